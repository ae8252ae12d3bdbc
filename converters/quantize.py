"""Quantize weight rows with ggml's own quantizers, the ones llama.cpp's llama-quantize uses.

They are called through ctypes in the libggml-base that llama-cpp-python ships, so the bytes are
exactly what llama.cpp would write, including its importance-weighted (imatrix) variants. Where that
library cannot be loaded, gguf-py's numpy quantizers cover the float types and the 32-wide legacy
quants (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1), without importance weighting.
"""

from __future__ import annotations

import ctypes
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from typing import Literal

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as gguf_quants

from edgeinfer.errors import ConversionError
from edgeinfer.system import llama_cpp_library, thread_count

Q = GGMLQuantizationType
Backend = Literal["auto", "ggml", "numpy"]

# The types llama.cpp's llama-quantize writes for weights (not its activation-only Q8_1/Q8_K,
# nor the model-specific ternary and FP4 formats).
SUPPORTED = frozenset(
    {Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K}
    | {Q.IQ4_NL, Q.IQ4_XS, Q.IQ3_S, Q.IQ3_XXS, Q.IQ2_S, Q.IQ2_XS, Q.IQ2_XXS, Q.IQ1_M, Q.IQ1_S}
)
NUMPY_TYPES = frozenset({Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1})

# What llama.cpp quantizes a tensor to when its rows are not a whole number of the target's
# blocks (tensor_type_fallback in src/llama-quant.cpp); F16 when even that does not fit.
_FALLBACK = {
    **dict.fromkeys((Q.IQ1_S, Q.IQ1_M, Q.IQ2_XXS, Q.IQ2_XS, Q.IQ2_S, Q.IQ3_XXS, Q.IQ3_S, Q.IQ4_XS), Q.IQ4_NL),
    Q.Q2_K: Q.Q4_0,
    Q.Q3_K: Q.Q4_0,
    Q.Q4_K: Q.Q5_0,
    Q.Q5_K: Q.Q5_1,
    Q.Q6_K: Q.Q8_0,
}

# Below this many values a thread costs more than it saves. The legacy types' and floats' plain
# (unweighted) quantizers run at memory speed, so they get one thread whatever the size: a second
# made Q4_0 slower (scripts/bench_quantize.py).
_MIN_VALUES_PER_THREAD = 1 << 16


class _TypeTraits(ctypes.Structure):
    # struct ggml_type_traits in ggml.h
    _fields_ = [
        ("type_name", ctypes.c_char_p),
        ("blck_size", ctypes.c_int64),
        ("blck_size_interleave", ctypes.c_int64),
        ("type_size", ctypes.c_size_t),
        ("is_quantized", ctypes.c_bool),
        ("to_float", ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)),
        ("from_float_ref", ctypes.c_void_p),
    ]


@cache
def _ggml() -> ctypes.CDLL | None:
    """llama-cpp-python's libggml-base, or None where it is not installed or will not load."""
    path = llama_cpp_library("ggml-base")
    if path is None:
        return None
    try:
        lib = ctypes.CDLL(str(path))
    except OSError:
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.ggml_quantize_chunk.argtypes = [ctypes.c_int, ptr, ptr, i64, i64, i64, ptr]
    lib.ggml_quantize_chunk.restype = ctypes.c_size_t
    lib.ggml_quantize_requires_imatrix.argtypes = [ctypes.c_int]
    lib.ggml_quantize_requires_imatrix.restype = ctypes.c_bool
    lib.ggml_validate_row_data.argtypes = [ctypes.c_int, ptr, ctypes.c_size_t]
    lib.ggml_validate_row_data.restype = ctypes.c_bool
    lib.ggml_get_type_traits.argtypes = [ctypes.c_int]
    lib.ggml_get_type_traits.restype = ctypes.POINTER(_TypeTraits)
    return lib


def block_size(qtype: GGMLQuantizationType) -> int:
    """Values per block: a row's length must be a multiple of it."""
    return GGML_QUANT_SIZES[qtype][0]


def row_bytes(qtype: GGMLQuantizationType, n_cols: int) -> int:
    """Bytes one row of n_cols values takes in qtype."""
    block, size = GGML_QUANT_SIZES[qtype]
    if n_cols % block:
        raise ConversionError(
            f"rows of {n_cols} values do not split into {qtype.name}'s blocks of {block}; "
            f"quantize them as {row_type(qtype, n_cols).name} (see row_type)"
        )
    return n_cols // block * size


def row_type(qtype: GGMLQuantizationType, n_cols: int) -> GGMLQuantizationType:
    """qtype if rows of n_cols values fit its blocks, else the type llama.cpp falls back to."""
    if n_cols % block_size(qtype) == 0:
        return qtype
    fallback = _FALLBACK.get(qtype, Q.F16)
    return fallback if n_cols % block_size(fallback) == 0 else Q.F16


def available(qtype: GGMLQuantizationType) -> bool:
    """Whether ``quantize`` can produce qtype here: gguf-py's types always, the rest with ggml."""
    return qtype in NUMPY_TYPES or (qtype in SUPPORTED and _ggml() is not None)


