"""Small Hugging Face tokenizers, trained in the test on the text below, written as a checkpoint's
tokenizer files, each with ``tokenizer_config.json``: byte-level BPE (``tokenizer.json`` configured
as a model family ships it, or GPT-2's ``vocab.json`` and ``merges.txt``), SentencePiece BPE with
byte fallback (``tokenizer.model``, or the ``tokenizer.json`` transformers makes of it), and Unigram
(``tokenizer.json``).
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Literal

import sentencepiece
from gguf import GGUFReader, TokenType
from sentencepiece import sentencepiece_model_pb2
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

BytePre = Literal["qwen2", "smollm", "llama-bpe", "gpt-2"]

CHATML_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# What the tokenizers are trained on: English, Python, digits, and other scripts, so that each
# sample the tests tokenize meets merged pieces as well as bare bytes.
CORPUS = """\
The harbour was quiet before dawn. Fishing boats knocked against the pier, and the gulls
had not yet started their arguments. Mara walked the length of the breakwater twice, counting
the lamps: 12 on the north side, 14 on the south, and one that hadn't worked since 1998.
She'd been told it couldn't be fixed. "It's the wiring," they'd said, "we'll get to it."
Nobody ever did. She didn't mind; a dark lamp was a landmark too.

In the workshop, the radio played a weather report: winds from the west at 25 km/h,
pressure 1013 hPa, visibility good. The kettle boiled. Tea, two sugars, no milk.
Her notebook listed the week's jobs -- paint the rail, oil the winch, replace 3 fuses --
and at the bottom, underlined twice, "call the harbourmaster about the lamp".

def count_lamps(sides: dict[str, int]) -> int:
    \"\"\"Return how many lamps line the breakwater.\"\"\"
    total = 0
    for side, lamps in sides.items():
        if lamps < 0:
            raise ValueError(f"{side}: {lamps} lamps?")
        total += lamps
    return total

class Harbour:
    def __init__(self, name: str, lamps: list[int]) -> None:
        self.name = name
        self.lamps = lamps

    def broken(self) -> list[int]:
        return [i for i, watts in enumerate(self.lamps) if watts == 0]

print(count_lamps({"north": 12, "south": 14}))  # 26
for i in range(10):
    print(i, i * i, 2 ** i)

