"""The llama.cpp backend, through llama-cpp-python's low-level C API.

Not the high-level ``Llama`` object: it keeps its own token bookkeeping, which
goes stale once the engine shifts the KV cache, and it samples, which is the
engine's job. Logits are read straight from llama.cpp's buffer without a copy.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import re
import signal
import sys
import tempfile
import threading
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, ClassVar

import llama_cpp
import numpy as np

from edgeinfer.errors import BackendError
from edgeinfer.models.info import ModelInfo
from edgeinfer.system import BASE_OVERHEAD_BYTES, MemoryNeed, probe_native_build

from .base import (
    CPU,
    BackendOptions,
    Device,
    Span,
    check_copy,
    check_options,
    check_sequence,
    check_spans,
    compute_bytes,
)

log = logging.getLogger("edgeinfer.llamacpp")

VULKAN_REGISTRY = "Vulkan"  # ggml's name for the backend serving Vulkan devices

# Recent llama.cpp log lines, so a failed load can say why instead of "returned NULL".
_recent_log: deque[str] = deque(maxlen=20)
_init_lock = threading.Lock()
_lib: ModuleType | None = None
_log_callback: object = None  # the ctypes callback must outlive every llama.cpp call


def llama_lib() -> ModuleType:
    """llama_cpp's ctypes module, initialised once, with llama.cpp's logging captured."""
    global _lib, _log_callback
    with _init_lock:
        if _lib is None:
            _log_callback = llama_cpp.llama_log_callback(_on_log)
            llama_cpp.llama_log_set(_log_callback, ctypes.c_void_p(0))
            with _stderr_to_log():
                llama_cpp.llama_backend_init()  # registers ggml's backends: Vulkan's opens its devices here
            _lib = llama_cpp
    return _lib


@contextlib.contextmanager
def _stderr_to_log() -> Iterator[None]:
    """What native code writes to stderr meanwhile goes to the log instead: ggml's Vulkan code writes its failures
    to open a device or allocate its memory there, past the log callback, and the backend says them in a line of
    its own. File descriptor 2 is the whole process's, so only the main thread takes it (the TUI loads a model in
    another, and draws on stderr meanwhile); a native abort meanwhile loses its last words."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    if sys.stderr is not None:
        sys.stderr.flush()
    try:
        sink = tempfile.TemporaryFile()  # noqa: SIM115 - closed by the with below
    except OSError:  # nowhere to put it: native lines go where they would
        yield
        return
    with sink:
        try:
            saved = os.dup(2)
        except OSError:  # no stderr to take
            yield
            return
        try:
            os.dup2(sink.fileno(), 2)
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            sink.seek(0)
            for line in sink.read().decode("utf-8", "replace").splitlines():
                _on_log(0, line.encode(), ctypes.c_void_p(0))


