"""The tokenizer half of a Hugging Face → GGUF conversion.

Reads the tokenizer with the special tokens, BOS/EOS conventions and chat template from the
files beside it:

- ``tokenizer.json`` with a byte-level BPE, naming the llama.cpp pre-tokenizer that splits text
  the same way; or GPT-2's ``vocab.json`` and ``merges.txt``, where no ``tokenizer.json`` is;
- ``tokenizer.model``, a SentencePiece BPE. One that normalizes text (the trainer's default
  ``nmt_nfkc``) is converted with its rule recorded under ``edgeinfer.tokenizer.normalizer`` and
  ``edgeinfer.tokenizer.remove_extra_whitespaces``, which edgeinfer's tokenizer applies and other
  runtimes ignore;
- ``tokenizer.json`` with a SentencePiece BPE (byte fallback, ``▁`` for spaces: Llama 2, Mistral,
  Gemma) where no ``tokenizer.model`` is, as llama.cpp's SentencePiece tokenizer (``llama``);
- ``tokenizer.json`` with a Unigram model, as llama.cpp's Unigram tokenizer (``t5``).

Where llama.cpp cannot do what the Hugging Face tokenizer does, it says so instead of writing a
GGUF that would tokenize differently.
"""

from __future__ import annotations

import base64
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gguf import GGUFWriter, TokenType

from edgeinfer.errors import ConversionError
from edgeinfer.models.pretokenizers import GPT2_SPLIT, PRE_BY_NAME, PRE_TOKENIZERS
from edgeinfer.tokenizer import NORMALIZER_KEY, REMOVE_EXTRA_WHITESPACES_KEY

