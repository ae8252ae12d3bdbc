"""What each of the backend's KV sequences holds, as the engine sees it, and how many cells they take.

The backend keeps one pool of KV cells for all sequences, and ``copy_prefix`` shares cells
between them (or copies them, where the backend does not ``shares_cells``). The engine mirrors
each sequence's tokens here, with what it needs to reuse them exactly (``exact``, the last
prompt and its logits), and counts the cells in use: a cell shared by several sequences counts once.

Cells are counted by group: positions a sequence appended in one go, since its last
truncation, copy or eviction, belong to one group, and a copy references a prefix of the
source's groups. Every reference to a group starts where the group starts, so the cells a
group takes are its longest reference.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from edgeinfer.backends.base import Backend


@dataclass
class CachedSequence:
    """One backend sequence: its tokens by position and what the engine may reuse of them."""

    tokens: list[int] = field(default_factory=list)
    exact: int = 0
    """Leading positions computed in whole aligned prompt chunks, as a cold run computes them (a multiple of
    the batch size): only these are reused for another prompt."""
    last_prompt: list[int] | None = None
    """The last prompt prefilled here in full, while the sequence still holds it."""
    last_logits: np.ndarray | None = None
    """That prompt's last row of logits: asking the same prompt again evaluates nothing."""
    used_at: int = 0  # the engine's call counter when last used, for choosing whom to drop
    busy: bool = False  # a running call holds it: nothing else may drop, overwrite or claim it
    _groups: list[list[int]] = field(default_factory=list)  # [group, first, end) covering [0, len(tokens))
    _appending: bool = False  # whether new positions extend the last group

    def reusable(self, tokens: Sequence[int], limit: int, batch_size: int) -> int:
        """How much of ``tokens`` (at most ``limit``) this sequence can serve as a cold run would compute it."""
        common = common_prefix(self.tokens, tokens)
        return min(common, limit, self.exact) // batch_size * batch_size


