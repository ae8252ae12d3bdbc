"""A client for an OpenAI-compatible ``/v1/chat/completions`` endpoint, built for falling back.

cloud = CloudModel("https://api.example.com/v1", "big-model")   # key from OPENAI_API_KEY
reply = cloud.complete([{"role": "user", "content": "Hi"}])
for piece in cloud.stream([{"role": "user", "content": "Hi"}]):
    print(piece, end="")

Every call has connect, read and total timeouts. The total one holds on every path (connecting,
sending, waiting for headers, reading the body): each socket operation waits at most what is left
of it. Timeouts, dropped connections and the statuses a server uses for "try again" (408, 409,
429, 5xx) are retried with jittered exponential backoff, or after the server's ``Retry-After`` when
that is short enough; a longer one fails at once (and the circuit stays open that long) so the
caller can answer locally instead of waiting. 400, 401, 403 and quota errors are not retried. A
stream is retried only until its first text: after that, text would be repeated. After
``breaker_failures`` failed calls in a row, the circuit breaker refuses calls for
``breaker_cooldown_s``, then lets one trial call through.

A reply is bounded while it is read, not after: ``max_reply_bytes`` in all, 1 MiB per line and per
stream event, and text pieces and characters in proportion to ``max_tokens`` (a stream that never
ends is cut there). Past a bound the call fails with a ``protocol`` error, as for a malformed reply.

``Cancellation.cancel()`` ends a call from another thread at once, in every phase: between
retries, and while connecting, waiting for headers or reading the body, by shutting its socket
down (so the server stops generating too). Resolving the host name is the one wait it cannot cut.

The API key goes only into the ``Authorization`` header. It is checked when the model is built:
surrounding whitespace (a pasted newline) is dropped, and a control or non-ASCII character is
refused with a message that shows no part of it. ``repr`` masks it, and every error message is
scrubbed of it in its plain, escaped and URL-encoded forms.
"""

from __future__ import annotations

import contextlib
import contextvars
import email.utils
import json
import os
import random
import re
import select
import socket
import sys
import threading
import time
import urllib.parse
from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import httpcore
import httpx

from edgeinfer.errors import CloudError, InvalidOptionError
from edgeinfer.sampling import SamplingParams, sampling_params

