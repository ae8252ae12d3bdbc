"""How the matrix-vector products run on a device: measured at the first load there, then kept.

Each ``matvec_<type>`` kernel takes ``ROWS`` rows a work-item (2, 4 or 8, set when ``products.cl`` is
built) and runs in work-groups of a size the driver picks or one we name; the types whose blocks carry
half-precision scales read them as the file holds them, or widened to float32 at upload (more bytes, less
arithmetic: a CPU device is bound by the second, a GPU by the first). Q4_0, Q4_1 and Q8_0 also come in the
lanes layout (``matvec_<type>_lanes``): 16 rows a work-item, a row a vector lane, which a CPU device's wide
vectors want. Which is fastest depends on the device and on the matrix: a CPU driver such as PoCL wants few,
long work-items in as many groups as it has cores, a GPU many, in groups its schedulers fill, and a small
matrix gives either less to share out. So the first load of a model times the shapes on each of its
products' types and sizes (the layout first, each in every group size at its first rows, then the other rows
in the chosen layout: ``Timer.tune``), and keeps the fastest for each, with the group size of the prompt's tiled
product (``gemm``) timed in that layout, in the cache folder under a digest of the device, its driver, the
tuning's version and the kernels' source: a new driver or a changed kernel measures again. A decode step
streams every weight from memory once, so each timed run starts with the device's caches emptied (a read of a
buffer larger than them).
"""

from __future__ import annotations

import hashlib
import json
import logging
import statistics
from collections.abc import Callable, Hashable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TypeVar

import numpy as np
import pyopencl as cl
from filelock import FileLock

from edgeinfer.errors import BackendError
from edgeinfer.files import write_atomic
from edgeinfer.system import cache_dir

log = logging.getLogger("edgeinfer.backends.opencl")

ROWS_CHOICES = (2, 4, 8)
LOCAL_CHOICES = (None, 32, 64)  # None: the driver's choice
LANES = 16  # rows a work-item of the lanes layout, one a lane of its float16 sums
# A lanes work-item does 16 rows' work, so its groups are smaller: SmolLM2's 576 rows are 36 work-items. Not the
# driver's groups: PoCL made those 36 one group, which runs on one core, and timed alone that sometimes won, but
# in a decode step it cost: three tunings that chose it for one or two of SmolLM2's products gave 11.7-12.3 ms a
# token, one that did not 10.8. The lanes layout is timed on every device but is made for CPU devices, whose
# drivers run a group on one core; a GPU should choose the flat layout (not measured here: no GPU).
LANES_LOCAL_CHOICES = (1, 4)
# The prompt's tiled product (gemm: a work-item computes 4 rows by 4 tokens) in groups of (row tiles, token tiles);
# None: the driver's choice. On PoCL a 64-token chunk of SmolLM2's products took 0.55x to 0.85x the driver's time
# in (8, 8) or (4, 16) groups, and up to 2x in (64, 1) ones (a /tmp script, 2026-12-05).
GEMM_LOCALS: tuple[tuple[int, int] | None, ...] = (None, (8, 8), (16, 4), (4, 16), (32, 2))
GEMM_TILE = 4  # rows, and tokens, a gemm work-item computes
ROUNDS = 5  # timed runs of each shape, in turns with the others, after one to warm up; the median counts
TUNING_VERSION = "4"  # how shapes are chosen: a record made by another way is measured again
FLUSH_BYTES = 64 << 20  # read before each timed run: more than the last-level cache of the devices we run
FLUSH = """
__kernel void flush(__global const float4 *src, __global float *dst) {
    float4 v = src[get_global_id(0)];
    if (v.x == 12345.0f) dst[0] = v.y;  // never true: the read cannot be left out
}

__kernel void follow(__global float *dst) {
    dst[0] = 0.0f;
}
"""