# llama.cpp spells the case-insensitive contractions group out, its regex engine lacks (?i:...).
_LLAMA_CPP_CONTRACTIONS = "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_HF_CONTRACTIONS = "(?i:'s|'t|'re|'ve|'m|'ll|'d)"


@dataclass
class Vocab:
    """A tokenizer as llama.cpp reads it from GGUF metadata.

    ``model`` is ``gpt2`` (byte-level BPE, with ``merges`` and the pre-tokenizer ``pre``),
    ``llama`` (SentencePiece BPE, with ``scores``) or ``t5`` (Unigram, with ``scores`` and the
    normalizer's ``precompiled_charsmap``). ``tokens`` has one entry per embedding row.
    ``normalizer`` is the SentencePiece normalization rule that edgeinfer's tokenizer applies
    before llama.cpp's (None: none). ``remove_extra_whitespaces``: whether leading, trailing and
    repeated whitespace is dropped first, by llama.cpp's Unigram tokenizer for ``t5``, else by
    edgeinfer's tokenizer with ``normalizer``.
    ``notes`` are one-line remarks for the user about differences that rarely matter.
    """

    model: str
    tokens: list[str]
    token_types: list[TokenType]
    scores: list[float] | None = None
    merges: list[str] = field(default_factory=list)
    pre: str | None = None
    bos_id: int | None = None
    eos_id: int | None = None
    eot_id: int | None = None
    unk_id: int | None = None
    pad_id: int | None = None
    add_bos: bool = False
    add_eos: bool = False
    add_space_prefix: bool | None = None
    precompiled_charsmap: bytes | None = None
    normalizer: str | None = None
    remove_extra_whitespaces: bool = False
    chat_template: str | list[dict[str, str]] | None = None
    notes: list[str] = field(default_factory=list)

    def add_to(self, writer: GGUFWriter) -> None:
        """Write every ``tokenizer.*`` key llama.cpp reads."""
        writer.add_tokenizer_model(self.model)
        if self.pre is not None:
            writer.add_tokenizer_pre(self.pre)
        writer.add_token_list(self.tokens)
        if self.scores is not None:
            writer.add_token_scores(self.scores)
        writer.add_token_types(self.token_types)
        if self.merges:
            writer.add_token_merges(self.merges)
        for token_id, add in (
            (self.bos_id, writer.add_bos_token_id),
            (self.eos_id, writer.add_eos_token_id),
            (self.eot_id, writer.add_eot_token_id),
            (self.unk_id, writer.add_unk_token_id),
            (self.pad_id, writer.add_pad_token_id),
        ):
            if token_id is not None:
                add(token_id)
        writer.add_add_bos_token(self.add_bos)
        writer.add_add_eos_token(self.add_eos)
        if self.add_space_prefix is not None:
            writer.add_add_space_prefix(self.add_space_prefix)
        if self.precompiled_charsmap:
            writer.add_precompiled_charsmap(self.precompiled_charsmap)
        if self.model == "t5" and self.remove_extra_whitespaces:
            writer.add_remove_extra_whitespaces(True)
        if self.normalizer is not None:
            writer.add_string(NORMALIZER_KEY, self.normalizer)
            writer.add_bool(REMOVE_EXTRA_WHITESPACES_KEY, self.remove_extra_whitespaces)
        if self.chat_template is not None:
            writer.add_chat_template(self.chat_template)


def read_vocab(hf_dir: Path, n_vocab: int, pre: str | None = None) -> Vocab:
    """The tokenizer of the Hugging Face checkpoint in ``hf_dir``, padded to ``n_vocab`` tokens
    (the embedding's rows) with unused placeholders.

    ``pre`` names the llama.cpp pre-tokenizer of a byte-level BPE tokenizer when it cannot be
    identified from ``tokenizer.json``. Raises ConversionError when the tokenizer is missing, is
    larger than ``n_vocab``, or does something llama.cpp cannot reproduce.
    """
    hf_dir = Path(hf_dir)
    try:
        return _read_vocab(hf_dir, n_vocab, pre)
    except ConversionError:
        raise
    except (KeyError, IndexError, TypeError, ValueError, AttributeError) as exc:  # a field missing or mistyped
        raise ConversionError(
            f"the tokenizer files in {hf_dir} are malformed ({type(exc).__name__}: {exc}); download them again"
        ) from None


def _read_vocab(hf_dir: Path, n_vocab: int, pre: str | None) -> Vocab:
    tokenizer_json = _read_json(hf_dir / "tokenizer.json")
    tokenizer_config = _read_json(hf_dir / "tokenizer_config.json") or {}
    if pre is not None and pre not in PRE_BY_NAME:
        raise ConversionError(f"unknown pre-tokenizer {pre!r}; choose one of {', '.join(PRE_BY_NAME)}")

    has_model = (hf_dir / "tokenizer.model").is_file()
    model_type = (tokenizer_json or {}).get("model", {}).get("type")
    if tokenizer_json is not None and _is_byte_level_bpe(tokenizer_json):
        vocab = _byte_level_bpe(tokenizer_json, tokenizer_config, pre, n_vocab)
    elif tokenizer_json is None and (hf_dir / "vocab.json").is_file() and (hf_dir / "merges.txt").is_file():
        tokenizer_json = _gpt2_files(hf_dir, tokenizer_config)
        vocab = _byte_level_bpe(tokenizer_json, tokenizer_config, pre or _pre_of_class(tokenizer_config), n_vocab)
    elif tokenizer_json is None and not has_model:
        raise ConversionError(
            f"no tokenizer in {hf_dir}: looked for tokenizer.json, tokenizer.model (SentencePiece) and "
            "vocab.json with merges.txt (GPT-2); copy them from the model's repository"
        )
    elif pre is not None:
        raise ConversionError("--pre-tokenizer applies to byte-level BPE tokenizers; this one is not, leave it out")
    elif has_model and model_type != "Unigram":
        vocab = _sentencepiece(hf_dir, tokenizer_json, tokenizer_config, n_vocab)
    elif model_type == "Unigram":
        vocab = _unigram_json(tokenizer_json, tokenizer_config, n_vocab)
    else:
        vocab = _sentencepiece_bpe_json(tokenizer_json, tokenizer_config, n_vocab)

    _set_special_tokens(vocab, hf_dir, tokenizer_json, tokenizer_config)
    vocab.chat_template = _chat_template(hf_dir, tokenizer_config)
    return vocab


# --- byte-level BPE (tokenizer.json) -----------------------------------------------------------


def _is_byte_level_bpe(tokenizer_json: Mapping[str, Any]) -> bool:
    model = tokenizer_json.get("model") or {}
    decoder = tokenizer_json.get("decoder") or {}
    byte_level = any(
        s.get("type") == "ByteLevel" for s in _flatten(tokenizer_json.get("pre_tokenizer"), "pretokenizers")
    )
    return (
        model.get("type") == "BPE"
        and not model.get("byte_fallback")
        and (byte_level or decoder.get("type") == "ByteLevel")
    )


def _byte_level_bpe(
    tokenizer_json: Mapping[str, Any], tokenizer_config: Mapping[str, Any], pre: str | None, n_vocab: int
) -> Vocab:
    model = tokenizer_json["model"]
    notes = _check_normalizer(tokenizer_json.get("normalizer"))
    name = pre or _identify_pre_tokenizer(tokenizer_json, tokenizer_config)
    pieces = _pieces_by_id(model["vocab"])
    vocab = Vocab(model="gpt2", tokens=[], token_types=[TokenType.NORMAL] * len(pieces), pre=name, notes=notes)
    # Byte-level tokens never hold a space (GPT-2's alphabet maps it to Ġ), so a space separates a pair.
    vocab.merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    vocab.tokens = _token_list(vocab, pieces, _added_tokens(tokenizer_json, tokenizer_config, None), n_vocab)
    return vocab


def _identify_pre_tokenizer(tokenizer_json: Mapping[str, Any], tokenizer_config: Mapping[str, Any]) -> str:
    """The llama.cpp pre-tokenizer that splits with the same regexes, in the same order."""
    pre_tokenizer = tokenizer_json.get("pre_tokenizer")
    splits = _splits(pre_tokenizer)
    same_splits = [p for p in PRE_TOKENIZERS if p.splits == splits]
    if not same_splits:
        raise ConversionError(
            f"tokenizer.json's pre-tokenizer {_describe(pre_tokenizer)} is not one llama.cpp implements; if you know "
            f"a llama.cpp pre-tokenizer that splits text the same way, pass --pre-tokenizer NAME "
            f"(one of {', '.join(PRE_BY_NAME)})"
        )
    ignore_merges = bool(tokenizer_json["model"].get("ignore_merges", False))
    candidates = [p for p in same_splits if p.ignore_merges == ignore_merges]
    if not candidates:
        other = same_splits[0]
        raise ConversionError(
            f"tokenizer.json splits text like llama.cpp's {other.name!r} pre-tokenizer, but its BPE model has "
            f"ignore_merges={str(ignore_merges).lower()} and {other.name!r} "
            f"{'does not ignore' if ignore_merges else 'ignores'} merges, so some words would tokenize "
            f"differently; pass --pre-tokenizer {other.name} to convert anyway"
        )
    clean = tokenizer_config.get("clean_up_tokenization_spaces")
    if isinstance(clean, bool):
        candidates.sort(key=lambda p: p.clean_spaces != clean)  # stable: keeps the table's order otherwise
    return candidates[0].name


def _splits(pre_tokenizer: Mapping[str, Any] | None) -> tuple[str, ...] | None:
    """The regexes a Hugging Face pre-tokenizer splits with, or None if it does more than split by
    regex and then map bytes (ByteLevel last), which is all llama.cpp's BPE pre-tokenizers do."""
    steps = _flatten(pre_tokenizer, "pretokenizers")
    if not steps or steps[-1].get("type") != "ByteLevel" or steps[-1].get("add_prefix_space"):
        return None
    splits = []
    for step in steps[:-1]:
        kind = step.get("type")
        if (
            kind == "Split"
            and "Regex" in step.get("pattern", {})
            and step.get("behavior") == "Isolated"
            and not step.get("invert")
        ):
            splits.append(_canonical_regex(step["pattern"]["Regex"]))
        elif kind == "Digits":
            splits.append(r"\p{N}" if step.get("individual_digits") else r"\p{N}+")
        else:
            return None
    if steps[-1].get("use_regex", True):
        splits.append(GPT2_SPLIT)
    return tuple(splits)


def _canonical_regex(regex: str) -> str:
    """One spelling for regexes that mean the same: escapes for line breaks, HF's contractions group."""
    regex = regex.replace("\r", r"\r").replace("\n", r"\n").replace("\t", r"\t")
    return regex.replace(_LLAMA_CPP_CONTRACTIONS, _HF_CONTRACTIONS)


def _describe(component: Mapping[str, Any] | None) -> str:
    """A pre-tokenizer or normalizer as one line, e.g. Sequence[Digits(individual_digits=True), ...]."""
    if component is None:
        return "None"
    kind = component.get("type", "?")
    children = component.get("pretokenizers") or component.get("normalizers")
    if kind == "Sequence" and children is not None:
        return f"Sequence[{', '.join(_describe(c) for c in children)}]"
    args = {key: value for key, value in component.items() if key not in ("type", "trim_offsets")}
    if isinstance(args.get("pattern"), dict) and "Regex" in args["pattern"]:
        args["pattern"] = args["pattern"]["Regex"]
    return f"{kind}({', '.join(f'{key}={json.dumps(value, ensure_ascii=False)}' for key, value in args.items())})"


def _check_normalizer(normalizer: Mapping[str, Any] | None) -> list[str]:
    """Refuse normalizers llama.cpp does not apply; NFC is the exception, noted (see below)."""
    steps = _flatten(normalizer, "normalizers")
    if all(step.get("type") == "NFC" for step in steps):
        # Qwen2's tokenizer composes characters first; llama.cpp's converter accepts it, as text is
        # almost always NFC already (only decomposed accents such as "e" + U+0301 tokenize differently).
        note = "tokenizer.json normalizes text to NFC and llama.cpp does not: text not in NFC may tokenize differently"
        return [note] if steps else []
    raise ConversionError(
        f"tokenizer.json normalizes text with {_describe(normalizer)}, which llama.cpp's byte-level BPE cannot "
        "apply; this tokenizer cannot be converted faithfully"
    )


# --- GPT-2's vocab.json and merges.txt ---------------------------------------------------------

# The pre-tokenizer transformers gives each tokenizer class that reads vocab.json and merges.txt.
_PRE_OF_CLASS = {"GPT2Tokenizer": "gpt-2", "Qwen2Tokenizer": "qwen2"}


def _tokenizer_class(tokenizer_config: Mapping[str, Any]) -> str:
    """The transformers tokenizer class tokenizer_config.json names, without "Fast"; "" if none."""
    return str(tokenizer_config.get("tokenizer_class") or "").removesuffix("Fast")


def _pre_of_class(tokenizer_config: Mapping[str, Any]) -> str:
    name = _tokenizer_class(tokenizer_config)
    if name not in _PRE_OF_CLASS:
        raise ConversionError(
            f"vocab.json and merges.txt belong to tokenizer class {name or '(none in tokenizer_config.json)'}, "
            f"whose pre-tokenizer edgeinfer does not know; if you know a llama.cpp pre-tokenizer that splits text "
            f"the same way, pass --pre-tokenizer NAME (one of {', '.join(PRE_BY_NAME)})"
        )
    return _PRE_OF_CLASS[name]


def _gpt2_files(hf_dir: Path, tokenizer_config: Mapping[str, Any]) -> dict[str, Any]:
    """The tokenizer.json transformers builds from vocab.json and merges.txt: their BPE, the special
    tokens tokenizer_config.json names and added_tokens.json's tokens as added tokens, and Qwen2's
    NFC normalizer."""
    if tokenizer_config.get("add_prefix_space"):
        raise ConversionError(
            "tokenizer_config.json sets add_prefix_space (a space before every text), which llama.cpp's "
            "byte-level BPE does not add; this tokenizer cannot be converted faithfully"
        )
    vocab = _read_json(hf_dir / "vocab.json")
    lines = (hf_dir / "merges.txt").read_text(encoding="utf-8").splitlines()
    merges = [line for n, line in enumerate(lines) if line and not (n == 0 and line.startswith("#version"))]
    for merge in merges:
        if merge.count(" ") != 1:
            raise ConversionError(f"merges.txt has {merge!r}, not a pair 'A B'; download it again")
    named = [tokenizer_config.get(f"{kind}_token") for kind in ("bos", "eos", "unk", "pad")]
    named += tokenizer_config.get("additional_special_tokens") or []
    texts = {entry.get("content") if isinstance(entry, dict) else entry for entry in named}
    added = [{"id": vocab[text], "content": text, "special": True} for text in texts if text in vocab]
    added += [
        {"id": token_id, "content": text, "special": False}
        for text, token_id in (_read_json(hf_dir / "added_tokens.json") or {}).items()
    ]
    return {
        "model": {"type": "BPE", "vocab": vocab, "merges": merges},
        "added_tokens": added,
        "normalizer": {"type": "NFC"} if _tokenizer_class(tokenizer_config) == "Qwen2Tokenizer" else None,
    }


# --- SentencePiece in tokenizer.json -----------------------------------------------------------

_BYTE_PIECE = re.compile(r"<0x[0-9A-F]{2}>")
_SPACE = "\u2581"  # ▁, SentencePiece's mark for a space


@dataclass(frozen=True)
class _Whitespace:
    """How a SentencePiece-style tokenizer.json marks spaces, as llama.cpp's keys say it."""

    add_space_prefix: bool
    charsmap: bytes | None  # a Precompiled normalizer's table (Unigram only)
    fold: bool  # leading, trailing and repeated spaces dropped (Unigram only)
    split: bool  # Metaspace splits the text into words at each ▁
    first_only: bool  # Metaspace puts a ▁ before the text, but not after a special token
    notes: list[str]


# How transformers' SpmConverter writes SentencePiece's remove_extra_whitespaces for a Unigram.
_FOLDING = [
    {"type": "Strip", "strip_left": False, "strip_right": True},
    {"type": "Replace", "pattern": {"Regex": " {2,}"}, "content": _SPACE},
]


def _sentencepiece_whitespace(tokenizer_json: Mapping[str, Any], *, unigram: bool) -> _Whitespace:
    """Accepts what llama.cpp's SentencePiece and Unigram tokenizers do: each space made ▁, one ▁
    before the text or none; for a Unigram also a precompiled normalizer and whitespace folding,
    which llama.cpp's Unigram tokenizer applies too.

    transformers writes that as a Prepend and Replace normalizer (Llama 2; Gemma's, without Prepend,
    is followed by a split at spaces, which there are none left of) or as a Metaspace pre-tokenizer
    (Mistral; Unigrams, after Precompiled, Strip and Replace normalizers); anything else is refused.
    """
    normalizer, pre_tokenizer = tokenizer_json.get("normalizer"), tokenizer_json.get("pre_tokenizer")
    steps, pre_steps = _flatten(normalizer, "normalizers"), _flatten(pre_tokenizer, "pretokenizers")
    charsmap = None
    if unigram and steps and steps[0].get("type") == "Precompiled":
        charsmap = base64.b64decode(steps[0].get("precompiled_charsmap") or "") or None
        steps = steps[1:]
    if all(step.get("type") == "Split" and step.get("pattern") == {"String": " "} for step in pre_steps):
        prepend = steps[:1] == [{"type": "Prepend", "prepend": _SPACE}]
        if steps[int(prepend) :] == [{"type": "Replace", "pattern": {"String": " "}, "content": _SPACE}]:
            return _Whitespace(prepend, charsmap, fold=False, split=False, first_only=False, notes=[])
    elif len(pre_steps) == 1 and pre_steps[0].get("type") == "Metaspace":
        metaspace = pre_steps[0]
        scheme = metaspace.get("prepend_scheme") or ("always" if metaspace.get("add_prefix_space", True) else "never")
        fold = unigram and steps == _FOLDING
        if (not steps or fold) and metaspace.get("replacement") == _SPACE and scheme in ("always", "first", "never"):
            notes = []
            if scheme != "never" and not fold:  # folded, a leading space is dropped by both
                notes.append(
                    "tokenizer.json's Metaspace puts no ▁ before text that starts with a space and llama.cpp does: "
                    "such text may tokenize differently"
                )
            if fold and scheme == "never":
                notes.append(
                    "tokenizer.json puts no ▁ before the text and llama.cpp's Unigram tokenizer, folding whitespace, "
                    "does: the first word may tokenize differently"
                )
            split = bool(metaspace.get("split", True))
            return _Whitespace(scheme != "never", charsmap, fold, split, first_only=scheme == "first", notes=notes)
    raise ConversionError(
        f"tokenizer.json normalizes text with {_describe(normalizer)} and pre-tokenizes it with "
        f"{_describe(pre_tokenizer)}; llama.cpp only makes each space ▁ (with one before the text, or none)"
        f"{', after a precompiled normalizer and folding whitespace as SentencePiece does' if unigram else ''}, "
        "so this tokenizer cannot be converted faithfully"
    )


def _check_words_unsplit(whitespace: _Whitespace, normal: set[str]) -> None:
    """Metaspace's split tokenizes each word on its own, llama.cpp the whole text: the same only
    while no normal token holds a ▁ that does not start it."""
    if not whitespace.split:
        return
    inside = next((p for p in sorted(normal) if _SPACE in p[1:]), None)
    if inside is not None:
        raise ConversionError(
            f"tokenizer.json's Metaspace splits the text into words at each ▁ (split=true), but the token "
            f"{inside!r} holds a ▁ after its start; llama.cpp does not split, so this tokenizer cannot be "
            "converted faithfully"
        )


def _sentencepiece_bpe_json(
    tokenizer_json: Mapping[str, Any], tokenizer_config: Mapping[str, Any], n_vocab: int
) -> Vocab:
    """A SentencePiece BPE as transformers writes it to tokenizer.json.

    llama.cpp's SentencePiece tokenizer merges, of all adjacent pairs that spell a token, the one
    whose token scores highest; Hugging Face's BPE applies the lowest-ranked merge. A token scores
    minus the rank of its first merge, so the two agree when the merges are SentencePiece's, as
    transformers writes them: every split of a token into two tokens is a merge, and a token's
    merges are consecutive. Merges that are not (a BPE trained by Hugging Face's trainer) are refused;
    a token's merges scattered among others' are noted.
    """
    model = tokenizer_json["model"]
    if model.get("type") != "BPE" or not model.get("byte_fallback"):
        raise ConversionError(
            f"tokenizer.json holds a {model.get('type', 'unknown')} model that is neither a byte-level BPE, a "
            "SentencePiece-style BPE (byte fallback) nor a Unigram, which are what llama.cpp tokenizes like "
            "Hugging Face; this tokenizer cannot be converted"
        )
    pieces = _pieces_by_id(model["vocab"])
    whitespace = _sentencepiece_whitespace(tokenizer_json, unigram=False)
    unk = model.get("unk_token")
    types = [
        TokenType.BYTE if p and _BYTE_PIECE.fullmatch(p) else TokenType.UNKNOWN if p == unk else TokenType.NORMAL
        for p in pieces
    ]
    # llama.cpp falls back to <0xXX>, or to the byte itself (Gemma has "\t" where <0x09> was).
    known = set(pieces)
    missing = [b for b in range(256) if f"<0x{b:02X}>" not in known and not (b < 0x80 and chr(b) in known)]
    if missing:
        raise ConversionError(
            f"tokenizer.json falls back to bytes but lacks {len(missing)} of the byte tokens <0x00>..<0xFF> "
            f"(<0x{missing[0]:02X}> first), which llama.cpp's SentencePiece tokenizer needs; fix the tokenizer files"
        )
    added = _added_tokens(tokenizer_json, tokenizer_config, None)
    normal = _normal_pieces(pieces, types, added)
    _check_words_unsplit(whitespace, normal)
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in model.get("merges", [])]
    first_rank, notes = _check_sentencepiece_merges(pieces, normal, merges)
    vocab = Vocab(
        model="llama",
        tokens=[],
        token_types=types,
        scores=[-float(first_rank[p]) if p in first_rank else 0.0 for p in pieces],
        add_space_prefix=whitespace.add_space_prefix,
        notes=whitespace.notes + notes,
    )
    vocab.tokens = _token_list(vocab, pieces, added, n_vocab)
    if whitespace.add_space_prefix:
        vocab.notes += _space_after_special(added, tokenizer_config, whitespace.first_only)
    return vocab


