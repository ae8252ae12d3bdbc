"""GGUF blocks as MatMulNBits inputs (backends/onnx/weights.py), run by real ONNX Runtime against the
float64 product with gguf-py's own dequantization."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QType
from gguf.constants import QK_K
from gguf.quants import dequantize

from edgeinfer.backends.onnx import weights
from edgeinfer.backends.onnx.weights import BLOCK, ZeroPoints, nbits
from edgeinfer.converters.quantize import available, quantize  # ggml's: gguf-py has none for K-quants

from support import load_script

RNG = np.random.default_rng(17)
bench_matmulnbits = load_script("bench_matmulnbits")  # its one-product graph
N, K = 48, 2 * QK_K


def run(weight, a: np.ndarray, accuracy_level: int = 0, residual_pass: bool = False) -> np.ndarray:
    session, _ = bench_matmulnbits.session(weight, accuracy_level, False, 1, residual_pass=residual_pass)
    return session.run(None, {"A": a})[0].astype(np.float64)


def relative_error(y: np.ndarray, expected: np.ndarray) -> float:
    return float(np.abs(y - expected).max() / np.abs(expected).max())


# Each form at two row lengths: an even count of 32-element blocks and an odd one, whose packed zero
# points end in half a byte (K-quants come in 256-element super-blocks, always an even count).
EXACT = [
    (qtype, zero_points, k)
    for qtype, zero_points, lengths in [
        (QType.Q4_0, ZeroPoints.FLOAT, (K, 3 * BLOCK)),
        (QType.Q8_0, ZeroPoints.FLOAT, (K, 3 * BLOCK)),
        (QType.Q4_1, ZeroPoints.FLOAT, (K, 3 * BLOCK)),
        (QType.Q4_1, ZeroPoints.SPLIT, (K, 3 * BLOCK)),
        (QType.Q4_K, ZeroPoints.SPLIT, (K, 3 * QK_K)),
        (QType.Q5_0, ZeroPoints.FLOAT, (K, 3 * BLOCK)),
        (QType.Q5_1, ZeroPoints.FLOAT, (K, 3 * BLOCK)),
        (QType.IQ4_NL, ZeroPoints.FLOAT, (K, 3 * BLOCK)),
        (QType.Q5_K, ZeroPoints.FLOAT, (K, 3 * QK_K)),
        (QType.Q6_K, ZeroPoints.FLOAT, (K, 3 * QK_K)),
        (QType.Q2_K, ZeroPoints.FLOAT, (K, 3 * QK_K)),
        (QType.Q3_K, ZeroPoints.FLOAT, (K, 3 * QK_K)),
        (QType.IQ4_XS, ZeroPoints.FLOAT, (K, 3 * QK_K)),
    ]
    for k in lengths
]


@pytest.mark.parametrize(("qtype", "zero_points", "k"), EXACT, ids=lambda v: getattr(v, "name", str(v)))
def test_the_exact_forms_compute_what_the_gguf_blocks_hold(qtype, zero_points, k):
    if not available(qtype):
        pytest.skip(f"{qtype.name} blocks come from ggml's quantizer, which needs llama.cpp's library")
    w = RNG.standard_normal((N, k)).astype(np.float32)
    w[:, :BLOCK] += 3.0  # a block of positive weights only: Q4_1's m > 0, its zero point negative
    raw = quantize(w, qtype)
    truth = dequantize(raw, qtype).reshape(N, k).astype(np.float64)
    weight = nbits(raw, qtype, k, zero_points)
    np.testing.assert_allclose(weight.dequantize(), truth, rtol=0, atol=1e-6 * np.abs(truth).max())
    a = RNG.standard_normal((5, k)).astype(np.float32)
    assert relative_error(run(weight, a), a.astype(np.float64) @ truth.T) <= 1e-5


@pytest.mark.parametrize(("qtype", "zero_points", "k"), [e for e in EXACT if e[2] % QK_K == 0], ids=str)
def test_a_matrix_converted_rows_at_a_time_is_the_one_converted_whole(qtype, zero_points, k, monkeypatch):
    if not available(qtype):
        pytest.skip(f"{qtype.name} blocks come from ggml's quantizer, which needs llama.cpp's library")
    raw = quantize(RNG.standard_normal((N, k)).astype(np.float32), qtype)
    whole = nbits(raw, qtype, k, zero_points)
    monkeypatch.setattr(weights, "ROWS_PER_CHUNK", 7)  # 48 rows: six chunks of 7 and one of 6
    chunked = nbits(raw, qtype, k, zero_points)
    for field in ("n", "k", "bits", "block_size", "codes", "scales", "zero_points", "offsets"):
        np.testing.assert_array_equal(getattr(chunked, field), getattr(whole, field), err_msg=field)


def test_q4_1_blocks_of_one_value_keep_it():
    """d == 0: every element is m, whatever its codes say."""
    w = np.full((N, K), 0.75, np.float32)
    raw = quantize(w, QType.Q4_1)
    blocks = raw.reshape(N, K // BLOCK, -1).copy()
    blocks[..., :2] = 0  # d = 0
    blocks[..., 4:] = RNG.integers(0, 256, size=blocks[..., 4:].shape, dtype=np.uint8)
    raw = blocks.reshape(N, -1)
    truth = dequantize(raw, QType.Q4_1).reshape(N, K).astype(np.float64)
    assert np.all(truth == np.float16(0.75))
    a = RNG.standard_normal((2, K)).astype(np.float32)
    for zero_points in ZeroPoints:
        weight = nbits(raw, QType.Q4_1, K, zero_points)
        np.testing.assert_allclose(weight.dequantize(), truth, rtol=1e-6)
        assert relative_error(run(weight, a), a.astype(np.float64) @ truth.T) <= 1e-5


def test_integer_zero_points_for_q4_1_are_what_they_say_and_lossy():
    """UINT4 rounds -m/d to a code: ONNX Runtime computes its own dequantization exactly, which is
    measurably off the file's weights (the benchmark's reason to prefer SPLIT)."""
    w = RNG.standard_normal((N, K)).astype(np.float32)
    raw = quantize(w, QType.Q4_1)
    truth = dequantize(raw, QType.Q4_1).reshape(N, K).astype(np.float64)
    weight = nbits(raw, QType.Q4_1, K, ZeroPoints.UINT4)
    a = RNG.standard_normal((3, K)).astype(np.float32)
    y = run(weight, a)
    assert relative_error(y, a.astype(np.float64) @ weight.dequantize().T) <= 1e-5
    assert relative_error(y, a.astype(np.float64) @ truth.T) > 1e-3


def test_int8_activations_stay_close():
    """accuracy_level 4 quantizes A to int8 per block: within a percent, not exact."""
    w = RNG.standard_normal((N, K)).astype(np.float32)
    raw = quantize(w, QType.Q4_0)
    truth = dequantize(raw, QType.Q4_0).reshape(N, K).astype(np.float64)
    a = RNG.standard_normal((4, K)).astype(np.float32)
    assert relative_error(run(nbits(raw, QType.Q4_0, K), a, accuracy_level=4), a.astype(np.float64) @ truth.T) <= 2e-2


@pytest.mark.parametrize(
    ("qtype", "zero_points"),
    [(QType.Q8_0, ZeroPoints.FLOAT), (QType.Q4_1, ZeroPoints.SPLIT)],  # the backend's, and one with offsets
    ids=lambda v: getattr(v, "name", str(v)),
)
def test_a_second_int8_pass_over_the_activations_rounding_takes_its_error_out(qtype, zero_points):
    """``residual_pass``: what rounding A to int8 left, rounded to int8 again, errs by at most 1/254 of the first
    rounding. A row with an outlier rounds the rest of its block coarsely; a block of zeros has a step of 0."""
    rng = np.random.default_rng(254)  # its own: the bound's margin does not hang on the tests run before
    w = rng.standard_normal((N, K)).astype(np.float32)
    raw = quantize(w, qtype)
    truth = dequantize(raw, qtype).reshape(N, K).astype(np.float64)
    weight = nbits(raw, qtype, K, zero_points)
    a = rng.standard_normal((3, K)).astype(np.float32)
    a[:, 5] = 40.0
    a[1, BLOCK : 2 * BLOCK] = 0.0
    expected = a.astype(np.float64) @ truth.T
    one = relative_error(run(weight, a, accuracy_level=4), expected)
    two = relative_error(run(weight, a, accuracy_level=4, residual_pass=True), expected)
    assert two <= one / 50, f"one pass {one:.2e}, two {two:.2e}"  # measured 226x to 341x less, over three seeds


def test_two_passes_hold_where_the_kernel_keeps_float_activations():
    """A kernel may keep float activations at accuracy level 4: MLAS has no int8 one for Q4_1's float zero points
    (a provider may have none at all). The first pass takes A already rounded, so the two passes still sum to the
    product; taking A whole there added the rounding's error back (5.8e-3)."""
    rng = np.random.default_rng(4)
    w = rng.standard_normal((N, K)).astype(np.float32)
    raw = quantize(w, QType.Q4_1)
    truth = dequantize(raw, QType.Q4_1).reshape(N, K).astype(np.float64)
    weight = nbits(raw, QType.Q4_1, K, ZeroPoints.FLOAT)
    a = rng.standard_normal((3, K)).astype(np.float32)
    expected = a.astype(np.float64) @ truth.T
    one = relative_error(run(weight, a, accuracy_level=4), expected)
    if one > 1e-5:
        pytest.skip(f"this onnxruntime rounds Q4_1's float zero points' activations to int8 ({one:.1e})")
    assert relative_error(run(weight, a, accuracy_level=4, residual_pass=True), expected) <= 1e-5


