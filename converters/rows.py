"""The vocabulary-sized matrices (token embedding, output), read a block of rows at a time.

They are a checkpoint's largest tensors by far: Llama-3.2-1B's embedding is 128,256 × 2,048,
1 GiB in float32, and widening it whole from BF16 passes through twice that. So the converter
never holds one whole: the writer quantizes it block by block, calibration looks up only the
rows its tokens use, and the head's logits are computed a block of the vocabulary at a time.
Every other tensor belongs to one layer and is read whole with ``Checkpoint.weight``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np
from gguf import MODEL_TENSOR

from edgeinfer.converters.checkpoint import Checkpoint, read_floats
from edgeinfer.models.arch import tensor_name

TOKEN_EMBD = tensor_name(MODEL_TENSOR.TOKEN_EMBD)
OUTPUT = tensor_name(MODEL_TENSOR.OUTPUT)
VOCAB_MATRICES = frozenset({TOKEN_EMBD, OUTPUT})
BLOCK_BYTES = 32 << 20  # float32 bytes per block: small beside the model, large enough for fast matmuls


def read_rows(ckpt: Checkpoint, name: str, start: int, stop: int) -> np.ndarray:
    """Rows ``start:stop`` of a vocabulary matrix as float32, as ``Checkpoint.weight`` would give them
    (these two are stored in GGUF's layout already: no RoPE permutation applies)."""
    if name not in VOCAB_MATRICES:
        raise ValueError(f"{name} is read whole with Checkpoint.weight")
    return read_floats(ckpt.tensors[name], start, stop - start)


def row_blocks(ckpt: Checkpoint, name: str) -> Iterator[np.ndarray]:
    """The tensor's rows as float32, in order: in blocks of about ``BLOCK_BYTES`` for a vocabulary
    matrix, whole (in one block) for any other tensor."""
    if name not in VOCAB_MATRICES:
        yield ckpt.weight(name)
        return
    n_rows = ckpt.shapes[name][0]
    step = _block_rows(ckpt, name)
    for start in range(0, n_rows, step):
        yield read_rows(ckpt, name, start, min(start + step, n_rows))


def gather_rows(ckpt: Checkpoint, name: str, indices: Sequence[int] | np.ndarray) -> np.ndarray:
    """The rows ``indices`` of a tensor, as float32, reading of a vocabulary matrix only the blocks
    that hold them."""
    indices = np.asarray(indices, dtype=np.int64)
    if name not in VOCAB_MATRICES:
        return ckpt.weight(name)[indices]
    wanted = np.unique(indices)
    step = _block_rows(ckpt, name)
    found = np.empty((len(wanted), ckpt.shapes[name][1]), np.float32)
    at = 0
    while at < len(wanted):  # one read per block of rows that holds any wanted
        start = int(wanted[at])
        end = int(np.searchsorted(wanted, start + step))
        found[at:end] = read_rows(ckpt, name, start, int(wanted[end - 1]) + 1)[wanted[at:end] - start]
        at = end
    return found[np.searchsorted(wanted, indices)]


def _block_rows(ckpt: Checkpoint, name: str) -> int:
    return max(1, BLOCK_BYTES // (4 * ckpt.shapes[name][1]))
