"""A client for an OpenAI-compatible ``/v1/chat/completions`` endpoint, built for falling back.

cloud = CloudModel("https://api.example.com/v1", "big-model")   # key from OPENAI_API_KEY
reply = cloud.complete([{"role": "user", "content": "Hi"}])
for piece in cloud.stream([{"role": "user", "content": "Hi"}]):
    print(piece, end="")

Every call has connect, read and total timeouts. Timeouts, dropped connections and the statuses
a server uses for "try again" (408, 409, 429, 5xx) are retried with jittered exponential backoff,
or after the server's ``Retry-After`` when that is short enough; a longer one fails at once (and
the circuit stays open that long) so the caller can answer locally instead of waiting. 400, 401,
403 and quota errors are not retried. A stream is retried only until its first text: after that,
text would be repeated. After ``breaker_failures`` failed calls in a row, the circuit breaker
refuses calls for ``breaker_cooldown_s``, then lets one trial call through.

``Cancellation.cancel()`` ends a call from another thread: between retries at once, and during
a response by cutting its connection. A request still waiting for response headers (a
non-streamed answer being generated) ends at its read timeout, so the router always streams.

The API key goes only into the ``Authorization`` header: ``repr`` masks it and every error
message is scrubbed of it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import email.utils
import json
import os
import random
import socket
import threading
import time
from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import httpx

from edgeinfer.errors import CloudError, InvalidOptionError
from edgeinfer.sampling import SamplingParams

_RETRY_STATUS = frozenset({408, 409, 429})
_NOT_RETRIED_KINDS = frozenset({"auth", "quota", "bad_request", "protocol", "circuit_open", "cancelled"})
# Failures that say nothing about the endpoint's health do not count towards opening the circuit.
_NOT_COUNTED_KINDS = frozenset({"bad_request", "circuit_open", "cancelled"})
BreakerState = Literal["closed", "open", "half_open"]


@dataclass
class Usage:
    """Tokens one call used. ``estimated``: the server sent no usage, so they were counted here."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    estimated: bool = False

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass
class CloudReply:
    """A finished cloud answer. ``finish_reason`` as the server gave it (``stop``, ``length``, ...)."""

    text: str
    finish_reason: str
    usage: Usage | None
    model: str


class CircuitBreaker:
    """Stops calling an endpoint that keeps failing.

    ``closed``: calls go through. After ``failures`` failed calls in a row it is ``open``: calls are
    refused for ``cooldown_s``. Then it is ``half_open``: calls go through again, and the first
    outcome decides: a success closes it, a failure opens it for another cooldown.
    """

    def __init__(self, failures: int = 3, cooldown_s: float = 30.0) -> None:
        if failures < 1 or cooldown_s < 0:
            raise InvalidOptionError("a circuit breaker needs failures >= 1 and cooldown_s >= 0")
        self.failures = failures
        self.cooldown_s = cooldown_s
        self._lock = threading.Lock()
        self._failed = 0
        self._open_until: float | None = None

    @property
    def state(self) -> BreakerState:
        with self._lock:
            if self._open_until is None:
                return "closed"
            return "open" if time.monotonic() < self._open_until else "half_open"

    @property
    def cooldown_left_s(self) -> float:
        """Seconds until calls may go through again (0 unless open)."""
        with self._lock:
            return max(0.0, self._open_until - time.monotonic()) if self._open_until is not None else 0.0

    def allow(self) -> bool:
        """Whether a call may go now."""
        return self.state != "open"

    def record_success(self) -> None:
        with self._lock:
            self._failed, self._open_until = 0, None

    def record_failure(self, cooldown_s: float | None = None) -> None:
        """Count a failed call; ``cooldown_s`` opens the circuit at once for that long (a long Retry-After)."""
        with self._lock:
            self._failed += 1
            if cooldown_s is not None or self._open_until is not None or self._failed >= self.failures:
                wait = self.cooldown_s if cooldown_s is None else max(cooldown_s, self.cooldown_s)
                self._open_until = time.monotonic() + wait


