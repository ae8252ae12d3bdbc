"""A GGUF's vocabulary, tokenized as llama.cpp tokenizes it, by Hugging Face ``tokenizers`` instead of llama.cpp.

For backends that run without llama.cpp (ONNX Runtime, OpenCL, the reference): ``edgeinfer.tokenizer`` uses
this where llama-cpp-python is not installed, and for a byte-level BPE vocabulary, which it rebuilds faster
than llama.cpp loads, on such a backend even where it is. It rebuilds llama.cpp's two common tokenizers from the
GGUF's own keys:

- ``gpt2``: byte-level BPE over the file's merges, after the regex splits its ``tokenizer.ggml.pre``
  names (``models/pretokenizers.py``, the table the converter names them by);
- ``llama``: SentencePiece BPE, ``▁`` for spaces (one before the text and after each special token,
  unless ``tokenizer.ggml.add_space_prefix`` is false), bytes for what the vocabulary lacks. llama.cpp
  merges the adjacent pair whose result scores highest; the merges here are every split of every
  token into two tokens, ranked by that token's score.

Special tokens (control and unknown ones) are matched in the text only when asked to; user-defined
ones always. Rendering a token back to bytes, and which tokens end a generation, follow llama.cpp's
rules (``llama-vocab.cpp``): tests/test_vocabulary.py checks both tokenizers agree token for token.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
from gguf import Keys, TokenType
from tokenizers import AddedToken, Regex, Tokenizer, models, normalizers, pre_tokenizers

from edgeinfer.errors import InvalidModelError
from edgeinfer.models.gguf_file import LongArray, read_header
from edgeinfer.models.pretokenizers import PRE_BY_NAME

# Token texts llama.cpp treats as ending a generation, whatever the file says of them (made control tokens).
EOG_TEXTS = frozenset(
    {
        "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>", "<end_of_turn>",
        "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]", "<|end_of_text|>",
        "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>", "<｜end▁of▁sentence｜>", "[e~[",
    }
)  # fmt: skip
# Fill-in-the-middle tokens llama.cpp also ends a generation at: the first of each group the vocabulary has.
# The file may name each by its key instead.
FIM_END_TEXTS = {
    Keys.Tokenizer.FIM_PAD_ID: ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    Keys.Tokenizer.FIM_REP_ID: ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    Keys.Tokenizer.FIM_SEP_ID: ("<|file_sep|>",),
}
SPACE = "▁"  # SentencePiece's symbol for a space
BOS_BY_DEFAULT = ("llama-bpe", "tekken")  # byte-level pre-tokenizers llama.cpp adds BOS for, unless told
_SPECIAL = (TokenType.CONTROL, TokenType.UNKNOWN)


@cache
def byte_symbols() -> list[str]:
    """GPT-2's printable stand-in for each byte value, by byte: the byte-level BPE base alphabet."""
    symbols = {b: char for char, b in byte_decoder().items()}
    return [symbols[b] for b in range(256)]


@cache
def byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the printable character standing for each byte, back to the byte (one table,
    built once: rendering a token looks it up, and building it takes 28 us)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = dict(zip(printable, printable, strict=True))
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = 256 + extra
            extra += 1
    return {chr(c): b for b, c in chars.items()}


