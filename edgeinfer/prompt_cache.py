"""KV states of prompt prefixes kept on disk, so a process that starts again reads its system prompt's cache
from a file instead of evaluating the prompt again.

One file a prefix, named by a digest of the prefix's tokens and of everything that decides what its cache
holds (``identity``: the model file, the backend and its device, the KV type, the chunk size prefills are
evaluated in, the native build). A file holds:

    MAGIC, a 4-byte header length, the header (JSON: identity, token count, the state's SHA-256),
    the tokens (int32), the backend's state (``Backend.save_state``)

and is read only where all of it checks out: another model's or build's file, a truncated one or one
whose bytes changed is ignored with a one-line warning and removed, so the prefix is evaluated and saved
again. Files are written atomically; past ``max_bytes`` in all, the least recently used go.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import struct
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from edgeinfer.errors import InvalidOptionError
from edgeinfer.files import atomic_path

log = logging.getLogger("edgeinfer")

MAGIC = b"EDGEINFER-KV\x01"
SUFFIX = ".kv"
_LENGTH = struct.Struct("<I")
# The files this cache writes, and the half-written ones atomic_path names; nothing else in the folder is touched.
_NAME = re.compile(r"[0-9a-f]{40}\.kv")
_HALF_WRITTEN = re.compile(r"\.[0-9a-f]{40}\.kv\.\d+\.[0-9a-f]+\.tmp")
_STALE_TMP_S = 3600  # a half-written file this old was left by a process that died writing it


class PromptCache:
    """Saved KV states of prompt prefixes in ``folder``, for one ``identity``, at most ``max_bytes`` of them."""

    def __init__(self, folder: str | os.PathLike[str], identity: str, max_bytes: int) -> None:
        self.folder = Path(folder).expanduser()
        self.identity = identity
        self.max_bytes = max_bytes
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise InvalidOptionError(
                f"cannot use {self.folder} as the prompt cache: {exc.strerror or exc}; give a folder you can write"
            ) from None
        if not self.folder.is_dir():
            raise InvalidOptionError(f"the prompt cache {self.folder} is not a folder; give a folder")

    def path(self, tokens: Sequence[int]) -> Path:
        """Where the state of the prefix ``tokens`` is kept."""
        digest = hashlib.sha256(self.identity.encode())
        digest.update(np.asarray(tokens, dtype="<i4").tobytes())
        return self.folder / f"{digest.hexdigest()[:40]}{SUFFIX}"

    def load(self, tokens: Sequence[int]) -> bytes | None:
        """The saved state of the prefix ``tokens``, or None where there is none that checks out."""
        path = self.path(tokens)
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            log.warning("prompt cache: cannot read %s (%s); evaluating the prompt", path.name, exc.strerror or exc)
            return None
        state, problem = self._parse(raw, tokens)
        if problem is not None:
            self.discard(tokens, problem)
            return None
        with contextlib.suppress(OSError):
            os.utime(path)  # the least recently used go first
        return state

    def save(self, tokens: Sequence[int], state: bytes) -> None:
        """Keep ``state`` as the prefix ``tokens``'s, then trim the folder to ``max_bytes``."""
        if len(state) > self.max_bytes:
            log.warning(
                "prompt cache: the prompt's state (%d bytes) is larger than the cache's cap (%d); it is not kept",
                len(state),
                self.max_bytes,
            )
            return
        header = json.dumps(
            {"identity": self.identity, "tokens": len(tokens), "sha256": hashlib.sha256(state).hexdigest()}
        ).encode()
        path = self.path(tokens)
        try:
            with atomic_path(path) as tmp, open(tmp, "xb") as f:
                f.write(MAGIC + _LENGTH.pack(len(header)) + header)
                f.write(np.asarray(tokens, dtype="<i4").tobytes())
                f.write(state)
        except OSError as exc:
            log.warning("prompt cache: cannot write %s (%s); the prompt is not cached", path.name, exc.strerror or exc)
            return
        self._trim(keep=path)

    def discard(self, tokens: Sequence[int], problem: str) -> None:
        """Remove the prefix ``tokens``'s file, which is ``problem``, saying so in one line."""
        path = self.path(tokens)
        log.warning("prompt cache: %s %s; ignored, and the prompt evaluated and saved again", path.name, problem)
        with contextlib.suppress(OSError):  # a read-only folder: the file stays, and is ignored each time
            path.unlink(missing_ok=True)

    def _parse(self, raw: bytes, tokens: Sequence[int]) -> tuple[bytes, None] | tuple[None, str]:
        """The state in a file's bytes, or what is wrong with them."""
        start = len(MAGIC) + _LENGTH.size
        if not raw.startswith(MAGIC) or len(raw) < start:
            return None, "is not an edgeinfer prompt-cache file"
        (header_size,) = _LENGTH.unpack_from(raw, len(MAGIC))
        try:
            header = json.loads(raw[start : start + header_size])
            identity, count, digest = header["identity"], header["tokens"], header["sha256"]
        except (ValueError, KeyError, TypeError):
            return None, "has a damaged header"
        if not isinstance(count, int) or isinstance(count, bool) or count < 0:
            return None, "has a damaged header"
        if identity != self.identity:
            return None, "was saved by another model, backend, KV type or build"
        body = start + header_size
        saved = np.frombuffer(raw[body : body + 4 * count], dtype="<i4")
        if count != len(tokens) or len(saved) != count or not np.array_equal(saved, tokens):
            return None, "is truncated or holds another prompt"
        state = raw[body + 4 * count :]
        if hashlib.sha256(state).hexdigest() != digest:
            return None, "is truncated or changed since it was written"
        return state, None

    def _trim(self, keep: Path) -> None:
        """Remove the least recently used files until the folder holds ``max_bytes`` at most (``keep`` last)."""
        files = []
        for path in self.folder.iterdir():
            try:
                st = path.stat()
            except OSError:
                continue
            if _HALF_WRITTEN.fullmatch(path.name) and time.time() - st.st_mtime > _STALE_TMP_S:
                with contextlib.suppress(OSError):
                    path.unlink()
            elif _NAME.fullmatch(path.name) and path.is_file():
                files.append((path != keep, st.st_mtime_ns, st.st_size, path))
        total = sum(size for _, _, size, _ in files)
        for _, _, size, path in sorted(files, key=lambda f: (not f[0], f[1])):
            if total <= self.max_bytes:
                break
            with contextlib.suppress(OSError):
                path.unlink()
                total -= size
