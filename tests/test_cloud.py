"""The cloud client against a real OpenAI-compatible server on 127.0.0.1 that fails on demand."""

from __future__ import annotations

import logging
import threading
import time

import pytest

from edgeinfer import CloudError, CloudModel, InvalidOptionError

from openai_server import OpenAIServer, backlog_full

KEY = "sk-test-0123456789abcdefghij"
HELLO = [{"role": "user", "content": "Hello?"}]


@pytest.fixture
def server():
    with OpenAIServer(default_answer="Hello from the cloud model.") as s:
        yield s


def make(server, **options):
    defaults = dict(api_key=KEY, connect_timeout=0.5, read_timeout=0.3, backoff_s=0.02, breaker_cooldown_s=60)
    return CloudModel(server.url, "big-model", **{**defaults, **options})


def test_complete_and_stream_send_the_request_and_read_usage(server):
    cloud = make(server)
    reply = cloud.complete(HELLO, max_tokens=20, temperature=0)
    assert reply.text == "Hello from the cloud model." and reply.finish_reason == "stop"
    assert reply.usage.completion_tokens == 5 and not reply.usage.estimated
    stream = cloud.stream(HELLO, max_tokens=3)
    assert list(stream) == ["Hello ", "from ", "the "]
    assert stream.finish_reason == "length" and stream.usage.completion_tokens == 3
    sent = server.requests[0]
    assert sent.authorization == f"Bearer {KEY}"
    assert sent.body["model"] == "big-model" and sent.body["messages"] == HELLO and sent.body["max_tokens"] == 20
    assert server.requests[1].body["stream"] is True


def test_url_model_and_key_come_from_the_environment(server, monkeypatch):
    monkeypatch.setenv("EDGEINFER_CLOUD_URL", server.url.removesuffix("/v1"))  # /v1 is added
    monkeypatch.setenv("EDGEINFER_CLOUD_MODEL", "env-model")
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    cloud = CloudModel()
    assert cloud.url == server.url + "/chat/completions" and cloud.model == "env-model"
    assert cloud.complete(HELLO).text.startswith("Hello")
    assert server.requests[-1].authorization == f"Bearer {KEY}"
    monkeypatch.delenv("EDGEINFER_CLOUD_URL")
    with pytest.raises(InvalidOptionError, match="EDGEINFER_CLOUD_URL"):
        CloudModel()


def test_429_waits_for_retry_after_then_succeeds(server):
    server.fail("status", status=429, retry_after=0.4)
    start = time.monotonic()
    assert make(server).complete(HELLO).text.startswith("Hello")
    assert time.monotonic() - start >= 0.4 and len(server.requests) == 2


def test_a_retry_after_beyond_the_bound_fails_at_once_and_opens_the_circuit(server):
    server.fail("status", status=429, retry_after=120)
    cloud = make(server, max_retry_after_s=5)
    start = time.monotonic()
    with pytest.raises(CloudError) as info:
        cloud.complete(HELLO)
    assert info.value.kind == "rate_limited" and time.monotonic() - start < 1
    assert cloud.breaker.state == "open" and cloud.breaker.cooldown_left_s > 100
    with pytest.raises(CloudError, match="cooling down"):
        cloud.complete(HELLO)
    assert len(server.requests) == 1


@pytest.mark.parametrize("status", [500, 502, 503, 408, 409])
def test_server_errors_are_retried_with_backoff(server, status):
    server.fail("status", status=status, times=2)
    start = time.monotonic()
    assert make(server, backoff_s=0.1).complete(HELLO).text.startswith("Hello")
    # Two jittered waits of at least half of 0.1 and 0.2 s.
    assert len(server.requests) == 3 and time.monotonic() - start >= 0.15


def test_retries_run_out(server):
    server.fail("status", status=500, times=5)
    with pytest.raises(CloudError) as info:
        make(server, max_retries=2).complete(HELLO)
    assert info.value.kind == "server" and info.value.status == 500 and len(server.requests) == 3


@pytest.mark.parametrize(
    ("status", "code", "kind"),
    [(400, None, "bad_request"), (401, None, "auth"), (403, None, "auth"), (429, "insufficient_quota", "quota")],
)
def test_client_errors_and_quota_are_not_retried(server, status, code, kind):
    server.fail("status", status=status, code=code)
    with pytest.raises(CloudError) as info:
        make(server).complete(HELLO)
    assert info.value.kind == kind and info.value.status == status and len(server.requests) == 1


def test_a_slow_server_times_out_and_the_retry_succeeds(server):
    server.fail("delay", seconds=1.0)
    assert make(server).stream(HELLO).__next__() == "Hello "
    assert len(server.requests) == 2


