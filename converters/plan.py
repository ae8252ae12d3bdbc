"""Choosing every tensor's type: one type for all matrices, or the mix with the least estimated
error under a size budget.

A matrix's error under a type is measured, not assumed: quantize it (with the importance
matrix), dequantize, and weigh each column's squared error by the mean squared activation
that column multiplies: the expected squared error the type adds to the matrix's output.
``--sensitivity kld`` (the default) scales each matrix's errors by a measured slope: the
model's output KL divergence when that matrix alone is quantized, per unit of that error.

The budget is met by Lagrangian relaxation (each tensor minimises ``error + λ · bytes`` for
the smallest λ that fits), then the bytes left over buy the upgrades with the best error
saved per byte.

Given each type's measured kernel speed (``type_speed``), the mix is also planned without the types
that are slow here for their size, and that mix is written unless quality insists (``budgeted``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter

from edgeinfer.converters.quantize import available, dequantize, quantize, row_type
from edgeinfer.converters.type_speed import TypeSpeed, slow_types
from edgeinfer.converters.writer import tensor_bytes
from edgeinfer.errors import ConversionError

QType = GGMLQuantizationType

UNIFORM_TYPES = {
    t.name.lower(): t
    for t in (QType.F32, QType.F16, QType.BF16, QType.Q8_0, QType.Q4_0, QType.Q4_1, QType.Q5_0)
    + (QType.Q4_K, QType.Q5_K, QType.Q6_K)
}
# What a budgeted mix chooses from, wherever a type's block fits the rows (K-quants and IQ4_XS
# need multiples of 256, the rest of 32). F32 is never worth its bytes over F16.
MIX_TYPES = (
    QType.Q3_K, QType.IQ4_XS, QType.Q4_K, QType.Q5_K, QType.Q6_K,
    QType.Q4_0, QType.IQ4_NL, QType.Q4_1, QType.Q5_0, QType.Q5_1, QType.Q8_0, QType.F16,
)  # fmt: skip
# The values sampled to estimate a large matrix's error: a stable mean, far cheaper than all of
# them. At least MIN_SAMPLE_ROWS rows, so a wide matrix's estimate still spans many rows.
ERROR_SAMPLE_VALUES = 1 << 19
MIN_SAMPLE_ROWS = 256
# A slow type is left out of the mix unless that takes the estimated error past this many times that of the mix
# chosen by error alone: a quarter more error, for a prefill that can be 2.1-2.8 times as fast (docs/BENCHMARKS.md).
QUALITY_INSISTS = 1.25


@dataclass(frozen=True)
class SpeedTrade:
    """What a budgeted mix gave up to avoid the types whose kernels are slow here, and what it won."""

    avoided: dict[QType, QType]  # each slow type left out, and the fastest type no larger that made it slow
    kept: dict[QType, float]  # each slow type quality kept: the error ratio leaving it out too would have given
    error_ratio: float  # the estimated error of the mix written, over that of the mix chosen by error alone
    speedup: float  # the estimated prefill time of the mix chosen by error alone, over that of the mix written


@dataclass(frozen=True)
class Option:
    qtype: QType
    nbytes: int  # padded as stored in the file
    error: float


@dataclass(frozen=True)
class Choice:
    """The type a tensor is written in, what it costs, and its estimated error (None: not measured)."""

    name: str
    shape: tuple[int, ...]
    qtype: QType
    nbytes: int
    error: float | None = None
    requested: QType | None = None  # the type asked for, where the rows forced a fallback


def stored_bytes(shape: tuple[int, ...], qtype: QType) -> int:
    return GGUFWriter.ggml_pad(tensor_bytes(shape, qtype), 32)


def uniform(shapes: Mapping[str, tuple[int, ...]], qtype: QType) -> dict[str, Choice]:
    """Every matrix in ``qtype`` (or the fallback its rows need, recorded), every vector in F32."""
    plan = {}
    for name, shape in shapes.items():
        chosen = row_type(qtype, shape[-1]) if len(shape) > 1 else QType.F32
        fallback = qtype if len(shape) > 1 and chosen != qtype else None
        plan[name] = Choice(name, shape, chosen, stored_bytes(shape, chosen), requested=fallback)
    return plan


def candidate_types(n_cols: int) -> list[QType]:
    """The mix's types whose blocks fit rows of ``n_cols`` and that can be quantized here."""
    return [t for t in MIX_TYPES if row_type(t, n_cols) == t and available(t)]


