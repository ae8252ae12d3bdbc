"""The chat's settings, and the one place where they become a model to talk to.

``open_chat`` returns the local engine (for the KV gauge and resets) and the object answers
come from: that same engine, or a Router in front of it and a cloud model, whose results
say which side answered and why.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from edgeinfer import Engine, InvalidOptionError, KVBudget, KVPolicy, Result, SamplingParams
from edgeinfer.kv import DEFAULT_KV_BUDGET
from edgeinfer.models.catalog import DEFAULT_MODEL
from edgeinfer.routing.cloud import CloudModel
from edgeinfer.routing.router import Router
from edgeinfer.system import default_threads

ROUTES = ("local", "auto", "cloud")
_SAMPLING = SamplingParams()


class AnswerStream(Protocol):
    """Text chunks of one answer, cancellable from any thread; ``result`` once they end."""

    result: Result | None

    def __iter__(self) -> Iterator[str]: ...
    def __next__(self) -> str: ...
    def cancel(self) -> None: ...
    def close(self) -> None: ...


# What answers the chat: the engine itself, or a router in front of it and a cloud model.
ChatModel = Engine | Router


@dataclass(frozen=True)
class ChatSettings:
    """What ``edgeinfer chat`` starts with; slash commands change them while it runs."""

    model: str = DEFAULT_MODEL
    backend: str = "auto"
    system: str = ""
    temperature: float = _SAMPLING.temperature
    max_tokens: int = _SAMPLING.max_tokens
    kv_budget: str = DEFAULT_KV_BUDGET
    kv_policy: str = "sinks"
    route: str = "local"
    cloud_url: str | None = None  # default: $EDGEINFER_CLOUD_URL
    cloud_model: str | None = None  # default: $EDGEINFER_CLOUD_MODEL
    threads: int | None = None

    def check(self) -> None:
        """Raise InvalidOptionError, naming the fix, for a value the chat cannot use."""
        check_route(self.route)
        if self.route != "local":
            CloudModel(self.cloud_url, self.cloud_model).close()  # says what is missing
        self.sampling()
        KVPolicy.parse(self.kv_policy)
        KVBudget.parse(self.kv_budget)
        if self.threads is not None and self.threads < 1:
            raise InvalidOptionError(f"threads must be at least 1, got {self.threads}")

    def sampling(self) -> SamplingParams:
        return SamplingParams(temperature=self.temperature, max_tokens=self.max_tokens)

    def replace(self, **changes: Any) -> ChatSettings:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def check_route(route: str) -> None:
    if route not in ROUTES:
        raise InvalidOptionError(f"unknown route {route!r}; choose one of {', '.join(ROUTES)}")


def open_chat(settings: ChatSettings) -> tuple[Engine, ChatModel]:
    """Load the local engine, and what answers through it (slow: call it off the UI thread)."""
    check_route(settings.route)
    # The UI renders while the model decodes; without a core of its own it preempts one of
    # llama.cpp's spinning threads and every token waits (tenfold slower on 2 busy cores).
    threads = settings.threads or max(1, default_threads() - 1)
    engine = Engine(
        settings.model,
        backend=settings.backend,
        kv_budget=settings.kv_budget,
        kv_policy=settings.kv_policy,
        threads=threads,
    )
    if settings.route == "local":
        return engine, engine
    try:
        cloud = CloudModel(settings.cloud_url, settings.cloud_model)
    except BaseException:
        engine.close()
        raise
    return engine, Router(engine, cloud, policy=settings.route)  # type: ignore[arg-type]  # check_route checked it


def close_chat(engine: Engine, chat: ChatModel) -> None:
    """Close what ``open_chat`` opened; waits for a generation that is still stopping."""
    if isinstance(chat, Router):
        chat.cloud.close()
    engine.close()
