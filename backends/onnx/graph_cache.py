"""Built graphs on disk, so that a model's graph is built once, not at every load.

A graph is keyed by the GGUF's content hash (SHA-256), the builder's version and the
``GraphSpec``: a changed file or a new builder finds no graph and builds one. It is written
atomically, with its own SHA-256 beside it; a graph whose bytes no longer match (cut short,
damaged) is rebuilt, never loaded.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

import onnx

from edgeinfer.errors import InvalidOptionError
from edgeinfer.files import atomic_path, write_atomic
from edgeinfer.models.info import ModelInfo
from edgeinfer.models.tensors import open_tensors
from edgeinfer.system import cache_dir

from .graph import BUILDER_VERSION, GraphSpec, build_graph

log = logging.getLogger("edgeinfer.backends.onnx")

PROTOBUF_LIMIT = 2**31 - 1  # one serialized ONNX graph holds at most this many bytes


def file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def graph_path(info: ModelInfo, spec: GraphSpec) -> Path:
    """Where the graph for ``info`` built under ``spec`` is kept."""
    # onnx's IR version too: the cache folder may serve environments with other onnx and onnxruntime releases.
    name = f"{file_digest(info.path)[:32]}-v{BUILDER_VERSION}-ir{onnx.IR_VERSION}-{spec.key}.onnx"
    return cache_dir() / "onnx" / name


def cached_graph(info: ModelInfo, spec: GraphSpec) -> Path:
    """The path of ``info``'s graph, built now if it is not on disk whole."""
    path = graph_path(info, spec)
    digest_path = path.with_name(path.name + ".sha256")
    if path.exists() and digest_path.exists():
        if digest_path.read_text().strip() == file_digest(path):
            return path
        log.warning("the cached graph %s is damaged; building it again", path.name)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)  # before building: an unwritable folder fails at once
    except OSError as exc:
        raise _unwritable(path, exc) from None
    log.info("building the ONNX graph of %s", info.path.name)
    with open_tensors(info) as tensors:
        model = build_graph(info, tensors, spec, _progress(info.path.name))
    data = model.SerializeToString()
    if len(data) > PROTOBUF_LIMIT:
        raise InvalidOptionError(f"{info.path.name}'s graph is over 2 GiB, more than one ONNX file holds")
    try:
        with atomic_path(path) as tmp:
            tmp.write_bytes(data)
        write_atomic(digest_path, hashlib.sha256(data).hexdigest() + "\n")
    except OSError as exc:
        raise _unwritable(path, exc) from None
    return path


def _unwritable(path: Path, exc: OSError) -> InvalidOptionError:
    return InvalidOptionError(
        f"cannot write the ONNX graph cache in {path.parent}: {exc.strerror or exc}; "
        "set EDGEINFER_CACHE_DIR to a writable folder"
    )


def _progress(name: str):
    def report(done: int, total: int) -> None:
        log.info("building %s's graph: layer %d of %d", name, done, total)

    return report