class CloudModel:
    """A chat model behind an OpenAI-compatible HTTP API.

    Args:
        url: the API base (``https://host/v1``) or the full ``.../chat/completions`` URL;
            default: ``$EDGEINFER_CLOUD_URL``. A base without ``/v1`` gets it appended.
        model: the model name the server expects; default: ``$EDGEINFER_CLOUD_MODEL``.
        api_key: sent as a bearer token; default: ``$OPENAI_API_KEY`` (none if unset).
        connect_timeout, read_timeout: seconds for one connection / between two reads.
        total_timeout: seconds for a whole call, retries and backoff included.
        max_retries: retries after the first attempt.
        backoff_s, max_backoff_s: exponential backoff base and cap; each wait is jittered
            between half and all of it, so many clients do not retry in lockstep.
        max_retry_after_s: the longest ``Retry-After`` waited out; a longer one fails the call.
        breaker_failures, breaker_cooldown_s: see ``CircuitBreaker``.
        price_per_1k_input, price_per_1k_output: currency per 1000 tokens, for ``cost()``.
    """

    def __init__(
        self,
        url: str | None = None,
        model: str | None = None,
        *,
        api_key: str | None = None,
        connect_timeout: float = 5.0,
        read_timeout: float = 30.0,
        total_timeout: float = 120.0,
        max_retries: int = 2,
        backoff_s: float = 0.5,
        max_backoff_s: float = 8.0,
        max_retry_after_s: float = 10.0,
        breaker_failures: int = 3,
        breaker_cooldown_s: float = 30.0,
        price_per_1k_input: float = 0.0,
        price_per_1k_output: float = 0.0,
    ) -> None:
        url = url or os.environ.get("EDGEINFER_CLOUD_URL")
        model = model or os.environ.get("EDGEINFER_CLOUD_MODEL")
        if not url:
            raise InvalidOptionError("no cloud URL: pass url= (--cloud-url) or set EDGEINFER_CLOUD_URL")
        if not model:
            raise InvalidOptionError("no cloud model name: pass model= (--cloud-model) or set EDGEINFER_CLOUD_MODEL")
        if not url.startswith(("http://", "https://")):
            raise InvalidOptionError(f"the cloud URL must start with http:// or https://, got {url!r}")
        for name, value in (("connect_timeout", connect_timeout), ("read_timeout", read_timeout),
                            ("total_timeout", total_timeout)):  # fmt: skip
            if not value > 0:
                raise InvalidOptionError(f"{name} must be a positive number of seconds, got {value}")
        if max_retries < 0:
            raise InvalidOptionError(f"max_retries must be >= 0, got {max_retries}")
        self.url = _endpoint(url)
        self.model = model
        self._api_key = api_key if api_key is not None else os.environ.get("OPENAI_API_KEY") or None
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.total_timeout = total_timeout
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.max_retry_after_s = max_retry_after_s
        self.breaker = CircuitBreaker(breaker_failures, breaker_cooldown_s)
        self.price_per_1k_input = price_per_1k_input
        self.price_per_1k_output = price_per_1k_output
        self._client = httpx.Client(follow_redirects=False)

    def __repr__(self) -> str:
        key = "set" if self._api_key else "none"
        return f"CloudModel(url={self.url!r}, model={self.model!r}, api_key=<{key}>)"

    def cost(self, usage: Usage) -> float:
        """The estimated price of ``usage`` at this model's prices."""
        return (
            usage.prompt_tokens * self.price_per_1k_input + usage.completion_tokens * self.price_per_1k_output
        ) / 1000

    def complete(
        self,
        messages: Sequence[Mapping[str, Any]],
        params: SamplingParams | None = None,
        *,
        cancel: Cancellation | None = None,
        **options: Any,
    ) -> CloudReply:
        """One answer, not streamed. Raises ``CloudError`` once retries are spent.

        ``max_tokens``, ``temperature``, ``top_p``, ``seed`` and ``stop`` are sent; setting
        ``cancel`` stops the call (between retries, or by cutting the connection).
        """
        body = self._body(messages, sampling_params(params, options), stream=False)
        call = cancel or Cancellation()
        deadline = time.monotonic() + self.total_timeout

        def attempt() -> CloudReply:
            response = self._send(body, deadline, call)
            try:
                payload = _read_json(response)
            finally:
                response.close()
            text, finish = _message(payload)
            return CloudReply(text, finish, _usage(payload.get("usage")), payload.get("model") or self.model)

        try:
            reply = self._retrying(attempt, deadline, call)
        except CloudError as err:
            raise self._scrub(err) from None
        return reply

    def stream(
        self,
        messages: Sequence[Mapping[str, Any]],
        params: SamplingParams | None = None,
        *,
        cancel: Cancellation | None = None,
        **options: Any,
    ) -> CloudStream:
        """Text chunks as the server sends them (SSE). Raises ``CloudError`` while iterating."""
        body = self._body(messages, sampling_params(params, options), stream=True)
        return CloudStream(self, body, cancel or Cancellation())

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> CloudModel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- one request, and the retry loop around it ------------------------------------------------

    def _body(self, messages: Sequence[Mapping[str, Any]], params: SamplingParams, *, stream: bool) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model,
            "messages": [{"role": m["role"], "content": m["content"]} for m in messages],
            "max_tokens": params.max_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "stream": stream,
        }
        if params.seed is not None:
            body["seed"] = params.seed
        if params.stop:
            body["stop"] = list(params.stop[:4])  # the most the OpenAI API takes
        if stream:
            body["stream_options"] = {"include_usage": True}
        return body

    def _send(self, body: dict[str, Any], deadline: float, call: Cancellation) -> httpx.Response:
        """One POST; a 200 response is returned open (its body not read yet), anything else raised."""
        left = deadline - time.monotonic()
        if left <= 0:
            raise CloudError(f"no answer within the total timeout of {self.total_timeout:g} s", "timeout")
        timeout = httpx.Timeout(min(self.read_timeout, left), connect=min(self.connect_timeout, left))
        headers = {"Authorization": f"Bearer {self._api_key}"} if self._api_key else {}
        request = self._client.build_request("POST", self.url, json=body, headers=headers, timeout=timeout)
        call.check()
        try:
            response = self._client.send(request, stream=True)
        except httpx.HTTPError as exc:
            raise _transport_error(exc) from None
        call.attach(response)
        if response.status_code == 200:
            return response
        try:
            response.read()
        except httpx.HTTPError as exc:
            raise _transport_error(exc) from None
        finally:
            response.close()
        raise _status_error(response)

    def _retrying(self, attempt: Callable[[], Any], deadline: float, call: Cancellation, *, done: bool = True) -> Any:
        """Run ``attempt`` until it succeeds or fails for good. ``done``: its success ends the call
        (a stream's first text does not: the breaker hears of the stream's end)."""
        for tries in range(self.max_retries + 1):
            # The breaker judges calls, not attempts: a call it let through keeps its retries.
            if tries == 0 and not self.breaker.allow():
                raise CloudError(
                    f"the cloud is cooling down after repeated failures ({self.breaker.cooldown_left_s:.0f} s left)",
                    "circuit_open",
                )
            try:
                result = attempt()
            except CloudError as err:
                if call.cancelled:
                    raise CloudError("the call was cancelled", "cancelled") from None
                wait = self._wait_before_retry(err, tries, deadline)
                if wait is None:
                    if err.kind not in _NOT_COUNTED_KINDS:
                        too_long = err.retry_after is not None and err.retry_after > self.max_retry_after_s
                        self.breaker.record_failure(err.retry_after if too_long else None)
                    raise
                if call.sleep(wait):
                    raise CloudError("the call was cancelled", "cancelled") from None
                continue
            if done:
                self.breaker.record_success()
            return result
        raise AssertionError("unreachable")

    def _wait_before_retry(self, err: CloudError, tries: int, deadline: float) -> float | None:
        """Seconds to wait before the next attempt, or None when the error is final."""
        if err.kind in _NOT_RETRIED_KINDS or tries >= self.max_retries:
            return None
        if err.status is not None and err.status not in _RETRY_STATUS and err.status < 500:
            return None
        if err.retry_after is not None:
            if err.retry_after > self.max_retry_after_s:
                return None
            wait = err.retry_after
        else:
            ceiling = min(self.max_backoff_s, self.backoff_s * 2**tries)
            wait = random.uniform(ceiling / 2, ceiling)
        return wait if time.monotonic() + wait < deadline else None

    def _scrub(self, err: CloudError) -> CloudError:
        if self._api_key and self._api_key in str(err):
            return CloudError(str(err).replace(self._api_key, "[redacted]"), err.kind, err.status, err.retry_after)
        return err


