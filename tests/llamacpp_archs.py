"""Tiny GGUF models of architectures that llama.cpp runs and edgeinfer's reference does not.

Each starts from a tiny llama model (tests/tiny_model.py) and keeps its vocabulary: ``granite``
is llama's layout with four scale keys of its own; ``mamba`` swaps attention for selective state
space layers, a recurrent state that cannot drop old tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFReader, GGUFValueType, GGUFWriter
from tiny_model import write_tiny_gguf

LLAMA_KEYS = "llama."


def _fields(reader: GGUFReader) -> Iterator[tuple[str, Any, GGUFValueType, GGUFValueType | None]]:
    """Every metadata key of ``reader`` but the header's and the architecture, with its value and types."""
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        kind = field.types[0]
        yield key, field.contents(), kind, field.types[-1] if kind == GGUFValueType.ARRAY else None


def _rewrite(
    source: Path,
    path: Path,
    arch: str,
    keys: Callable[[str], str | None],
    extra: Mapping[str, Any],
    tensors: Mapping[str, np.ndarray] | None = None,
) -> Path:
    """``source`` as ``arch``: each key renamed by ``keys`` (None drops it), ``extra`` keys added, and
    ``tensors`` (numpy order) in place of the source's when given."""
    reader = GGUFReader(source)
    writer = GGUFWriter(path, arch)
    for key, value, kind, sub in _fields(reader):
        new = keys(key)
        if new is not None:
            writer.add_key_value(new, value, kind, sub_type=sub)
    for key, value in extra.items():
        if isinstance(value, list):
            writer.add_key_value(key, value, GGUFValueType.ARRAY, sub_type=GGUFValueType.UINT32)
        else:
            writer.add_key_value(
                key, value, GGUFValueType.FLOAT32 if isinstance(value, float) else GGUFValueType.UINT32
            )
    if tensors is None:
        for t in reader.tensors:
            writer.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
    else:
        for name, data in tensors.items():
            writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_tiny_granite(path: Path, *, kv_heads: list[int] | None = None, **options: Any) -> Path:
    """A tiny IBM Granite model: llama's tensors, plus its embedding, residual, attention and logit scales.

    ``kv_heads`` gives each layer its own KV head count, as an array llama.cpp reads per layer.
    """
    source = write_tiny_gguf(path.with_suffix(".llama.gguf"), arch="llama", **options)
    extra: dict[str, Any] = {
        "granite.embedding_scale": 2.0,
        "granite.residual_scale": 0.5,
        "granite.attention.scale": 0.125,
        "granite.logit_scale": 4.0,
    }
    if kv_heads is not None:
        extra["granite.attention.head_count_kv"] = kv_heads

    def rename(key: str) -> str | None:
        if key == "llama.attention.head_count_kv" and kv_heads is not None:
            return None
        return "granite." + key.removeprefix(LLAMA_KEYS) if key.startswith(LLAMA_KEYS) else key

    out = _rewrite(source, path, "granite", rename, extra)
    source.unlink()
    return out


def write_tiny_mamba(path: Path, *, n_layer: int = 2, n_embd: int = 64, seed: int = 0) -> Path:
    """A tiny Mamba model: each layer a selective state space block, no attention and so no KV cache."""
    source = write_tiny_gguf(path.with_suffix(".llama.gguf"), arch="llama", n_layer=n_layer, n_embd=n_embd)
    n_vocab = next(int(t.shape[1]) for t in GGUFReader(source).tensors if t.name == "token_embd.weight")
    d_inner, d_state, d_conv, dt_rank = 2 * n_embd, 8, 4, 8
    rng = np.random.default_rng(seed)

    def weights(*shape: int, scale: float = 0.05) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    tensors = {"token_embd.weight": weights(n_vocab, n_embd, scale=0.5)}
    for i in range(n_layer):
        b = f"blk.{i}."
        tensors |= {
            b + "attn_norm.weight": np.ones(n_embd, np.float32),
            b + "ssm_in.weight": weights(2 * d_inner, n_embd),
            b + "ssm_conv1d.weight": weights(d_inner, d_conv, scale=0.3),
            b + "ssm_conv1d.bias": weights(d_inner),
            b + "ssm_x.weight": weights(dt_rank + 2 * d_state, d_inner),
            b + "ssm_dt.weight": weights(d_inner, dt_rank),
            b + "ssm_dt.bias": weights(d_inner),
            # A = -exp(a): negative, so the state decays (what Mamba's A_log stores, sign included).
            b + "ssm_a": -np.tile(np.arange(1, d_state + 1, dtype=np.float32), (d_inner, 1)),
            b + "ssm_d": np.ones(d_inner, np.float32),
            b + "ssm_out.weight": weights(n_embd, d_inner),
        }
    tensors["output_norm.weight"] = np.ones(n_embd, np.float32)
    kept = ("llama.context_length", "llama.embedding_length", "llama.block_count")

    def rename(key: str) -> str | None:
        if key.startswith(LLAMA_KEYS):
            return "mamba." + key.removeprefix(LLAMA_KEYS) if key in kept else None
        return None if key == "tokenizer.chat_template" else key

    extra = {
        "mamba.ssm.conv_kernel": d_conv,
        "mamba.ssm.inner_size": d_inner,
        "mamba.ssm.state_size": d_state,
        "mamba.ssm.time_step_rank": dt_rank,
        "mamba.attention.layer_norm_rms_epsilon": 1e-5,
    }
    out = _rewrite(source, path, "mamba", rename, extra, tensors)
    source.unlink()
    return out