def _check_sentencepiece_merges(
    pieces: Sequence[str | None], normal: set[str], merges: Sequence[tuple[str, ...]]
) -> tuple[dict[str, int], list[str]]:
    """The rank of each token's first merge, after checking that the merges are SentencePiece's
    (see _sentencepiece_bpe_json), and a note where a token's merges are not consecutive (pieces of
    equal score, which transformers may interleave); only merges into ``normal`` tokens count."""
    known = {p for p in pieces if p is not None}
    first_rank: dict[str, int] = {}
    scattered = None
    made = None
    for rank, (left, right) in enumerate(merges):
        token = left + right
        if token not in normal or token == made:
            continue
        if token in first_rank:
            scattered = scattered or token
        else:
            first_rank[token] = rank
        made = token
    merge_set = set(merges)
    for token in sorted(normal):
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            # llama.cpp merges two symbols, each a token or a single character, whenever they spell a token.
            symbols = (left in known or cut == 1) and (right in known or cut == len(token) - 1)
            if symbols and (left, right) not in merge_set:
                raise ConversionError(
                    f"tokenizer.json's BPE has no merge {left!r} + {right!r} though they spell the token "
                    f"{token!r}; llama.cpp's SentencePiece tokenizer merges any two pieces that spell a token "
                    "and would tokenize differently, so convert from the checkpoint's tokenizer.model"
                )
    if scattered is None:
        return first_rank, []
    note = (
        f"tokenizer.json's merges that make {scattered!r} (and maybe others) are not consecutive and llama.cpp ranks "
        "a merge by the token it makes: words where they compete may tokenize differently"
    )
    return first_rank, [note]


