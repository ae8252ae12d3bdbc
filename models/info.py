"""What the engine needs to know about a model before loading it, read from the GGUF header and
checked against its architecture, so that nothing malformed ever reaches native code."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import Keys, TokenType

from edgeinfer.errors import InvalidModelError
from edgeinfer.models.arch import (
    HParams,
    architecture_for_gguf,
    check_tensor_types,
    check_tensors,
    hparams_from_metadata,
)
from edgeinfer.models.gguf_file import GGUFHeader, LongArray, TensorInfo, array_length, read_header

# llama.cpp's tokenizers: SentencePiece, byte-level BPE, WordPiece, T5's Unigram, RWKV's and PLaMo 2's.
# The converter writes the first two, which are checked in depth here.
TOKENIZER_MODELS = ("llama", "gpt2", "bert", "t5", "rwkv", "plamo2")
# Counts that llama.cpp reads once for all layers or, as an array, layer by layer.
PER_LAYER_KEYS = (Keys.LLM.FEED_FORWARD_LENGTH, Keys.Attention.HEAD_COUNT, Keys.Attention.HEAD_COUNT_KV)
_BYTE_TOKEN = re.compile(rb"<0x[0-9A-Fa-f]{2}>")
# The type llama.cpp reads each key as ("{arch}" is general.architecture). It refuses a key of
# another type, or worse, reads a vocabulary array with the wrong element size.
KEY_TYPES: dict[str, str] = {
    Keys.General.NAME: "string",
    Keys.LLM.CONTEXT_LENGTH: "uint32",
    Keys.LLM.EMBEDDING_LENGTH: "uint32",
    Keys.LLM.BLOCK_COUNT: "uint32",
    Keys.LLM.FEED_FORWARD_LENGTH: "uint32",
    Keys.LLM.EXPERT_COUNT: "uint32",
    Keys.LLM.EXPERT_USED_COUNT: "uint32",
    Keys.Attention.HEAD_COUNT: "uint32",
    Keys.Attention.HEAD_COUNT_KV: "uint32",
    Keys.Attention.KEY_LENGTH: "uint32",
    Keys.Attention.VALUE_LENGTH: "uint32",
    Keys.Attention.LAYERNORM_RMS_EPS: "float32",
    Keys.Rope.DIMENSION_COUNT: "uint32",
    Keys.Rope.FREQ_BASE: "float32",
    Keys.Rope.SCALING_TYPE: "string",
    Keys.Rope.FREQ_BASE_SWA: "float32",
    Keys.Attention.SLIDING_WINDOW: "uint32",
    Keys.LLM.FINAL_LOGIT_SOFTCAPPING: "float32",
    Keys.Tokenizer.MODEL: "string",
    Keys.Tokenizer.PRE: "string",
    Keys.Tokenizer.LIST: "array[string]",
    Keys.Tokenizer.SCORES: "array[float32]",
    Keys.Tokenizer.TOKEN_TYPE: "array[int32]",
    Keys.Tokenizer.MERGES: "array[string]",
    Keys.Tokenizer.ADD_BOS: "bool",
    Keys.Tokenizer.ADD_EOS: "bool",
    Keys.Tokenizer.ADD_PREFIX: "bool",
    Keys.Tokenizer.CHAT_TEMPLATE: "string",
}


@dataclass(frozen=True)
class ModelInfo:
    """A model's architecture, size and tensors, as its (checked) GGUF header states them."""

    path: Path
    name: str
    hparams: HParams
    chat_template: str | None
    file_size: int
    tensors: tuple[TensorInfo, ...]
    tokenizer_model: str  # tokenizer.ggml.model: "gpt2" (byte-level BPE), "llama" (SentencePiece), ...

    @property
    def architecture(self) -> str:
        return self.hparams.arch.gguf_arch

    @property
    def tensor_types(self) -> dict[str, int]:
        """ggml type name -> how many tensors have it."""
        return dict(Counter(t.type.name for t in self.tensors))

    @property
    def kv_values_per_token(self) -> int:
        """Values of KV cache one token takes: K and V, every layer, every KV head.

        Bytes depend on how a backend lays its cache out: ``Backend.kv_bytes_per_token``.
        """
        return self.hparams.kv_values_per_token


def load_model_info(path: str | Path) -> ModelInfo:
    """Read and check the GGUF at ``path``; raises InvalidModelError naming the field at fault."""
    return model_info_from_header(read_header(path))


def model_info_from_header(header: GGUFHeader) -> ModelInfo:
    meta, file = header.metadata, header.path.name
    _check_key_types(header)
    shapes = {t.name: t.shape for t in header.tensors}
    hparams = hparams_from_metadata(meta, set(shapes), file)
    _check_vocabulary(meta, hparams.n_vocab, file)
    check_tensors(hparams, shapes, file)
    check_tensor_types(header.tensors, file)
    template = meta.get(Keys.Tokenizer.CHAT_TEMPLATE)
    return ModelInfo(
        path=header.path,
        name=str(meta.get(Keys.General.NAME) or header.path.stem),
        hparams=hparams,
        chat_template=template if isinstance(template, str) else None,
        file_size=header.file_size,
        tensors=header.tensors,
        tokenizer_model=str(meta.get(Keys.Tokenizer.MODEL) or ""),
    )


