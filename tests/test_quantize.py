"""edgeinfer.converters.quantize: ggml's quantizers through ctypes, gguf-py's numpy ones without it."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import quants as gguf_quants

from edgeinfer.converters.quantize import NUMPY_TYPES, dequantize, quantize, row_bytes, row_type
from edgeinfer.errors import ConversionError

K_QUANTS = [Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K]


def name(qtype: Q) -> str:
    return qtype.name


def weights(n_rows: int, n_cols: int, seed: int = 0) -> np.ndarray:
    """Heavy-tailed rows with columns of different scale, as in a real weight matrix."""
    rng = np.random.default_rng(seed)
    return (rng.standard_t(5, (n_rows, n_cols)) * rng.uniform(0.01, 0.05, n_cols)).astype(np.float32)


def relative_error(rows: np.ndarray, qtype: Q, importance: np.ndarray | None = None) -> float:
    restored = dequantize(quantize(rows, qtype, importance), qtype)
    return float(np.sqrt(((restored - rows) ** 2).mean() / (rows**2).mean()))


@pytest.mark.parametrize("qtype", sorted(NUMPY_TYPES), ids=name)
def test_ggml_writes_the_same_bytes_as_gguf_py(qtype: Q) -> None:
    rows = weights(96, 576)
    rows[3, :64] = 0.0  # all-zero blocks take the quantizers' special case
    ours = quantize(rows, qtype, backend="ggml")
    assert ours.dtype == np.uint8 and ours.shape == (96, row_bytes(qtype, 576))
    assert np.array_equal(ours, quantize(rows, qtype, backend="numpy"))


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q8_0, *K_QUANTS, Q.IQ4_NL], ids=name)
def test_dequantize_decodes_like_gguf_py(qtype: Q) -> None:
    raw = quantize(weights(64, 512), qtype)
    assert np.array_equal(dequantize(raw, qtype), gguf_quants.dequantize(raw, qtype))


def test_k_quants_round_trip_more_closely_than_the_legacy_types_of_the_same_bits() -> None:
    rows = weights(128, 512)
    errors = {qtype: relative_error(rows, qtype) for qtype in [*K_QUANTS, Q.Q4_0, Q.Q5_0, Q.Q8_0]}
    assert errors[Q.Q6_K] < errors[Q.Q5_K] < errors[Q.Q4_K] < errors[Q.Q3_K] < errors[Q.Q2_K] < 0.35
    assert errors[Q.Q4_K] < errors[Q.Q4_0] < 0.12
    assert errors[Q.Q5_K] < errors[Q.Q5_0]
    assert errors[Q.Q6_K] < 0.03 and errors[Q.Q8_0] < 0.01


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q5_1, Q.Q3_K, Q.Q4_K, Q.IQ4_NL], ids=name)
def test_importance_lowers_the_error_where_it_is_high(qtype: Q) -> None:
    rows = weights(128, 512)
    importance = np.ones(512, dtype=np.float32)
    importance[::8] = 100.0
    plain = (dequantize(quantize(rows, qtype), qtype) - rows) ** 2
    weighted = (dequantize(quantize(rows, qtype, importance), qtype) - rows) ** 2
    assert weighted[:, ::8].mean() < 0.8 * plain[:, ::8].mean()
    assert (weighted * importance).mean() < (plain * importance).mean()


def test_columns_of_zero_importance_are_still_quantized() -> None:
    rows = weights(32, 512)
    importance = np.zeros(512, dtype=np.float32)
    importance[256:] = 1.0  # the first 256-value block has no weight at all
    assert relative_error(rows, Q.Q4_K, importance) < 0.1
    assert relative_error(rows, Q.Q4_K, np.zeros(512, dtype=np.float32)) < 0.1


def test_threads_split_rows_without_changing_the_bytes() -> None:
    rows = weights(1000, 256)
    importance = np.random.default_rng(1).gamma(1.0, 1.0, 256).astype(np.float32)
    single = quantize(rows, Q.Q4_K, importance, threads=1)
    assert np.array_equal(quantize(rows, Q.Q4_K, importance, threads=2), single)
    assert np.array_equal(quantize(rows, Q.Q4_K, importance, threads=7), single)


def test_row_type_falls_back_as_llama_cpp_does() -> None:
    # SmolLM2's hidden size 576 and a 320-wide head: not multiples of 256.
    assert row_type(Q.Q4_K, 576) == Q.Q5_0
    assert row_type(Q.Q5_K, 576) == Q.Q5_1
    assert row_type(Q.Q6_K, 320) == Q.Q8_0
    assert row_type(Q.Q2_K, 576) == row_type(Q.Q3_K, 320) == Q.Q4_0
    assert row_type(Q.IQ4_XS, 576) == Q.IQ4_NL
    assert row_type(Q.Q4_K, 1536) == Q.Q4_K and row_type(Q.Q4_0, 576) == Q.Q4_0
    assert row_type(Q.Q4_K, 100) == row_type(Q.Q4_0, 100) == Q.F16  # not even 32-wide blocks fit
    assert row_bytes(Q.Q4_K, 512) == 288 and row_bytes(Q.Q4_0, 576) == 324 and row_bytes(Q.F16, 100) == 200
    with pytest.raises(ConversionError, match="Q5_0"):
        quantize(weights(4, 576), Q.Q4_K)


def test_numpy_backend_round_trips_without_ggml() -> None:
    rows = weights(64, 320)
    for qtype in NUMPY_TYPES:
        restored = dequantize(quantize(rows, qtype, backend="numpy"), qtype)
        assert np.sqrt(((restored - rows) ** 2).mean() / (rows**2).mean()) < 0.12


def test_a_type_only_ggml_quantizes_is_a_clear_error_without_it() -> None:
    with pytest.raises(ConversionError, match=r"Q4_K needs ggml.*pip install llama-cpp-python"):
        quantize(weights(4, 256), Q.Q4_K, backend="numpy")


def test_types_that_need_an_importance_matrix_refuse_to_run_without_one() -> None:
    rows = weights(16, 256)
    with pytest.raises(ConversionError, match="IQ2_XXS needs an importance matrix"):
        quantize(rows, Q.IQ2_XXS)
    importance = np.ones(256, dtype=np.float32)
    assert relative_error(rows, Q.IQ2_XXS, importance) < 0.5


@pytest.mark.parametrize(
    ("rows", "qtype", "importance", "message"),
    [
        (np.full((4, 64), np.nan, dtype=np.float32), Q.Q4_0, None, "NaN"),
        (weights(4, 64) * 1e6, Q.F16, None, "overflowed float16"),
        (weights(4, 64), Q.Q4_0, np.ones(32), "64 finite non-negative"),
        (weights(4, 64), Q.Q8_1, None, "cannot quantize to Q8_1"),
        (np.zeros(64, dtype=np.float32), Q.Q4_0, None, "2-D"),
    ],
    ids=["nan", "f16-overflow", "importance-length", "unsupported-type", "1-d"],
)
def test_bad_input_is_a_one_line_error(rows: np.ndarray, qtype: Q, importance: np.ndarray | None, message: str) -> None:
    with pytest.raises(ConversionError, match=message):
        quantize(rows, qtype, importance)