def _unigram_json(tokenizer_json: Mapping[str, Any], tokenizer_config: Mapping[str, Any], n_vocab: int) -> Vocab:
    """A Unigram tokenizer.json as llama.cpp's Unigram tokenizer (T5's): the same Viterbi search over
    the pieces' scores, an unknown token for characters without a piece, a precompiled normalizer."""
    model = tokenizer_json["model"]
    if model.get("byte_fallback"):
        raise ConversionError(
            "tokenizer.json's Unigram falls back to bytes for unknown characters and llama.cpp's Unigram tokenizer "
            "puts its unknown token there; this tokenizer cannot be converted faithfully"
        )
    unk_id = model.get("unk_id")
    if not isinstance(unk_id, int):
        raise ConversionError(
            "tokenizer.json's Unigram has no unknown token (unk_id), which llama.cpp's Unigram tokenizer gives "
            "characters no piece spells; set unk_id in tokenizer.json"
        )
    pieces: list[str | None] = [str(piece) for piece, _ in model["vocab"]]
    whitespace = _sentencepiece_whitespace(tokenizer_json, unigram=True)
    types = [TokenType.UNKNOWN if i == unk_id else TokenType.NORMAL for i in range(len(pieces))]
    added = _added_tokens(tokenizer_json, tokenizer_config, None)
    _check_words_unsplit(whitespace, _normal_pieces(pieces, types, added))
    vocab = Vocab(
        model="t5",
        tokens=[],
        token_types=types,
        scores=[float(score) for _, score in model["vocab"]],
        add_space_prefix=whitespace.add_space_prefix,
        precompiled_charsmap=whitespace.charsmap,
        remove_extra_whitespaces=whitespace.fold,
        unk_id=unk_id,
        notes=list(whitespace.notes),
    )
    vocab.tokens = _token_list(vocab, pieces, added, n_vocab)
    if whitespace.add_space_prefix:
        vocab.notes += _space_after_special(added, tokenizer_config, whitespace.first_only)
    return vocab