_RETRY_STATUS = frozenset({408, 409, 429})
_NOT_RETRIED_KINDS = frozenset({"auth", "quota", "bad_request", "protocol", "circuit_open", "cancelled"})
# Failures that say nothing about the endpoint's health do not count towards opening the circuit.
_NOT_COUNTED_KINDS = frozenset({"bad_request", "circuit_open", "cancelled"})
BreakerState = Literal["closed", "open", "half_open"]
# Bounds on what a server may send. A real stream's lines and events are well under 1 KiB.
MAX_LINE_BYTES = 1 << 20
MAX_EVENT_BYTES = 1 << 20
ERROR_BODY_BYTES = 1 << 16  # of an error response, only the start is read: its message is at the front
# A piece of a stream is usually one token; some servers split tokens, so allow twice as many and some.
PIECES_PER_TOKEN, PIECE_SLACK = 2, 16
CHARS_PER_TOKEN = 128  # more than the longest token of the vocabularies we know
_LINE_END = re.compile(rb"\r\n|\r|\n")


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
        max_reply_bytes: the most one reply's body may hold; a longer one fails the call.
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
        max_reply_bytes: int = 4 << 20,
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
        if max_reply_bytes < ERROR_BODY_BYTES:
            raise InvalidOptionError(f"max_reply_bytes must be at least {ERROR_BODY_BYTES}, got {max_reply_bytes}")
        self.url = _endpoint(url)
        self.model = model
        key = _checked_key(api_key if api_key is not None else os.environ.get("OPENAI_API_KEY"))
        self._headers = {"Authorization": f"Bearer {key}"} if key else {}
        # The forms a server or a library may quote the key in; the longest first, as one contains another.
        forms = {key, json.dumps(key)[1:-1], urllib.parse.quote(key, safe="")} if key else set()
        self._key_forms = sorted(forms, key=len, reverse=True)
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
        self.max_reply_bytes = max_reply_bytes
        transport = httpx.HTTPTransport()
        # httpx takes no network backend; the pool under its transport does, and ours lets a cancel
        # and the total timeout reach the socket in every phase of a call.
        transport._pool = httpcore.ConnectionPool(
            ssl_context=httpx.create_ssl_context(), keepalive_expiry=5.0, network_backend=_Backend()
        )
        self._client = httpx.Client(transport=transport, follow_redirects=False)

    def __repr__(self) -> str:
        key = "set" if self._headers else "none"
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
        params = sampling_params(params, options)
        body = self._body(messages, params, stream=False)
        scope = _Scope(cancel or Cancellation(), time.monotonic() + self.total_timeout, self.total_timeout)

        def attempt() -> CloudReply:
            response = self._send(body, scope)
            try:
                _body_kind(response)
                payload = _json(b"".join(_chunks(response, scope, self.max_reply_bytes)), "response")
            finally:
                response.close()
            text, finish = _message(payload)
            _Allowance(params.max_tokens).take(text)
            return CloudReply(text, finish, _usage(payload.get("usage")), payload.get("model") or self.model)

        try:
            return self._retrying(attempt, scope)
        except CloudError as err:
            raise self._scrubbed(err) from None

    def stream(
        self,
        messages: Sequence[Mapping[str, Any]],
        params: SamplingParams | None = None,
        *,
        cancel: Cancellation | None = None,
        **options: Any,
    ) -> CloudStream:
        """Text chunks as the server sends them (SSE). Raises ``CloudError`` while iterating."""
        params = sampling_params(params, options)
        return CloudStream(self, self._body(messages, params, stream=True), cancel or Cancellation())

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

    def _send(self, body: dict[str, Any], scope: _Scope) -> httpx.Response:
        """One POST; a 200 response is returned open (its body not read yet), anything else raised."""
        # The sockets wait no longer than the call has left (see _Backend).
        timeout = httpx.Timeout(self.read_timeout, connect=self.connect_timeout)
        request = self._client.build_request("POST", self.url, json=body, headers=self._headers, timeout=timeout)
        scope.call.check()
        try:
            with scope.active():
                response = self._client.send(request, stream=True)
        except httpx.HTTPError as exc:
            raise _transport_error(exc) from None
        if response.status_code == 200:
            return response
        start = bytearray()
        try:
            for chunk in _chunks(response, scope, sys.maxsize):
                start += chunk
                if len(start) >= ERROR_BODY_BYTES:
                    break
        finally:
            response.close()
        raise _status_error(response, bytes(start[:ERROR_BODY_BYTES]), self._scrub)

    def _retrying(self, attempt: Callable[[], Any], scope: _Scope, *, done: bool = True) -> Any:
        """Run ``attempt`` until it succeeds or fails for good. ``done``: its success ends the call
        (a stream's first text does not: the breaker hears of the stream's end)."""
        call = scope.call
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
                wait = self._wait_before_retry(err, tries, scope.deadline)
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

    def _scrub(self, text: str) -> str:
        for form in self._key_forms:
            text = text.replace(form, "[redacted]")
        return text

    def _scrubbed(self, err: CloudError) -> CloudError:
        return CloudError(self._scrub(str(err)), err.kind, err.status, err.retry_after)


class CloudStream(Iterator[str]):
    """The text of one streamed cloud answer. ``usage`` and ``finish_reason`` are set at its end.

    ``abort()`` may be called from any thread: it cuts the connection, so the server stops
    generating, and the iteration raises ``CloudError`` of kind ``cancelled``.
    """

    def __init__(self, cloud: CloudModel, body: dict[str, Any], call: Cancellation) -> None:
        self._cloud = cloud
        self._call = call
        self._allowance = _Allowance(body["max_tokens"])
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
            raise self._cloud._scrubbed(err) from None

    def abort(self) -> None:
        self._call.cancel()

    def close(self) -> None:
        self._chunks.close()

    def _run(self, body: dict[str, Any]) -> Generator[str, None, None]:
        cloud, call = self._cloud, self._call
        scope = _Scope(call, time.monotonic() + cloud.total_timeout, cloud.total_timeout)

        def until_first_text() -> tuple[httpx.Response, Iterator[dict[str, Any]], str | None]:
            response = cloud._send(body, scope)
            try:
                chunks = _chunks(response, scope, cloud.max_reply_bytes)
                if _body_kind(response) == "json":  # a server that ignored "stream": one answer, not events
                    events = _whole(_json(b"".join(chunks), "response"))
                else:
                    events = _events(_lines(chunks), cloud._scrub)
                for event in events:
                    text = self._take(event)
                    if text:
                        return response, events, text
            except BaseException:
                response.close()
                raise
            return response, events, None

        response, events, first = cloud._retrying(until_first_text, scope, done=False)
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
        return self._allowance.take(text)


