"""What the ``edgeinfer`` command shows of the library's log: its warnings, each a plain line on stderr, and on a
terminal its progress too (an ONNX graph being built layer by layer, a model being measured), so that a first
load of many seconds is not silent. A record logged with ``extra={"progress": True}`` is rewritten in place by
the next one; the others end their line."""

from __future__ import annotations

import logging
import sys

LOGGER = "edgeinfer"


class _Notes(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self._line_open = False  # a progress line waits to be rewritten

    def emit(self, record: logging.LogRecord) -> None:
        stream = sys.stderr  # looked up each time: a test's runner swaps it
        if record.levelno < logging.WARNING and not stream.isatty():
            return  # progress is for a person watching; a script's stderr gets the warnings alone
        progress = getattr(record, "progress", False)
        text = record.getMessage()
        if self._line_open:
            stream.write("\r\x1b[K")  # back over the open line, cleared
        stream.write(text if progress else text + "\n")
        stream.flush()
        self._line_open = progress


def show_notes() -> None:
    """Show edgeinfer's notes on stderr (once, however often it is called)."""
    logger = logging.getLogger(LOGGER)
    if not any(isinstance(handler, _Notes) for handler in logger.handlers):
        logger.addHandler(_Notes())
        logger.setLevel(logging.INFO)
