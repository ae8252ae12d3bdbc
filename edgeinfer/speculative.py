"""Speculative decoding by prompt lookup: tokens guessed from the text so far, checked by the model in one pass.

An answer that quotes its input (fields pulled out of a text, a function rewritten with one change,
a summary in the paragraph's own words) repeats runs of tokens the prompt already holds. Where the
last few tokens occurred before, the tokens that followed them then are a draft: the engine
evaluates the drawn token and the draft in one backend call, keeps each drafted token only where the
token drawn from the row before it is that token, and truncates the rest. So the output is the one
decoding without drafts draws: with sampling, from the same distribution, one draw per token as
before; greedy, the same tokens, except that llama.cpp rounds a position's logits by how many
tokens one evaluation carries, so a near tie between the two best may go the other way. A step
that keeps ``a`` drafted tokens yields ``a + 1`` tokens for one evaluation.

A drafted token is not free: evaluating ``1 + k`` tokens costs more than one, by how much depends on
the backend and the hardware (``DraftCost`` measures it). ``DraftControl`` drafts only as many as pay
for themselves at the acceptance the answer has shown, and stops drafting where they do not.
"""

from __future__ import annotations

import contextlib
import enum
import json
import statistics
from collections import deque
from collections.abc import Sequence

from edgeinfer.errors import InvalidOptionError
from edgeinfer.files import write_atomic
from edgeinfer.system import cache_dir

# n-gram lengths matched against earlier text, longest first: a longer match predicts more surely, and
# a single token matches everywhere in chat and predicts little.
NGRAM_SIZES = (3, 2)
MAX_DRAFT = 8  # most drafted tokens verified in one step
# What one drafted token adds to a step's cost, as a share of a one-token step, until DraftCost has measured it
# for the model on this machine. Through llama.cpp on SmolLM2 with 2 threads (docs/BENCHMARKS.md, "Speculative
# decoding"): 0.62-0.86 for Q4_1 and Q4_0 on a 2-core AMD EPYC, 0.35-0.41 for Q4_1 on a 2-core Xeon with
# AVX-512, 0.2-0.28 for F16 on the EPYC. The dearest of the common ones, so a first run never drafts at a loss.
DRAFT_TOKEN_COST = 0.7
# The acceptance an answer is assumed to have before it has shown any, and drifts back to while it drafts
# nothing: high enough that a first draft is tried.
PRIOR_ACCEPTANCE = 0.8
ACCEPTANCE_WEIGHT = 0.25  # how much one verified position moves the estimate
# Tokens over which the estimate drifts back to the prior where a drafted token costs a whole step (where it
# costs less, it drifts slower): rejected probes then cost under 3% of decode whatever a drafted token costs.
RECOVERY_TOKENS = 64


class Speculation(enum.Enum):
    """Whether answers are drafted ahead: ``lookup`` (from the prompt and the answer so far), ``draft`` (by a
    smaller model with the same vocabulary, ``Engine(draft=...)``) or ``off``."""

    LOOKUP = "lookup"
    DRAFT = "draft"
    OFF = "off"

    @classmethod
    def parse(cls, value: str | Speculation) -> Speculation:
        if isinstance(value, Speculation):
            return value
        try:
            return cls(value)
        except ValueError:
            choices = ", ".join(s.value for s in cls)
            raise InvalidOptionError(f"unknown speculative mode {value!r}; choose one of {choices}") from None


class PromptLookup:
    """Drafts what followed the latest earlier occurrence of the text's last n tokens.

    An index maps every n-gram of the text but the one it ends with to where its latest occurrence
    ended, so a lookup is one dictionary probe per n-gram length. It is brought up to date when a draft is
    asked for, so tokens decoded while drafting is off cost an append each.
    """

    def __init__(self, tokens: Sequence[int]) -> None:
        self._tokens: list[int] = list(tokens)
        self._ends: dict[tuple[int, ...], int] = {}
        self._indexed = 0  # the n-grams ending before this position are in the index

    def extend(self, tokens: Sequence[int]) -> None:
        """Append ``tokens`` to the text."""
        self._tokens.extend(tokens)

    def draft(self, limit: int) -> list[int]:
        """Up to ``limit`` tokens that followed the longest n-gram the text ends with, where it occurred last."""
        text, ends = self._tokens, self._ends
        for end in range(self._indexed, len(text)):  # every n-gram but the ones the text ends with
            for n in NGRAM_SIZES:
                if end >= n:
                    ends[tuple(text[end - n : end])] = end
        self._indexed = len(text)
        for n in NGRAM_SIZES:
            if len(text) > n:
                end = ends.get(tuple(text[-n:]))
                if end is not None:
                    return text[end : end + limit]
        return []


