"""``GET /metrics``: the server's counters in Prometheus' text format, through ``prometheus_client``.

Every figure comes from what the engine already measures for each call (``Metrics``), so the server's
TTFT is the engine's; queue depth and KV use are read when scraped.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from edgeinfer.streams import Result

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# Seconds: a small model's first token takes tens of milliseconds on a CPU, a queued one seconds.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0)


class ServerMetrics:
    """The counters of one server; ``queue_depth``, ``running``, ``kv_used``, ``kv_capacity`` and ``steps`` are
    read when scraped."""

    def __init__(
        self,
        *,
        queue_depth: Callable[[], int],
        running: Callable[[], int],
        kv_used: Callable[[], int],
        kv_capacity: Callable[[], int],
        steps: Callable[[], tuple[int, int]],
    ) -> None:
        self.registry = registry = CollectorRegistry()
        self.requests = Counter(
            "edgeinfer_requests", "HTTP requests answered, by endpoint and status.", ["endpoint", "status"],
            registry=registry,
        )  # fmt: skip
        self.answers = Counter(
            "edgeinfer_answers", "Answers given, by the side that gave them and whether a failure changed it.",
            ["route", "degraded"], registry=registry,
        )  # fmt: skip
        self.tokens = Counter(
            "edgeinfer_tokens", "Tokens: prompt, cached (prompt tokens whose KV was reused), completion.", ["kind"],
            registry=registry,
        )  # fmt: skip
        self.ttft = Histogram(
            "edgeinfer_ttft_seconds", "Time to the first token, the wait for a slot included.", buckets=TTFT_BUCKETS,
            registry=registry,
        )  # fmt: skip
        self.tpot = Histogram(
            "edgeinfer_tpot_seconds", "Mean time per output token after the first, per answer.", buckets=TPOT_BUCKETS,
            registry=registry,
        )  # fmt: skip
        gauges = (
            ("edgeinfer_queue_depth", "Requests waiting for a slot.", queue_depth),
            ("edgeinfer_requests_running", "Requests holding a slot.", running),
            ("edgeinfer_kv_cells_used", "KV cells in use across all sequences (a shared prefix counts once).", kv_used),
            ("edgeinfer_kv_cells_capacity", "KV cells in the budget.", kv_capacity),
            ("edgeinfer_decode_steps", "Decode steps run: each evaluates the next token of every running answer.",
             lambda: steps()[0]),
            ("edgeinfer_decoded_tokens", "Answers the decode steps evaluated a token of (over steps: the mean batch).",
             lambda: steps()[1]),
        )  # fmt: skip
        for name, documentation, read in gauges:
            Gauge(name, documentation, registry=registry).set_function(read)

    def answered(self, result: Result, waited_s: float) -> None:
        """Count one finished answer, ``waited_s`` the time it waited for a slot."""
        m = result.metrics
        self.answers.labels(result.route, str(bool(getattr(result, "degraded", False))).lower()).inc()
        self.tokens.labels("prompt").inc(m.prompt_tokens)
        self.tokens.labels("cached").inc(m.cached_tokens)
        self.tokens.labels("completion").inc(m.output_tokens)
        if m.output_tokens:
            self.ttft.observe(waited_s + m.ttft_s)
        if m.output_tokens > 1:
            self.tpot.observe(m.tpot_s)

    def render(self) -> bytes:
        return generate_latest(self.registry)
