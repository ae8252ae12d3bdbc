"""SIGTERM and SIGHUP stop a conversion the way Ctrl-C does: as an exception in the main thread,
so every ``finally`` and ``with`` on the way out runs and removes its temporary files. Python's
default for them ends the process on the spot, leaving those files behind.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

SIGNALS = (signal.SIGTERM, signal.SIGHUP)


class Terminated(KeyboardInterrupt):
    """The process was asked to stop by ``signum``. A KeyboardInterrupt, so that code which cleans
    up after Ctrl-C cleans up after this too, and no ``except Exception`` swallows it."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextmanager
def terminating_raises() -> Iterator[None]:
    """Within the block, SIGTERM and SIGHUP raise Terminated (call from the main thread)."""

    def stop(signum: int, frame: FrameType | None) -> None:
        raise Terminated(signum)

    # Only where the default is in force: under nohup, SIGHUP is ignored and must stay so.
    taken = [s for s in SIGNALS if signal.getsignal(s) == signal.SIG_DFL]
    previous = {s: signal.signal(s, stop) for s in taken}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