class CloudStream(Iterator[str]):
    """The text of one streamed cloud answer. ``usage`` and ``finish_reason`` are set at its end.

    ``abort()`` may be called from any thread: it cuts the connection, so the server stops
    generating, and the iteration raises ``CloudError`` of kind ``cancelled``.
    """

    def __init__(self, cloud: CloudModel, body: dict[str, Any], call: Cancellation) -> None:
        self._cloud = cloud
        self._call = call
        self._chunks = self._run(body)
        self.usage: Usage | None = None
        self.finish_reason: str | None = None
        self.model: str = cloud.model

    def __next__(self) -> str:
        try:
            return next(self._chunks)
        except CloudError as err:
            if self._call.cancelled and err.kind != "cancelled":
                raise CloudError("the call was cancelled", "cancelled") from None
            raise self._cloud._scrub(err) from None

    def abort(self) -> None:
        self._call.cancel()

    def close(self) -> None:
        self._chunks.close()

    def _run(self, body: dict[str, Any]) -> Generator[str, None, None]:
        cloud, call = self._cloud, self._call
        deadline = time.monotonic() + cloud.total_timeout

        def until_first_text() -> tuple[httpx.Response, Iterator[dict[str, Any]], str | None]:
            response = cloud._send(body, deadline, call)
            if response.headers.get("content-type", "").startswith("application/json"):
                events = _whole(response)  # a server that ignored "stream": one answer, not events
            else:
                events = _events(response, deadline)
            try:
                for event in events:
                    text = self._take(event)
                    if text:
                        return response, events, text
            except BaseException:
                response.close()
                raise
            return response, events, None

        response, events, first = cloud._retrying(until_first_text, deadline, call, done=False)
        failed = False
        try:
            if first is not None:
                yield first
                for event in events:
                    text = self._take(event)
                    if text:
                        yield text
        except CloudError as err:
            failed = err.kind not in _NOT_COUNTED_KINDS and not call.cancelled
            raise
        finally:
            response.close()
            # A stream the caller closed early still showed the endpoint working.
            cloud.breaker.record_failure() if failed else cloud.breaker.record_success()

    def _take(self, event: dict[str, Any]) -> str:
        """Note the usage and finish reason in one SSE event; return its text."""
        if event.get("usage"):
            self.usage = _usage(event["usage"])
        self.model = event.get("model") or self.model
        try:
            choices = event.get("choices") or []
            if not choices:
                return ""
            choice = choices[0]
            self.finish_reason = choice.get("finish_reason") or self.finish_reason
            text = (choice.get("delta") or {}).get("content") or ""
        except AttributeError:
            raise CloudError("the cloud sent a stream event of the wrong shape", "protocol") from None
        if not isinstance(text, str):
            raise CloudError("the cloud sent a stream event whose content is not text", "protocol")
        return text


