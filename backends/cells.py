"""KV cells shared by sequences, as llama.cpp's unified cache shares them: the bookkeeping, not the storage.

Each sequence holds a list of cells, its positions 0, 1, ... in order. A cell may be held by several
sequences (a prefix one copied from another, shared rather than copied) and is free when none holds
it. A backend keeps its keys and values wherever it likes, indexed by cell.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from edgeinfer.errors import BackendError

from .base import Span, check_copy, check_room, check_sequence


class CellPool:
    """``capacity`` cells for ``n_seq`` sequences."""

    def __init__(self, capacity: int, n_seq: int) -> None:
        self._users = np.zeros(capacity, np.int32)  # sequences holding each cell
        self._cells: list[list[int]] = [[] for _ in range(n_seq)]  # each sequence's cells, by position

    @property
    def capacity(self) -> int:
        return len(self._users)

    @property
    def n_seq(self) -> int:
        return len(self._cells)

    def lengths(self) -> list[int]:
        """Positions each sequence holds."""
        return [len(cells) for cells in self._cells]

    def cells(self, seq: int) -> list[int]:
        """``seq``'s cells, by position (the pool's own list: do not change it)."""
        return self._cells[seq]

    def take(self, spans: Sequence[Span]) -> list[np.ndarray]:
        """Free cells for each span's tokens, appended to its sequence: the cells, a span at a time. A one-line
        ``BackendError`` if they do not fit; ``truncate`` each sequence to its span's start to undo."""
        free = np.flatnonzero(self._users == 0)
        check_room(sum(len(span.tokens) for span in spans), len(free), self.capacity)
        taken = []
        for span in spans:
            cells, free = free[: len(span.tokens)], free[len(span.tokens) :]
            self._users[cells] = 1
            self._cells[span.seq].extend(cells.tolist())
            taken.append(cells)
        return taken

    def truncate(self, seq: int, n: int) -> None:
        check_sequence(seq, self.lengths())
        held = self._cells[seq]
        self._users[held[n:]] -= 1
        del held[n:]

    def evict(self, seq: int, start: int, end: int) -> list[int]:
        """Drop ``seq``'s positions ``[start, end)``; return the cells of the later positions, which move down by
        ``end - start`` (their keys are the caller's to re-rotate). They may not be shared with another sequence."""
        check_sequence(seq, self.lengths())
        held = self._cells[seq]
        if np.any(self._users[held[start:]] > 1):
            raise BackendError(f"sequence {seq} shares positions from {start} on with another; it cannot evict them")
        self._users[held[start:end]] -= 1
        kept = held[end:]
        del held[start:end]
        return kept

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        """Make ``dst`` hold ``src``'s first ``n`` cells, shared."""
        check_copy(src, dst, n, self.lengths())
        shared = self._cells[src][:n]
        self.truncate(dst, 0)
        self._users[shared] += 1
        self._cells[dst] = list(shared)


class PooledBackend:
    """The contract's cell keeping for a backend whose cells a ``CellPool`` keeps (``self._pool``), where every
    position can be truncated and shifted: a backend class adds its model, ``eval`` and ``evict``."""

    name: str
    _pool: CellPool
    _closed: bool

    @property
    def capacity(self) -> int:
        return self._pool.capacity

    @property
    def n_seq(self) -> int:
        return self._pool.n_seq

    @property
    def can_shift(self) -> bool:
        return True

    @property
    def can_truncate(self) -> bool:
        return True

    def truncate(self, seq: int, n: int) -> None:
        self._check_open()
        self._pool.truncate(seq, n)

    def save_state(self, seq: int) -> None:
        return None  # its cells live in its own buffers, with no format to write them in

    def load_state(self, seq: int, data: bytes, n: int) -> bool:
        return False

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        self._check_open()
        self._pool.copy_prefix(src, dst, n)

    def _check_open(self) -> None:
        if self._closed:
            raise BackendError(f"this {self.name} backend is closed (its engine was closed); create a new Engine")
