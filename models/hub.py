"""Model files from the Hugging Face Hub: ``hf:ORG/REPO/FILE.gguf`` references, their cache and downloads.

A module of its own because huggingface_hub takes about a fifth of a second to import: the catalog
imports it only for a file that comes from the Hub, so a packaged or local model starts without it.
"""

from __future__ import annotations

import re
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
from edgeinfer.models.catalog import CATALOG, DEFAULT_MODEL, HF_PREFIX

_E = TypeVar("_E", bound=BaseException)

# The repo id is checked by huggingface_hub itself; this only splits it from the file path.
_HF_REF = re.compile(r"hf:(?P<repo_id>[^/]+/[^/]+)/(?P<filename>.+\.gguf)", re.IGNORECASE)


@dataclass(frozen=True)
class HubFile:
    repo_id: str
    filename: str

    def __str__(self) -> str:
        return f"{HF_PREFIX}{self.repo_id}/{self.filename}"


def parse_ref(spec: str) -> HubFile:
    """The file an ``hf:ORG/REPO/FILE.gguf`` reference names; a one-line error for a malformed one."""
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
    return HubFile(repo_id, filename)


def _hub_cache() -> Path:
    # Read on each call so the cache huggingface_hub was configured with is the one searched;
    # scan_cache_dir's own default is bound at import and would miss later changes.
    return Path(hf_constants.HF_HUB_CACHE)


def from_hub(ref: HubFile, spec: str, *, download: bool, progress: bool) -> Path:
    """``ref``'s path in the Hugging Face cache, downloading it first where ``download`` allows."""
    cached = try_to_load_from_cache(ref.repo_id, ref.filename, cache_dir=_hub_cache())
    if isinstance(cached, str):
        return Path(cached)
    if not download:
        raise ModelNotFoundError(f"{spec} is not downloaded yet (run 'edgeinfer pull {spec}')")
    return _download(ref, progress=progress)


def _download(ref: HubFile, *, progress: bool) -> Path:
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


def _download_error(ref: HubFile, exc: BaseException) -> DownloadError:
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


def cached_gguf_files() -> dict[str, Path]:
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
                    files[str(HubFile(repo.repo_id, relative))] = file.file_path
    return files
