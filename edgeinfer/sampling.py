"""How to pick tokens and when to stop: ``SamplingParams``, as every caller passes them.

Apart from the sampler (``edgeinfer.sampler``), so that the command line reads the defaults
without importing numpy: ``edgeinfer --help`` starts in a tenth of a second.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from edgeinfer.errors import InvalidOptionError


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop.

    The defaults are llama.cpp's: on SmolLM2-135M nothing else measured answers everyday
    questions clearly better (docs/BENCHMARKS.md, "The default experience"). ``top_k=0``,
    ``top_p=1`` and ``min_p=0`` each switch their filter off; ``repetition_penalty=1``
    switches the penalty off.

    ``top_k=0`` with ``min_p=0`` leaves the whole vocabulary to sort and weigh on every token:
    about 20 ms for 49,152 entries on a 2.8 GHz Xeon, where the default chain takes about 0.2 ms.
    """

    max_tokens: int = 256
    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repetition_penalty: float = 1.0
    repeat_last_n: int = 64
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    logprobs: bool = False  # report each token's log-probability and the entropy it was drawn from (Result)

    @property
    def argmax_only(self) -> bool:
        """Whether each token is its row's argmax and nothing else of the row is read: greedy, with no repetition
        penalty and no logprobs. A backend may then hand back the token alone (``Span.argmax``)."""
        penalized = self.repetition_penalty != 1.0 and self.repeat_last_n > 0
        return self.temperature == 0 and not penalized and not self.logprobs

    def __post_init__(self) -> None:
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, (tuple, list)) or not all(isinstance(s, str) for s in stop):
            raise InvalidOptionError(f"stop must be a string or a list of strings, got {self.stop!r}")
        object.__setattr__(self, "stop", tuple(s for s in stop if s))
        for name in ("max_tokens", "top_k", "repeat_last_n"):
            if not _is_int(getattr(self, name)):
                raise InvalidOptionError(f"{name} must be an integer, got {getattr(self, name)!r}")
        for name in ("temperature", "top_p", "min_p", "repetition_penalty"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
                raise InvalidOptionError(f"{name} must be a finite number, got {value!r}")
        if self.seed is not None and not (_is_int(self.seed) and 0 <= self.seed < 2**64):
            raise InvalidOptionError(
                f"seed must be a non-negative integer (leave it out for a random one), got {self.seed!r}"
            )
        checks = (
            (self.max_tokens >= 1, f"max_tokens must be at least 1, got {self.max_tokens}"),
            (self.temperature >= 0, f"temperature must be >= 0 (0 is greedy), got {self.temperature}"),
            (self.top_k >= 0, f"top_k must be >= 0 (0 switches it off), got {self.top_k}"),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            (0 <= self.min_p < 1, f"min_p must be in [0, 1), got {self.min_p}"),
            (self.repetition_penalty > 0, f"repetition_penalty must be > 0 (1 is off), got {self.repetition_penalty}"),
            (self.repeat_last_n >= 0, f"repeat_last_n must be >= 0, got {self.repeat_last_n}"),
        )
        for ok, message in checks:
            if not ok:
                raise InvalidOptionError(message)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def sampling_params(params: SamplingParams | None, options: Mapping[str, Any]) -> SamplingParams:
    """``params`` with keyword ``options`` applied, as ``Engine.stream`` takes them."""
    if params is not None and not isinstance(params, SamplingParams):
        raise InvalidOptionError(f"params must be a SamplingParams, got {type(params).__name__}")
    params = params or SamplingParams()
    unknown = set(options) - {f.name for f in dataclasses.fields(SamplingParams)}
    if unknown:
        raise InvalidOptionError(
            f"unknown sampling option {', '.join(sorted(unknown))}; see SamplingParams for the options"
        )
    return dataclasses.replace(params, **options) if options else params
