"""Arrays whose memory is taken a page at a time, as they are written: a KV cache allocated for its whole budget
holds in RAM only the cells in use."""

from __future__ import annotations

import contextlib
import mmap

import numpy as np
from numpy.typing import DTypeLike


def lazy_zeros(shape: tuple[int, ...], dtype: DTypeLike) -> np.ndarray:
    """Zeros in an anonymous mapping of their own, without transparent huge pages.

    The kernel maps a page (4 KiB on x86) at its first write. numpy's own large ``zeros`` ask for 2 MiB huge
    pages (madvise), so the first prompt chunk written into one sequence's region of a KV pool made most of the
    pool resident: an ONNX engine on SmolLM2 at a 4096-token budget grew by 185 MiB, its f32 pool's 180 MiB, for
    64 cells in use (docs/BENCHMARKS.md, "An f32 cache by default").
    """
    dtype = np.dtype(dtype)
    count = int(np.prod(shape, dtype=np.int64))
    if not hasattr(mmap, "MAP_PRIVATE") or count == 0:  # Windows commits calloc's pages at first touch already
        return np.zeros(shape, dtype)
    area = mmap.mmap(-1, count * dtype.itemsize, flags=mmap.MAP_PRIVATE)  # anonymous: no file
    if hasattr(mmap, "MADV_NOHUGEPAGE"):  # where transparent huge pages are "always", not only on request
        with contextlib.suppress(OSError):  # a kernel built without them refuses the advice, and needs none
            area.madvise(mmap.MADV_NOHUGEPAGE)
    return np.frombuffer(area, dtype, count).reshape(shape)