def test_the_total_timeout_bounds_the_whole_call(server):
    server.fail("delay", seconds=1.0, times=10)
    start = time.monotonic()
    with pytest.raises(CloudError) as info:
        make(server, max_retries=10, total_timeout=0.8).complete(HELLO)
    assert info.value.kind == "timeout" and time.monotonic() - start < 1.3


def test_a_stream_cut_before_its_first_text_is_retried_without_repeats(server):
    server.fail("drop", after=0)
    assert "".join(make(server).stream(HELLO)) == "Hello from the cloud model."
    assert len(server.requests) == 2


def test_a_stream_cut_after_some_text_raises_and_keeps_what_was_sent(server):
    server.fail("drop", after=2)
    pieces = []
    with pytest.raises(CloudError) as info:
        for piece in make(server).stream(HELLO):
            pieces.append(piece)
    assert info.value.kind == "connection" and pieces == ["Hello ", "from "] and len(server.requests) == 1


@pytest.mark.parametrize(("fault", "kind"), [("malformed", "protocol"), ("error_event", "server")])
def test_broken_streams_are_errors(server, fault, kind):
    server.fail(fault, after=1)
    with pytest.raises(CloudError) as info:
        list(make(server).stream(HELLO))
    assert info.value.kind == kind


def test_invalid_json_is_a_protocol_error_and_not_retried(server):
    server.fail("invalid_json")
    with pytest.raises(CloudError, match="not valid JSON") as info:
        make(server).complete(HELLO)
    assert info.value.kind == "protocol" and len(server.requests) == 1


def test_the_breaker_opens_after_failures_and_closes_after_a_good_trial(server):
    cloud = make(server, max_retries=0, breaker_failures=2, breaker_cooldown_s=0.3)
    server.fail("status", status=500, times=2)
    for _ in range(2):
        with pytest.raises(CloudError):
            cloud.complete(HELLO)
    assert cloud.breaker.state == "open"
    with pytest.raises(CloudError) as info:
        cloud.complete(HELLO)
    assert info.value.kind == "circuit_open" and len(server.requests) == 2  # refused without a request
    time.sleep(0.35)
    assert cloud.breaker.state == "half_open"
    assert cloud.complete(HELLO).text.startswith("Hello")
    assert cloud.breaker.state == "closed"


def test_a_failed_trial_reopens_the_breaker(server):
    cloud = make(server, max_retries=0, breaker_failures=1, breaker_cooldown_s=0.2)
    server.fail("status", status=503, times=2)
    with pytest.raises(CloudError):
        cloud.complete(HELLO)
    time.sleep(0.25)
    with pytest.raises(CloudError):
        cloud.complete(HELLO)
    assert cloud.breaker.state == "open"


def test_the_api_key_is_never_shown(server, caplog):
    caplog.set_level(logging.DEBUG)
    cloud = make(server)
    assert KEY not in repr(cloud) and KEY not in str(vars(cloud).get("url"))
    server.fail("status", status=401, echo_auth=True)  # a server that echoes the header back
    with pytest.raises(CloudError) as info:
        cloud.complete(HELLO)
    assert "[redacted]" in str(info.value) and KEY not in str(info.value)
    assert KEY not in caplog.text


def pieces_of(key: str, n: int = 8) -> list[str]:
    """Every run of ``n`` characters of ``key``: none may show anywhere."""
    return [key[i : i + n] for i in range(len(key) - n + 1)]


def test_the_key_is_scrubbed_before_a_long_message_is_cut_short(server):
    key = "sk-" + "a1b2c3" * 20  # long: the echoed message is cut in the middle of its second copy
    server.fail("status", status=401, echo_auth=True)
    with pytest.raises(CloudError) as info:
        make(server, api_key=key).complete(HELLO)
    assert "[redacted]" in str(info.value) and not [p for p in pieces_of(key) if p in str(info.value)]


