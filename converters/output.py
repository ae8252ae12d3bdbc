"""The GGUF's side of a conversion: its path, checked before any work is done, and the temporary
files written beside it.

Temporary files sit beside the output, not in /tmp, so the final rename stays on one file system
and an unquantized copy for ``--eval`` does not fill a small /tmp. Each is named
``.<output name>.<pid>.<kind>`` (folders and probes add a random tail): the PID lets a later
conversion to the same output tell the leftovers of a killed run from those of a running one.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Literal, get_args

from edgeinfer.errors import ConversionError

Kind = Literal["partial", "header", "probe", "vocab", "base"]


def output_path(value: str | Path) -> Path:
    """The path ``-o`` gives, refused when it is empty (``Path("")`` would mean the current folder)."""
    if not str(value):
        raise ConversionError("the output path is empty; name the GGUF file to write, e.g. -o model.gguf")
    return Path(value)


def check_output(output: Path, inputs: Mapping[Path, str]) -> None:
    """Refuse an output the conversion cannot or must not replace: one in a missing or unwritable
    folder, an existing file that is not a regular file (a device, a FIFO, a folder), or one of
    ``inputs`` (each path with what it is), reached by its own path, a symbolic or a hard link."""
    if not output.parent.is_dir():
        raise ConversionError(f"{output.parent} is not a folder; create it or write the GGUF elsewhere")
    try:
        _check_replaceable(output, output.stat(), inputs)
    except FileNotFoundError:
        pass  # a new file: nothing there to protect
    except OSError as exc:
        raise ConversionError(f"{output} cannot be examined ({exc.strerror}); write the GGUF elsewhere") from None
    _check_writable(output.parent, scratch(output, "probe").name)


def scratch(output: Path, kind: Kind) -> Path:
    """The path of this process's temporary file of ``kind`` beside ``output``."""
    return output.with_name(f".{output.name}.{os.getpid()}.{kind}")


def scratch_folder(output: Path, kind: Kind) -> tempfile.TemporaryDirectory[str]:
    """A temporary folder of ``kind`` beside ``output``, removed when its ``with`` block ends."""
    return tempfile.TemporaryDirectory(dir=output.parent, prefix=f"{scratch(output, kind).name}-")


def sweep(output: Path) -> list[Path]:
    """Remove the temporary files that conversions to ``output`` left when they were killed
    (SIGKILL, a crash, a power cut): those whose process is no longer running. Returns them."""
    kinds = "|".join(get_args(Kind))
    pattern = re.compile(rf"\.{re.escape(output.name)}\.([1-9][0-9]{{0,6}})\.(?:{kinds})(?:-\w+)?")
    try:
        entries = list(output.parent.iterdir())
    except OSError:  # a folder one may write in but not list: nothing in it to see
        return []
    removed = []
    for entry in entries:
        found = pattern.fullmatch(entry.name)
        if found is None or _running(int(found[1])):
            continue
        try:
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()
        except OSError:  # another user's, in a shared folder: theirs to remove
            continue
        removed.append(entry)
    return removed


def _check_replaceable(output: Path, found: os.stat_result, inputs: Mapping[Path, str]) -> None:
    if not stat.S_ISREG(found.st_mode):
        raise ConversionError(f"{output} exists and is not a regular file; write the GGUF to a file path")
    for path, role in inputs.items():
        if _same_file(found, path):
            what = role if output.absolute() == path.absolute() else f"the same file as {path} ({role})"
            raise ConversionError(f"{output} is {what}, an input of this conversion; write the GGUF under another name")


def _same_file(found: os.stat_result, path: Path) -> bool:
    try:
        other = path.stat()
    except OSError:  # an input that is not there cannot be overwritten
        return False
    return (found.st_dev, found.st_ino) == (other.st_dev, other.st_ino)


def _check_writable(folder: Path, prefix: str) -> None:
    # Creating a file is the only true test: os.access goes by permission bits, which do not bind
    # root, and some file systems (sysfs) refuse new files whatever the bits say.
    try:
        with tempfile.NamedTemporaryFile(dir=folder, prefix=f"{prefix}-"):
            pass
    except OSError as exc:
        raise ConversionError(
            f"cannot create files in {folder} ({exc.strerror}); write the GGUF to a folder you can write to"
        ) from None


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: checks the process exists, sends nothing
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, but is another user's
        pass
    return True
