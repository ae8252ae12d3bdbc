"""The chat's own widgets: a prompt box with history, and the live status bar."""

from __future__ import annotations

from dataclasses import dataclass

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.widgets import Input, ProgressBar, Static


class PromptInput(Input):
    """An input box that recalls earlier prompts with Up and Down, as a shell does."""

    BINDINGS = [
        Binding("up", "recall(-1)", "Earlier prompt", show=False),
        Binding("down", "recall(1)", "Later prompt", show=False),
    ]

    def __init__(self, placeholder: str = "", *, id: str | None = None) -> None:
        super().__init__(placeholder=placeholder, id=id)
        self.history: list[str] = []
        self._index = 0
        self._draft = ""  # what was typed before browsing, given back past the newest entry

    def remember(self, text: str) -> None:
        if text and (not self.history or self.history[-1] != text):
            self.history.append(text)
        self._index = len(self.history)

    def action_recall(self, step: int) -> None:
        if not self.history:
            return
        if self._index == len(self.history):
            self._draft = self.value
        self._index = max(0, min(len(self.history), self._index + step))
        self.value = self.history[self._index] if self._index < len(self.history) else self._draft
        self.cursor_position = len(self.value)


@dataclass
class Stats:
    """What the status bar shows; the app fills it in as things happen."""

    state: str = "starting"
    model: str = "-"
    backend: str = "-"
    route: str = "local"
    reason: str = ""
    ttft_s: float | None = None
    tokens_per_s: float | None = None
    kv_used: int = 0
    kv_capacity: int = 0
    ram_bytes: int = 0


class StatusBar(Vertical):
    """Two lines: what answers (model, backend, route) and how it is doing (speed, KV, RAM)."""

    DEFAULT_CSS = """
    StatusBar { height: 2; background: $panel; padding: 0 1; }
    StatusBar Horizontal { height: 1; }
    StatusBar #speed { width: auto; }
    StatusBar #kv-label { width: auto; margin: 0 0 0 2; }
    StatusBar #kv { width: 24; margin: 0 1; }
    StatusBar #kv #bar { width: 16; }
    StatusBar #kv-text { width: auto; }
    StatusBar #ram { width: auto; margin: 0 0 0 2; }
    """

    def __init__(self) -> None:
        super().__init__()
        self.stats = Stats()

    def compose(self) -> ComposeResult:
        yield Static(id="identity", markup=False)
        with Horizontal():
            yield Static(id="speed", markup=False)
            yield Static("KV", id="kv-label")
            yield ProgressBar(total=1, show_eta=False, id="kv")
            yield Static(id="kv-text", markup=False)
            yield Static(id="ram", markup=False)

    def on_mount(self) -> None:
        self.show()

    def show(self) -> None:
        if not self.app.is_running:  # shutting down: a timer's last tick may find the children removed
            return
        s = self.stats
        route = f"{s.route} ({s.reason})" if s.reason else s.route
        self.query_one("#identity", Static).update(f"{s.model} · {s.backend} · route {route} · {s.state}")
        ttft = f"{s.ttft_s * 1000:.0f} ms" if s.ttft_s is not None else "-"
        speed = f"{s.tokens_per_s:.1f} tok/s" if s.tokens_per_s is not None else "- tok/s"
        self.query_one("#speed", Static).update(f"TTFT {ttft} · {speed}")
        self.query_one("#kv", ProgressBar).update(total=max(s.kv_capacity, 1), progress=s.kv_used)
        self.query_one("#kv-text", Static).update(f"{s.kv_used}/{s.kv_capacity} tokens")
        self.query_one("#ram", Static).update(f"RAM {s.ram_bytes / 2**20:,.0f} MiB")

    @property
    def text(self) -> str:
        """Everything the bar says, as plain text (for tests and screen readers)."""
        parts = [str(self.query_one(f"#{name}", Static).content) for name in ("identity", "speed", "kv-text", "ram")]
        return " · ".join(parts)
