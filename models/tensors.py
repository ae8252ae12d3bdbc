"""A GGUF file's tensors for any backend: the raw quantized blocks, memory-mapped, or float32.

A backend that runs the file's own blocks (OpenCL kernels, ONNX Runtime's MatMulNBits) takes
``raw``: a read-only numpy view into one memory map of the file, no copy. One that computes in
float32 (the reference model) takes ``dequantize``. Names, types, shapes and offsets are the
tensor directory the header reader (``models/gguf_file.py``) already checked; opening checks
them once more against the file's size now, as the file may have changed since::

    with open_tensors(info) as tensors:
        t = tensors["blk.0.attn_q.weight"]  # TensorInfo: type, shape (ggml order), numpy_shape...
        blocks = tensors.raw(t.name)  # uint8 (t.n_rows, t.row_bytes): t.blocks_per_row blocks a row
        w = tensors.dequantize(t.name)  # float32 in t.numpy_shape, the caller's own copy

Lifetime: ``close()`` (safe to call twice) lets go of the map, after which ``raw`` and
``dequantize`` raise ValueError. Views handed out before stay valid: each holds the map
through its ``base``, and the file is unmapped when the last of them is gone. A view holds
address space, not memory: pages are read on first use and the kernel may drop them again.
The file must not be truncated or rewritten in place while mapped: reading a page past its
new end kills the process (SIGBUS), as it would llama.cpp's own map.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import TracebackType

import numpy as np
from gguf.quants import dequantize

from edgeinfer.errors import InvalidModelError, ModelNotFoundError
from edgeinfer.models.gguf_file import GGUFHeader, TensorInfo, check_in_file, read_header
from edgeinfer.models.info import ModelInfo


class GGUFTensors(Mapping[str, TensorInfo]):
    """One memory map of a GGUF file, and its tensors by name (each a ``TensorInfo``)."""

    _map: np.memmap | None  # None once closed

    def __init__(self, directory: ModelInfo | GGUFHeader) -> None:
        """Map the file ``directory`` describes. Raises InvalidModelError, naming the tensor, if
        the file has been cut short since the directory was read, or if it has changed size."""
        self.path = directory.path
        self._tensors = {t.name: t for t in directory.tensors}
        try:
            with self.path.open("rb") as f:
                size = os.fstat(f.fileno()).st_size
                for tensor in directory.tensors:
                    check_in_file(tensor, self.path, size)
                if size != directory.file_size:
                    raise InvalidModelError(
                        f"{self.path.name} changed since its header was read ({directory.file_size} bytes then, "
                        f"{size} now); load the model again"
                    )
                # Mapped from the file object whose size was just checked, not reopened by name.
                self._map = np.memmap(f, dtype=np.uint8, mode="r")
        except FileNotFoundError:
            raise ModelNotFoundError(f"model file not found: {self.path}") from None
        except OSError as exc:
            raise InvalidModelError(f"cannot read {self.path}: {exc.strerror or exc}") from None

    def __getitem__(self, name: str) -> TensorInfo:
        return self._tensors[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes as stored, ``(n_rows, row_bytes)`` uint8: a read-only view of the map, no copy.

        Each row is ``blocks_per_row`` blocks of the tensor's ggml type; for F32 and F16,
        ``.view(np.float32)`` or ``.view(np.float16)`` gives the elements, ``(n_rows, shape[0])``.
        """
        if self._map is None:
            raise ValueError(f"the tensors of {self.path.name} are closed; open them again")
        tensor = self._tensors[name]
        return self._map[tensor.offset : tensor.offset + tensor.nbytes].reshape(tensor.n_rows, tensor.row_bytes)

    def dequantize(self, name: str) -> np.ndarray:
        """The tensor as float32 in ``numpy_shape``, dequantized by gguf-py: a new, writable array."""
        tensor, blocks = self[name], self.raw(name)
        floats = dequantize(blocks, tensor.type).reshape(tensor.numpy_shape)
        # gguf-py returns F32 data as a view of its input: copied, so that weights kept as floats
        # neither hold the whole map nor keep its pages counted as the process's memory.
        return floats.astype(np.float32, copy=np.may_share_memory(floats, blocks))

    def close(self) -> None:
        """Let go of the map; views already handed out keep it until they are gone."""
        self._map = None

    def __enter__(self) -> GGUFTensors:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.close()


def open_tensors(source: ModelInfo | GGUFHeader | str | Path) -> GGUFTensors:
    """The tensors of a GGUF file: of a model already read (``load_model_info``, ``read_header``),
    or of the file at a path, whose header is read and checked first."""
    return GGUFTensors(read_header(source) if isinstance(source, (str, Path)) else source)
