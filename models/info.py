"""What the engine needs to know about a model before loading it, read from the GGUF header."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edgeinfer.errors import InvalidModelError
from edgeinfer.models.gguf_file import GGUFHeader, SkippedArray, read_header

# Bytes one cached K or V element takes, by KV cache type. q8_0 stores 32 values in 34 bytes.
KV_TYPE_BYTES: dict[str, float] = {"f16": 2.0, "q8_0": 34 / 32}


@dataclass(frozen=True)
class ModelInfo:
    """A model's architecture and size, as its GGUF header states them."""

    path: Path
    name: str
    architecture: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: tuple[int, ...]  # per layer: some architectures vary it
    head_dim_k: int
    head_dim_v: int
    n_ctx_train: int
    n_vocab: int
    chat_template: str | None
    file_size: int
    tensor_types: dict[str, int]  # ggml type name -> tensor count

    def kv_bytes_per_token(self, kv_type: str = "f16") -> float:
        """Bytes of KV cache one token takes: K and V, every layer, every KV head."""
        return sum(n * (self.head_dim_k + self.head_dim_v) for n in self.n_head_kv) * KV_TYPE_BYTES[kv_type]


def load_model_info(path: str | Path) -> ModelInfo:
    """Read and check the header of the GGUF at ``path``."""
    return model_info_from_header(read_header(path))


def model_info_from_header(header: GGUFHeader) -> ModelInfo:
    meta = header.metadata

    def need(key: str, kind: type | tuple[type, ...] = int) -> Any:
        if key not in meta:
            raise InvalidModelError(f"{header.path.name} lacks the metadata key '{key}' (re-convert the model)")
        value = meta[key]
        if not isinstance(value, kind) or isinstance(value, bool) or (isinstance(value, int) and value <= 0):
            raise InvalidModelError(f"{header.path.name}: metadata '{key}' = {value!r} is not valid")
        return value

    arch = need("general.architecture", str)
    n_layer = need(f"{arch}.block_count")
    n_embd = need(f"{arch}.embedding_length")
    n_head = need(f"{arch}.attention.head_count")
    head_kv = meta.get(f"{arch}.attention.head_count_kv", n_head)
    n_head_kv = tuple(head_kv) if isinstance(head_kv, list) else (head_kv,) * n_layer
    if len(n_head_kv) != n_layer or not all(isinstance(n, int) and n >= 0 for n in n_head_kv) or not any(n_head_kv):
        raise InvalidModelError(
            f"{header.path.name}: metadata '{arch}.attention.head_count_kv' = {head_kv!r} is not valid"
        )
    head_dim_k = meta.get(f"{arch}.attention.key_length", n_embd // n_head)
    head_dim_v = meta.get(f"{arch}.attention.value_length", head_dim_k)
    if not all(isinstance(d, int) and d > 0 for d in (head_dim_k, head_dim_v)):
        raise InvalidModelError(
            f"{header.path.name}: attention head dimensions {head_dim_k}/{head_dim_v} are not valid"
        )
    tokens = meta.get("tokenizer.ggml.tokens")
    n_vocab = meta.get(f"{arch}.vocab_size") or (
        tokens.count if isinstance(tokens, SkippedArray) else len(tokens or ())
    )
    if not n_vocab:
        raise InvalidModelError(f"{header.path.name} has no vocabulary (tokenizer.ggml.tokens); re-convert the model")
    template = meta.get("tokenizer.chat_template")
    return ModelInfo(
        path=header.path,
        name=str(meta.get("general.name") or header.path.stem),
        architecture=arch,
        n_layer=n_layer,
        n_embd=n_embd,
        n_head=n_head,
        n_head_kv=n_head_kv,
        head_dim_k=int(head_dim_k),
        head_dim_v=int(head_dim_v),
        n_ctx_train=need(f"{arch}.context_length"),
        n_vocab=int(n_vocab),
        chat_template=template if isinstance(template, str) else None,
        file_size=header.file_size,
        tensor_types=dict(Counter(t.type.name for t in header.tensors)),
    )
