"""The ONNX Runtime backend: the GGUF's own blocks in a graph built from the file (``graph.py``).

The KV cache is one pool of ``capacity`` cells per layer, keys and values, allocated once.
GroupQueryAttention wants a sequence's cache as one dense ``(1, kv heads, cells, head_dim)``
tensor whose past and present are the same buffer, so each sequence owns a contiguous region
of the pool, bound to the graph by address (IO binding): no token's keys are ever copied to
run a step. Regions are sized to what their sequences hold plus a share of the free cells; a
sequence that outgrows its region has the regions laid out afresh (a copy of the cells in use,
rare). ``copy_prefix`` copies cells, so a copy costs cells (``shares_cells`` is False).

Regions start out equal, and are laid out equal again whenever what the sequences hold allows it:
then the pool of each layer is also one ``(sequences, kv heads, cells, head_dim)`` tensor, and
sequences that decode a token each run as one batch, in one pass over the weights, wherever a
batch is cheaper than its rows one by one (not with float activations for 4-bit codes).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import logging
import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import numpy as np
import onnxruntime as ort
from gguf import GGMLQuantizationType as QType

from edgeinfer.errors import BackendError, BackendUnavailableError, InvalidOptionError, first_line
from edgeinfer.models.info import ModelInfo
from edgeinfer.models.reference import Transformer
from edgeinfer.models.tensors import open_tensors
from edgeinfer.pages import lazy_zeros
from edgeinfer.system import BASE_OVERHEAD_BYTES, MemoryNeed

from ..base import (
    ARGMAX_NOT_FINITE,
    CPU,
    BackendOptions,
    Device,
    Span,
    check_copy,
    check_range,
    check_room,
    check_sequence,
    check_spans,
    compute_bytes,
)
from .activations import CALIBRATION_TOKENS, FLOAT, INT8, INT8_KLD_LIMIT, LOSSLESS_KLD_LIMIT, int8_kld
from .graph_cache import (
    cached_graph,
    choosing_accuracy_level,
    chosen_accuracy_level,
    is_built,
    record_accuracy_level,
    remove_graph,
)
from .spec import (
    FLOAT_TYPES,
    FOUR_BIT_TYPES,
    INPUT_IDS,
    LOGIT_ROWS,
    LOGITS,
    POSITION_IDS,
    SEQLENS_K,
    TOTAL_LENGTH,
    GraphSpec,
    activations,
    graph_bytes,
    past_names,
    present_names,
    product_types,
    rope_positions,
    unmapped_types,
)

log = logging.getLogger("edgeinfer.backends.onnx")
CPU_PROVIDER = "CPUExecutionProvider"
REMOTE_PROVIDER = "AzureExecutionProvider"  # calls a cloud endpoint; it runs no graph here


@dataclass
class _Region:
    """A sequence's part of the pool: ``size`` cells from ``start``, the first ``length`` of them in use."""

    start: int
    size: int
    length: int = 0


class _StepFeed:
    """A one-token step's inputs for one sequence, bound to its IO binding by address and written in place each
    step: binding fresh arrays took five calls of about 30 us a step, a quarter of a tiny model's step."""

    def __init__(self) -> None:
        self.ids = np.zeros((1, 1), np.int64)
        self.positions = np.zeros((1, 1), np.int64)
        self.seqlens = np.zeros(1, np.int32)  # positions held after the step, minus 1
        self.total = np.zeros((), np.int32)
        self.rows = np.zeros(1, np.int64)  # the one token's row gets logits

    def bind(self, binding: ort.IOBinding, logits: np.ndarray) -> None:
        inputs = {INPUT_IDS: self.ids, POSITION_IDS: self.positions, SEQLENS_K: self.seqlens, TOTAL_LENGTH: self.total,
                  LOGIT_ROWS: self.rows}  # fmt: skip
        for name, array in inputs.items():
            binding.bind_input(name, "cpu", 0, array.dtype, array.shape, array.ctypes.data)
        binding.bind_output(LOGITS, "cpu", 0, np.float32, logits.shape, logits.ctypes.data)

    def write(self, token: int, position: int) -> None:
        self.ids[0, 0] = token
        self.positions[0, 0] = position
        self.seqlens[0] = position
        self.total[()] = position + 1


