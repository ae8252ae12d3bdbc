"""The terminal chat, driven through Textual's pilot on the real default model."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable

import pytest
from click.testing import CliRunner
from textual.pilot import Pilot
from textual.widgets import Markdown, Static

from edgeinfer import EdgeInferError
from edgeinfer.cli import cli
from edgeinfer.tui.app import THREAD_PREFIX, ChatApp
from edgeinfer.tui.settings import ChatSettings
from edgeinfer.tui.widgets import PromptInput

from openai_server import OpenAIServer
from support import SYSTEM

JAPAN = "What is the capital of Japan?"
STORY = "Write a very long story about a robot who learns to paint, with many chapters."
SIZE = (100, 40)


@pytest.fixture
def settings(model_path) -> ChatSettings:
    # Greedy with the tests' system prompt, JAPAN answers "Tokyo" by a wide margin (support.JAPAN). One thread:
    # the UI needs the other core, and the tests' machine is shared.
    return ChatSettings(
        model=str(model_path), system=SYSTEM, temperature=0, max_tokens=32, kv_budget="2048tok", threads=1
    )


async def until(pilot: Pilot, condition: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}; the chat says: {said(pilot.app)}")  # type: ignore[arg-type]
        await pilot.pause(0.02)


async def ready(pilot: Pilot) -> ChatApp:
    app: ChatApp = pilot.app  # type: ignore[assignment]
    await until(pilot, lambda: not app.loading, "the model to load")
    return app


async def send(pilot: Pilot, text: str) -> None:
    pilot.app.query_one(PromptInput).value = text
    await pilot.press("enter")


async def answer(pilot: Pilot, text: str) -> str:
    """Send ``text`` and wait for the whole answer; its Markdown source."""
    app: ChatApp = pilot.app  # type: ignore[assignment]
    before = len(answers(app))
    await send(pilot, text)
    await until(pilot, lambda: len(answers(app)) > before and not app.answering, "the answer")
    return answers(app)[-1]


def answers(app: ChatApp) -> list[str]:
    return [md.source for md in app.query("#conversation > Markdown.assistant").results(Markdown)]


def said(app: ChatApp, kind: str = "note, .error") -> list[str]:
    """The notes and errors in the conversation (or the ``kind`` of line given)."""
    return [str(w.content) for w in app.query(f"#conversation > .{kind}").results(Static)]


def errors(app: ChatApp) -> list[str]:
    return said(app, "error")


async def test_typing_a_prompt_streams_a_markdown_answer_and_updates_the_stats(settings):
    app = ChatApp(settings)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        assert "SmolLM2-135M-Instruct" in app.status.text and "route local" in app.status.text
        assert app.status.stats.ram_bytes > 50 * 2**20  # the model is mapped in
        await pilot.click("#prompt")
        await pilot.press(*JAPAN, "enter")  # typed key by key, as a person would
        await until(pilot, lambda: bool(answers(app)) and not app.answering, "the answer")

        assert "Tokyo" in answers(app)[-1]
        assert app.messages == [
            {"role": "user", "content": JAPAN},
            {"role": "assistant", "content": answers(app)[-1]},
        ]
        stats = app.status.stats
        assert stats.ttft_s and stats.ttft_s > 0 and stats.tokens_per_s and stats.tokens_per_s > 0
        assert app.engine is not None and stats.kv_used == app.engine.kv_used > 0 and stats.kv_capacity == 2048
        assert f"{stats.kv_used}/2048 tokens" in app.status.text and "tok/s" in app.status.text
        assert errors(app) == []

        prompt = app.query_one(PromptInput)
        assert prompt.value == ""
        await pilot.press("up")
        assert prompt.value == JAPAN
        await pilot.press("down")
        assert prompt.value == ""


async def test_an_answer_can_be_cancelled_mid_stream_and_the_chat_goes_on(settings):
    app = ChatApp(settings.replace(max_tokens=1000))
    async with app.run_test(size=SIZE, notifications=True) as pilot:
        await ready(pilot)
        await send(pilot, STORY)
        await until(pilot, lambda: bool(answers(app)) and len(answers(app)[-1]) > 20, "some of the answer")
        # The app keeps responding while the answer streams, and the stats move live.
        assert app.answering
        await send(pilot, "/settings")
        await until(pilot, lambda: any(line.startswith("model ") for line in said(app)), "the settings")
        assert app.answering and app.status.stats.tokens_per_s is not None
        partial = answers(app)[-1]

        await pilot.press("ctrl+c")
        await until(pilot, lambda: not app.answering, "the cancel", timeout=5)
        assert said(app)[-1] == "Cancelled."
        assert app.messages[-1]["role"] == "assistant" and app.messages[-1]["content"].startswith(partial)
        assert len(app.messages[-1]["content"]) < 3000  # well short of 1000 tokens
        assert app.is_running

        await send(pilot, STORY)  # Esc cancels too
        await until(pilot, lambda: len(answers(app)) == 2 and bool(answers(app)[-1]), "a second answer")
        await pilot.press("escape")
        await until(pilot, lambda: not app.answering, "the second cancel", timeout=5)
        assert said(app)[-1] == "Cancelled."

        await pilot.press("ctrl+c")  # with nothing to cancel: a hint, not an exit
        await pilot.pause(0.1)
        assert app.is_running and any("Press ctrl+q to quit" in str(t.render()) for t in app.query("Toast"))

        await send(pilot, "/reset")
        await pilot.pause()
        assert app.messages == [] and answers(app) == [] and said(app) == ["New conversation."]
        assert app.engine is not None and app.engine.kv_used == 0 == app.status.stats.kv_used
        await send(pilot, "/max-tokens 32")
        assert "Tokyo" in await answer(pilot, JAPAN)


async def test_quitting_mid_answer_stops_the_generation_and_frees_the_model(settings):
    app = ChatApp(settings.replace(max_tokens=1000))
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        engine = app.engine
        await send(pilot, STORY)
        await until(pilot, lambda: bool(answers(app)) and bool(answers(app)[-1]), "some of the answer")
        assert any(t.name.startswith(THREAD_PREFIX) for t in threading.enumerate())
        await pilot.press("ctrl+q")
    assert not app.is_running
    assert [t.name for t in threading.enumerate() if t.name.startswith(THREAD_PREFIX)] == []
    assert engine is not None
    with pytest.raises(EdgeInferError, match="closed"):
        engine.reset()


async def test_save_a_transcript_and_load_it_back(settings, tmp_path):
    app = ChatApp(settings)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        tokyo = await answer(pilot, JAPAN)
        await send(pilot, f"/save {tmp_path / 'chat.json'}")
        await send(pilot, f"/save {tmp_path / 'chat.md'}")
        assert said(app)[-2:] == [f"Saved 2 messages to {tmp_path / name}." for name in ("chat.json", "chat.md")]

        saved = json.loads((tmp_path / "chat.json").read_text())
        assert saved["messages"] == [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": JAPAN},
            {"role": "assistant", "content": tokyo},
        ]
        assert saved["settings"]["temperature"] == 0 and saved["settings"]["max_tokens"] == 32
        markdown = (tmp_path / "chat.md").read_text()
        assert f"## You\n\n{JAPAN}" in markdown and "Tokyo" in markdown.split("## Assistant")[1]
        assert sorted(p.name for p in tmp_path.iterdir()) == ["chat.json", "chat.md"]  # no temp files left

        await send(pilot, f"/save {tmp_path / 'missing-dir' / 'chat.json'}")
        await send(pilot, f"/save {tmp_path / 'chat.txt'}")
        (tmp_path / "notes.json").write_text('{"hello": 1}')
        await send(pilot, f"/load {tmp_path / 'notes.json'}")
        assert len(errors(app)) == 3
        assert "cannot write" in errors(app)[0] and "No such file" in errors(app)[0]
        assert ".md" in errors(app)[1] and "not an edgeinfer chat transcript" in errors(app)[2]

    # A new session picks the conversation up where it was saved.
    app = ChatApp(settings.replace(system="", temperature=0.8))
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, f"/load {tmp_path / 'chat.json'}")
        await pilot.pause()
        assert app.messages == saved["messages"][1:]
        assert app.settings.system == SYSTEM and app.settings.temperature == 0
        assert answers(app) == [tokyo]
        assert said(app)[-1] == f"Loaded 2 messages from {tmp_path / 'chat.json'}."
        follow_up = await answer(pilot, "And what is the capital of Italy?")
        assert follow_up and app.messages[-1] == {"role": "assistant", "content": follow_up}
        assert errors(app) == []


async def test_a_missing_model_is_an_error_in_the_chat_and_the_app_goes_on(settings, model_path):
    app = ChatApp(settings.replace(model="/nonexistent.gguf"))
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        assert len(errors(app)) == 1 and "/nonexistent.gguf" in errors(app)[0]
        assert "Traceback" not in errors(app)[0] and app.status.stats.state == "no model"
        await send(pilot, JAPAN)
        assert said(app)[-1] == "No model is loaded: load one with /model NAME."

        await send(pilot, f"/model {model_path}")
        await ready(pilot)
        assert "Tokyo" in await answer(pilot, JAPAN)

        # A bad /model leaves the chat on the model it had.
        await send(pilot, "/model /nonexistent.gguf")
        await ready(pilot)
        await until(pilot, lambda: said(app)[-1].startswith("Loaded"), "the old model to come back")
        assert len(errors(app)) == 2 and "/nonexistent.gguf" in errors(app)[1]
        assert app.settings.model == str(model_path)
        assert "Tokyo" in await answer(pilot, JAPAN)


async def test_a_full_kv_cache_under_the_error_policy_is_a_message(settings):
    app = ChatApp(settings.replace(kv_budget="64tok", kv_policy="error", max_tokens=40))
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        partial = await answer(pilot, STORY)
        assert partial  # what was generated before the cache filled stays on screen
        assert len(errors(app)) == 1 and "KV cache full" in errors(app)[0] and "/kv-policy sinks" in errors(app)[0]
        assert app.messages == []  # the failed turn is not sent again

        await send(pilot, "/kv-policy sinks")
        await ready(pilot)
        assert app.settings.kv_policy == "sinks"
        story = await answer(pilot, STORY)  # the prompt and 40 tokens overflow 64: sinks makes room
        assert story and len(errors(app)) == 1 and app.messages[-1] == {"role": "assistant", "content": story}


async def test_slash_commands_change_settings_and_explain_mistakes(settings):
    app = ChatApp(settings)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        for line in ("/temperature 0.5", "/max-tokens 64", "/system Answer in French."):
            await send(pilot, line)
        assert (app.settings.temperature, app.settings.max_tokens, app.settings.system) == (
            0.5, 64, "Answer in French."
        )  # fmt: skip
        await send(pilot, "/system")
        assert app.settings.system == ""

        mistakes = {
            "/temperature warm": "'warm' is not a number",
            "/temperature -1": "temperature must be >= 0",
            "/max-tokens 0": "max_tokens must be at least 1",
            "/kv-policy lru": "unknown KV policy 'lru'",
            "/route sky": "unknown route 'sky'",
            "/frobnicate": "unknown command /frobnicate",
            "/save": "name the file",
        }
        for line in mistakes:
            await send(pilot, line)
        await pilot.pause()
        assert len(errors(app)) == len(mistakes)
        for error, needle in zip(errors(app), mistakes.values(), strict=True):
            assert needle in error
        assert app.settings.temperature == 0.5 and app.settings.route == "local"

        await send(pilot, "/help")
        assert "/save FILE" in said(app)[-1] and "Ctrl+Q quits" in said(app)[-1]


def test_the_chat_command_refuses_what_it_cannot_do():
    runner = CliRunner()
    result = runner.invoke(cli, ["chat", "--route", "cloud"], env={"EDGEINFER_CLOUD_URL": None})
    assert result.exit_code == 1
    assert result.stderr.strip() == "error: no cloud URL: pass url= (--cloud-url) or set EDGEINFER_CLOUD_URL"
    result = runner.invoke(cli, ["chat", "--temperature", "-1"])
    assert result.exit_code == 1 and "temperature must be >= 0" in result.stderr
    result = runner.invoke(cli, ["chat"])  # CliRunner's stdin is no terminal
    assert result.exit_code == 1 and "needs a terminal" in result.stderr


async def test_the_route_shows_where_each_answer_came_from_and_why(settings):
    with OpenAIServer(default_answer="The cloud says hello from far away.") as server:
        routed = settings.replace(route="cloud", cloud_url=server.url, cloud_model="oracle")
        app = ChatApp(routed)
        async with app.run_test(size=SIZE) as pilot:
            await ready(pilot)
            assert "The cloud says" in await answer(pilot, JAPAN)
            assert app.status.stats.route == "cloud" and "route cloud (" in app.status.text
            assert len(server.requests) == 1

            server.fail("status", status=500)  # the cloud fails: the local model answers, marked degraded
            server.fail("status", status=500)
            server.fail("status", status=500)
            assert "Tokyo" in await answer(pilot, JAPAN)
            assert app.status.stats.route == "local" and errors(app) == []

            await send(pilot, "/route local")
            await ready(pilot)
            assert "Tokyo" in await answer(pilot, JAPAN)
            assert len(server.requests) <= 4 and app.status.stats.route == "local"


async def test_esc_and_quit_do_not_wait_for_a_cloud_that_never_answers(settings):
    with OpenAIServer() as server:
        app = ChatApp(settings.replace(route="cloud", cloud_url=server.url, cloud_model="oracle"))
        async with app.run_test(size=SIZE) as pilot:
            await ready(pilot)
            server.fail("silent")  # accepts the request, never sends headers (the read timeout is 30 s)
            await send(pilot, JAPAN)
            await until(pilot, lambda: app.answering and len(server.requests) == 1, "the request")
            await pilot.press("escape")
            start = time.monotonic()
            await until(pilot, lambda: not app.answering, "the cancel", timeout=10)
            assert time.monotonic() - start < 2
            assert said(app)[-1] == "Cancelled before the answer began." and errors(app) == []

            server.fail("silent")
            await send(pilot, JAPAN)
            await until(pilot, lambda: app.answering and len(server.requests) == 2, "the second request")
            await pilot.press("ctrl+q")
            start = time.monotonic()
        assert not app.is_running and time.monotonic() - start < 3
        assert [t.name for t in threading.enumerate() if t.name.startswith(THREAD_PREFIX)] == []
        deadline = time.monotonic() + 2
        while server.hangups < 2 and time.monotonic() < deadline:  # the server notices within its 20 ms poll
            time.sleep(0.05)
        assert server.hangups == 2
