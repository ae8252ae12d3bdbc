"""A Hugging Face checkpoint folder, read lazily: ``config.json`` and ``.safetensors`` shards.

Tensors are read and converted to float32 one at a time, in the layout and convention GGUF
stores (llama's Q and K rows permuted for llama.cpp's RoPE, Gemma's norm weights with the 1 its
RMSNorm adds), so converting a model holds one tensor, not the model, in memory. No torch:
safetensors is a JSON header followed by raw little-endian arrays, and its own numpy API cannot
read BF16, the dtype most checkpoints ship in.

``config.json`` is read in transformers 4's style (``rope_theta``, ``rope_scaling``) and 5's
(``rope_parameters``, per layer kind for Gemma 3); whatever in it llama.cpp would compute
differently from transformers is refused in one line naming the field.
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
from gguf import MODEL_ARCH_NAMES, MODEL_TENSOR, get_tensor_name_map

from edgeinfer.errors import ConversionError
from edgeinfer.models.arch import (
    ARCHITECTURES,
    GGUF_PY_ARCHS,
    MAX_CONTEXT,
    RMS_EPS_RANGE,
    ROPE_BASE_RANGE,
    Architecture,
    HParams,
    expected_tensors,
    llamacpp_attn_scale,
    swa_pattern_layers,
    tensor_name,
)
from edgeinfer.models.gguf_file import GGUF_MAGIC

SUPPORTED_CLASSES = {cls: arch for arch in ARCHITECTURES.values() for cls in arch.hf_classes}
# Classes whose text model we could read but whose checkpoint holds more (a vision tower), with what to use instead.
MULTIMODAL_CLASSES = {"Gemma3ForConditionalGeneration": "Gemma3ForCausalLM (Gemma 3 1B or 270M)"}
# transformers' defaults for what a family's config.json may leave out, where they are not the
# converter's own (no tied embeddings, SiLU, a RoPE base of 10000): Gemma3TextConfig's.
CONFIG_DEFAULTS: dict[str, dict[str, Any]] = {
    "gemma3": {
        "tie_word_embeddings": True,
        "hidden_activation": "gelu_pytorch_tanh",
        "rope_theta": 1_000_000.0,
        "rope_local_base_freq": 10_000.0,
        "query_pre_attn_scalar": 256,
        "sliding_window": 4096,
        "sliding_window_pattern": 6,
    },
}
# Architectures whose HF RMSNorm multiplies by 1 + w: GGUF stores the factor, so the 1 is added here.
NORM_PLUS_ONE = frozenset({"gemma3"})
# The config key naming the FFN's activation, and the HF activation that is llama.cpp's for each Architecture.ffn_act.
ACTIVATION_KEY = {"gemma3": "hidden_activation"}
HF_ACTIVATIONS = {"silu": "silu", "gelu": "gelu_pytorch_tanh"}
# Config keys that mean a mixture of experts; llama.cpp runs those as other architectures.
MOE_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size")
LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
# Tensors a GGUF holds that the checkpoint does not: computed from config.json.
ROPE_FREQS = tensor_name(MODEL_TENSOR.ROPE_FREQS)
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


def read_floats(ref: TensorRef, first_row: int = 0, n_rows: int | None = None) -> np.ndarray:
    """Rows ``first_row:first_row + n_rows`` (all by default) of a stored tensor as float32 ``(n_rows, row)``;
    a one-line error if they hold NaN or infinity."""
    dtype = DTYPES[ref.dtype]
    row = math.prod(ref.shape[1:])
    n_rows = ref.shape[0] - first_row if n_rows is None else n_rows
    # Read, not memory-mapped: mapped pages would stay resident and count as the process's.
    offset = ref.offset + first_row * row * dtype.itemsize
    raw = np.fromfile(ref.file, dtype=dtype, count=n_rows * row, offset=offset).reshape(n_rows, row)
    bf16 = ref.dtype == "BF16"
    array = (raw.astype(np.uint32) << 16).view(np.float32) if bf16 else raw.astype(np.float32, copy=False)
    # One NaN or infinity anywhere makes the float64 sum non-finite, without a mask the tensor's size.
    if not math.isfinite(array.sum(dtype=np.float64)):
        raise ConversionError(
            f"{ref.file}: tensor '{ref.hf_name}' holds NaN or infinite values; the checkpoint is damaged, "
            "download it again"
        )
    return array


class Checkpoint:
    """A local HF checkpoint of a supported architecture, with its tensors under their GGUF names."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        if not self.folder.is_dir():
            raise ConversionError(f"{self.folder} is not a folder; pass a Hugging Face checkpoint folder")
        config = read_json(self.folder / "config.json")
        self.arch = architecture(config, self.folder)
        # With transformers' defaults for what the file leaves out.
        self.config = {**CONFIG_DEFAULTS.get(self.arch.name, {}), **config}
        self.hparams = hparams_from_config(self.config, self.arch, self.folder)
        # Llama 3.1's scaling, as the per-pair frequency divisors llama.cpp reads from rope_freqs.weight.
        full_rope = rope_parameters(self.config)[0]
        self.rope_factors = llama3_rope_factors(full_rope, self.hparams) if self.hparams.rope_freqs else None
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
        self.shapes = {name: tuple(reversed(shape)) for name, shape in expected_tensors(self.hparams).items()}

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
        if name == ROPE_FREQS and self.rope_factors is not None:
            return self.rope_factors.copy()
        ref = self.tensors[name]
        array = read_floats(ref).reshape(ref.shape)
        hp = self.hparams
        if hp.arch.permute_qk and name.endswith(".attn_q.weight"):
            array = permute_rope_rows(array, hp.n_head)
        elif hp.arch.permute_qk and name.endswith(".attn_k.weight"):
            array = permute_rope_rows(array, hp.n_head_kv)
        elif hp.arch.name in NORM_PLUS_ONE and name.endswith("norm.weight"):
            array = array + np.float32(1)
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
        if cls in MULTIMODAL_CLASSES:
            raise ConversionError(
                f"{folder / 'config.json'}: {cls} is a multimodal checkpoint, which the converter does not read; "
                f"convert a text-only {MULTIMODAL_CLASSES[cls]} checkpoint"
            )
    raise ConversionError(
        f"{folder / 'config.json'}: architecture {', '.join(map(str, classes)) or 'unnamed'} is not supported; "
        f"the converter reads {', '.join(sorted(SUPPORTED_CLASSES))}"
    )


