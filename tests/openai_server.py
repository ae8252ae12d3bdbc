"""A real OpenAI-compatible chat server on 127.0.0.1 that fails on demand.

It serves ``POST /v1/chat/completions``, streamed (server-sent events in chunked transfer
encoding, ending with ``data: [DONE]``) or not, with usage. It answers a question from its
``answers`` table (an oracle: the router benchmark gives it the accepted answers) and anything
else with ``default_answer``; given a trailing assistant message, it continues that text.

Faults are queued and each is used by the next request::

    server.fail("status", status=429, retry_after=1)   # then answer normally
    server.fail("delay", seconds=1.0)                  # past the client's read timeout
    server.fail("drop", after=2)                       # cut the connection after 2 chunks
    server.fail("malformed")                           # an SSE event that is not JSON
    server.fail("invalid_json")                        # a JSON body (even when streaming was asked) that is not JSON
    server.fail("error_event", after=1)                # an {"error": ...} event mid-stream
    server.fail("slow", seconds=0.2)                   # a pause before each chunk
    server.fail("status", status=401, echo_auth=True)   # an error that quotes the Authorization header back

And hostile ones, each for at most ``duration`` seconds (then the connection is closed)::

    server.fail("silent")                              # read the request, never send headers
    server.fail("no_newline", seconds=0)               # "data: xxxx..." without a newline, a chunk every `seconds`
    server.fail("no_done", seconds=0)                  # valid text chunks, never data: [DONE]
    server.fail("huge", size=10 << 20)                 # a reply of `size` bytes (events or one JSON body)
    server.fail("html")                                # 200 with a text/html page, as a wrong URL gets

``backlog_full()`` gives a URL whose connections never complete (a listener that accepts nobody).

Every request is recorded (``requests``), and so is a client that hung up mid-stream
(``hangups``), so a test can tell that cancelling reached the server.
"""

from __future__ import annotations

import contextlib
import json
import select
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass
class Fault:
    kind: str
    status: int = 500
    retry_after: float | None = None
    code: str | None = None
    seconds: float = 0.0
    after: int = 1
    echo_auth: bool = False
    size: int = 10 << 20
    duration: float = 30.0


@dataclass
class Received:
    body: dict[str, Any]
    authorization: str | None


@dataclass
class OpenAIServer:
    answers: dict[str, str] = field(default_factory=dict)
    default_answer: str = "The cloud model says hello from far away."
    model: str = "oracle-1"
    ignore_stream: bool = False  # answer plain JSON even when events are asked for, as some servers do
    requests: list[Received] = field(default_factory=list)
    hangups: int = 0
    _faults: list[Fault] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _server: ThreadingHTTPServer | None = None

    @property
    def url(self) -> str:
        assert self._server is not None, "use OpenAIServer as a context manager"
        return f"http://127.0.0.1:{self._server.server_port}/v1"

    def fail(self, kind: str, *, times: int = 1, **options: Any) -> None:
        """Queue a fault for each of the next ``times`` requests."""
        with self._lock:
            self._faults.extend(Fault(kind, **options) for _ in range(times))

    def next_fault(self) -> Fault | None:
        with self._lock:
            return self._faults.pop(0) if self._faults else None

    def reply_to(self, messages: list[dict[str, Any]]) -> str:
        if messages and messages[-1].get("role") == "assistant":
            partial = messages[-1]["content"]
            question = next((m["content"] for m in reversed(messages) if m.get("role") == "user"), "")
            full = self.answers.get(question, self.default_answer)
            return full[len(partial) :] if full.startswith(partial) else " and that is all."
        question = messages[-1].get("content", "") if messages else ""
        return self.answers.get(question, self.default_answer)

    def __enter__(self) -> OpenAIServer:
        handler = type("Handler", (_Handler,), {"api": self})
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, args=(0.05,), daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.shutdown()
        self._server.server_close()


