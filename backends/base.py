"""The backend contract: a logit machine with a KV cache.

A backend loads weights, evaluates tokens at given positions and returns logits,
and keeps its KV cache. It does not sample, stop, template, route or time
anything; the engine does all of that once for every backend. If a new backend
needs a special case in the engine, change this contract instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, Protocol, runtime_checkable

import numpy as np

from edgeinfer.models.info import ModelInfo

# Prompt tokens per evaluation step. The engine reuses a cached prefix in whole chunks of this
# size, so small chunks keep more of a chat cached: on SmolLM2, 64 prefills at 0.94x the best
# size (128) and re-evaluates 84 tokens at a chat's fifth turn, against 212 at 256 or 512
# (scripts/bench_prefill.py --threads 2 --runs 3).
DEFAULT_BATCH_SIZE = 64


@dataclass(frozen=True)
class BackendOptions:
    """How the engine asks a backend to set itself up."""

    kv_tokens: int  # KV slots wanted; the backend may round up to its ``kv_block``
    kv_type: str = "f16"  # one of the backend's ``kv_types``
    threads: int = 1
    batch_size: int = DEFAULT_BATCH_SIZE  # most tokens one evaluation step takes


@runtime_checkable
class Backend(Protocol):
    """What every backend implements. Positions are 0-based and contiguous from 0."""

    name: ClassVar[str]
    kv_block: ClassVar[int]
    """The backend allocates KV in multiples of this many tokens."""
    kv_types: ClassVar[tuple[str, ...]]
    """KV cache element types it supports, e.g. ``("f16", "q8_0")``."""

    @staticmethod
    def weight_bytes(info: ModelInfo) -> int:
        """RAM the weights will take once loaded (for the check before loading)."""
        ...

    @property
    def capacity(self) -> int:
        """KV slots actually allocated (>= the requested ``kv_tokens``)."""
        ...

    @property
    def can_shift(self) -> bool:
        """Whether ``evict`` works (false for caches without positions, e.g. recurrent models)."""
        ...

    @property
    def n_vocab(self) -> int:
        """Length of a row of logits."""
        ...

    def eval(self, tokens: Sequence[int], start: int, *, all_logits: bool = False) -> np.ndarray:
        """Append ``tokens`` at positions ``start, start+1, ...`` to the cache and return logits.

        Returns the last token's logits as a float32 ``(n_vocab,)`` array, or
        ``(len(tokens), n_vocab)`` with ``all_logits``. The array may be a view
        of the backend's own buffer, valid until the next call; copy it to keep it.
        ``start`` must equal the number of cached positions.
        """
        ...

    def truncate(self, n: int) -> None:
        """Forget positions ``>= n``."""
        ...

    def evict(self, start: int, end: int) -> None:
        """Drop positions ``[start, end)`` and shift later ones down by ``end - start``.

        Re-rotating the shifted keys (RoPE) is the backend's job.
        """
        ...

    def close(self) -> None:
        """Free native memory now rather than at garbage collection."""
        ...
