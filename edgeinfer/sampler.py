"""The sampler: one per request, shared by every backend; it draws as ``SamplingParams`` say.

Order of operations: repetition penalty, top-k, temperature, softmax, top-p,
min-p, then one draw from a seeded numpy Generator (same seed, same logits,
same token). ``temperature == 0`` is greedy and skips everything after the penalty.

It runs once per generated token, over the whole vocabulary (49,152 logits for SmolLM2), right
after a decode step has swept the CPU's caches: there each numpy call costs 10-15 µs whatever its
size, and each pass over the row more. So min-p's bound finds the tokens that can be drawn in two
passes (the maximum, then the bound), ``_top_k`` finds the k best in a few where min-p cannot
decide, and the filters and the draw run in plain Python on those few tokens.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Sequence

import numpy as np

from edgeinfer.sampling import SamplingParams


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

        best = float(logits.max())
        if not math.isfinite(best):  # NaN wins max(), as it wins greedy's argmax
            raise ValueError(f"the largest logit is {best}: no distribution to draw from")
        if p.min_p > 0.0:
            # Min-p keeps no token whose logit lies below max + T*ln(min_p), so one pass for the
            # maximum and one for that threshold find, on most rows, everything the chain can draw.
            # The margin lets in what rounding the bound and the weights in float64 might otherwise
            # shut out: _draw counts min-p itself, on the weights.
            threshold = best + p.temperature * math.log(p.min_p) - _THRESHOLD_MARGIN * max(1.0, abs(best))
            above = logits >= threshold
            ids, values = _largest(logits, above.nonzero()[0], p.top_k)
            if p.top_k == 0:  # the chain is the whole row: what min-p drops still counts in top-p's total
                rest: float | None = _mass(logits[~above], best, p.temperature)
            else:  # the top k, or all of it that min-p can keep
                rest = 0.0 if len(ids) == p.top_k else None
            token = self._draw(ids, values, rest)
            if token is not None:
                return token
        ids, values = _top_k(logits, p.top_k)
        token = self._draw(ids, values, rest=0.0)
        assert token is not None  # a complete top k always settles the draw
        return token

    def _draw(self, ids: list[int], values: list[float], rest: float | None) -> int | None:
        """One of ``ids``, whose logits ``values`` are largest first.

        ``rest`` is the weight (``exp((logit - best) / T)`` summed) of the tokens in the top k that
        ``ids`` leaves out; None when it is not known. Each of those weighs less than min-p's share,
        so min-p drops them; they count only in top-p's total mass. Unknown, that total is at least
        the listed mass, so top-p keeps at least as many as the listed mass makes it keep: where
        min-p keeps no more than that, the draw is the one the whole top k gives. Otherwise the
        draw depends on what is missing, and the answer is None, before the generator is used.

        The weights come from ``math.exp`` (glibc's, the same on every x86-64 CPU with FMA), which
        can differ from numpy's vectorised exp in the last bit: a token exactly at min-p's or
        top-p's edge may fall on the other side of it than it would under numpy.

        Plain Python on at most k numbers: after a decode step has swept the caches, each numpy call
        costs 10-15 µs whatever its size, more than this whole loop (docs/BENCHMARKS.md).
        """
        p = self.params
        best, temperature, min_p = values[0], p.temperature, p.min_p
        # Unnormalised probabilities, the largest 1: each filter compares shares, which need no sum.
        weights = [math.exp((value - best) / temperature) for value in values]
        mass = list(itertools.accumulate(weights))
        keep = len(weights)
        if p.top_p < 1.0:
            # Keep the smallest prefix whose mass reaches top_p (the token that crosses it included).
            keep = min(keep, bisect.bisect_left(mass, p.top_p * (mass[-1] + (rest or 0.0))) + 1)
        kept_by_min_p = len([weight for weight in weights if weight >= min_p]) if min_p > 0.0 else keep
        if rest is None and kept_by_min_p > keep:
            return None
        keep = min(keep, kept_by_min_p)  # at least 1: the largest weighs 1
        draw = self._rng.random() * mass[keep - 1]
        return ids[min(bisect.bisect_right(mass, draw, 0, keep), keep - 1)]


def _penalize(logits: np.ndarray, recent: Sequence[int], penalty: float) -> np.ndarray:
    # CTRL-style penalty as llama.cpp applies it: shrink positive logits, grow negative ones.
    # A repeated id reads and writes the same value, so the ids need no deduplication.
    ids = np.asarray(recent, dtype=np.intp)
    out = logits.copy()
    values = out[ids]
    out[ids] = np.where(values > 0, values / penalty, values * penalty)
    return out


# Relative to the largest logit (at least 1): far above float64's rounding of the bound. It lets in
# tokens a little below min-p's share (by exp(-margin / T)), which only costs the time to weigh them.
_THRESHOLD_MARGIN = 1e-3

# Enough groups that the top k of a row rarely share one, and few enough that partitioning
# their maxima stays cheap (see _top_k).
_MIN_GROUPS = 1024
_GROUPS_PER_K = 16


def _top_k(logits: np.ndarray, k: int) -> tuple[list[int], list[float]]:
    """The indices of the k largest logits (all when k is 0), largest first, equal logits by index;
    and those logits."""
    n = logits.shape[0]
    groups = max(_MIN_GROUPS, _GROUPS_PER_K * k)
    if k == 0 or 2 * groups > n:
        return _largest(logits, np.arange(n), k)
    # The maxima of disjoint groups are distinct entries of the row, so the k-th largest maximum
    # is at most the row's k-th largest logit: the top k all lie at or above it, with a few others
    # at most. Strided groups make the maxima one vectorised pass, where np.argpartition over the
    # whole row costs several times more.
    rows = n // groups
    maxima = logits[: rows * groups].reshape(rows, groups).max(axis=0)
    maxima.partition(-k)  # in place, on an array of our own
    return _largest(logits, (logits >= maxima[-k]).nonzero()[0], k)


def _mass(logits: np.ndarray, best: float, temperature: float) -> float:
    """The summed weights ``exp((logit - best) / temperature)`` of ``logits``, in float64."""
    weights = np.subtract(logits, best, dtype=np.float64)
    weights /= temperature
    return float(np.exp(weights, out=weights).sum())


def _largest(logits: np.ndarray, candidates: np.ndarray, k: int) -> tuple[list[int], list[float]]:
    """The k of ``candidates`` with the largest logits (all when k is 0), in _top_k's order."""
    values = logits[candidates]
    order = (-values).argsort(kind="stable")
    if k:
        order = order[:k]
    return candidates[order].tolist(), values[order].tolist()
