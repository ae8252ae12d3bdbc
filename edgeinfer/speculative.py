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

import abc
import contextlib
import enum
import json
import statistics
from collections import deque
from collections.abc import Sequence

from edgeinfer.errors import InvalidOptionError
from edgeinfer.files import write_atomic
from edgeinfer.system import cache_dir

MAX_DRAFT = 8  # most drafted tokens verified in one step
# What one drafted token adds to a step's cost, as a share of a one-token step, until DraftCost has measured it
# for the model on this machine. Through llama.cpp on SmolLM2 with 2 threads (docs/BENCHMARKS.md, "Speculative
# decoding"): 0.62-0.86 for Q4_1 and Q4_0 on a 2-core AMD EPYC, 0.35-0.41 for Q4_1 on a 2-core Xeon with
# AVX-512, 0.2-0.28 for F16 on the EPYC. The dearest of the common ones, so a first run never drafts at a loss.
DRAFT_TOKEN_COST = 0.7
# The acceptance a draft model's tokens are assumed to have before the answer has shown any, and drift back to
# while it drafts nothing: high enough that a first draft is tried.
PRIOR_ACCEPTANCE = 0.8
ACCEPTANCE_WEIGHT = 0.25  # how much one verified position moves an estimate
# Tokens over which an estimate drifts back to its prior where a drafted token costs a whole step (where it
# costs less, it drifts slower; with several kinds of draft, each that many times slower): rejected probes then
# cost under 3% of decode whatever a drafted token costs (tests/test_speculative.py).
RECOVERY_TOKENS = 64

# Prompt lookup matches the text's last two tokens against their RECENT_MATCHES latest earlier occurrences and
# drafts what followed the one whose match reaches furthest back (up to MAX_MATCH tokens): the longer the match,
# the likelier the answer is copying that very passage. Each answer keeps one acceptance estimate per class of
# match length: 2 tokens, 3-4, 5-8, 9 and more. The priors follow what SmolLM2's greedy answers to the 60
# input-grounded and 20 chat prompts of scripts/data/speculative_prompts.jsonl showed: each class's mean run of
# kept tokens (1.8, 2.8, 3.1-4.5 and 5.9-6.5 of 8) read as a geometric chance (0.65, 0.76, 0.79-0.87, 0.93-0.95),
# the last taken down to 0.9 to be safe, so a long match is drafted further from the first step. Against the latest
# trigram's or bigram's continuation with one estimate, this drafted 1.07x, 1.05x and 1.01x as fast on
# extraction, rewriting and summarising, replayed at a drafted token's cost of 0.4, and 1.04x, 1.06x and 1.01x
# measured at 0.36 (docs/BENCHMARKS.md, "Matches by length").
NGRAM = 2
RECENT_MATCHES = 4
MAX_MATCH = 16
MATCH_CLASSES = (2, 4, 8)  # the longest match of each class but the last
MATCH_PRIORS = (0.65, 0.75, 0.8, 0.9)


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


class Drafter(abc.ABC):
    """Drafts one answer's next tokens and learns from their verification: ``PromptLookup`` from the text so far,
    ``edgeinfer.draft_model.ModelDrafts`` by a smaller model. ``control`` says how many of them pay."""

    def __init__(self, tokens: Sequence[int], priors: Sequence[float] = (PRIOR_ACCEPTANCE,)) -> None:
        self._tokens: list[int] = list(tokens)
        self.control = DraftControl(priors)
        self._kind = 0  # the acceptance class of the last draft

    def extend(self, tokens: Sequence[int]) -> None:
        """Append ``tokens`` to the text."""
        self._tokens.extend(tokens)

    def draft(self, available: int, token_cost: float) -> list[int]:
        """Up to ``available`` tokens to verify after the drawn one, as many as pay where each costs ``token_cost``
        of a one-token step; none (and the estimates drift back towards their priors) where none pays."""
        draft = self._propose(available, token_cost) if available and self.control.may_pay(token_cost) else []
        if not draft:
            self.control.skipped(token_cost)
        return draft

    def verified(self, drafted: int, accepted: int) -> None:
        """The last draft's ``drafted`` tokens were verified, and the first ``accepted`` kept."""
        self.control.verified(drafted, accepted, self._kind)

    @abc.abstractmethod
    def _propose(self, available: int, token_cost: float) -> list[int]:
        """Up to ``available`` tokens, as many as ``control`` says pay at ``token_cost``; sets ``_kind``, the
        acceptance class the draft is judged in, where the drafter has several."""


