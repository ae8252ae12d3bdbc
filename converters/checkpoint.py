"""A Hugging Face checkpoint folder, read lazily: ``config.json`` and ``.safetensors`` shards.

Tensors are read and converted to float32 one at a time, in the layout GGUF stores
(llama's Q and K rows permuted for llama.cpp's RoPE), so converting a model holds one tensor,
not the model, in memory. No torch: safetensors is a JSON header followed by raw little-endian
arrays, and its own numpy API cannot read BF16, the dtype most checkpoints ship in.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import MODEL_ARCH, MODEL_ARCH_NAMES, MODEL_TENSOR, get_tensor_name_map

from edgeinfer.errors import ConversionError
from edgeinfer.models.arch import (
    ARCHITECTURES,
    RMS_EPS_RANGE,
    ROPE_BASE_RANGE,
    Architecture,
    HParams,
    expected_tensors,
    tensor_name,
)
from edgeinfer.models.gguf_file import GGUF_MAGIC

SUPPORTED_CLASSES = {cls: arch for arch in ARCHITECTURES.values() for cls in arch.hf_classes}
# Safetensors dtypes we read, with their numpy storage type; BF16 is widened by hand.
DTYPES: dict[str, np.dtype] = {"F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": np.dtype("<u2")}
# Buffers some checkpoints save that are not weights (recomputed from config.json).
IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)
MAX_HEADER = 100 << 20


@dataclass(frozen=True)
class TensorRef:
    """Where one tensor's bytes sit: which file, at what offset, in what dtype and (numpy) shape."""

    hf_name: str
    file: Path
    dtype: str
    shape: tuple[int, ...]
    offset: int


class Checkpoint:
    """A local HF checkpoint of a supported architecture, with its tensors under their GGUF names."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        if not self.folder.is_dir():
            raise ConversionError(f"{self.folder} is not a folder; pass a Hugging Face checkpoint folder")
        self.config = read_json(self.folder / "config.json")
        self.arch = architecture(self.config, self.folder)
        self.hparams = hparams_from_config(self.config, self.arch, self.folder)
        self.shards = safetensors_files(self.folder)
        refs: dict[str, TensorRef] = {}
        for ref in (ref for path in self.shards for ref in read_header(path)):
            if ref.hf_name in refs:
                raise ConversionError(
                    f"{self.folder}: tensor '{ref.hf_name}' is in both {refs[ref.hf_name].file.name} and "
                    f"{ref.file.name}; remove the stray file"
                )
            refs[ref.hf_name] = ref
        self.tensors = gguf_names(refs, self.hparams, self.folder)
        # Every tensor's numpy shape by GGUF name, in the order they are written.
        self.shapes = {name: self.tensors[name].shape for name in expected_tensors(self.hparams)}

    def files(self) -> list[Path]:
        """Every file the checkpoint is made of: its shards (wherever the index puts them) and each
        file in its folder (config, tokenizer, README), but no GGUF: conversions write those, never read them."""
        loose = [path for path in self.folder.iterdir() if path.is_file() and not _is_gguf(path)]
        return [*self.shards, *loose]

    @property
    def source_dtype(self) -> str:
        """The widest dtype among the matrices: what "unquantized" means for this checkpoint."""
        dtypes = {ref.dtype for ref in self.tensors.values() if len(ref.shape) > 1}
        return "F32" if "F32" in dtypes else "F16" if dtypes == {"F16"} else "BF16" if dtypes == {"BF16"} else "F32"

    def weight(self, name: str) -> np.ndarray:
        """The tensor GGUF calls ``name``, as float32 in GGUF's numpy layout ``(n_out, n_in)``."""
        ref = self.tensors[name]
        dtype = DTYPES[ref.dtype]
        # Read, not memory-mapped: mapped pages would stay resident and count as the process's.
        raw = np.fromfile(ref.file, dtype=dtype, count=math.prod(ref.shape), offset=ref.offset).reshape(ref.shape)
        bf16 = ref.dtype == "BF16"
        array = (raw.astype(np.uint32) << 16).view(np.float32) if bf16 else raw.astype(np.float32, copy=False)
        # One NaN or infinity anywhere makes the float64 sum non-finite, without a mask the tensor's size.
        if not math.isfinite(array.sum(dtype=np.float64)):
            raise ConversionError(
                f"{ref.file}: tensor '{ref.hf_name}' holds NaN or infinite values; the checkpoint is damaged, "
                "download it again"
            )
        hp = self.hparams
        if hp.arch.permute_qk and name.endswith(".attn_q.weight"):
            array = permute_rope_rows(array, hp.n_head)
        elif hp.arch.permute_qk and name.endswith(".attn_k.weight"):
            array = permute_rope_rows(array, hp.n_head_kv)
        return array