class DraftControl:
    """How many drafted tokens one answer verifies next: as many as pay for themselves at its acceptance so far.

    ``acceptance`` estimates the chance that a drafted token is kept, given the one before it was. A
    draft of ``k`` keeps ``1 + p + ... + p**k`` tokens in expectation for a step that costs
    ``1 + k * token_cost``; the length with the best ratio above 1 wins, and none while no
    length beats a plain step (drafting is off then, until the estimate drifts back).
    """

    def __init__(self) -> None:
        self.acceptance = PRIOR_ACCEPTANCE

    def length(self, available: int, token_cost: float = DRAFT_TOKEN_COST) -> int:
        """Drafted tokens worth verifying when ``available`` are on offer and each costs ``token_cost`` of a
        one-token step (0: decode one token)."""
        if self.acceptance <= token_cost:  # each drafted token keeps at most what it costs: no length pays
            return 0
        best, best_gain = 0, 1.0
        kept = term = 1.0
        for k in range(1, min(available, MAX_DRAFT) + 1):
            term *= self.acceptance
            kept += term
            gain = kept / (1.0 + k * token_cost)
            if gain > best_gain:
                best, best_gain = k, gain
        return best

    def verified(self, drafted: int, accepted: int) -> None:
        """Learn from a step that drafted ``drafted`` tokens and kept the first ``accepted``."""
        outcomes = [1.0] * accepted + ([0.0] if accepted < drafted else [])
        for kept in outcomes:
            self.acceptance += (kept - self.acceptance) * ACCEPTANCE_WEIGHT

    def skipped(self, token_cost: float = DRAFT_TOKEN_COST) -> None:
        """A token decoded without a draft verified: drift back towards the prior, to try again later; the
        cheaper a drafted token, the sooner a draft pays again, so the slower the drift."""
        self.acceptance += (PRIOR_ACCEPTANCE - self.acceptance) * min(1.0, token_cost) / RECOVERY_TOKENS


class DraftCost:
    """What a drafted token costs on this machine for one model, backend and thread count: measured from the
    engine's own decode steps, kept across runs in the cache folder (``draft-costs.json``).

    ``value`` is fixed for the life of an engine (the one kept, else DRAFT_TOKEN_COST), so its drafts, and with
    them llama.cpp's batch-dependent rounding, are the same from call to call. What the steps measure is kept for
    the next engine where it moves the figure by more than MIN_CHANGE: runs after the first draft alike too.
    """

    SAMPLES = 64  # recent steps of each kind the estimate reads
    MIN_STEPS = 16  # of each kind, before an estimate is kept
    MIN_CHANGE = 0.1  # a smaller move keeps the figure kept: timings jitter, and drafts should not
    FILE = "draft-costs.json"

    def __init__(self, key: str) -> None:
        self.key = key
        self.kept = _kept_costs().get(key)
        self.value = DRAFT_TOKEN_COST if self.kept is None else self.kept
        self._plain: deque[float] = deque(maxlen=self.SAMPLES)  # seconds of one-token steps
        self._drafted: deque[tuple[int, float]] = deque(maxlen=self.SAMPLES)  # (drafted tokens, seconds)

    def observe(self, tokens: int, seconds: float) -> None:
        """A decode step of one answer evaluated ``tokens`` tokens (the drawn one and its draft) in ``seconds``."""
        if tokens == 1:
            self._plain.append(seconds)
        else:
            self._drafted.append((tokens - 1, seconds))

    def measured(self) -> float | None:
        """The cost the steps observed show, or None before there are enough of them."""
        if len(self._plain) < self.MIN_STEPS or len(self._drafted) < self.MIN_STEPS:
            return None
        step = statistics.median(self._plain)
        return min(1.5, max(0.05, statistics.median((t / step - 1) / k for k, t in self._drafted)))

    def save(self) -> None:
        """Keep the measured cost for the next engine, where it differs enough from the one kept."""
        measured = self.measured()
        if measured is None or (self.kept is not None and abs(measured - self.kept) < self.MIN_CHANGE):
            return
        costs = _kept_costs()
        costs[self.key] = round(measured, 3)
        with contextlib.suppress(OSError):  # a read-only cache folder: the next engine measures again
            write_atomic(cache_dir() / self.FILE, json.dumps(costs, indent=1, sort_keys=True))


def _kept_costs() -> dict[str, float]:
    try:
        costs = json.loads((cache_dir() / DraftCost.FILE).read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(costs, dict):
        return {}
    return {k: float(v) for k, v in costs.items() if isinstance(v, (int, float)) and 0 < v <= 1.5}
