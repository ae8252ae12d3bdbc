"""Small Hugging Face tokenizers, trained in the test on the text below, written as a checkpoint's
tokenizer files: byte-level BPE (``tokenizer.json``, configured as a model family ships it) and
SentencePiece BPE with byte fallback (``tokenizer.model``), each with ``tokenizer_config.json``.
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Literal

import sentencepiece
from gguf import GGUFReader, TokenType
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

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


def write_sentencepiece(folder: Path, vocab_size: int = 512) -> None:
    """A SentencePiece BPE with byte fallback trained on CORPUS, set up like Llama 2's (no
    normalization, a ▁ before the first word, BOS on every text), plus the ChatML markers as added
    tokens after its vocabulary, the way fine-tunes add them (in tokenizer_config.json)."""
    folder.mkdir(parents=True, exist_ok=True)
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS.splitlines()),
        model_writer=model,
        vocab_size=vocab_size,
        model_type="bpe",
        byte_fallback=True,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
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