class OnnxRuntimeBackend:
    """GGUF models on ONNX Runtime: MatMulNBits over the file's blocks, GroupQueryAttention over a fixed cache."""

    name: ClassVar[str] = "onnxruntime"
    kv_block: ClassVar[int] = 1
    # f32 first: ONNX Runtime's CPU GroupQueryAttention has no fast half-precision kernel, and an f16 cache also
    # casts Q, K, V and the output every layer. tiny-qwen2 Q4_0 decodes 1.42x as fast with f32 (docs/BENCHMARKS.md,
    # "An f32 cache by default"); the cache holds twice the bytes for the same tokens, its pages taken as used.
    kv_types: ClassVar[tuple[str, ...]] = ("f32", "f16")
    shares_cells: ClassVar[bool] = False
    loads_llamacpp: ClassVar[bool] = False
    follows: ClassVar[bool] = True
    _KV_DTYPES: ClassVar[dict[str, type]] = {"f16": np.float16, "f32": np.float32}

    @classmethod
    def supports(cls, info: ModelInfo) -> str | None:
        hp = info.hparams
        if not hp.arch.reference:
            return f"its graph builder does not implement the {info.architecture} architecture"
        if hp.rope_scaling != "none":
            return f"{info.path.name} scales RoPE for a longer context ({hp.rope_scaling}), which it does not build"
        if hp.kv_heads_per_layer or hp.value_dim not in (None, hp.head_dim):
            return f"{info.path.name} has layers of different attention shapes, which it does not build"
        types = unmapped_types(info)
        if types:
            return f"{info.path.name} has {', '.join(types)} tensors, which it has no ONNX form for"
        return None

    @classmethod
    def devices(cls) -> list[Device]:
        """The CPU, then every other execution provider the installed onnxruntime offers, by its own name: those
        that compute here (Azure's sends a request to a cloud endpoint, which this backend's graph is not for)."""
        others = [name for name in ort.get_available_providers() if name not in (CPU_PROVIDER, REMOTE_PROVIDER)]
        return [Device(CPU, "the CPU, through ONNX Runtime's CPU execution provider", aliases=(CPU_PROVIDER,))] + [
            Device(name, f"ONNX Runtime's {name}, falling back to the CPU for what it cannot run") for name in others
        ]

    @classmethod
    def kv_bytes_per_token(cls, info: ModelInfo, kv_type: str) -> float:
        return info.kv_values_per_token * np.dtype(cls._KV_DTYPES[kv_type]).itemsize

    @classmethod
    def memory(cls, info: ModelInfo, options: BackendOptions) -> MemoryNeed:
        kv = int(options.kv_tokens * cls.kv_bytes_per_token(info, options.kv_type))
        # The graph's weights, prepacked for MatMulNBits from a mapped file let go of weight by weight. At its peak,
        # loading a built graph held 1.05x and 1.19x the graph on disk, building one 2.25x and 2.15x (SmolLM2,
        # Gemma 3 270M; docs/BENCHMARKS.md): a build needs about one graph more, for the load only.
        weights = graph_bytes(info)
        level = chosen_accuracy_level(info) if _measured(info) else FLOAT
        built = level is not None and is_built(info, GraphSpec(options.kv_type, level))
        building = 0 if built else weights  # measuring the level builds the two graphs one after the other
        return MemoryNeed(
            weights=weights * 5 // 4,
            kv=kv,
            overhead=BASE_OVERHEAD_BYTES + compute_bytes(info, options) + building,
        )

    def __init__(self, info: ModelInfo, options: BackendOptions, *, accuracy_level: int | None = None) -> None:
        """Load ``info``'s graph (built first if need be) at ``accuracy_level`` (``activations.py``): by default the
        level measured for the model (``accuracy_level``)."""
        reason = self.supports(info)
        if reason is not None:
            raise BackendUnavailableError(f"the onnxruntime backend cannot run this model: {reason}")
        if options.kv_tokens > rope_positions(info.hparams):
            raise InvalidOptionError(
                f"the onnxruntime backend holds at most {rope_positions(info.hparams):,} positions of "
                f"{info.path.name}, not {options.kv_tokens:,}: lower --kv-budget"
            )
        self._closed = True  # until loaded
        hp = info.hparams
        self._hp = hp
        self._n_vocab = hp.n_vocab
        self._batch_size = options.batch_size
        level = self.accuracy_level(info, options) if accuracy_level is None else accuracy_level
        spec = GraphSpec(options.kv_type, level)
        graph = cached_graph(info, spec)
        self._session = self._open_session(info, graph, options)
        with open_tensors(info) as tensors:
            self._rotary = Transformer(hp, tensors.dequantize)  # RoPE frequencies, for re-rotating evicted keys
        self._dtype = self._KV_DTYPES[options.kv_type]
        self._row = hp.n_head_kv * hp.head_dim  # values one cell of one layer's keys takes
        share = -(-options.kv_tokens // options.n_seq)  # rounded up: equal regions, which a batched step needs
        self._pool = lazy_zeros((hp.n_layer, 2, share * options.n_seq * self._row), self._dtype)  # RAM as cells fill
        self._regions = [_Region(seq * share, share) for seq in range(options.n_seq)]
        self._bindings: dict[int, ort.IOBinding] = {}  # a sequence's cache, bound: dropped when regions move
        self._feeds = [_StepFeed() for _ in range(options.n_seq)]
        self._stepping: set[int] = set()  # sequences whose binding holds their step feed
        self._together: dict[tuple[int, int], ort.IOBinding] = {}  # sequences first to last as one batch, bound
        # Float activations for 4-bit codes take MLAS's dequantizing path for more than one row: two rows took
        # 1.6x to 3.6x as long as one (docs/BENCHMARKS.md), so such a graph runs each sequence on its own.
        self._batches = not (_four_bit(info) and level == FLOAT)
        self._last_logits = [np.zeros((1, hp.n_vocab), np.float32) for _ in range(options.n_seq)]  # last rows
        self._rows = np.zeros((options.n_seq, hp.n_vocab), np.float32)  # a batched step's rows
        self._closed = False

    @classmethod
    def accuracy_level(cls, info: ModelInfo, options: BackendOptions) -> int:
        """The graph's level for ``info``: int8 activations in one pass where they move the model little, measured at
        its first load (``activations.py``) and kept in the graph cache."""
        if not _measured(info):
            return FLOAT  # the level changes nothing: other 8-bit codes always take one int8 pass, floats none
        chosen = chosen_accuracy_level(info)
        if chosen is not None:  # read without the lock: a cache only read (read-only, say) needs no lock file
            return chosen
        with choosing_accuracy_level(info):
            level = chosen_accuracy_level(info)
            if level is None:
                log.info("measuring whether %s can take int8 activations (once per model)", info.path.name)
                calibration = dataclasses.replace(options, kv_tokens=CALIBRATION_TOKENS, n_seq=1)
                kld = int8_kld(lambda at: cls(info, calibration, accuracy_level=at))
                limit = LOSSLESS_KLD_LIMIT if _lossless(info) else INT8_KLD_LIMIT
                level = INT8 if kld <= limit else FLOAT
                record_accuracy_level(info, level, kld)
                remove_graph(info, GraphSpec(options.kv_type, FLOAT if level == INT8 else INT8))
                log.info("%s: int8 activations move it by KLD %.1e (limit %.0e): %s kept", info.path.name, kld,
                         limit, activations(info, level))  # fmt: skip
        return level

    # -- contract -----------------------------------------------------------------------------------

    @property
    def capacity(self) -> int:
        return self._pool.shape[2] // self._row

    @property
    def n_seq(self) -> int:
        return len(self._regions)

    @property
    def can_shift(self) -> bool:
        return True

    @property
    def can_truncate(self) -> bool:
        return True

    def save_state(self, seq: int) -> None:
        return None  # its cells live in its own buffers, with no format to write them in

    def load_state(self, seq: int, data: bytes, n: int) -> bool:
        return False

    @property
    def n_vocab(self) -> int:
        return self._n_vocab

    def eval(self, spans: Sequence[Span]) -> list[np.ndarray]:
        self._check_open()
        lengths = self._lengths()
        check_spans(spans, lengths, self._n_vocab)
        check_room(sum(len(span.tokens) for span in spans), self.capacity - sum(lengths), self.capacity)
        regions, chunk = self._regions, self._batch_size
        if any(span.start + len(span.tokens) > regions[span.seq].size for span in spans):
            self._lay_out({span.seq: span.start + len(span.tokens) for span in spans})
        out = []
        try:
            if self._batchable(spans):
                return self._run_together(spans)
            for span in spans:
                tokens, all_logits = span.tokens, span.all_logits
                if len(tokens) <= chunk:  # a decode step, or a short draft: one run
                    logits = self._run(span.seq, tokens, all_logits)
                else:
                    starts = range(0, len(tokens), chunk)
                    rows = [self._run(span.seq, tokens[i : i + chunk], all_logits) for i in starts]
                    logits = np.concatenate(rows) if all_logits else rows[-1]
                out.append(self._follow(span.seq, logits[-1], span.follow, span.ends) if span.follow else
                           logits if all_logits else logits[-1])  # fmt: skip
        except BaseException:
            for span in spans:  # a failed evaluation changes nothing
                self._regions[span.seq].length = span.start
            raise
        return out

    def truncate(self, seq: int, n: int) -> None:
        self._check_open()
        lengths = self._lengths()
        check_sequence(seq, lengths)
        check_range(seq, min(n, lengths[seq]), lengths[seq], lengths)  # n past the end truncates nothing
        region = self._regions[seq]
        region.length = min(region.length, n)

    def evict(self, seq: int, start: int, end: int) -> None:
        self._check_open()
        check_range(seq, start, end, self._lengths())
        region = self._regions[seq]
        cache = self._view(seq)  # (layers, 2, kv heads, cells, head_dim)
        kept = cache[:, :, :, end : region.length].copy()
        # Rotating by -(end - start) positions moves the keys' RoPE to their new places.
        back = np.full(kept.shape[3], start - end)
        for layer in range(self._hp.n_layer):
            keys = kept[layer, 0].transpose(1, 0, 2).astype(np.float32)  # (cells, kv heads, head_dim)
            kept[layer, 0] = self._rotary.rope(keys, back, layer).transpose(1, 0, 2)
        cache[:, :, :, start : start + kept.shape[3]] = kept
        region.length -= end - start

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        self._check_open()
        check_copy(src, dst, n, self._lengths())
        self._regions[dst].length = 0
        if n > self._regions[dst].size:
            check_room(n, self.capacity - sum(self._lengths()), self.capacity)
            self._lay_out({dst: n})
        self._view(dst)[:, :, :, :n] = self._view(src)[:, :, :, :n]
        self._regions[dst].length = n

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._bindings.clear()
        self._stepping.clear()
        self._together.clear()
        del self._session
        self._pool = np.zeros((0, 2, 0), self._dtype)

    # -- inside -------------------------------------------------------------------------------------

    @staticmethod
    def _open_session(info: ModelInfo, graph: Path, options: BackendOptions) -> ort.InferenceSession:
        """A session on ``options.device``'s provider (the CPU taking the nodes it cannot run), or on the CPU alone,
        with a one-line note, where that provider cannot run the graph at all."""
        settings = ort.SessionOptions()
        settings.intra_op_num_threads = options.threads
        settings.inter_op_num_threads = 1
        settings.log_severity_level = 4  # fatal only: a failed run becomes one BackendError line, not a log line too
        wanted = [CPU_PROVIDER] if options.device == CPU else [options.device, CPU_PROVIDER]
        said = io.StringIO()
        try:
            # ONNX Runtime reports a provider it cannot start in lines of its own (a warning; four printed lines as
            # it retries on the CPU): the one line below says it instead. The CPU's own session says nothing.
            with contextlib.ExitStack() as quiet:
                if options.device != CPU:
                    quiet.enter_context(warnings.catch_warnings())
                    warnings.filterwarnings("ignore", message="Specified provider")
                    quiet.enter_context(contextlib.redirect_stdout(said))
                session = ort.InferenceSession(str(graph), settings, providers=wanted)
        except Exception as exc:  # noqa: BLE001 - onnxruntime raises its own classes, all of them Exception
            if options.device == CPU:
                raise BackendError(
                    f"ONNX Runtime cannot load the graph built for {info.path.name} ({graph}): {first_line(exc)};"
                    " remove that file to build it again"
                ) from None
            log.warning("%s cannot run %s (%s); running on the CPU", options.device, info.path.name, first_line(exc))
            return OnnxRuntimeBackend._open_session(info, graph, dataclasses.replace(options, device=CPU))
        if options.device != CPU and options.device not in session.get_providers():
            why = next((line.strip() for line in said.getvalue().splitlines() if line.startswith("EP Error")), "")
            log.warning("%s cannot run %s here%s; running on the CPU", options.device, info.path.name,
                        f" ({why[:200]})" if why else "")  # fmt: skip
        return session

    def _run(self, seq: int, tokens: Sequence[int], all_logits: bool) -> np.ndarray:
        region = self._regions[seq]
        binding = self._bindings.get(seq) or self._bind(seq)
        n, start = len(tokens), region.length
        total = start + n
        logits = np.empty((n, self._n_vocab), np.float32) if all_logits else self._last_logits[seq]
        if n == 1 and not all_logits:  # a decode step: its inputs are written in place, bound once
            feed = self._feeds[seq]
            if seq not in self._stepping:
                feed.bind(binding, logits)
                self._stepping.add(seq)
            feed.write(tokens[0], start)
        else:
            self._stepping.discard(seq)  # the inputs bound below replace the step's
            binding.bind_cpu_input(INPUT_IDS, np.asarray(tokens, np.int64).reshape(1, n))
            binding.bind_cpu_input(POSITION_IDS, np.arange(start, total, dtype=np.int64).reshape(1, n))
            binding.bind_cpu_input(SEQLENS_K, np.array([total - 1], np.int32))
            binding.bind_cpu_input(TOTAL_LENGTH, np.array(total, np.int32))
            rows = np.arange(n, dtype=np.int64) if all_logits else np.array([n - 1], np.int64)
            binding.bind_cpu_input(LOGIT_ROWS, rows)
            binding.bind_output(LOGITS, "cpu", 0, np.float32, logits.shape, logits.ctypes.data)
        region.length = total  # the cells the step writes are the sequence's now (undone if it fails)
        try:
            self._session.run_with_iobinding(binding)
        except Exception as exc:  # noqa: BLE001 - onnxruntime's failures are its own Exception classes
            raise BackendError(f"ONNX Runtime failed mid-evaluation: {first_line(exc)}") from None
        return logits

    def _follow(self, seq: int, row: np.ndarray, steps: int, ends: frozenset[int]) -> np.ndarray:
        """``row``'s argmax, then each next row's after evaluating the token before, ``steps`` more at most: fewer
        where ``seq``'s region is full, a winner is not finite or a token is in ``ends`` (``Span.follow``)."""
        region = self._regions[seq]
        steps = min(steps, region.size - region.length)
        tokens = []
        while True:
            token = int(row.argmax())
            if not math.isfinite(row[token]):
                tokens.append(ARGMAX_NOT_FINITE)
                break
            tokens.append(token)
            if len(tokens) > steps or token in ends:
                break
            self._run(seq, (token,), False)  # into ``row``: the sequence's own last row
        return np.array(tokens, np.int64)

    def _batchable(self, spans: Sequence[Span]) -> bool:
        """Whether ``spans`` can run as one batch: the graph's products gain from it; a token each, for several
        sequences, while every region is of one size (the batch's cache tensor) with a free cell in each
        sequence the batch spans (the step writes to every one)."""
        if not self._batches or len(spans) < 2 or any(len(span.tokens) != 1 or span.follow for span in spans):
            return False
        share = self.capacity // self.n_seq
        first, last = min(span.seq for span in spans), max(span.seq for span in spans)
        return all(r.start == s * share and r.size == share for s, r in enumerate(self._regions)) and all(
            r.length < r.size for r in self._regions[first : last + 1]
        )

    def _run_together(self, spans: Sequence[Span]) -> list[np.ndarray]:
        """One step for the sequences from the first span's to the last's, a token each: one pass over the
        weights for all of them. One between them with no span steps too, on token 0 into its first free
        cell, which holds nothing of it; its row is not computed past the last layer."""
        first, last = min(span.seq for span in spans), max(span.seq for span in spans)
        binding = self._together.get((first, last)) or self._bind_together(first, last)
        lengths = np.array(self._lengths()[first : last + 1], np.int64)
        ids = np.zeros((len(lengths), 1), np.int64)
        for span in spans:
            ids[span.seq - first, 0] = span.tokens[0]
        binding.bind_cpu_input(INPUT_IDS, ids)
        binding.bind_cpu_input(POSITION_IDS, lengths.reshape(-1, 1))
        binding.bind_cpu_input(SEQLENS_K, lengths.astype(np.int32))  # positions held after the step, minus 1
        binding.bind_cpu_input(TOTAL_LENGTH, np.array(lengths.max() + 1, np.int32))
        binding.bind_cpu_input(LOGIT_ROWS, np.array([span.seq - first for span in spans], np.int64))
        rows = self._rows[: len(spans)]
        binding.bind_output(LOGITS, "cpu", 0, np.float32, rows.shape, rows.ctypes.data)
        for span in spans:
            self._regions[span.seq].length += 1
        try:
            self._session.run_with_iobinding(binding)
        except Exception as exc:  # noqa: BLE001 - onnxruntime's failures are its own Exception classes
            raise BackendError(f"ONNX Runtime failed mid-evaluation: {first_line(exc)}") from None
        return [rows[i : i + 1] if span.all_logits else rows[i] for i, span in enumerate(spans)]

    def _bind_together(self, first: int, last: int) -> ort.IOBinding:
        """An IO binding with the regions of sequences ``first`` to ``last`` of every layer as one batch."""
        binding = self._session.io_binding()
        hp, share = self._hp, self.capacity // self.n_seq
        shape = (last + 1 - first, hp.n_head_kv, share, hp.head_dim)
        for layer in range(hp.n_layer):
            for kind, (past, present) in enumerate(zip(past_names(layer), present_names(layer), strict=True)):
                address = self._pool[layer, kind, first * share * self._row :].ctypes.data
                binding.bind_input(past, "cpu", 0, self._dtype, shape, address)
                binding.bind_output(present, "cpu", 0, self._dtype, shape, address)
        self._together[first, last] = binding
        return binding

    def _bind(self, seq: int) -> ort.IOBinding:
        """An IO binding with ``seq``'s region of every layer's cache as its past and present."""
        binding = self._session.io_binding()
        view = self._view(seq)
        shape = view.shape[2:]
        for layer in range(self._hp.n_layer):
            for kind, (past, present) in enumerate(zip(past_names(layer), present_names(layer), strict=True)):
                address = view[layer, kind].ctypes.data  # keys (0) or values (1)
                binding.bind_input(past, "cpu", 0, self._dtype, (1, *shape), address)
                binding.bind_output(present, "cpu", 0, self._dtype, (1, *shape), address)
        self._bindings[seq] = binding
        return binding

    def _view(self, seq: int) -> np.ndarray:
        """``seq``'s region of the pool: (layers, keys and values, kv heads, cells, head_dim), a view."""
        region, hp = self._regions[seq], self._hp
        cells = self._pool[:, :, region.start * self._row : (region.start + region.size) * self._row]
        return cells.reshape(hp.n_layer, 2, hp.n_head_kv, region.size, hp.head_dim)

    def _lay_out(self, needs: dict[int, int]) -> None:
        """Lay the regions out afresh so that each sequence in ``needs`` has that many cells: every region keeps
        what it holds, the growing ones share half of the cells left over, and every sequence gets an even
        share of the other half."""
        held = [self._view(s)[:, :, :, : r.length].copy() for s, r in enumerate(self._regions)]
        sizes = [max(needs.get(s, 0), r.length) for s, r in enumerate(self._regions)]
        share = self.capacity // self.n_seq
        if max(sizes) < share:  # equal regions again, each with a free cell: sequences can step together
            sizes = [share] * self.n_seq
        spare = self.capacity - sum(sizes)
        sizes = [size + spare // 2 // len(sizes) + (spare // 2 // len(needs) if s in needs else 0)
                 for s, size in enumerate(sizes)]  # fmt: skip
        sizes[max(needs)] += self.capacity - sum(sizes)
        start = 0
        for region, size in zip(self._regions, sizes, strict=True):
            region.start, region.size = start, size
            start += size
        for s, cells in enumerate(held):
            self._view(s)[:, :, :, : cells.shape[3]] = cells
        self._bindings.clear()
        self._stepping.clear()
        self._together.clear()

    def _lengths(self) -> list[int]:
        return [region.length for region in self._regions]

    def _check_open(self) -> None:
        if self._closed:
            raise BackendError("this onnxruntime backend is closed (its engine was closed); create a new Engine")


def _four_bit(info: ModelInfo) -> bool:
    """Whether ``info`` has products of 4-bit codes, whose activations can be float or int8."""
    return not product_types(info).isdisjoint(FOUR_BIT_TYPES)


def _measured(info: ModelInfo) -> bool:
    """Whether ``info``'s level is measured: it has products of 4-bit codes (float activations or int8) or of Q8_0
    (two int8 passes or one)."""
    return not product_types(info).isdisjoint({*FOUR_BIT_TYPES, QType.Q8_0})


def _lossless(info: ModelInfo) -> bool:
    """Whether ``info``'s products are all Q8_0 or float, whose codes lose next to nothing."""
    return product_types(info) <= {QType.Q8_0, *FLOAT_TYPES}
