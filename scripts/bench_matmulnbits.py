"""ONNX Runtime's MatMulNBits on GGUF blocks: speed and error of each mapping, before the ONNX backend picks them.

Issue 17 asks three questions of the CPU kernels, answered here side by side in one run:

- Q4_1's offset as a float zero point (exact), rounded to a 4-bit integer one (the kernels'
  fast path, at a cost in accuracy), or split off into a product of block sums (exact, integer kernels);
- ``accuracy_level`` 4 (int8 activations) against 0 (float activations);
- weights as graph initializers against weights fed as inputs at run time.

And one of our own: whether Q8_0 can be computed exactly at speed. Its 8-bit codes run fast only with int8
activations; as two 4-bit planes (high nibbles times 16d, low ones times d, A fed twice) they take float ones;
in two int8 passes, the second over what rounding A to int8 left (``matmul``'s ``residual_pass``, the backend's
form), they come within 1/254 of the first pass's error.

Each case is one MatMulNBits node computing ``A @ W.T`` for a weight matrix quantized by ggml
and repacked by ``edgeinfer.backends.onnx.weights``, timed over --calls runs after a warm-up, for one
row of A (a decode step) and for --prefill rows. The error is the largest deviation from the float64
product with gguf-py's own dequantization, relative to the largest output.

    python scripts/bench_matmulnbits.py --threads 2 [--json out.json]
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from time import perf_counter

import click
import numpy as np
import onnxruntime as ort
from gguf import GGMLQuantizationType as QType
from gguf.quants import dequantize
from onnx import TensorProto, helper, numpy_helper

from edgeinfer.backends.onnx.weights import NBits, ZeroPoints, matmul, nbits, pack4, pack_nibbles
from edgeinfer.converters.quantize import quantize

# (name, N, K): a small model's FFN up and down projections (512 wide, so that Q4_K's 256-element
# super-blocks fit its rows), and a 7B-class square matrix.
SHAPES = [("512->1536", 1536, 512), ("1536->512", 512, 1536), ("4096->4096", 4096, 4096)]
# (label, GGUF type, how Q4_1's zero point goes in, accuracy_level, weights as inputs, 8-bit codes as 4-bit planes,
# a second int8 pass over A's rounding)
CASES = [
    ("Q4_0", QType.Q4_0, ZeroPoints.FLOAT, 0, False, False, False),
    ("Q4_0 acc4", QType.Q4_0, ZeroPoints.FLOAT, 4, False, False, False),
    ("Q4_0 inputs", QType.Q4_0, ZeroPoints.FLOAT, 0, True, False, False),
    ("Q4_0 acc4 inputs", QType.Q4_0, ZeroPoints.FLOAT, 4, True, False, False),
    ("Q8_0", QType.Q8_0, ZeroPoints.FLOAT, 0, False, False, False),
    ("Q8_0 acc4", QType.Q8_0, ZeroPoints.FLOAT, 4, False, False, False),
    ("Q4_1 float zp", QType.Q4_1, ZeroPoints.FLOAT, 0, False, False, False),
    ("Q4_1 float zp acc4", QType.Q4_1, ZeroPoints.FLOAT, 4, False, False, False),
    ("Q4_1 uint4 zp", QType.Q4_1, ZeroPoints.UINT4, 0, False, False, False),
    ("Q4_1 uint4 zp acc4", QType.Q4_1, ZeroPoints.UINT4, 4, False, False, False),
    ("Q4_1 split", QType.Q4_1, ZeroPoints.SPLIT, 0, False, False, False),
    ("Q4_1 split acc4", QType.Q4_1, ZeroPoints.SPLIT, 4, False, False, False),
    ("Q4_K split", QType.Q4_K, ZeroPoints.SPLIT, 0, False, False, False),
    ("Q4_K split acc4", QType.Q4_K, ZeroPoints.SPLIT, 4, False, False, False),
    # Codes of 5 to 8 bits go in as 8-bit codes, fast only with int8 activations.
    ("Q5_0 acc4", QType.Q5_0, ZeroPoints.FLOAT, 4, False, False, False),
    ("Q5_K acc4", QType.Q5_K, ZeroPoints.FLOAT, 4, False, False, False),
    ("Q6_K acc4", QType.Q6_K, ZeroPoints.FLOAT, 4, False, False, False),
    ("IQ4_NL acc4", QType.IQ4_NL, ZeroPoints.FLOAT, 4, False, False, False),
    ("Q8_0 as 4-bit planes", QType.Q8_0, ZeroPoints.FLOAT, 0, False, True, False),
    ("Q8_0 as 4-bit planes acc4", QType.Q8_0, ZeroPoints.FLOAT, 4, False, True, False),
    ("Q8_0 acc4 two passes", QType.Q8_0, ZeroPoints.FLOAT, 4, False, False, True),
]


def planes(weight: NBits) -> NBits:
    """8-bit codes u (value (u - 128) * d) as 4-bit codes over A fed twice: the first k of the 2k inputs take the
    high nibbles, zero point 8, scale 16d; the next k the low nibbles, zero point 0, scale d. Their sum is
    (16h + l - 128) d = (u - 128) d, exactly."""
    n, blocks = weight.n, weight.k // weight.block_size
    codes = weight.codes.reshape(n, blocks, weight.block_size)
    d = weight.scales.reshape(n, blocks)
    zero = np.concatenate([np.full((n, blocks), 8, np.uint8), np.zeros((n, blocks), np.uint8)], axis=1)
    return NBits(
        n,
        2 * weight.k,
        4,
        pack_nibbles(np.concatenate([codes >> 4, codes & 0xF], axis=1)),
        np.concatenate([16 * d, d], axis=1).reshape(-1).astype(np.float32),
        pack4(zero),
    )


@dataclass(frozen=True)
class Row:
    shape: str
    case: str
    rows: int
    us_per_call: float
    relative_error: float


def session(
    weight: NBits,
    accuracy_level: int,
    as_inputs: bool,
    threads: int,
    doubled: bool = False,
    residual_pass: bool = False,
) -> tuple[ort.InferenceSession, dict]:
    """The product's graph; the feeds that go with every run (the weights, when they are inputs). ``doubled``: the
    weight reads A twice over (``planes``); ``residual_pass``: ``matmul``'s."""
    nodes, initializers = matmul(
        weight, "A2" if doubled else "A", "Y", "w", accuracy_level, residual_pass=residual_pass
    )
    if doubled:
        nodes.insert(0, helper.make_node("Concat", ["A", "A"], ["A2"], axis=-1))
    inputs = [helper.make_tensor_value_info("A", TensorProto.FLOAT, [None, weight.k // 2 if doubled else weight.k])]
    feeds = {}
    if as_inputs:
        feeds = {t.name: numpy_helper.to_array(t) for t in initializers}
        inputs += [
            helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(a.dtype), a.shape)
            for n, a in feeds.items()
        ]
    graph = helper.make_graph(
        nodes,
        "matmulnbits",
        inputs,
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [None, weight.n])],
        initializer=[] if as_inputs else initializers,
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]
    )
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"]), feeds


