"""The pre-tokenizers llama.cpp implements, by their ``tokenizer.ggml.pre`` names: the regexes each splits
text with before byte-level BPE, as Hugging Face's tokenizer.json spells them. The converter names a
checkpoint's pre-tokenizer by them; the tokenizer that runs without llama.cpp splits by them."""

from __future__ import annotations

from dataclasses import dataclass

# The regexes Hugging Face's pre-tokenizers split with, as tokenizer.json spells them.
# ByteLevel(use_regex=True) splits with GPT-2's regex.
GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SEED_CODER_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)|\s+"
)
TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass(frozen=True)
class PreTokenizer:
    """A pre-tokenizer llama.cpp implements: ``name`` is its ``tokenizer.ggml.pre``, ``splits`` the
    regexes, in order, that Hugging Face's pre-tokenizer splits text with before byte-level BPE."""

    name: str
    splits: tuple[str, ...]
    # llama.cpp emits a word that is itself a token without applying merges (HF's BPE ignore_merges).
    ignore_merges: bool = False
    # llama.cpp's detokenizer drops the space before punctuation (HF's clean_up_tokenization_spaces).
    clean_spaces: bool = True


# Where two names split alike, the first is the one llama.cpp's converter gives the best-known family.
PRE_TOKENIZERS: tuple[PreTokenizer, ...] = (
    PreTokenizer("gpt-2", (GPT2_SPLIT,)),
    PreTokenizer("smollm", (r"\p{N}", GPT2_SPLIT), clean_spaces=False),
    PreTokenizer("starcoder", (r"\p{N}", GPT2_SPLIT)),
    PreTokenizer("llama-bpe", (LLAMA3_SPLIT,), ignore_merges=True),
    PreTokenizer("smaug-bpe", (LLAMA3_SPLIT,)),
    PreTokenizer("qwen2", (QWEN2_SPLIT,), clean_spaces=False),
    PreTokenizer("stablelm2", (QWEN2_SPLIT,)),
    PreTokenizer("seed-coder", (SEED_CODER_SPLIT,), clean_spaces=False),
    PreTokenizer("tekken", (TEKKEN_SPLIT,), ignore_merges=True, clean_spaces=False),
    PreTokenizer(
        "deepseek-coder",
        (r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+", r"\p{N}"),
        clean_spaces=False,
    ),
)
PRE_BY_NAME = {p.name: p for p in PRE_TOKENIZERS}
