"""The OpenAI-compatible ASGI app (Starlette) in front of one ``Engine``, or a ``Router`` and its cloud model.

Requests take one of ``parallel`` slots; the engine decodes every slot's answer in one backend step
(continuous batching), and shares a cached prompt prefix's KV between them. A request that finds every slot
taken waits in a queue of ``max_queue``; past that it is refused (429, with ``Retry-After``). The model loads
in the background: until it has, ``/health`` says ``loading`` and completions are refused (503).

Errors are OpenAI's error objects, each with a message that names the problem and the fix. The API key is
compared in constant time and never written anywhere.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import anyio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from edgeinfer.assemble import Answerer, close_answerer
from edgeinfer.engine import Engine
from edgeinfer.errors import ContextFull, EdgeInferError, InvalidOptionError
from edgeinfer.serve.metrics import CONTENT_TYPE, ServerMetrics
from edgeinfer.serve.protocol import (
    APIError,
    CompletionRequest,
    chunk_body,
    parse_request,
    response_body,
    usage_chunk,
)
from edgeinfer.streams import AsyncStream, Result

log = logging.getLogger("edgeinfer.serve")

LOADING, OK, BUSY = "loading", "ok", "busy"


@dataclass(frozen=True)
class ServeConfig:
    """How the server takes requests (the engine's own options are the loader's)."""

    model_id: str  # what /v1/models lists and responses name
    parallel: int = 4  # requests decoding at once
    max_queue: int = 16  # requests waiting for a slot, beyond which a request gets 429
    max_body_bytes: int = 1 << 20
    api_key: str | None = None

    def __post_init__(self) -> None:
        if self.parallel < 1 or self.max_queue < 0 or self.max_body_bytes < 1:
            raise InvalidOptionError(
                f"--parallel must be at least 1, --max-queue at least 0 and --max-body positive; got {self.parallel}, "
                f"{self.max_queue} and {self.max_body_bytes}"
            )


class _Slots:
    """``parallel`` slots and the bounded queue in front of them (one event loop's; no lock needed)."""

    def __init__(self, parallel: int, max_queue: int) -> None:
        self.parallel, self.max_queue = parallel, max_queue
        self._free = asyncio.Semaphore(parallel)
        self.queued = 0
        self.running = 0
        self._service_s = 1.0  # a running mean of how long a request holds its slot, for Retry-After

    def retry_after(self) -> int:
        """Seconds until a slot is likely free for a request that joins the queue's end now."""
        return max(1, math.ceil(self._service_s * (self.queued + 1) / self.parallel))

    async def take(self) -> _Slot:
        """A slot, once one is free. Refuses (429) when the queue is full."""
        if self.running >= self.parallel and self.queued >= self.max_queue:
            raise APIError(
                429,
                f"the server is busy: {self.running} requests running and {self.queued} queued; retry later",
                kind="rate_limit_error",
                code="server_busy",
                headers={"Retry-After": str(self.retry_after())},
            )
        start = time.monotonic()
        self.queued += 1
        try:
            await self._free.acquire()
        finally:
            self.queued -= 1
        self.running += 1
        return _Slot(self, time.monotonic() - start)

    def _give_back(self, held_s: float) -> None:
        self.running -= 1
        self._free.release()
        self._service_s += (held_s - self._service_s) / 8


class _Slot:
    """One request's slot; ``release`` is synchronous and idempotent, so no path (a cancelled task included)
    can keep it."""

    def __init__(self, slots: _Slots, waited_s: float) -> None:
        self._slots, self.waited_s, self._taken = slots, waited_s, time.monotonic()
        self._held = True

    def release(self) -> None:
        if self._held:
            self._held = False
            self._slots._give_back(time.monotonic() - self._taken)


class _Server:
    """What the handlers share: the answerer once loaded, the slots, the counters."""

    def __init__(self, config: ServeConfig, load: Callable[[], tuple[Engine, Answerer]]) -> None:
        self.config = config
        self.load = load
        self.engine: Engine | None = None
        self.answerer: Answerer | None = None
        self.load_error: BaseException | None = None
        self.loaded = asyncio.Event()
        self.streams: set[AsyncStream] = set()  # the answers in flight
        self.stopping = False  # told to shut down: no new answers
        self.slots = _Slots(config.parallel, config.max_queue)
        self.metrics = ServerMetrics(
            queue_depth=lambda: self.slots.queued,
            running=lambda: self.slots.running,
            kv_used=lambda: self.engine.kv_used if self.engine else 0,
            kv_capacity=lambda: self.engine.capacity if self.engine else 0,
            steps=lambda: self.engine.decode_steps if self.engine else (0, 0),
        )

    def status(self) -> str:
        if self.engine is None:
            return LOADING
        return BUSY if self.slots.running >= self.config.parallel or self.stopping else OK

    def cancel_all(self) -> None:
        """Shutting down and out of time: every answer in flight ends after its current token."""
        for stream in list(self.streams):
            stream.cancel()

    def ready(self) -> tuple[Engine, Answerer]:
        if self.stopping:
            raise APIError(503, "the server is shutting down; send the request to another one",
                           kind="server_error", code="shutting_down")  # fmt: skip
        if self.engine is None or self.answerer is None:
            raise APIError(503, "the model is still loading; retry in a few seconds", kind="server_error",
                           code="loading", headers={"Retry-After": "2"})  # fmt: skip
        return self.engine, self.answerer

    def check_key(self, request: Request) -> None:
        """Refuse (401) a request without the server's API key, comparing in constant time."""
        key = self.config.api_key
        if key is None:
            return
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
            raise APIError(
                401,
                "a valid API key is required: send the header 'Authorization: Bearer KEY' with the server's --api-key",
                kind="authentication_error",
                code="invalid_api_key",
            )


def create_app(config: ServeConfig, load: Callable[[], tuple[Engine, Answerer]]) -> Starlette:
    """The app. ``load`` (run in a worker thread once the app starts) loads the engine and puts the router, if any,
    in front of it; ``app.state.server.loaded`` is set when it has returned or failed (``load_error``)."""

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        server = _Server(config, load)
        app.state.server = server
        loop = asyncio.get_running_loop()
        # Each answer's decode loop runs in a worker thread (AsyncStream): enough for every slot and its router.
        loop.set_default_executor(ThreadPoolExecutor(config.parallel * 2 + 4, thread_name_prefix="edgeinfer-serve"))
        loading = asyncio.create_task(_load(server))
        try:
            yield
        finally:
            await loading
            if server.engine is not None:
                await asyncio.to_thread(close_answerer, server.engine, server.answerer)  # type: ignore[arg-type]

    routes = [
        Route("/v1/chat/completions", _chat_completions, methods=["POST"]),
        Route("/v1/completions", _completions, methods=["POST"]),
        Route("/v1/models", _models, methods=["GET"]),
        Route("/health", _health, methods=["GET"]),
        Route("/metrics", _metrics, methods=["GET"]),
    ]
    return Starlette(
        routes=routes,
        lifespan=lifespan,
        exception_handlers={APIError: _api_error, HTTPException: _http_error, Exception: _internal_error},
    )


async def _load(server: _Server) -> None:
    try:
        server.engine, server.answerer = await asyncio.to_thread(server.load)
    except BaseException as exc:  # the CLI reports it and stops the server
        server.load_error = exc
    finally:
        server.loaded.set()


def _server(request: Request) -> _Server:
    return request.app.state.server


# -- endpoints -----------------------------------------------------------------------------------


async def _chat_completions(request: Request) -> Response:
    return await _complete(request, chat=True)


async def _completions(request: Request) -> Response:
    return await _complete(request, chat=False)


async def _models(request: Request) -> Response:
    server = _server(request)
    server.check_key(request)
    model = {"id": server.config.model_id, "object": "model", "created": 0, "owned_by": "edgeinfer"}
    return JSONResponse({"object": "list", "data": [model]})


async def _health(request: Request) -> Response:
    server = _server(request)
    status = server.status()
    body: dict[str, Any] = {"status": status, "running": server.slots.running, "queued": server.slots.queued}
    full = server.slots.queued >= server.config.max_queue and status == BUSY
    return JSONResponse(body, status_code=503 if status == LOADING or full or server.stopping else 200)


async def _metrics(request: Request) -> Response:
    server = _server(request)
    server.check_key(request)
    return Response(server.metrics.render(), media_type=CONTENT_TYPE)


async def _complete(request: Request, *, chat: bool) -> Response:
    server = _server(request)
    endpoint = "chat" if chat else "completions"
    try:
        server.check_key(request)
        parsed = parse_request(await _body(request, server.config.max_body_bytes), chat=chat)
        engine, answerer = server.ready()
        response = await _answer(server, request, parsed, engine, answerer)
    except APIError as exc:
        server.metrics.requests.labels(endpoint, str(exc.status)).inc()
        raise
    server.metrics.requests.labels(endpoint, str(response.status_code)).inc()
    return response


async def _body(request: Request, limit: int) -> bytes:
    """The request's body, refused (413) past ``limit`` bytes before more of it is read."""
    too_large = APIError(
        413, f"the request body is over the server's limit of {limit:,} bytes (--max-body); send less",
        code="request_too_large",
    )  # fmt: skip
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large
    body = bytearray()
    try:
        async for piece in request.stream():
            body += piece
            if len(body) > limit:
                raise too_large
    except ClientDisconnect:
        raise APIError(400, "the client closed the connection before sending the whole body") from None
    return bytes(body)


async def _answer(
    server: _Server, request: Request, parsed: CompletionRequest, engine: Engine, answerer: Answerer
) -> Response:
    """Take a slot, start the answer, and hand it back whole or as server-sent events."""
    slot = await server.slots.take()
    stream: AsyncStream | None = None
    try:
        if server.stopping:  # it waited for its slot through the start of a shutdown
            raise _shut_down()
        # Raw text is continued by the local model: the cloud's chat API has no such call.
        stream = (
            answerer.astream(parsed.messages, parsed.params)
            if parsed.chat
            else engine.astream(parsed.prompt or "", parsed.params)
        )
        server.streams.add(stream)
        first = await _first_piece(stream)
    except BaseException:
        await _release(server, slot, stream)
        raise
    ident = f"{'chatcmpl' if parsed.chat else 'cmpl'}-{uuid.uuid4().hex}"
    created = int(time.time())
    model = server.config.model_id
    if not parsed.stream:
        try:
            result = await _finish(request, stream, first)
        finally:
            await _release(server, slot, stream)
        if result is None:  # the client hung up: nobody to answer
            return Response(status_code=499)
        if result.finish_reason == "cancelled":
            raise _shut_down()
        server.metrics.answered(result, slot.waited_s)
        return JSONResponse(response_body(parsed, result, ident, created, model))

    async def events() -> AsyncIterator[str]:
        yield _event(chunk_body(parsed, ident, created, model, text=first or "", first=True))
        result: Result | None = None
        try:
            if first is not None:
                async for piece in stream:
                    yield _event(chunk_body(parsed, ident, created, model, text=piece))
            result = stream.result
        except EdgeInferError as exc:  # headers are sent: the error is the stream's last event
            yield _event(_api_error_of(exc).body())
        except Exception:
            log.exception("an answer failed mid-stream")
            yield _event(APIError(500, "internal server error; see the server's log", kind="server_error").body())
        if result is not None and result.finish_reason == "cancelled":  # only the shutdown cancels
            yield _event(_shut_down().body())
        elif result is not None:
            server.metrics.answered(result, slot.waited_s)
            yield _event(chunk_body(parsed, ident, created, model, result=result))
            if parsed.include_usage:
                yield _event(usage_chunk(parsed, ident, created, model, result))
        yield "data: [DONE]\n\n"

    return _EventStream(events(), lambda: _release(server, slot, stream))


class _EventStream(StreamingResponse):
    """Server-sent events whose answer is cancelled, and slot freed, however the response ends: finished, the
    client gone mid-stream (within one decode step), or the task cancelled before the first event."""

    def __init__(self, events: AsyncIterator[str], release: Callable[[], Awaitable[None]]) -> None:
        super().__init__(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._release = release

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._release()


def _shut_down() -> APIError:
    return APIError(503, "the server shut down before the answer was finished; ask again", kind="server_error",
                    code="shutting_down")  # fmt: skip


async def _release(server: _Server, slot: _Slot, stream: AsyncStream | None) -> None:
    """Free the slot, then cancel the answer if it still runs and wait for its worker, shielded: a cancelled task
    (the client gone) must still get here to the end."""
    slot.release()
    if stream is not None:
        server.streams.discard(stream)
        with anyio.CancelScope(shield=True):
            await stream.aclose()


async def _first_piece(stream: AsyncStream) -> str | None:
    """The answer's first piece of text (None if it had none), or the request's error as an ``APIError``: until
    it comes, nothing is sent, so a prompt that cannot be answered is still a status code."""
    try:
        return await stream.__anext__()
    except StopAsyncIteration:
        return None
    except EdgeInferError as exc:
        raise _api_error_of(exc) from None


def _api_error_of(exc: EdgeInferError) -> APIError:
    """The OpenAI error for an engine's refusal: the request's fault (400), or the model's (500)."""
    if isinstance(exc, ContextFull):
        return APIError(400, str(exc), code="context_length_exceeded")
    if isinstance(exc, InvalidOptionError):
        return APIError(400, str(exc))
    return APIError(500, str(exc), kind="server_error")


async def _finish(request: Request, stream: AsyncStream, first: str | None) -> Result | None:
    """Read a non-streamed answer to its end; None if the client hung up meanwhile (which cancels it)."""

    async def drain() -> Result:
        if first is not None:
            async for _ in stream:
                pass
        assert stream.result is not None
        return stream.result

    async def hung_up() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    answer, watch = asyncio.create_task(drain()), asyncio.create_task(hung_up())
    try:
        await asyncio.wait({answer, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
    if not answer.done():  # gone: nobody reads the answer
        answer.cancel()
        return None
    try:
        return answer.result()
    except EdgeInferError as exc:
        raise _api_error_of(exc) from None


def _event(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


# -- errors --------------------------------------------------------------------------------------


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        message = f"there is no {request.url.path} here; see /v1/models, /v1/chat/completions, /v1/completions"
    elif exc.status_code == 405:
        message = f"{request.method} is not allowed on {request.url.path}"
    else:
        message = exc.detail
    error = APIError(exc.status_code, message, code="not_found" if exc.status_code == 404 else None)
    return JSONResponse(error.body(), status_code=exc.status_code, headers=exc.headers)


async def _internal_error(request: Request, exc: Exception) -> Response:
    # The traceback goes to the log, never a prompt's text to another client.
    log.exception("internal error on %s", request.url.path)
    error = APIError(500, f"internal server error ({type(exc).__name__}); see the server's log", kind="server_error")
    return JSONResponse(error.body(), status_code=500)