class _Allowance:
    """The text a reply may hold for ``max_tokens`` tokens: a reply past it is not going to end."""

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self.max_pieces = PIECES_PER_TOKEN * max_tokens + PIECE_SLACK
        self.max_chars = CHARS_PER_TOKEN * max_tokens
        self.pieces = self.chars = 0

    def take(self, text: str) -> str:
        if not text:
            return text
        self.pieces += 1
        self.chars += len(text)
        if self.pieces > self.max_pieces:
            raise CloudError(
                f"the cloud sent more than {self.max_pieces} pieces of text for max_tokens={self.max_tokens}: "
                "its stream does not end",
                "protocol",
            )
        if self.chars > self.max_chars:
            raise CloudError(
                f"the cloud sent more than {self.max_chars} characters for "
                f"max_tokens={self.max_tokens}, more than that many tokens hold",
                "protocol",
            )
        return text


class Cancellation:
    """Stops cloud calls from any thread: ``cancel()`` ends their retries and shuts down the sockets
    they are using, so they stop at once in any phase and the server stops generating. Pass one as
    ``cancel=`` to ``complete`` or ``stream``; one may serve several calls."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self._sockets: set[socket.socket] = set()
        self._lock = threading.Lock()

    @property
    def cancelled(self) -> bool:
        return self._event.is_set()

    def cancel(self) -> None:
        self._event.set()
        with self._lock:
            sockets = list(self._sockets)
        for sock in sockets:
            # Shutting a socket down wakes an operation blocked on it in another thread at once;
            # closing it does not. The plain socket's method: an SSLSocket's own one drops its SSL
            # state under the reading thread.
            with contextlib.suppress(OSError):
                socket.socket.shutdown(sock, socket.SHUT_RDWR)

    def check(self) -> None:
        if self.cancelled:
            raise CloudError("the call was cancelled", "cancelled")

    def sleep(self, seconds: float) -> bool:
        """Sleep; True if cancelled meanwhile."""
        return self._event.wait(seconds)

    @contextlib.contextmanager
    def watching(self, sock: socket.socket) -> Iterator[bool]:
        """While inside, ``cancel`` shuts ``sock`` down; yields whether the call is cancelled already.

        A cancel either finds ``sock`` here, or came before the check: no window lets one through.
        """
        with self._lock:
            self._sockets.add(sock)
        try:
            yield self.cancelled
        finally:
            with self._lock:
                self._sockets.discard(sock)


@dataclass(frozen=True)
class _Scope:
    """One call's cancellation and deadline, for the socket operations made on its behalf."""

    call: Cancellation
    deadline: float
    total_timeout: float

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Make this the call the calling thread's socket operations serve (see _Backend)."""
        token = _ACTIVE.set(self)
        try:
            yield
        finally:
            _ACTIVE.reset(token)


# httpx and httpcore do not pass the call down to the sockets, so it travels beside them.
_ACTIVE: contextvars.ContextVar[_Scope | None] = contextvars.ContextVar("edgeinfer_cloud_call", default=None)


@contextlib.contextmanager
def _socket_op(
    sock: socket.socket, timeout: float | None, timed_out: type[Exception], failed: type[Exception]
) -> Iterator[float | None]:
    """One blocking operation on ``sock``, for the active call: within its deadline, and stopped by its cancel.

    Yields the timeout to set; turns socket errors into httpcore's, which httpx maps to its own.
    """
    scope = _ACTIVE.get()
    if scope is None:
        with _mapped(timed_out, failed, "timed out"):
            yield timeout
        return
    left = scope.deadline - time.monotonic()
    past_total = f"the call ran past its total timeout of {scope.total_timeout:g} s"
    if left <= 0:
        raise timed_out(past_total)
    wait = left if timeout is None else min(timeout, left)
    message = past_total if wait == left else "timed out"
    with scope.call.watching(sock) as cancelled, _mapped(timed_out, failed, message):
        if cancelled:
            raise failed("the call was cancelled")
        yield wait


