"""Per-call timings and counters: one path, filled by the engine for every backend."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import ClassVar

import numpy as np


@dataclass
class Metrics:
    """Where the time of one call went, and how full the KV cache is.

    Stage times are wall-clock seconds spent in that stage alone: ``prefill_s`` and
    ``decode_s`` are the backend's evaluations, ``sample_s`` the sampler and
    ``detokenize_s`` the incremental detokenizer. ``ttft_s`` runs from the start
    of the call (the first ``next()`` of a stream), any wait for the engine included,
    to the first sampled token; ``tpot_s`` is the mean gap between later tokens, and
    ``tpot_percentile`` reads the spread of those gaps from ``token_times_s``. Tokens one step made together (a
    kept draft, or a greedy answer's tokens its backend went on to draw) arrive together, microseconds apart.
    """

    prompt_tokens: int = 0  # as evaluated, after any cut
    prompt_cut: int = 0  # tokens the KV policy cut from the middle of a prompt too long for the budget
    cached_tokens: int = 0  # prompt tokens reused from the previous call's KV cache
    output_tokens: int = 0
    tokenize_s: float = 0.0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    sample_s: float = 0.0
    detokenize_s: float = 0.0
    ttft_s: float = 0.0
    total_s: float = 0.0
    kv_used: int = 0
    kv_capacity: int = 0
    kv_evicted: int = 0  # tokens dropped by the KV policy during this call
    # The prompt cache on disk (edgeinfer.prompt_cache): "off", "hit" (its prefix read from disk), "saved" (evaluated
    # and written for the next start), "in memory" (the prefix was cached already), "nothing to keep" (no system
    # prompt a whole chunk long).
    prompt_cache: str = "off"
    disk_cached_tokens: int = 0  # prompt tokens read from the prompt cache on disk (counted in cached_tokens too)
    drafted_tokens: int = 0  # tokens drafted ahead and verified (edgeinfer.speculative)
    accepted_tokens: int = 0  # of those, the ones kept: each saved a decode step
    # When each output token was sampled, in seconds from the start of the call.
    token_times_s: list[float] = field(default_factory=list, repr=False)
    # Rows of ``format`` that say nothing for this kind of call (a cloud answer ran nothing locally).
    rows_left_out: ClassVar[tuple[str, ...]] = ()

    @property
    def tpot_s(self) -> float:
        """Time per output token after the first, from when the first and the last were made.

        Not from ``total_s - ttft_s``: a router shows a held-back probe at once, and the
        caller's clock would count those tokens as taking no time.
        """
        times = self.token_times_s
        if len(times) > 1:
            return (times[-1] - times[0]) / (len(times) - 1)
        return (self.total_s - self.ttft_s) / (self.output_tokens - 1) if self.output_tokens > 1 else 0.0

    @property
    def token_gaps_s(self) -> list[float]:
        """The time between each output token and the one before it."""
        times = self.token_times_s
        return [b - a for a, b in zip(times, times[1:], strict=False)]

    def tpot_percentile(self, q: float) -> float:
        """The ``q``-th percentile (0-100) of the time per output token after the first."""
        return percentile(self.token_gaps_s, q)

    @property
    def tokens_per_s(self) -> float:
        """Decode throughput as the caller sees it (1 / tpot)."""
        return 1.0 / self.tpot_s if self.tpot_s > 0 else 0.0

    @property
    def acceptance_rate(self) -> float:
        """The share of drafted tokens kept (0.0 where none was drafted)."""
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def prefill_tokens_per_s(self) -> float:
        evaluated = self.prompt_tokens - self.cached_tokens
        return evaluated / self.prefill_s if self.prefill_s > 0 else 0.0

    def to_dict(self) -> dict[str, float | int]:
        """Every figure, with the per-token times summed up as percentiles rather than listed."""
        out: dict[str, float | int] = asdict(self)
        del out["token_times_s"]
        out.update(
            tpot_s=self.tpot_s,
            tpot_p50_s=self.tpot_percentile(50),
            tpot_p95_s=self.tpot_percentile(95),
            tpot_p99_s=self.tpot_percentile(99),
            tokens_per_s=self.tokens_per_s,
            prefill_tokens_per_s=self.prefill_tokens_per_s,
            acceptance_rate=self.acceptance_rate,
        )
        return out

    def format(self) -> str:
        """A short human-readable block, as ``edgeinfer run --stats`` prints it."""
        ms = 1000.0
        rows = [
            (
                "tokens",
                f"{self.prompt_tokens} prompt ({self.cached_tokens} cached"
                f"{f', {self.prompt_cut} more cut to fit the KV budget' if self.prompt_cut else ''}), "
                f"{self.output_tokens} generated",
            ),
            ("TTFT", f"{self.ttft_s * ms:.1f} ms"),
            (
                "decode",
                f"{self.tokens_per_s:.1f} tok/s ({self.tpot_s * ms:.2f} ms/token; P50 "
                f"{self.tpot_percentile(50) * ms:.2f}, P95 {self.tpot_percentile(95) * ms:.2f}, "
                f"P99 {self.tpot_percentile(99) * ms:.2f} ms)",
            ),
            (
                "prefill",
                f"{self.prefill_tokens_per_s:.1f} tok/s"
                if self.prompt_tokens > self.cached_tokens
                else "nothing evaluated (the whole prompt was cached)",
            ),
            (
                "stages",
                f"tokenize {self.tokenize_s * ms:.1f} ms, prefill {self.prefill_s * ms:.1f} ms, "
                f"decode {self.decode_s * ms:.1f} ms, sample {self.sample_s * ms:.1f} ms, "
                f"detokenize {self.detokenize_s * ms:.1f} ms",
            ),
            (
                "prompt cache",
                f"hit: {self.disk_cached_tokens} prompt tokens read from disk"
                if self.prompt_cache == "hit"
                else self.prompt_cache,
            ),
            (
                "drafts",
                f"{self.accepted_tokens} of {self.drafted_tokens} drafted tokens kept ({self.acceptance_rate:.0%})"
                if self.drafted_tokens
                else "none verified",
            ),
            ("KV cache", f"{self.kv_used}/{self.kv_capacity} tokens, {self.kv_evicted} evicted"),
            ("total", f"{self.total_s * ms:.1f} ms"),
        ]
        return "\n".join(f"{name:>12}: {value}" for name, value in rows if name not in self.rows_left_out)


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) of ``values``, interpolating between ranks; 0.0 for none."""
    return float(np.percentile(values, q)) if len(values) else 0.0
