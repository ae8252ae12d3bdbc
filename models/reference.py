"""The reference transformer: a plain numpy forward pass that every backend is checked against.

It computes in float32 over dequantized weights, in the tensor layout GGUF stores, for
every architecture in ``models/arch.py``. Readable top to bottom, one block at a time:

    model = Transformer(hparams, gguf_weights(info))
    x = model.embed(tokens)
    for layer in range(hparams.n_layer):
        x = model.block(layer, x, positions)          # causal attention over x
    logits = model.head(x)

The architectures share one block; where they differ, the ``Architecture`` flags say how (Q/K
norms, post-norms, the FFN's activation, scaled embeddings) and ``HParams`` says with what
(sliding-window layers and their RoPE base, Llama 3's RoPE frequency factors, the attention
scale, capped logits), as llama.cpp's graph for each architecture computes them.

``block`` also takes a ``KVCache``, which keeps keys and values and decides whom each new
token attends to (one sequence or several), and an
``observe(name, inputs)`` callback that sees the input activations of every matrix
multiplication, by weight name (what calibration needs). Weights are asked for by name
when used, so a caller that loads them one layer at a time holds one layer in memory.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np
from gguf import MODEL_TENSOR

from edgeinfer.models.arch import HParams, RopeStyle, tensor_name
from edgeinfer.models.info import ModelInfo
from edgeinfer.models.tensors import open_tensors

Weights = Callable[[str], np.ndarray]
"""Returns a tensor by GGUF name as float32, in numpy order: a projection is ``(n_out, n_in)``."""
Observer = Callable[[str, np.ndarray], None]
"""Called with a weight's name and the ``(n_tokens, n_in)`` activations it is about to multiply."""

_BIASED = (MODEL_TENSOR.ATTN_Q, MODEL_TENSOR.ATTN_K, MODEL_TENSOR.ATTN_V)  # where qkv_bias adds a bias


def gguf_weights(info: ModelInfo) -> dict[str, np.ndarray]:
    """Every tensor of a GGUF file as float32 in numpy order, dequantized by gguf-py."""
    with open_tensors(info) as tensors:
        return {name: tensors.dequantize(name) for name in tensors}