class _Handler(BaseHTTPRequestHandler):
    api: OpenAIServer
    protocol_version = "HTTP/1.1"

    def log_message(self, *args: object) -> None:  # keep test output clean
        pass

    def handle(self) -> None:
        with contextlib.suppress(ConnectionResetError, BrokenPipeError):  # a client gone between requests
            super().handle()

    def do_POST(self) -> None:
        try:
            self._serve()
        except (BrokenPipeError, ConnectionResetError):  # the client hung up
            self.api.hangups += 1
            self.close_connection = True

    def _serve(self) -> None:
        api = self.api
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        authorization = self.headers.get("Authorization")
        api.requests.append(Received(body, authorization))
        if not self.path.endswith("/chat/completions"):
            return self._error(404, "no such endpoint", None)
        fault = api.next_fault()
        if fault is not None and fault.kind == "delay" and self._client_left(fault.seconds):
            api.hangups += 1
            return
        if fault is not None and fault.kind == "status":
            # Echoed as servers and proxies do: as sent, and as Python shows the header's bytes.
            echo = f" for {authorization} ({str(authorization).encode()!r})" if fault.echo_auth else ""
            return self._error(fault.status, f"injected {fault.status}{echo}", fault)
        if fault is not None and fault.kind in _HOSTILE:
            return _HOSTILE[fault.kind](self, fault, body)
        words = api.reply_to(body.get("messages", [])).split(" ")
        pieces = [w + " " for w in words[:-1]] + [words[-1]]
        limit = int(body.get("max_tokens") or len(pieces))
        finish = "length" if len(pieces) > limit else "stop"
        pieces = [p for p in pieces[:limit] if p]
        usage = {
            "prompt_tokens": sum(len(str(m.get("content", "")).split()) for m in body.get("messages", [])),
            "completion_tokens": len(pieces),
        }
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        if body.get("stream") and not api.ignore_stream and not (fault is not None and fault.kind == "invalid_json"):
            self._stream(pieces, finish, usage, fault)
        else:
            self._complete("".join(pieces), finish, usage, fault)

    def _complete(self, text: str, finish: str, usage: dict[str, int], fault: Fault | None) -> None:
        if fault is not None and fault.kind == "invalid_json":
            data = b'{"choices": [{"message": {"content": "trunc'
        else:
            data = json.dumps(
                {
                    "id": "chatcmpl-test",
                    "object": "chat.completion",
                    "model": self.api.model,
                    "choices": [
                        {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}
                    ],
                    "usage": usage,
                }
            ).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _stream(self, pieces: list[str], finish: str, usage: dict[str, int], fault: Fault | None) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        kind = fault.kind if fault is not None else None
        self._event({"choices": [{"index": 0, "delta": {"role": "assistant"}, "finish_reason": None}]})
        for i, piece in enumerate(pieces):
            if fault is not None and i == fault.after:
                if kind == "drop":
                    self.wfile.flush()
                    self.connection.shutdown(2)  # no final chunk: the body ends mid-stream
                    self.close_connection = True
                    return
                if kind == "malformed":
                    self._chunk(b'data: {"choices": [{"delta": {"content": "oops"\n\n')
                if kind == "error_event":  # as servers do: an error event, then the end of the stream
                    self._event({"error": {"message": "the model is overloaded", "type": "server_error"}})
                    self._chunk(b"")
                    return
            if kind == "slow" and self._client_left(fault.seconds):  # type: ignore[union-attr]
                self.api.hangups += 1
                return
            self._event({"choices": [{"index": 0, "delta": {"content": piece}, "finish_reason": None}]})
        self._event({"choices": [{"index": 0, "delta": {}, "finish_reason": finish}]})
        if usage:
            self._event({"choices": [], "usage": usage})
        self._chunk(b"data: [DONE]\n\n")
        self._chunk(b"")

    def _silent(self, fault: Fault, body: dict[str, Any]) -> None:
        if self._client_left(fault.duration):
            self.api.hangups += 1
        self.close_connection = True

    def _no_newline(self, fault: Fault, body: dict[str, Any]) -> None:
        self._endless(fault, b"data: ", lambda: b"x" * 4096)

    def _no_done(self, fault: Fault, body: dict[str, Any]) -> None:
        event = {"id": "chatcmpl-test", "object": "chat.completion.chunk", "model": self.api.model}
        event["choices"] = [{"index": 0, "delta": {"content": "more "}, "finish_reason": None}]
        chunk = f"data: {json.dumps(event)}\n\n".encode()
        self._endless(fault, b"", lambda: chunk)

    def _endless(self, fault: Fault, first: bytes, chunk: Callable[[], bytes]) -> None:
        """Send ``first``, then ``chunk()`` every ``fault.seconds`` until the client leaves or ``duration`` is up."""
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        if first:  # an empty chunk would end the body
            self._chunk(first)
        end = time.monotonic() + fault.duration
        while time.monotonic() < end:
            if fault.seconds and self._client_left(fault.seconds):
                self.api.hangups += 1
                return
            self._chunk(chunk())  # a client gone raises BrokenPipeError: counted by do_POST
        self.connection.shutdown(socket.SHUT_RDWR)  # no final chunk: the body ends cut
        self.close_connection = True

    def _huge(self, fault: Fault, body: dict[str, Any]) -> None:
        text = "x" * fault.size
        if body.get("stream") and not self.api.ignore_stream:
            step = 1 << 16
            self._stream([text[i : i + step] for i in range(0, len(text), step)], "stop", {}, None)
        else:
            self._complete(text, "stop", {}, None)

    def _html(self, fault: Fault, body: dict[str, Any]) -> None:
        data = b"<!doctype html><html><body><h1>Welcome to nginx!</h1></body></html>"
        self.send_response(200)
        self.send_header("Content-Type", "text/html; charset=utf-8")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _client_left(self, seconds: float) -> bool:
        """Wait ``seconds``, watching the connection as a server does; True if the client hung up."""
        end = time.monotonic() + seconds
        while (left := end - time.monotonic()) > 0:
            readable, _, _ = select.select([self.connection], [], [], min(left, 0.02))
            if readable and not self.connection.recv(1, socket.MSG_PEEK):
                self.close_connection = True
                return True
        return False

    def _event(self, payload: dict[str, Any]) -> None:
        payload = {"id": "chatcmpl-test", "object": "chat.completion.chunk", "model": self.api.model, **payload}
        self._chunk(f"data: {json.dumps(payload)}\n\n".encode())

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()

    def _error(self, status: int, message: str, fault: Fault | None) -> None:
        error: dict[str, Any] = {
            "message": message,
            "type": "server_error" if status >= 500 else "invalid_request_error",
        }
        if fault is not None and fault.code:
            error["code"] = fault.code
        data = json.dumps({"error": error}).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if fault is not None and fault.retry_after is not None:
            self.send_header("Retry-After", f"{fault.retry_after:g}")
        self.end_headers()
        self.wfile.write(data)


_HOSTILE: dict[str, Callable[[_Handler, Fault, dict[str, Any]], None]] = {
    "silent": _Handler._silent,
    "no_newline": _Handler._no_newline,
    "no_done": _Handler._no_done,
    "huge": _Handler._huge,
    "html": _Handler._html,
}


@contextlib.contextmanager
def backlog_full() -> Iterator[str]:
    """A cloud URL whose connections never complete: its listener accepts nobody, and its queue is full."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    queued = []
    try:
        while True:  # fill the accept queue; the connect after the last that fits waits forever
            sock = socket.socket()
            sock.settimeout(0.2)
            try:
                sock.connect(("127.0.0.1", port))
            except TimeoutError:
                sock.close()
                break
            queued.append(sock)
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        for sock in queued:
            sock.close()
        listener.close()
