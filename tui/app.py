"""``edgeinfer chat``: talk to a model in the terminal and watch the runtime while it answers.

Nothing slow runs on the UI thread. Loading a model and generating an answer each run
in a background thread that reports to the app with messages; an answer's text goes
over in batches at most every FLUSH_S, so a fast model cannot flood the Markdown
renderer. Esc or Ctrl+C cancels an answer (the engine stops after the token in
progress); quitting cancels it, waits for the threads and closes the engine.

The threads are plain ``threading.Thread``s rather than Textual thread workers: Textual
runs those in the event loop's executor and does not wait for them when the app exits,
and quitting must leave nothing running.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from time import perf_counter
from typing import Any

import psutil
from textual import on
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.message import Message as UIMessage
from textual.widgets import Footer, Input, Markdown, Static
from textual.widgets.markdown import MarkdownStream

from edgeinfer import ContextFull, EdgeInferError, Engine, InvalidOptionError, Message, Result
from edgeinfer.tui.settings import AnswerStream, ChatModel, ChatSettings, close_chat, open_chat
from edgeinfer.tui.transcript import load_transcript, save_transcript
from edgeinfer.tui.widgets import PromptInput, StatusBar

FLUSH_S = 0.05  # the UI re-renders an answer at most this often
THREAD_PREFIX = "edgeinfer-chat"

HELP = """\
/help              this list
/reset             start a new conversation (and empty the KV cache)
/save FILE         save the conversation: FILE.md to read, FILE.json to /load later
/load FILE.json    continue a saved conversation (its messages, system prompt and sampling)
/system [TEXT]     set the system prompt; without TEXT, remove it
/model NAME        load another model: a .gguf path, a catalog alias or hf:ORG/REPO/FILE.gguf
/temperature X     sampling temperature; 0 is greedy
/max-tokens N      the longest answer, in tokens
/kv-policy NAME    sinks, shift or error: what happens when the KV cache is full (reloads the model)
/kv-budget SIZE    the KV cache size: tokens (4096tok) or bytes (64MB) (reloads the model)
/route NAME        where answers come from: local, auto or cloud
/settings          the settings now
Esc or Ctrl+C cancels an answer; Up and Down recall earlier prompts; Ctrl+Q quits."""


class ModelLoaded(UIMessage):
    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds


class ModelFailed(UIMessage):
    def __init__(self, error: str, fallback: ChatSettings | None) -> None:
        super().__init__()
        self.error = error
        self.fallback = fallback


class AnswerText(UIMessage):
    """More of the answer, with speeds measured as it arrives."""

    def __init__(self, text: str, ttft_s: float, tokens_per_s: float | None) -> None:
        super().__init__()
        self.text = text
        self.ttft_s = ttft_s
        self.tokens_per_s = tokens_per_s


class AnswerEnded(UIMessage):
    def __init__(self, result: Result | None, error: str | None) -> None:
        super().__init__()
        self.result = result
        self.error = error


class ChatApp(App[None]):
    """A chat with a local model: Markdown answers streamed live, stats, slash commands."""

    TITLE = "edgeinfer chat"
    ENABLE_COMMAND_PALETTE = False  # the slash commands are the commands
    CSS = """
    #conversation { height: 1fr; padding: 0 1; }
    #conversation > .user { margin: 1 0 0 0; padding: 0 1; border-left: outer $primary; background: $boost; }
    #conversation > .assistant { margin: 0; padding: 0 0 0 1; border-left: outer $success; }
    #conversation > .assistant > *:last-child { margin-bottom: 0; }
    #conversation > .note { color: $text-muted; padding: 0 1; }
    #conversation > .error { color: $text-error; padding: 0 1; border-left: outer $error; }
    """
    BINDINGS = [
        Binding("escape", "cancel(False)", "Cancel answer", priority=True),
        Binding("ctrl+c", "cancel(True)", "Cancel answer", show=False, priority=True),
        Binding("ctrl+q", "quit", "Quit", priority=True),
    ]

    def __init__(self, settings: ChatSettings | None = None) -> None:
        super().__init__()
        self.settings = settings or ChatSettings()
        self.messages: list[Message] = []  # the turns; the system prompt lives in the settings
        self._engine: Engine | None = None
        self._chat: ChatModel | None = None
        self._loading = False
        self._stream: AnswerStream | None = None
        self._markdown: MarkdownStream | None = None
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()  # a load thread checks _closing and installs its engine under it
        self._closing = False
        self._process = psutil.Process()

    @property
    def engine(self) -> Engine | None:
        """The local engine, once loaded."""
        return None if self._loading else self._engine

    @property
    def answering(self) -> bool:
        return self._stream is not None

    @property
    def loading(self) -> bool:
        return self._loading

    @property
    def status(self) -> StatusBar:
        return self.query_one(StatusBar)

    @property
    def conversation(self) -> VerticalScroll:
        return self.query_one("#conversation", VerticalScroll)

    def compose(self) -> ComposeResult:
        yield VerticalScroll(id="conversation")
        yield PromptInput(placeholder="Message the model, or /help", id="prompt")
        yield StatusBar()
        yield Footer()

    def on_mount(self) -> None:
        self.conversation.anchor()
        self.query_one(PromptInput).focus()
        self._refresh_ram()
        self.set_interval(1.0, self._refresh_ram)
        self._note("Type a message and press Enter; /help lists the commands.")
        self._load(self.settings, fallback=None)

    def on_unmount(self) -> None:
        # Quitting mid-answer: stop the generation, wait for every thread, then free the model.
        with self._lock:
            self._closing = True
        if self._stream is not None:
            self._stream.cancel()
        for thread in self._threads:
            thread.join()
        if self._engine is not None and self._chat is not None:
            close_chat(self._engine, self._chat)
        self._engine = self._chat = None

    # -- the conversation ----------------------------------------------------------------------

    @on(Input.Submitted, "#prompt")
    async def _submitted(self, event: Input.Submitted) -> None:
        text = event.value.strip()
        if not text:
            return
        prompt = self.query_one(PromptInput)
        if text.startswith("/"):
            prompt.remember(text)
            prompt.value = ""
            await self._command(text)
            return
        refusal = self._why_not_ask()
        if refusal:  # the text stays in the box, to send once the app is ready
            self._note(refusal)
            return
        prompt.remember(text)
        prompt.value = ""
        await self._ask(text)

    def _why_not_ask(self) -> str | None:
        if self._loading:
            return "The model is still loading; press Enter again once it is ready."
        if self.answering:
            return "Wait for this answer, or press Esc to cancel it."
        if self._chat is None:
            return "No model is loaded: load one with /model NAME."
        return None

    async def _ask(self, text: str) -> None:
        assert self._chat is not None
        await self.conversation.mount(Static(text, classes="user", markup=False))
        self.messages.append({"role": "user", "content": text})
        try:
            stream = self._chat.stream(self._with_system(self.messages), self.settings.sampling())
        except Exception as exc:
            self.messages.pop()
            self._error(str(exc) if isinstance(exc, EdgeInferError) else _internal_error(exc))
            return
        self._stream = stream
        answer = Markdown(classes="assistant")
        await self.conversation.mount(answer)
        self._markdown = Markdown.get_stream(answer)
        stats = self.status.stats
        stats.state, stats.ttft_s, stats.tokens_per_s = "answering", None, None
        self.status.show()
        self._spawn("answer", self._generate, stream, perf_counter())

    def _generate(self, stream: AnswerStream, started: float) -> None:
        """Thread: run the stream and post its text in batches, then how it ended."""
        pending: list[str] = []
        first = last_post = 0.0
        chunks = 0
        error = None

        def post() -> None:
            now = perf_counter()
            speed = (chunks - 1) / (now - first) if chunks > 1 and now > first else None
            self.post_message(AnswerText("".join(pending), first - started, speed))
            pending.clear()

        try:
            for chunk in stream:
                now = perf_counter()
                if not chunks:
                    first = now
                chunks += 1
                pending.append(chunk)
                if now - last_post >= FLUSH_S:
                    post()
                    last_post = now
        except ContextFull as exc:
            error = f"{exc} (in this chat: /kv-budget SIZE, /kv-policy sinks, or /reset)"
        except EdgeInferError as exc:
            error = str(exc)
        except Exception as exc:  # a bug: a line in the chat, not a dead app
            error = _internal_error(exc)
        finally:
            stream.close()
        if pending:
            post()
        self.post_message(AnswerEnded(stream.result, error))

    async def on_answer_text(self, message: AnswerText) -> None:
        if self._markdown is not None:
            await self._markdown.write(message.text)
        stats = self.status.stats
        stats.ttft_s, stats.tokens_per_s = message.ttft_s, message.tokens_per_s
        self._refresh_kv()

    async def on_answer_ended(self, message: AnswerEnded) -> None:
        result, stats = message.result, self.status.stats
        if self._markdown is not None:
            await self._markdown.stop()
            if result is not None:  # rendered in one piece: appends can split a list's spacing
                await self._markdown.markdown_widget.update(result.text)
            self._markdown = None
        self._stream = None
        if message.error is not None or result is None:
            self.messages.pop()  # the question stays on screen but is not sent again
            self._error(message.error or "the answer ended without a result")
        elif result.finish_reason == "cancelled" and not result.text:
            self.messages.pop()
            self._note("Cancelled before the answer began.")
        else:
            self.messages.append({"role": "assistant", "content": result.text})
            if result.finish_reason == "cancelled":
                self._note("Cancelled.")
            elif result.finish_reason == "length":
                self._note(f"Stopped at {self.settings.max_tokens} tokens; /max-tokens N allows longer answers.")
            m = result.metrics
            stats.ttft_s = m.ttft_s
            stats.tokens_per_s = m.tokens_per_s if m.output_tokens > 1 else stats.tokens_per_s
            stats.route, stats.reason = result.route, getattr(result, "reason", None) or ""
        stats.state = "ready"
        self._refresh_kv()

    def action_cancel(self, hint: bool) -> None:
        """Stop the answer in progress (the engine stops after the token it is on)."""
        if self._stream is not None:
            self._stream.cancel()
            self.status.stats.state = "cancelling"
            self.status.show()
        elif hint:  # Ctrl+C out of habit: say how to quit rather than quit
            self.action_help_quit()

    def _with_system(self, turns: list[Message]) -> list[Message]:
        system: list[Message] = [{"role": "system", "content": self.settings.system}] if self.settings.system else []
        return system + turns

    # -- the model -----------------------------------------------------------------------------

    def _load(self, settings: ChatSettings, fallback: ChatSettings | None) -> None:
        """Swap in a model built from ``settings``; if it fails, load ``fallback`` again."""
        old = (self._engine, self._chat) if self._engine is not None and self._chat is not None else None
        self._engine = self._chat = None
        self._loading = True
        self.settings = settings
        stats = self.status.stats
        stats.state, stats.model, stats.backend = f"loading {Path(settings.model).name}…", "-", "-"
        stats.route, stats.reason, stats.kv_used, stats.kv_capacity = settings.route, "", 0, 0
        self.status.show()
        self._spawn("load", self._open, settings, old, fallback)

    def _open(
        self, settings: ChatSettings, old: tuple[Engine, ChatModel] | None, fallback: ChatSettings | None
    ) -> None:
        """Thread: close the old model (its memory is needed), then load the new one."""
        started = perf_counter()
        try:
            if old is not None:
                close_chat(*old)
            engine, chat = open_chat(settings)
        except EdgeInferError as exc:
            self.post_message(ModelFailed(str(exc), fallback))
            return
        except Exception as exc:
            self.post_message(ModelFailed(_internal_error(exc), fallback))
            return
        with self._lock:
            if self._closing:  # the app is gone: nobody will use it
                close_chat(engine, chat)
                return
            self._engine, self._chat = engine, chat
        self.post_message(ModelLoaded(perf_counter() - started))

    def on_model_loaded(self, message: ModelLoaded) -> None:
        self._loading = False
        engine = self._engine
        assert engine is not None
        stats = self.status.stats
        stats.state, stats.model, stats.backend = "ready", engine.model_path.name, engine.backend.name
        self._refresh_kv()
        self._note(
            f"Loaded {engine.model_path.name} on {engine.backend.name} in {message.seconds:.1f} s: "
            f"KV cache {engine.capacity} tokens ({engine.kv_policy.name}), "
            f"{engine.threads} thread{'s' if engine.threads > 1 else ''}."
        )

    def on_model_failed(self, message: ModelFailed) -> None:
        self._loading = False
        self._error(message.error)
        if message.fallback is not None:
            self._note(f"Going back to {message.fallback.model}.")
            self._load(message.fallback, fallback=None)
        else:
            self.status.stats.state = "no model"
            self.status.show()
            self._note("Load a model with /model NAME.")

    # -- slash commands ------------------------------------------------------------------------

    async def _command(self, line: str) -> None:
        name, _, arg = line[1:].partition(" ")
        command = _COMMANDS.get(name.lower())
        if command is None:
            self._error(f"unknown command /{name}; /help lists the commands")
            return
        method, needs_idle = command
        if needs_idle and (self._loading or self.answering):
            what = "the model to load" if self._loading else "this answer, or press Esc to cancel it"
            self._note(f"Wait for {what}, then /{name} again.")
            return
        try:
            await getattr(self, method)(arg.strip())
        except EdgeInferError as exc:
            self._error(str(exc))
        except Exception as exc:
            self._error(_internal_error(exc))

    async def _cmd_help(self, arg: str) -> None:
        self._note(HELP)

    async def _cmd_reset(self, arg: str) -> None:
        self.messages.clear()
        await self.conversation.remove_children()
        if self._engine is not None:
            self._engine.reset()
        stats = self.status.stats
        stats.ttft_s = stats.tokens_per_s = None
        self._refresh_kv()
        self._note("New conversation.")

    async def _cmd_save(self, arg: str) -> None:
        if not arg:
            raise InvalidOptionError("name the file: /save FILE.md or /save FILE.json")
        path = save_transcript(arg, self._with_system(self.messages), self.settings)
        self._note(f"Saved {len(self.messages)} messages to {path}.")

    async def _cmd_load(self, arg: str) -> None:
        if not arg:
            raise InvalidOptionError("name the file: /load FILE.json")
        messages, saved = load_transcript(arg)
        system = ""
        if messages and messages[0]["role"] == "system":
            system = messages.pop(0)["content"]
        settings = self.settings.replace(system=system)
        for key in ("temperature", "max_tokens"):
            try:
                candidate = settings.replace(**{key: saved[key]})
                candidate.check()
            except (KeyError, TypeError, EdgeInferError):
                continue  # not saved, or not usable: keep the current value
            settings = candidate
        self.settings = settings
        self.messages = messages
        await self.conversation.remove_children()
        for m in messages:
            if m["role"] == "assistant":
                await self.conversation.mount(Markdown(m["content"], classes="assistant"))
            else:
                await self.conversation.mount(Static(m["content"], classes=m["role"], markup=False))
        self._note(f"Loaded {len(messages)} messages from {Path(arg).expanduser()}.")

    async def _cmd_system(self, arg: str) -> None:
        self.settings = self.settings.replace(system=arg)
        self._note(f"System prompt: {arg}" if arg else "System prompt removed.")

    async def _cmd_model(self, arg: str) -> None:
        if not arg:
            raise InvalidOptionError(f"name the model: /model NAME (now {self.settings.model})")
        self._reload(model=arg)

    async def _cmd_temperature(self, arg: str) -> None:
        self.settings = self._changed(temperature=_number(arg, float, "/temperature 0.7"))
        self._note(f"Temperature {self.settings.temperature}.")

    async def _cmd_max_tokens(self, arg: str) -> None:
        self.settings = self._changed(max_tokens=_number(arg, int, "/max-tokens 512"))
        self._note(f"Answers stop after {self.settings.max_tokens} tokens.")

    async def _cmd_kv_policy(self, arg: str) -> None:
        self._reload(kv_policy=arg or "(none)")

    async def _cmd_kv_budget(self, arg: str) -> None:
        self._reload(kv_budget=arg or "(none)")

    async def _cmd_route(self, arg: str) -> None:
        self._reload(route=arg or "(none)")

    async def _cmd_settings(self, arg: str) -> None:
        s = self.settings
        self._note(
            "\n".join(
                [
                    f"model        {s.model}",
                    f"backend      {s.backend}",
                    f"route        {s.route}",
                    f"system       {s.system or '(none)'}",
                    f"temperature  {s.temperature}",
                    f"max tokens   {s.max_tokens}",
                    f"KV budget    {s.kv_budget}",
                    f"KV policy    {s.kv_policy or 'the default'}",
                    f"threads      {s.threads or 'the free cores'}",
                ]
            )
        )

    def _changed(self, **changes: Any) -> ChatSettings:
        settings = self.settings.replace(**changes)
        settings.check()
        return settings

    def _reload(self, **changes: Any) -> None:
        settings = self._changed(**changes)
        if settings == self.settings and self._engine is not None:
            self._note("Nothing to change.")
            return
        self._load(settings, fallback=self.settings if self._engine is not None else None)

    # -- helpers -------------------------------------------------------------------------------

    def _spawn(self, name: str, target: Callable[..., None], *args: object) -> None:
        if self._closing:  # quitting already: on_unmount has joined the threads it will wait for
            return
        self._threads = [t for t in self._threads if t.is_alive()]
        thread = threading.Thread(target=target, args=args, name=f"{THREAD_PREFIX}-{name}", daemon=True)
        self._threads.append(thread)
        thread.start()

    def _note(self, text: str) -> None:
        self.conversation.mount(Static(text, classes="note", markup=False))

    def _error(self, text: str) -> None:
        self.conversation.mount(Static(f"error: {text}", classes="error", markup=False))

    def _refresh_kv(self) -> None:
        stats = self.status.stats
        if self._engine is not None and not self._loading:
            stats.kv_used, stats.kv_capacity = self._engine.kv_used, self._engine.capacity
        self.status.show()

    def _refresh_ram(self) -> None:
        self.status.stats.ram_bytes = self._process.memory_info().rss
        self.status.show()


# name: (method, needs no answer running and no model loading)
_COMMANDS: dict[str, tuple[str, bool]] = {
    "help": ("_cmd_help", False),
    "reset": ("_cmd_reset", True),
    "save": ("_cmd_save", False),
    "load": ("_cmd_load", True),
    "system": ("_cmd_system", False),
    "model": ("_cmd_model", True),
    "temperature": ("_cmd_temperature", False),
    "temp": ("_cmd_temperature", False),
    "max-tokens": ("_cmd_max_tokens", False),
    "kv-policy": ("_cmd_kv_policy", True),
    "kv-budget": ("_cmd_kv_budget", True),
    "route": ("_cmd_route", True),
    "settings": ("_cmd_settings", False),
}


def _number(text: str, kind: Callable[[str], float], example: str) -> Any:
    try:
        return kind(text)
    except ValueError:
        raise InvalidOptionError(f"{text!r} is not a number; for example {example}") from None


def _internal_error(exc: Exception) -> str:
    return f"internal error ({type(exc).__name__}: {' '.join(str(exc).split())}); please report it"
