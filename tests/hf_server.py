"""A local stand-in for the Hugging Face Hub's file endpoint, enough for ``hf_hub_download``.

It serves ``HEAD`` and ``GET`` on ``/{org}/{repo}/resolve/{revision}/{path}`` with the headers
huggingface_hub 2.x reads (``X-Repo-Commit``, ``ETag``, ``Content-Length``), honours ``Range`` so a
dropped download can resume, and answers unknown repos and files with the Hub's error codes.
Every request is recorded, so a test can tell whether the network was touched at all.

Point a fresh process at it with ``HF_ENDPOINT=hub.url``: huggingface_hub reads the endpoint
when it is imported.
"""

from __future__ import annotations

import hashlib
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote

COMMIT = "0123456789abcdef0123456789abcdef01234567"
_RESOLVE = re.compile(r"/(?P<repo_id>[^/]+/[^/]+)/resolve/[^/]+/(?P<path>.+)")
_RANGE = re.compile(r"bytes=(?P<start>\d+)-")


@dataclass(frozen=True)
class Request:
    method: str
    path: str
    range: str | None


@dataclass
class FakeHub:
    """Serves ``files`` ({(repo_id, path): content}) over HTTP on 127.0.0.1.

    Repos in ``gated`` refuse every file, as a gated repo does to a user without access. With
    ``drop_first_get_after=n`` the first GET of a file promises the whole file but closes the
    connection after ``n`` bytes, as a flaky network would.
    """

    files: dict[tuple[str, str], bytes]
    gated: frozenset[str] = frozenset()
    drop_first_get_after: int | None = None
    requests: list[Request] = field(default_factory=list)
    _server: ThreadingHTTPServer | None = None

    @property
    def url(self) -> str:
        assert self._server is not None, "use FakeHub as a context manager"
        return f"http://127.0.0.1:{self._server.server_port}"

    def __enter__(self) -> FakeHub:
        handler = type("Handler", (_Handler,), {"hub": self})
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=self._server.serve_forever, args=(0.05,), daemon=True).start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        assert self._server is not None
        self._server.shutdown()
        self._server.server_close()


class _Handler(BaseHTTPRequestHandler):
    hub: FakeHub

    def do_HEAD(self) -> None:
        self._serve(send_body=False)

    def do_GET(self) -> None:
        self._serve(send_body=True)

    def _serve(self, *, send_body: bool) -> None:
        hub = self.hub
        hub.requests.append(Request(self.command, self.path, self.headers.get("Range")))
        match = _RESOLVE.fullmatch(unquote(self.path.split("?")[0]))
        if match is None:
            # Anything else huggingface_hub asks for (its agent registry, say) does not exist here.
            return self._error(404, None)
        repo_id, path = match["repo_id"], match["path"]
        # Like the Hub to an anonymous client: 401, with a code that says which problem it is.
        if repo_id in hub.gated:
            return self._error(401, "GatedRepo")
        if not any(repo == repo_id for repo, _ in hub.files):
            return self._error(401, "RepoNotFound")
        content = hub.files.get((repo_id, path))
        if content is None:
            return self._error(404, "EntryNotFound", commit=True)

        start = 0
        if send_body and (wanted := _RANGE.fullmatch(self.headers.get("Range", ""))):
            start = int(wanted["start"])
        body = content[start:]
        self.send_response(206 if start else 200)
        self.send_header("Content-Length", str(len(body)))
        if start:
            self.send_header("Content-Range", f"bytes {start}-{len(content) - 1}/{len(content)}")
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("ETag", f'"{hashlib.sha256(content).hexdigest()}"')
        self.send_header("X-Repo-Commit", COMMIT)
        self.end_headers()
        if not send_body:
            return
        gets = sum(r.method == "GET" and r.path == self.path for r in hub.requests)
        if hub.drop_first_get_after is not None and gets == 1:
            body = body[: hub.drop_first_get_after]
        self.wfile.write(body)

    def _error(self, status: int, code: str | None, *, commit: bool = False) -> None:
        self.send_response(status)
        if code is not None:
            self.send_header("X-Error-Code", code)
        if commit:
            self.send_header("X-Repo-Commit", COMMIT)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:
        pass  # keep pytest's output clean