class Cancellation:
    """Stops cloud calls from any thread: ``cancel()`` ends their retries and cuts their connections,
    so the server stops generating. Pass one as ``cancel=`` to ``complete`` or ``stream``; one may
    serve several calls."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self._responses: list[httpx.Response] = []
        self._lock = threading.Lock()

    @property
    def cancelled(self) -> bool:
        return self._event.is_set()

    def cancel(self) -> None:
        self._event.set()
        with self._lock:
            responses = list(self._responses)
        for response in responses:
            # Shutting the socket down wakes a read blocked in another thread at once; closing does not.
            stream = response.extensions.get("network_stream")
            sock = stream.get_extra_info("socket") if stream is not None else None
            if isinstance(sock, socket.socket):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

    def check(self) -> None:
        if self.cancelled:
            raise CloudError("the call was cancelled", "cancelled")

    def sleep(self, seconds: float) -> bool:
        """Sleep; True if cancelled meanwhile."""
        return self._event.wait(seconds)

    def attach(self, response: httpx.Response) -> None:
        with self._lock:
            self._responses.append(response)
        if self.cancelled:
            self.cancel()


def _events(response: httpx.Response, deadline: float) -> Iterator[dict[str, Any]]:
    """The JSON events of a server-sent-event stream, up to ``data: [DONE]``."""
    data: list[str] = []
    name = ""
    try:
        for line in response.iter_lines():
            if time.monotonic() > deadline:
                raise CloudError("the stream ran past the total timeout", "timeout")
            if line.startswith(":"):  # an SSE comment, such as a keep-alive
                continue
            if line:
                field, _, value = line.partition(":")
                value = value[1:] if value.startswith(" ") else value
                if field == "data":
                    data.append(value)
                elif field == "event":
                    name = value
                continue
            if not data:
                continue
            payload, data = "\n".join(data), []
            if payload.strip() == "[DONE]":
                return
            event = _json(payload.encode(), "stream event")
            if name == "error" or "error" in event:
                raise _event_error(event)
            name = ""
            yield event
    except httpx.HTTPError as exc:
        raise _transport_error(exc) from None
    raise CloudError("the cloud's stream ended before data: [DONE]: the connection was cut", "connection")


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


def _read_json(response: httpx.Response) -> dict[str, Any]:
    try:
        response.read()
    except httpx.HTTPError as exc:
        raise _transport_error(exc) from None
    return _json(response.content, "response")


def _message(payload: dict[str, Any]) -> tuple[str, str]:
    """The text and finish reason of a non-streamed completion."""
    try:
        choice = payload["choices"][0]
        text = choice["message"].get("content") or ""
        finish = choice.get("finish_reason") or "stop"
    except (KeyError, IndexError, TypeError, AttributeError):
        raise CloudError("the cloud's response has no choices[0].message.content", "protocol") from None
    if not isinstance(text, str):
        raise CloudError("the cloud's response content is not text", "protocol")
    return text, finish


def _whole(response: httpx.Response) -> Iterator[dict[str, Any]]:
    """A non-streamed completion as the one stream event it would have been."""
    payload = _read_json(response)
    text, finish = _message(payload)
    yield {"choices": [{"delta": {"content": text}, "finish_reason": finish}], "model": payload.get("model")}
    if payload.get("usage"):
        yield {"choices": [], "usage": payload["usage"]}


def _json(raw: bytes, what: str) -> dict[str, Any]:
    try:
        value = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise CloudError(f"the cloud sent a {what} that is not valid JSON", "protocol") from None
    if not isinstance(value, dict):
        raise CloudError(f"the cloud sent a {what} that is not a JSON object", "protocol")
    return value


def _usage(raw: object) -> Usage | None:
    if not isinstance(raw, dict):
        return None
    try:
        return Usage(int(raw.get("prompt_tokens") or 0), int(raw.get("completion_tokens") or 0))
    except (TypeError, ValueError):
        return None


def _transport_error(exc: httpx.HTTPError) -> CloudError:
    if isinstance(exc, httpx.TimeoutException):
        return CloudError(f"the cloud did not answer in time ({type(exc).__name__})", "timeout")
    return CloudError(f"the connection to the cloud failed: {type(exc).__name__}: {_short(str(exc))}", "connection")


def _status_error(response: httpx.Response) -> CloudError:
    status = response.status_code
    message, code = _error_detail(response)
    retry_after = _retry_after(response.headers)
    detail = f"the cloud answered HTTP {status}" + (f": {message}" if message else "")
    if status in (401, 403):
        return CloudError(f"{detail}; check the API key (OPENAI_API_KEY)", "auth", status)
    if "quota" in code or "billing" in code:
        return CloudError(f"{detail}; the account is out of quota", "quota", status)
    if status == 429:
        return CloudError(detail, "rate_limited", status, retry_after)
    if status in _RETRY_STATUS or status >= 500:
        return CloudError(detail, "server", status, retry_after)
    return CloudError(detail, "bad_request", status)


def _error_detail(response: httpx.Response) -> tuple[str, str]:
    """The server's error message and its code/type, from an OpenAI-style error body if there is one."""
    try:
        error = response.json().get("error")
    except (ValueError, AttributeError, UnicodeDecodeError):
        return _short(response.text), ""
    if isinstance(error, dict):
        code = f"{error.get('code') or ''} {error.get('type') or ''}".lower()
        return _short(str(error.get("message") or "")), code
    return _short(str(error or "")), ""


def _event_error(event: dict[str, Any]) -> CloudError:
    error = event.get("error")
    message = error.get("message") if isinstance(error, dict) else error
    return CloudError(f"the cloud reported an error mid-stream: {_short(str(message or event))}", "server")


def _retry_after(headers: httpx.Headers) -> float | None:
    """Seconds the server asks us to wait: ``retry-after-ms``, or ``Retry-After`` in seconds or as a date."""
    if (ms := headers.get("retry-after-ms")) is not None:
        with contextlib.suppress(ValueError):
            return max(0.0, float(ms) / 1000)
    value = headers.get("retry-after")
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


def _endpoint(url: str) -> str:
    url = url.rstrip("/")
    if url.endswith("/chat/completions"):
        return url
    return url + ("/chat/completions" if url.endswith("/v1") else "/v1/chat/completions")


def _short(text: str, limit: int = 200) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"
