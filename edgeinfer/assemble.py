"""From options to what answers: the local ``Engine`` alone, or a ``Router`` in front of it and a cloud model.

``edgeinfer run`` and ``edgeinfer chat`` both build here, so a route, a cloud and a threshold mean
the same to both:

    engine, answerer = open_answerer(Route("auto", samples=4), model="smollm2-135m", threads=2)
    try:
        print(answerer.chat("What is 4738 * 2913?").text)
    finally:
        close_answerer(engine, answerer)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Union

from edgeinfer.engine import Engine
from edgeinfer.errors import InvalidOptionError

if TYPE_CHECKING:
    from edgeinfer.routing.cloud import CloudModel
    from edgeinfer.routing.router import Policy, Router

LOCAL = "local"
# What answers: the engine itself, or a router in front of it and a cloud model. The routing modules load
# only for a route that leaves the device: httpx, which the cloud client needs, takes a tenth of a second.
Answerer = Union[Engine, "Router"]  # noqa: UP007  # a name not imported yet can only be a string in a Union


@dataclass(frozen=True)
class Route:
    """Where answers come from.

    ``local``: this device only; nothing is sent anywhere, not even when the local model fails.
    ``auto`` and ``cloud``: a ``Router`` between the engine and the cloud model at ``cloud_url``
    named ``cloud_model`` (default: ``$EDGEINFER_CLOUD_URL``, ``$EDGEINFER_CLOUD_MODEL``), with
    ``Policy(mode, threshold, samples)``; ``threshold`` None is the policy's default.
    """

    mode: str = LOCAL
    cloud_url: str | None = None
    cloud_model: str | None = None
    threshold: float | None = None
    samples: int = 0

    def check(self) -> None:
        """Raise InvalidOptionError, naming the fix, for a route that cannot be taken (connects to nothing)."""
        self.policy()
        if self.mode != LOCAL:
            self.open_cloud().close()

    def policy(self) -> Policy:
        from edgeinfer.routing.router import MODES, Policy

        if self.mode not in MODES:
            raise InvalidOptionError(f"unknown route {self.mode!r}; choose one of {', '.join(MODES)}")
        threshold = {} if self.threshold is None else {"threshold": self.threshold}
        return Policy(self.mode, samples=self.samples, **threshold)  # type: ignore[arg-type]  # checked above

    def open_cloud(self) -> CloudModel:
        from edgeinfer.routing.cloud import CloudModel

        return CloudModel(self.cloud_url, self.cloud_model)


def open_answerer(route: Route, **engine_options: Any) -> tuple[Engine, Answerer]:
    """Load an ``Engine(**engine_options)`` and put ``route`` in front of it; returns the engine (for its
    KV cache and threads) and what to ask. Slow: it loads a model. The route is checked first, so a bad
    cloud URL or threshold costs no load."""
    if route.mode == LOCAL:
        engine = Engine(**engine_options)
        return engine, engine
    from edgeinfer.routing.router import Router

    policy = route.policy()
    cloud = route.open_cloud()
    try:
        engine = Engine(**engine_options)
    except BaseException:
        cloud.close()
        raise
    return engine, Router(engine, cloud, policy=policy)


def close_answerer(engine: Engine, answerer: Answerer) -> None:
    """Close what ``open_answerer`` opened; waits for a generation that is still stopping."""
    if answerer is not engine:  # a Router, and its cloud model
        answerer.cloud.close()
    engine.close()
