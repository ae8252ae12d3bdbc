"""GGUF's quantized blocks as ONNX Runtime's MatMulNBits takes them, without dequantizing.

MatMulNBits (com.microsoft) computes ``A @ W.T`` for ``W`` of shape (N, K) stored a block of
``block_size`` elements at a time: unsigned ``bits``-bit codes ``q``, one scale ``s`` per block and
a zero point ``z`` (default ``2**(bits-1)``), each element ``(q - z) * s``. Codes pack low bits
first: element ``2i`` in the low nibble of byte ``i`` and ``2i + 1`` in its high nibble.

- Q4_0 (block 32, ``(q - 8) * d``) is that layout with no zero points: exact. GGUF packs element
  ``j`` with element ``j + 16`` in one byte, so the nibbles are repacked.
- Q8_0 (block 32, signed ``q * d``) is 8-bit codes ``q + 128`` with the default zero point: exact.
- Q4_1 (block 32, ``q * d + m``) has three forms, whose speed and error
  ``scripts/bench_matmulnbits.py`` measures:
  - ``FLOAT``: the zero point ``-m / d`` as a float. Exact.
  - ``UINT4``: that zero point rounded to a 4-bit code, which the fast integer kernels take.
    Every element of a block moves by up to half a step.
  - ``SPLIT``: the codes with the default zero point 8 and scale ``d``, plus ``offsets``, each
    block's ``m + 8d``. The graph adds ``blocksums(A) @ offsets.T``, where ``blocksums`` sums A
    over each 32-element block. Exact, on the integer kernels.

  A block with ``d == 0`` holds ``m`` everywhere. It becomes codes 0 with a scale and zero point
  that give ``m``; under ``SPLIT``, scale 0 and offset ``m``.
- Q4_K (super-blocks of 256: eight 32-element blocks, each ``q * d * sc - dmin * mn`` with 6-bit
  ``sc`` and ``mn``) is always ``SPLIT``: scale ``d * sc`` and offset ``8 * d * sc - dmin * mn``
  per block, from float32 products formed the way ggml forms them. Exact.
- Q5_0, Q5_1, Q5_K, Q6_K, Q2_K, Q3_K, IQ4_NL and IQ4_XS have codes of 2 to 6 bits or (IQ4_NL's 16
  non-linear levels) up to 8 bits: they become 8-bit codes about the default zero point 128, exact,
  with their blocks' scales and offsets (Q6_K, Q2_K and Q3_K in blocks of 16). MatMulNBits runs
  8-bit codes fast only with ``accuracy_level`` 4, whose rounding of the activations ``matmul``'s
  ``residual_pass`` takes out again at the cost of a second product.

Codes sit about their zero point wherever a type has offsets too (the middle of their range moves
into the offsets): with int8 activations (``accuracy_level`` 4) a product's error grows with its
codes' size. Counted from 0, the codes of Q4_1, Q4_K, Q5_1, Q5_K and Q2_K cost 1.5x to 2.9x what
rounding the activations costs against the file's own weights; centred, 1.0x to 1.1x
(``tests/test_onnx_weights.py``). SmolLM2's calibration KLD from int8 activations went from 2.0e-2
to 7.2e-3.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import numpy as np
from gguf import GGMLQuantizationType as QType
from gguf.constants import QK_K
from gguf.quants import Q4_K, dequantize
from onnx import NodeProto, TensorProto, helper, numpy_helper

from .spec import INT8, NBITS_TYPES

BLOCK = 32  # elements in a block of the 32-element types, and in a K-quant's sub-blocks (Q6_K's: 16)
K_QUANTS = (QType.Q2_K, QType.Q3_K, QType.Q4_K, QType.Q5_K, QType.Q6_K, QType.IQ4_XS)  # 256-element super-blocks


class ZeroPoints(Enum):
    """How a Q4_1 block's offset ``m`` reaches MatMulNBits."""

    FLOAT = "float"  # -m / d exactly, as a float per block
    UINT4 = "uint4"  # rounded to a 4-bit code, packed two to a byte
    SPLIT = "split"  # zero point 8, and m + 8d apart: the graph adds blocksums(A) @ offsets.T