def _normal_pieces(pieces: Sequence[str | None], types: Sequence[TokenType], added: Sequence[_AddedToken]) -> set[str]:
    """The pieces the model itself tokenizes text into: not bytes, unknown or added tokens."""
    added_ids = {token.id for token in added}
    return {p for i, p in enumerate(pieces) if p and types[i] == TokenType.NORMAL and i not in added_ids}


def _pieces_by_id(vocab: Mapping[str, int]) -> list[str | None]:
    """A tokenizer.json BPE vocabulary as a list by id; None where no token has the id."""
    pieces: list[str | None] = [None] * (max(vocab.values(), default=-1) + 1)
    for text, token_id in vocab.items():
        pieces[token_id] = text
    return pieces


def _space_after_special(
    added: Sequence[_AddedToken], tokenizer_config: Mapping[str, Any], first_only: bool
) -> list[str]:
    """A note where transformers puts no ▁ after a special token (legacy=False, or Metaspace's
    prepend_scheme "first") and llama.cpp's SentencePiece-style tokenizers do."""
    if any(token.special for token in added) and (tokenizer_config.get("legacy") is False or first_only):
        return [
            "transformers (legacy=False) puts no ▁ before the text after a special token and llama.cpp does: "
            "text right after a special token may tokenize differently"
        ]
    return []