class KVCache(Protocol):
    """Where a forward pass keeps keys and values, and which of them each new query sees."""

    def attend(self, layer: int, q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
        """Store the new tokens' keys ``k`` (already rotated) and values ``v``, ``(n, kv heads, d)``, of ``layer``;
        return the attention ``(n, heads, d)`` of the queries ``q`` (rotated and scaled) over the cached keys
        each one may see: ``causal``'s rule, with ``layer``'s sliding window (``HParams.window``)."""
        ...


class Transformer:
    """A decoder-only transformer (every architecture in ``models/arch.py``) over named weights."""

    def __init__(self, hparams: HParams, weights: Weights | dict[str, np.ndarray]) -> None:
        self.hp = hparams
        self.weights: Weights = weights.__getitem__ if isinstance(weights, dict) else weights
        half = hparams.head_dim // 2
        # Llama 3.1's RoPE scaling divides each rotated pair's frequency by its factor.
        factors = self.weights(tensor_name(MODEL_TENSOR.ROPE_FREQS)).astype(np.float64) if hparams.rope_freqs else 1.0
        # Each layer's frequencies: sliding-window layers may rotate with a base of their own.
        self.inv_freq = [
            hparams.layer_rope_base(layer) ** (-np.arange(half, dtype=np.float64) / half) / factors
            for layer in range(hparams.n_layer)
        ]
        scale = hparams.attn_scale if hparams.attn_scale is not None else 1 / math.sqrt(hparams.head_dim)
        self.attn_scale = np.float32(scale)
        self.activation = {"silu": silu, "gelu": gelu}[hparams.arch.ffn_act]

    def forward(self, tokens: Sequence[int], positions: np.ndarray, cache: KVCache | None = None) -> np.ndarray:
        """Logits ``(len(tokens), n_vocab)`` for tokens at ``positions``, kept in ``cache`` if given.

        The tokens may belong to several sequences: ``cache`` knows which, and whom each attends to.
        """
        x = self.embed(tokens)
        for layer in range(self.hp.n_layer):
            x = self.block(layer, x, positions, cache)
        return self.head(x)

    def embed(self, tokens: Sequence[int]) -> np.ndarray:
        x = self.weights(tensor_name(MODEL_TENSOR.TOKEN_EMBD))[np.asarray(tokens)]
        return x * np.float32(math.sqrt(self.hp.n_embd)) if self.hp.arch.embed_scale else x

    def block(
        self,
        layer: int,
        x: np.ndarray,
        positions: np.ndarray,
        cache: KVCache | None = None,
        observe: Observer | None = None,
    ) -> np.ndarray:
        """One transformer block. Without a cache, ``x`` is one sequence and attends causally to itself alone."""
        hp, arch = self.hp, self.hp.arch

        def weight(kind: MODEL_TENSOR, suffix: str = "weight") -> np.ndarray:
            return self.weights(tensor_name(kind, layer, suffix))

        def norm(kind: MODEL_TENSOR, h: np.ndarray) -> np.ndarray:
            return rms_norm(h, weight(kind), hp.rms_eps)

        def project(kind: MODEL_TENSOR, h: np.ndarray) -> np.ndarray:
            if observe is not None:
                observe(tensor_name(kind, layer), h)
            out = h @ weight(kind).T
            return out + weight(kind, "bias") if arch.qkv_bias and kind in _BIASED else out

        n = len(x)
        h = norm(MODEL_TENSOR.ATTN_NORM, x)
        q = project(MODEL_TENSOR.ATTN_Q, h).reshape(n, hp.n_head, hp.head_dim)
        k = project(MODEL_TENSOR.ATTN_K, h).reshape(n, hp.n_head_kv, hp.head_dim)
        v = project(MODEL_TENSOR.ATTN_V, h).reshape(n, hp.n_head_kv, hp.head_dim)
        if arch.qk_norm:  # over each head's own vector, before RoPE
            q, k = norm(MODEL_TENSOR.ATTN_Q_NORM, q), norm(MODEL_TENSOR.ATTN_K_NORM, k)
        q = self.rope(q, positions, layer) * self.attn_scale
        k = self.rope(k, positions, layer)
        if cache is None:
            attended = attention(q, k, v, causal(n, window=hp.window(layer)))
        else:
            attended = cache.attend(layer, q, k, v)
        out = project(MODEL_TENSOR.ATTN_OUT, attended.reshape(n, hp.q_dim))
        x = x + (norm(MODEL_TENSOR.ATTN_POST_NORM, out) if arch.post_norms else out)

        h = norm(MODEL_TENSOR.FFN_NORM, x)
        gate, up = project(MODEL_TENSOR.FFN_GATE, h), project(MODEL_TENSOR.FFN_UP, h)
        out = project(MODEL_TENSOR.FFN_DOWN, self.activation(gate) * up)
        return x + (norm(MODEL_TENSOR.FFN_POST_NORM, out) if arch.post_norms else out)

    def head(self, x: np.ndarray) -> np.ndarray:
        h = rms_norm(x, self.weights(tensor_name(MODEL_TENSOR.OUTPUT_NORM)), self.hp.rms_eps)
        out = MODEL_TENSOR.TOKEN_EMBD if self.hp.tied_embeddings else MODEL_TENSOR.OUTPUT
        logits = h @ self.weights(tensor_name(out)).T
        cap = np.float32(self.hp.logit_softcap)
        return cap * np.tanh(logits / cap) if cap else logits

    def rope(self, x: np.ndarray, positions: np.ndarray, layer: int) -> np.ndarray:
        """Rotate ``layer``'s ``(n, heads, head_dim)`` vectors by their positions (negative ones rotate back)."""
        angles = np.asarray(positions, dtype=np.float64)[:, None] * self.inv_freq[layer]
        return rotate(x, angles, self.hp.arch.rope_style)


def rotate(x: np.ndarray, angles: np.ndarray, style: RopeStyle) -> np.ndarray:
    """RoPE: rotate pairs of ``x`` (n, heads, d) by ``angles`` (n, d/2)."""
    cos = np.cos(angles)[:, None, :].astype(np.float32)
    sin = np.sin(angles)[:, None, :].astype(np.float32)
    half = x.shape[-1] // 2
    if style == "norm":  # pairs (x0, x1), (x2, x3), ...
        a, b = x[..., 0::2], x[..., 1::2]
    else:  # neox: pairs (x_i, x_{i + d/2})
        a, b = x[..., :half], x[..., half:]
    ra, rb = a * cos - b * sin, a * sin + b * cos
    out = np.empty_like(x)
    if style == "norm":
        out[..., 0::2], out[..., 1::2] = ra, rb
    else:
        out[..., :half], out[..., half:] = ra, rb
    return out


def causal(n: int, past: int = 0, window: int = 0) -> np.ndarray:
    """Which of ``past + n`` keys (positions 0, 1, ...) each of ``n`` new queries (positions past, past + 1, ...)
    sees: those at its position or before and, with a sliding ``window``, fewer than ``window`` positions back."""
    keys, queries = np.arange(past + n)[None, :], past + np.arange(n)[:, None]
    visible = keys <= queries
    return visible & (queries - keys < window) if window else visible


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, visible: np.ndarray) -> np.ndarray:
    """Grouped-query attention of ``n`` queries, already scaled, over the keys ``visible[i]`` lets query ``i`` see;
    ``(n, heads, d)``."""
    n, n_head, d = q.shape
    n_kv = k.shape[1]
    group = n_head // n_kv
    qg = q.reshape(n, n_kv, group, d).transpose(1, 2, 0, 3)  # (kv head, group, n, d)
    scores = qg @ k.transpose(1, 2, 0)[:, None]  # (kv head, group, n, past + n)
    scores = np.where(visible, scores, -np.inf)
    probs = softmax(scores)
    out = probs @ v.transpose(1, 0, 2)[:, None]  # (kv head, group, n, d)
    return out.transpose(2, 0, 1, 3).reshape(n, n_head, d)


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def silu(x: np.ndarray) -> np.ndarray:
    return x * (0.5 + 0.5 * np.tanh(0.5 * x))  # x * sigmoid(x), without exp's overflow


def gelu(x: np.ndarray) -> np.ndarray:
    """GELU's tanh approximation, the one Gemma was trained with (PyTorch's gelu_pytorch_tanh) and llama.cpp runs."""
    return 0.5 * x * (1 + np.tanh(np.float32(math.sqrt(2 / math.pi)) * (x + np.float32(0.044715) * x * x * x)))


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)
