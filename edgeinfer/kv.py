"""The fixed-budget KV cache: how many tokens a budget buys, and what happens when it fills.

The engine owns this; backends only allocate the capacity they are given and
remove or shift ranges when the policy says so.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Literal

from edgeinfer.errors import ContextFull, InvalidOptionError
from edgeinfer.sizes import TOKEN_COUNT, format_size, parse_size

DEFAULT_KV_BUDGET = "4096tok"
# The most the prompt cache on disk holds (edgeinfer.prompt_cache); a 1,000-token prefix of SmolLM2 at f16 takes
# about 23 MB.
DEFAULT_PROMPT_CACHE_SIZE = "2GB"
# Below this a cache cannot hold a sink, a window and a new token at once.
MIN_KV_TOKENS = 16
PolicyName = Literal["sinks", "shift", "error"]
POLICIES: tuple[PolicyName, ...] = ("sinks", "shift", "error")

# StreamingLLM keeps 4 attention-sink tokens; fewer lets perplexity explode once the start is evicted.
STREAMING_SINKS = 4


@dataclass(frozen=True)
class KVBudget:
    """A cap on the KV cache, either in bytes or in tokens (exactly one is set)."""

    bytes: int | None = None
    tokens: int | None = None

    def __post_init__(self) -> None:
        if (self.bytes is None) == (self.tokens is None) or (self.bytes or self.tokens or 0) <= 0:
            raise InvalidOptionError("a KV budget is a positive number of bytes or of tokens, not both")

    def __str__(self) -> str:
        return f"{self.tokens} tokens" if self.tokens is not None else format_size(self.bytes or 0)

    def describe(self, capacity: int) -> str:
        """The budget with what it buys, for messages: ``"512 tokens"``, ``"64.0 MB = 2560 tokens"``."""
        return f"{capacity} tokens" if self.tokens is not None else f"{self} = {capacity} tokens"

    @classmethod
    def parse(cls, value: str | int | KVBudget) -> KVBudget:
        """``"64MB"``, ``"1.5GiB"``, ``"512tok"``; a bare int is a byte count."""
        if isinstance(value, KVBudget):
            return value
        if isinstance(value, int) and not isinstance(value, bool):
            text = str(value)
        elif isinstance(value, str):
            text = value
        else:
            raise InvalidOptionError(f"kv_budget must be a string such as '64MB' or '512tok', got {value!r}")
        tokens = TOKEN_COUNT.match(text)
        if tokens is None:
            return cls(bytes=parse_size(text, "KV budget", or_else=" or tokens such as '512tok'"))
        if int(tokens.group(1)) == 0:
            raise InvalidOptionError(f"KV budget {value!r} is zero; give a positive size such as '64MB' or '512tok'")
        return cls(tokens=int(tokens.group(1)))

    def capacity(self, bytes_per_token: float, block: int) -> int:
        """Tokens this budget holds when the backend allocates KV in multiples of ``block`` tokens.

        A byte budget rounds down to whole blocks, so the real allocation never exceeds it.
        A token budget is the caller's exact limit even if the backend pads its allocation.
        """
        if self.tokens is not None:
            return self.tokens
        if bytes_per_token <= 0:  # a recurrent model's state does not grow with the tokens it has seen
            return sys.maxsize
        fits = int((self.bytes or 0) // bytes_per_token)
        tokens = fits // block * block
        if tokens < block:
            unit = f"{block} token" + ("s" if block != 1 else "")
            # A count of tokens written without its unit reads as bytes ("4096" for "4096tok"): say so.
            typo = f" (a number alone is bytes: {self.bytes} tokens is '{self.bytes}tok')" if fits < 1 else ""
            raise InvalidOptionError(
                f"KV budget {self} holds {fits} tokens, less than the backend's allocation unit of {unit} "
                f"({format_size(int(block * bytes_per_token))}); raise --kv-budget{typo}"
            )
        return tokens


@dataclass(frozen=True)
class KVPolicy:
    """What to do when the cache is full.

    - ``sinks`` (StreamingLLM): keep the first ``n_keep`` tokens (default 4 attention sinks) and the
      most recent window; drop the oldest quarter of the window at a time.
    - ``shift`` (llama-server's context shift): keep the first ``n_keep`` tokens (default 0, plus BOS)
      and drop half of the rest (``n_discard`` overrides).
    - ``error``: raise ContextFull.
    """

    name: PolicyName = "sinks"
    n_keep: int | None = None
    n_discard: int | None = None

    def __post_init__(self) -> None:
        if self.name not in POLICIES:
            raise InvalidOptionError(f"unknown KV policy {self.name!r}; choose one of {', '.join(POLICIES)}")
        if (self.n_keep is not None and self.n_keep < 0) or (self.n_discard is not None and self.n_discard < 1):
            raise InvalidOptionError("KV policy n_keep must be >= 0 and n_discard >= 1")

    @classmethod
    def parse(cls, value: str | KVPolicy) -> KVPolicy:
        return value if isinstance(value, KVPolicy) else cls(value)  # type: ignore[arg-type]

    def keep(self, has_bos: bool) -> int:
        if self.n_keep is not None:
            return self.n_keep
        return STREAMING_SINKS if self.name == "sinks" else int(has_bos)

    def eviction(self, n_cached: int, n_incoming: int, capacity: int, *, has_bos: bool, budget: str) -> tuple[int, int]:
        """The range [start, end) to evict so ``n_incoming`` more tokens fit after ``n_cached``.

        ``budget`` describes the budget for the ContextFull message, e.g. ``"512 tokens"``.
        """
        needed = n_cached + n_incoming - capacity
        if self.name == "error":
            raise ContextFull(
                f"KV cache full: {n_cached} + {n_incoming} tokens exceed the KV budget ({budget}); "
                "raise --kv-budget or choose --kv-policy sinks or shift"
            )
        keep = max(0, min(self.keep(has_bos), capacity - n_incoming - 1))
        window = n_cached - keep
        chunk = self.n_discard or (window // 4 if self.name == "sinks" else window // 2)
        drop = min(max(needed, chunk, 1), window)
        return keep, keep + drop

    def fit_prompt(self, tokens: list[int], capacity: int, reserve: int, *, has_bos: bool, budget: str) -> list[int]:
        """A prompt too long for the cache keeps its head (``n_keep``) and its newest tail.

        ``sinks`` and ``shift`` cut it to leave ``reserve`` tokens free for the answer;
        ``error`` raises ContextFull only if the prompt alone does not fit.
        """
        if self.name == "error":
            if len(tokens) > capacity:
                raise ContextFull(
                    f"the prompt is {len(tokens)} tokens but the KV budget ({budget}) holds {capacity}; "
                    "raise --kv-budget or choose --kv-policy sinks or shift"
                )
            return tokens
        room = capacity - reserve
        if len(tokens) <= room:
            return tokens
        keep = min(self.keep(has_bos), room // 2)
        return tokens[:keep] + tokens[len(tokens) - (room - keep) :]