class GGUFVocabulary:
    """The tokenizer of one GGUF file, without llama.cpp."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        meta = {
            key: _plain(value)
            for key, value in read_header(self.path).metadata.items()
            if key.startswith(("tokenizer.", "edgeinfer."))
        }
        self.model: str = meta.get(Keys.Tokenizer.MODEL, "")
        self.tokens: list[str] = meta[Keys.Tokenizer.LIST]
        self.n_vocab = len(self.tokens)
        vocab = {t: i for i, t in enumerate(self.tokens)}
        self._unk_id: int = meta.get(Keys.Tokenizer.UNK_ID, 0)
        self._characters: dict[int, str] = {}
        by_text = {vocab[t] for t in EOG_TEXTS if t in vocab}
        for key, group in FIM_END_TEXTS.items():
            if meta.get(key) is None:
                by_text.update([vocab[t] for t in group if t in vocab][:1])
        keys = (Keys.Tokenizer.EOS_ID, Keys.Tokenizer.EOT_ID, Keys.Tokenizer.EOM_ID, *FIM_END_TEXTS)
        ids = (meta.get(key) for key in keys)
        self.end_ids = frozenset(by_text.union(i for i in ids if i is not None))
        types = meta.get(Keys.Tokenizer.TOKEN_TYPE) or [TokenType.NORMAL] * self.n_vocab
        # llama.cpp makes the tokens it knows by their text control tokens, whatever the file says.
        self.types = [TokenType.CONTROL if i in by_text else TokenType(k) for i, k in enumerate(types)]
        pre_name = meta.get(Keys.Tokenizer.PRE)
        # llama.cpp's defaults where the file does not say: BOS for SentencePiece and Llama 3's and Mistral's
        # byte-level BPE, EOS for Unigram.
        self.add_bos = bool(meta.get(Keys.Tokenizer.ADD_BOS, self.model == "llama" or pre_name in BOS_BY_DEFAULT))
        self.add_eos = bool(meta.get(Keys.Tokenizer.ADD_EOS, self.model == "t5"))
        self.bos_id: int = meta.get(Keys.Tokenizer.BOS_ID, -1)
        self.eos_id: int = meta.get(Keys.Tokenizer.EOS_ID, -1)
        for needed, key in ((True, Keys.Tokenizer.EOS_ID), (self.add_bos, Keys.Tokenizer.BOS_ID)):
            if needed and meta.get(key) is None:
                raise self._only_llamacpp(f"lacks {key}, for which llama.cpp assumes an id of its own")
        if self.model == "gpt2":
            pre = PRE_BY_NAME.get(pre_name or "")  # llama.cpp's "default" splits unlike any of them
            if pre is None:
                raise self._only_llamacpp(f"has the pre-tokenizer {pre_name!r} (tokenizer.ggml.pre)")
            merges = [tuple(m.split(" ", 1)) for m in meta[Keys.Tokenizer.MERGES]]
            self.hf_tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=pre.ignore_merges))
            self.hf_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
                [*(pre_tokenizers.Split(Regex(s), "isolated") for s in pre.splits),
                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
            )  # fmt: skip
        elif self.model == "llama":
            self.hf_tokenizer = self._sentencepiece(vocab, meta)
        elif self.model == "t5":
            self.hf_tokenizer = self._unigram(meta)
        else:
            raise self._only_llamacpp(f"has the tokenizer model {self.model!r}")
        added = list(zip(self.tokens, self.types, strict=True))
        self.hf_tokenizer.add_special_tokens([AddedToken(t, normalized=False) for t, k in added if k in _SPECIAL])
        self.hf_tokenizer.add_tokens([AddedToken(t, normalized=False) for t, k in added if k == TokenType.USER_DEFINED])
        # The long arrays live on in what was built from them (self.tokens, self.types, the tokenizer); kept as
        # Python objects too, SmolLM2's held 7.6 MiB more (tracemalloc). Only the single values stay, for meta().
        self.metadata = {key: value for key, value in meta.items() if not isinstance(value, list)}

    def _only_llamacpp(self, what: str) -> InvalidModelError:
        return InvalidModelError(
            f"{self.path.name} {what}: edgeinfer tokenizes it only through llama.cpp; "
            "install llama-cpp-python as README.md shows"
        )

    def _sentencepiece(self, vocab: dict[str, int], meta: dict[str, Any]) -> Tokenizer:
        """SentencePiece BPE as llama.cpp runs it. llama.cpp starts from the text's characters, in the vocabulary
        or not, so every character of a token gets an id of its own past the vocabulary's end; one left unmerged
        becomes its bytes' tokens (``tokenize``)."""
        if meta.get(Keys.Tokenizer.SCORES) is None:  # llama.cpp breaks ties by position, a rank cannot
            raise self._only_llamacpp(f"lacks {Keys.Tokenizer.SCORES}")
        scores = np.asarray(meta[Keys.Tokenizer.SCORES], np.float64)
        normal = [t for t, kind in zip(self.tokens, self.types, strict=True) if kind == TokenType.NORMAL]
        extended = dict(vocab)
        for char in sorted({c for t in normal for c in t} - vocab.keys()):
            extended[char] = len(extended)
        self._characters = {i: c for c, i in extended.items() if i >= self.n_vocab}
        ranked = []
        for token in normal:
            for cut in range(1, len(token)):
                left, right = token[:cut], token[cut:]
                if left in extended and right in extended:
                    ranked.append((-scores[vocab[token]], vocab[token], cut, left, right))
        ranked.sort()
        unk = meta.get(Keys.Tokenizer.UNK_ID)
        hf = Tokenizer(
            models.BPE(
                vocab=extended,
                merges=[(left, right) for *_, left, right in ranked],
                byte_fallback=TokenType.BYTE in self.types,
                unk_token=self.tokens[unk] if unk is not None else None,
            )
        )
        # A space before the text and after each special token (as llama.cpp's add_space_prefix), then ▁ for spaces.
        steps = [normalizers.Replace(" ", SPACE)]
        if meta.get(Keys.Tokenizer.ADD_PREFIX, True):
            steps.insert(0, normalizers.Prepend(" "))
        hf.normalizer = normalizers.Sequence(steps)
        return hf

    def _unigram(self, meta: dict[str, Any]) -> Tokenizer:
        """SentencePiece's Unigram as llama.cpp runs it: the model's character map, whitespace folded if asked,
        a space before the text, ▁ for spaces, then the most likely segmentation."""
        scores = meta.get(Keys.Tokenizer.SCORES) or [0.0] * self.n_vocab
        unk = meta.get(Keys.Tokenizer.UNK_ID)
        hf = Tokenizer(
            models.Unigram(
                list(zip(self.tokens, scores, strict=True)), unk_id=unk, byte_fallback=TokenType.BYTE in self.types
            )
        )
        steps = []
        charsmap = meta.get(Keys.Tokenizer.PRECOMPILED_CHARSMAP)
        if charsmap:
            steps.append(normalizers.Precompiled(np.asarray(charsmap).astype(np.uint8).tobytes()))
        if meta.get(Keys.Tokenizer.REMOVE_EXTRA_WS):
            steps += [normalizers.Strip(), normalizers.Replace(Regex(" {2,}"), " ")]
        if meta.get(Keys.Tokenizer.ADD_PREFIX, True):
            steps.append(normalizers.Prepend(" "))
        steps.append(normalizers.Replace(" ", SPACE))
        hf.normalizer = normalizers.Sequence(steps)
        return hf

    def tokenize(self, text: str, add_special: bool, parse_special: bool) -> list[int]:
        self.hf_tokenizer.encode_special_tokens = not parse_special
        ids = self.hf_tokenizer.encode(text, add_special_tokens=False).ids
        if any(i >= self.n_vocab for i in ids):  # characters no merge took in: their bytes' tokens
            ids = [j for i in ids for j in (self._bytes(self._characters[i]) if i >= self.n_vocab else (i,))]
        if add_special:
            ids = ([self.bos_id] if self.add_bos else []) + ids + ([self.eos_id] if self.add_eos else [])
        return ids

    def _bytes(self, char: str) -> list[int]:
        """The byte tokens of ``char``'s UTF-8, or the unknown token where the vocabulary has none."""
        byte_ids = [self.hf_tokenizer.token_to_id(f"<0x{b:02X}>") for b in char.encode()]
        if None in byte_ids:
            return [self._unk_id]
        return byte_ids  # type: ignore[return-value]

    def render(self, token: int, special: bool) -> bytes:
        kind, text = self.types[token], self.tokens[token]
        if kind in _SPECIAL:
            return text.encode() if special else b""
        if kind == TokenType.USER_DEFINED:
            return text.encode()
        if kind == TokenType.NORMAL:
            if self.model == "llama":
                return text.replace(SPACE, " ").encode()
            table = byte_decoder()
            return bytes(table[c] for c in text) if all(c in table for c in text) else text.encode()
        if kind == TokenType.BYTE:
            return bytes([int(text[3:-1], 16)])  # <0xAB>
        return b""

    def is_marker(self, token: int) -> bool:
        """Whether parsing special tokens turns this token's text into the token."""
        return self.types[token] in _SPECIAL

    def is_end_of_generation(self, token: int) -> bool:
        return token in self.end_ids

    def close(self) -> None:
        """Nothing native to free: the tokenizer is Python objects."""

    def meta(self, key: str) -> str | None:
        value = self.metadata.get(key)
        if value is None:
            return None
        return str(value).lower() if isinstance(value, bool) else str(value)


def _plain(value: Any) -> Any:
    """A metadata value as Python values: a long array's strings decoded, its numbers a list."""
    if not isinstance(value, LongArray):
        return value
    if value.strings is not None:
        return [s.decode("utf-8", "replace") for s in value.strings]
    return value.values.tolist() if value.values is not None else None
