"""The chat's settings, and where they become a model to talk to.

``open_chat`` returns the local engine (for the KV gauge and resets) and the object answers
come from: that same engine, or a Router in front of it and a cloud model, whose results
say which side answered and why (built by ``edgeinfer.assemble``, as for ``edgeinfer run``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from edgeinfer import Engine, KVBudget, KVPolicy, Result, SamplingParams
from edgeinfer.assemble import Answerer, Route, close_answerer, open_answerer
from edgeinfer.backends.base import CPU
from edgeinfer.kv import DEFAULT_KV_BUDGET
from edgeinfer.models.catalog import DEFAULT_MODEL
from edgeinfer.speculative import Speculation
from edgeinfer.system import thread_count

_SAMPLING = SamplingParams()
# tui/app.py's names for what answers the chat, and for closing it.
ChatModel = Answerer
close_chat = close_answerer


class AnswerStream(Protocol):
    """Text chunks of one answer, cancellable from any thread; ``result`` once they end."""

    result: Result | None

    def __iter__(self) -> Iterator[str]: ...
    def __next__(self) -> str: ...
    def cancel(self) -> None: ...
    def close(self) -> None: ...


@dataclass(frozen=True)
class ChatSettings:
    """What ``edgeinfer chat`` starts with; slash commands change them while it runs."""

    model: str = DEFAULT_MODEL
    backend: str = "auto"
    system: str = ""
    temperature: float = _SAMPLING.temperature
    max_tokens: int = _SAMPLING.max_tokens
    kv_budget: str = DEFAULT_KV_BUDGET
    kv_policy: str | None = None  # None: the engine's default (sinks, or error where the cache cannot drop tokens)
    speculative: str | None = None  # None: lookup, or draft with a draft model
    draft_model: str | None = None
    route: str = "local"
    cloud_url: str | None = None  # default: $EDGEINFER_CLOUD_URL
    cloud_model: str | None = None  # default: $EDGEINFER_CLOUD_MODEL
    threads: int | None = None
    device: str = CPU
    gpu_layers: int = -1  # placed on ``device`` when it is a GPU (-1: all)

    def check(self) -> None:
        """Raise InvalidOptionError, naming the fix, for a value the chat cannot use."""
        self.routing().check()
        self.sampling()
        if self.kv_policy is not None:
            KVPolicy.parse(self.kv_policy)
        KVBudget.parse(self.kv_budget)
        if self.speculative is not None:
            Speculation.parse(self.speculative)
        if self.threads is not None:
            thread_count(self.threads)  # refuses a count below 1

    def routing(self) -> Route:
        return Route(self.route, self.cloud_url, self.cloud_model)

    def sampling(self) -> SamplingParams:
        return SamplingParams(temperature=self.temperature, max_tokens=self.max_tokens)

    def replace(self, **changes: Any) -> ChatSettings:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def open_chat(settings: ChatSettings) -> tuple[Engine, ChatModel]:
    """Load the local engine, and what answers through it (slow: call it off the UI thread)."""
    return open_answerer(
        settings.routing(),
        model=settings.model,
        backend=settings.backend,
        kv_budget=settings.kv_budget,
        kv_policy=settings.kv_policy,
        speculative=settings.speculative,
        draft=settings.draft_model,
        # The UI renders while the model decodes; without a core of its own it preempts one of
        # llama.cpp's spinning threads and every token waits (tenfold slower on 2 busy cores).
        threads=thread_count(settings.threads, spare=1),
        device=settings.device,
        gpu_layers=settings.gpu_layers,
    )
