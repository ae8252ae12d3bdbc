"""Built graphs on disk, so that a model's graph is built once, not at every load.

A graph is keyed by the GGUF's content hash (SHA-256), the builder's version and the
``GraphSpec``: a changed file or a new builder finds no graph and builds one. Its weights go in a
file of their own beside it (ONNX's external data), each at a page boundary. ONNX Runtime maps
that file: it lets go of each weight MatMulNBits has prepacked, and of the others (the embedding's
rows) only the pages read are in memory, where a graph holding its weights stays in memory whole
(SmolLM2's session: 121 MiB after loading against 203 MiB, docs/BENCHMARKS.md).

Both files are built in a folder of their own and renamed into place, weights first; the SHA-256 of
both, written last, is what makes them a graph. A pair whose bytes no longer match it (cut short,
damaged, or half written by a crash) is rebuilt, never loaded. One process builds a graph at a
time: another that needs it waits on a lock file beside it, then loads what the first built.

The accuracy level measured for a model (``activations.py``) is kept here too, keyed by the GGUF's
hash and the builder's version.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import re
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from filelock import FileLock, Timeout

from edgeinfer.errors import InvalidOptionError
from edgeinfer.files import replace_durably, write_atomic
from edgeinfer.models.info import ModelInfo
from edgeinfer.models.tensors import open_tensors
from edgeinfer.system import cache_dir

from .spec import BUILDER_VERSION, FLOAT, INT8, GraphSpec

if TYPE_CHECKING:
    import onnx

log = logging.getLogger("edgeinfer.backends.onnx")


def file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def graph_path(info: ModelInfo, spec: GraphSpec) -> Path:
    """Where the graph for ``info`` built under ``spec`` is kept."""
    # The builder's version, not onnx's: the graph declares a fixed IR version (spec.py), and importing onnx takes
    # 0.8 s, which a load that finds its graph built does without.
    name = f"{_gguf_digest(info.path)[:32]}-v{BUILDER_VERSION}-{spec.key}.onnx"
    return cache_dir() / "onnx" / name


def is_built(info: ModelInfo, spec: GraphSpec) -> bool:
    """Whether ``info``'s graph is on disk (whole or not: ``cached_graph`` checks that)."""
    path = graph_path(info, spec)
    try:
        return all(f.exists() for f in (path, weights_path(path), _digests_path(path)))
    except OSError:  # a cache folder it may not search: the load says so
        return False


def _gguf_digest(path: Path) -> str:
    """``file_digest`` of a GGUF, hashed once per process while the file stays the same one, unchanged (the
    memory check and the load both need it: 2 s a GB)."""
    s = path.stat()  # ctime too: no one can set it back, where cp -p and rsync -t restore mtime
    return _digest_of(str(path), s.st_dev, s.st_ino, s.st_size, s.st_mtime_ns, s.st_ctime_ns)


@functools.lru_cache(maxsize=16)
def _digest_of(path: str, *stat: int) -> str:
    return file_digest(Path(path))


def weights_path(graph: Path) -> Path:
    """The file beside ``graph`` that holds its weights."""
    return graph.with_name(graph.name + ".data")


def _digests_path(graph: Path) -> Path:
    """The file beside ``graph`` that holds its and its weights' SHA-256."""
    return graph.with_name(graph.name + ".sha256")


def cached_graph(info: ModelInfo, spec: GraphSpec) -> Path:
    """The path of ``info``'s graph, built now if it is not on disk whole."""
    path = graph_path(info, spec)
    if _whole(path):
        return path
    _remove_abandoned_builds(path)
    try:  # made before building: an unwritable cache fails at once
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise _unwritable(path, exc) from None
    with _locked(path, f"another process is building the ONNX graph of {info.path.name}; waiting for it"):
        if _whole(path):  # built by the process this one waited for
            return path
        _build(info, spec, path)
    _remove_older_builds(path)
    return path


def _whole(path: Path) -> bool:
    """Whether the graph at ``path``, its weights and their digests are all there and agree."""
    files = (path, weights_path(path))
    digest_path = _digests_path(path)
    if not all(f.exists() for f in (*files, digest_path)):
        return False
    with contextlib.suppress(OSError):  # a folder in a file's place, say: damaged as well
        if digest_path.read_bytes().split() == [file_digest(f).encode() for f in files]:
            return True
    log.warning("the cached graph %s is damaged; building it again", path.name)
    return False


def _build(info: ModelInfo, spec: GraphSpec, path: Path) -> None:
    """Build the graph in a folder of its own, then rename its files into place: weights, graph, digests."""
    files = (path, weights_path(path))
    from .graph import build_graph  # onnx, imported only to build (0.8 s: before the folder, which Ctrl-C would leave)

    try:
        folder = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}."))
    except OSError as exc:
        raise _unwritable(path, exc) from None

    try:
        with open_tensors(info) as tensors:
            model = build_graph(info, tensors, spec, _progress(info, spec))
        built = [folder / f.name for f in files]
        try:
            _save(model, *built)
            digests = [file_digest(f) for f in built]
            for source, target in reversed(list(zip(built, files, strict=True))):
                replace_durably(source, target)
            write_atomic(_digests_path(path), "\n".join(digests) + "\n")
        except OSError as exc:
            raise _unwritable(path, exc) from None
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def remove_graph(info: ModelInfo, spec: GraphSpec) -> None:
    """Remove ``info``'s graph built under ``spec``, if there is one (a graph the model will not use)."""
    path = graph_path(info, spec)
    with _locked(path, f"another process is building the ONNX graph of {info.path.name}; waiting for it"):
        for f in (_digests_path(path), path, weights_path(path)):  # its digests first: no longer a graph
            with contextlib.suppress(OSError):
                f.unlink()