@dataclass(frozen=True)
class NBits:
    """One matrix's MatMulNBits inputs and attributes."""

    n: int  # output features (rows of W)
    k: int  # input features
    bits: int
    codes: np.ndarray  # uint8 (n, k // block_size, block_size * bits // 8)
    scales: np.ndarray  # float32 (n * k // block_size,)
    zero_points: np.ndarray | None  # float32 like scales; uint8, 4-bit packed; or None: the default
    offsets: np.ndarray | None = None  # float32 (n, k // block_size): each block's offset, added apart
    block_size: int = BLOCK

    def dequantize(self) -> np.ndarray:
        """W as float64 (n, k), as MatMulNBits reads these inputs: the tests' and the benchmark's truth."""
        blocks = self.k // self.block_size
        if self.bits == 8:
            q = self.codes.astype(np.float64)
        else:
            q = np.stack([self.codes & 0xF, self.codes >> 4], axis=-1).astype(np.float64)
        q = q.reshape(self.n, blocks, self.block_size)
        if self.zero_points is None:
            z = np.full((self.n, blocks), 2.0 ** (self.bits - 1))
        elif self.zero_points.dtype == np.uint8:
            packed = self.zero_points.reshape(self.n, -1)
            z = np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(self.n, -1)[:, :blocks].astype(np.float64)
        else:
            z = self.zero_points.reshape(self.n, blocks).astype(np.float64)
        s = self.scales.reshape(self.n, blocks, 1).astype(np.float64)
        w = (q - z[..., None]) * s
        if self.offsets is not None:
            w += self.offsets.astype(np.float64)[..., None]
        return w.reshape(self.n, self.k)


def concat(weights: list[NBits]) -> NBits:
    """Matrices of one type and width stacked by rows, as one (their outputs side by side)."""
    first = weights[0]
    if len(weights) == 1:
        return first

    def joined(arrays: list[np.ndarray | None]) -> np.ndarray | None:
        return None if arrays[0] is None else np.concatenate(arrays)  # type: ignore[arg-type]

    return NBits(
        sum(w.n for w in weights),
        first.k,
        first.bits,
        np.concatenate([w.codes for w in weights]),
        np.concatenate([w.scales for w in weights]),
        joined([w.zero_points for w in weights]),  # per row, each row's packed to whole bytes
        joined([w.offsets for w in weights]),
        first.block_size,
    )


# Rows converted at a time: conversions go through float64, 8 bytes an element. Gemma 3 270M's 262,144-row
# embedding converted whole took its build's peak from 1,076 to 1,178 MiB.
ROWS_PER_CHUNK = 4096


def nbits(raw: np.ndarray, qtype: QType, k: int, zero_points: ZeroPoints = ZeroPoints.FLOAT) -> NBits:
    """MatMulNBits inputs for a GGUF matrix given as ``GGUFTensors.raw`` rows: ``(n, row_bytes)`` uint8."""
    chunks = range(0, raw.shape[0], ROWS_PER_CHUNK)
    return concat([_rows(raw[start : start + ROWS_PER_CHUNK], qtype, k, zero_points) for start in chunks])