def measure(threads: int, calls: int, prefill: int) -> list[Row]:
    rng = np.random.default_rng(0)
    rows = []
    for shape, n, k in SHAPES:
        w = (rng.standard_normal((n, k)) * 0.02).astype(np.float32)
        for label, qtype, zero_points, accuracy, as_inputs, as_planes, two_passes in CASES:
            raw = quantize(w, qtype)
            truth = dequantize(raw, qtype).reshape(n, k).astype(np.float64)
            weight = nbits(raw, qtype, k, zero_points)
            if as_planes:
                weight = planes(weight)
            sess, feeds = session(weight, accuracy, as_inputs, threads, doubled=as_planes, residual_pass=two_passes)
            for m in (1, prefill):
                a = rng.standard_normal((m, k)).astype(np.float32)
                feed = {"A": a, **feeds}
                y = sess.run(None, feed)[0].astype(np.float64)
                expected = a.astype(np.float64) @ truth.T
                error = float(np.abs(y - expected).max() / np.abs(expected).max())
                n_calls = calls if m == 1 else max(3, calls // 20)
                start = perf_counter()
                for _ in range(n_calls):
                    sess.run(None, feed)
                rows.append(Row(shape, label, m, (perf_counter() - start) / n_calls * 1e6, error))
    return rows


@click.command()
@click.option("--threads", type=click.IntRange(1), default=2, show_default=True)
@click.option(
    "--calls", type=click.IntRange(10), default=400, show_default=True, help="Timed runs of a one-row product."
)
@click.option(
    "--prefill", type=click.IntRange(2), default=128, show_default=True, help="Rows of A for the prefill case."
)
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Also write the rows here.")
def main(threads: int, calls: int, prefill: int, json_path: str | None) -> None:
    print(f"onnxruntime {ort.__version__}, {threads} threads")
    rows = measure(threads, calls, prefill)
    print(f"{'shape':12s} {'case':26s} {'rows':>5s} {'us/call':>10s} {'rel. error':>11s}")
    for r in rows:
        print(f"{r.shape:12s} {r.case:26s} {r.rows:5d} {r.us_per_call:10.1f} {r.relative_error:11.2e}")
    if json_path:
        with open(json_path, "w") as f:
            json.dump([asdict(r) for r in rows], f, indent=1)


if __name__ == "__main__":
    main()