# --- SentencePiece (tokenizer.model) ----------------------------------------------------------


def _sentencepiece(
    hf_dir: Path, tokenizer_json: Mapping[str, Any] | None, tokenizer_config: Mapping[str, Any], n_vocab: int
) -> Vocab:
    spm_model = _sentencepiece_model_format()
    proto = spm_model.ModelProto()
    try:
        proto.ParseFromString((hf_dir / "tokenizer.model").read_bytes())
    except Exception:  # protobuf's DecodeError; a file that parses into nothing is caught below too
        proto.Clear()
    if not proto.pieces:
        raise ConversionError(f"{hf_dir / 'tokenizer.model'} is not a SentencePiece model; download it again")
    trainer, normalizer = proto.trainer_spec, proto.normalizer_spec
    rule = normalizer.name or "identity"
    # llama.cpp's SentencePiece tokenizer merges by score (BPE), escapes spaces as ▁ and falls back to
    # <0xXX> byte pieces; the normalization before it, if any, is edgeinfer's tokenizer's (see Vocab).
    problem = None
    if trainer.model_type != spm_model.TrainerSpec.BPE:
        problem = f"is a {spm_model.TrainerSpec.ModelType.Name(trainer.model_type).lower()} model, not BPE"
    elif not trainer.byte_fallback:
        problem = "has no byte fallback (the <0x00>..<0xFF> pieces)"
    elif not normalizer.escape_whitespaces or trainer.treat_whitespace_as_suffix:
        problem = "does not mark word starts with ▁"
    if problem:
        raise ConversionError(f"tokenizer.model {problem}, which llama.cpp's SentencePiece tokenizer cannot reproduce")
    if rule not in _SENTENCEPIECE_RULES or (rule == "identity" and normalizer.precompiled_charsmap):
        raise ConversionError(
            f"tokenizer.model normalizes text with the rule {rule!r}; edgeinfer applies nmt_nfkc (SentencePiece's "
            "default) or none, so this tokenizer cannot be converted faithfully"
        )

    piece_type = spm_model.ModelProto.SentencePiece.Type
    vocab = Vocab(
        model="llama",
        tokens=[],
        token_types=[TokenType[piece_type.Name(p.type)] for p in proto.pieces],
        scores=[p.score for p in proto.pieces],
        add_space_prefix=normalizer.add_dummy_prefix,
        # LlamaTokenizer's defaults; tokenizer_config.json may say otherwise.
        add_bos=True,
    )
    vocab.bos_id, vocab.eos_id, vocab.unk_id, vocab.pad_id = (
        i if i >= 0 else None for i in (trainer.bos_id, trainer.eos_id, trainer.unk_id, trainer.pad_id)
    )
    added = _added_tokens(tokenizer_json, tokenizer_config, _read_json(hf_dir / "added_tokens.json"))
    vocab.tokens = _token_list(vocab, [p.piece for p in proto.pieces], added, n_vocab)
    pre_steps = _flatten((tokenizer_json or {}).get("pre_tokenizer"), "pretokenizers")
    first_only = any(step.get("prepend_scheme") == "first" for step in pre_steps)
    vocab.notes += _space_after_special(added, tokenizer_config, first_only)
    if rule != "identity" or normalizer.remove_extra_whitespaces:
        vocab.normalizer, vocab.remove_extra_whitespaces = rule, normalizer.remove_extra_whitespaces
        vocab.notes += _normalizer_notes(spm_model, rule, normalizer)
    return vocab


# The SentencePiece normalization rules edgeinfer's tokenizer applies: none, and the trainer's default.
_SENTENCEPIECE_RULES = ("identity", "nmt_nfkc")


