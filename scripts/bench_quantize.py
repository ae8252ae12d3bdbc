"""Throughput of edgeinfer.converters.quantize in MB/s of float32 (input to quantize, output of dequantize).

    python scripts/bench_quantize.py [--repeat 3]

Shapes are SmolLM2-135M's token embedding (49152x576) and one of its FFN matrices (1536x576);
K-quants need 256-wide rows, so they run on 512-wide matrices with the same row counts.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import click
import numpy as np
from gguf import GGMLQuantizationType as Q

from edgeinfer.converters.quantize import NUMPY_TYPES, dequantize, quantize

CASES = [(Q.Q8_0, False), (Q.Q4_0, False), (Q.Q4_0, True), (Q.Q4_K, False), (Q.Q4_K, True), (Q.Q6_K, True)]


def mb_per_s(megabytes: float, fn: Callable[[], object], repeat: int) -> str:
    """The fastest of `repeat` runs."""
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return f"{megabytes / min(times):.0f}"


def measure(rows: np.ndarray, qtype: Q, importance: np.ndarray | None, repeat: int) -> list[str]:
    mb = rows.nbytes / 1e6
    raw = quantize(rows, qtype, importance)
    plain = importance is None and qtype in NUMPY_TYPES
    return [
        mb_per_s(mb, lambda: quantize(rows, qtype, importance, threads=1), repeat),
        mb_per_s(mb, lambda: quantize(rows, qtype, importance, threads=2), repeat),
        mb_per_s(mb, lambda: quantize(rows, qtype, backend="numpy"), repeat) if plain else "-",
        mb_per_s(mb, lambda: dequantize(raw, qtype), repeat),
    ]


@click.command()
@click.option("--repeat", default=3, show_default=True, help="Runs per measurement; the fastest counts.")
def main(repeat: int) -> None:
    rng = np.random.default_rng(0)
    header = ["type", "imatrix", "shape", "1 thread", "2 threads", "numpy", "dequant"]
    print(" ".join(f"{h:>10}" for h in header) + "  (MB/s of float32)")
    for n_rows in (49152, 1536):
        for qtype, with_importance in CASES:
            n_cols = 576 if qtype in NUMPY_TYPES else 512
            # Heavy-tailed like real weights, with columns of different scale.
            rows = (rng.standard_t(5, (n_rows, n_cols)) * rng.uniform(0.01, 0.05, n_cols)).astype(np.float32)
            importance = rng.gamma(1.0, 1.0, n_cols).astype(np.float32) if with_importance else None
            cells = [qtype.name, "yes" if with_importance else "no", f"{n_rows}x{n_cols}"]
            print(" ".join(f"{c:>10}" for c in cells + measure(rows, qtype, importance, repeat)))


if __name__ == "__main__":
    main()