def _check_key_types(header: GGUFHeader) -> None:
    """Every key llama.cpp or edgeinfer reads has the type they read it as."""
    arch = architecture_for_gguf(header.metadata.get(Keys.General.ARCHITECTURE), header.path.name).gguf_arch
    expected = {key.format(arch=arch): kind for key, kind in KEY_TYPES.items()}
    per_layer = {key.format(arch=arch) for key in PER_LAYER_KEYS}
    for key, kind in header.types.items():
        want = expected.get(key, "uint32" if key.startswith("tokenizer.ggml.") and key.endswith("_token_id") else kind)
        if key in per_layer and kind in ("array[int32]", "array[uint32]"):
            continue  # llama.cpp reads one count per layer from it
        if kind != want:
            raise InvalidModelError(f"{header.path.name}: metadata '{key}' is {kind}, but llama.cpp reads it as {want}")


def _check_vocabulary(meta: Mapping[str, Any], n_vocab: int, file: str) -> None:
    """Check that the tokenizer is one llama.cpp has and that every per-token array and special id fits.

    llama.cpp indexes the scores and token types by token id, trusts the special ids, and
    aborts on a token that appears twice.
    """
    model = meta.get(Keys.Tokenizer.MODEL)
    if model is None:
        raise InvalidModelError(f"{file} lacks the metadata key '{Keys.Tokenizer.MODEL}' (re-convert the model)")
    if model not in TOKENIZER_MODELS:
        raise InvalidModelError(
            f"{file}: tokenizer model {model!r} is not supported (expected one of {', '.join(TOKENIZER_MODELS)})"
        )
    for key in (Keys.Tokenizer.SCORES, Keys.Tokenizer.TOKEN_TYPE):
        if key in meta and array_length(meta[key]) != n_vocab:
            raise InvalidModelError(f"{file}: '{key}' has {array_length(meta[key])} entries for {n_vocab} tokens")
    vocabulary = meta[Keys.Tokenizer.LIST]
    assert isinstance(vocabulary, LongArray) and vocabulary.strings is not None  # how read_header keeps it
    tokens = vocabulary.strings
    unique = set(tokens)
    if len(unique) != len(tokens) or b"" in unique:
        _check_duplicate_tokens(tokens, file)
    if model == "llama":
        _check_byte_fallback(unique, file)
    _check_byte_tokens(tokens, meta.get(Keys.Tokenizer.TOKEN_TYPE), file)
    if model == "gpt2" and not array_length(meta.get(Keys.Tokenizer.MERGES)):
        raise InvalidModelError(f"{file}: a BPE vocabulary needs '{Keys.Tokenizer.MERGES}'; re-convert the model")
    special_ids = {k: v for k, v in meta.items() if k.startswith("tokenizer.ggml.") and k.endswith("_token_id")}
    for key, value in special_ids.items():
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < n_vocab:
            raise InvalidModelError(f"{file}: '{key}' = {value!r} is not a token id below {n_vocab}")


def _check_duplicate_tokens(tokens: tuple[bytes, ...], file: str) -> None:
    seen: dict[bytes, int] = {}
    for i, token in enumerate(tokens):
        token = token or f"[EMPTY_{i}]".encode()  # what llama.cpp names an empty token
        if token in seen:
            raise InvalidModelError(
                f"{file}: token {i} {token!r} in '{Keys.Tokenizer.LIST}' repeats token {seen[token]}; "
                "llama.cpp aborts on a duplicate token (re-convert the model)"
            )
        seen[token] = i


def _check_byte_tokens(tokens: tuple[bytes, ...], token_types: object, file: str) -> None:
    """Tokens typed BYTE must be spelled ``<0xXX>``: llama.cpp reads the byte from the text's 4th and 5th characters."""
    types = token_types.values if isinstance(token_types, LongArray) else token_types
    if types is None:
        return
    for i in np.flatnonzero(np.asarray(types) == TokenType.BYTE):
        if not _BYTE_TOKEN.fullmatch(tokens[i]):
            raise InvalidModelError(
                f"{file}: token {i} {tokens[i]!r} has type BYTE in '{Keys.Tokenizer.TOKEN_TYPE}' but is not "
                "spelled <0xXX> (re-convert the model)"
            )


def _check_byte_fallback(tokens: set[bytes], file: str) -> None:
    """SentencePiece spells text it has no piece for as byte tokens; llama.cpp aborts on a byte it cannot find."""
    for b in range(256):
        if f"<0x{b:02X}>".encode() not in tokens and bytes([b]) not in tokens:
            raise InvalidModelError(
                f"{file}: the SentencePiece vocabulary lacks the byte token <0x{b:02X}>, so llama.cpp would abort on "
                "text with that byte (re-convert the model)"
            )
