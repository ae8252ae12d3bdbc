"""Tiny, valid GGUF models for tests: every supported architecture, real tokenizers, random weights.

``write_tiny_gguf`` writes a file that passes ``load_model_info``, loads in llama.cpp and
generates. Tensor names and shapes come from ``edgeinfer.models.arch.expected_tensors``, so
the file is exactly what the architecture tables describe. Weights are seeded normal(0, 0.02)
and RMS norm weights 1 + normal(0, 0.1), so logits are finite and differ from token to token;
norm weights (Q/K and post-norms included) and qwen2's Q/K/V biases are random too, so a
reference implementation that drops either disagrees with llama.cpp. Llama 3's RoPE frequency
factors (``rope_freqs=True``) are drawn from 1 to 8, the range its long-context scaling uses.

Two tokenizers, as llama.cpp knows them:

- ``"gpt2"``: byte-level BPE. The 256 byte symbols, a few merges (``" the"``, ``"in"``...)
  and the ChatML control tokens ``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>``.
- ``"llama"``: SentencePiece. ``<unk>``, ``<s>``, ``</s>``, the 256 byte-fallback tokens
  ``<0x00>``...``<0xFF>`` and a few scored pieces (``"▁the"``...).

Both carry a ChatML chat template. ``add_vocab`` replaces them with any vocabulary, e.g. one the
converter read from a Hugging Face tokenizer.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Literal

import numpy as np
from gguf import MODEL_TENSOR, GGMLQuantizationType, GGUFValue, GGUFWriter, Keys, TokenType
from gguf.quants import quantize

from edgeinfer.converters.writer import add_hparams
from edgeinfer.models.arch import (
    ARCHITECTURES,
    ROPE_BASE_SWA,
    HParams,
    expected_tensors,
    swa_pattern_layers,
    tensor_name,
)
from edgeinfer.vocabulary import byte_symbols

TensorType = Literal["F32", "F16", "Q8_0", "Q4_0", "Q4_1"]
ArchName = Literal["llama", "mistral", "qwen2", "qwen3", "gemma3"]
TokenizerModel = Literal["gpt2", "llama"]

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Merged pieces, each built from two symbols already in the vocabulary (Ġ is GPT-2's space).
BPE_MERGES = [
    ("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("Ġ", "a"), ("e", "r"), ("o", "n"), ("Ġ", "s"),
    ("r", "e"), ("a", "t"), ("e", "n"), ("o", "r"), ("Ġ", "w"), ("i", "s"), ("Ġ", "c"), ("e", "s"),
]  # fmt: skip
SPM_PIECES = ["▁", "▁t", "he", "▁the", "in", "▁a", "er", "on", "▁s", "re", "at", "en", "or", "▁w", "is", "es"]
CHATML_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def _add_gpt2_vocab(writer: GGUFWriter) -> int:
    tokens = byte_symbols() + [a + b for a, b in BPE_MERGES]
    types = [TokenType.NORMAL] * len(tokens)
    first_special = len(tokens)
    tokens += CHATML_SPECIALS
    types += [TokenType.CONTROL] * len(CHATML_SPECIALS)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges([f"{a} {b}" for a, b in BPE_MERGES])
    writer.add_bos_token_id(first_special)  # <|endoftext|>
    writer.add_eos_token_id(first_special + 2)  # <|im_end|>
    writer.add_add_bos_token(False)
    return len(tokens)


def _add_spm_vocab(writer: GGUFWriter) -> int:
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *SPM_PIECES, *CHATML_SPECIALS[1:]]
    types = [TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL] + [TokenType.BYTE] * 256
    types += [TokenType.NORMAL] * len(SPM_PIECES) + [TokenType.CONTROL] * 2
    # SentencePiece prefers the highest-scoring piece: longer pieces score higher.
    scores = [0.0] * 259 + [-10.0 + len(p) for p in SPM_PIECES] + [0.0, 0.0]
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(len(tokens) - 1)  # <|im_end|>, so chats stop where ChatML says
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(True)
    return len(tokens)


def write_tiny_gguf(
    path: str | Path,
    *,
    arch: ArchName = "llama",
    tensor_type: TensorType = "F32",
    tokenizer: TokenizerModel = "gpt2",
    add_vocab: Callable[[GGUFWriter], int] | None = None,
    seed: int = 0,
    n_layer: int = 2,
    n_embd: int = 128,
    n_head: int = 2,
    n_head_kv: int = 1,
    head_dim: int | None = None,
    n_ff: int = 256,
    n_ctx: int = 512,
    tied: bool = True,
    rope_freqs: bool = False,
    sliding_window: int = 0,
    swa_layers: tuple[bool, ...] | None = None,
    rope_base_swa: float = ROPE_BASE_SWA,
    logit_softcap: float = 0.0,
    metadata: Mapping[str, GGUFValue | None] | None = None,
) -> Path:
    """Write a small valid GGUF model to ``path`` and return the path.

    ``tensor_type`` is the type of every matrix; vectors (norms, biases) are always F32,
    as llama.cpp's converter writes them. Quantized types need ``n_embd`` and ``n_ff`` to be
    multiples of 32. ``add_vocab(writer)``, if given, writes the tokenizer keys (chat template
    included) instead of ``tokenizer`` and returns the vocabulary size. ``tied=False`` adds a
    separate ``output.weight``. ``head_dim`` defaults to ``n_embd // n_head``. ``rope_freqs`` adds
    Llama 3's RoPE frequency factors (llama and mistral). ``sliding_window`` (gemma3) makes the layers
    ``swa_layers`` flags (by default the architecture's pattern) attend within that window, rotating
    with ``rope_base_swa``; ``logit_softcap`` (gemma3) caps the logits. ``metadata`` replaces, adds
    (a ``GGUFValue``) or drops (``None``)
    keys last, for tests of malformed files; the tensors still follow the arguments, and the
    length of a replaced token list.
    """
    path = Path(path)
    spec = ARCHITECTURES[arch]
    writer = GGUFWriter(path, spec.gguf_arch)
    writer.add_name(f"tiny-{arch}")
    if add_vocab is None:
        n_vocab = (_add_gpt2_vocab if tokenizer == "gpt2" else _add_spm_vocab)(writer)
        writer.add_chat_template(CHATML)
    else:
        n_vocab = add_vocab(writer)
    hp = HParams(
        arch=spec,
        n_vocab=n_vocab,
        n_embd=n_embd,
        n_layer=n_layer,
        n_head=n_head,
        n_head_kv=n_head_kv,
        head_dim=head_dim or n_embd // n_head,
        n_ff=n_ff,
        n_ctx_train=n_ctx,
        rope_base=10_000.0 if arch in ("llama", "mistral") else 1_000_000.0,
        rms_eps=1e-5 if arch in ("llama", "mistral") else 1e-6,
        tied_embeddings=tied,
        rope_freqs=rope_freqs,
        sliding_window=sliding_window,
        swa_layers=(swa_layers or swa_pattern_layers(spec.swa_pattern, n_layer)) if sliding_window else (),
        rope_base_swa=rope_base_swa,
        logit_softcap=logit_softcap,
    )
    add_hparams(writer, hp)

    for key, value in (metadata or {}).items():
        if value is None:
            del writer.kv_data[0][key]
        else:
            writer.kv_data[0][key] = value
    if Keys.Tokenizer.LIST in writer.kv_data[0]:  # the embeddings follow a replaced vocabulary
        hp = replace(hp, n_vocab=len(writer.kv_data[0][Keys.Tokenizer.LIST].value))

    rng = np.random.default_rng(seed)
    qtype = GGMLQuantizationType[tensor_type]
    for name, shape in expected_tensors(hp).items():
        numpy_shape = tuple(reversed(shape))  # ggml lists the fastest dimension first
        if len(shape) == 1 and name.endswith("norm.weight"):
            writer.add_tensor(name, (1 + rng.standard_normal(numpy_shape) * 0.1).astype(np.float32))
        elif name == tensor_name(MODEL_TENSOR.ROPE_FREQS):
            writer.add_tensor(name, rng.uniform(1, 8, numpy_shape).astype(np.float32))
        elif len(shape) == 1:
            writer.add_tensor(name, (rng.standard_normal(numpy_shape) * 0.02).astype(np.float32))
        else:
            weights = (rng.standard_normal(numpy_shape) * 0.02).astype(np.float32)
            data = quantize(weights, qtype)
            writer.add_tensor(name, data, raw_dtype=qtype if data.dtype == np.uint8 else None)

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
