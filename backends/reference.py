"""The reference backend: ``models/reference.py``'s numpy forward pass behind the backend contract.

It is the ground truth, not a fast path: float32 weights (about 4x the file size of a Q4
model in RAM) and numpy's BLAS threads. Keys and values are cached in float16, as llama.cpp's
default cache stores them, or in float32.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import numpy as np
from gguf import MODEL_TENSOR

from edgeinfer.errors import BackendError, InvalidOptionError
from edgeinfer.models.arch import tensor_name
from edgeinfer.models.info import ModelInfo
from edgeinfer.models.reference import LayerCache, Transformer, gguf_weights

from .base import BackendOptions


class ReferenceBackend:
    """Plain numpy over the dequantized GGUF weights."""

    name: ClassVar[str] = "reference"
    kv_block: ClassVar[int] = 1
    kv_types: ClassVar[tuple[str, ...]] = ("f16", "f32")

    def __init__(self, info: ModelInfo, options: BackendOptions) -> None:
        hp = info.hparams
        if hp.rope_scaling != "none" or any(t.name == tensor_name(MODEL_TENSOR.ROPE_FREQS) for t in info.tensors):
            raise InvalidOptionError(
                f"{info.path.name} scales RoPE for a longer context, which the reference backend does not do; "
                "use --backend llamacpp"
            )
        self.model = Transformer(hp, gguf_weights(info))
        self._capacity = options.kv_tokens
        shape = (options.kv_tokens, hp.n_head_kv, hp.head_dim)
        dtype = np.float16 if options.kv_type == "f16" else np.float32
        self.caches = [LayerCache(np.zeros(shape, dtype), np.zeros(shape, dtype)) for _ in range(hp.n_layer)]

    @staticmethod
    def weight_bytes(info: ModelInfo) -> int:
        return 4 * sum(int(np.prod(t.shape, dtype=np.int64)) for t in info.tensors)

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def can_shift(self) -> bool:
        return True

    @property
    def n_vocab(self) -> int:
        return self.model.hp.n_vocab

    @property
    def length(self) -> int:
        return self.caches[0].length

    def eval(self, tokens: Sequence[int], start: int, *, all_logits: bool = False) -> np.ndarray:
        if start != self.length or start + len(tokens) > self._capacity:
            raise BackendError(
                f"cannot evaluate {len(tokens)} tokens at position {start}: "
                f"the cache holds {self.length} of {self._capacity}"
            )
        logits = self.model.forward(tokens, np.arange(start, start + len(tokens)), self.caches)
        return logits if all_logits else logits[-1]

    def truncate(self, n: int) -> None:
        for cache in self.caches:
            cache.length = min(cache.length, n)

    def evict(self, start: int, end: int) -> None:
        shift = end - start
        for cache in self.caches:
            n = cache.length
            kept_k = cache.k[end:n].astype(np.float32)
            # Rotating by -shift positions moves the keys' RoPE to their new places.
            cache.k[start : n - shift] = self.model.rope(kept_k, np.full(n - end, -shift))
            cache.v[start : n - shift] = cache.v[end:n]
            cache.length = n - shift

    def close(self) -> None:
        del self.model  # the weights
        self.caches = []
