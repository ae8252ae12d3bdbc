"""Tiny GGUF models for the backend conformance suite, and the measures it compares logits with.

``tiny_model.write_tiny_gguf`` draws every weight from normal(0, 0.02): its logits are almost
flat and its attention almost uniform, so a backend that lost RoPE or mixed up positions would
still agree with the reference. ``write_sharp_gguf`` scales the norm weights afterwards, in
place (norm weights are F32 vectors whatever the matrices' type): the attention norms by
``ATTN_SCALE`` multiply every attention score by its square, the output norm by ``OUTPUT_SCALE``
spreads the logits. ``poison`` writes NaN or infinity into the output norm, so every logit is
NaN; ``poison_token`` makes one token's embedding NaN, so the logits turn NaN once it is generated.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFReader
from tiny_model import write_tiny_gguf

# Measured on the tiny llama below: attention scores spread from std 0.05 to 0.9, logits from
# std 0.2 to about 2.
ATTN_SCALE = 4.0
OUTPUT_SCALE = 10.0


def write_sharp_gguf(path: str | Path, *, poison: float | None = None, **tiny: Any) -> Path:
    """``write_tiny_gguf(path, **tiny)`` with sharpened norms; ``poison`` (NaN, inf) goes into the output norm."""
    path = write_tiny_gguf(path, **tiny)
    reader = GGUFReader(path, "r+")
    for tensor in reader.tensors:
        if tensor.name.endswith("attn_norm.weight"):
            tensor.data[...] *= ATTN_SCALE
        elif tensor.name == "output_norm.weight":
            tensor.data[...] *= OUTPUT_SCALE
            if poison is not None:
                tensor.data[0] = poison
    reader.data.flush()
    del reader
    return path


def poison_token(path: str | Path, token: int, *, boost: float = 3.0) -> Path:
    """Make ``token``'s embedding NaN and its output row ``boost`` times larger (an untied F32 model, in place).

    A prompt without ``token`` gives finite logits; if ``token`` already led them, it leads by more,
    is chosen, and the next evaluation, of it, gives NaN.
    """
    reader = GGUFReader(path, "r+")
    tensors = {tensor.name: tensor for tensor in reader.tensors}
    tensors["token_embd.weight"].data[token] = np.nan
    tensors["output.weight"].data[token] *= boost
    reader.data.flush()
    del reader
    return Path(path)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = np.asarray(logits, dtype=np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def kld(p_logits: np.ndarray, q_logits: np.ndarray) -> float:
    """Mean KL(p || q) over rows, in nats; p is the ground truth."""
    p, q = log_softmax(p_logits), log_softmax(q_logits)
    return float((np.exp(p) * (p - q)).sum(axis=-1).mean())


def top1(a: np.ndarray, b: np.ndarray) -> float:
    """Share of rows whose highest logit is the same token."""
    return float((np.asarray(a).argmax(axis=-1) == np.asarray(b).argmax(axis=-1)).mean())
