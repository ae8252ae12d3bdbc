"""Writing a file whole or not at all: a crash, a full disk or Ctrl-C mid-write leaves the old one.

The new bytes go to a temporary file beside the target (one file system, so the rename is
atomic), reach the disk, and only then are renamed over the target.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Iterator
from pathlib import Path


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` as UTF-8, replacing what was there only once all of it is written."""
    # open(..., "x") rather than mkstemp: the file gets the user's umask, not mode 600.
    with atomic_path(path) as tmp, open(tmp, "x", encoding="utf-8") as f:
        f.write(text)


@contextlib.contextmanager
def atomic_path(path: Path) -> Iterator[Path]:
    """A fresh path beside ``path`` to write the new file at, for writers that want a path (a plot's
    ``savefig``). It replaces ``path`` when the block ends, or is removed if the block raises."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        yield tmp
        replace_durably(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def replace_durably(tmp: Path, path: Path) -> None:
    """Rename the finished file ``tmp`` over ``path``. Its bytes reach the disk first: renamed before
    they did, a power cut can leave an empty or torn file under the name."""
    fd = os.open(tmp, os.O_RDWR)  # Windows flushes only a handle open for writing
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    if os.name == "posix":  # the rename itself is an entry in the folder; Windows cannot open a folder
        # Some file systems (network ones) refuse to sync a folder; the file is in place all the same.
        with contextlib.suppress(OSError):
            folder = os.open(path.parent, os.O_RDONLY)
            try:
                os.fsync(folder)
            finally:
                os.close(folder)