def test_the_key_loses_pasted_whitespace_and_a_bad_one_is_refused_unseen(server, monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", f"  {KEY}\r\n")
    assert CloudModel(server.url, "big-model").complete(HELLO).text.startswith("Hello")
    assert server.requests[-1].authorization == f"Bearer {KEY}"
    for bad in (f"{KEY}\x00tail", f"sk-tëst-{KEY[8:]}", f"{KEY[:10]}\n{KEY[10:]}"):
        with pytest.raises(InvalidOptionError, match="control or non-ASCII") as info:
            CloudModel(server.url, "big-model", api_key=bad)
        message = str(info.value)
        assert "\n" not in message and not [p for p in pieces_of(bad, 6) if p in message]


def test_a_200_web_page_is_named_as_such_and_not_retried(server):
    for call in (lambda cloud: cloud.complete(HELLO), lambda cloud: list(cloud.stream(HELLO))):
        server.fail("html")
        with pytest.raises(CloudError, match="answered text/html, not an event stream or JSON.*--cloud-url") as info:
            call(make(server))
        assert info.value.kind == "protocol"
    assert len(server.requests) == 2


def test_a_line_that_never_ends_is_cut_at_its_bound(server):
    """The client gives up once the line passes its bound, while the server is still sending: not at the end
    of the stream nor at the read timeout. (Told by the server seeing it hang up, not by the clock: with both
    cores busy the server sent the bound's megabyte slower than a 2.5 s limit allowed.)"""
    server.fail("no_newline", seconds=0.001, duration=30)  # 4 KiB a millisecond at most, without a newline
    with pytest.raises(CloudError, match="line longer than") as info:
        list(make(server, read_timeout=5).stream(HELLO))
    assert info.value.kind == "protocol"
    deadline = time.monotonic() + 10
    while server.hangups == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.hangups == 1  # the server noticed the client leave mid-line, long before its 30 s were up


def test_the_total_timeout_holds_while_a_stream_trickles(server):
    server.fail("no_newline", seconds=0.05, duration=6)  # a read never waits long: only the total bounds it
    start = time.monotonic()
    with pytest.raises(CloudError, match="total timeout of 1 s") as info:
        list(make(server, read_timeout=5, total_timeout=1).stream(HELLO))
    assert info.value.kind == "timeout" and time.monotonic() - start < 2.5


def test_a_stream_that_never_sends_done_is_cut_for_its_max_tokens(server):
    server.fail("no_done", seconds=0.0005, duration=4)
    pieces = []
    with pytest.raises(CloudError, match="more than 96 pieces of text for max_tokens=40") as info:
        for piece in make(server, read_timeout=5).stream(HELLO, max_tokens=40):
            pieces.append(piece)
    assert info.value.kind == "protocol" and len(pieces) == 96


def test_a_huge_reply_fails_at_its_bound_while_it_is_read(server):
    server.fail("huge", size=10 << 20)
    with pytest.raises(CloudError, match="reply is longer than 4194304 bytes") as info:
        make(server, read_timeout=5).complete(HELLO, max_tokens=100_000)
    assert info.value.kind == "protocol"
    server.fail("huge", size=10 << 20)  # streamed: the text outgrows what max_tokens can hold
    with pytest.raises(CloudError, match="more than 3072 characters for max_tokens=24"):
        list(make(server, read_timeout=5).stream(HELLO, max_tokens=24))


def aborted(stream) -> tuple[CloudError, float]:
    """Abort ``stream`` from another thread 0.3 s into its first read: the error, and how long the read took."""
    threading.Timer(0.3, stream.abort).start()
    start = time.monotonic()
    with pytest.raises(CloudError) as info:
        next(stream)
    return info.value, time.monotonic() - start


def test_cancel_reaches_a_call_waiting_for_headers_on_a_new_or_kept_alive_connection(server):
    cloud = make(server, read_timeout=5, total_timeout=60)
    for _ in range(2):  # first on a new connection, then on the one kept alive
        server.fail("silent")
        error, seconds = aborted(cloud.stream(HELLO))
        assert error.kind == "cancelled" and seconds < 1.5
        assert cloud.complete(HELLO).text.startswith("Hello")  # the next call is not disturbed
    deadline = time.monotonic() + 2
    while server.hangups < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.hangups == 2  # the server saw each connection go


def test_cancel_reaches_a_call_still_connecting():
    with backlog_full() as url:
        error, seconds = aborted(CloudModel(url, "big-model", connect_timeout=5, total_timeout=60).stream(HELLO))
        assert error.kind == "cancelled" and seconds < 1.5


def test_abort_from_another_thread_cuts_the_connection(server):
    server.fail("slow", seconds=0.3)
    stream = make(server, read_timeout=5).stream(HELLO)
    assert next(stream) == "Hello "
    threading.Timer(0.1, stream.abort).start()
    start = time.monotonic()
    with pytest.raises(CloudError) as info:
        list(stream)
    assert info.value.kind == "cancelled" and time.monotonic() - start < 0.3
    deadline = time.monotonic() + 2
    while server.hangups == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.hangups == 1  # the server noticed and stopped sending


def test_a_server_that_ignores_stream_is_read_as_one_answer(server):
    server.ignore_stream = True  # answers plain JSON even when events were asked for
    stream = make(server).stream(HELLO)
    assert list(stream) == ["Hello from the cloud model."]
    assert stream.finish_reason == "stop" and stream.usage.completion_tokens == 5
    server.fail("invalid_json")
    with pytest.raises(CloudError, match="not valid JSON"):
        list(make(server).stream(HELLO))