@dataclass(frozen=True)
class Shape:
    """Rows a work-item, work-items a group (None: the driver chooses), whether the blocks' half scales
    are uploaded as float32, and whether the rows lie across lanes (``products.cl``'s lanes layout, whose
    scales are always float32): the decode product's shape. And the groups of the prompt's tiled product
    (``GEMM_LOCALS``), timed in the decode product's layout."""

    rows: int = 4
    local: int | None = None
    float_scales: bool = False
    lanes: bool = False
    gemm_local: tuple[int, int] | None = None

    @property
    def layout(self) -> tuple[bool, bool]:
        """What the matrix's upload depends on: float32 scales, and the lanes layout."""
        return self.float_scales, self.lanes

    def defines(self) -> tuple[str, ...]:
        """``products.cl``'s build options for this shape (a lanes kernel's rows are fixed)."""
        rows = () if self.lanes else (f"-DROWS={self.rows}",)
        return rows + (("-DSCALE_FLOAT",) if self.float_scales else ())

    def global_size(self, n: int) -> int:
        """Work-items for ``n`` rows, rounded up to whole groups: the kernels skip rows past ``n``."""
        items = -(-n // self.rows)
        return items if self.local is None else -(-items // self.local) * self.local

    def local_size(self) -> tuple[int, int] | None:
        """The group size over (rows, tokens): a chunk's tokens are its second dimension."""
        return None if self.local is None else (self.local, 1)

    def gemm_size(self, n: int, tokens: int) -> tuple[int, int]:
        """The gemm's work-items for ``n`` rows and ``tokens`` tokens, rounded up to whole groups: it skips the
        tiles past either end."""
        tiles = (-(-n // GEMM_TILE), -(-tokens // GEMM_TILE))
        if self.gemm_local is None:
            return tiles
        return (-(-tiles[0] // self.gemm_local[0]) * self.gemm_local[0],
                -(-tiles[1] // self.gemm_local[1]) * self.gemm_local[1])  # fmt: skip


FLAT_SHAPES = tuple(
    Shape(rows, local, wide) for wide in (False, True) for rows in ROWS_CHOICES for local in LOCAL_CHOICES
)
LANES_SHAPES = tuple(Shape(LANES, local, float_scales=True, lanes=True) for local in LANES_LOCAL_CHOICES)
SHAPES = FLAT_SHAPES + LANES_SHAPES


def shapes_for(half_scales: bool, lanes: bool) -> tuple[Shape, ...]:
    """The shapes to try for a type: float32 scales only where its blocks have half ones to widen, the lanes
    layout only where it has a lanes kernel."""
    flat = FLAT_SHAPES if half_scales else tuple(shape for shape in FLAT_SHAPES if not shape.float_scales)
    return flat + (LANES_SHAPES if lanes else ())


def first_shape(layout: tuple[bool, bool]) -> Shape:
    """A shape of ``layout``, whose rows the first round of ``Timer.tune`` times every group size at (the default
    rows; a lanes work-item's are fixed), and in which a matrix is uploaded to be timed in that layout."""
    float_scales, lanes = layout
    return LANES_SHAPES[0] if lanes else Shape(float_scales=float_scales)


def tuning_path(device: cl.Device, source: str) -> Path:
    """The record of ``device``'s shapes for kernels built from ``source``, as this tuning chooses them."""
    identity = "\n".join(
        (device.platform.name, device.platform.version, device.name, device.version, device.driver_version,
         TUNING_VERSION, source)
    )  # fmt: skip
    return cache_dir() / "opencl" / f"shapes-{hashlib.sha256(identity.encode()).hexdigest()[:32]}.json"


def recorded_shapes(path: Path) -> dict[str, Shape]:
    """The shapes measured before, by product (``shape_key``); none if there is no record or it cannot be read
    (then the products are measured again)."""
    try:
        record = json.loads(path.read_bytes())
        return {name: _shape(fields) for name, fields in record.items()}
    except (OSError, ValueError, TypeError, AttributeError, LookupError, RecursionError):
        return {}


def record_shapes(path: Path, shapes: dict[str, Shape]) -> None:
    """Add ``shapes`` to the record, read again under a lock: another process may have timed other products since
    this one read it (two first loads at once kept only the last one's). An unwritable cache only means measuring
    again at the next load, which a line says."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(path.with_name(path.name + ".lock")):
            kept = recorded_shapes(path) | shapes
            write_atomic(path, json.dumps({name: asdict(shape) for name, shape in sorted(kept.items())}) + "\n")
    except OSError as exc:
        log.warning(
            "cannot keep the OpenCL products' timings in %s (%s): the next load times them again; set "
            "EDGEINFER_CACHE_DIR to a writable folder", path.parent, exc.strerror or exc,
        )  # fmt: skip


def shape_key(type_name: str, n: int, k: int) -> str:
    """How a record names a product: its type and size."""
    return f"{type_name} {n}x{k}"


Key = TypeVar("Key", bound=Hashable)
Run = tuple[cl.Kernel, tuple[int, ...], "tuple[int, ...] | None"]  # a kernel with its arguments set, its sizes


class Timer:
    """Times kernels on a device from a cold cache, by its own timestamps."""

    def __init__(self, context: cl.Context) -> None:
        self.queue = cl.CommandQueue(context, properties=cl.command_queue_properties.PROFILING_ENABLE)
        program = cl.Program(context, FLUSH).build()
        self._flush, self._follow = cl.Kernel(program, "flush"), cl.Kernel(program, "follow")
        self._flush_buffers = (cl.Buffer(context, cl.mem_flags.READ_ONLY, FLUSH_BYTES),
                               cl.Buffer(context, cl.mem_flags.WRITE_ONLY, 4))  # fmt: skip
        # Written once: a CPU driver's never-written buffer can be the system's one zero page, always cached.
        cl.enqueue_fill_buffer(self.queue, self._flush_buffers[0], np.float32(1), 0, FLUSH_BYTES).wait()
        self._flush.set_args(*self._flush_buffers)
        self._follow.set_args(self._flush_buffers[1])

    def tune(self, launch: Callable[[Shape], tuple[cl.Kernel, int]], shapes: tuple[Shape, ...]) -> tuple[Shape, float]:
        """The fastest of ``shapes`` for a product whose launch in a shape is ``launch(shape)`` (its kernel and the
        rows it covers), and its median seconds: the layout chosen first, each timed in every group size at the
        rows of its ``first_shape``, then the other rows in that layout, which builds a fraction of the programs
        that trying every shape would (a first load on PoCL: 21 s for the flat shapes alone). The groups count in
        the first round: on PoCL SmolLM2's FFN down product took 82-86 us in the lanes layout in the driver's
        groups, no less than the flat layout's 67-94 us, but 55 us in groups of 4 (a /tmp script, 2026-12-05)."""
        firsts = tuple(shape for shape in shapes if shape.rows == first_shape(shape.layout).rows)
        timings = self.in_turns({shape: run for shape in firsts if (run := _timed_run(launch, shape))})
        layout = min(timings, key=timings.__getitem__).layout if timings else shapes[0].layout
        return self.fastest(launch, tuple(shape for shape in shapes if shape.layout == layout))

    def fastest(
        self, launch: Callable[[Shape], tuple[cl.Kernel, int]], shapes: tuple[Shape, ...]
    ) -> tuple[Shape, float]:
        """Of ``shapes``, the one whose launch runs fastest, and its median seconds. A shape the device refuses (a
        group larger than it allows) is skipped."""
        timings = self.in_turns({shape: run for shape in shapes if (run := _timed_run(launch, shape))})
        if not timings:
            raise BackendError("the OpenCL device refused every shape of the matrix products; try another device")
        best = min(timings, key=timings.__getitem__)
        return best, timings[best]

    def fastest_gemm(self, gemm: cl.Kernel, shape: Shape, n: int, tokens: int) -> Shape:
        """``shape`` with the fastest of ``GEMM_LOCALS`` for ``gemm`` (its arguments set) over ``n`` rows and
        ``tokens`` tokens; a group size the device refuses is skipped."""
        tried = [replace(shape, gemm_local=local) for local in GEMM_LOCALS]
        timings = self.in_turns({s: (gemm, s.gemm_size(n, tokens), s.gemm_local) for s in tried})
        return min(timings, key=timings.__getitem__, default=shape)

    def median_seconds(self, kernel: cl.Kernel, size: tuple[int, ...], local: tuple[int, ...] | None = None) -> float:
        """Median seconds of ``ROUNDS`` runs of ``kernel``, each after the caches are emptied and until a kernel
        after it has run (``in_turns``), after a warm-up."""
        timings = self.in_turns({kernel: (kernel, size, local)})
        if not timings:
            raise BackendError(f"the OpenCL device refused {kernel.function_name} in groups of {local}")
        return timings[kernel]

    def in_turns(self, runs: dict[Key, Run]) -> dict[Key, float]:
        """Median seconds of each run, timed in turns: ``ROUNDS`` rounds of each once, after the caches are emptied
        (after a warm-up of each). A shared machine's speed drifts from one second to the next, so runs timed back
        to back compare moments as much as kernels: here one tuning chose the flat layout for SmolLM2's Q, K and V
        and its gate and up on PoCL, and its 4-bit products took 1.18x as long a step as in the lanes layout that
        three other tunings chose. A run the device refuses (a group larger than it allows) is left out.

        A run counts until a one-work-item kernel after it has run, as a decode step runs every kernel between
        others: on PoCL the driver's groups for SmolLM2's 576x576 product were one group, which ran on one core
        and after which the next kernel started 13 us later, against 4 us after groups of 4; a step took 1.10x
        as long (a /tmp profile, 2026-12-05)."""
        times: dict[Key, list[float]] = {}
        for key, (kernel, size, local) in runs.items():
            try:
                cl.enqueue_nd_range_kernel(self.queue, kernel, size, local).wait()
            except cl.Error:
                continue
            times[key] = []
        for _ in range(ROUNDS):
            for key, taken in times.items():
                kernel, size, local = runs[key]
                cl.enqueue_nd_range_kernel(self.queue, self._flush, (FLUSH_BYTES // 16,), None)
                event = cl.enqueue_nd_range_kernel(self.queue, kernel, size, local)
                after = cl.enqueue_nd_range_kernel(self.queue, self._follow, (1,), None)
                after.wait()
                taken.append((after.profile.end - event.profile.start) * 1e-9)
        return {key: statistics.median(taken) for key, taken in times.items()}


def _timed_run(launch: Callable[[Shape], tuple[cl.Kernel, int]], shape: Shape) -> Run | None:
    """``launch(shape)`` as a run to time; None where the device refuses its kernel."""
    try:
        kernel, n = launch(shape)
    except cl.Error:
        return None
    return kernel, (shape.global_size(n), 1), shape.local_size()


def _shape(fields: dict) -> Shape:
    local = None if fields["local"] is None else _whole(fields["local"])
    if not isinstance(fields["float_scales"], bool) or not isinstance(fields["lanes"], bool):
        raise ValueError(f"float_scales or lanes is not true or false: {fields!r}")
    shape = Shape(_whole(fields["rows"]), local, fields["float_scales"], fields["lanes"])
    gemm_local = None if fields["gemm_local"] is None else tuple(_whole(size) for size in fields["gemm_local"])
    if shape not in SHAPES or gemm_local not in GEMM_LOCALS:
        raise ValueError(f"no such shape: {fields!r}")
    return replace(shape, gemm_local=gemm_local)


def _whole(value: object) -> int:
    """A record's count as it was written: a 4.7 or a "4" is no count, and its record is measured again."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"not a whole number: {value!r}")
    return value
