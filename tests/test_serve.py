"""`edgeinfer serve`: a real server process on 127.0.0.1, spoken to through the official `openai` client.

Each server is the real command in a child process (so SIGTERM is a real signal), on a port it picks.
Answers that a test compares are greedy answers to `JAPAN`-style questions, whose every token leads by a
wide margin; the rest assert properties.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import httpx
import openai
import pytest

from openai_server import OpenAIServer
from support import JAPAN, MIN_MARGIN, greedy_margins

KEY = "sk-edge-test-0123456789"
LONG_STORY = [{"role": "user", "content": "Tell me a very long story about a lighthouse keeper."}]


class Served:
    """An `edgeinfer serve` child process and what it printed."""

    def __init__(self, *args: str, env: dict[str, str] | None = None) -> None:
        command = [sys.executable, "-m", "edgeinfer", "serve", "--port", "0", "--threads", "2", *args]
        self.process = subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, **(env or {})},
        )
        self.health_before_ready: list[tuple[int, str]] = []
        self.url = self._wait_until_ready()
        self.base = self.url.removesuffix("/v1")

    def _wait_until_ready(self) -> str:
        assert self.process.stdout is not None and self.process.stderr is not None
        loading = self.process.stderr.readline()
        assert "loading" in loading, loading
        lines: list[str] = []
        reader = threading.Thread(target=lambda: lines.append(self.process.stdout.readline()), daemon=True)
        reader.start()
        port = None
        deadline = time.monotonic() + 180
        while reader.is_alive() and time.monotonic() < deadline:
            port = port or _listening_port(self.process.pid)
            if port is not None:
                with contextlib.suppress(httpx.HTTPError):
                    r = httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)
                    self.health_before_ready.append((r.status_code, r.json()["status"]))
            time.sleep(0.02)
        reader.join(timeout=1)
        match = re.search(r"ready at (\S+)", lines[0] if lines else "")
        assert match, f"no ready line: {lines} {self.process.stderr.read() if self.process.poll() is not None else ''}"
        return match.group(1)

    def client(self, **options) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url, api_key=options.pop("api_key", "none"), max_retries=0, **options)

    def metric(self, name: str) -> float:
        text = httpx.get(f"{self.base}/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
        return sum(float(line.split()[-1]) for line in text.splitlines() if line.split("{")[0].split()[0] == name)

    def stop(self, timeout: float = 60) -> tuple[int, str]:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            _, err = self.process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            _, err = self.process.communicate()
        return self.process.returncode, err


def _listening_port(pid: int) -> int | None:
    import psutil

    with contextlib.suppress(psutil.Error):
        for conn in psutil.Process(pid).net_connections(kind="tcp"):
            if conn.status == psutil.CONN_LISTEN:
                return conn.laddr.port
    return None


@contextlib.contextmanager
def serving(*args: str, env: dict[str, str] | None = None) -> Iterator[Served]:
    served = Served(*args, env=env)
    try:
        yield served
    finally:
        served.stop()


@pytest.fixture(scope="module")
def server() -> Iterator[Served]:
    with serving("--parallel", "4", "--api-key", KEY) as s:
        yield s


@pytest.fixture(scope="module")
def client(server: Served) -> openai.OpenAI:
    return server.client(api_key=KEY)


# -- the endpoints ---------------------------------------------------------------------------------


def test_it_says_it_is_loading_then_ok_and_lists_its_model(server, client):
    assert (503, "loading") in server.health_before_ready
    health = httpx.get(f"{server.base}/health")
    assert health.status_code == 200 and health.json()["status"] == "ok"
    assert [m.id for m in client.models.list()] == ["smollm2-135m"]


def test_a_chat_answer_with_usage_and_the_route_and_timings(client):
    response = client.chat.completions.create(model="any", messages=JAPAN, temperature=0, max_tokens=24)
    choice = response.choices[0]
    assert "Tokyo" in choice.message.content and choice.finish_reason == "stop"
    assert response.usage.completion_tokens > 3 and response.usage.prompt_tokens > 10
    extension = response.model_extra["edgeinfer"]
    assert extension["route"] == "local" and extension["degraded"] is False and extension["reason"]
    assert extension["timings"]["ttft_ms"] > 0 and extension["timings"]["completion_tokens"] == (
        response.usage.completion_tokens
    )


def test_a_streamed_chat_is_the_same_answer_and_ends_with_usage(client):
    whole = client.chat.completions.create(model="any", messages=JAPAN, temperature=0, max_tokens=24)
    chunks = list(
        client.chat.completions.create(
            model="any", messages=JAPAN, temperature=0, max_tokens=24, stream=True,
            stream_options={"include_usage": True},
        )
    )  # fmt: skip
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    last_choice = [c for c in chunks if c.choices][-1]
    assert last_choice.choices[0].finish_reason == "stop" and last_choice.model_extra["edgeinfer"]["route"] == "local"
    assert not chunks[-1].choices and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_raw_completions_streamed_and_not(client):
    whole = client.completions.create(model="any", prompt="One, two, three, four,", max_tokens=8, temperature=0)
    assert whole.choices[0].finish_reason == "length" and whole.usage.completion_tokens == 8
    streamed = client.completions.create(
        model="any", prompt="One, two, three, four,", max_tokens=8, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed) == whole.choices[0].text


def test_stop_seed_and_top_p_are_honoured(client):
    ask = dict(model="any", messages=LONG_STORY, max_tokens=24, temperature=0.9, top_p=0.9, seed=7)
    first, again = (client.chat.completions.create(**ask).choices[0].message.content for _ in range(2))
    assert first == again  # the same seed, the same draw
    stopped = client.chat.completions.create(**{**ask, "stop": [first.split()[2]]})
    assert stopped.choices[0].finish_reason == "stop" and first.split()[2] not in stopped.choices[0].message.content


# -- continuous batching and the prefix cache ------------------------------------------------------------


def test_several_clients_at_once_are_decoded_together(server, client):
    alone = client.chat.completions.create(model="any", messages=JAPAN, temperature=0, max_tokens=24)
    steps, tokens = server.metric("edgeinfer_decode_steps"), server.metric("edgeinfer_decoded_tokens")
    answers: dict[int, str] = {}

    def ask(i: int) -> None:
        messages = JAPAN if i % 2 == 0 else LONG_STORY
        stream = client.chat.completions.create(
            model="any", messages=messages, temperature=0, max_tokens=40, stream=True
        )
        answers[i] = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert answers[0] == answers[2] == alone.choices[0].message.content  # batched, the same wide-margin answer
    assert answers[1] and answers[3]
    batch = (server.metric("edgeinfer_decoded_tokens") - tokens) / (server.metric("edgeinfer_decode_steps") - steps)
    assert batch > 1.5  # answers shared backend steps, not one after another


def test_a_shared_system_prompt_is_reused_and_the_answer_is_the_cold_one(engine, server, client):
    system = " ".join(["You answer questions about geography briefly and correctly."] * 40)
    question = [{"role": "system", "content": system}, {"role": "user", "content": "What is the capital of Japan?"}]
    other = [{"role": "system", "content": system}, {"role": "user", "content": "Name a large ocean."}]
    cold_local = engine.chat(question, temperature=0, max_tokens=12)
    assert greedy_margins(engine, question, cold_local).min() > MIN_MARGIN  # the answer does not hang on rounding

    def ask(messages):
        return client.chat.completions.create(model="any", messages=messages, temperature=0, max_tokens=12)

    ask([{"role": "user", "content": "Hi"}])  # shares nothing reusable: the idle cache is emptied
    cold = ask(question)
    assert cold.model_extra["edgeinfer"]["timings"]["cached_tokens"] == 0
    ask([{"role": "user", "content": "Hi"}])
    ask(other)  # leaves the system prompt cached
    warm = ask(question)  # a new question after the same system prompt: its KV is copied, not recomputed
    timings = warm.model_extra["edgeinfer"]["timings"]
    assert timings["cached_tokens"] >= 320 and timings["cached_tokens"] < timings["prompt_tokens"]
    assert warm.choices[0].message.content == cold.choices[0].message.content


# -- robustness --------------------------------------------------------------------------------------


def test_a_client_that_hangs_up_mid_stream_cancels_its_answer(server):
    with httpx.stream(
        "POST", f"{server.url}/chat/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=60,
        json={"messages": LONG_STORY, "max_tokens": 3000, "ignore_eos": True, "stream": True},
    ) as response:  # fmt: skip
        lines = response.iter_lines()
        for _ in range(6):
            next(lines)
        assert server.metric("edgeinfer_requests_running") == 1
    deadline = time.monotonic() + 10
    while server.metric("edgeinfer_requests_running") and time.monotonic() < deadline:
        time.sleep(0.05)
    steps = server.metric("edgeinfer_decode_steps")
    time.sleep(0.5)
    assert server.metric("edgeinfer_requests_running") == 0 and server.metric("edgeinfer_decode_steps") == steps


def test_a_client_that_hangs_up_before_a_whole_answer_cancels_it(server):
    with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes the connection
        httpx.post(
            f"{server.url}/chat/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=2,
            json={"messages": LONG_STORY, "max_tokens": 3000, "ignore_eos": True},
        )  # fmt: skip
    deadline = time.monotonic() + 10
    while server.metric("edgeinfer_requests_running") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.metric("edgeinfer_requests_running") == 0


@pytest.mark.parametrize(
    ("body", "status", "says"),
    [
        (b"{not json", 400, "not valid JSON"),
        (b"[1, 2]", 400, "must be a JSON object"),
        (b'{"messages": [{"role": "user", "content": "caf\xe9"}]}', 400, "not valid UTF-8"),
        (json.dumps({"messages": [{"role": "user", "content": "\ud800"}]}).encode(), 400, "lone surrogate"),
        (json.dumps({"messages": [{"role": "wizard", "content": "Hi"}]}).encode(), 400, "messages[0].role"),
        (json.dumps({"messages": [{"role": "user", "content": "Hi"}], "tools": []}).encode(), 400, "'tools'"),
        (json.dumps({"messages": [{"role": "user", "content": "Hi"}], "n": 3}).encode(), 400, "n=3"),
        (json.dumps({"messages": [{"role": "user", "content": "Hi"}], "temperature": "hot"}).encode(), 400, "number"),
        (json.dumps({"messages": [{"role": "user", "content": "x" * (2 << 20)}]}).encode(), 413, "--max-body"),
        (json.dumps({"messages": []}).encode(), 400, "non-empty list"),
    ],
)
def test_a_bad_request_is_an_openai_error_naming_the_problem(server, body, status, says):
    r = httpx.post(
        f"{server.url}/chat/completions", content=body, timeout=30,
        headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"},
    )  # fmt: skip
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert says in error["message"] and error["type"] and "Traceback" not in r.text
    assert httpx.get(f"{server.base}/health").json()["status"] in ("ok", "busy")  # still serving


def test_a_wrong_or_missing_key_is_401_and_the_key_is_never_echoed(server):
    with pytest.raises(openai.AuthenticationError) as caught:
        server.client(api_key="sk-wrong").chat.completions.create(model="any", messages=JAPAN, max_tokens=2)
    assert caught.value.status_code == 401 and KEY not in str(caught.value.body)
    missing = httpx.post(f"{server.url}/chat/completions", json={"messages": JAPAN})
    assert missing.status_code == 401 and missing.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{server.url}/models").status_code == 401
    r = httpx.post(f"{server.url}/chat/completions", json={"messages": JAPAN}, headers={"Authorization": KEY})
    assert r.status_code == 401  # the key without "Bearer"


def test_a_small_budget_refuses_a_long_prompt_and_a_full_queue_is_429(model_path):
    with serving("--parallel", "1", "--max-queue", "1", "--kv-budget", "512tok", "--kv-policy", "error") as small:
        client = small.client()
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(
                model="any", messages=[{"role": "user", "content": "word " * 700}], max_tokens=4
            )
        assert caught.value.code == "context_length_exceeded" and "512 tokens" in caught.value.message

        # One running and one queued fill the server. Each answer is long enough (200 tokens, seconds) that
        # the second is still queued when the third asks; the state is polled for, not slept for.
        workers = []
        for busy in ({"status": "busy", "running": 1, "queued": 0}, {"status": "busy", "running": 1, "queued": 1}):
            workers.append(threading.Thread(target=_ask_long, args=(client,)))
            workers[-1].start()
            assert _health_becomes(small, busy) == busy
        with pytest.raises(openai.RateLimitError) as refused:
            client.chat.completions.create(model="any", messages=JAPAN, max_tokens=4)
        assert int(refused.value.response.headers["Retry-After"]) >= 1
        assert httpx.get(f"{small.base}/health").status_code == 503
        for worker in workers:
            worker.join(timeout=300)
        assert small.metric("edgeinfer_requests_total") >= 4


def _health_becomes(served: Served, wanted: dict[str, object], timeout: float = 30) -> dict[str, object]:
    """/health's answer once it is ``wanted``, or its last answer after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while (health := httpx.get(f"{served.base}/health").json()) != wanted and time.monotonic() < deadline:
        time.sleep(0.05)
    return health