def permute_rope_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Reorder each head's Q or K rows from HF's half-split RoPE pairs (i, i + d/2) to the adjacent
    pairs (2i, 2i + 1) llama.cpp rotates for llama: row ``h*d + 2i + j`` takes HF row ``h*d + j*d/2 + i``."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _is_gguf(path: Path) -> bool:
    try:
        with path.open("rb") as f:
            return f.read(len(GGUF_MAGIC)) == GGUF_MAGIC
    except OSError:  # unreadable: counted among the files not to overwrite
        return False


def read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConversionError(f"{path.parent} has no {path.name}; pass the folder of a Hugging Face checkpoint")
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConversionError(f"{path} is not valid JSON ({exc}); restore the file from the model's source") from None
    if not isinstance(value, dict):
        raise ConversionError(f"{path} holds a {type(value).__name__}, not a JSON object")
    return value


def architecture(config: Mapping[str, Any], folder: Path) -> Architecture:
    classes = config.get("architectures") or []
    for cls in classes if isinstance(classes, list) else []:
        if cls in SUPPORTED_CLASSES:
            return SUPPORTED_CLASSES[cls]
    raise ConversionError(
        f"{folder / 'config.json'}: architecture {', '.join(map(str, classes)) or 'unnamed'} is not supported; "
        f"the converter reads {', '.join(sorted(SUPPORTED_CLASSES))}"
    )