def _on_log(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
    line = text.decode("utf-8", "replace").rstrip()
    if line:
        _recent_log.append(line)
        log.debug(line)


def build_info() -> str:
    """The instruction sets and options this llama.cpp build was compiled with."""
    return llama_lib().llama_print_system_info().decode("utf-8", "replace").strip(" |")


def last_log_lines(n: int = 3) -> str:
    """The last few llama.cpp log lines, joined for an error message."""
    return " | ".join(list(_recent_log)[-n:])


@contextlib.contextmanager
def _holding_ctrl_c() -> Iterator[list[int]]:
    """Note Ctrl-C during a native call instead of raising it; the caller cleans up, then raises.

    llama.cpp logs through a Python callback while it loads; a KeyboardInterrupt raised
    inside that callback is printed and dropped by ctypes, and the load runs on.
    """
    caught: list[int] = []
    if threading.current_thread() is not threading.main_thread():  # only it receives signals
        yield caught
        return
    previous = signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    try:
        yield caught
    finally:
        signal.signal(signal.SIGINT, previous)


@dataclass
class _Held:
    """A model llama.cpp holds: which file it is, whether all of it or its vocabulary alone, and its users."""

    file: tuple[str, int, int, int]
    vocab_only: bool
    users: int = 1


# Every model loaded through load_model, by its pointer. A vocabulary asked for after the whole file was loaded
# (the tokenizer's, after the backend's) is that model's: reading the file again took 0.12 s of a 0.64 s start.
_held: dict[int, _Held] = {}
_held_lock = threading.Lock()


def _file_identity(path: str) -> tuple[str, int, int, int]:
    """The file ``path`` names, as a model held can be matched to it: a file rewritten since is another file."""
    st = os.stat(path)
    return os.path.realpath(path), st.st_ino, st.st_size, st.st_mtime_ns


def load_model(path: str, *, vocab_only: bool = False, gpu_layers: int = 0, device: int | None = None) -> int:
    """Load a GGUF with llama.cpp; returns the model pointer, which ``free_model`` frees.

    ``gpu_layers`` layers (-1: all) go to ggml device number ``device``. Without a device, llama.cpp
    gets an empty list of them: llama-cpp-python's defaults would offload every layer on a GPU build,
    and with no layers offloaded llama.cpp still copies a prompt's weights to a GPU it was given.
    With ``vocab_only``, a model of the same file already held is shared rather than loaded again.
    """
    lib = llama_lib()
    try:
        file = _file_identity(path)
    except OSError:
        file = None  # llama.cpp's own load gives the error
    if vocab_only and file is not None:
        with _held_lock:
            for model, held in _held.items():
                if held.file == file:
                    held.users += 1
                    return model
    params = lib.llama_model_default_params()
    params.vocab_only = vocab_only
    params.n_gpu_layers = gpu_layers if device is not None else 0
    # A NULL-terminated list of the devices to use; it must outlive the load call.
    devices = (ctypes.c_void_p * 2)(None if device is None else ggml_devices().handle(device), None)
    params.devices = ctypes.addressof(devices)  # llama-cpp-python declares the field a void pointer
    _recent_log.clear()
    with _holding_ctrl_c() as interrupted, _stderr_to_log() if device is not None else contextlib.nullcontext():
        model = lib.llama_model_load_from_file(path.encode(), params)
    if interrupted:
        if model:
            lib.llama_model_free(model)
        raise KeyboardInterrupt
    if not model:
        raise _load_error(Path(path).name)
    if file is not None:
        with _held_lock:
            _held[model] = _Held(file, vocab_only)
    return model


def free_model(model: int) -> None:
    """Let go of a model ``load_model`` gave; llama.cpp frees it when its last user has."""
    with _held_lock:
        held = _held.get(model)
        if held is not None and held.users > 1:
            held.users -= 1
            return
        _held.pop(model, None)
    llama_lib().llama_model_free(model)


# An architecture's name -> why this llama.cpp build refuses it (None: it runs it); see supports().
_architecture_refusals: dict[str, str | None] = {}
_LOAD_ERROR = re.compile(r"error loading model: (?:error loading model \w+: )?(.*)")
_UNKNOWN_ARCH = re.compile(r"unknown model architecture: '(.*)'")


def _layer_of(tensor: str) -> int:
    """The repeating layer a tensor belongs to (``blk.N.``), or -1 for the others (embedding, output, norms)."""
    if not tensor.startswith("blk."):
        return -1
    number = tensor.split(".", 2)[1]
    return int(number) if number.isdecimal() else -1


def _load_error(name: str) -> BackendError:
    """llama.cpp's reason for refusing a file, in one line: its own message where it logged one."""
    lines = list(_recent_log)
    reason = next((m[1] for line in reversed(lines) if (m := _LOAD_ERROR.search(line))), None)
    if reason is None:
        return BackendError(f"llama.cpp could not load {name}: {last_log_lines() or 'no reason given'}")
    if unknown := _UNKNOWN_ARCH.search(reason):
        return BackendError(
            f"{name}: the installed llama.cpp (llama-cpp-python {llama_cpp.__version__}) does not run the "
            f"'{unknown[1]}' architecture; a newer llama-cpp-python may (pip install -U llama-cpp-python)"
        )
    return BackendError(f"llama.cpp could not load {name}: {reason}")


@dataclass(frozen=True)
class GgmlDevice:
    """A device of this llama.cpp build, as ggml lists it."""

    index: int  # ggml's, for ggml_backend_dev_get
    name: str  # lower case, as --device takes it: cpu, vulkan0, cuda0
    kind: str  # cpu, gpu, igpu (an integrated GPU) or accel
    registry: str  # the ggml backend serving it: CPU, Vulkan, CUDA, Metal...
    description: str
    free_bytes: int
    total_bytes: int
    # What ggml does not say, and a backend may know (backends/vulkan.py asks the Vulkan driver):
    max_tensor_bytes: int | None = None  # the largest tensor a shader can bind; None: no limit known
    emulated: bool = False  # a GPU's interface run on the CPU (Mesa's lavapipe)

    @property
    def is_gpu(self) -> bool:
        return self.kind in ("gpu", "igpu")

    def as_device(self) -> Device:
        """As the backend contract lists it; memory a driver reports as 0 is unknown, as llama.cpp takes it."""
        known = self.total_bytes > 0
        return Device(
            self.name, self.description, self.free_bytes if known else None, self.total_bytes if known else None,
            emulated=self.emulated,
        )  # fmt: skip


class _Ggml:
    """The few ggml device functions llama-cpp-python does not bind: which devices exist, and their memory."""

    _KINDS = ("cpu", "gpu", "igpu", "accel")  # enum ggml_backend_dev_type, in order

    def __init__(self) -> None:
        # The libggml beside the libllama llama_cpp loaded (LLAMA_CPP_LIB_PATH may have put it anywhere):
        # a second copy of ggml would have devices of its own.
        llama = Path(_loaded_llama()._name)
        path = llama.with_name(llama.name.replace("llama", "ggml", 1))
        try:
            lib = ctypes.CDLL(str(path))
        except OSError as exc:
            raise BackendError(f"llama.cpp's libggml will not load from {path}: {exc}") from None
        size_p = ctypes.POINTER(ctypes.c_size_t)
        for name, restype, argtypes in (
            ("ggml_backend_dev_count", ctypes.c_size_t, []),
            ("ggml_backend_dev_get", ctypes.c_void_p, [ctypes.c_size_t]),
            ("ggml_backend_dev_name", ctypes.c_char_p, [ctypes.c_void_p]),
            ("ggml_backend_dev_description", ctypes.c_char_p, [ctypes.c_void_p]),
            ("ggml_backend_dev_type", ctypes.c_int, [ctypes.c_void_p]),
            ("ggml_backend_dev_memory", None, [ctypes.c_void_p, size_p, size_p]),
            ("ggml_backend_dev_backend_reg", ctypes.c_void_p, [ctypes.c_void_p]),
            ("ggml_backend_reg_name", ctypes.c_char_p, [ctypes.c_void_p]),
        ):
            function = getattr(lib, name)
            function.restype, function.argtypes = restype, argtypes
        self._lib = lib

    def all(self) -> list[GgmlDevice]:
        """Every device of the build, the CPU's included, with its memory now. Nothing here opens a device (ggml's
        buffer types would: a Vulkan one compiles its shaders)."""
        lib, found = self._lib, []
        for i in range(lib.ggml_backend_dev_count()):
            dev = lib.ggml_backend_dev_get(i)
            free, total = ctypes.c_size_t(), ctypes.c_size_t()
            lib.ggml_backend_dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
            kind = lib.ggml_backend_dev_type(dev)
            found.append(
                GgmlDevice(
                    index=i,
                    name=lib.ggml_backend_dev_name(dev).decode().lower(),
                    kind=self._KINDS[kind] if 0 <= kind < len(self._KINDS) else f"type {kind}",
                    registry=lib.ggml_backend_reg_name(lib.ggml_backend_dev_backend_reg(dev)).decode(),
                    description=lib.ggml_backend_dev_description(dev).decode(errors="replace"),
                    free_bytes=free.value,
                    total_bytes=total.value,
                )
            )
        return found

    def gpus(self) -> list[GgmlDevice]:
        """The GPU devices, in ggml's order."""
        return [device for device in self.all() if device.is_gpu]

    def handle(self, index: int) -> int:
        return self._lib.ggml_backend_dev_get(index)


_ggml: _Ggml | None = None
_logits_at: Any = None


def _logits_address() -> Any:
    """``llama_get_logits_ith`` returning a plain address, through a function object of our own
    (llama_cpp's returns a ctypes pointer, which costs a cast per call)."""
    global _logits_at
    if _logits_at is None:
        function = _loaded_llama()["llama_get_logits_ith"]  # indexing makes a new function object
        function.argtypes, function.restype = [ctypes.c_void_p, ctypes.c_int32], ctypes.c_void_p
        _logits_at = function
    return _logits_at


def _loaded_llama() -> ctypes.CDLL:
    """The libllama llama_cpp loaded, wherever it found it (llama_cpp keeps it as ``llama_cpp.llama_cpp._lib``)."""
    return llama_cpp.llama_cpp._lib


def ggml_devices() -> _Ggml:
    global _ggml
    llama_lib()  # registers ggml's backends
    with _init_lock:
        if _ggml is None:
            _ggml = _Ggml()
    return _ggml


class LlamaCppBackend:
    """llama.cpp on the CPU, or on a CUDA or Metal GPU its build supports (Vulkan's: ``backends/vulkan.py``)."""

    name: ClassVar[str] = "llamacpp"
    kv_block: ClassVar[int] = 256  # llama.cpp pads n_ctx up to a multiple of 256
    kv_types: ClassVar[tuple[str, ...]] = ("f16", "q8_0", "f32")
    shares_cells: ClassVar[bool] = True
    loads_llamacpp: ClassVar[bool] = True
    follows: ClassVar[bool] = False
    # Each KV type's ggml type, and whether flash attention reads it: always for a quantized V cache, which works
    # only with it; for f16 wherever the device runs it (llama.cpp's own default, AUTO); never for f32, a cache
    # asked for its precision, which flash attention's Vulkan kernels give up (a shifted cache's KLD to a cold one
    # went from under 1e-6 to 1.5e-6). On the CPU its kernel skips the cells a token's mask hides, where the
    # plain path multiplies every cell up to the highest in use, whichever sequence holds it: with sequences kept
    # for the prefix cache, a step costs what the whole pool costs (docs/BENCHMARKS.md, issue 20).
    _KV_TYPES: ClassVar[dict[str, tuple[str, str]]] = {
        "f16": ("GGML_TYPE_F16", "LLAMA_FLASH_ATTN_TYPE_AUTO"),
        "q8_0": ("GGML_TYPE_Q8_0", "LLAMA_FLASH_ATTN_TYPE_ENABLED"),
        "f32": ("GGML_TYPE_F32", "LLAMA_FLASH_ATTN_TYPE_DISABLED"),
    }
    _elsewhere: ClassVar[str] = ""  # what a failure on the device adds: where else the model runs
    _KV_TYPE_BYTES: ClassVar[dict[str, float]] = {"f16": 2.0, "q8_0": 34 / 32, "f32": 4.0}  # q8_0: 32 values in 34 B

    @classmethod
    def supports(cls, info: ModelInfo) -> str | None:
        if info.hparams.arch.reference:
            return None  # llama.cpp runs every architecture the reference implements
        name = info.architecture
        if name not in _architecture_refusals:
            # Only llama.cpp knows which architectures it was built with: ask it, once a name, by loading
            # the file's vocabulary alone (it reads the architecture first and stops there if unknown).
            try:
                free_model(load_model(str(info.path), vocab_only=True))
            except BackendError as exc:
                if not _UNKNOWN_ARCH.search("\n".join(_recent_log)):
                    return None  # refused for another reason, which loading it for real will give
                _architecture_refusals[name] = str(exc)
            else:
                _architecture_refusals[name] = None
        return _architecture_refusals[name]

    @classmethod
    def devices(cls) -> list[Device]:
        return [Device(CPU, "the CPU, through llama.cpp's CPU kernels")] + [gpu.as_device() for gpu in cls._gpus()]

    @classmethod
    def _gpus(cls) -> list[GgmlDevice]:
        """The GPUs this backend places layers on: the build's, but Vulkan's, which the vulkan backend serves."""
        return [gpu for gpu in ggml_devices().gpus() if gpu.registry != VULKAN_REGISTRY]

    @classmethod
    def _cells(cls, options: BackendOptions) -> int:
        """The cells llama.cpp makes for ``options.kv_tokens``: whole blocks of ``kv_block``."""
        return -(-options.kv_tokens // cls.kv_block) * cls.kv_block

    @classmethod
    def _placed_on(cls, options: BackendOptions) -> GgmlDevice | None:
        """The GPU ``options`` put layers on; None for the CPU alone."""
        if options.device == CPU:
            return None
        options = check_options(cls, options)  # refuses a device it does not have; names one given by index
        return next(gpu for gpu in cls._gpus() if gpu.name == options.device)

    @classmethod
    def kv_bytes_per_token(cls, info: ModelInfo, kv_type: str) -> float:
        return info.kv_values_per_token * cls._KV_TYPE_BYTES[kv_type]

    @classmethod
    def memory(cls, info: ModelInfo, options: BackendOptions) -> MemoryNeed:
        kv = int(cls._cells(options) * cls.kv_bytes_per_token(info, options.kv_type))
        compute = compute_bytes(info, options)
        gpu = cls._placed_on(options)
        if gpu is None:  # the file, mapped as it is
            return MemoryNeed(weights=info.file_size, kv=kv, overhead=BASE_OVERHEAD_BYTES + compute)
        # llama.cpp counts the output layer as one more, the first it offloads, then the repeating layers from the
        # last, each with its part of the cache. The input embedding stays on the host (a tied output matrix is
        # copied to the device); the compute buffers are the device's.
        n_layer = info.hparams.n_layer
        on_device = n_layer + 1 if options.gpu_layers < 0 else min(options.gpu_layers, n_layer + 1)
        first_offloaded = n_layer - max(on_device - 1, 0)
        sizes = {t.name: t.nbytes for t in info.tensors}
        layers = sum(size for name, size in sizes.items() if _layer_of(name) >= first_offloaded)
        output = sizes.get("output.weight", sizes.get("token_embd.weight", 0)) if on_device else 0
        on_host = info.file_size - layers - (output if "output.weight" in sizes else 0)
        kv_on_device = kv * (n_layer - first_offloaded) // n_layer
        return MemoryNeed(
            weights=on_host,
            kv=kv - kv_on_device,
            overhead=BASE_OVERHEAD_BYTES,
            device=gpu.name,
            device_bytes=layers + output + kv_on_device + compute,
            device_free=gpu.as_device().free_bytes,
        )

    def __init__(self, info: ModelInfo, options: BackendOptions, *, probe: bool = True) -> None:
        """``probe=False`` skips the native-build check; only the probe's own child uses it."""
        if probe:
            probe_native_build(info.path)
        lib = llama_lib()
        self._lib = lib
        self._model: Any = None
        self._ctx: Any = None
        self._batch: Any = None
        self._row_address: int | None = None
        self._row_view = np.empty(0, np.float32)
        gpu = self._placed_on(options)
        self._model = self._load(info, options, gpu)
        try:
            if lib.llama_model_has_encoder(self._model):  # BERT-like embedders, and T5 which needs llama_encode
                raise BackendError(
                    f"{info.path.name} is an encoder model ({info.architecture}); edgeinfer runs decoder-only "
                    "text generators"
                )
            params = lib.llama_context_default_params()
            params.n_ctx = options.kv_tokens
            # One decode step carries a token of each sequence, and llama.cpp aborts the process when
            # they outnumber a batch's outputs: the batch holds at least n_seq. Prompt chunks keep their
            # own size (the engine's batch_size), so a wider batch computes them exactly as before.
            self._batch_size = max(options.batch_size, options.n_seq)
            params.n_batch = params.n_ubatch = self._batch_size
            params.n_seq_max = options.n_seq
            params.kv_unified = True  # one pool of cells for all sequences: the KV budget is one total
            # Sliding-window layers (Gemma 3's local attention) keep every position too, not just their
            # window: the cache can then be truncated and shifted like any other, and the budget's
            # bytes per token are the same for every layer. llama.cpp's default; set so it stays so.
            params.swa_full = True
            params.n_threads = params.n_threads_batch = options.threads
            ggml_type, flash_attention = self._KV_TYPES[options.kv_type]
            params.type_k = params.type_v = getattr(lib, ggml_type)
            params.flash_attn_type = getattr(lib, flash_attention)
            params.no_perf = True
            _recent_log.clear()
            with _holding_ctrl_c() as interrupted, _stderr_to_log() if gpu else contextlib.nullcontext():
                self._ctx = lib.llama_init_from_model(self._model, params)
            if interrupted:
                raise KeyboardInterrupt  # close() below frees what was made
            if not self._ctx:
                raise BackendError(
                    f"llama.cpp could not create a context: {last_log_lines() or 'no reason given'}{self._elsewhere}"
                )
            self._memory = lib.llama_get_memory(self._ctx)
            if not self._memory:  # llama.cpp gives a model that attends both ways (BERT) no cache
                raise BackendError(
                    f"{info.path.name} ({info.architecture}) is an embedding model that keeps no KV cache; "
                    "edgeinfer runs text generators"
                )
            self._capacity = lib.llama_n_ctx(self._ctx)
            self._n_seq = options.n_seq
            # A recurrent state (Mamba, RWKV; the recurrent layers of a hybrid) cannot give back tokens it took
            # in, though llama.cpp calls shifting its positions possible.
            recurrent = lib.llama_model_is_recurrent(self._model) or lib.llama_model_is_hybrid(self._model)
            self._can_truncate = not recurrent
            self._can_shift = bool(lib.llama_memory_can_shift(self._memory)) and not recurrent
            self._n_vocab = lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(self._model))
            self._batch = lib.llama_batch_init(self._batch_size, 0, 1)
            for i in range(self._batch_size):
                self._batch.n_seq_id[i] = 1
            self._lengths = [0] * options.n_seq  # positions each sequence holds, to refuse a gap early
        except BaseException:
            self.close()
            raise

    def _load(self, info: ModelInfo, options: BackendOptions, gpu: GgmlDevice | None) -> Any:
        """The model, on the CPU or with ``options.gpu_layers`` of its layers on ``gpu``."""
        if gpu is None:
            return load_model(str(info.path))
        # Each layer's keys, and its values, are one tensor: one larger than the device can bind aborts llama.cpp.
        hp = info.hparams
        cells = self._cells(options)
        per_value = self.kv_bytes_per_token(info, options.kv_type) / info.kv_values_per_token
        largest = cells * hp.n_head_kv * max(hp.head_dim, hp.value_dim or 0) * per_value
        limit = gpu.max_tensor_bytes
        if limit is not None and options.gpu_layers != 1 and largest > limit:  # 1: the output layer alone, no cache
            mib = 2**20
            raise BackendError(
                f"a {cells}-token cache puts {largest / mib:,.0f} MiB of keys in a layer, more than the "
                f"{limit / mib:,.0f} MiB {gpu.name} binds at once; lower --kv-budget{self._elsewhere}"
            )
        try:
            return load_model(str(info.path), gpu_layers=options.gpu_layers, device=gpu.index)
        except BackendError as exc:
            raise BackendError(f"{exc}{self._elsewhere}") from None

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def n_seq(self) -> int:
        return self._n_seq

    @property
    def can_shift(self) -> bool:
        return self._can_shift

    @property
    def can_truncate(self) -> bool:
        return self._can_truncate

    @property
    def n_vocab(self) -> int:
        return self._n_vocab

    def eval(self, spans: Sequence[Span]) -> list[np.ndarray]:
        self._check_open()
        lengths = self._lengths
        check_spans(spans, lengths, self._n_vocab)
        try:
            if len(spans) == 1 and len(spans[0].tokens) <= self._batch_size:  # the decode loop's path
                span = spans[0]
                self._decode(((span, j) for j in range(len(span.tokens))), len(span.tokens))
                rows = [self._rows(0, len(span.tokens)) if span.all_logits else self._row(len(span.tokens) - 1)]
            else:
                rows = self._eval_chunked(spans)
        except BaseException:
            # Earlier chunks are in the cache: take them out, so a failed evaluation changes nothing.
            for span in spans:
                self._lib.llama_memory_seq_rm(self._memory, span.seq, span.start, -1)
            raise
        for span in spans:
            lengths[span.seq] += len(span.tokens)
        return rows

    def _eval_chunked(self, spans: Sequence[Span]) -> list[np.ndarray]:
        """Several spans, or more tokens than a batch: one ``llama_decode`` per batch-sized chunk."""
        results: list[np.ndarray | None] = [
            np.empty((len(s.tokens), self._n_vocab), np.float32) if s.all_logits else None for s in spans
        ]
        items = [(k, j) for k, span in enumerate(spans) for j in range(len(span.tokens))]
        single_chunk = len(items) <= self._batch_size
        for first in range(0, len(items), self._batch_size):
            chunk = items[first : first + self._batch_size]
            self._decode(((spans[k], j) for k, j in chunk), len(chunk))
            for i, (k, j) in enumerate(chunk):
                last = j == len(spans[k].tokens) - 1
                if spans[k].all_logits:
                    results[k][j] = self._row(i)  # type: ignore[index]
                elif last:
                    # Rows of one llama_decode stay valid together; a later chunk overwrites them.
                    results[k] = self._row(i) if single_chunk else self._row(i).copy()
        return results  # type: ignore[return-value]

    def _decode(self, items: Iterator[tuple[Span, int]], n: int) -> None:
        lib, batch = self._lib, self._batch
        batch.n_tokens = n
        for i, (span, j) in enumerate(items):
            batch.token[i] = span.tokens[j]
            batch.pos[i] = span.start + j
            batch.seq_id[i][0] = span.seq
            batch.logits[i] = span.all_logits or j == len(span.tokens) - 1
        status = lib.llama_decode(self._ctx, batch)
        if status != 0:
            first, last = batch.pos[0], batch.pos[n - 1]
            # Below 0 the computation itself failed (a device out of memory, say); 1 is a full cache, 2 a stop.
            elsewhere = self._elsewhere if status < 0 else ""
            raise BackendError(
                f"llama_decode failed with status {status} at positions {first}..{last} "
                f"of a {self._capacity}-cell cache: {last_log_lines() or 'no reason given'}{elsewhere}"
            )

    def _row(self, i: int) -> np.ndarray:
        # The decode loop asks for the same row of the same buffer every step: its view is reused, since
        # building one (np.ctypeslib.as_array) costs more than the rest of a step's bookkeeping.
        address = _logits_address()(self._ctx, i)
        if not address:
            raise BackendError(f"llama.cpp has no logits for output {i}: {last_log_lines() or 'no reason given'}")
        if address != self._row_address:
            self._row_view = np.ctypeslib.as_array((ctypes.c_float * self._n_vocab).from_address(address))
            self._row_address = address
        return self._row_view

    def _rows(self, first: int, n: int) -> np.ndarray:
        address = _logits_address()(self._ctx, first)
        if not address:
            raise BackendError(f"llama.cpp has no logits for output {first}: {last_log_lines() or 'no reason given'}")
        return np.ctypeslib.as_array((ctypes.c_float * (n * self._n_vocab)).from_address(address)).reshape(
            n, self._n_vocab
        )

    def truncate(self, seq: int, n: int) -> None:
        self._check_open()
        check_sequence(seq, self._lengths)
        if not self._lib.llama_memory_seq_rm(self._memory, seq, n, -1):
            raise BackendError(f"llama.cpp cannot remove positions from {n} on from this model's cache")
        self._lengths[seq] = min(self._lengths[seq], n)

    def save_state(self, seq: int) -> bytes:
        self._check_open()
        check_sequence(seq, self._lengths)
        lib = self._lib
        size = lib.llama_state_seq_get_size(self._ctx, seq)
        buffer = (ctypes.c_uint8 * size)()
        written = lib.llama_state_seq_get_data(self._ctx, buffer, size, seq)
        return ctypes.string_at(buffer, written)

    def load_state(self, seq: int, data: bytes, n: int) -> bool:
        self._check_open()
        check_sequence(seq, self._lengths)
        lib = self._lib
        buffer = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
        read = lib.llama_state_seq_set_data(self._ctx, buffer, len(data), seq)  # empties seq first; 0: refused
        if read != len(data) or lib.llama_memory_seq_pos_max(self._memory, seq) != n - 1:
            lib.llama_memory_seq_rm(self._memory, seq, -1, -1)
            self._lengths[seq] = 0
            return False
        self._lengths[seq] = n
        return True

    def evict(self, seq: int, start: int, end: int) -> None:
        self._check_open()
        check_sequence(seq, self._lengths)
        if not self._lib.llama_memory_seq_rm(self._memory, seq, start, end):
            raise BackendError(f"llama.cpp cannot remove positions {start}..{end - 1} from this model's cache")
        self._lib.llama_memory_seq_add(self._memory, seq, end, -1, start - end)
        self._lengths[seq] -= min(end, self._lengths[seq]) - min(start, self._lengths[seq])

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        self._check_open()
        check_copy(src, dst, n, self._lengths)
        self._lib.llama_memory_seq_rm(self._memory, dst, 0, -1)
        self._lib.llama_memory_seq_cp(self._memory, src, dst, 0, n)
        self._lengths[dst] = n

    def _check_open(self) -> None:
        # A call on freed native memory would crash the process; the engine never makes one, a caller holding
        # the backend past Engine.close() might.
        if not self._ctx:
            raise BackendError("this llama.cpp context is closed (its engine was closed); create a new Engine")

    def close(self) -> None:
        lib = self._lib
        if self._batch is not None:
            lib.llama_batch_free(self._batch)
            self._batch = None
        if self._ctx:
            lib.llama_free(self._ctx)
            self._ctx = None
        if self._model:
            free_model(self._model)
            self._model = None

    def __del__(self) -> None:
        # Not contextlib.suppress: interpreter shutdown may have set this module's globals to None already.
        try:  # noqa: SIM105
            self.close()
        except Exception:  # nothing can be reported from a finalizer
            pass
