"""Token bytes to displayable text: whole UTF-8 characters only, stop strings never shown."""

from __future__ import annotations

import codecs
from collections.abc import Sequence

JOIN_EVERY = 4096  # pieces of shown text kept apart before they are joined


class TextStream:
    """Incremental detokenizer with stop-string hold-back.

    ``push`` returns the text that is now safe to show: a multi-byte character
    split across tokens waits for its last byte, and a tail that could be the
    start of a stop string waits until it either completes the stop string
    (then it is dropped and ``stopped`` turns true) or diverges from it.
    """

    def __init__(self, stop: Sequence[str] = ()) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._stop = tuple(s for s in stop if s)
        self._held = ""
        # The text shown so far, in pieces joined when asked or when they are many: appending to one string copied
        # it whole each token, 34 us a token by the 100,000th.
        self._shown: list[str] = []
        self.stopped = False

    @property
    def text(self) -> str:
        """All the text shown so far."""
        if len(self._shown) > 1:
            self._shown[:] = ["".join(self._shown)]
        return self._shown[0] if self._shown else ""

    def push(self, piece: bytes) -> str:
        """Feed one token's bytes; return the newly displayable text."""
        if self.stopped:
            return ""
        if not self._stop:  # nothing to hold back: a token's text as it decodes (a third of the work, per token)
            out = self._decoder.decode(piece)
            self._show(out)
            return out
        return self._emit(self._held + self._decoder.decode(piece))

    def flush(self) -> str:
        """End of generation: release whatever was held back.

        The bytes of a character that generation stopped in the middle of are dropped,
        never shown as a replacement character.
        """
        if self.stopped:
            return ""
        self._decoder.reset()
        tail, self._held = self._held, ""
        cut = self._find_stop(tail)
        if cut is not None:
            self.stopped = True
            tail = tail[:cut]
        self._show(tail)
        return tail

    def _emit(self, pending: str) -> str:
        cut = self._find_stop(pending)
        if cut is not None:
            self.stopped = True
            self._held = ""
            out = pending[:cut]
        else:
            hold = self._partial_stop_len(pending)
            out, self._held = pending[: len(pending) - hold], pending[len(pending) - hold :]
        self._show(out)
        return out

    def _show(self, text: str) -> None:
        self._shown.append(text)
        if len(self._shown) >= JOIN_EVERY:  # a string each token weighs more than the text itself
            self._shown[:] = ["".join(self._shown)]

    def _find_stop(self, text: str) -> int | None:
        hits = [i for i in (text.find(s) for s in self._stop) if i >= 0]
        return min(hits) if hits else None

    def _partial_stop_len(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop string.

        Such a suffix starts with the stop string's first character, so only the places in the last
        ``len(stop) - 1`` characters that hold it are tried: one ``find`` where none does, as on most tokens
        (trying every prefix length took 6 us a token with a chat template's two stop strings)."""
        best = 0
        for stop in self._stop:
            i = text.find(stop[0], max(0, len(text) - len(stop) + 1))
            while i != -1 and len(text) - i > best:
                if stop.startswith(text[i:]):
                    best = len(text) - i  # the earliest place is the longest suffix
                    break
                i = text.find(stop[0], i + 1)
        return best