class SequenceCache:
    """The backend's sequences, mirrored; every change to a sequence's KV goes through here."""

    def __init__(self, backend: Backend, batch_size: int, capacity: int) -> None:
        self.backend = backend
        self.batch_size = batch_size
        self.capacity = capacity  # the KV budget in cells (the backend may have allocated a few more)
        self.sequences = [CachedSequence() for _ in range(backend.n_seq)]
        self._group_ids = itertools.count()

    def cells_used(self, *, busy_only: bool = False) -> int:
        """KV cells in use across all sequences (with ``busy_only``, the busy ones'); a shared cell counts once."""
        spans: dict[int, tuple[int, int]] = {}
        for seq in self.sequences:
            if busy_only and not seq.busy:
                continue
            for group, first, end in seq._groups:
                known = spans.get(group)
                spans[group] = (first, end if known is None else max(known[1], end))
        return sum(end - first for first, end in spans.values())

    def has_room(self, n: int) -> bool:
        """Whether ``n`` more cells fit the pool. Cheap when the sequences' lengths alone say so (once per token)."""
        capacity = self.capacity
        return sum(len(s.tokens) for s in self.sequences) + n <= capacity or self.cells_used() + n <= capacity

    def append(self, seq: int, tokens: Sequence[int], *, exact_chunk: bool = False) -> None:
        """Record ``tokens`` the backend has just evaluated at the end of ``seq``.

        ``exact_chunk``: they are one whole aligned prompt chunk, computed as a cold run would.
        """
        state = self.sequences[seq]
        first = len(state.tokens)
        state.tokens.extend(tokens)
        if state._appending:
            state._groups[-1][2] = len(state.tokens)
        else:
            state._groups.append([next(self._group_ids), first, len(state.tokens)])
            state._appending = True
        if exact_chunk and state.exact == first:
            state.exact = len(state.tokens)

    def forget(self, seq: int, n: int) -> None:
        """Drop ``seq``'s positions from ``n`` on; all of them where the backend cannot truncate between."""
        state = self.sequences[seq]
        if not self.backend.can_truncate and n < len(state.tokens):
            n = 0
        self.backend.truncate(seq, n)
        if n >= len(state.tokens):
            return
        del state.tokens[n:]
        state.exact = min(state.exact, n)
        if state.last_prompt is not None and n < len(state.last_prompt):
            state.last_prompt = state.last_logits = None
        state._groups = [[g, a, min(b, n)] for g, a, b in state._groups if a < n]
        state._appending = False

    def restore(self, seq: int, tokens: Sequence[int], state: bytes) -> bool:
        """Make ``seq`` hold ``tokens``, a whole number of aligned prompt chunks, from a state the backend saved
        after evaluating them as a cold run does (``Backend.save_state``); False, with ``seq`` empty, where the
        backend cannot read it."""
        self.forget(seq, 0)
        if not self.backend.load_state(seq, state, len(tokens)):
            return False
        self.append(seq, tokens)
        self.sequences[seq].exact = len(tokens)
        return True

    def rollback(self, seq: int, n: int) -> None:
        """Take back ``seq``'s positions from ``n`` on, which the step just run appended to it (drafted tokens its
        answer did not keep). They were the end of its last group, which goes on growing: no other sequence
        references positions a step appended, so no group is split, and the group count stays flat."""
        state = self.sequences[seq]
        self.backend.truncate(seq, n)
        del state.tokens[n:]
        state._groups[-1][2] = n

    def share(self, src: int, dst: int, n: int) -> None:
        """Make ``dst`` hold ``src``'s first ``n`` positions, sharing their cells (or copying them, where the
        backend does not ``shares_cells``: ``copy_cost`` cells, which the caller makes room for); where the
        backend cannot copy part of a sequence, ``dst`` is left empty unless ``n`` is all of ``src``."""
        source, target = self.sequences[src], self.sequences[dst]
        if not self.backend.can_truncate and n < len(source.tokens):
            self.forget(dst, 0)
            return
        if not self.backend.shares_cells:
            self.forget(dst, 0)  # empty in the mirror too, should the backend refuse the copy
        self.backend.copy_prefix(src, dst, n)
        target.tokens = source.tokens[:n]
        target.exact = min(source.exact, n)
        target.last_prompt = target.last_logits = None
        if self.backend.shares_cells:
            target._groups = [[g, a, min(b, n)] for g, a, b in source._groups if a < n]
        else:  # cells of its own
            target._groups = [[next(self._group_ids), 0, n]] if n else []
        target._appending = False

    def copy_cost(self, n: int) -> int:
        """The free cells ``share`` of ``n`` positions takes: none where the backend shares cells."""
        return 0 if self.backend.shares_cells else n

    def evict(self, seq: int, start: int, end: int) -> None:
        """Drop ``seq``'s positions ``[start, end)``, shifting later ones down; no other sequence may share them."""
        state = self.sequences[seq]
        try:
            self.backend.evict(seq, start, end)
        except BaseException:
            # The backend may have moved some of the later positions and not others: forget them all, as a failed
            # evaluation leaves nothing of its span.
            self.forget(seq, start)
            raise
        del state.tokens[start:end]
        # Shifted positions were re-rotated, not computed as a cold run computes them.
        state.exact = min(state.exact, start // self.batch_size * self.batch_size)
        state.last_prompt = state.last_logits = None
        state._groups = [[next(self._group_ids), 0, len(state.tokens)]] if state.tokens else []
        state._appending = False

    def drop_others(self, keep: Sequence[int], room: int) -> None:
        """Empty sequences neither busy nor in ``keep``, least recently used first, until ``room`` cells are free or
        none is left."""
        others = sorted(
            (s for s in range(len(self.sequences)) if s not in keep and not self.sequences[s].busy), key=self._last_use
        )
        for seq in others:
            if self.capacity - self.cells_used() >= room:
                return
            self.forget(seq, 0)

    def _last_use(self, seq: int) -> int:
        return self.sequences[seq].used_at


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
