"""The OpenCL backend's matrix-vector kernels against what the device can stream: GB/s, side by side.

Times a plain copy kernel (float4 loads and stores over 256 MiB) and each type's decode product
(``backends/opencl/kernels/products.cl``) on a 16384x8192 matrix in the layout the backend uploads,
by the device's own event timestamps from an emptied cache, in every shape the backend's tuning
tries (``tuning.py``), and prints the fastest shape's bytes read per second (its layout's, and the
file's: widened scales read more bytes than the file holds) as a share of the copy's (bytes read and
written).

    python scripts/bench_opencl.py [--device 0:0]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import pyopencl as cl
from gguf import GGMLQuantizationType as QType

from edgeinfer.backends.opencl.backend import HALF_SCALES, KERNELS
from edgeinfer.backends.opencl.device import choose_device
from edgeinfer.backends.opencl.tuning import SHAPES, Shape, Timer

COPY = """
__kernel void copy(__global const float4 *src, __global float4 *dst) {
    dst[get_global_id(0)] = src[get_global_id(0)];
}
"""
# Larger than a server CPU's last-level cache even at 4 bits (75 MB), so that the figures are the memory's.
N, K = 16384, 8192
# type: bytes of one 32-element block, as the backend's buffers hold it
BLOCK_BYTES = {"q4_0": 18, "q4_1": 20, "q8_0": 34, "f16": 64, "f32": 128}


def buffers(context: cl.Context, kind: str, rng: np.random.Generator, float_scales: bool) -> list[cl.Buffer]:
    """Random weights in the flat layout: scales (and minimums) apart from codes, as halves or widened."""
    blocks = N * K // 32

    def upload(array: np.ndarray) -> cl.Buffer:
        return cl.Buffer(context, cl.mem_flags.READ_ONLY | cl.mem_flags.COPY_HOST_PTR, hostbuf=array)

    def scales() -> cl.Buffer:
        return upload((rng.random(blocks) / 64).astype(np.float32 if float_scales else np.float16))

    if kind == "f32":
        return [upload(rng.random(N * K, dtype=np.float32))]
    if kind == "f16":
        return [upload(rng.random(N * K).astype(np.float16))]
    if kind == "q4_1":
        return [scales(), scales(), upload(rng.integers(0, 256, blocks * 16, np.uint8))]
    return [scales(), upload(rng.integers(0, 256, blocks * (16 if kind == "q4_0" else 32), np.uint8))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", help="P:D or a part of the device's name (default: the backend's choice)")
    args = parser.parse_args()
    info, device = choose_device(args.device)
    context = cl.Context([device])
    timer = Timer(context)
    rng = np.random.default_rng(0)

    size = 256 << 20
    src = cl.Buffer(
        context, cl.mem_flags.READ_ONLY | cl.mem_flags.COPY_HOST_PTR, hostbuf=np.ones(size // 4, np.float32)
    )
    dst = cl.Buffer(context, cl.mem_flags.WRITE_ONLY, size)
    copy = cl.Kernel(cl.Program(context, COPY).build(), "copy")
    copy.set_args(src, dst)
    stream = 2 * size / timer.median_seconds(copy, (size // 16,))
    print(f"{info.index} {info.name}: copy {stream / 1e9:.1f} GB/s (read and written)")

    source = (Path(KERNELS) / "products.cl").read_text()
    # One program a set of build options: the group size is the launch's, not the build's.
    programs = {
        defines: cl.Program(context, source).build(options=list(defines)) for defines in {s.defines() for s in SHAPES}
    }
    x = cl.Buffer(context, cl.mem_flags.READ_ONLY | cl.mem_flags.COPY_HOST_PTR, hostbuf=rng.random(K, dtype=np.float32))
    y = cl.Buffer(context, cl.mem_flags.WRITE_ONLY, N * 4)
    for kind, block in BLOCK_BYTES.items():
        half_parts = len(HALF_SCALES.get(QType[kind.upper()], ()))
        half_scales = half_parts > 0
        layouts = {wide: buffers(context, kind, rng, wide) for wide in {False, half_scales}}

        def launch(shape: Shape, kind: str = kind, layouts: dict = layouts) -> tuple[cl.Kernel, int]:
            kernel = cl.Kernel(programs[shape.defines()], f"matvec_{kind}")
            kernel.set_args(*layouts[shape.float_scales], x, y, None, np.int32(K), np.int32(0), np.int32(N))
            return kernel, N

        shape, seconds = timer.tune(launch, half_scales)
        groups = f"groups of {shape.local}" if shape.local else "groups the driver chose"
        read = N * K // 32 * (block + 2 * half_parts * shape.float_scales)
        rate, file_rate = read / seconds, N * K // 32 * block / seconds
        print(
            f"  {kind:<5} {N}x{K}: {seconds * 1e6:8.0f} us  {rate / 1e9:5.1f} GB/s  {rate / stream:5.0%} of the copy"
            f"  (the file's bytes: {file_rate / 1e9:5.1f} GB/s, {file_rate / stream:4.0%})"
            f"  {shape.rows} rows a work-item, {groups}, {'float32' if shape.float_scales else 'half'} scales"
        )


if __name__ == "__main__":
    main()
