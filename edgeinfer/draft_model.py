"""Drafting by a smaller model with the same vocabulary (``Engine(draft=...)``), for the engine's verification.

Its tokens are checked as prompt lookup's are (``edgeinfer.speculative``): the engine evaluates the drawn token
and the draft in one step and keeps a drafted token only where the token drawn before it is that token.
"""

from __future__ import annotations

from collections.abc import Sequence

from edgeinfer.backends.base import ARGMAX_NOT_FINITE, Backend, Span
from edgeinfer.errors import BackendError
from edgeinfer.sequences import common_prefix
from edgeinfer.speculative import Drafter


class DraftModel:
    """A smaller model that drafts for the engine's, with the same vocabulary, on a backend of its own.

    Its sequence ``i`` follows the answer in the engine's sequence ``i``: before drafting, it is cut back to
    what it shares with the answer's tokens and given the rest, then decodes greedily one token a step.
    Drafted tokens the answer kept stay in it, so the next draft starts where this one was kept.
    """

    def __init__(self, backend: Backend, capacity: int) -> None:
        self.backend = backend
        self.capacity = capacity  # its KV budget, in cells, for all its sequences together
        self._held: list[list[int]] = [[] for _ in range(backend.n_seq)]  # the tokens each sequence holds

    def draft(self, seq: int, tokens: Sequence[int], limit: int) -> list[int]:
        """Up to ``limit`` tokens the draft model expects after ``tokens`` (an answer's sequence so far, its drawn
        token last); none where its budget has no room for them."""
        held = self._held[seq]
        common = min(common_prefix(held, tokens), len(tokens) - 1)  # the last token is evaluated for its row
        if len(tokens) + limit > self.capacity:
            return []
        if sum(map(len, self._held)) - (len(held) - common) + len(tokens) - common + limit > self.capacity:
            self._empty_others(seq)
        try:
            if common < len(held):
                self.backend.truncate(seq, common)
                del held[common:]
            drafted: list[int] = []
            span = list(tokens[common:])
            while len(drafted) < limit:
                (row,) = self.backend.eval([Span(seq, len(held), span, argmax=True)])
                held.extend(span)
                token = int(row) if row.ndim == 0 else int(row.argmax())
                if token == ARGMAX_NOT_FINITE:
                    break
                drafted.append(token)
                span = [token]
            return drafted
        except BackendError:  # its cache refused: it starts over at the next draft
            self.backend.truncate(seq, 0)
            held.clear()
            return []

    def _empty_others(self, seq: int) -> None:
        for other, held in enumerate(self._held):
            if other != seq and held:
                self.backend.truncate(other, 0)
                held.clear()

    def close(self) -> None:
        self.backend.close()


class ModelDrafts(Drafter):
    """One answer's drafts from a ``DraftModel``, as many as pay at the acceptance its drafts have shown."""

    def __init__(self, model: DraftModel, seq: int, tokens: Sequence[int]) -> None:
        super().__init__(tokens)
        self._model, self._seq = model, seq

    def _propose(self, available: int, token_cost: float) -> list[int]:
        length = self.control.length(available, token_cost)
        return self._model.draft(self._seq, self._tokens, length) if length else []
