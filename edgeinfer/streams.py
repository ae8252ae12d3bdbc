"""What a generation hands back: ``Result``, and the ``Stream`` and ``AsyncStream`` that yield its text.

The engine makes them; the router makes them too, of its own kind, with the same shape.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import weakref
from collections.abc import AsyncIterator, Callable, Generator, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

from edgeinfer.metrics import Metrics

FinishReason = Literal["stop", "length", "cancelled"]


@dataclass
class Result:
    """One finished generation.

    ``finish_reason``: ``stop`` (end-of-generation token or a stop string),
    ``length`` (``max_tokens`` reached) or ``cancelled``. ``logprobs[i]`` is the natural-log
    probability the model gave ``tokens[i]`` (before sampling filters), and ``entropies[i]`` the
    entropy in nats of the distribution it was drawn from: confidence signals for the router.
    """

    text: str
    tokens: list[int]
    finish_reason: FinishReason
    metrics: Metrics
    model: str
    backend: str
    route: str = "local"
    logprobs: list[float] = field(default_factory=list)
    entropies: list[float] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "text": self.text,
            "finish_reason": self.finish_reason,
            "model": self.model,
            "backend": self.backend,
            "route": self.route,
            "tokens": self.tokens,
            "metrics": self.metrics.to_dict(),
        }


class Stream(Iterator[str]):
    """Text chunks as they are generated; ``result`` once the iteration has ended.

    ``cancel()`` may be called from any thread: the generation stops after the
    token in progress and finishes with ``finish_reason == "cancelled"``. ``tokens`` grows as
    tokens are sampled, and so do ``logprobs`` and ``entropies`` when ``SamplingParams(logprobs=True)``
    asked for them, so a caller can judge the model's confidence mid-stream.
    """

    def __init__(
        self,
        chunks: Generator[str, None, Result],
        cancel: threading.Event,
        logprobs: list[float] | None = None,
        entropies: list[float] | None = None,
        tokens: list[int] | None = None,
    ) -> None:
        self._chunks = chunks
        self._cancel = cancel
        self.logprobs: list[float] = logprobs if logprobs is not None else []
        self.entropies: list[float] = entropies if entropies is not None else []
        self.tokens: list[int] = tokens if tokens is not None else []
        self.result: Result | None = None

    def __next__(self) -> str:
        try:
            return next(self._chunks)
        except StopIteration as stop:
            if stop.value is not None:  # a finished generator raises again with no value
                self.result = stop.value
            raise

    def cancel(self) -> None:
        self._cancel.set()

    def close(self) -> None:
        """Stop now and release the engine (also what leaving a ``with`` block does)."""
        self._chunks.close()

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncStream(AsyncIterator[str]):
    """The async twin of Stream: the decode loop runs in a worker thread.

    Cancelling the consuming task, ``aclose()``, leaving ``async with``, or dropping
    the stream cancels the generation. So does leaving it unfinished (``break`` out of
    ``async for``): the generation is cancelled when the task that created the stream
    ends, or when that task starts reading another stream of the same engine. Read it from
    other tasks as you like (``wait_for(anext(stream), ...)`` included), but while its
    creator lives. A stream left unfinished while its task goes on with other work keeps its
    answer decoding, and its KV cells taken, until ``max_tokens``, as a slow reader would.
    """

    def __init__(self, stream: Stream, on_start: Callable[[AsyncStream], None] | None = None) -> None:
        self._stream = stream
        self._on_start = on_start
        self._queue: asyncio.Queue[object] | None = None
        self._worker: asyncio.Future[None] | None = None
        self.owner = _current_task()  # the task that asked for it
        self._owner_ended: Callable[[asyncio.Task[Any]], None] | None = None
        self.finished = False

    @property
    def result(self) -> Result | None:
        return self._stream.result

    async def __anext__(self) -> str:
        if self._queue is None:
            loop = asyncio.get_running_loop()
            self._queue = asyncio.Queue()
            if self._on_start is not None:
                self._on_start(self)
            if self.owner is not None:
                alive = weakref.ref(self)  # a strong one would keep a dropped stream, which cancels, alive
                self._owner_ended = lambda _: (stream := alive()) is not None and stream.cancel()
                self.owner.add_done_callback(self._owner_ended)
            self._worker = loop.run_in_executor(None, _pump, self._stream, loop, self._queue)
        try:
            item = await self._queue.get()
        except asyncio.CancelledError:
            self.cancel()
            raise
        if item is _END or isinstance(item, BaseException):
            self._finish()
            await self._worker  # type: ignore[misc]  # it has just put its last item
            if isinstance(item, BaseException):
                raise item
            raise StopAsyncIteration
        return item  # type: ignore[return-value]

    def _finish(self) -> None:
        self.finished = True
        if self.owner is not None and self._owner_ended is not None:  # a long-lived task must not collect them
            self.owner.remove_done_callback(self._owner_ended)
            self._owner_ended = None

    def cancel(self) -> None:
        self._stream.cancel()

    async def aclose(self) -> None:
        """Cancel and wait until the worker has let go of the engine."""
        self.cancel()
        if self._worker is not None:
            await self._worker

    async def __aenter__(self) -> AsyncStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def __del__(self) -> None:
        self.cancel()


_END = object()


def _current_task() -> asyncio.Task[Any] | None:
    try:
        return asyncio.current_task()
    except RuntimeError:  # no running event loop
        return None


def _pump(stream: Stream, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue[object]) -> None:
    """Worker thread: run the stream, hand chunks and then _END (or the error) to the loop.

    It holds the Stream, not the AsyncStream, so a dropped AsyncStream is collected and cancels.
    """
    last: object = _END
    try:
        for chunk in stream:
            loop.call_soon_threadsafe(queue.put_nowait, chunk)
    except BaseException as exc:  # handed to the consumer, re-raised there
        last = exc
    finally:
        stream.close()
        with contextlib.suppress(RuntimeError):  # the consumer's loop is gone; nobody is waiting
            loop.call_soon_threadsafe(queue.put_nowait, last)


def drain(stream: Stream) -> Result:
    for _ in stream:
        pass
    assert stream.result is not None
    return stream.result


async def adrain(stream: AsyncStream) -> Result:
    async with stream:
        async for _ in stream:
            pass
    assert stream.result is not None
    return stream.result