def error_sample(shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    """The rows (sorted indices) whose errors stand for a matrix of ``shape``'s: all of a small one."""
    n_rows, n_cols = shape
    wanted = max(MIN_SAMPLE_ROWS, ERROR_SAMPLE_VALUES // n_cols)
    if n_rows <= wanted:
        return np.arange(n_rows)
    return np.sort(np.random.default_rng(seed).choice(n_rows, wanted, replace=False))


def estimate_errors(rows: np.ndarray, n_rows: int, importance: np.ndarray, types: list[QType]) -> dict[QType, float]:
    """Each type's expected squared output error on a matrix of ``n_rows`` rows, from a sample of
    them (``rows``, as ``error_sample`` picks): column ``j``'s squared weight error times
    ``importance[j]``, the mean squared input it multiplies, summed, and scaled to all rows."""
    errors = {}
    for qtype in types:
        restored = dequantize(quantize(rows, qtype, importance), qtype).reshape(rows.shape)
        diff = (restored - rows).astype(np.float64)
        errors[qtype] = float(np.einsum("ij,j->", diff * diff, importance)) * n_rows / len(rows)
    return errors


def smallest_bytes(shapes: Mapping[str, tuple[int, ...]]) -> int:
    """The fewest tensor bytes a mix can take: each matrix in its smallest candidate type, vectors in F32."""
    return sum(
        min(stored_bytes(shape, t) for t in candidate_types(shape[-1]))
        if len(shape) > 1
        else stored_bytes(shape, QType.F32)
        for shape in shapes.values()
    )


def check_fits(smallest: int, budget: int) -> None:
    """A one-line error when even the smallest mix (``smallest`` bytes) exceeds ``budget``."""
    if smallest > budget:
        raise ConversionError(
            f"the smallest mix of types needs {smallest / 1e6:.2f} MB of tensors, more than the budget's "
            f"{budget / 1e6:.2f} MB; raise --target-size or --target-bpw"
        )


def allocate(options: Mapping[str, list[Option]], budget: int) -> dict[str, Option]:
    """The option per tensor with the least total error whose bytes sum to at most ``budget``."""
    check_fits(sum(min(o.nbytes for o in opts) for opts in options.values()), budget)

    def pick(lam: float) -> dict[str, Option]:
        return {n: min(opts, key=lambda o: (o.error + lam * o.nbytes, o.nbytes)) for n, opts in options.items()}

    low, high = -60.0, 10.0  # log10 of λ: from "error is all that counts" to "bytes are all that count"
    for _ in range(80):
        mid = (low + high) / 2
        if sum(o.nbytes for o in pick(10**mid).values()) <= budget:
            high = mid
        else:
            low = mid
    chosen = pick(10**high)
    left = budget - sum(o.nbytes for o in chosen.values())
    while True:  # spend what is left on the upgrade that saves the most error per byte
        best: tuple[float, str, Option] | None = None
        for name, current in chosen.items():
            for o in options[name]:
                extra = o.nbytes - current.nbytes
                if 0 < extra <= left and o.error < current.error:
                    gain = (current.error - o.error) / extra
                    if best is None or gain > best[0]:
                        best = (gain, name, o)
        if best is None:
            return chosen
        _, name, upgrade = best
        left -= upgrade.nbytes - chosen[name].nbytes
        chosen[name] = upgrade


def budgeted(
    shapes: Mapping[str, tuple[int, ...]],
    budget: int,
    errors_of: Callable[[str, list[QType]], dict[QType, float]],
    speeds: Mapping[QType, TypeSpeed] | None = None,
    lookups: frozenset[str] = frozenset(),
) -> tuple[dict[str, Choice], SpeedTrade | None]:
    """The least-error mix within ``budget`` tensor bytes; vectors stay F32.

    With ``speeds`` (``type_speed.measure_type_speeds``), each type whose kernels are slow here for its size
    (``slow_types``), the slowest first, is taken out of the choices of every matrix that is multiplied (not the
    ``lookups``, read a row a token) and fits the faster type's rows, where the mix planned without it keeps the
    estimated error within QUALITY_INSISTS times that of the unrestricted mix. The ``SpeedTrade`` says which
    types were avoided, which quality kept, and what that cost and won.
    """
    options: dict[str, list[Option]] = {}
    for name, shape in shapes.items():
        if len(shape) == 1:
            options[name] = [Option(QType.F32, stored_bytes(shape, QType.F32), 0.0)]
            continue
        types = candidate_types(shape[-1])
        errors = errors_of(name, types)
        options[name] = [Option(t, stored_bytes(shape, t), errors[t]) for t in types if math.isfinite(errors[t])]
    full = chosen = allocate(options, budget)
    trade = None
    if speeds is not None:
        multiplied = [n for n, shape in shapes.items() if len(shape) == 2 and n not in lookups]
        offered = {o.qtype for n in multiplied for o in options[n]}
        slow = {t: [u for u in faster if u in offered] for t, faster in slow_types(speeds).items() if t in offered}
        slow = {t: faster for t, faster in slow.items() if faster}
        avoided: dict[QType, QType] = {}
        kept: dict[QType, float] = {}
        for t in sorted(slow, key=lambda t: speeds[t].prefill / speeds[slow[t][0]].prefill):
            trial = {n: _without(opts, t, slow[t]) if n in multiplied else opts for n, opts in options.items()}
            plan = allocate(trial, budget)
            ratio = _error_ratio(plan, full)
            if ratio <= QUALITY_INSISTS:
                options, chosen, avoided[t] = trial, plan, slow[t][0]
            else:
                kept[t] = ratio

        def prefill_seconds(plan: Mapping[str, Option]) -> float:  # per token: the timed types' matrices alone
            timed = [n for n in multiplied if plan[n].qtype in speeds]
            return sum(float(np.prod(shapes[n])) / speeds[plan[n].qtype].prefill_params_per_s for n in timed)

        before, after = prefill_seconds(full), prefill_seconds(chosen)
        trade = SpeedTrade(avoided, kept, _error_ratio(chosen, full), before / after if after > 0 else 1.0)
    return {n: Choice(n, shapes[n], o.qtype, o.nbytes, o.error) for n, o in chosen.items()}, trade


def _without(options: list[Option], slow: QType, faster: list[QType]) -> list[Option]:
    """``options`` less the ``slow`` type, where one of the ``faster`` types is among them."""
    return [o for o in options if o.qtype != slow] if any(o.qtype in faster for o in options) else options


def _error_ratio(plan: Mapping[str, Option], full: Mapping[str, Option]) -> float:
    error, full_error = (sum(o.error for o in p.values()) for p in (plan, full))
    if full_error == 0:  # a mix without error (weights a type holds exactly): any error at all is too much
        return 1.0 if error == 0 else math.inf
    return error / full_error