def _ask_long(client: openai.OpenAI) -> None:
    with contextlib.suppress(openai.APIError):
        client.chat.completions.create(
            model="any", messages=LONG_STORY, max_tokens=200, extra_body={"ignore_eos": True}
        )


def test_sigterm_finishes_short_answers_cancels_long_ones_and_exits(model_path):
    served = Served("--parallel", "2", "--shutdown-timeout", "3")
    client = served.client(timeout=60)
    results: dict[str, object] = {}

    def ask(name: str, max_tokens: int) -> None:
        try:
            stream = client.chat.completions.create(
                model="any", messages=LONG_STORY, max_tokens=max_tokens, stream=True, extra_body={"ignore_eos": True}
            )
            results[name] = [c.choices[0].finish_reason for c in stream if c.choices][-1]
        except (openai.APIError, httpx.HTTPError) as exc:
            results[name] = exc

    workers = [threading.Thread(target=ask, args=("short", 12)), threading.Thread(target=ask, args=("long", 1500))]
    for worker in workers:
        worker.start()
    deadline = time.monotonic() + 60
    while served.metric("edgeinfer_requests_running") < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    started = time.monotonic()
    served.process.send_signal(signal.SIGTERM)
    code, err = served.stop(timeout=60)
    took = time.monotonic() - started
    for worker in workers:
        worker.join(timeout=30)
    assert code == 0, err
    assert took < 3 + 10  # the shutdown timeout, and the engine closing
    assert results["short"] == "length"  # finished within the timeout
    assert isinstance(results["long"], openai.APIError) and "shut down" in str(results["long"])  # its last event
    assert "Traceback" not in err
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"{served.base}/health", timeout=2)