def quantize(
    rows: np.ndarray,
    qtype: GGMLQuantizationType,
    importance: np.ndarray | None = None,
    *,
    backend: Backend = "auto",
    threads: int | None = None,
) -> np.ndarray:
    """Quantize float rows ``(n_rows, n_cols)`` to qtype's raw bytes ``(n_rows, row_bytes)`` (uint8).

    importance: per-column weights (an importance matrix: the mean squared input activation of
    each column, length n_cols); ggml's quantizers then minimise the error weighted by it. The numpy
    backend has no weighted quantizers and ignores it.
    backend: "ggml" (llama-cpp-python's libggml-base), "numpy" (gguf-py), or "auto": ggml where
    it loads. threads: ggml threads over the rows (default: ``system.thread_count``'s, every usable core).
    """
    if qtype not in SUPPORTED:
        names = ", ".join(t.name for t in sorted(SUPPORTED))
        raise ConversionError(f"cannot quantize to {qtype.name}; supported types: {names}")
    rows = np.ascontiguousarray(rows, dtype=np.float32)
    if rows.ndim != 2:
        raise ConversionError(f"quantize takes a 2-D (rows, columns) array, not shape {rows.shape}")
    n_rows, n_cols = rows.shape
    out = np.empty((n_rows, row_bytes(qtype, n_cols)), dtype=np.uint8)
    # ggml asserts (aborting the process) on NaN input to its searching quantizers.
    if not np.isfinite(rows).all():
        raise ConversionError("the tensor holds NaN or infinite values; the checkpoint is damaged")

    lib = None if backend == "numpy" else _ggml()
    if lib is None:
        if backend == "ggml":
            raise ConversionError("llama-cpp-python's libggml-base is not found; pip install llama-cpp-python")
        if qtype not in NUMPY_TYPES:
            why = (
                "the numpy backend was chosen" if backend == "numpy" else "llama-cpp-python's libggml-base is not found"
            )
            raise ConversionError(
                f"{qtype.name} needs ggml's quantizer but {why}; pip install llama-cpp-python, "
                f"or choose one of {', '.join(t.name for t in sorted(NUMPY_TYPES))}"
            )
        out[:] = np.ascontiguousarray(gguf_quants.quantize(rows, qtype)).view(np.uint8)
        return out

    weights = None
    if importance is not None:
        weights = np.ascontiguousarray(importance, dtype=np.float32)
        if weights.shape != (n_cols,) or not np.isfinite(weights).all() or (weights < 0).any():
            raise ConversionError(
                f"the importance matrix must hold {n_cols} finite non-negative values (one a column), "
                f"not shape {weights.shape}"
            )
        # A block whose columns all weigh zero would be quantized to zeros; a sliver of weight
        # makes it an unweighted block instead and leaves the others as they were.
        weights = np.maximum(weights, 1e-6 * (weights.max() or 1.0), dtype=np.float32)
    elif lib.ggml_quantize_requires_imatrix(qtype):
        raise ConversionError(f"{qtype.name} needs an importance matrix; calibrate with --calib TEXT_FILE")

    weights_ptr = None if weights is None else weights.ctypes.data
    n_threads = 1 if weights is None and qtype in NUMPY_TYPES else thread_count(threads, spinning=False)
    n_threads = max(1, min(n_threads, rows.size // _MIN_VALUES_PER_THREAD, n_rows))
    bounds = np.linspace(0, n_rows, n_threads + 1).astype(int)

    # ggml writes a chunk's rows at their offset in dst; ctypes releases the GIL for the call.
    def quantize_chunk(start: int, stop: int) -> None:
        lib.ggml_quantize_chunk(
            qtype, rows.ctypes.data, out.ctypes.data, start * n_cols, stop - start, n_cols, weights_ptr
        )

    if n_threads == 1:
        quantize_chunk(0, n_rows)
    else:
        with ThreadPoolExecutor(n_threads) as pool:
            list(pool.map(quantize_chunk, bounds[:-1], bounds[1:]))
    # As llama-quantize does: catches scales or F16 values that overflowed float16.
    if not lib.ggml_validate_row_data(qtype, out.ctypes.data, out.nbytes):
        raise ConversionError(
            f"quantizing to {qtype.name} overflowed float16 (weights beyond ±65504?); use BF16 or F32 for this tensor"
        )
    return out


def dequantize(raw: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """Raw qtype bytes ``(n_rows, row_bytes)`` back to float32 ``(n_rows, n_cols)``."""
    block, size = GGML_QUANT_SIZES[qtype]
    raw = np.ascontiguousarray(raw, dtype=np.uint8)
    if qtype not in SUPPORTED or raw.ndim != 2 or raw.shape[1] % size:
        raise ConversionError(f"cannot read {raw.shape} bytes as rows of {qtype.name} blocks ({size} bytes each)")
    lib = _ggml()
    if lib is None or qtype == Q.F32:
        return gguf_quants.dequantize(raw, qtype).astype(np.float32, copy=False)
    # ggml's own decoder: the same values as gguf-py's, 4-17x faster (scripts/bench_quantize.py).
    out = np.empty((raw.shape[0], raw.shape[1] // size * block), dtype=np.float32)
    lib.ggml_get_type_traits(qtype).contents.to_float(raw.ctypes.data, out.ctypes.data, out.size)
    return out