Καλημέρα! Το λιμάνι ήταν ήσυχο πριν από την αυγή και οι βάρκες περίμεναν τον άνεμο.
Ο φάρος ανάβει κάθε βράδυ στις εννέα, και η θάλασσα είναι γαλάζια.
你好，世界。港口在黎明前很安静，渔船在码头边轻轻摇晃。灯塔每天晚上九点亮起。
今天天气很好，我们去海边散步吧。海鸥在天空中飞翔。
Здравствуй, мир! Маяк светит каждую ночь, и корабли возвращаются домой.
Emoji: 🙂 🚢 🌊 ⚓ 🐟 — café, naïve, jalapeño, Ångström, São Paulo, Zürich.
"""

# The pre-tokenizer regexes as the model families' tokenizer.json files spell them.
_GPT2_STYLE_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _pre_tokenizer(pre: BytePre) -> pre_tokenizers.PreTokenizer:
    if pre == "gpt-2":
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":
        return pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
        )
    regex = _GPT2_STYLE_QWEN2 if pre == "qwen2" else _LLAMA3
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(regex), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def write_byte_level_bpe(folder: Path, *, pre: BytePre = "qwen2", vocab_size: int = 512) -> None:
    """A byte-level BPE trained on CORPUS with ``pre``'s pre-tokenizer and the ChatML specials.

    ``llama-bpe`` is set up like Llama 3: merges are ignored for words that are whole tokens, and
    every text starts with ``<|begin_of_text|>``. The others add nothing to a text, as Qwen2 does.
    The specials come first in the vocabulary, as SmolLM's do, except for ``gpt-2``, which adds
    them after it, as GPT-2 and Qwen2 do.
    """
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.BPE(ignore_merges=pre == "llama-bpe"))
    tokenizer.pre_tokenizer = _pre_tokenizer(pre)
    tokenizer.decoder = decoders.ByteLevel()
    specials = ["<|begin_of_text|>", *CHATML_SPECIALS] if pre == "llama-bpe" else CHATML_SPECIALS
    specials_last = pre == "gpt-2"
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(specials) if specials_last else vocab_size,
        special_tokens=[] if specials_last else specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS.splitlines(keepends=True), trainer)
    if specials_last:
        tokenizer.add_special_tokens(specials)
    config = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "chat_template": CHATML}
    if pre == "llama-bpe":
        bos = "<|begin_of_text|>"
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tokenizer.token_to_id(bos))]
        )
        config["bos_token"] = bos
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")


def write_smollm2_from_gguf(folder: Path, gguf_path: Path) -> None:
    """SmolLM2's tokenizer.json and tokenizer_config.json, rebuilt from its GGUF's vocabulary and
    merges: a real 49152-token byte-level BPE with SmolLM's pre-tokenizer and specials."""
    folder.mkdir(parents=True, exist_ok=True)
    reader = GGUFReader(gguf_path)
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    types = reader.fields["tokenizer.ggml.token_type"].contents()
    merges = [tuple(m.split(" ")) for m in reader.fields["tokenizer.ggml.merges"].contents()]
    tokenizer = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    tokenizer.pre_tokenizer = _pre_tokenizer("smollm")
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([t for t, kind in zip(tokens, types, strict=True) if kind == TokenType.CONTROL])
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {
        "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>",
        "pad_token": "<|im_end|>",
        "unk_token": "<|endoftext|>",
        "clean_up_tokenization_spaces": False,
        "chat_template": reader.fields["tokenizer.chat_template"].contents(),
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")


def write_sentencepiece(
    folder: Path,
    vocab_size: int = 512,
    *,
    normalization: Literal["identity", "nmt_nfkc", "nfkc"] = "identity",
    fold_whitespace: bool | None = None,
    add_dummy_prefix: bool = True,
) -> None:
    """A SentencePiece BPE with byte fallback trained on CORPUS, set up like Llama 2's (no
    normalization, a ▁ before the first word, BOS on every text), plus the ChatML markers as added
    tokens after its vocabulary, the way fine-tunes add them (in tokenizer_config.json).

    ``normalization="nmt_nfkc"`` keeps the trainer's defaults instead: NFKC with SentencePiece's
    extra rules, and whitespace folded (remove_extra_whitespaces), as every rule but identity
    does unless ``fold_whitespace`` says otherwise.
    """
    folder.mkdir(parents=True, exist_ok=True)
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS.splitlines()),
        model_writer=model,
        vocab_size=vocab_size,
        model_type="bpe",
        byte_fallback=True,
        normalization_rule_name=normalization,
        remove_extra_whitespaces=normalization != "identity" if fold_whitespace is None else fold_whitespace,
        add_dummy_prefix=add_dummy_prefix,
        split_digits=True,
        allow_whitespace_only_pieces=True,
        minloglevel=2,
    )
    (folder / "tokenizer.model").write_bytes(model.getvalue())
    added = {
        str(vocab_size + i): {"content": text, "special": True, "lstrip": False, "rstrip": False, "normalized": False}
        for i, text in enumerate(CHATML_SPECIALS[1:])
    }
    config = {
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "add_bos_token": True,
        "add_eos_token": False,
        "added_tokens_decoder": added,
        "chat_template": CHATML,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")


SpmJsonStyle = Literal["llama", "mistral", "gemma"]


def write_sentencepiece_json(folder: Path, style: SpmJsonStyle, vocab_size: int = 768) -> Tokenizer:
    """The tokenizer.json transformers' LlamaConverter makes of write_sentencepiece's model, which is
    then removed, as repositories that ship only tokenizer.json are. Returns the Hugging Face tokenizer.

    ``llama`` marks spaces as Llama 2's does (a Prepend and a Replace normalizer), ``mistral`` with a
    Metaspace pre-tokenizer that prepends ▁ to the first text only (legacy=False), ``gemma`` as
    GemmaConverter does: a Replace normalizer, a split at spaces (none are left), no ▁ before the
    text (the model is trained without one), and "\t" in place of the byte piece <0x09>.
    """
    write_sentencepiece(folder, vocab_size, add_dummy_prefix=style != "gemma")
    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString((folder / "tokenizer.model").read_bytes())
    (folder / "tokenizer.model").unlink()
    pieces = [(p.piece, p.score) for p in proto.pieces]
    if style == "gemma":
        pieces = [("\t" if piece == "<0x09>" else piece, score) for piece, score in pieces]
    vocab = {piece: i for i, (piece, _) in enumerate(pieces)}
    tokenizer = Tokenizer(
        models.BPE(vocab, _sentencepiece_merges(pieces, vocab), unk_token="<unk>", fuse_unk=True, byte_fallback=True)
    )
    space = "\u2581"
    if style == "mistral":
        tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement=space, prepend_scheme="first", split=False)
    elif style == "llama":
        tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend(space), normalizers.Replace(" ", space)])
    else:
        tokenizer.normalizer = normalizers.Replace(" ", space)
        tokenizer.pre_tokenizer = pre_tokenizers.Split(" ", "merged_with_previous")
    tokenizer.decoder = decoders.Sequence([decoders.Replace(space, " "), decoders.ByteFallback(), decoders.Fuse()])
    tokenizer.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in ("<unk>", "<s>", "</s>")])
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", vocab["<s>"])]
    )
    tokenizer.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in CHATML_SPECIALS[1:]])
    tokenizer.save(str(folder / "tokenizer.json"))
    config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    del config["added_tokens_decoder"]  # tokenizer.json holds them now
    config["legacy"] = style != "mistral"
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    return tokenizer


