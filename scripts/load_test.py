"""Load on an OpenAI-compatible server: aggregate decode tok/s, TTFT and TPOT with concurrent streaming clients.

Target (``edgeinfer serve``'s continuous batching): aggregate decode tok/s with 4 clients >= 2x one client alone.

Each request is a streaming ``POST /v1/completions`` (temperature 0, --max-tokens new tokens) whose
prompt is exactly --prompt-tokens tokens of plain text, as edgeinfer's tokenizer counts them (the
prompt builder of ``scripts/bench_llamacpp.py``, behind a leading sentence). Every request's prompt
differs from the first word or two on, so no server can answer one client from another's KV cache.
With --shared-prefix N every prompt is instead one N-token system text followed by a short question
of its own, and a second pass sends the same lengths with a different system text each time: the
TTFT of the two passes is what a prefix cache saves.

The answers are asked to run to --max-tokens, so every server decodes the same number of tokens:
``"ignore_eos": true`` for edgeinfer (an extension field), a -100 ``logit_bias`` on every
end-of-generation token for llama_cpp.server (which takes no ``ignore_eos``; its ``min_tokens``
bans the one EOS token alone, and the model has other end-of-generation tokens). llama_cpp.server
also gets ``repeat_penalty: 1.0``: its default of 1.1 is not the plain greedy pick temperature 0
means to the other side. Completion tokens come from the usage chunk (``stream_options:
{"include_usage": true}``) where the server sends one, else from the count of text chunks (one
token a chunk, except where a character's bytes span tokens), and the report says which.

Per request: TTFT from sending it to the first non-empty text chunk; TPOT, the mean gap between
one such chunk and the next, from the first on (every gap is kept for the percentiles); the
completion tokens and the total time. Per pass: the errors by status code, aggregate decode throughput (all completion
tokens over the pass's wall time, prefills included), and P50/P99 of TTFT and of the gaps. A pass
stops issuing requests after --requests of them or --duration seconds, whichever comes first, and
waits for those in flight.

Two ways to run it:

- ``--url http://127.0.0.1:PORT/v1``: a server already running (loopback only). ``--pid`` adds its RSS.
- ``--compare``: starts ``edgeinfer serve`` and then ``python -m llama_cpp.server`` (one at a
  time, never both: they would share the cores) on free loopback ports, with the same GGUF and
  threads, and ``--parallel`` = --clients for edgeinfer (llama_cpp.server serves one request at a
  time, with ``--interrupt_requests False`` so that a waiting request does not cut the one
  streaming short); ``--only edgeinfer|llamacpp`` starts one. A server is ready when GET
  /v1/models answers 200 and GET /health anything but 503 (edgeinfer serve loads in the background).
  Each server gets one warm-up request (not counted), a 1-client pass of --baseline-requests
  (the scaling target's denominator), the --clients pass, and its RSS idle after startup and
  after the load (the process and its children). ``--url`` runs the same passes.

``--clients 1`` alone is the one-client baseline.

Reproduce (on a quiet machine; --threads at most the free physical cores):

    python scripts/load_test.py --compare --threads 2 --clients 4 --requests 16 --max-tokens 128
    python scripts/load_test.py --only llamacpp --shared-prefix 400
    python scripts/load_test.py --url http://127.0.0.1:8080/v1 --clients 4 --json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn
from urllib.parse import urlsplit

import httpx
import numpy as np
import psutil

from edgeinfer.errors import EdgeInferError
from edgeinfer.metrics import percentile
from edgeinfer.models.catalog import DEFAULT_MODEL, resolve_model
from edgeinfer.tokenizer import Tokenizer

HOST = "127.0.0.1"
LOOPBACK = {"127.0.0.1", "localhost", "::1"}
SERVERS = {"edgeinfer": "edgeinfer serve", "llamacpp": "llama_cpp.server"}
EOS_MODES = ("auto", "ignore_eos", "logit_bias", "both", "none")
SCALING_TARGET = 2.0  # aggregate decode tok/s with --clients over one client alone, for edgeinfer
BAN = -100.0  # OpenAI's floor for logit_bias; llama-cpp-python adds it to the logit, far below any other token
WARMUP_TOKENS = 8
MAX_PROMPT_TOKENS = 16384
MIB = 1024 * 1024
PROMPT_LEAD = "Entry {k} of the keeper's log. "
SYSTEM_LEAD = "You answer questions about the lighthouse keeper's log. "
QUESTION = "\nQuestion {k}: what did the keeper write on evening {k}?\nAnswer:"


class ArgumentParser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        """One line, without the usage block: every bad input is a one-line error."""
        self.exit(2, f"{self.prog}: error: {message}\n")


def fail(message: str) -> NoReturn:
    raise SystemExit(f"load_test.py: {message}")


class Counted:
    """What ``bench_llamacpp.fixed_prompt`` counts with, for the text after a lead it does not see."""

    def __init__(self, tokenizer: Tokenizer, lead: str) -> None:
        self.tokenizer, self.lead = tokenizer, lead

    def tokenize(self, text: str) -> list[int]:
        return self.tokenizer.encode(self.lead + text)


class Prompts:
    """The prompts of a run, each one different, in the order the passes take them.

    Both servers of a --compare get the same sequence: a fresh ``Prompts`` each.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_tokens: int, shared_prefix: int) -> None:
        # Imported, not copied: the one prompt builder the benchmarks share. From the script's own
        # folder, which is on sys.path only when it runs as `python scripts/load_test.py`.
        scripts = str(Path(__file__).resolve().parent)
        if scripts not in sys.path:
            sys.path.append(scripts)
        try:
            from bench_llamacpp import fixed_prompt
        except ImportError as exc:
            fail(f"cannot import scripts/bench_llamacpp.py's prompt builder: {exc}")

        self._fixed_prompt = fixed_prompt
        self.tokenizer, self.prompt_tokens, self.shared_prefix = tokenizer, prompt_tokens, shared_prefix
        self.next = 0
        self.system = (
            SYSTEM_LEAD + fixed_prompt(Counted(tokenizer, SYSTEM_LEAD), shared_prefix) if shared_prefix else ""
        )

    def take(self, count: int, shared: bool = True) -> list[str]:
        """``count`` new prompts; ``shared=False`` gives each its own system text of the same length."""
        out = [self._prompt(k, shared) for k in range(self.next, self.next + count)]
        self.next += count
        return out

    def _prompt(self, k: int, shared: bool) -> str:
        lead = PROMPT_LEAD.format(k=k)
        if not self.shared_prefix:
            text = lead + self._fixed_prompt(Counted(self.tokenizer, lead), self.prompt_tokens)
            if len(self.tokenizer.encode(text)) != self.prompt_tokens:  # the lead and the cut can merge a token
                fail(f"cannot build an exact {self.prompt_tokens}-token prompt; try another --prompt-tokens")
            return text
        system = self.system if shared else lead + self._fixed_prompt(Counted(self.tokenizer, lead), self.shared_prefix)
        return system + QUESTION.format(k=k)

    def shared_tokens(self, prompts: Sequence[str]) -> int:
        """How many leading token ids every prompt has in common: what a prefix cache can reuse."""
        ids = [self.tokenizer.encode(p) for p in prompts]
        n = min(len(i) for i in ids)
        for j in range(n):
            if any(i[j] != ids[0][j] for i in ids):
                return j
        return n


