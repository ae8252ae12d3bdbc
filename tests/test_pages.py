"""Arrays whose memory is taken as it is written (edgeinfer/pages.py), as the KV pools of the ONNX Runtime and
reference backends are: RAM follows the cells in use, not the budget."""

from __future__ import annotations

import numpy as np
import psutil
import pytest

from edgeinfer.pages import lazy_zeros

MIB = 1 << 20


def resident() -> int:
    return psutil.Process().memory_info().rss


@pytest.mark.skipif(not hasattr(__import__("mmap"), "MAP_PRIVATE"), reason="POSIX mappings")
def test_only_the_pages_written_are_resident():
    before = resident()
    pool = lazy_zeros((64, 2, MIB), np.float32)  # 512 MiB, as a KV pool's (layers, keys and values, cells)
    assert pool.shape == (64, 2, MIB) and pool.dtype == np.float32 and pool.flags.writeable
    assert not pool[:, :, -8:].any()
    pool[:, :, :1024] = 1.0  # the first 1,024 cells of every layer: 128 pages of 4 KiB, 0.5 MiB in all
    grown = resident() - before
    assert grown < 64 * MIB, f"{grown / MIB:.0f} MiB resident for 0.5 MiB written"
    assert pool.sum() == 64 * 2 * 1024


def test_an_empty_shape_and_other_types():
    assert lazy_zeros((0, 3), np.float16).shape == (0, 3)
    small = lazy_zeros((3, 5), np.float16)
    small[1, 2] = 2.5
    assert small.dtype == np.float16 and small.sum() == 2.5
