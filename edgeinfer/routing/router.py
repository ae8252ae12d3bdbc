"""The edge-cloud router: the device answers what its small model can, the cloud the rest.

router = Router(local=Engine(), cloud=CloudModel("https://api.example.com/v1", "big-model"))
result = router.chat([{"role": "user", "content": "What is 47 * 38?"}], temperature=0)
print(result.text, result.route, result.reason, result.degraded, result.cloud_cost)

``auto`` tries local first and escalates when unsure. Before generating, it scores the prompt
(length against the KV capacity and the question's own size, task features, the prompt's
perplexity; see ``signals``) and sends it straight to the cloud if that score is already over the
threshold. Otherwise the local model generates its first ``probe_tokens`` tokens, held back from
the caller; their log-probabilities and entropies complete the score, and the held text is either
released (the local model goes on) or dropped for the cloud. With ``Policy(samples=N)`` the
local model first answers N more times, briefly and at random, and how much those answers
disagree with each other and with the probe joins the score (``disagreement``: a better judge
of a small model's wrong facts, for a slower first token). The caller never sees text from
both sides for one answer, except in the one documented case below, where each piece is shown once.

Failures: a cloud that is down, slow, rate-limited or erroring before its first text means the
local model answers (``degraded``); if the local probe is still paused, it simply resumes. If the
cloud fails after some of its text was shown, the local model continues that text (the prompt
plus the cloud's partial answer), so nothing is shown twice or lost. A local failure
(``ContextFull``, out of memory, a backend error) goes to the cloud; if local text was already
shown, the cloud is asked to continue it (it gets the partial answer as a last assistant message).
Private prompts (``privacy``) never leave the device, even then.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import threading
import time
from collections.abc import Generator, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from time import perf_counter
from typing import Any, ClassVar, Literal

from edgeinfer.chat import Continuation, Message
from edgeinfer.engine import Engine
from edgeinfer.errors import (
    BackendError,
    CloudError,
    ContextFull,
    InsufficientMemoryError,
    InvalidOptionError,
)
from edgeinfer.metrics import Metrics
from edgeinfer.routing.cloud import Cancellation, CloudModel, CloudStream, Usage
from edgeinfer.routing.privacy import PrivacyRule, PrivacyRules
from edgeinfer.routing.signals import (
    SIGNALS,
    WEIGHTS,
    disagreement_signal,
    entropy_signal,
    escalation_score,
    length_signal,
    perplexity_signal,
    size_signal,
    task_signals,
    top_signals,
    uncertainty_signal,
)
from edgeinfer.sampling import SamplingParams, sampling_params
from edgeinfer.streams import AsyncStream, FinishReason, Result, Stream, drain

Mode = Literal["auto", "local", "cloud"]
Prompt = Sequence[Message] | str  # a string is one user message
MODES: tuple[Mode, ...] = ("auto", "local", "cloud")
# Each sends 30% of scripts/data/router_questions.jsonl to the cloud, with and without samples.
DEFAULT_THRESHOLD = 0.64
SAMPLED_THRESHOLD = 1.81  # disagreement adds up to its weight, 1.33, to the score
# What a local failure can look like; anything else is a bug and is raised.
LOCAL_FAILURES = (ContextFull, BackendError, InsufficientMemoryError, MemoryError)


@dataclass(frozen=True)
class Policy:
    """How to route. ``auto`` escalates when the escalation score reaches ``threshold``
    (``edgeinfer router calibrate`` picks one for a target cloud share; by default, the one that
    sends 30% of our benchmark's questions, with or without ``samples``); ``probe_tokens`` is K,
    the local tokens generated and judged before the caller sees any; ``weights`` weigh each
    signal in the score (default: ``signals.WEIGHTS``, fitted for SmolLM2-135M). ``samples`` > 0
    also has the local model answer that many times (``sample_tokens`` each, at temperature 0.7)
    before the probe, for the ``disagreement`` signal: a better score for that many more local
    tokens before the first one is shown (see ``signals``)."""

    mode: Mode = "auto"
    threshold: float = -1.0  # -1: DEFAULT_THRESHOLD, or SAMPLED_THRESHOLD with samples
    probe_tokens: int = 16
    weights: Mapping[str, float] = field(default_factory=lambda: dict(WEIGHTS))
    samples: int = 0
    sample_tokens: int = 24

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise InvalidOptionError(f"unknown routing policy {self.mode!r}; choose one of {', '.join(MODES)}")
        if not math.isfinite(self.threshold):  # nan compares false with every score: auto would never escalate
            raise InvalidOptionError(
                f"the routing threshold must be a finite number, got {self.threshold}; "
                "`edgeinfer router calibrate` picks one"
            )
        unknown = set(self.weights) - set(SIGNALS)
        if unknown or not all(math.isfinite(w) and w >= 0 for w in self.weights.values()):
            raise InvalidOptionError(
                f"weights are finite non-negative numbers for the signals {', '.join(SIGNALS)}; "
                f"got {dict(self.weights)}"
            )
        if self.probe_tokens < 1:
            raise InvalidOptionError(f"probe_tokens must be at least 1, got {self.probe_tokens}")
        if self.samples < 0 or self.sample_tokens < 1:
            raise InvalidOptionError(
                f"samples must be 0 or more and sample_tokens at least 1, got {self.samples} and {self.sample_tokens}"
            )
        if self.threshold == -1.0:
            object.__setattr__(self, "threshold", SAMPLED_THRESHOLD if self.samples else DEFAULT_THRESHOLD)


@dataclass(frozen=True)
class Budget:
    """A cap on cloud use within any sliding window of ``window_s`` seconds (None: no cap)."""

    max_requests: int | None = None
    max_tokens: int | None = None
    window_s: float = 3600.0

    def __post_init__(self) -> None:
        if self.window_s <= 0:
            raise InvalidOptionError(f"the budget window must be positive, got {self.window_s}")


class _Ledger:
    """Cloud requests and tokens spent in the last window, safe to share between threads."""

    def __init__(self, budget: Budget) -> None:
        self.budget = budget
        self._spent: collections.deque[tuple[float, int, int]] = collections.deque()  # (time, requests, tokens)
        self._lock = threading.Lock()

    def charge(self, requests: int = 0, tokens: int = 0) -> None:
        with self._lock:
            self._spent.append((time.monotonic(), requests, tokens))

    def exhausted(self) -> str | None:
        """Why no further cloud call fits in the budget now, or None if one does."""
        b = self.budget
        with self._lock:
            now = time.monotonic()
            while self._spent and self._spent[0][0] <= now - b.window_s:
                self._spent.popleft()
            requests = sum(r for _, r, _ in self._spent)
            tokens = sum(t for _, _, t in self._spent)
        if b.max_requests is not None and requests >= b.max_requests:
            return f"the cloud budget of {b.max_requests} requests per {b.window_s:g} s is used up"
        if b.max_tokens is not None and tokens >= b.max_tokens:
            return f"the cloud budget of {b.max_tokens} tokens per {b.window_s:g} s is used up"
        return None


@dataclass
class CloudMetrics(Metrics):
    """A cloud answer's metrics: its tokens (as the server counted them, or counted here), and when each
    piece of its stream arrived (``token_times_s``; a piece is about a token), which the decode row's
    percentiles read. Nothing ran locally: ``format`` leaves out prefill, stage times and the KV cache."""

    rows_left_out: ClassVar[tuple[str, ...]] = ("prefill", "stages", "prompt cache", "drafts", "KV cache")


@dataclass
class RoutedResult(Result):
    """A Result that says where it was answered and why.

    ``route``: ``local`` or ``cloud``, the side that finished the answer. ``reason``: why, in words.
    ``degraded``: a failure changed the route (the answer is not what the policy chose).
    ``score``/``signals``: the escalation score and its parts (``auto`` only). ``local_usage``/
    ``cloud_usage``: tokens each side used for this call; ``cloud_cost``: at the cloud's prices.
    ``metrics``: the answering side's counters (``CloudMetrics`` for a cloud answer),
    with ``ttft_s``/``total_s`` as the caller saw them.
    """

    reason: str = ""
    degraded: bool = False
    score: float | None = None
    signals: dict[str, float] = field(default_factory=dict)
    local_usage: Usage = field(default_factory=Usage)
    cloud_usage: Usage = field(default_factory=Usage)
    cloud_cost: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        out = super().to_dict()
        out.update(
            reason=self.reason,
            degraded=self.degraded,
            score=self.score,
            signals=self.signals,
            local_usage=dataclasses.asdict(self.local_usage),
            cloud_usage=dataclasses.asdict(self.cloud_usage),
            cloud_cost=self.cloud_cost,
        )
        return out


@dataclass
class Assessment:
    """What ``Router.assess`` found: the local answer, and the escalation score it would have got."""

    result: Result
    signals: dict[str, float]
    score: float


class RouterStream(Stream):
    """A Stream whose ``cancel()`` stops both sides: the local decode loop and the cloud request."""

    def __init__(self, chunks: Generator[str, None, Result], call: _Call) -> None:
        super().__init__(chunks, call.cancel_event)
        self._call = call

    def cancel(self) -> None:
        self._call.cancel()


class Router:
    """Routes each call to the local engine or the cloud model; the same calls as ``Engine``.

    Args:
        local: the engine on the device.
        cloud: the cloud model to escalate to.
        policy: ``"auto"``, ``"local"``, ``"cloud"`` or a ``Policy``. ``local`` and ``cloud``
            fix the route but still fall back to the other side when theirs fails.
        privacy: extra ``PrivacyRule``s or regular expressions; prompts matching them, or the
            built-in rules (unless ``builtin_privacy=False``), never go to the cloud.
        budget: a cap on cloud requests and tokens per window; past it, calls stay local.
    """

    def __init__(
        self,
        local: Engine,
        cloud: CloudModel,
        *,
        policy: Mode | Policy = "auto",
        privacy: Iterable[str | PrivacyRule] = (),
        builtin_privacy: bool = True,
        budget: Budget | None = None,
    ) -> None:
        self.local = local
        self.cloud = cloud
        self.policy = policy if isinstance(policy, Policy) else Policy(mode=policy)
        self.privacy = PrivacyRules(privacy, builtin=builtin_privacy)
        self._ledger = _Ledger(budget or Budget())

    # -- public API ----------------------------------------------------------------------------

    def chat(self, messages: Prompt, params: SamplingParams | None = None, **options: Any) -> RoutedResult:
        """Answer ``messages`` (a string is one user message) on the side the policy picks."""
        stream = self._stream(messages, params, options)
        for _ in stream:
            pass
        return _routed(stream)

    def stream(self, messages: Prompt, params: SamplingParams | None = None, **options: Any) -> RouterStream:
        """Stream the answer's text; ``.result`` (a ``RoutedResult``) once it has ended."""
        return self._stream(messages, params, options)

    async def achat(self, messages: Prompt, params: SamplingParams | None = None, **options: Any) -> RoutedResult:
        """Async ``chat``; cancelling the awaiting task cancels both sides."""
        routed = self._stream(messages, params, options)
        async with AsyncStream(routed) as stream:
            async for _ in stream:
                pass
        return _routed(routed)

    def astream(self, messages: Prompt, params: SamplingParams | None = None, **options: Any) -> AsyncStream:
        """Async ``stream``: ``async for piece in router.astream(...)``."""
        return AsyncStream(self.stream(messages, params, **options))

    def cloud_state(self) -> str | None:
        """Why the cloud cannot be called now (cooling down, budget used up), or None if it can."""
        breaker = self.cloud.breaker
        if breaker.state == "open":
            return f"the cloud is cooling down after failures ({breaker.cooldown_left_s:.0f} s left)"
        return self._ledger.exhausted()

    # -- routing -------------------------------------------------------------------------------

    def _stream(
        self,
        messages: Prompt,
        params: SamplingParams | None,
        options: dict[str, Any],
    ) -> RouterStream:
        messages, params = _prepare(messages, params, options)
        call = _Call()
        return RouterStream(_Routing(self, messages, params, call).run(), call)


class _Call:
    """One routed call's cancellation, reaching whichever side is running."""

    def __init__(self) -> None:
        self.cancel_event = threading.Event()
        self.cloud_cancel = Cancellation()
        self.local: Stream | None = None
        self.cloud: CloudStream | None = None

    @property
    def cancelled(self) -> bool:
        return self.cancel_event.is_set()

    def cancel(self) -> None:
        self.cancel_event.set()
        if self.local is not None:
            self.local.cancel()
        self.cloud_cancel.cancel()

    def run_locally(self, stream: Stream) -> None:
        """Make ``stream`` the local side that ``cancel`` stops; stop it now if that came first."""
        self.local = stream
        if self.cancelled:
            stream.cancel()


class _Routing:
    """One call through the router: the plan, each side's attempt, and what the caller was shown."""

    def __init__(self, router: Router, messages: list[Message], params: SamplingParams, call: _Call):
        self.router = router
        self.local, self.cloud = router.local, router.cloud
        self.messages, self.params, self.call = messages, params, call
        self.start = perf_counter()
        self.ttft_s = 0.0
        self.shown: list[str] = []
        self.cloud_times: list[float] = []  # when each cloud piece was shown, from the start
        self.route: Literal["local", "cloud"] = "local"
        self.reason = ""
        self.degraded = False
        self.cloud_allowed = True
        self.signals: dict[str, float] = {}
        self.samples: list[str] = []
        self.score: float | None = None
        self.local_result: Result | None = None
        self.local_usage = Usage()
        self.cloud_usage = Usage()
        self.cloud_finish: FinishReason = "stop"
        self.cloud_model = router.cloud.model

    def run(self) -> Generator[str, None, RoutedResult]:
        try:
            plan = self._plan()
            if plan == "cloud":
                yield from self._cloud(self.messages, fallback=None)
            else:
                yield from self._local(probe=plan == "probe")
        finally:
            for side in (self.call.local, self.call.cloud):
                if side is not None:
                    side.close()
        return self._result()

    def _plan(self) -> Literal["local", "probe", "cloud"]:
        router, policy = self.router, self.router.policy
        rule = router.privacy.first_match("\n".join(str(m.get("content", "")) for m in self.messages))
        if rule is not None:
            self.cloud_allowed = False
            self.reason = f"private: the prompt contains a {rule}, so it stays on the device"
            return "local"
        if policy.mode == "local":
            self.reason = "policy: local"
            return "local"
        blocked = router.cloud_state()
        if blocked is not None:
            self.reason = blocked
            self.degraded = policy.mode == "cloud"
            return "local"
        if policy.mode == "cloud":
            self.reason = "policy: cloud"
            return "cloud"
        try:
            self.signals = prompt_signals(self.local, self.messages, self.params)
        except LOCAL_FAILURES as exc:
            self.degraded = True
            self.reason = f"the local model failed ({_describe(exc)})"
            return "cloud"
        self.score = escalation_score(self.signals, policy.weights)
        if self.signals["length"] >= 1.0:
            self.reason = (
                f"the prompt and room for the answer exceed the local KV capacity of {self.local.capacity} tokens"
            )
            return "cloud"
        if self.score >= policy.threshold:
            top = top_signals(self.signals, policy.weights)
            self.reason = f"escalation score {self.score:.2f} >= {policy.threshold:.2f} before generating ({top})"
            return "cloud"
        try:
            self.samples = sample_answers(self.local, self.messages, policy, self.call)
        except LOCAL_FAILURES as exc:
            self.degraded = True
            self.reason = f"the local model failed ({_describe(exc)})"
            return "cloud"
        return "probe"

    # -- the local side ------------------------------------------------------------------------

    def _local(self, *, probe: bool) -> Generator[str, None, None]:
        policy = self.router.policy
        # The probe judges the local model's confidence in its first tokens; other plans need none of it.
        params = dataclasses.replace(self.params, logprobs=probe or self.params.logprobs)
        stream = self.local.stream(self.messages, params)
        self.call.run_locally(stream)  # a cancel while the prompt was scored or sampled stops it at once
        held: list[str] = []
        try:
            if probe:
                # Hold the first K tokens back while judging the model's confidence in them.
                held = take_probe(stream, policy.probe_tokens)
                self.signals.update(
                    probe_signals(
                        self.messages,
                        "".join(held),
                        self.samples,
                        stream.logprobs,
                        stream.entropies,
                        policy.probe_tokens,
                    )
                )
                self.score = escalation_score(self.signals, policy.weights)
                verdict = ">=" if self.score >= policy.threshold else "<"
                self.reason = (
                    f"escalation score {self.score:.2f} {verdict} {policy.threshold:.2f} after "
                    # The signals read the first K tokens; a chunk of kept drafted tokens may have brought more.
                    f"{min(len(stream.tokens), policy.probe_tokens)} local tokens "
                    f"({top_signals(self.signals, policy.weights)})"
                )
                if verdict == ">=" and not self.call.cancelled:
                    yield from self._cloud(self.messages, fallback=(stream, held))
                    return
            yield from self._resume_local(stream, held)
        except LOCAL_FAILURES as exc:
            self._local_usage_so_far(stream)
            yield from self._after_local_failure(exc)

    def _resume_local(self, stream: Stream, held: list[str]) -> Generator[str, None, None]:
        self.route = "local"
        yield from self._show(held)
        yield from self._show(stream)
        self.local_result = stream.result
        self._local_usage_so_far(stream)

    def _local_usage_so_far(self, stream: Stream) -> None:
        result = stream.result
        if result is not None:
            self.local_usage = Usage(result.metrics.prompt_tokens, result.metrics.output_tokens)
        else:
            self.local_usage = Usage(len(self.local.tokenize(self.messages)), len(stream.tokens), estimated=True)

    def _after_local_failure(self, exc: BaseException) -> Generator[str, None, None]:
        blocked = self.router.cloud_state()
        if not self.cloud_allowed or blocked is not None or self.call.cancelled:
            raise exc
        if self.call.local is not None:
            self.call.local.close()
        self.degraded = True
        self.reason = f"the local model failed ({_describe(exc)})"
        messages = self.messages
        if self.shown:  # the caller has part of a local answer: the cloud continues it
            messages = [*messages, {"role": "assistant", "content": "".join(self.shown)}]
        yield from self._cloud(messages, fallback=None, local_on_failure=False)

    # -- the cloud side ------------------------------------------------------------------------

    def _cloud(
        self,
        messages: list[Message],
        fallback: tuple[Stream, list[str]] | None,
        local_on_failure: bool = True,
    ) -> Generator[str, None, None]:
        self.route = "cloud"
        self.router._ledger.charge(requests=1)
        # Always a streamed request, for chat too: what arrives before a failure is kept, and continued locally.
        cloud_stream = self.cloud.stream(messages, self.params, cancel=self.call.cloud_cancel)
        self.call.cloud = cloud_stream
        try:
            first = next(cloud_stream, None)
        except CloudError as err:
            yield from self._after_cloud_failure(err, fallback, local_on_failure)
            return
        if fallback is not None:  # the cloud has answered: let the engine go
            self.local_usage = Usage(len(self.local.tokenize(self.messages)), len(fallback[0].tokens), estimated=True)
            fallback[0].close()
        if first:
            yield from self._show([first], self.cloud_times)
        try:
            yield from self._show(cloud_stream, self.cloud_times)
        except CloudError as err:
            self._count_cloud(cloud_stream.usage, messages, cloud_stream.finish_reason)
            if err.kind == "cancelled":
                self.cloud_finish = "cancelled"
                return
            if not local_on_failure:
                raise CloudError(
                    f"{self.reason}, and the cloud failed mid-answer: {err}", err.kind, err.status
                ) from None
            yield from self._continue_locally(err)
            return
        self.cloud_model = cloud_stream.model
        self._count_cloud(cloud_stream.usage, messages, cloud_stream.finish_reason)

    def _after_cloud_failure(
        self, err: CloudError, fallback: tuple[Stream, list[str]] | None, local_on_failure: bool
    ) -> Generator[str, None, None]:
        if err.kind == "cancelled":
            self.cloud_finish = "cancelled"
            return
        if not local_on_failure:
            raise CloudError(f"{self.reason}, and so did the cloud: {err}", err.kind, err.status) from None
        self.degraded = True
        self.cloud_allowed = False
        self.reason = f"{self.reason}; the cloud failed ({err.kind}: {err}), so the local model answered"
        if fallback is not None:
            yield from self._resume_local(*fallback)
        else:
            yield from self._local(probe=False)

    def _continue_locally(self, err: CloudError) -> Generator[str, None, None]:
        """The cloud broke off mid-answer: the local model continues the text shown so far."""
        self.degraded = True
        self.cloud_allowed = False
        self.reason = f"{self.reason}; the cloud failed mid-answer ({err.kind}: {err}), so the local model finished it"
        prompt = Continuation(self.messages, "".join(self.shown))
        left = max(1, self.params.max_tokens - self.cloud_usage.completion_tokens)
        stream = self.local.stream(prompt, dataclasses.replace(self.params, max_tokens=left))
        self.call.local = stream
        yield from self._resume_local(stream, [])

    def _count_cloud(self, usage: Usage | None, messages: list[Message], finish: str | None) -> None:
        if usage is None:  # the server did not say: count with the local tokenizer
            text = "".join(self.shown)
            usage = Usage(
                len(self.local.tokenize(messages)),
                len(self.local.tokenizer.encode(text, add_special=False)) if text else 0,
                estimated=True,
            )
        self.cloud_usage = usage
        self.cloud_finish = "length" if finish == "length" else "stop"
        self.router._ledger.charge(tokens=usage.total_tokens)

    # -- what the caller sees ------------------------------------------------------------------

    def _show(self, chunks: Iterable[str], times: list[float] | None = None) -> Generator[str, None, None]:
        """Pass ``chunks`` to the caller; ``times``, if given, gets when each was shown."""
        for chunk in chunks:
            now = perf_counter() - self.start
            if not self.shown:
                self.ttft_s = now
            if times is not None:
                times.append(now)
            self.shown.append(chunk)
            yield chunk

    def _result(self) -> RoutedResult:
        total = perf_counter() - self.start
        text = "".join(self.shown)
        local = self.local_result
        if self.route == "local" and local is not None:
            metrics: Metrics = dataclasses.replace(
                local.metrics, ttft_s=self.ttft_s or local.metrics.ttft_s, total_s=total
            )
            result = RoutedResult(
                text,
                local.tokens,
                local.finish_reason,
                metrics,
                local.model,
                local.backend,
                "local",
                local.logprobs,
                local.entropies,
            )
        else:
            finish: FinishReason = "cancelled" if self.call.cancelled else self.cloud_finish
            metrics = CloudMetrics(
                prompt_tokens=self.cloud_usage.prompt_tokens,
                output_tokens=self.cloud_usage.completion_tokens,
                ttft_s=self.ttft_s,
                total_s=total,
                token_times_s=self.cloud_times,
            )
            result = RoutedResult(text, [], finish, metrics, self.cloud_model, "cloud", self.route)
        result.reason, result.degraded, result.score, result.signals = (
            self.reason,
            self.degraded,
            self.score,
            self.signals,
        )
        result.local_usage, result.cloud_usage = self.local_usage, self.cloud_usage
        result.cloud_cost = self.cloud.cost(self.cloud_usage)
        return result


def assess(
    engine: Engine,
    messages: Prompt,
    params: SamplingParams | None = None,
    *,
    policy: Policy | None = None,
    **options: Any,
) -> Assessment:
    """Answer on ``engine``, in full, with every escalation signal ``auto`` would compute."""
    policy = policy or Policy()
    messages, params = _prepare(messages, params, options)
    signals = prompt_signals(engine, messages, params)
    samples = sample_answers(engine, messages, policy)
    with engine.stream(messages, dataclasses.replace(params, logprobs=True)) as stream:
        probe = "".join(take_probe(stream, policy.probe_tokens))
        result = drain(stream)
    signals.update(probe_signals(messages, probe, samples, result.logprobs, result.entropies, policy.probe_tokens))
    return Assessment(result, signals, escalation_score(signals, policy.weights))


def prompt_signals(engine: Engine, messages: list[Message], params: SamplingParams) -> dict[str, float]:
    """Every signal known before generating: length, size, task features, the prompt's perplexity."""
    tokens = engine.tokenize(messages)
    room = min(params.max_tokens, engine.capacity // 4)
    signals = {"length": length_signal(len(tokens), room, engine.capacity)}
    if signals["length"] >= 1.0:
        return signals
    start, tail = _last_message_span(engine, messages, tokens)
    signals["size"] = size_signal(max(0, len(tokens) - start - tail))
    signals.update(task_signals(_question(messages)))
    scores = engine.prompt_logprobs(messages, start)
    signals["perplexity"] = perplexity_signal(scores[: len(scores) - tail] if tail else scores)
    return signals


def take_probe(stream: Stream, k: int) -> list[str]:
    """The text chunks of the stream's first ``k`` tokens (fewer if the answer ends sooner)."""
    held: list[str] = []
    for chunk in stream:
        held.append(chunk)
        if len(stream.tokens) >= k:
            break
    return held


def sample_answers(engine: Engine, messages: list[Message], policy: Policy, call: _Call | None = None) -> list[str]:
    """The ``policy.samples`` short answers ``disagreement`` compares with the probe (seeded: reproducible).

    They are decoded together, as parallel sequences sharing the prompt's KV. Cancelling ``call``
    stops them after their current token.
    """
    if not policy.samples:
        return []
    params = [
        SamplingParams(temperature=0.7, max_tokens=policy.sample_tokens, seed=seed) for seed in range(policy.samples)
    ]
    results = engine.generate_batch(messages, params, cancel=call.cancel_event if call is not None else None)
    return [result.text for result in results]


def generation_signals(logprobs: Sequence[float], entropies: Sequence[float], k: int) -> dict[str, float]:
    """The signals of the local model's confidence in its first ``k`` generated tokens."""
    return {"uncertainty": uncertainty_signal(logprobs[:k]), "entropy": entropy_signal(entropies[:k])}


def probe_signals(
    messages: Sequence[Message],
    probe: str,
    samples: Sequence[str],
    logprobs: Sequence[float],
    entropies: Sequence[float],
    k: int,
) -> dict[str, float]:
    """What the probe adds to the score: confidence in its first ``k`` tokens and, with samples, disagreement."""
    signals = generation_signals(logprobs, entropies, k)
    if samples:
        signals["disagreement"] = disagreement_signal(_question(messages), [probe, *samples])
    return signals


def _question(messages: Sequence[Message]) -> str:
    return str(messages[-1].get("content", ""))


def _last_message_span(engine: Engine, messages: list[Message], tokens: list[int]) -> tuple[int, int]:
    """Where the last message's text starts in ``tokens``, and how many template tokens follow it.

    Perplexity is the model's surprise at what the user wrote, not at the chat template around it.
    """
    last = messages[-1]
    skeleton = engine.tokenize([*messages[:-1], {"role": last.get("role", "user"), "content": ""}])
    start = 0
    while start < min(len(tokens), len(skeleton)) and tokens[start] == skeleton[start]:
        start += 1
    return max(start, 1), len(skeleton) - start


def _prepare(
    messages: Prompt, params: SamplingParams | None, options: dict[str, Any]
) -> tuple[list[Message], SamplingParams]:
    if isinstance(messages, str):
        messages = [{"role": "user", "content": messages}]
    if not messages or not all(isinstance(m, dict) and "role" in m and "content" in m for m in messages):
        raise InvalidOptionError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
    return list(messages), sampling_params(params, options)


def _routed(stream: Stream) -> RoutedResult:
    assert isinstance(stream.result, RoutedResult)
    return stream.result


def _describe(exc: BaseException) -> str:
    message = " ".join(str(exc).split()) or "no message"
    return f"{type(exc).__name__}: {message}"