class PromptLookup(Drafter):
    """Drafts what followed an earlier occurrence of the text's last tokens, chosen by how far back it matches.

    An index maps every bigram of the text but the one it ends with to where its RECENT_MATCHES latest
    occurrences ended, so a lookup reads a few positions. It is brought up to date when a draft is asked for, so
    tokens decoded while drafting is off cost an append each.
    """

    def __init__(self, tokens: Sequence[int]) -> None:
        super().__init__(tokens, MATCH_PRIORS)
        self._ends: dict[tuple[int, ...], deque[int]] = {}  # each bigram's latest ends, all a lookup reads
        self._indexed = 0  # the bigrams ending before this position are in the index

    def match(self, limit: int) -> tuple[list[int], int]:
        """Up to ``limit`` tokens that followed the best earlier match of the text's end, and how many tokens that
        match reaches back (0: none)."""
        text, ends = self._tokens, self._ends
        for end in range(max(self._indexed, NGRAM), len(text)):  # every bigram but the one the text ends with
            ends.setdefault(tuple(text[end - NGRAM : end]), deque(maxlen=RECENT_MATCHES)).append(end)
        self._indexed = len(text)
        best, best_length = 0, 0
        for end in reversed(ends.get(tuple(text[-NGRAM:]), ())):  # the latest first: it wins a tie
            length = NGRAM
            while length < MAX_MATCH and end > length and text[end - length - 1] == text[-length - 1]:
                length += 1
            if length > best_length:
                best, best_length = end, length
        return (text[best : best + limit], best_length) if best_length else ([], 0)

    def _propose(self, available: int, token_cost: float) -> list[int]:
        tokens, length = self.match(available)
        self._kind = sum(length > bound for bound in MATCH_CLASSES)
        return tokens[: self.control.length(len(tokens), token_cost, self._kind)]


class DraftControl:
    """How many drafted tokens one answer verifies next: as many as pay for themselves at its acceptance so far.

    ``acceptance[kind]`` estimates the chance that a drafted token of that kind is kept, given the one before it
    was (``PromptLookup`` tells its drafts apart by how long a match they follow). A draft of ``k`` keeps
    ``1 + p + ... + p**k`` tokens in expectation for a step that costs ``1 + k * token_cost``; the length with the
    best ratio above 1 wins, and none while no length beats a plain step (drafting is off then, until the
    estimate drifts back).
    """

    def __init__(self, priors: Sequence[float] = (PRIOR_ACCEPTANCE,)) -> None:
        self._priors = tuple(priors)
        self.acceptance = list(priors)

    def may_pay(self, token_cost: float = DRAFT_TOKEN_COST) -> bool:
        """Whether a draft of some kind would pay, before looking for one."""
        return max(self.acceptance) > token_cost

    def length(self, available: int, token_cost: float = DRAFT_TOKEN_COST, kind: int = 0) -> int:
        """Drafted tokens of ``kind`` worth verifying when ``available`` are on offer and each costs ``token_cost``
        of a one-token step (0: decode one token)."""
        p = self.acceptance[kind]
        if p <= token_cost:  # each drafted token keeps at most what it costs: no length pays
            return 0
        best, best_gain = 0, 1.0
        kept = term = 1.0
        for k in range(1, min(available, MAX_DRAFT) + 1):
            term *= p
            kept += term
            gain = kept / (1.0 + k * token_cost)
            if gain > best_gain:
                best, best_gain = k, gain
        return best

    def verified(self, drafted: int, accepted: int, kind: int = 0) -> None:
        """Learn from a step that drafted ``drafted`` tokens of ``kind`` and kept the first ``accepted``."""
        outcomes = [1.0] * accepted + ([0.0] if accepted < drafted else [])
        for kept in outcomes:
            self.acceptance[kind] += (kept - self.acceptance[kind]) * ACCEPTANCE_WEIGHT

    def skipped(self, token_cost: float = DRAFT_TOKEN_COST) -> None:
        """A token decoded without a draft verified: drift back towards the priors, to try again later; the
        cheaper a drafted token, the sooner a draft pays again, so the slower the drift. Each of ``n`` kinds
        drifts ``n`` times slower, so that their probes together cost what one kind's would."""
        rate = min(1.0, token_cost) / (RECOVERY_TOKENS * len(self._priors))
        for kind, prior in enumerate(self._priors):
            self.acceptance[kind] += (prior - self.acceptance[kind]) * rate


class DraftCost:
    """What a drafted token costs on this machine for one model, backend, thread count and KV type: measured from the
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
