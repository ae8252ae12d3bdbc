"""Load GGUF files in real llama.cpp, in a child process, and say how each one went.

A malformed file that gets past validation could crash llama.cpp, which would take the
test runner down with it; here a crash only ends the child. The child reports each file
before and after it tries it, so a crash or a hang names the file, and a fresh child
carries on with the rest.

Each file goes through the Engine: validation, llama.cpp's tokenizer and model load, a
short greedy generation, and every token of the vocabulary rendered to text. With
``checked=False`` the Engine skips the vocabulary and tensor checks (the GGUF reader's and
the hyper-parameter checks still run), to show what llama.cpp does with what they catch.
"""

from __future__ import annotations

import os
import select
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parent.parent

# Text with ASCII, accents, CJK, an emoji and a ChatML marker, to reach the byte fallbacks.
_CHILD = """
import os, sys
report = os.fdopen(os.dup(1), "w", buffering=1)
os.dup2(2, 1)  # what native code prints, a crash report included, goes to the log, not the report
import edgeinfer.engine
from edgeinfer import EdgeInferError, Engine
from edgeinfer.models import arch, info
from edgeinfer.models.gguf_file import read_header
TEXT = "Hello, the wörld! 你好 🙂 <|im_start|>\\n\\t  x"
def unchecked_info(path):
    h = read_header(path)
    hparams = arch.hparams_from_metadata(h.metadata, {t.name for t in h.tensors}, h.path.name)
    return info.ModelInfo(h.path, h.path.stem, hparams, None, h.file_size, h.tensors, "")
def run(path):
    with Engine(path, kv_budget="256tok", threads=1) as engine:
        engine.generate(TEXT, max_tokens=2, temperature=0)
        for token in range(engine.tokenizer.n_vocab):
            engine.tokenizer.piece(token)
            engine.tokenizer.token_text(token)
run(sys.argv[1])  # a valid file first: the native-build probe runs once, on it
if sys.argv[3] == "unchecked":
    edgeinfer.engine.load_model_info = unchecked_info
print("ready", file=report)
for i, path in enumerate(open(sys.argv[2]).read().splitlines()):
    print(f"start {i}", file=report)
    try:
        run(path)
        print(f"ok {i}", file=report)
    except EdgeInferError as exc:
        print(f"refused {i} {type(exc).__name__}: {exc}".replace("\\n", " "), file=report)
"""


@dataclass(frozen=True)
class NativeOutcome:
    """How one file went: ``ok``, ``refused`` (a clean EdgeInferError), ``crashed`` or ``hung``."""

    path: Path
    status: str
    detail: str = ""


def load_in_llamacpp(
    paths: list[Path], valid: Path, *, timeout_s: float = 20.0, checked: bool = True
) -> list[NativeOutcome]:
    """Try each file in a child process; a crash or hang is recorded and a new child resumes after it.

    ``valid`` is a file known to load, used once per child to run the native-build probe.
    """
    outcomes: list[NativeOutcome] = []
    while len(outcomes) < len(paths):
        outcomes += _run_child(paths[len(outcomes) :], valid, timeout_s, checked)
    return outcomes


def _run_child(paths: list[Path], valid: Path, timeout_s: float, checked: bool) -> list[NativeOutcome]:
    # No gdb backtrace from ggml on an abort: it takes seconds and says nothing the file name does not.
    pythonpath = os.pathsep.join(filter(None, [str(CHECKOUT), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, PYTHONPATH=pythonpath, GGML_NO_BACKTRACE="1")
    with tempfile.TemporaryDirectory() as tmp:
        listing, stderr_path = Path(tmp) / "paths.txt", Path(tmp) / "stderr.txt"
        listing.write_text("".join(f"{p}\n" for p in paths))
        with stderr_path.open("wb") as stderr:
            child = subprocess.Popen(
                [sys.executable, "-c", _CHILD, str(valid), str(listing), "checked" if checked else "unchecked"],
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=stderr, env=env, cwd=CHECKOUT,
            )  # fmt: skip
        try:
            return _collect(child, paths, valid, timeout_s, stderr_path)
        finally:
            if child.poll() is None:
                child.kill()
            child.wait()
            if child.stdout:
                child.stdout.close()


def _collect(
    child: subprocess.Popen[bytes], paths: list[Path], valid: Path, timeout_s: float, stderr: Path
) -> list[NativeOutcome]:
    assert child.stdout
    lines = _Lines(child.stdout.fileno())
    if lines.next(timeout_s * 3) != "ready":
        raise RuntimeError(f"the llama.cpp child failed on the valid file {valid}: {_tail(stderr)}")
    outcomes: list[NativeOutcome] = []
    for i, path in enumerate(paths):
        started, finished = lines.next(timeout_s), lines.next(timeout_s)
        if finished is None:
            hung = lines.timed_out
            child.kill()
            child.wait()
            detail = f"no answer in {timeout_s} s" if hung else f"exit status {child.returncode}: {_tail(stderr)}"
            return outcomes + [NativeOutcome(path, "hung" if hung else "crashed", detail)]
        assert started == f"start {i}", started
        status, _, detail = finished.partition(" ")
        outcomes.append(NativeOutcome(path, status, detail.partition(" ")[2]))
    return outcomes


def _tail(path: Path) -> str:
    lines = path.read_text("utf-8", "replace").strip().splitlines()
    return " | ".join(lines[-3:])


class _Lines:
    """Lines from a pipe, each with a deadline (a blocking readline could wait forever on a hung child)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.buffer = b""
        self.timed_out = False

    def next(self, timeout_s: float) -> str | None:
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self.buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.fd], [], [], left)[0]:
                self.timed_out = True
                return None
            chunk = os.read(self.fd, 65536)
            if not chunk:  # the child is gone
                return None
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        return line.decode("utf-8", "replace")