@dataclass
class Answer:
    """One request as the client saw it."""

    status: int | None = None  # None: no HTTP answer (a timeout, a refused connection)
    error: str | None = None
    ttft_s: float | None = None
    gaps_s: list[float] = field(default_factory=list)  # between non-empty text chunks after the first
    chunks: int = 0  # non-empty text chunks
    usage_tokens: int | None = None  # completion_tokens of the usage chunk, where the server sent one
    prompt_tokens: int | None = None  # as the server counted them, from the usage chunk
    finish_reason: str | None = None
    total_s: float = 0.0

    @property
    def tokens(self) -> int:
        return self.usage_tokens if self.usage_tokens is not None else self.chunks

    @property
    def tpot_s(self) -> float | None:
        return float(np.mean(self.gaps_s)) if self.gaps_s else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "status": self.status,
            "error": self.error,
            "ttft_ms": None if self.ttft_s is None else self.ttft_s * 1000,
            "tpot_ms": None if self.tpot_s is None else self.tpot_s * 1000,
            "completion_tokens": self.tokens,
            "tokens_from": "usage" if self.usage_tokens is not None else "chunks",
            "prompt_tokens_server": self.prompt_tokens,
            "finish_reason": self.finish_reason,
            "total_s": self.total_s,
        }


async def complete(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> Answer:
    """One streaming completion, timed from the moment it is sent."""
    answer = Answer()
    start = time.perf_counter()
    times: list[float] = []
    try:
        async with client.stream("POST", url, json=body) as response:
            answer.status = response.status_code
            if response.status_code != 200:
                text = (await response.aread()).decode("utf-8", "replace")
                answer.error = f"HTTP {response.status_code}: {' '.join(text.split())[:200]}"
                return answer
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue  # blank separators, and ": ping" comments
                data = line[len("data:") :].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    answer.error = f"error in the stream: {str(chunk['error'])[:200]}"
                    break
                for choice in chunk.get("choices") or []:
                    if choice.get("text"):
                        times.append(time.perf_counter())
                    answer.finish_reason = choice.get("finish_reason") or answer.finish_reason
                usage = chunk.get("usage")
                if usage:
                    answer.usage_tokens = usage.get("completion_tokens")
                    answer.prompt_tokens = usage.get("prompt_tokens")
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        answer.error = f"{type(exc).__name__}: {str(exc)[:200]}"
    finally:
        answer.total_s = time.perf_counter() - start
    answer.chunks = len(times)
    if times:
        answer.ttft_s = times[0] - start
        answer.gaps_s = [b - a for a, b in zip(times, times[1:], strict=False)]
    if answer.error is None and not times:
        answer.error = "no text in the answer"
    return answer


@dataclass(frozen=True)
class Target:
    """Where the requests go and what each one carries besides its prompt."""

    base_url: str  # ending in /v1
    body: dict[str, Any]  # model, sampling, EOS suppression, extra fields
    headers: dict[str, str]
    request_timeout_s: float

    def client(self, clients: int) -> httpx.AsyncClient:
        # The read timeout is per chunk: a server that queues requests sends nothing until one's turn.
        timeout = httpx.Timeout(self.request_timeout_s, connect=10.0)
        limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
        return httpx.AsyncClient(timeout=timeout, limits=limits, headers=self.headers)

    def request(self, prompt: str, max_tokens: int) -> dict[str, Any]:
        return {**self.body, "prompt": prompt, "max_tokens": max_tokens}


async def run_pass(
    target: Target, prompts: list[str], clients: int, max_tokens: int, duration_s: float
) -> dict[str, Any]:
    """``clients`` clients, each sending its next request when its last one is done, until the
    prompts run out or ``duration_s`` has passed."""
    url = target.base_url + "/completions"
    answers: list[Answer] = []
    queue = iter(prompts)
    async with target.client(clients) as client:
        start = time.perf_counter()
        deadline = start + duration_s

        async def one_client() -> None:
            for prompt in queue:  # shared by every client: each request is taken once
                answers.append(await complete(client, url, target.request(prompt, max_tokens)))
                if time.perf_counter() >= deadline:
                    return

        await asyncio.gather(*(one_client() for _ in range(clients)))
        wall_s = time.perf_counter() - start
    return summary(answers, clients, wall_s, max_tokens)


def summary(answers: list[Answer], clients: int, wall_s: float, max_tokens: int) -> dict[str, Any]:
    ok = [a for a in answers if a.error is None]
    # By status code; without one (a timeout, a broken stream), by the error's kind.
    errors = Counter(
        str(a.status) if a.status not in (None, 200) else str(a.error).split(":")[0] for a in answers if a.error
    )
    ttft = [a.ttft_s * 1000 for a in ok if a.ttft_s is not None]
    gaps = [g * 1000 for a in ok for g in a.gaps_s]
    tokens = sum(a.tokens for a in ok)
    sources = {"usage" if a.usage_tokens is not None else "chunks" for a in ok}
    server_prompt = [a.prompt_tokens for a in ok if a.prompt_tokens is not None]
    return {
        "clients": clients,
        "requests": len(answers),
        "ok": len(ok),
        "errors": dict(errors),
        "first_error": next((a.error for a in answers if a.error), None),
        "completion_tokens": tokens,
        "tokens_from": sources.pop() if len(sources) == 1 else "mixed" if sources else None,
        "short_answers": sum(a.tokens < max_tokens for a in ok),
        "wall_s": wall_s,
        "aggregate_tok_s": tokens / wall_s if wall_s > 0 else 0.0,
        "ttft_ms_p50": percentile(ttft, 50),
        "ttft_ms_p99": percentile(ttft, 99),
        "tpot_ms_p50": percentile(gaps, 50),
        "tpot_ms_p99": percentile(gaps, 99),
        "tpot_ms_mean": float(np.mean(gaps)) if gaps else 0.0,
        "total_s_p50": percentile([a.total_s for a in ok], 50),
        "prompt_tokens_server": [min(server_prompt), max(server_prompt)] if server_prompt else None,
        "answers": [a.to_dict() for a in answers],
    }


def rss_mib(pid: int) -> float | None:
    """Resident memory of the process and all its children, in MiB; None once it has gone."""
    try:
        proc = psutil.Process(pid)
        procs = [proc, *proc.children(recursive=True)]
    except psutil.NoSuchProcess:
        return None
    total = 0
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            total += p.memory_info().rss
    return total / MIB


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


class Server:
    """A server this script starts, in its own process group, with its output in a log file."""

    def __init__(self, kind: str, command: list[str], port: int) -> None:
        self.kind, self.command, self.port = kind, command, port
        self.base_url = f"http://{HOST}:{port}/v1"
        self.log = tempfile.NamedTemporaryFile(prefix=f"load_test-{kind}-", suffix=".log", delete=False)  # noqa: SIM115
        # Its own session: SIGTERM reaches the server's children (uvicorn workers), never this script.
        self.proc = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self, timeout_s: float, headers: dict[str, str]) -> str:
        """Poll GET /v1/models until it answers 200, then GET /health until it stops answering 503;
        the first model id listed.

        edgeinfer serve lists its model while it still loads it in the background, and says so on
        /health; llama_cpp.server loads before it listens, and has no /health (404).
        """
        deadline = time.monotonic() + timeout_s
        model: str | None = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                fail(f"{SERVERS[self.kind]} exited with status {self.proc.returncode} before it was ready; "
                     f"its log: {self.log.name}")  # fmt: skip
            with contextlib.suppress(httpx.HTTPError):
                if model is None:
                    response = httpx.get(self.base_url + "/models", headers=headers, timeout=5.0)
                    model = first_model(response) if response.status_code == 200 else None
                if model is not None:
                    health = httpx.get(f"http://{HOST}:{self.port}/health", headers=headers, timeout=5.0)
                    if health.status_code != 503:
                        return model
            time.sleep(0.5)
        fail(f"{SERVERS[self.kind]} was not ready after {timeout_s:g} s; its log: {self.log.name}")

    def stop(self, timeout_s: float) -> None:
        """SIGTERM to the group, then SIGKILL if it has not gone after ``timeout_s``."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()


def first_model(response: httpx.Response) -> str:
    """The first id of a /v1/models answer; "" where it lists none."""
    try:
        return str(response.json()["data"][0]["id"])
    except (ValueError, KeyError, IndexError, TypeError):
        return ""  # a server that lists nothing may still take any model name


def server_command(kind: str, gguf: Path, threads: int, parallel: int, n_ctx: int, port: int) -> list[str]:
    if kind == "edgeinfer":
        return [
            sys.executable, "-m", "edgeinfer", "serve", "--model", str(gguf), "--threads", str(threads),
            "--parallel", str(parallel), "--host", HOST, "--port", str(port),
        ]  # fmt: skip
    # interrupt_requests (default True) ends the stream in progress whenever another request waits:
    # with concurrent clients every answer would stop after a token or two.
    return [
        sys.executable, "-m", "llama_cpp.server", "--model", str(gguf), "--n_threads", str(threads),
        "--n_threads_batch", str(threads), "--n_ctx", str(n_ctx), "--host", HOST, "--port", str(port),
        "--interrupt_requests", "False",
    ]  # fmt: skip


def request_body(kind: str, model: str, eos: str, eog_ids: list[int], extra: dict[str, Any]) -> dict[str, Any]:
    """Everything a request carries but its prompt and max_tokens, for a server of ``kind``."""
    if eos == "auto":
        eos = {"edgeinfer": "ignore_eos", "llamacpp": "logit_bias"}.get(kind, "both")
    body: dict[str, Any] = {"model": model, "temperature": 0.0, "stream": True,
                            "stream_options": {"include_usage": True}}  # fmt: skip
    if eos in ("ignore_eos", "both"):
        body["ignore_eos"] = True
    if eos in ("logit_bias", "both"):
        body["logit_bias"] = {str(t): BAN for t in eog_ids}
    if kind == "llamacpp":
        body["repeat_penalty"] = 1.0
    return {**body, **extra}


@dataclass
class Settings:
    gguf: Path
    threads: int
    clients: int
    requests: int
    baseline_requests: int
    duration_s: float
    max_tokens: int
    prompt_tokens: int
    shared_prefix: int
    eos: str
    extra: dict[str, Any]
    headers: dict[str, str]
    request_timeout_s: float
    server_args: dict[str, list[str]]  # more command-line options for each server this script starts
    ready_timeout_s: float
    stop_timeout_s: float


def passes(target: Target, settings: Settings, prompts: Prompts) -> dict[str, Any]:
    """The warm-up, the 1-client baseline, the load, and with --shared-prefix the load without one."""
    s = settings
    # Not the shared system text: a prefix cache primed by the warm-up would serve the load's first request.
    warmup_prompt = prompts.take(1, shared=False)
    deadline = time.monotonic() + s.ready_timeout_s
    while True:
        warmup = asyncio.run(run_pass(target, warmup_prompt, 1, WARMUP_TOKENS, s.duration_s))
        if warmup["ok"] == 1:
            break
        # 503 from a server that is still loading its model (edgeinfer serve, with Retry-After): wait for it.
        if warmup["errors"] != {"503": 1} or time.monotonic() >= deadline:
            fail(f"the warm-up request failed: {warmup['first_error']}")
        time.sleep(1.0)
    out: dict[str, Any] = {}
    if s.clients > 1 and s.baseline_requests > 0:
        out["single"] = asyncio.run(run_pass(target, prompts.take(s.baseline_requests), 1, s.max_tokens, s.duration_s))
    if s.shared_prefix:
        # Without a shared prefix first: its last request leaves nothing in a one-slot cache that
        # the shared pass could reuse, so that pass's first request pays the full prefill too.
        unshared = prompts.take(s.requests, shared=False)
        out["unshared"] = asyncio.run(run_pass(target, unshared, s.clients, s.max_tokens, s.duration_s))
        out["unshared"]["shared_prefix_tokens"] = prompts.shared_tokens(unshared)
    batch = prompts.take(s.requests)
    out["load"] = asyncio.run(run_pass(target, batch, s.clients, s.max_tokens, s.duration_s))
    if s.shared_prefix:
        out["load"]["shared_prefix_tokens"] = prompts.shared_tokens(batch)
    return out


def run_managed(
    kind: str, settings: Settings, eog_ids: list[int], n_ctx: int, model: str | None, tokenizer: Tokenizer
) -> dict[str, Any]:
    s = settings
    port = free_port()
    command = server_command(kind, s.gguf, s.threads, s.clients, n_ctx, port) + s.server_args[kind]
    server = Server(kind, command, port)
    try:
        listed = server.wait_ready(s.ready_timeout_s, s.headers)
        rss_idle = rss_mib(server.proc.pid)
        body = request_body(kind, model or listed, s.eos, eog_ids, s.extra)
        target = Target(server.base_url, body, s.headers, s.request_timeout_s)
        result = passes(target, s, Prompts(tokenizer, s.prompt_tokens, s.shared_prefix))
        rss_after = rss_mib(server.proc.pid)
    finally:
        server.stop(s.stop_timeout_s)
    return {"command": command, "log": server.log.name, "request": redacted(body), "rss_idle_mib": rss_idle,
            "rss_after_mib": rss_after, "passes": result}  # fmt: skip


def run_url(base_url: str, settings: Settings, eog_ids: list[int], model: str | None, pid: int | None,
            tokenizer: Tokenizer) -> dict[str, Any]:  # fmt: skip
    s = settings
    if model is None:
        try:
            model = first_model(httpx.get(base_url + "/models", headers=s.headers, timeout=10.0))
        except httpx.HTTPError as exc:
            fail(f"cannot reach {base_url}/models: {type(exc).__name__}: {exc}")
    body = request_body("url", model, s.eos, eog_ids, s.extra)
    target = Target(base_url, body, s.headers, s.request_timeout_s)
    rss_idle = rss_mib(pid) if pid else None
    result = passes(target, s, Prompts(tokenizer, s.prompt_tokens, s.shared_prefix))
    return {"url": base_url, "request": redacted(body), "pid": pid, "rss_idle_mib": rss_idle,
            "rss_after_mib": rss_mib(pid) if pid else None, "passes": result}  # fmt: skip


def redacted(body: dict[str, Any]) -> dict[str, Any]:
    """The request as the report shows it: the fields, without a prompt."""
    return {k: v for k, v in body.items() if k != "prompt"}


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def ratios(servers: dict[str, dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, server in servers.items():
        p = server["passes"]
        mine: dict[str, Any] = {}
        if "single" in p:
            mine["load_over_single_tok_s"] = ratio(p["load"]["aggregate_tok_s"], p["single"]["aggregate_tok_s"])
        if "unshared" in p:
            mine["ttft_p50_shared_over_unshared"] = ratio(p["load"]["ttft_ms_p50"], p["unshared"]["ttft_ms_p50"])
        out[name] = mine
    if {"edgeinfer", "llamacpp"} <= servers.keys():
        e, ll = servers["edgeinfer"]["passes"]["load"], servers["llamacpp"]["passes"]["load"]
        out["edgeinfer_over_llamacpp_tok_s"] = ratio(e["aggregate_tok_s"], ll["aggregate_tok_s"])
        out["ttft_ms_p99"] = {"edgeinfer": e["ttft_ms_p99"], "llamacpp": ll["ttft_ms_p99"]}
        out["edgeinfer_over_llamacpp_ttft_p99"] = ratio(e["ttft_ms_p99"], ll["ttft_ms_p99"])
    return out


def fmt(value: float | None, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def print_report(report: dict[str, Any]) -> None:
    s = report["settings"]
    prompt = (f"{s['shared_prefix']} shared + a question ({s['prompt_tokens_min']}-{s['prompt_tokens_max']} tokens)"
              if s["shared_prefix"] else f"{s['prompt_tokens']} tokens")  # fmt: skip
    print(f"{Path(s['gguf']).name}  threads={s['threads']}  clients={s['clients']}  requests<={s['requests']}  "
          f"duration<={s['duration_s']:.0f} s  max_tokens={s['max_tokens']}  prompt={prompt}")  # fmt: skip
    header = (f"  {'pass':<12} {'reqs':>5} {'errors':>6} {'short':>5} {'tokens':>7} {'wall s':>7} {'agg tok/s':>10} "
              f"{'TTFT P50 ms':>12} {'TTFT P99 ms':>12} {'TPOT P50 ms':>12} {'TPOT P99 ms':>12}")  # fmt: skip
    for name, server in report["servers"].items():
        where = " ".join(server["command"]) if "command" in server else server["url"]
        print(f"\n{SERVERS.get(name, name)}: {where}")
        print(f"  request fields: {json.dumps(server['request'])}")
        print(f"  RSS: idle after startup {fmt(server['rss_idle_mib'], '.1f')} MiB, "
              f"after the load {fmt(server['rss_after_mib'], '.1f')} MiB")  # fmt: skip
        print(header)
        for label, p in server["passes"].items():
            row = f"{label} ({p['clients']})"
            print(f"  {row:<12} {p['requests']:>5} {sum(p['errors'].values()):>6} {p['short_answers']:>5} "
                  f"{p['completion_tokens']:>7} {p['wall_s']:>7.2f} {p['aggregate_tok_s']:>10.2f} "
                  f"{p['ttft_ms_p50']:>12.1f} {p['ttft_ms_p99']:>12.1f} {p['tpot_ms_p50']:>12.2f} "
                  f"{p['tpot_ms_p99']:>12.2f}")  # fmt: skip
            if p["errors"]:
                print(f"    errors {p['errors']}; first: {p['first_error']}")
            if p["tokens_from"] == "chunks":
                print("    completion tokens counted as text chunks: the server sent no usage")
            elif p["tokens_from"] == "mixed":
                print("    some answers came without usage: their completion tokens counted as text chunks")
            if "shared_prefix_tokens" in p:
                print(f"    token ids every prompt shares: {p['shared_prefix_tokens']} (asked {s['shared_prefix']})")
        mine = report["ratios"].get(name, {})
        if mine.get("load_over_single_tok_s") is not None:
            verdict = ""
            if name == "edgeinfer":
                verdict = f" (target >= {SCALING_TARGET:.0f}x)  " + (
                    "PASS" if mine["load_over_single_tok_s"] >= SCALING_TARGET else "FAIL"
                )
            print(f"  aggregate tok/s, {s['clients']} clients over 1: {mine['load_over_single_tok_s']:.2f}x{verdict}")
        if mine.get("ttft_p50_shared_over_unshared") is not None:
            print(f"  TTFT P50 with the shared prefix over without: {mine['ttft_p50_shared_over_unshared']:.2f}x")
    r = report["ratios"]
    if "edgeinfer_over_llamacpp_tok_s" in r:
        print(f"\nedgeinfer / llama_cpp.server, {s['clients']} clients: aggregate tok/s "
              f"{fmt(r['edgeinfer_over_llamacpp_tok_s'])}x; TTFT P99 {r['ttft_ms_p99']['edgeinfer']:.1f} ms vs "
              f"{r['ttft_ms_p99']['llamacpp']:.1f} ms ({fmt(r['edgeinfer_over_llamacpp_ttft_p99'])}x)")  # fmt: skip


def loopback_url(url: str) -> str:
    """``url`` without a trailing slash, if it names a loopback server; else a one-line error."""
    try:
        parts = urlsplit(url)
        host = parts.hostname
        parts.port  # noqa: B018 - raises ValueError for a port out of range or not a number
    except ValueError as exc:
        fail(f"--url {url!r} is not a URL: {exc}")
    if parts.scheme not in ("http", "https") or not host:
        fail(f"--url {url!r}: give http://127.0.0.1:PORT/v1")
    if host not in LOOPBACK:
        fail(f"--url {url!r}: loopback servers only (127.0.0.1, localhost or ::1), not {host}")
    return url.rstrip("/")


def stopped(signum: int, frame: object) -> NoReturn:
    raise SystemExit(f"load_test.py: stopped by signal {signum}")


def main() -> None:
    ap = ArgumentParser(description=__doc__, prog="load_test.py", formatter_class=argparse.RawDescriptionHelpFormatter)
    where = ap.add_mutually_exclusive_group()
    where.add_argument("--url", help="an OpenAI-compatible server's base URL, e.g. http://127.0.0.1:8080/v1")
    where.add_argument("--compare", action="store_true", help="start edgeinfer serve, then llama_cpp.server")
    where.add_argument("--only", choices=list(SERVERS), help="start this one server alone")
    ap.add_argument("--model", help="the model field of each request (default: the first id GET /v1/models lists)")
    ap.add_argument("--api-key", help="sent as a Bearer token")
    ap.add_argument("--pid", type=int, help="with --url: the server's process id, for its RSS")
    ap.add_argument("--gguf", default=DEFAULT_MODEL, help="the GGUF to count prompt tokens with, and to serve "
                    f"(a path or catalog alias; default {DEFAULT_MODEL})")  # fmt: skip
    ap.add_argument("--threads", type=int, default=2, help="the servers' threads (default 2)")
    ap.add_argument("--clients", type=int, default=4, help="concurrent clients (default 4)")
    ap.add_argument("--requests", type=int, default=16, help="requests per pass at most (default 16)")
    ap.add_argument(
        "--duration", type=float, default=120.0, help="seconds a pass issues requests for, at most (default 120)"
    )
    ap.add_argument("--baseline-requests", type=int, default=4,
                    help="requests of the 1-client pass run before the load when --clients > 1 (0: none)")  # fmt: skip
    ap.add_argument("--max-tokens", type=int, default=128, help="tokens each answer runs to (default 128)")
    ap.add_argument("--prompt-tokens", type=int, default=128, help="tokens in each prompt (default 128)")
    ap.add_argument("--shared-prefix", type=int, default=0, metavar="N",
                    help="every prompt: one N-token system text and a short question; also a pass without")  # fmt: skip
    ap.add_argument("--eos", choices=EOS_MODES, default="auto",
                    help="how to ask for answers of max_tokens: auto sends ignore_eos to edgeinfer, logit_bias to "
                    "llama_cpp.server and both to --url")  # fmt: skip
    ap.add_argument("--extra-json", default="{}", help="a JSON object of fields added to every request")
    ap.add_argument("--edgeinfer-args", default="", help="more options for edgeinfer serve, e.g. '--kv-budget 8192tok'")
    ap.add_argument("--llamacpp-args", default="", help="more options for llama_cpp.server, e.g. '--n_batch 256'")
    ap.add_argument("--n-ctx", type=int, help="llama_cpp.server's --n_ctx (default: the longest prompt + max_tokens)")
    ap.add_argument("--request-timeout", type=float, default=300.0, help="seconds to wait for each chunk (default 300)")
    ap.add_argument(
        "--ready-timeout",
        type=float,
        default=180.0,
        help="seconds a server has to load its model and answer (default 180)",
    )
    ap.add_argument(
        "--stop-timeout", type=float, default=15.0, help="seconds after SIGTERM before SIGKILL (default 15)"
    )
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the tables")
    args = ap.parse_args()

    if not (args.url or args.compare or args.only):
        ap.error("give --url URL for a running server, or --compare / --only NAME to start them")
    for name in ("threads", "clients", "requests", "max_tokens", "prompt_tokens"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1")
    for name in ("duration", "request_timeout", "ready_timeout", "stop_timeout"):
        if not getattr(args, name) > 0:
            ap.error(f"--{name.replace('_', '-')} must be more than 0")
    if args.baseline_requests < 0 or args.shared_prefix < 0:
        ap.error("--baseline-requests and --shared-prefix must be at least 0")
    if max(args.prompt_tokens, args.shared_prefix) > MAX_PROMPT_TOKENS:
        # The prompt builder tokenizes a dozen times a prompt: longer ones take minutes to make.
        ap.error(f"--prompt-tokens and --shared-prefix must be at most {MAX_PROMPT_TOKENS}")
    if args.pid is not None and (not args.url or not psutil.pid_exists(args.pid)):
        ap.error(f"--pid {args.pid}: give the process id of a running server, with --url")
    try:
        extra = json.loads(args.extra_json)
    except json.JSONDecodeError as exc:
        ap.error(f"--extra-json is not JSON: {exc}")
    if not isinstance(extra, dict):
        ap.error("--extra-json must be a JSON object")
    base_url = loopback_url(args.url) if args.url else None
    try:
        server_args = {"edgeinfer": shlex.split(args.edgeinfer_args), "llamacpp": shlex.split(args.llamacpp_args)}
    except ValueError as exc:
        ap.error(f"--edgeinfer-args / --llamacpp-args: {exc}")

    try:
        gguf = resolve_model(args.gguf)
        tokenizer = Tokenizer(gguf)
    except EdgeInferError as exc:
        fail(str(exc))
    # Every end-of-generation id, not the EOS alone: llama-cpp-python stops at any of them.
    eog_ids = [t for t in range(tokenizer.n_vocab) if tokenizer.is_end_of_generation(t)]
    probe = Prompts(tokenizer, args.prompt_tokens, args.shared_prefix)
    lengths = [len(tokenizer.encode(p)) for p in probe.take(2)]  # builds one of each kind: bad lengths fail here
    if args.shared_prefix:
        lengths += [len(tokenizer.encode(p)) for p in probe.take(2, shared=False)]
    # Room for the longest prompt (a larger index may tokenize a token longer) and the answer.
    n_ctx = args.n_ctx or -(-(max(lengths) + 8 + args.max_tokens) // 256) * 256
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    settings = Settings(
        gguf=gguf, threads=args.threads, clients=args.clients, requests=args.requests,
        baseline_requests=args.baseline_requests, duration_s=args.duration, max_tokens=args.max_tokens,
        prompt_tokens=args.prompt_tokens, shared_prefix=args.shared_prefix, eos=args.eos, extra=extra,
        headers=headers, request_timeout_s=args.request_timeout, server_args=server_args,
        ready_timeout_s=args.ready_timeout, stop_timeout_s=args.stop_timeout,
    )  # fmt: skip

    # SIGTERM as an exception, as Ctrl-C is one: the finally that stops a started server runs either way.
    signal.signal(signal.SIGTERM, stopped)
    servers: dict[str, dict[str, Any]] = {}
    if base_url:
        servers["server"] = run_url(base_url, settings, eog_ids, args.model, args.pid, tokenizer)
    else:
        # One at a time, edgeinfer first: two servers at once would share the cores and each other's timings.
        for kind in [args.only] if args.only else list(SERVERS):
            servers[kind] = run_managed(kind, settings, eog_ids, n_ctx, args.model, tokenizer)

    report = {
        "settings": {
            "gguf": str(gguf), "threads": args.threads, "clients": args.clients, "requests": args.requests,
            "baseline_requests": args.baseline_requests, "duration_s": args.duration, "max_tokens": args.max_tokens,
            "prompt_tokens": args.prompt_tokens, "shared_prefix": args.shared_prefix,
            "prompt_tokens_min": min(lengths), "prompt_tokens_max": max(lengths), "n_ctx_llamacpp": n_ctx,
            "eos": args.eos, "eog_ids": eog_ids,
        },
        "servers": servers,
        "ratios": ratios(servers),
    }  # fmt: skip
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_report(report)


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        raise SystemExit("load_test.py: interrupted") from None
