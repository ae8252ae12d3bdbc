"""The sampler: one per request, shared by every backend.

Order of operations: repetition penalty, top-k, temperature, softmax, top-p,
min-p, then one draw from a seeded numpy Generator (same seed, same logits,
same token). ``temperature == 0`` is greedy and skips everything after the penalty.

It runs once per generated token, over the whole vocabulary (49,152 logits for SmolLM2), where
each pass costs microseconds that count against a decode step of well under a millisecond on a
small model: top-k finds its survivors in a few passes over the row (``_top_k``), and everything
after it works on those k alone.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from edgeinfer.errors import InvalidOptionError


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop.

    The defaults are llama.cpp's: on SmolLM2-135M nothing else measured answers everyday
    questions clearly better (docs/BENCHMARKS.md, "The default experience"). ``top_k=0``,
    ``top_p=1`` and ``min_p=0`` each switch their filter off; ``repetition_penalty=1``
    switches the penalty off.
    """

    max_tokens: int = 256
    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repetition_penalty: float = 1.0
    repeat_last_n: int = 64
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    logprobs: bool = False  # report each token's log-probability and the entropy it was drawn from (Result)

    def __post_init__(self) -> None:
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, (tuple, list)) or not all(isinstance(s, str) for s in stop):
            raise InvalidOptionError(f"stop must be a string or a list of strings, got {self.stop!r}")
        object.__setattr__(self, "stop", tuple(s for s in stop if s))
        for name in ("max_tokens", "top_k", "repeat_last_n"):
            if not _is_int(getattr(self, name)):
                raise InvalidOptionError(f"{name} must be an integer, got {getattr(self, name)!r}")
        for name in ("temperature", "top_p", "min_p", "repetition_penalty"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
                raise InvalidOptionError(f"{name} must be a finite number, got {value!r}")
        if self.seed is not None and not (_is_int(self.seed) and 0 <= self.seed < 2**64):
            raise InvalidOptionError(
                f"seed must be a non-negative integer (leave it out for a random one), got {self.seed!r}"
            )
        checks = (
            (self.max_tokens >= 1, f"max_tokens must be at least 1, got {self.max_tokens}"),
            (self.temperature >= 0, f"temperature must be >= 0 (0 is greedy), got {self.temperature}"),
            (self.top_k >= 0, f"top_k must be >= 0 (0 switches it off), got {self.top_k}"),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            (0 <= self.min_p < 1, f"min_p must be in [0, 1), got {self.min_p}"),
            (self.repetition_penalty > 0, f"repetition_penalty must be > 0 (1 is off), got {self.repetition_penalty}"),
            (self.repeat_last_n >= 0, f"repeat_last_n must be >= 0, got {self.repeat_last_n}"),
        )
        for ok, message in checks:
            if not ok:
                raise InvalidOptionError(message)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def sampling_params(params: SamplingParams | None, options: Mapping[str, Any]) -> SamplingParams:
    """``params`` with keyword ``options`` applied, as ``Engine.stream`` takes them."""
    if params is not None and not isinstance(params, SamplingParams):
        raise InvalidOptionError(f"params must be a SamplingParams, got {type(params).__name__}")
    params = params or SamplingParams()
    unknown = set(options) - {f.name for f in dataclasses.fields(SamplingParams)}
    if unknown:
        raise InvalidOptionError(
            f"unknown sampling option {', '.join(sorted(unknown))}; see SamplingParams for the options"
        )
    return dataclasses.replace(params, **options) if options else params


class Sampler:
    """Picks the next token from a row of logits. Never writes into ``logits``."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self._rng = np.random.default_rng(params.seed)

    def __call__(self, logits: np.ndarray, recent: Sequence[int] = ()) -> int:
        p = self.params
        if p.repetition_penalty != 1.0 and p.repeat_last_n and len(recent):
            logits = _penalize(logits, recent[-p.repeat_last_n :], p.repetition_penalty)
        if p.temperature == 0:
            return int(logits.argmax())

        candidates, top = _top_k(logits, p.top_k)
        # Unnormalised probabilities, the largest 1 (each filter below compares shares, which need
        # no sum), in float64 and in place: on k entries numpy's per-call cost is what counts.
        weights = np.subtract(top, top[0], dtype=np.float64)
        weights /= p.temperature
        np.exp(weights, out=weights)
        mass = weights.cumsum()
        keep = len(weights)
        if p.top_p < 1.0:
            # Keep the smallest prefix whose mass reaches top_p (the token that crosses it included).
            keep = min(keep, int(mass.searchsorted(p.top_p * mass[-1])) + 1)
        if p.min_p > 0.0:
            keep = min(keep, int(np.count_nonzero(weights >= p.min_p)))
        draw = self._rng.random() * mass[keep - 1]
        return int(candidates[min(int(mass[:keep].searchsorted(draw, side="right")), keep - 1)])


def _penalize(logits: np.ndarray, recent: Sequence[int], penalty: float) -> np.ndarray:
    # CTRL-style penalty as llama.cpp applies it: shrink positive logits, grow negative ones.
    # A repeated id reads and writes the same value, so the ids need no deduplication.
    ids = np.asarray(recent, dtype=np.intp)
    out = logits.copy()
    values = out[ids]
    out[ids] = np.where(values > 0, values / penalty, values * penalty)
    return out


# Enough groups that the top k of a row rarely share one, and few enough that partitioning
# their maxima stays cheap (see _top_k).
_MIN_GROUPS = 1024
_GROUPS_PER_K = 16


def _top_k(logits: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The indices of the k largest logits (all when k is 0), largest first, equal logits by index;
    and those logits."""
    n = logits.shape[0]
    groups = max(_MIN_GROUPS, _GROUPS_PER_K * k)
    if k > 0 and 2 * groups <= n:
        # The maxima of disjoint groups are distinct entries of the row, so the k-th largest
        # maximum is at most the row's k-th largest logit: the top k all lie at or above it,
        # with a few others at most. Strided groups make the maxima one vectorised pass, where
        # np.argpartition over the whole row costs several times more.
        rows = n // groups
        maxima = logits[: rows * groups].reshape(rows, groups).max(axis=0)
        maxima.partition(-k)  # in place, on an array of our own
        candidates = (logits >= maxima[-k]).nonzero()[0]
    else:
        candidates = np.arange(n)
    values = logits[candidates]
    order = (-values).argsort(kind="stable")
    if k:
        order = order[:k]
    return candidates[order], values[order]