def rounded_as_int8(a: np.ndarray, block: int) -> np.ndarray:
    """``a`` as int8 activations hold it: each ``block`` of a row in 127 steps of its largest magnitude."""
    blocks = a.reshape(a.shape[0], -1, block).astype(np.float64)
    step = np.abs(blocks).max(axis=-1, keepdims=True) / 127
    return (np.rint(np.divide(blocks, step, out=np.zeros_like(blocks), where=step > 0)) * step).reshape(a.shape)


def rms(x: np.ndarray) -> float:
    return float(np.sqrt(np.mean(np.square(x))))


@pytest.mark.parametrize(
    ("qtype", "zero_points"), sorted({e[:2] for e in EXACT}, key=str), ids=lambda v: getattr(v, "name", str(v))
)
def test_int8_activations_cost_what_rounding_them_costs_on_the_files_weights(qtype, zero_points):
    """With int8 activations a product is off by what rounding A to int8 costs against the file's own weights,
    ``W @ int8(A)`` (llama.cpp's product), for every type: codes sit about zero, offsets included. Q4_1's split
    form with codes from 0 to 15 and m apart was off by 2.9x that, which took SmolLM2's KLD from 7e-3 to 2e-2."""
    if not available(qtype):
        pytest.skip(f"{qtype.name} blocks come from ggml's quantizer, which needs llama.cpp's library")
    rng = np.random.default_rng(int(qtype))  # its own: the bound's margin does not hang on the tests run before
    w = rng.standard_normal((4 * N, K)).astype(np.float32)
    raw = quantize(w, qtype)
    truth = dequantize(raw, qtype).reshape(4 * N, K).astype(np.float64)
    weight = nbits(raw, qtype, K, zero_points)
    a = rng.standard_normal((8, K)).astype(np.float32)
    a[:, rng.choice(K, 4, replace=False)] *= 30  # outliers, as real activations have
    exact = a.astype(np.float64) @ truth.T
    rounding = rms(rounded_as_int8(a, weight.block_size) @ truth.T - exact)
    ratio = rms(run(weight, a, accuracy_level=4) - exact) / rounding
    assert ratio <= 1.2, f"{ratio:.2f}x what rounding costs"  # measured 1.00 to 1.09; uncentred, 1.5 to 2.9


@pytest.mark.parametrize(
    ("qtype", "k", "message"),
    [(QType.TQ2_0, 256, "not TQ2_0"), (QType.Q4_0, 48, "48 elements"), (QType.Q6_K, 288, "288 elements")],
)
def test_what_it_cannot_map_is_one_line(qtype, k, message):
    raw = np.zeros((2, 144), np.uint8)
    with pytest.raises(ValueError, match=message):
        nbits(raw, qtype, k)