# -- the router behind it ----------------------------------------------------------------------------


def test_the_router_escalates_and_degrades_behind_the_same_endpoint():
    with OpenAIServer(default_answer="The cloud model says hello.") as cloud:
        env = {"OPENAI_API_KEY": "sk-cloud-secret-42"}
        with serving("--route", "cloud", "--cloud-url", cloud.url, "--cloud-model", "oracle-1", env=env) as served:
            client = served.client()
            answered = client.chat.completions.create(model="any", messages=JAPAN, max_tokens=16)
            extension = answered.model_extra["edgeinfer"]
            assert answered.choices[0].message.content == "The cloud model says hello."
            assert extension["route"] == "cloud" and extension["degraded"] is False
            cloud.fail("status", status=500, times=3)  # the first try and both retries
            degraded = client.chat.completions.create(model="any", messages=JAPAN, max_tokens=16, temperature=0)
            extension = degraded.model_extra["edgeinfer"]
            assert extension["route"] == "local" and extension["degraded"] is True
            assert "Tokyo" in degraded.choices[0].message.content
            streamed = client.chat.completions.create(model="any", messages=JAPAN, max_tokens=16, stream=True)
            assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == (
                "The cloud model says hello."
            )
            assert served.metric("edgeinfer_answers_total") == 3
            code, err = served.stop()
        assert "sk-cloud-secret-42" not in err
        assert all(r.authorization == "Bearer sk-cloud-secret-42" for r in cloud.requests)