def hparams_from_config(config: Mapping[str, Any], arch: Architecture, folder: Path) -> HParams:
    """The hyper-parameters in ``config.json``, refusing what llama.cpp would run differently."""
    where = folder / "config.json"

    def number(key: str, default: int | None = None) -> int:
        value = config.get(key, default)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ConversionError(f"{where}: '{key}' is {value!r}; it must be a positive int")
        return value

    def real(key: str, default: float, low: float, high: float) -> float:
        value = config.get(key, default)
        # JSON's NaN and Infinity, which Python reads, fail the comparisons. The second compares the
        # value as the GGUF stores it, in 32 bits: 1e-12 rounds to just under the loader's minimum.
        in_range = isinstance(value, (int, float)) and not isinstance(value, bool) and low <= value <= high
        if not (in_range and low <= float(np.float32(value)) <= high):
            raise ConversionError(
                f"{where}: '{key}' is {value!r}; it must be a number from {low:g} to {high:g} "
                "as a 32-bit float (fix config.json)"
            )
        return float(value)

    n_embd, n_head = number("hidden_size"), number("num_attention_heads")
    n_head_kv = number("num_key_value_heads", n_head)
    head_dim = number("head_dim", n_embd // n_head) if config.get("head_dim") is not None else n_embd // n_head
    if n_head % n_head_kv or head_dim % 2:
        raise ConversionError(f"{where}: {n_head} heads, {n_head_kv} KV heads and head size {head_dim} do not fit")
    rope = config.get("rope_parameters") or {}  # transformers 5 moved rope_theta and rope_scaling here
    scaling = config.get("rope_scaling") or ({} if rope.get("rope_type", "default") == "default" else rope)
    if scaling:
        kind = scaling.get("rope_type", scaling.get("type"))
        raise ConversionError(
            f"{where}: RoPE scaling '{kind}' is not supported by the converter; use a model without it"
        )
    unsupported = [f"hidden_act={config['hidden_act']!r}"] if config.get("hidden_act", "silu") != "silu" else []
    unsupported += [f"{key}=True" for key in ("mlp_bias", "use_sliding_window") if config.get(key)]
    if config.get("attention_bias") and not arch.qkv_bias:
        unsupported.append("attention_bias=True")
    if unsupported:
        raise ConversionError(f"{where}: {', '.join(unsupported)} is not what llama.cpp runs for {arch.name} models")
    return HParams(
        arch=arch,
        n_vocab=number("vocab_size"),
        n_embd=n_embd,
        n_layer=number("num_hidden_layers"),
        n_head=n_head,
        n_head_kv=n_head_kv,
        head_dim=head_dim,
        n_ff=number("intermediate_size"),
        n_ctx_train=number("max_position_embeddings", 4096),
        # The ranges the loader accepts: a file outside them would convert and then load nowhere.
        rope_base=real("rope_theta", rope.get("rope_theta", 10000.0), *ROPE_BASE_RANGE),
        rms_eps=real("rms_norm_eps", 1e-6, *RMS_EPS_RANGE),
        tied_embeddings=bool(config.get("tie_word_embeddings", False)),
    )


def safetensors_files(folder: Path) -> list[Path]:
    """The checkpoint's safetensors files: all shards the index names, or every one in the folder."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ConversionError(f"{index} has no weight_map; restore the file from the model's source")
        files = sorted({str(f) for f in weight_map.values()})
        missing = [f for f in files if not (folder / f).is_file()]
        if missing:
            raise ConversionError(
                f"{folder}: shard {missing[0]} named in {index.name} is missing"
                f"{f' (and {len(missing) - 1} more)' if len(missing) > 1 else ''}; download every shard"
            )
        return [folder / f for f in files]
    paths = sorted(folder.glob("*.safetensors"))
    if not paths:
        bins = sorted(p.name for p in folder.glob("*.bin")) + sorted(p.name for p in folder.glob("*.pt*"))
        hint = f" (found {bins[0]}: PyTorch pickles are not read; save the model with safetensors)" if bins else ""
        raise ConversionError(f"{folder} has no .safetensors weights{hint}")
    return paths


def read_header(path: Path) -> Iterator[TensorRef]:
    """The tensors one safetensors file holds, each checked against the file's size."""
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(8)
        (length,) = struct.unpack("<Q", head) if len(head) == 8 else (size,)
        if not 2 <= length <= min(MAX_HEADER, size - 8):
            raise ConversionError(f"{path} is not a safetensors file (header length {length}); re-download it")
        try:
            header = json.loads(f.read(length))
        except (UnicodeDecodeError, json.JSONDecodeError):
            header = None
    if not isinstance(header, dict):
        raise ConversionError(f"{path} has a corrupt safetensors header; re-download it")
    start = 8 + length
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if any(name.endswith(s) for s in IGNORED_SUFFIXES):
            continue
        fields = entry if isinstance(entry, dict) else {}
        dtype, shape, offsets = fields.get("dtype"), fields.get("shape"), fields.get("data_offsets")
        if not (isinstance(shape, list) and isinstance(offsets, list) and len(offsets) == 2) or not all(
            isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in (*shape, *offsets)
        ):
            raise ConversionError(f"{path}: tensor '{name}' has a malformed header entry; re-download it")
        begin, end = offsets
        if not isinstance(dtype, str) or dtype not in DTYPES:
            raise ConversionError(
                f"{path}: tensor '{name}' is {dtype}; the converter reads F32, F16 and BF16 "
                "(dequantize or cast the checkpoint first)"
            )
        count = int(np.prod(shape, dtype=np.int64)) if shape else 1
        if not 0 <= begin <= end <= size - start or end - begin != count * DTYPES[dtype].itemsize:
            raise ConversionError(
                f"{path}: tensor '{name}' lies outside the file or has the wrong size; re-download it"
            )
        yield TensorRef(name, path, dtype, tuple(shape), start + begin)


def gguf_names(refs: Mapping[str, TensorRef], hp: HParams, folder: Path) -> dict[str, TensorRef]:
    """The checkpoint's tensors under their GGUF names, each with the shape config.json implies."""
    arch = MODEL_ARCH.QWEN2 if hp.arch.gguf_arch == "qwen2" else MODEL_ARCH.LLAMA
    name_map = get_tensor_name_map(arch, hp.n_layer)
    expected = expected_tensors(hp)
    output = tensor_name(MODEL_TENSOR.OUTPUT)
    tensors: dict[str, TensorRef] = {}
    for hf_name, ref in refs.items():
        name = name_map.get_name(hf_name, try_suffixes=(".weight", ".bias")) or hf_name
        if name == output and hp.tied_embeddings:
            continue  # a copy of the embeddings some checkpoints save although tied
        if name not in expected:
            raise ConversionError(
                f"{folder}: tensor '{hf_name}' is not part of a {MODEL_ARCH_NAMES[arch]} model "
                "as config.json describes it; check the architecture in config.json"
            )
        shape = tuple(reversed(expected[name]))
        if ref.shape != shape:
            raise ConversionError(
                f"{folder}: tensor '{hf_name}' has shape {list(ref.shape)}, but config.json implies {list(shape)}; "
                "the config does not belong to these weights"
            )
        tensors[name] = ref
    missing = [n for n in expected if n not in tensors]
    if missing:
        hint = (
            " (set tie_word_embeddings in config.json if the output shares the embeddings)"
            if missing == [output]
            else ""
        )
        raise ConversionError(
            f"{folder}: the weights lack the tensor GGUF calls '{missing[0]}' ({len(missing)} missing){hint}"
        )
    return tensors
