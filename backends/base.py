"""The backend contract: a logit machine with a KV cache, addressed by sequence.

A backend loads weights, evaluates tokens of one or several sequences at given positions and
returns logits, and keeps their KV cache. It does not sample, stop, template, route or time
anything; the engine does all of that once for every backend. If a new backend needs a special
case in the engine, change this contract instead.

Sequences are numbered ``0 .. n_seq - 1``. The KV cache is one pool of ``capacity`` cells shared
by all of them: a cell holds one position of one sequence, or of several once ``copy_prefix``
has shared it (where the backend ``shares_cells``). Positions are 0-based and contiguous from 0 within a sequence.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, NamedTuple, Protocol, runtime_checkable

import numpy as np

from edgeinfer.errors import BackendError, InvalidOptionError, NoSuchDeviceError
from edgeinfer.models.info import ModelInfo
from edgeinfer.system import MemoryNeed

# Prompt tokens per evaluation step. The engine reuses a cached prefix in whole chunks of this
# size, so small chunks keep more of a chat cached: on SmolLM2, 64 prefills at 0.94x the best
# size (128) and re-evaluates 84 tokens at a chat's fifth turn, against 212 at 256 or 512
# (scripts/bench_prefill.py --threads 2 --runs 3).
DEFAULT_BATCH_SIZE = 64

CPU = "cpu"


@dataclass(frozen=True)
class BackendOptions:
    """How the engine asks a backend to set itself up."""

    kv_tokens: int  # KV cells wanted in all, across sequences; the backend may round up to its ``kv_block``
    kv_type: str | None = "f16"  # one of the backend's ``kv_types``; None: its first (``check_options`` chooses)
    threads: int = 1
    batch_size: int = DEFAULT_BATCH_SIZE  # most tokens one evaluation step takes
    n_seq: int = 1  # sequences the cache holds at once
    device: str = CPU  # one of the backend's ``devices()``
    gpu_layers: int = -1  # layers placed on ``device`` when it is a GPU (-1: all)


@dataclass(frozen=True)
class Device:
    """Somewhere a backend can run: the CPU, or an accelerator with memory of its own."""

    name: str  # what ``BackendOptions.device`` names it
    description: str
    free_bytes: int | None = None  # the device's own memory; None for the CPU (host RAM is checked instead)
    total_bytes: int | None = None
    emulated: bool = False  # a GPU's interface run on the CPU (Mesa's lavapipe): auto passes it over
    aliases: tuple[str, ...] = ()  # other names it answers to, whole: ONNX Runtime's own for the CPU

    @property
    def has_own_memory(self) -> bool:
        """A GPU whose memory the backend places layers in, not host RAM."""
        return self.free_bytes is not None


class Span(NamedTuple):
    """Tokens of sequence ``seq`` at positions ``start, start + 1, ...``.

    ``start`` must equal the number of positions the sequence holds. With ``all_logits``
    the backend returns every token's logits, else only the last one's. With ``argmax`` (and not
    ``all_logits``) the caller wants only the last row's greedy token: a backend may return that
    instead of the row (``ARGMAX_NOT_FINITE`` where the winner is a NaN or an infinity), which
    spares a device the row's trip back.

    With ``follow`` (an ``argmax`` span, to a backend that ``follows``) the backend goes on greedily: it evaluates
    that argmax token and takes the argmax of its row, and so on, up to ``follow`` times (fewer where it likes, e.g.
    where the sequence's cells run out, or after a winner that is not finite), and never past a token in ``ends``
    (the model's end-of-generation tokens). It returns a 1-d int64 array: the argmax of the span's last row, then of
    each row it went on to; the sequence holds the span's tokens and every returned token but the last. A tiny
    model's step is a few hundred microseconds, and the engine's own Python around each call a sizeable share of
    it: following spreads that over several tokens.
    """

    seq: int
    start: int
    tokens: Sequence[int]
    all_logits: bool = False
    argmax: bool = False
    follow: int = 0
    ends: frozenset[int] = frozenset()


# What a backend returns for an ``argmax`` span whose winning logit is not finite: NaN wins, as in numpy's argmax.
ARGMAX_NOT_FINITE = -1


@runtime_checkable
class Backend(Protocol):
    """What every backend implements; ``backends/__init__.py`` registers it by name."""

    name: ClassVar[str]
    kv_block: ClassVar[int]
    """The backend allocates KV in multiples of this many cells."""
    kv_types: ClassVar[tuple[str, ...]]
    """KV cache element types it supports, its default first, e.g. ``("f16", "q8_0")``: the engine's cache is of
    the first unless the caller names another."""
    shares_cells: ClassVar[bool]
    """Whether ``copy_prefix`` shares the source's cells (free) or copies them (a cell per copied position)."""
    loads_llamacpp: ClassVar[bool]
    """Whether it runs on llama.cpp, whose tokenizer then comes with it. Where it does not, the engine tokenizes
    with Hugging Face's ``tokenizers`` where that is quick, rather than load llama.cpp (and the GPU drivers it
    opens) only to tokenize."""
    follows: ClassVar[bool]
    """Whether ``eval`` goes on greedily after an ``argmax`` span that asks it to (``Span.follow``); the engine asks
    only a backend that does."""

    def __init__(self, info: ModelInfo, options: BackendOptions) -> None:
        """Load the model; raise an ``EdgeInferError`` naming the problem if it cannot (a model ``supports``
        refuses included)."""
        ...

    @classmethod
    def supports(cls, info: ModelInfo) -> str | None:
        """None if this backend can run the model, else a one-line reason why not (checked before loading)."""
        ...

    @classmethod
    def devices(cls) -> list[Device]:
        """Where it can run here, first where it runs unless told, named ``cpu``: the CPU, or its default device
        (whose memory, a GPU's, ``free_bytes`` gives)."""
        ...

    @classmethod
    def kv_bytes_per_token(cls, info: ModelInfo, kv_type: str) -> float:
        """Bytes one cell of its KV cache takes for this model: it lays the cache out."""
        ...

    @classmethod
    def memory(cls, info: ModelInfo, options: BackendOptions) -> MemoryNeed:
        """Host and device bytes the loaded model will take (for the check before loading)."""
        ...

    @property
    def capacity(self) -> int:
        """KV cells actually allocated, in all (>= the requested ``kv_tokens``)."""
        ...

    @property
    def n_seq(self) -> int:
        """Sequences the cache can hold at once."""
        ...

    @property
    def can_shift(self) -> bool:
        """Whether ``evict`` works (false for caches without positions, e.g. recurrent models)."""
        ...

    @property
    def can_truncate(self) -> bool:
        """Whether ``truncate`` and ``copy_prefix`` work at any position. False where a recurrent state has
        absorbed every token it saw: such a sequence can only be emptied (``truncate(seq, 0)``) or copied whole."""
        ...

    @property
    def n_vocab(self) -> int:
        """Length of a row of logits."""
        ...

    def eval(self, spans: Sequence[Span]) -> list[np.ndarray]:
        """Append each span's tokens to its sequence's cache, all in one forward pass; return their logits.

        One float32 array per span: its last token's ``(n_vocab,)`` logits, or
        ``(len(tokens), n_vocab)`` with ``all_logits``; for an ``argmax`` span, that row or a 0-d
        int64 array holding its argmax, and with ``follow`` the argmax tokens (``Span``). An array may be a view of
        the backend's own buffer, valid until the next call; copy it to keep it. Two spans
        may not name the same sequence. A span may hold more tokens than ``batch_size``: the
        backend splits it. Every refusal (an unknown or repeated sequence, a start that is not
        the sequence's length, a full cache) is a one-line ``BackendError``, and an evaluation
        that fails leaves every sequence as it was.
        """
        ...

    def truncate(self, seq: int, n: int) -> None:
        """Forget sequence ``seq``'s positions ``>= n``."""
        ...

    def save_state(self, seq: int) -> bytes | None:
        """``seq``'s KV state, as bytes ``load_state`` takes in another process with the same model, options and
        build; None where this backend cannot save one (the engine's prompt cache on disk is then skipped)."""
        ...

    def load_state(self, seq: int, data: bytes, n: int) -> bool:
        """Make ``seq``, empty, hold the ``n`` positions ``data`` (from ``save_state``) holds; False, with ``seq``
        left empty, where ``data`` is not a state this backend can read."""
        ...

    def evict(self, seq: int, start: int, end: int) -> None:
        """Drop ``seq``'s positions ``[start, end)`` and shift later ones down by ``end - start``.

        Re-rotating the shifted keys (RoPE) is the backend's job. The positions from
        ``start`` on must not be shared with another sequence (the engine ensures it).
        """
        ...

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        """Make sequence ``dst`` hold ``src``'s first ``n`` positions, without recomputing them.

        ``dst`` is emptied first. With ``shares_cells`` the cells are shared, not copied: they cost
        nothing until one of the two sequences is truncated past them. Without it they are copied, and a
        copy that does not fit the free cells is a one-line ``BackendError`` that leaves ``dst`` empty.
        """
        ...

    def close(self) -> None:
        """Free native memory now rather than at garbage collection. A second call does nothing;
        any other call after it raises ``BackendError``."""
        ...


def check_options(backend: type[Backend], options: BackendOptions) -> BackendOptions:
    """``options`` with its device by name: its own, its index after the default (``--device 1``: the second), or a
    part of its name or description (``--device pocl``, ``--device cuda``); and its KV type (None: the backend's
    first); or a one-line refusal of what the backend cannot honour, naming the choices."""
    if options.kv_type is None:
        options = dataclasses.replace(options, kv_type=backend.kv_types[0])
    if options.kv_type not in backend.kv_types:
        raise InvalidOptionError(
            f"KV type {options.kv_type!r} is not supported by the {backend.name} backend; "
            f"choose one of {', '.join(backend.kv_types)}"
        )
    devices = backend.devices()
    names = [d.name for d in devices]
    aliased = {alias.lower(): d.name for d in devices for alias in d.aliases}
    wanted, place = options.device, place_in_list(options.device)
    spoken = wanted.strip().lower()  # how the CPU and aliases are matched: whole, in any case
    if spoken == CPU:
        options = dataclasses.replace(options, device=CPU)
    elif spoken in aliased:
        options = dataclasses.replace(options, device=aliased[spoken])
    elif place is not None:  # an index, never a part of a name
        if wanted not in names and place < len(devices) - 1:
            options = dataclasses.replace(options, device=names[place + 1])
    elif wanted not in names:
        described = [(d.name, d.name, d.description) for d in devices[1:]]
        found = device_by_part(wanted, described, f"{backend.name} devices")
        options = dataclasses.replace(options, device=found or wanted)
    if options.device not in names:
        raise NoSuchDeviceError(
            f"the {backend.name} backend has no device {options.device!r} here; choose one of {', '.join(names)}, "
            "or a part of its name or description (`edgeinfer info` lists every backend's devices)",
            options.device,
            backend.name,
            names,
        )
    gpu = options.device if options.device != CPU else None
    if gpu is None and devices[0].has_own_memory:  # the default device is a GPU
        gpu = devices[0].description
    if options.gpu_layers > 0 and gpu is None:
        raise InvalidOptionError("--gpu-layers needs a GPU device (--device); the CPU holds every layer already")
    if options.gpu_layers == 0 and gpu is not None:
        raise InvalidOptionError(f"--gpu-layers 0 puts nothing on {gpu}; give a number of layers, or -1 for all")
    return options


def place_in_list(wanted: str) -> int | None:
    """``wanted`` as a place in a list of devices where it is a number alone, spaces around it ignored: a number is
    never a part of a description ("OpenCL C 1.2" holds a 1). One too long to be a place is past any list."""
    digits = wanted.strip()
    if not (digits.isascii() and digits.isdigit()):
        return None
    return int(digits) if len(digits) < 10 else 10**10


def device_by_part(wanted: str, devices: Sequence[tuple[str, str, str]], kind: str) -> str | None:
    """The key of the one of ``devices`` (key, name, description) whose name holds ``wanted`` in any case, else
    whose description does; None where none does (or ``wanted`` is blank), and a one-line refusal naming them where
    several do."""
    part = wanted.strip().lower()
    if not part:
        return None
    found = [key for key, name, _ in devices if part in name.lower()] or [
        key for key, _, description in devices if part in description.lower()
    ]
    if len(found) > 1:
        raise InvalidOptionError(f"{wanted!r} matches several {kind} ({', '.join(found)}); name one")
    return found[0] if found else None


def compute_bytes(info: ModelInfo, options: BackendOptions) -> int:
    """One batch of activations and the logits buffer, in f32: what a forward pass allocates beside weights and KV."""
    hp = info.hparams
    return 4 * options.batch_size * (hp.n_vocab + 8 * hp.n_embd)


def check_sequence(seq: int, lengths: Sequence[int]) -> None:
    """Refuse a sequence number the cache does not have (``lengths``: positions each sequence holds)."""
    if not 0 <= seq < len(lengths):
        raise BackendError(f"sequence {seq} does not exist: this cache holds sequences 0..{len(lengths) - 1}")


def check_copy(src: int, dst: int, n: int, lengths: Sequence[int]) -> None:
    """Refuse a ``copy_prefix`` the contract forbids, in one line."""
    check_sequence(src, lengths)
    check_sequence(dst, lengths)
    if src == dst:
        raise BackendError(f"cannot copy sequence {src} into itself")
    if n > lengths[src]:
        raise BackendError(f"sequence {src} holds {lengths[src]} positions, not {n}")


def check_spans(spans: Sequence[Span], lengths: Sequence[int], n_vocab: int) -> None:
    """Refuse, in one line, an evaluation the contract forbids: an unknown or repeated sequence, an empty
    span, one that does not start where its sequence ends, or a token outside the vocabulary."""
    seen = set()
    for span in spans:
        check_sequence(span.seq, lengths)
        if not span.tokens:
            raise BackendError("eval needs at least one token per sequence")
        if span.follow and (span.follow < 0 or not span.argmax or span.all_logits):
            raise BackendError(f"follow={span.follow}: only an argmax span, without all_logits, goes on greedily")
        if min(span.tokens) < 0 or max(span.tokens) >= n_vocab:
            bad = next(token for token in span.tokens if not 0 <= token < n_vocab)
            raise BackendError(f"token {bad} is not in the model's vocabulary (ids 0 to {n_vocab - 1})")
        if span.seq in seen:
            raise BackendError(f"sequence {span.seq} appears twice in one evaluation")
        if span.start != lengths[span.seq]:
            raise BackendError(
                f"cannot evaluate sequence {span.seq} from position {span.start}: it holds {lengths[span.seq]}"
            )
        seen.add(span.seq)


def check_room(wanted: int, free: int, capacity: int) -> None:
    """Refuse, in one line, ``wanted`` new positions where only ``free`` of ``capacity`` cells are."""
    if wanted > free:
        raise BackendError(f"the KV cache is full: {wanted} new positions, {free} of {capacity} cells free")


def check_range(seq: int, start: int, end: int, lengths: Sequence[int]) -> None:
    """Refuse, in one line, positions ``[start, end)`` that ``seq`` does not hold."""
    check_sequence(seq, lengths)
    if not 0 <= start <= end <= lengths[seq]:
        raise BackendError(f"sequence {seq} holds positions 0 to {lengths[seq]}, not {start} to {end}")