def _normalizer_notes(spm_model: Any, rule: str, normalizer: Any) -> list[str]:
    """What the user should know of a SentencePiece normalizer (``rule``, and ``normalizer``'s
    whitespace folding) that only edgeinfer applies."""
    done = ["nmt_nfkc: NFKC, line breaks and tabs made spaces"] if rule == "nmt_nfkc" else []
    done += ["whitespace folded"] if normalizer.remove_extra_whitespaces else []
    notes = [
        f"tokenizer.model normalizes text before tokenizing ({'; '.join(done)}); edgeinfer applies that, as "
        f"recorded under {NORMALIZER_KEY}, but llama.cpp, Ollama and other runtimes ignore the key and tokenize "
        "text it changes differently"
    ]
    if rule != "identity":
        import sentencepiece

        builtin = spm_model.ModelProto()
        builtin.ParseFromString(sentencepiece.SentencePieceNormalizer(rule_name=rule).serialized_model_proto())
        if builtin.normalizer_spec.precompiled_charsmap != normalizer.precompiled_charsmap:
            notes.append(
                f"tokenizer.model's {rule} table differs from the one sentencepiece "
                f"{sentencepiece.__version__} applies: some rare characters may normalize differently"
            )
    return notes


def _sentencepiece_model_format() -> Any:
    """sentencepiece's protobuf module for tokenizer.model, imported only when one is converted."""
    try:
        from sentencepiece import sentencepiece_model_pb2
    except Exception as exc:  # ImportError, or protobuf's VersionError: older than sentencepiece's generated code
        raise ConversionError(
            f"reading tokenizer.model needs sentencepiece and a protobuf as new as it was built with ({exc}); "
            "run: pip install -U sentencepiece protobuf"
        ) from None
    return sentencepiece_model_pb2


# --- added and special tokens, chat template ---------------------------------------------------


@dataclass(frozen=True)
class _AddedToken:
    id: int
    content: str
    special: bool


def _added_tokens(
    tokenizer_json: Mapping[str, Any] | None,
    tokenizer_config: Mapping[str, Any],
    added_tokens_file: Mapping[str, int] | None,
) -> list[_AddedToken]:
    """Tokens added to the base vocabulary, from every file transformers reads them from."""
    by_id: dict[int, _AddedToken] = {}
    for entry in (tokenizer_json or {}).get("added_tokens", []):
        by_id.setdefault(entry["id"], _AddedToken(entry["id"], entry["content"], bool(entry.get("special"))))
    for key, entry in (tokenizer_config.get("added_tokens_decoder") or {}).items():
        by_id.setdefault(int(key), _AddedToken(int(key), entry["content"], bool(entry.get("special"))))
    for content, token_id in (added_tokens_file or {}).items():
        by_id.setdefault(token_id, _AddedToken(token_id, content, False))
    return sorted(by_id.values(), key=lambda t: t.id)


_PLACEHOLDER_SCORE = -1e9


def _token_list(vocab: Vocab, pieces: list[str | None], added: list[_AddedToken], n_vocab: int) -> list[str]:
    """``n_vocab`` tokens: the base vocabulary ``pieces``, the added tokens at their ids, and an unused
    placeholder at every other id. Brings ``vocab``'s types and scores to the same length.

    Added tokens are control tokens if special, else user-defined (which llama.cpp, like
    transformers, matches in any text).
    """
    tokens = list(pieces)
    for token in added:
        if token.id < 0:
            raise ConversionError(f"added token {token.content!r} has id {token.id}; fix the tokenizer files")
        tokens.extend([None] * (token.id + 1 - len(tokens)))
        tokens[token.id] = token.content
    if len(tokens) > n_vocab:
        raise ConversionError(
            f"the tokenizer has {len(tokens)} tokens but the model's embedding has only {n_vocab} rows; "
            "the tokenizer files belong to a different checkpoint"
        )
    # transformers encodes an added token's text as the added id; a base entry with the same text is unreachable.
    added_ids = {token.content: token.id for token in added}
    tokens = [None if text in added_ids and added_ids[text] != i else text for i, text in enumerate(tokens)]
    tokens += [None] * (n_vocab - len(tokens))

    types = vocab.token_types + [TokenType.UNUSED] * (n_vocab - len(vocab.token_types))
    for token in added:
        # Keep what SentencePiece already says of its own pieces, e.g. <unk> (unknown) or <s> (control).
        if types[token.id] == TokenType.NORMAL or token.id >= len(pieces) or pieces[token.id] != token.content:
            types[token.id] = TokenType.CONTROL if token.special else TokenType.USER_DEFINED
    taken = set(tokens)
    for i, text in enumerate(tokens):
        if text is None:
            name = f"[PAD{i}]"
            while name in taken:  # llama.cpp refuses a vocabulary with a token twice
                name = f"[{name}]"
            tokens[i] = name
            types[i] = TokenType.UNUSED
    vocab.token_types = types
    if vocab.scores is not None:
        # Tokens that are not SentencePiece pieces must never win a merge (real pieces score down to about -n_vocab).
        vocab.scores = [
            score if i < len(pieces) and tokens[i] == pieces[i] else _PLACEHOLDER_SCORE
            for i, score in enumerate(vocab.scores + [0.0] * (n_vocab - len(vocab.scores)))
        ]
    return tokens  # type: ignore[return-value]  # every None has a placeholder now


