"""The reference backend: ``models/reference.py``'s numpy forward pass behind the backend contract.

It is the ground truth, not a fast path: float32 weights (about 4x the file size of a Q4
model in RAM) and numpy's BLAS threads. Keys and values are cached in float16, as llama.cpp's
default cache stores them, or in float32, in one pool of cells that sequences share as
llama.cpp's unified cache does. Sliding-window layers keep every position's keys too (llama.cpp
drops those that left the window): each query sees only its window of them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import numpy as np

from edgeinfer.errors import BackendUnavailableError
from edgeinfer.models.info import ModelInfo
from edgeinfer.models.reference import Transformer, attention, causal, gguf_weights
from edgeinfer.pages import lazy_zeros
from edgeinfer.system import BASE_OVERHEAD_BYTES, MemoryNeed

from .base import CPU, BackendOptions, Device, Span, check_spans, compute_bytes
from .cells import CellPool, PooledBackend


class ReferenceBackend(PooledBackend):
    """Plain numpy over the dequantized GGUF weights."""

    name: ClassVar[str] = "reference"
    kv_block: ClassVar[int] = 1
    kv_types: ClassVar[tuple[str, ...]] = ("f16", "f32")
    shares_cells: ClassVar[bool] = True
    loads_llamacpp: ClassVar[bool] = False
    follows: ClassVar[bool] = False
    _KV_DTYPES: ClassVar[dict[str, type]] = {"f16": np.float16, "f32": np.float32}

    @classmethod
    def supports(cls, info: ModelInfo) -> str | None:
        if not info.hparams.arch.reference:
            return f"the reference backend does not implement the {info.architecture} architecture"
        if info.hparams.rope_scaling != "none":  # Llama 3's frequency factors (rope_freqs.weight) it does apply
            return (
                f"{info.path.name} scales RoPE for a longer context ({info.hparams.rope_scaling}), "
                "which the reference backend does not do"
            )
        return None

    @classmethod
    def devices(cls) -> list[Device]:
        return [Device(CPU, "the CPU, through numpy")]

    @classmethod
    def kv_bytes_per_token(cls, info: ModelInfo, kv_type: str) -> float:
        return info.kv_values_per_token * np.dtype(cls._KV_DTYPES[kv_type]).itemsize

    @classmethod
    def memory(cls, info: ModelInfo, options: BackendOptions) -> MemoryNeed:
        weights = 4 * sum(int(np.prod(t.shape, dtype=np.int64)) for t in info.tensors)  # all dequantized to f32
        kv = int(options.kv_tokens * cls.kv_bytes_per_token(info, options.kv_type))
        return MemoryNeed(weights=weights, kv=kv, overhead=BASE_OVERHEAD_BYTES + compute_bytes(info, options))

    def __init__(self, info: ModelInfo, options: BackendOptions) -> None:
        reason = self.supports(info)
        if reason is not None:
            raise BackendUnavailableError(f"the reference backend cannot run this model: {reason}")
        hp = info.hparams
        self.model = Transformer(hp, gguf_weights(info))
        self._n_vocab = hp.n_vocab
        shape = (hp.n_layer, options.kv_tokens, hp.n_head_kv, hp.head_dim)
        dtype = self._KV_DTYPES[options.kv_type]
        self._k, self._v = lazy_zeros(shape, dtype), lazy_zeros(shape, dtype)  # RAM as cells fill
        self._pool = CellPool(options.kv_tokens, options.n_seq)
        self._pending: list[tuple[int, slice, np.ndarray]] = []  # during eval: (seq, its rows, its new cells)
        self._closed = False

    @property
    def n_vocab(self) -> int:
        return self._n_vocab

    def eval(self, spans: Sequence[Span]) -> list[np.ndarray]:
        self._check_open()
        check_spans(spans, self._pool.lengths(), self._n_vocab)
        tokens: list[int] = []
        positions: list[int] = []
        row_slices = []
        for span, cells in zip(spans, self._pool.take(spans), strict=True):
            rows = slice(len(tokens), len(tokens) + len(span.tokens))
            row_slices.append(rows)
            self._pending.append((span.seq, rows, cells))
            tokens.extend(span.tokens)
            positions.extend(range(span.start, span.start + len(span.tokens)))
        try:
            logits = self.model.forward(tokens, np.asarray(positions), self)
        except BaseException:
            for span in spans:  # a failed evaluation changes nothing
                self.truncate(span.seq, span.start)
            raise
        finally:
            self._pending = []
        return [
            logits[rows] if span.all_logits else logits[rows.stop - 1]
            for span, rows in zip(spans, row_slices, strict=True)
        ]

    def attend(self, layer: int, q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
        """The ``KVCache`` side: store the new keys in their cells; each sequence attends to its own cells
        (a sequence's cells are its positions 0, 1, ...), within the layer's sliding window if it has one."""
        window = self.model.hp.window(layer)
        out = np.empty_like(q)
        for seq, rows, cells in self._pending:
            self._k[layer, cells] = k[rows]
            self._v[layer, cells] = v[rows]
            held = self._pool.cells(seq)
            keys = self._k[layer, held].astype(np.float32)
            values = self._v[layer, held].astype(np.float32)
            n = rows.stop - rows.start
            out[rows] = attention(q[rows], keys, values, causal(n, len(held) - n, window))
        return out

    def evict(self, seq: int, start: int, end: int) -> None:
        self._check_open()
        kept = self._pool.evict(seq, start, end)
        # Rotating by -(end - start) positions moves the keys' RoPE to their new places.
        back = np.full(len(kept), start - end)
        for layer in range(self.model.hp.n_layer):
            self._k[layer, kept] = self.model.rope(self._k[layer, kept].astype(np.float32), back, layer)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        del self.model  # the weights
        self._k = self._v = np.zeros(0)