def hparams_from_config(config: Mapping[str, Any], arch: Architecture, folder: Path) -> HParams:
    """The hyper-parameters in ``config.json``, refusing what llama.cpp would run differently."""
    where = folder / "config.json"

    def refuse(field: str, value: object, why: str) -> ConversionError:
        return ConversionError(f"{where}: '{field}' = {value!r} is not supported: {why}")

    def number(key: str, default: int | None = None) -> int:
        value = config.get(key, default)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ConversionError(f"{where}: '{key}' is {value!r}; it must be a positive int")
        return value

    def real(key: str, value: object, low: float, high: float) -> float:
        # JSON's NaN and Infinity, which Python reads, fail the comparisons. The second compares the
        # value as the GGUF stores it, in 32 bits: 1e-12 rounds to just under the loader's minimum.
        if (
            isinstance(value, (int, float))
            and not isinstance(value, bool)
            and low <= value <= high
            and low <= float(np.float32(value)) <= high
        ):
            return float(value)
        raise ConversionError(
            f"{where}: '{key}' is {value!r}; it must be a number from {low:g} to {high:g} "
            "as a 32-bit float (fix config.json)"
        )

    for key in MOE_KEYS:
        if config.get(key):
            raise refuse(key, config[key], "the converter reads dense models, not mixtures of experts")
    n_embd, n_head = number("hidden_size"), number("num_attention_heads")
    n_head_kv = number("num_key_value_heads", n_head)
    head_dim = number("head_dim", n_embd // n_head) if config.get("head_dim") is not None else n_embd // n_head
    n_layer = number("num_hidden_layers")
    if n_head % n_head_kv or head_dim % 2:
        raise ConversionError(f"{where}: {n_head} heads, {n_head_kv} KV heads and head size {head_dim} do not fit")
    if config.get("partial_rotary_factor") not in (None, 1.0):
        raise refuse("partial_rotary_factor", config["partial_rotary_factor"], "RoPE must rotate whole heads (1.0)")

    swa_layers = sliding_layers(config, arch, n_layer, where)
    full_rope, sliding_rope = rope_parameters(config)
    rope_field = "rope_parameters" if config.get("rope_parameters") else "rope_scaling"
    rope_kind = full_rope.get("rope_type", full_rope.get("type")) or "default"
    legacy = config.get("rope_scaling")
    if rope_field == "rope_parameters" and isinstance(legacy, dict) and legacy:
        # transformers 4's field beside 5's: a model read by either must mean the same, or the file is wrong.
        legacy_kind = legacy.get("rope_type", legacy.get("type")) or "default"
        if legacy_kind != rope_kind or any(legacy.get(k) != full_rope.get(k) for k in LLAMA3_ROPE_KEYS if k in legacy):
            raise ConversionError(
                f"{where}: 'rope_scaling' ({legacy_kind!r}) and 'rope_parameters' ({rope_kind!r}) say different "
                "things; remove the one transformers does not use for this checkpoint"
            )
    if rope_kind == "llama3" and arch.rope_freqs:
        for key in LLAMA3_ROPE_KEYS:
            real(f"{rope_field}.{key}", full_rope.get(key), 1e-6, float(MAX_CONTEXT))
        if not full_rope["low_freq_factor"] < full_rope["high_freq_factor"]:
            raise ConversionError(f"{where}: '{rope_field}' needs a low_freq_factor below its high_freq_factor")
    elif rope_kind != "default" or (any(swa_layers) and sliding_rope.get("rope_type", "default") != "default"):
        kind = rope_kind if rope_kind != "default" else sliding_rope.get("rope_type")
        supported = "the converter reads models without RoPE scaling" + (
            ", or with Llama 3's ('llama3')" if arch.rope_freqs else f" for {arch.name}"
        )
        raise ConversionError(f"{where}: RoPE scaling {kind!r} ('{rope_field}') is not supported; {supported}")

    act_key = ACTIVATION_KEY.get(arch.name, "hidden_act")
    activation = config.get(act_key, HF_ACTIVATIONS[arch.ffn_act])
    if activation != HF_ACTIVATIONS[arch.ffn_act]:
        raise refuse(act_key, activation, f"llama.cpp runs {arch.name} models with '{HF_ACTIVATIONS[arch.ffn_act]}'")
    for key in ("mlp_bias", "use_sliding_window") + (() if arch.qkv_bias else ("attention_bias",)):
        if config.get(key):
            raise refuse(key, config[key], f"llama.cpp runs {arch.name} models without it")
    if config.get("attn_logit_softcapping") is not None:
        raise refuse("attn_logit_softcapping", config["attn_logit_softcapping"], "llama.cpp does not cap attention")
    softcap = config.get("final_logit_softcapping")
    if softcap is not None and not arch.logit_softcap:
        raise refuse("final_logit_softcapping", softcap, f"llama.cpp does not cap {arch.name} models' logits")

    # transformers scales Gemma's queries by 1/sqrt(query_pre_attn_scalar); llama.cpp by 1/sqrt(head size),
    # or for Gemma 3's 62-layer 27B model by 1/sqrt(n_embd / n_head). They must agree.
    attn_scale = llamacpp_attn_scale(arch.name, n_layer, n_embd, n_head)
    scalar = n_embd // n_head if attn_scale is not None else head_dim
    if config.get("query_pre_attn_scalar", scalar) != scalar:
        raise refuse(
            "query_pre_attn_scalar", config["query_pre_attn_scalar"], f"llama.cpp computes this model with {scalar}"
        )
    sliding: dict[str, Any] = {}
    if any(swa_layers):
        local_base = (
            "rope_parameters.sliding_attention.rope_theta"
            if rope_field == "rope_parameters"
            else "rope_local_base_freq"
        )
        sliding = {
            "sliding_window": number("sliding_window"),
            "swa_layers": swa_layers,
            "rope_base_swa": real(local_base, sliding_rope.get("rope_theta", 10000.0), *ROPE_BASE_RANGE),
        }
    return HParams(
        arch=arch,
        n_vocab=number("vocab_size"),
        n_embd=n_embd,
        n_layer=n_layer,
        n_head=n_head,
        n_head_kv=n_head_kv,
        head_dim=head_dim,
        n_ff=number("intermediate_size"),
        n_ctx_train=number("max_position_embeddings", 4096),
        # The ranges the loader accepts: a file outside them would convert and then load nowhere.
        rope_base=real("rope_theta", full_rope.get("rope_theta", 10000.0), *ROPE_BASE_RANGE),
        rms_eps=real("rms_norm_eps", config.get("rms_norm_eps", 1e-6), *RMS_EPS_RANGE),
        tied_embeddings=bool(config.get("tie_word_embeddings", False)),
        rope_freqs=rope_kind == "llama3",
        attn_scale=attn_scale,
        logit_softcap=real("final_logit_softcapping", softcap, 1e-3, 1e6) if softcap is not None else 0.0,
        **sliding,
    )


def rope_parameters(config: Mapping[str, Any]) -> tuple[Mapping[str, Any], Mapping[str, Any]]:
    """RoPE's settings (``rope_theta``, ``rope_type`` and its parameters) for full-attention layers and
    for sliding-window ones, from transformers 5's ``rope_parameters`` (flat, or by layer kind) or
    4's ``rope_theta`` and ``rope_scaling`` (with Gemma 3's ``rope_local_base_freq``)."""
    params = config.get("rope_parameters")
    if isinstance(params, dict) and isinstance(params.get("full_attention"), dict):
        full = params["full_attention"]
        return full, params.get("sliding_attention") or full
    if isinstance(params, dict) and params:
        full = {**params, "rope_theta": config.get("rope_theta", params.get("rope_theta", 10000.0))}
        return full, full
    scaling = config.get("rope_scaling")
    full = {**(scaling if isinstance(scaling, dict) else {}), "rope_theta": config.get("rope_theta", 10000.0)}
    return full, {"rope_theta": config.get("rope_local_base_freq", full["rope_theta"])}


def sliding_layers(config: Mapping[str, Any], arch: Architecture, n_layer: int, where: Path) -> tuple[bool, ...]:
    """Which layers attend within a sliding window: transformers 5's ``layer_types``, or 4's
    ``sliding_window_pattern`` (every pattern-th layer global). Only architectures llama.cpp runs
    with a window (``swa_pattern``) may have such layers; Mistral's window llama.cpp ignores."""
    layer_types = config.get("layer_types")
    if layer_types is not None:
        kinds = ("full_attention", "sliding_attention") if arch.swa_pattern else ("full_attention",)
        if not (isinstance(layer_types, list) and len(layer_types) == n_layer and set(layer_types) <= set(kinds)):
            raise ConversionError(
                f"{where}: 'layer_types' must name one of {', '.join(kinds)} for each of the {n_layer} layers "
                f"of a {arch.name} model"
            )
        return tuple(kind == "sliding_attention" for kind in layer_types)
    if not arch.swa_pattern:
        return (False,) * n_layer
    pattern = config.get("sliding_window_pattern")
    if not isinstance(pattern, int) or isinstance(pattern, bool) or pattern <= 0:
        raise ConversionError(f"{where}: 'sliding_window_pattern' is {pattern!r}; it must be a positive int")
    return swa_pattern_layers(pattern, n_layer)


def llama3_rope_factors(rope: Mapping[str, Any], hp: HParams) -> np.ndarray:
    """What llama.cpp divides each rotated pair's frequency by for Llama 3.1's RoPE scaling: ``factor`` for
    wavelengths past the original context over ``low_freq_factor``, 1 below it over ``high_freq_factor``,
    and a smooth blend between, as transformers' ``llama3`` rope type scales its frequencies."""
    factor, low, high = (float(rope[key]) for key in LLAMA3_ROPE_KEYS[:3])
    original = float(rope["original_max_position_embeddings"])
    wavelength = 2 * math.pi * hp.rope_base ** (np.arange(0, hp.head_dim, 2) / hp.head_dim)
    smooth = (original / wavelength - low) / (high - low)
    blended = 1 / ((1 - smooth) / factor + smooth)
    factors = np.where(wavelength < original / high, 1.0, np.where(wavelength > original / low, factor, blended))
    return factors.astype(np.float32)


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
    arch = GGUF_PY_ARCHS[hp.arch.gguf_arch]
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
    missing = [n for n in expected if n not in tensors and n != ROPE_FREQS]
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
