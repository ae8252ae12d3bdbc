"""The llama.cpp backend, through llama-cpp-python's low-level C API.

Not the high-level ``Llama`` object: it keeps its own token bookkeeping, which
goes stale once the engine shifts the KV cache, and it samples, which is the
engine's job. Logits are read straight from llama.cpp's buffer without a copy.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import signal
import threading
from collections import deque
from collections.abc import Iterator, Sequence
from types import ModuleType
from typing import Any, ClassVar

import llama_cpp
import numpy as np

from edgeinfer.errors import BackendError
from edgeinfer.models.info import ModelInfo
from edgeinfer.system import probe_native_build

from .base import BackendOptions

log = logging.getLogger("edgeinfer.llamacpp")

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
            llama_cpp.llama_backend_init()
            _lib = llama_cpp
    return _lib


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


def load_model(path: str, *, vocab_only: bool = False) -> int:
    """Load a GGUF with llama.cpp; returns the model pointer."""
    lib = llama_lib()
    params = lib.llama_model_default_params()
    params.vocab_only = vocab_only
    _recent_log.clear()
    with _holding_ctrl_c() as interrupted:
        model = lib.llama_model_load_from_file(path.encode(), params)
    if interrupted:
        if model:
            lib.llama_model_free(model)
        raise KeyboardInterrupt
    if not model:
        raise BackendError(f"llama.cpp could not load {path}: {last_log_lines() or 'no reason given'}")
    return model


class LlamaCppBackend:
    """llama.cpp on the CPU (or the GPU backend it was built with)."""

    name: ClassVar[str] = "llamacpp"
    kv_block: ClassVar[int] = 256  # llama.cpp pads n_ctx up to a multiple of 256
    kv_types: ClassVar[tuple[str, ...]] = ("f16", "q8_0", "f32")

    @staticmethod
    def weight_bytes(info: ModelInfo) -> int:
        return info.file_size  # mapped from the file as it is

    def __init__(self, info: ModelInfo, options: BackendOptions, *, probe: bool = True) -> None:
        """``probe=False`` skips the native-build check; only the probe's own child uses it."""
        if probe:
            probe_native_build(info.path)
        lib = llama_lib()
        self._lib = lib
        self._model: Any = None
        self._ctx: Any = None
        self._batch: Any = None
        self._model = load_model(str(info.path))
        try:
            params = lib.llama_context_default_params()
            params.n_ctx = options.kv_tokens
            params.n_batch = params.n_ubatch = options.batch_size
            params.n_seq_max = 1
            params.n_threads = params.n_threads_batch = options.threads
            ggml_type = {"f16": lib.GGML_TYPE_F16, "q8_0": lib.GGML_TYPE_Q8_0, "f32": lib.GGML_TYPE_F32}[
                options.kv_type
            ]
            params.type_k = params.type_v = ggml_type
            # A quantized V cache only works with flash attention.
            params.flash_attn_type = (
                lib.LLAMA_FLASH_ATTN_TYPE_ENABLED if options.kv_type == "q8_0" else lib.LLAMA_FLASH_ATTN_TYPE_DISABLED
            )
            params.no_perf = True
            _recent_log.clear()
            with _holding_ctrl_c() as interrupted:
                self._ctx = lib.llama_init_from_model(self._model, params)
            if interrupted:
                raise KeyboardInterrupt  # close() below frees what was made
            if not self._ctx:
                raise BackendError(f"llama.cpp could not create a context: {last_log_lines() or 'no reason given'}")
            self._memory = lib.llama_get_memory(self._ctx)
            self._capacity = lib.llama_n_ctx(self._ctx)
            self._can_shift = bool(lib.llama_memory_can_shift(self._memory))
            self._n_vocab = lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(self._model))
            self._batch_size = options.batch_size
            self._batch = lib.llama_batch_init(options.batch_size, 0, 1)
            for i in range(options.batch_size):
                self._batch.n_seq_id[i] = 1
                self._batch.seq_id[i][0] = 0
        except BaseException:
            self.close()
            raise

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def can_shift(self) -> bool:
        return self._can_shift

    @property
    def n_vocab(self) -> int:
        return self._n_vocab

    def eval(self, tokens: Sequence[int], start: int, *, all_logits: bool = False) -> np.ndarray:
        self._check_open()
        lib, batch, n = self._lib, self._batch, len(tokens)
        if n == 0:
            raise BackendError("eval needs at least one token")
        rows = np.empty((n, self._n_vocab), dtype=np.float32) if all_logits else None
        for first in range(0, n, self._batch_size):
            chunk = tokens[first : first + self._batch_size]
            batch.n_tokens = len(chunk)
            for j, token in enumerate(chunk):
                batch.token[j] = token
                batch.pos[j] = start + first + j
                batch.logits[j] = all_logits
            batch.logits[len(chunk) - 1] = True
            status = lib.llama_decode(self._ctx, batch)
            if status != 0:
                end = start + first + len(chunk) - 1
                raise BackendError(
                    f"llama_decode failed with status {status} at positions {start + first}..{end} "
                    f"of a {self._capacity}-token cache: {last_log_lines() or 'no reason given'}"
                )
            if rows is not None:
                view = np.ctypeslib.as_array(lib.llama_get_logits(self._ctx), shape=(len(chunk), self._n_vocab))
                rows[first : first + len(chunk)] = view
        if rows is not None:
            return rows
        return np.ctypeslib.as_array(lib.llama_get_logits_ith(self._ctx, -1), shape=(self._n_vocab,))

    def truncate(self, n: int) -> None:
        self._check_open()
        if not self._lib.llama_memory_seq_rm(self._memory, 0, n, -1):
            raise BackendError(f"llama.cpp cannot remove positions from {n} on from this model's cache")

    def evict(self, start: int, end: int) -> None:
        self._check_open()
        if not self._lib.llama_memory_seq_rm(self._memory, 0, start, end):
            raise BackendError(f"llama.cpp cannot remove positions {start}..{end - 1} from this model's cache")
        self._lib.llama_memory_seq_add(self._memory, 0, end, -1, start - end)

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
            lib.llama_model_free(self._model)
            self._model = None

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # interpreter shutdown may have torn the module down already
            self.close()