def _set_special_tokens(
    vocab: Vocab, hf_dir: Path, tokenizer_json: Mapping[str, Any] | None, tokenizer_config: Mapping[str, Any]
) -> None:
    """BOS, EOS, EOT, UNK and PAD ids, and whether BOS/EOS are added to every text.

    tokenizer_config.json names them by text and wins; generation_config.json, then config.json,
    give ids where it is silent. generation_config's extra end-of-sequence ids (chat models stop at
    several) make the first one that is not EOS the end-of-turn token, so llama.cpp stops there too.
    """
    ids = {text: i for i, text in enumerate(vocab.tokens) if vocab.token_types[i] != TokenType.UNUSED}
    id_sources = (
        ("generation_config.json", _read_json(hf_dir / "generation_config.json") or {}),
        ("config.json", _read_json(hf_dir / "config.json") or {}),
    )

    def named(kind: str) -> int | None:
        entry = tokenizer_config.get(f"{kind}_token")
        text = entry.get("content") if isinstance(entry, dict) else entry
        if not isinstance(text, str):
            return None
        if text not in ids:
            raise ConversionError(
                f"tokenizer_config.json names {kind}_token {text!r}, which is not in the vocabulary; "
                "fix tokenizer_config.json"
            )
        return ids[text]

    def listed(kind: str) -> list[int]:
        for source, values in id_sources:
            value = values.get(f"{kind}_token_id")
            token_ids = [i for i in (value if isinstance(value, list) else [value]) if isinstance(i, int)]
            if not token_ids:
                continue  # absent or null
            for i in token_ids:
                if not 0 <= i < len(vocab.tokens):
                    raise ConversionError(
                        f"{source} gives {kind}_token_id {i}, outside the vocabulary of {len(vocab.tokens)} "
                        f"tokens; fix {source}"
                    )
            return token_ids
        return []

    eos_ids = listed("eos")
    vocab.bos_id = _first(named("bos"), *listed("bos"), vocab.bos_id)
    vocab.eos_id = _first(named("eos"), *eos_ids, vocab.eos_id)
    vocab.eot_id = _first(*(i for i in eos_ids if i != vocab.eos_id))
    vocab.pad_id = _first(named("pad"), *listed("pad"), vocab.pad_id)
    unk_text = (tokenizer_json or {}).get("model", {}).get("unk_token")
    vocab.unk_id = _first(named("unk"), ids.get(unk_text) if isinstance(unk_text, str) else None, vocab.unk_id)
    _set_add_bos_eos(vocab, ids, tokenizer_json, tokenizer_config)


def _set_add_bos_eos(
    vocab: Vocab, ids: Mapping[str, int], tokenizer_json: Mapping[str, Any] | None, tokenizer_config: Mapping[str, Any]
) -> None:
    """Whether every text gets BOS/EOS: what tokenizer.json's post-processor adds, unless
    tokenizer_config.json's add_bos_token / add_eos_token say otherwise (as transformers does)."""
    for processor in _flatten((tokenizer_json or {}).get("post_processor"), "processors"):
        if processor.get("type") != "TemplateProcessing":
            continue
        single = processor.get("single", [])
        first = single[0].get("SpecialToken", {}).get("id") if single else None
        last = single[-1].get("SpecialToken", {}).get("id") if len(single) > 1 else None
        vocab.add_bos, vocab.add_eos = first is not None, last is not None
        if first is not None:
            vocab.bos_id = ids.get(first)  # what transformers prepends, whatever bos_token says
        if last is not None and ids.get(last) != vocab.eos_id:
            raise ConversionError(
                f"tokenizer.json appends {last!r} to every text but the end-of-sequence token is another; "
                "llama.cpp can only append its EOS token"
            )
    add_bos, add_eos = tokenizer_config.get("add_bos_token"), tokenizer_config.get("add_eos_token")
    vocab.add_bos = add_bos if isinstance(add_bos, bool) else vocab.add_bos
    vocab.add_eos = add_eos if isinstance(add_eos, bool) else vocab.add_eos
    for kind, adds, token_id in (("BOS", vocab.add_bos, vocab.bos_id), ("EOS", vocab.add_eos, vocab.eos_id)):
        if adds and token_id is None:
            raise ConversionError(
                f"the tokenizer adds a {kind} token to every text but none is in its vocabulary; "
                f"set {kind.lower()}_token in tokenizer_config.json"
            )


def _first(*candidates: int | None) -> int | None:
    return next((c for c in candidates if c is not None), None)


def _chat_template(hf_dir: Path, tokenizer_config: Mapping[str, Any]) -> str | list[dict[str, str]] | None:
    """The chat template: chat_template.jinja (where transformers 5 writes it), else
    tokenizer_config.json's (a string, or named templates of which llama.cpp uses "default")."""
    jinja = hf_dir / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    template = tokenizer_config.get("chat_template")
    if template is None:
        template = (_read_json(hf_dir / "chat_template.json") or {}).get("chat_template")
    if template is None or isinstance(template, str):
        return template
    if isinstance(template, list) and all(isinstance(t, dict) and {"name", "template"} <= t.keys() for t in template):
        return [{"name": t["name"], "template": t["template"]} for t in template]
    raise ConversionError("tokenizer_config.json's chat_template is neither a string nor a list of named templates")


# --- helpers -----------------------------------------------------------------------------------


def _read_json(path: Path) -> Any:
    """A JSON file's content, None if the file does not exist."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConversionError(f"{path} is not valid JSON ({exc}); download it again") from None


def _flatten(component: Mapping[str, Any] | None, children: str) -> list[Mapping[str, Any]]:
    """The steps of a (possibly nested) Sequence pre-tokenizer, normalizer or post-processor."""
    if not component:
        return []
    if component.get("type") == "Sequence" and isinstance(component.get(children), Sequence):
        return [step for child in component[children] for step in _flatten(child, children)]
    return [component]
