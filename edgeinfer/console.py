"""The ``edgeinfer`` command's entry point: nothing heavy is imported before Ctrl-C is handled."""

from __future__ import annotations

import sys

EXIT_INTERRUPTED = 130


def main() -> None:
    try:
        from edgeinfer.cli import main as run
    except KeyboardInterrupt:  # during the imports of numpy, llama.cpp, ...
        sys.exit(EXIT_INTERRUPTED)
    run()