@contextlib.contextmanager
def _mapped(timed_out: type[Exception], failed: type[Exception], timeout_message: str) -> Iterator[None]:
    try:
        yield
    except TimeoutError:
        raise timed_out(timeout_message) from None
    except OSError as exc:
        raise failed(str(exc) or type(exc).__name__) from None


class _Stream(httpcore.NetworkStream):
    """A TCP (or TLS) connection whose operations go through ``_socket_op``."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        with _socket_op(self._sock, timeout, httpcore.ReadTimeout, httpcore.ReadError) as wait:
            self._sock.settimeout(wait)
            return self._sock.recv(max_bytes)

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        while buffer:
            with _socket_op(self._sock, timeout, httpcore.WriteTimeout, httpcore.WriteError) as wait:
                self._sock.settimeout(wait)
                buffer = buffer[self._sock.send(buffer) :]

    def close(self) -> None:
        self._sock.close()

    def start_tls(
        self, ssl_context: Any, server_hostname: str | None = None, timeout: float | None = None
    ) -> httpcore.NetworkStream:
        try:
            with _socket_op(self._sock, timeout, httpcore.ConnectTimeout, httpcore.ConnectError) as wait:
                self._sock.settimeout(wait)
                return _Stream(ssl_context.wrap_socket(self._sock, server_hostname=server_hostname))
        except BaseException:
            self.close()
            raise

    def get_extra_info(self, info: str) -> Any:
        if info == "socket":
            return self._sock
        if info == "is_readable":  # how the pool tells a kept-alive connection the server has closed
            return bool(select.select([self._sock], [], [], 0)[0])
        return None


class _Backend(httpcore.NetworkBackend):
    """httpcore's TCP connections, opened and used through ``_socket_op``.

    A connect is cancellable as a read is: shutting a connecting socket down ends the connect.
    """

    def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Any = None,
    ) -> httpcore.NetworkStream:
        failure: Exception = httpcore.ConnectError(f"{host} has no address")
        with _mapped(httpcore.ConnectTimeout, httpcore.ConnectError, "timed out"):
            addresses = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        for family, kind, proto, _, address in addresses:
            sock = socket.socket(family, kind, proto)
            try:
                for option in socket_options or ():
                    sock.setsockopt(*option)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                with _socket_op(sock, timeout, httpcore.ConnectTimeout, httpcore.ConnectError) as wait:
                    if local_address is not None:
                        sock.bind((local_address, 0))
                    sock.settimeout(wait)
                    sock.connect(address)
                return _Stream(sock)
            except httpcore.ConnectError as exc:  # try the host's next address
                sock.close()
                failure = exc
            except BaseException:
                sock.close()
                raise
        raise failure


def _chunks(response: httpx.Response, scope: _Scope, limit: int) -> Iterator[bytes]:
    """The body's bytes as they arrive, read for ``scope``'s call; more than ``limit`` in all is an error."""
    received = 0
    chunks = response.iter_bytes()
    while True:
        try:
            with scope.active():
                chunk = next(chunks, None)
        except httpx.HTTPError as exc:
            raise _transport_error(exc) from None
        if chunk is None:
            return
        received += len(chunk)
        if received > limit:
            raise CloudError(f"the cloud's reply is longer than {limit} bytes (max_reply_bytes)", "protocol")
        yield chunk


def _lines(chunks: Iterator[bytes]) -> Iterator[bytes]:
    """The lines of an event stream (ended by CRLF, LF or CR), none longer than MAX_LINE_BYTES."""
    buffer = bytearray()
    for chunk in chunks:
        buffer += chunk
        start = 0
        while (end := _LINE_END.search(buffer, start)) is not None:
            if end.group() == b"\r" and end.end() == len(buffer):  # perhaps half of a CRLF
                break
            if end.start() - start > MAX_LINE_BYTES:
                break
            yield bytes(buffer[start : end.start()])
            start = end.end()
        del buffer[:start]
        if len(buffer) > MAX_LINE_BYTES:
            raise CloudError(
                f"the cloud sent a line longer than {MAX_LINE_BYTES} bytes: not an event stream", "protocol"
            )


def _events(lines: Iterator[bytes], scrub: Callable[[str], str]) -> Iterator[dict[str, Any]]:
    """The JSON events of a server-sent-event stream, up to ``data: [DONE]``."""
    data: list[str] = []
    size = 0
    name = ""
    for raw in lines:
        line = raw.decode("utf-8", "replace")
        if line.startswith(":"):  # an SSE comment, such as a keep-alive
            continue
        if line:
            field, _, value = line.partition(":")
            value = value[1:] if value.startswith(" ") else value
            if field == "data":
                size += len(raw)
                if size > MAX_EVENT_BYTES:
                    raise CloudError(f"the cloud sent a stream event longer than {MAX_EVENT_BYTES} bytes", "protocol")
                data.append(value)
            elif field == "event":
                name = value
            continue
        if not data:
            continue
        payload, data, size = "\n".join(data), [], 0
        if payload.strip() == "[DONE]":
            return
        event = _json(payload, "stream event")
        if name == "error" or "error" in event:
            raise _event_error(event, scrub)
        name = ""
        yield event
    raise CloudError("the cloud's stream ended before data: [DONE]: the connection was cut", "connection")


def _body_kind(response: httpx.Response) -> Literal["json", "events"]:
    """What a 200 response holds, from its Content-Type: a web page is the wrong URL, not a cut connection."""
    kind = response.headers.get("content-type", "").partition(";")[0].strip().lower()
    if kind == "application/json":
        return "json"
    if kind in ("text/event-stream", ""):
        return "events"
    raise CloudError(
        f"the cloud answered {kind}, not an event stream or JSON: check the cloud URL (--cloud-url)", "protocol"
    )


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


def _whole(payload: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """A non-streamed completion as the one stream event it would have been."""
    text, finish = _message(payload)
    yield {"choices": [{"delta": {"content": text}, "finish_reason": finish}], "model": payload.get("model")}
    if payload.get("usage"):
        yield {"choices": [], "usage": payload["usage"]}


def _json(raw: bytes | str, what: str) -> dict[str, Any]:
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
        return CloudError(f"the cloud did not answer in time ({type(exc).__name__}: {_short(str(exc))})", "timeout")
    return CloudError(f"the connection to the cloud failed: {type(exc).__name__}: {_short(str(exc))}", "connection")


def _status_error(response: httpx.Response, body: bytes, scrub: Callable[[str], str]) -> CloudError:
    status = response.status_code
    message, code = _error_detail(body, scrub)
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


def _error_detail(body: bytes, scrub: Callable[[str], str]) -> tuple[str, str]:
    """The server's error message (scrubbed before it is shortened, so no part of the key is left) and
    its code/type, from an OpenAI-style error body if there is one."""
    try:
        error = json.loads(body).get("error")
    except (ValueError, AttributeError, UnicodeDecodeError):
        return _short(scrub(body.decode("utf-8", "replace"))), ""
    if isinstance(error, dict):
        code = f"{error.get('code') or ''} {error.get('type') or ''}".lower()
        return _short(scrub(str(error.get("message") or ""))), code
    return _short(scrub(str(error or ""))), ""


def _event_error(event: dict[str, Any], scrub: Callable[[str], str]) -> CloudError:
    error = event.get("error")
    message = error.get("message") if isinstance(error, dict) else error
    return CloudError(f"the cloud reported an error mid-stream: {_short(scrub(str(message or event)))}", "server")


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


def _checked_key(raw: str | None) -> str | None:
    """The API key as the header will carry it, without the whitespace a paste leaves around it."""
    key = (raw or "").strip()
    if any(not " " <= c <= "~" for c in key):
        raise InvalidOptionError(
            "the API key (api_key= or OPENAI_API_KEY) has a control or non-ASCII character in it: set it again"
        )
    return key or None


def _endpoint(url: str) -> str:
    url = url.rstrip("/")
    if url.endswith("/chat/completions"):
        return url
    return url + ("/chat/completions" if url.endswith("/v1") else "/v1/chat/completions")


def _short(text: str, limit: int = 200) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"
