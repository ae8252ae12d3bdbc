"""The OpenCL backend's matrix-vector kernels against what the device can stream: GB/s, side by side.

Times a plain copy kernel (float4 loads and stores over 256 MiB) and each type's decode product
(``backends/opencl/kernels/products.cl``) on a 16384x8192 matrix in the layout the backend uploads,
by the device's own event timestamps from an emptied cache, in the shape the backend's tuning
chooses (``tuning.py``). Then the copy and the product take turns for ROUNDS rounds (a shared machine's
bandwidth drifts from one second to the next), and it prints the product's bytes read per second (its
layout's, and the file's: widened scales read more bytes than the file holds) as a share of the copy's
(bytes read and written), the median of the rounds' shares.

    python scripts/bench_opencl.py [--device 0:0]
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import numpy as np
import pyopencl as cl
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QType

from edgeinfer.backends.opencl.backend import (
    FLAT_PARTS,
    HALF_SCALES,
    KERNELS,
    kernel_name,
    layout_parts,
    shapes_of,
)
from edgeinfer.backends.opencl.device import choose_device
from edgeinfer.backends.opencl.tuning import SHAPES, Shape, Timer

COPY = """
__kernel void copy(__global const float4 *src, __global float4 *dst) {
    dst[get_global_id(0)] = src[get_global_id(0)];
}
"""
# Larger than a server CPU's last-level cache even at 4 bits (75 MB), so that the figures are the memory's.
N, K = 16384, 8192
KINDS = (QType.Q4_0, QType.Q4_1, QType.Q8_0, QType.F16, QType.F32)
ROUNDS = 9


def raw_blocks(qtype: QType, rng: np.random.Generator) -> np.ndarray:
    """An N x K matrix of ``qtype`` as a GGUF holds it, a row of bytes each: random codes, small half scales."""
    if qtype in (QType.F32, QType.F16):
        return rng.random((N, K)).astype(np.float32 if qtype == QType.F32 else np.float16).view(np.uint8)
    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (N, K // block, size), np.uint8)
    for i in HALF_SCALES[qtype]:  # each half scale's two bytes, at the flat part's offset in the block
        at = FLAT_PARTS[qtype][i]
        raw[..., at : at + 2] = (rng.random((N, K // block, 1)) / 64).astype(np.float16).view(np.uint8)
    return raw.reshape(N, -1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", help="P:D or a part of the device's name (default: the backend's choice)")
    args = parser.parse_args()
    info, device = choose_device(args.device)
    context = cl.Context([device])
    timer = Timer(context)
    rng = np.random.default_rng(0)

    def upload(array: np.ndarray) -> cl.Buffer:
        return cl.Buffer(context, cl.mem_flags.READ_ONLY | cl.mem_flags.COPY_HOST_PTR, hostbuf=array)

    size = 256 << 20
    src, dst = upload(np.ones(size // 4, np.float32)), cl.Buffer(context, cl.mem_flags.WRITE_ONLY, size)
    copy = cl.Kernel(cl.Program(context, COPY).build(), "copy")
    copy.set_args(src, dst)
    print(f"{info.index} {info.name}: each product against a copy of {size >> 20} MiB, {ROUNDS} rounds in turn")

    source = (Path(KERNELS) / "products.cl").read_text()
    # One program a set of build options: the group size is the launch's, not the build's.
    programs = {
        defines: cl.Program(context, source).build(options=list(defines)) for defines in {s.defines() for s in SHAPES}
    }
    x = upload(rng.random(K, dtype=np.float32))
    y = cl.Buffer(context, cl.mem_flags.WRITE_ONLY, N * 4)
    for qtype in KINDS:
        elements, size_of = GGML_QUANT_SIZES[qtype]
        block = 32 // elements * size_of  # bytes of 32 elements in the file
        half_parts = len(HALF_SCALES.get(qtype, ()))
        tried = shapes_of(qtype)
        raw = raw_blocks(qtype, rng)
        layouts = {
            layout: [upload(part) for part in layout_parts(qtype, raw, K, *layout)]
            for layout in dict.fromkeys(shape.layout for shape in tried)
        }
        del raw

        def launch(
            shape: Shape, qtype: QType = qtype, layouts: dict[tuple[bool, bool], list[cl.Buffer]] = layouts
        ) -> tuple[cl.Kernel, int]:
            kernel = cl.Kernel(programs[shape.defines()], kernel_name("matvec", qtype, shape.lanes))
            kernel.set_args(*layouts[shape.layout], x, y, None, np.int32(K), np.int32(0), np.int32(N))
            return kernel, N

        shape, _ = timer.tune(launch, tried)
        kernel, rows = launch(shape)
        copies, products = [], []  # seconds, in turns
        for _ in range(ROUNDS):
            copies.append(timer.median_seconds(copy, (size // 16,)))
            products.append(timer.median_seconds(kernel, (shape.global_size(rows), 1), shape.local_size()))
        block_read = block + 2 * half_parts * shape.float_scales  # bytes of a block in the layout
        read = N * K // 32 * block_read
        share = statistics.median(read * c / (2 * size * p) for c, p in zip(copies, products, strict=True))
        seconds, stream = statistics.median(products), 2 * size / statistics.median(copies)
        groups = f"groups of {shape.local}" if shape.local else "groups the driver chose"
        layout = "lanes" if shape.lanes else f"{shape.rows} rows a work-item"
        print(
            f"  {qtype.name:<5} {N}x{K}: {seconds * 1e6:6.0f} us  {read / seconds / 1e9:5.1f} GB/s  {share:4.0%} of the"
            f" copy's {stream / 1e9:4.1f} GB/s (the file's bytes: {share * block / block_read:4.0%})"
            f"  {layout}, {groups}, {'float32' if shape.float_scales else 'half'} scales"
        )
        del layouts


if __name__ == "__main__":
    main()