def _sentencepiece_merges(pieces: list[tuple[str, float]], vocab: dict[str, int]) -> list[tuple[str, str]]:
    """The merges transformers writes for a SentencePiece BPE's ``pieces`` and their scores: every
    split of a piece into two pieces, the best-scoring piece's first (transformers' generate_merges)."""
    merges = []
    for piece, score in pieces:
        splits = [(piece[:i], piece[i:]) for i in range(1, len(piece))]
        local = sorted(
            (pair for pair in splits if pair[0] in vocab and pair[1] in vocab),
            key=lambda pair: (vocab[pair[0]], vocab[pair[1]]),
        )
        merges += [(left, right, score) for left, right in local]
    merges.sort(key=lambda merge: (merge[2], len(merge[0]), len(merge[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]


def write_bpe_trained_with_byte_fallback(folder: Path, vocab_size: int = 768) -> Tokenizer:
    """A BPE with byte fallback and Llama 2's ▁ marks, but trained by Hugging Face's trainer: its merges
    are its own, not SentencePiece's."""
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256))],
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS.splitlines(), trainer)
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    return tokenizer


def write_unigram(folder: Path, *, nmt_nfkc: bool = False, fold: bool = False, vocab_size: int = 600) -> Tokenizer:
    """A Unigram trained on CORPUS with a Metaspace pre-tokenizer, as transformers converts
    SentencePiece Unigrams; ``nmt_nfkc`` normalizes text first with SentencePiece's default rules
    (a Precompiled normalizer), ``fold`` folds whitespace as transformers writes SentencePiece's
    remove_extra_whitespaces (T5's tokenizer.json does both). Returns the Hugging Face tokenizer."""
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.Unigram())
    steps = []
    if nmt_nfkc:
        spec = sentencepiece_model_pb2.ModelProto()
        spec.ParseFromString(sentencepiece.SentencePieceNormalizer(rule_name="nmt_nfkc").serialized_model_proto())
        steps.append(normalizers.Precompiled(spec.normalizer_spec.precompiled_charsmap))
    if fold:
        steps += [normalizers.Strip(left=False, right=True), normalizers.Replace(Regex(" {2,}"), "\u2581")]
    if steps:
        tokenizer.normalizer = normalizers.Sequence(steps)
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always", split=True)
    tokenizer.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="always", split=True)
    trainer = trainers.UnigramTrainer(
        vocab_size=vocab_size, special_tokens=["<pad>", "</s>", "<unk>"], unk_token="<unk>", show_progress=False
    )
    tokenizer.train_from_iterator(CORPUS.splitlines(keepends=True), trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single="$A </s>", pair="$A </s> $B </s>", special_tokens=[("</s>", tokenizer.token_to_id("</s>"))]
    )
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {"eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    return tokenizer


def write_gpt2_files(folder: Path, *, pre: Literal["gpt-2", "qwen2"]) -> Tokenizer:
    """write_byte_level_bpe's tokenizer saved the way GPT-2 and Qwen2 repositories also ship it:
    vocab.json and merges.txt, the specials in tokenizer_config.json, the class named there.
    tokenizer.json is removed; the Hugging Face tokenizer is returned."""
    write_byte_level_bpe(folder, pre=pre)
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    (folder / "tokenizer.json").unlink()
    tokenizer.model.save(str(folder))
    config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    config["tokenizer_class"] = "GPT2Tokenizer" if pre == "gpt-2" else "Qwen2TokenizerFast"
    config["added_tokens_decoder"] = {
        str(tokenizer.token_to_id(text)): {"content": text, "special": True} for text in CHATML_SPECIALS
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    return tokenizer
