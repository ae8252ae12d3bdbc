"""The sampler: one per request, shared by every backend.

Order of operations: repetition penalty, top-k, temperature, softmax, top-p,
min-p, then one draw from a seeded numpy Generator (same seed, same logits,
same token). ``temperature == 0`` is greedy and skips everything after the penalty.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

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
            return int(np.argmax(logits))

        candidates = _top_k(logits, p.top_k)
        scaled = logits[candidates].astype(np.float64) / p.temperature
        probs = np.exp(scaled - scaled[0])
        probs /= probs.sum()
        keep = len(probs)
        if p.top_p < 1.0:
            # Keep the smallest prefix whose mass reaches top_p (the token that crosses it included).
            keep = min(keep, int(np.searchsorted(np.cumsum(probs), p.top_p)) + 1)
        if p.min_p > 0.0:
            keep = min(keep, int(np.count_nonzero(probs >= p.min_p * probs[0])))
        probs = probs[: max(keep, 1)]
        draw = self._rng.random() * probs.sum()
        index = min(int(np.searchsorted(np.cumsum(probs), draw, side="right")), len(probs) - 1)
        return int(candidates[index])


def _penalize(logits: np.ndarray, recent: Sequence[int], penalty: float) -> np.ndarray:
    # CTRL-style penalty as llama.cpp applies it: shrink positive logits, grow negative ones.
    ids = np.unique(np.asarray(recent, dtype=np.int64))
    out = logits.copy()
    values = out[ids]
    out[ids] = np.where(values > 0, values / penalty, values * penalty)
    return out


def _top_k(logits: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest logits (all when k is 0), largest first."""
    if 0 < k < logits.shape[0]:
        idx = np.argpartition(logits, -k)[-k:]
        return idx[np.argsort(logits[idx], kind="stable")[::-1]]
    return np.argsort(logits, kind="stable")[::-1]