def _rows(raw: np.ndarray, qtype: QType, k: int, zero_points: ZeroPoints) -> NBits:
    n = raw.shape[0]
    if k % (QK_K if qtype in K_QUANTS else BLOCK):
        raise ValueError(f"rows of {k} elements are not whole {qtype.name} blocks")
    blocks = raw.reshape(n, k // BLOCK, -1) if qtype not in K_QUANTS else raw
    if qtype == QType.Q4_0:
        d, qs = blocks[..., :2], blocks[..., 2:]
        return NBits(n, k, 4, _repack(qs), _f16(d), None)
    if qtype == QType.Q8_0:
        d, qs = blocks[..., :2], blocks[..., 2:]
        codes = (qs.view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        return NBits(n, k, 8, np.ascontiguousarray(codes), _f16(d), None)
    if qtype == QType.Q4_1:
        return _q4_1(blocks, n, k, zero_points)
    if qtype == QType.Q4_K:
        return _q4_k(raw, n, k)
    if qtype in (QType.Q5_0, QType.IQ4_NL):
        return _eight_bit(raw, qtype, n, k, BLOCK, _f16(blocks[..., :2]))
    if qtype == QType.Q5_1:
        return _eight_bit(raw, qtype, n, k, BLOCK, _f16(blocks[..., :2]), offsets=_f16(blocks[..., 2:4]), centre=16)
    if qtype == QType.Q5_K:
        scales, offsets = _k_scales(raw, n, k)
        return _eight_bit(raw, qtype, n, k, BLOCK, scales, offsets=offsets, centre=16)
    if qtype == QType.Q6_K:
        supers = raw.reshape(n * (k // QK_K), -1)
        d = _f16(supers[:, -2:]).reshape(-1, 1)
        sc = supers[:, -2 - QK_K // 16 : -2].view(np.int8).astype(np.float32)
        return _eight_bit(raw, qtype, n, k, 16, d * sc)
    supers = raw.reshape(n * (k // QK_K), -1)
    if qtype == QType.Q2_K:  # per 16: d * (sc & 15) * q - dmin * (sc >> 4), q in 0..3
        sc = supers[:, : QK_K // 16].astype(np.float32)
        d, dmin = _f16(supers[:, -4:-2]).reshape(-1, 1), _f16(supers[:, -2:]).reshape(-1, 1)
        return _eight_bit(raw, qtype, n, k, 16, d * (sc % 16), offsets=-(dmin * (sc // 16)), centre=2)
    if qtype == QType.Q3_K:  # per 16: d * (sc - 32) * q, q in -4..3
        d = _f16(supers[:, -2:]).reshape(-1, 1)
        return _eight_bit(raw, qtype, n, k, 16, d * _q3_k_scales(supers[:, -14:-2]))
    if qtype == QType.IQ4_XS:  # per 32: d * (ls - 32) * level, IQ4_NL's 16 levels
        d = _f16(supers[:, :2]).reshape(-1, 1)
        high = supers[:, 2:4].copy().view(np.uint16).astype(np.int32)  # two bits a block
        low = supers[:, 4:8]
        ls = np.stack([low & 0xF, low >> 4], axis=-1).reshape(-1, 8).astype(np.int32)
        ls |= ((high >> (2 * np.arange(8))) & 3) << 4
        return _eight_bit(raw, qtype, n, k, BLOCK, d * (ls - 32).astype(np.float32))
    raise ValueError(f"MatMulNBits takes {', '.join(t.name for t in NBITS_TYPES)} blocks, not {qtype.name}")


def _q3_k_scales(packed: np.ndarray) -> np.ndarray:
    """Q3_K's sixteen 6-bit scales, packed in 12 bytes (low nibbles in bytes 0-7, high pairs in 8-11), minus 32."""
    low = np.stack([packed[:, :8] & 0xF, packed[:, :8] >> 4], axis=1).reshape(-1, 16)
    high = np.stack([(packed[:, 8:] >> shift) & 3 for shift in (0, 2, 4, 6)], axis=1).reshape(-1, 16)
    return ((low | (high << 4)).astype(np.int8) - 32).astype(np.float32)


def _eight_bit(
    raw: np.ndarray,
    qtype: QType,
    n: int,
    k: int,
    block: int,
    scales: np.ndarray,
    *,
    offsets: np.ndarray | None = None,
    centre: int = 0,
) -> NBits:
    """A type whose values are small integers times a scale per ``block`` elements (plus an offset), as 8-bit codes
    about MatMulNBits' default zero point 128: each element ``(code - 128) * scale (+ offset)``.

    The integers are read back from gguf-py's dequantization, which ggml's formula makes exact: every
    value is a float32 product of the block's scale and a small integer (plus the block's offset).
    IQ4_NL's 16 non-linear levels are such integers (-127 to 113). A type with offsets counts its
    integers from 0: ``centre``, the middle of their range, moves into the offsets, so that the codes
    sit about zero as the other types' do. The error of int8 activations grows with the codes' size
    (``rounded_as_int8`` in the tests): uncentred, Q5_1's and Q5_K's were 2.1x what rounding A costs.
    """
    blocks = k // block
    values = dequantize(raw, qtype).reshape(n, blocks, block).astype(np.float64)
    scale = scales.reshape(n, blocks, 1).astype(np.float64)
    offset_array = None
    if offsets is not None:
        centred = offsets.reshape(n, blocks, 1).astype(np.float64) + centre * scale
        values -= centred
        offset_array = centred.reshape(n, blocks).astype(np.float32)
    used = scale != 0  # a block of scale 0 holds its offset (or 0) whatever its codes
    steps = np.rint(np.divide(values, scale, out=np.zeros_like(values), where=used))
    codes = np.clip(steps + 128, 0, 255).astype(np.uint8).reshape(n, blocks, block)
    return NBits(n, k, 8, codes, scales.reshape(-1).astype(np.float32), None, offset_array, block)


def _q4_1(blocks: np.ndarray, n: int, k: int, zero_points: ZeroPoints) -> NBits:
    d = _f16(blocks[..., :2]).astype(np.float64)
    m = _f16(blocks[..., 2:4]).astype(np.float64)
    codes = _repack(blocks[..., 4:])
    flat = d == 0  # every element is m: codes 0 and (0 - z) * s = m
    if flat.any():
        codes = codes.reshape(-1, codes.shape[-1])
        codes[flat] = 0
        codes = codes.reshape(n, k // BLOCK, -1)
    if zero_points is ZeroPoints.SPLIT:  # (q - 8) * d + (m + 8d): the codes centred, as Q4_0's are
        return NBits(n, k, 4, codes, d.astype(np.float32), None, (m + 8 * d).reshape(n, -1).astype(np.float32))
    if zero_points is ZeroPoints.FLOAT:
        scale = np.where(flat, m, d)
        zero = np.where(flat, -1.0, -m / np.where(flat, 1.0, d))
        return NBits(n, k, 4, codes, scale.astype(np.float32), zero.astype(np.float32))
    # Integer zero points: z = round(-m / d) in 0..15, the scale kept; a flat block gets z = 15 and the
    # scale that makes (0 - 15) * s = m.
    zero = np.clip(np.rint(-m / np.where(flat, 1.0, d)), 0, 15)
    zero[flat] = 15
    scale = np.where(flat, -m / 15, d)
    return NBits(n, k, 4, codes, scale.astype(np.float32), pack4(zero.astype(np.uint8).reshape(n, -1)))


def pack4(zero: np.ndarray) -> np.ndarray:
    """Per-block 4-bit zero points (n, blocks) as MatMulNBits packs them: two a byte, each row padded to whole bytes."""
    if zero.shape[1] % 2:
        zero = np.concatenate([zero, np.zeros((zero.shape[0], 1), np.uint8)], axis=1)
    return (zero[:, 0::2] | (zero[:, 1::2] << 4)).reshape(-1)


def _k_scales(raw: np.ndarray, n: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's and Q5_K's per-block scales ``d * sc`` and offsets ``-dmin * mn`` (both lay them out alike),
    float32, eight a super-block (n * k // QK_K, 8), formed as ggml forms them."""
    supers = raw.reshape(n * (k // QK_K), -1)
    d, dmin = _f16(supers[:, :2]).reshape(-1, 1), _f16(supers[:, 2:4]).reshape(-1, 1)
    sc, mn = Q4_K.get_scale_min(supers[:, 4 : 4 + Q4_K.K_SCALE_SIZE])
    return d * sc.astype(np.float32), -(dmin * mn.astype(np.float32))


def _q4_k(raw: np.ndarray, n: int, k: int) -> NBits:
    supers = raw.reshape(n * (k // QK_K), -1)
    scales, offsets = _k_scales(raw, n, k)
    # Each 32 bytes of codes hold two blocks: the low nibbles one, the high nibbles the next.
    qs = supers[:, 4 + Q4_K.K_SCALE_SIZE :].reshape(-1, 4, 1, 32)
    elements = np.concatenate([qs & 0xF, qs >> 4], axis=2).reshape(n, k // BLOCK, BLOCK)
    centred = offsets.astype(np.float64) + 8 * scales.astype(np.float64)  # (q - 8) * scale + (offset + 8 scale)
    return NBits(n, k, 4, pack_nibbles(elements), scales.reshape(-1), None, centred.astype(np.float32).reshape(n, -1))


def _repack(qs: np.ndarray) -> np.ndarray:
    """GGUF's 4-bit order (byte j: elements j and j + 16) to MatMulNBits' (byte i: elements 2i and 2i + 1)."""
    return pack_nibbles(np.concatenate([qs & 0xF, qs >> 4], axis=-1))


def pack_nibbles(elements: np.ndarray) -> np.ndarray:
    """4-bit codes, one a byte, packed two a byte as MatMulNBits reads them."""
    return np.ascontiguousarray(elements[..., 0::2] | (elements[..., 1::2] << 4))


def _f16(pairs: np.ndarray) -> np.ndarray:
    """Little-endian float16s stored as byte pairs, as float32 (n * blocks,)."""
    return np.ascontiguousarray(pairs).view(np.float16).reshape(-1).astype(np.float32)


def matmul(
    weight: NBits,
    a: str,
    y: str,
    name: str,
    accuracy_level: int,
    rank: int = 2,
    bias: np.ndarray | None = None,
    residual_pass: bool = False,
) -> tuple[list[NodeProto], list[TensorProto]]:
    """The nodes computing ``y = a @ W.T (+ bias)`` for float32 ``a`` of ``rank`` dimensions, the last ``k``, and
    their initializers (named after ``name``).

    ``residual_pass`` (int8 activations only) computes the product in two passes: of ``a`` rounded as int8
    activations round it, each block to steps of its largest magnitude / 127, and of what that rounding left. The
    rounded part is on int8's grid already, so the kernel's own rounding of it changes nothing, and a kernel that
    keeps float activations (a provider, or a platform without an int8 one) computes it as it is; the residual's
    own rounding errs by at most 1/254 of the first one's. Each pass reads the weights once: about a second
    product's cost, for about 1/250 of one pass's error (``tests/test_onnx_weights.py``)."""
    if residual_pass and accuracy_level != INT8:
        raise ValueError("a residual pass takes out int8 activations' rounding: accuracy_level 4 only")
    arrays = {f"{name}.codes": weight.codes, f"{name}.scales": weight.scales}
    if weight.zero_points is not None:
        arrays[f"{name}.zero_points"] = weight.zero_points
    if bias is not None:  # MatMulNBits' own bias input: one node fewer than an Add after it
        arrays[f"{name}.bias"] = bias.astype(np.float32)
    # MatMulNBits' inputs by position: A, B, scales, then zero_points, g_idx and bias, "" for one not given.
    optional = [key if key in arrays else "" for key in (f"{name}.zero_points", f"{name}.g_idx", f"{name}.bias")]
    while optional and not optional[-1]:
        optional.pop()
    inputs = [a, f"{name}.codes", f"{name}.scales", *optional]
    product = y if weight.offsets is None else f"{name}.codes_product"
    attributes = {
        "domain": "com.microsoft",
        "K": weight.k,
        "N": weight.n,
        "bits": weight.bits,
        "block_size": weight.block_size,
        "accuracy_level": accuracy_level,
    }
    blocks = weight.k // weight.block_size
    nodes = []
    if residual_pass or weight.offsets is not None:  # both take a a block at a time
        arrays[f"{name}.block_shape"] = np.array([0] * (rank - 1) + [blocks, weight.block_size], np.int64)
        arrays[f"{name}.reduce_axes"] = np.array([-1], np.int64)
        nodes.append(helper.make_node("Reshape", [a, f"{name}.block_shape"], [f"{name}.a_blocks"]))
    if not residual_pass:
        nodes.append(helper.make_node("MatMulNBits", inputs, [product], name=name, **attributes))
    else:
        arrays[f"{name}.inverse_127"] = np.array(1 / 127, np.float32)
        zero_points = [key for key in optional[:1] if key]
        residual_inputs = [f"{name}.residual", *inputs[1:3], *zero_points]  # the bias is the first pass's
        rounding = {"axis": -1, "block_size": weight.block_size}
        nodes += [
            helper.make_node("Abs", [f"{name}.a_blocks"], [f"{name}.a_magnitudes"]),
            helper.make_node(
                "ReduceMax", [f"{name}.a_magnitudes", f"{name}.reduce_axes"], [f"{name}.a_largest"], keepdims=0
            ),
            # The int8 step of each block: its largest magnitude / 127, as MLAS takes it. A block of zeros has step
            # 0, where the rounded block is 0 * step = 0 whatever the codes, and so is its residual.
            helper.make_node("Mul", [f"{name}.a_largest", f"{name}.inverse_127"], [f"{name}.a_step"]),
            helper.make_node(
                "QuantizeLinear", [a, f"{name}.a_step"], [f"{name}.a_int8"], output_dtype=TensorProto.INT8, **rounding
            ),
            helper.make_node(
                "DequantizeLinear", [f"{name}.a_int8", f"{name}.a_step"], [f"{name}.a_rounded"], **rounding
            ),
            helper.make_node("Sub", [a, f"{name}.a_rounded"], [f"{name}.residual"]),
            helper.make_node(
                "MatMulNBits", [f"{name}.a_rounded", *inputs[1:]], [f"{name}.first_pass"], name=name, **attributes
            ),
            helper.make_node(
                "MatMulNBits", residual_inputs, [f"{name}.second_pass"], name=f"{name}.second_pass", **attributes
            ),
            helper.make_node("Add", [f"{name}.first_pass", f"{name}.second_pass"], [product]),
        ]
    if weight.offsets is not None:
        # Each block's offset times the sum of the block's inputs: a product 32 times smaller than W's.
        arrays[f"{name}.offsets"] = np.ascontiguousarray(weight.offsets.T)
        nodes += [
            helper.make_node(
                "ReduceSum", [f"{name}.a_blocks", f"{name}.reduce_axes"], [f"{name}.block_sums"], keepdims=0
            ),
            helper.make_node("MatMul", [f"{name}.block_sums", f"{name}.offsets"], [f"{name}.offset_product"]),
            helper.make_node("Add", [product, f"{name}.offset_product"], [y]),
        ]
    return nodes, [numpy_helper.from_array(value, key) for key, value in arrays.items()]
