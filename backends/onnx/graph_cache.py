"""Built graphs on disk, so that a model's graph is built once, not at every load.

A graph is keyed by the GGUF's content hash (SHA-256), the builder's version and the
``GraphSpec``: a changed file or a new builder finds no graph and builds one. Its weights go in a
file of their own beside it (ONNX's external data). ONNX Runtime maps that file: it lets go of each
weight MatMulNBits has prepacked, and of the others (the embedding's rows) only the pages read
are in memory, where a graph holding its weights stays in memory whole (SmolLM2's session: 121 MiB
after loading against 203 MiB, docs/BENCHMARKS.md). No 2 GiB protobuf limit applies either. Both files are written atomically, with their SHA-256 beside them;
a graph whose bytes no longer match (cut short, damaged) is rebuilt, never loaded.
"""

from __future__ import annotations

import hashlib
import logging
import shutil
import tempfile
from pathlib import Path

import onnx

from edgeinfer.errors import InvalidOptionError
from edgeinfer.files import replace_durably, write_atomic
from edgeinfer.models.info import ModelInfo
from edgeinfer.models.tensors import open_tensors
from edgeinfer.system import cache_dir

from .graph import BUILDER_VERSION, GraphSpec, build_graph

log = logging.getLogger("edgeinfer.backends.onnx")


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


def weights_path(graph: Path) -> Path:
    """The file beside ``graph`` that holds its weights."""
    return graph.with_name(graph.name + ".data")


def cached_graph(info: ModelInfo, spec: GraphSpec) -> Path:
    """The path of ``info``'s graph, built now if it is not on disk whole."""
    path = graph_path(info, spec)
    files = (path, weights_path(path))
    digest_path = path.with_name(path.name + ".sha256")
    if all(f.exists() for f in (*files, digest_path)):
        if digest_path.read_text().split() == [file_digest(f) for f in files]:
            return path
        log.warning("the cached graph %s is damaged; building it again", path.name)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)  # before building: an unwritable folder fails at once
    except OSError as exc:
        raise _unwritable(path, exc) from None
    log.info("building the ONNX graph of %s", info.path.name)
    with open_tensors(info) as tensors:
        model = build_graph(info, tensors, spec, _progress(info.path.name))
    try:
        # Written in a folder of its own beside the cache (one file system), under the final names: the
        # graph names its weights' file. The weights land first, so a graph on disk finds its weights.
        with tempfile.TemporaryDirectory(dir=path.parent, prefix=f".{path.name}.") as folder:
            built = [Path(folder) / f.name for f in files]
            onnx.save_model(model, built[0], save_as_external_data=True, location=built[1].name)
            shutil.copymode(built[0], built[1])  # onnx creates the weights' file private (0600): the umask's mode
            digests = [file_digest(f) for f in built]
            for source, target in reversed(list(zip(built, files, strict=True))):
                replace_durably(source, target)
        write_atomic(digest_path, "\n".join(digests) + "\n")
    except OSError as exc:
        raise _unwritable(path, exc) from None
    _remove_older_builds(path)
    return path


def _remove_older_builds(path: Path) -> None:
    """Remove the graphs an older builder made from the same GGUF: no release of this one loads them again.
    (Another onnx release's graphs stay: an environment beside this one may share the cache.)"""
    digest = path.name.split("-")[0]
    for other in path.parent.glob(f"{digest}-v*"):
        version = other.name.split("-")[1].removeprefix("v")
        if version.isdigit() and int(version) < BUILDER_VERSION:
            other.unlink(missing_ok=True)


def _unwritable(path: Path, exc: OSError) -> InvalidOptionError:
    return InvalidOptionError(
        f"cannot write the ONNX graph cache in {path.parent}: {exc.strerror or exc}; "
        "set EDGEINFER_CACHE_DIR to a writable folder"
    )


def _progress(name: str):
    def report(done: int, total: int) -> None:
        log.info("building %s's graph: layer %d of %d", name, done, total)

    return report