def _activations_path(info: ModelInfo) -> Path:
    return cache_dir() / "onnx" / f"{_gguf_digest(info.path)[:32]}-v{BUILDER_VERSION}-activations.json"


def chosen_accuracy_level(info: ModelInfo) -> int | None:
    """The accuracy level measured for ``info``, or None if it has not been measured (or its record is unreadable,
    which measures it again)."""
    try:
        level = json.loads(_activations_path(info).read_bytes())["accuracy_level"]
    except (OSError, ValueError, KeyError, TypeError, RecursionError):  # the last: brackets nested past Python's
        return None
    return level if type(level) is int and level in (FLOAT, INT8) else None


def record_accuracy_level(info: ModelInfo, level: int, kld: float) -> None:
    """Keep the accuracy level chosen for ``info``, with the KLD it was chosen by."""
    path = _activations_path(info)
    record = {"accuracy_level": level, "int8_kld": kld, "model": info.path.name}
    try:
        write_atomic(path, json.dumps(record) + "\n")
    except OSError as exc:
        raise _unwritable(path, exc) from None


@contextlib.contextmanager
def choosing_accuracy_level(info: ModelInfo) -> Iterator[None]:
    """Held while ``info``'s accuracy level is measured: another process loading the model waits for the choice."""
    path = _activations_path(info)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise _unwritable(path, exc) from None
    with _locked(path, f"another process is measuring {info.path.name} on ONNX Runtime; waiting for it"):
        yield


@contextlib.contextmanager
def _locked(path: Path, waiting: str) -> Iterator[None]:
    """An exclusive lock on ``path`` among processes (a lock file beside it), saying ``waiting`` if it must wait.
    The operating system lets go of a lock whose process dies."""
    lock = FileLock(path.with_name(path.name + ".lock"))
    try:
        try:
            lock.acquire(timeout=0)
        except Timeout:
            log.info(waiting)
            lock.acquire()
    except OSError as exc:
        raise _unwritable(path, exc) from None
    try:
        yield
    finally:
        lock.release()


# Initializers this large go in the weights' file; smaller ones (norm weights, shapes) stay in the graph.
EXTERNAL_MIN_BYTES = 1024
PAGE = 4096  # ONNX Runtime maps a weight whose offset is a multiple of the page size


def _save(model: onnx.ModelProto, graph: Path, weights: Path) -> None:
    """Write ``model`` to ``graph``, its large initializers to ``weights`` (named in the graph by file name).

    By hand, not ``onnx.save_model(save_as_external_data=True)``: that refuses when a file of the weights'
    name exists in the working directory, and it leaves the weights' file private (mode 0600).
    """
    from onnx import TensorProto  # imported only to build (spec.py says why)
    from onnx.external_data_helper import set_external_data

    with weights.open("xb") as f:
        for tensor in model.graph.initializer:
            data = tensor.raw_data  # a copy at every read
            if len(data) < EXTERNAL_MIN_BYTES:
                continue
            f.write(bytes(-f.tell() % PAGE))
            set_external_data(tensor, weights.name, offset=f.tell(), length=len(data))
            f.write(data)
            tensor.ClearField("raw_data")  # the model's memory goes down as the file grows
            tensor.data_location = TensorProto.EXTERNAL
    graph.write_bytes(model.SerializeToString())


# A build folder this old belongs to a process that died mid-build (a kill, a power cut).
ABANDONED_AFTER_S = 24 * 3600


def _remove_abandoned_builds(path: Path) -> None:
    for folder in path.parent.glob(f".{path.name}.*"):
        with contextlib.suppress(OSError):
            if folder.is_dir() and time.time() - folder.stat().st_mtime > ABANDONED_AFTER_S:
                shutil.rmtree(folder, ignore_errors=True)


_BUILT_NAME = re.compile(r"([0-9a-f]{32})-v([0-9]+)-")


def _remove_older_builds(path: Path) -> None:
    """Remove the graphs an older builder made from the same GGUF; an older edgeinfer in another environment
    sharing the cache builds its own again if it needs it."""
    digest = path.name[:32]
    for other in path.parent.glob(f"{digest}-v*"):
        name = _BUILT_NAME.match(other.name)
        if name and int(name[2]) < BUILDER_VERSION:
            with contextlib.suppress(OSError):  # in use elsewhere, or not ours to remove: left
                other.unlink()


def _unwritable(path: Path, exc: OSError) -> InvalidOptionError:
    return InvalidOptionError(
        f"cannot write the ONNX graph cache in {path.parent}: {exc.strerror or exc}; "
        "set EDGEINFER_CACHE_DIR to a writable folder"
    )


def _progress(info: ModelInfo, spec: GraphSpec):
    described = spec.describe(info)

    def report(done: int, total: int) -> None:
        log.info(
            "building the ONNX graph of %s (%s): layer %d of %d",
            info.path.name,
            described,
            done,
            total,
            extra={"progress": done < total},  # rewritten in place on a terminal (edgeinfer/notes.py)
        )

    return report
