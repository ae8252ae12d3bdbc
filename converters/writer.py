"""Writing the GGUF: metadata as llama.cpp reads it, then tensors streamed one at a time.

The file is written under a temporary name beside the target and renamed into place at the
end, so an interrupted conversion never leaves a partial GGUF where a model is expected.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGML_QUANT_VERSION, GGMLQuantizationType, GGUFWriter, LlamaFileType

from edgeinfer.converters.checkpoint import Checkpoint
from edgeinfer.converters.output import scratch
from edgeinfer.converters.rows import row_blocks
from edgeinfer.converters.vocab import Vocab
from edgeinfer.errors import ConversionError
from edgeinfer.files import replace_durably
from edgeinfer.models.arch import ROPE_BASE_SWA, HParams, swa_pattern_layers

QType = GGMLQuantizationType
Quantizer = Callable[[str, np.ndarray, QType], np.ndarray]
"""Turns a tensor (by GGUF name, float32 in numpy order) into the raw bytes of ``qtype``, row by row."""


def tensor_bytes(shape: tuple[int, ...], qtype: QType) -> int:
    """Bytes of a tensor with numpy ``shape`` stored as ``qtype``."""
    block, size = GGML_QUANT_SIZES[qtype]
    n_rows = int(np.prod(shape[:-1], dtype=np.int64)) if len(shape) > 1 else 1
    return n_rows * shape[-1] // block * size


def file_type(types: Mapping[str, QType], shapes: Mapping[str, tuple[int, ...]]) -> LlamaFileType:
    """The ``general.file_type`` to record: the type that holds most of the matrices' weights."""
    weight: dict[QType, int] = {}
    for name, qtype in types.items():
        if len(shapes[name]) > 1:
            weight[qtype] = weight.get(qtype, 0) + int(np.prod(shapes[name]))
    main = max(weight, key=weight.__getitem__) if weight else QType.F32
    if main == QType.F32:
        return LlamaFileType.ALL_F32
    names = LlamaFileType.__members__  # K-quants are named by their mixes: MOSTLY_Q4_K_M
    return names.get(f"MOSTLY_{main.name}") or names.get(f"MOSTLY_{main.name}_M") or LlamaFileType.GUESSED


def new_writer(path: Path, ckpt: Checkpoint, vocab: Vocab, ftype: LlamaFileType) -> GGUFWriter:
    """A GGUFWriter holding every metadata key llama.cpp needs for the checkpoint's architecture."""
    hp = ckpt.hparams
    writer = GGUFWriter(path, hp.arch.gguf_arch)
    writer.add_name(ckpt.folder.resolve().name)
    add_hparams(writer, hp)
    writer.add_vocab_size(hp.n_vocab)
    writer.add_file_type(ftype)
    writer.add_quantization_version(GGML_QUANT_VERSION)
    vocab.add_to(writer)
    return writer


def add_hparams(writer: GGUFWriter, hp: HParams) -> None:
    """The architecture's hyper-parameter keys, as ``models/arch.py`` reads them back."""
    writer.add_context_length(hp.n_ctx_train)
    writer.add_embedding_length(hp.n_embd)
    writer.add_block_count(hp.n_layer)
    writer.add_feed_forward_length(hp.n_ff)
    writer.add_head_count(hp.n_head)
    writer.add_head_count_kv(hp.n_head_kv)
    writer.add_layer_norm_rms_eps(hp.rms_eps)
    writer.add_rope_freq_base(hp.rope_base)
    writer.add_rope_dimension_count(hp.head_dim)
    if hp.head_dim != hp.n_embd // hp.n_head:
        writer.add_key_length(hp.head_dim)
        writer.add_value_length(hp.head_dim)
    # What llama.cpp would otherwise take from its built-in defaults is written only where it differs.
    if hp.sliding_window:
        writer.add_sliding_window(hp.sliding_window)
        if hp.swa_layers != swa_pattern_layers(hp.arch.swa_pattern, hp.n_layer):
            writer.add_sliding_window_pattern(list(hp.swa_layers))
        if hp.rope_base_swa != ROPE_BASE_SWA:
            writer.add_rope_freq_base_swa(hp.rope_base_swa)
    if hp.logit_softcap:
        writer.add_final_logit_softcapping(hp.logit_softcap)


def header_bytes(ckpt: Checkpoint, vocab: Vocab, output: Path) -> int:
    """Bytes before the first tensor of ``output``: metadata and tensor directory, which do not depend on types."""
    with _temporary(scratch(output, "header")) as tmp:
        writer = new_writer(tmp, ckpt, vocab, LlamaFileType.ALL_F32)
        for name, shape in ckpt.shapes.items():
            writer.add_tensor_info(name, shape, np.dtype(np.float32), tensor_bytes(shape, QType.F32), QType.F32)
        writer.write_header_to_file(tmp)
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        writer.close()
        size = tmp.stat().st_size
    return GGUFWriter.ggml_pad(size, 32)  # GGUF's default alignment


def write_vocab_only(path: Path, ckpt: Checkpoint, vocab: Vocab) -> None:
    """A GGUF with the metadata and no tensors: enough for llama.cpp to tokenize with."""
    writer = new_writer(path, ckpt, vocab, LlamaFileType.ALL_F32)
    writer.write_header_to_file(path)
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()


def write_gguf(
    out: Path,
    ckpt: Checkpoint,
    vocab: Vocab,
    types: Mapping[str, QType],
    quantize: Quantizer,
    max_bytes: int | None = None,
) -> int:
    """Write the model with each tensor as ``types`` says, streaming; return the file's size.
    A file over ``max_bytes`` is refused before it replaces anything."""
    with _temporary(scratch(out, "partial")) as tmp:
        writer = new_writer(tmp, ckpt, vocab, file_type(types, ckpt.shapes))
        try:
            for name, shape in ckpt.shapes.items():
                qtype = types[name]
                writer.add_tensor_info(name, shape, np.dtype(np.float32), tensor_bytes(shape, qtype), qtype)
            writer.write_header_to_file(tmp)
            writer.write_kv_data_to_file()
            writer.write_ti_data_to_file()
            for name, shape in ckpt.shapes.items():
                # Block by block, so a vocabulary-sized matrix is never whole in memory as float32.
                data = np.empty(tensor_bytes(shape, types[name]), np.uint8)
                at = 0
                for rows in row_blocks(ckpt, name):
                    block = np.ascontiguousarray(quantize(name, rows.reshape(-1, shape[-1]), types[name]))
                    data[at : at + block.nbytes] = block.view(np.uint8).reshape(-1)
                    at += block.nbytes
                writer.write_tensor_data(data)
        finally:
            writer.close()
        size = tmp.stat().st_size
        if max_bytes is not None and size > max_bytes:  # the plan counts every byte; this guards it
            raise ConversionError(f"the GGUF came out at {size} bytes, over the target of {max_bytes}; nothing written")
        # Not files.atomic_path's random name: output.scratch's names carry the PID, by which the next
        # conversion to this output tells a killed run's leftover from a running one's (output.sweep).
        replace_durably(tmp, out)
    return size


@contextmanager
def _temporary(path: Path) -> Iterator[Path]:
    """A path that is removed on the way out unless it was renamed away."""
    try:
        yield path
    finally:
        path.unlink(missing_ok=True)
