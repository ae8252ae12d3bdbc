"""The architectures edgeinfer runs, as data: hyper-parameters from GGUF metadata, tensor names
and shapes, RoPE style and tied embeddings. Every backend and the converter read models through here.

Shapes are in ggml order (the fastest-varying dimension first), as GGUF stores them: a
projection from ``n_in`` to ``n_out`` features is ``(n_in, n_out)``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from gguf import MODEL_ARCH_NAMES, MODEL_TENSOR, MODEL_TENSORS, TENSOR_NAMES, GGMLQuantizationType, Keys

from edgeinfer.errors import InvalidModelError
from edgeinfer.models.gguf_file import LongArray, TensorInfo, array_length

RopeStyle = Literal["norm", "neox"]


@dataclass(frozen=True)
class Architecture:
    """What distinguishes one family of decoder-only transformers from another.

    ``rope_style``: ``norm`` rotates adjacent pairs (x0, x1), (x2, x3)...; ``neox`` rotates
    (x_i, x_{i+d/2}). llama.cpp runs llama with ``norm`` because its converter permutes the
    Q and K rows of Hugging Face's checkpoints (``permute_qk``), which were trained with ``neox``.

    The block is the same for all of them; the flags after ``reference`` say where one differs,
    as llama.cpp's graph for the architecture (``src/models/<arch>.cpp``) computes it.
    """

    name: str  # Hugging Face's name for it (the converter's key)
    gguf_arch: str  # general.architecture in GGUF
    hf_classes: tuple[str, ...]
    rope_style: RopeStyle
    permute_qk: bool
    qkv_bias: bool
    # False for the architectures llama.cpp runs that edgeinfer's reference transformer and converter
    # do not implement: their files are checked by gguf-py's tensor tables (see ``llamacpp_only``).
    reference: bool = True
    qk_norm: bool = False  # each head's queries and keys are RMS-normalized before RoPE (attn_q_norm, attn_k_norm)
    post_norms: bool = False  # the attention's and the FFN's outputs are RMS-normalized before the residual add
    embed_scale: bool = False  # the token embeddings are multiplied by sqrt(n_embd)
    ffn_act: Literal["silu", "gelu"] = "silu"  # the FFN gate's activation; gelu is the tanh approximation
    rope_freqs: bool = False  # llama.cpp loads rope_freqs.weight if the file has it (Llama 3.1's RoPE scaling)
    # With a sliding window and no '{arch}.attention.sliding_window_pattern', every swa_pattern-th
    # layer attends globally and the others within the window: llama.cpp's built-in pattern.
    swa_pattern: int = 0
    logit_softcap: bool = False  # llama.cpp reads '{arch}.final_logit_softcapping'

    @classmethod
    def llamacpp_only(cls, gguf_arch: str) -> Architecture:
        """An architecture edgeinfer leaves to llama.cpp, known by its GGUF name alone."""
        return cls(gguf_arch, gguf_arch, (), "norm", permute_qk=False, qkv_bias=False, reference=False)


ARCHITECTURES: dict[str, Architecture] = {
    a.name: a
    for a in (
        Architecture("llama", "llama", ("LlamaForCausalLM",), "norm", permute_qk=True, qkv_bias=False, rope_freqs=True),
        # llama.cpp runs Mistral (full attention, no sliding window) as llama.
        Architecture(
            "mistral", "llama", ("MistralForCausalLM",), "norm", permute_qk=True, qkv_bias=False, rope_freqs=True
        ),
        Architecture("qwen2", "qwen2", ("Qwen2ForCausalLM",), "neox", permute_qk=False, qkv_bias=True),
        Architecture("qwen3", "qwen3", ("Qwen3ForCausalLM",), "neox", permute_qk=False, qkv_bias=False, qk_norm=True),
        # Gemma 3's text-only model. Its converter adds 1 to every norm weight (Gemma's RMSNorm
        # multiplies by 1 + w), so the file's norms are plain ones.
        Architecture(
            "gemma3",
            "gemma3",
            ("Gemma3ForCausalLM",),
            "neox",
            permute_qk=False,
            qkv_bias=False,
            qk_norm=True,
            post_norms=True,
            embed_scale=True,
            ffn_act="gelu",
            swa_pattern=6,
            logit_softcap=True,
        ),
    )
}
_BY_GGUF_ARCH = {a.gguf_arch: a for a in ARCHITECTURES.values() if a.name != "mistral"}

# gguf-py's names for architectures, and the tensors each has: the tables llama.cpp's own converter
# writes files by. An architecture missing here may still be one the installed llama.cpp runs.
GGUF_PY_ARCHS = {name: arch for arch, name in MODEL_ARCH_NAMES.items()}
# llama.cpp prefixes metadata keys with the architecture's name: a name that could not be a key part
# (or a file name) is no architecture at all.
_ARCH_NAME = re.compile(r"[a-z][a-z0-9_.\-]{0,63}")
# Metadata under these names means layers that keep a recurrent state rather than (or besides)
# attention's keys and values: Mamba's SSM, RWKV's WKV, LFM2's short convolutions.
_RECURRENT_KEY_PARTS = (".ssm.", ".wkv.", ".shortconv.")
# The largest sizes we accept: far above any model that runs on an edge device, low enough
# that arithmetic on them cannot overflow llama.cpp's 32-bit fields.
MAX_DIM = 1 << 20
MAX_LAYERS = 512  # llama.cpp's LLAMA_MAX_LAYERS
MAX_CONTEXT = 1 << 24
MIN_CONTEXT = 64  # below any real model's, and too short to hold a chat turn
# A RoPE base below 1 makes RoPE's frequencies grow past float range: NaN logits.
ROPE_BASE_RANGE = (1.0, float(1 << 40))
RMS_EPS_RANGE = (1e-12, 1.0)
ROPE_BASE_SWA = 10000.0  # llama.cpp's RoPE base for sliding-window layers, unless '{arch}.rope.freq_base_swa' says
# The RoPE scaling names llama.cpp knows; it aborts on any other.
ROPE_SCALING_TYPES = ("none", "linear", "yarn", "longrope")

# The types llama.cpp's CPU backend multiplies with and looks rows up in (each checked on a real
# decode). Integer and f64 weights, and the Q8_K scratch format, crash it at the first decode.
# By name, as older gguf-py releases lack the newest ones.
_MATRIX_TYPE_NAMES = (
    "F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
    "IQ2_XXS", "IQ2_XS", "IQ3_XXS", "IQ1_S", "IQ4_NL", "IQ3_S", "IQ2_S", "IQ4_XS", "IQ1_M", "TQ1_0", "TQ2_0",
    "MXFP4", "NVFP4", "Q1_0",
)  # fmt: skip
MATRIX_TYPES = frozenset(GGMLQuantizationType[n] for n in _MATRIX_TYPE_NAMES if n in GGMLQuantizationType.__members__)
# Norm weights and biases are added and multiplied element-wise, which llama.cpp does in f32 only.
VECTOR_TYPES = frozenset({GGMLQuantizationType.F32})


@dataclass(frozen=True)
class HParams:
    """A model's hyper-parameters, as its GGUF metadata states them."""

    arch: Architecture
    n_vocab: int
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int
    n_ctx_train: int
    rope_base: float
    rms_eps: float
    tied_embeddings: bool  # no output.weight: the output projection reuses token_embd
    rope_scaling: str = "none"  # or linear, yarn, longrope: context extension
    kv_heads_per_layer: tuple[int, ...] = ()  # where layers differ (0: a layer without attention); else n_head_kv
    value_dim: int | None = None  # V's head size where it differs from K's (head_dim)
    recurrent: bool = False  # some layers keep a recurrent state, which cannot drop old tokens
    rope_freqs: bool = False  # rope_freqs.weight divides each rotated pair's frequency (Llama 3.1's RoPE scaling)
    # A query in a sliding-window layer sees the keys fewer than sliding_window positions behind it,
    # its own included (llama.cpp's is_masked_swa); the other layers see every earlier key.
    sliding_window: int = 0
    swa_layers: tuple[bool, ...] = ()  # per layer: attends within sliding_window (empty: none does)
    rope_base_swa: float = ROPE_BASE_SWA  # the sliding-window layers' RoPE base
    attn_scale: float | None = None  # what attention scores are multiplied by; None: 1/sqrt(head_dim)
    logit_softcap: float = 0.0  # the logits become logit_softcap * tanh(logits / logit_softcap); 0: not capped

    def window(self, layer: int) -> int:
        """How many positions back a query of ``layer`` sees, its own included; 0: all of them."""
        return self.sliding_window if self.swa_layers and self.swa_layers[layer] else 0

    def layer_rope_base(self, layer: int) -> float:
        """The RoPE base ``layer`` rotates with: sliding-window layers have their own."""
        return self.rope_base_swa if self.swa_layers and self.swa_layers[layer] else self.rope_base

    @property
    def kv_values_per_token(self) -> int:
        """Values of KV cache one token takes: K and V, every layer, every KV head."""
        heads = sum(self.kv_heads_per_layer) if self.kv_heads_per_layer else self.n_layer * self.n_head_kv
        return heads * (self.head_dim + (self.head_dim if self.value_dim is None else self.value_dim))

    @property
    def q_dim(self) -> int:
        return self.n_head * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_head_kv * self.head_dim


def architecture_for_gguf(name: object, file: str) -> Architecture:
    """The Architecture a GGUF's ``general.architecture`` names, or a one-line error.

    Any well-formed name passes: whether the installed llama.cpp runs it is llama.cpp's to say when
    it loads the file (``backends/llamacpp.py`` turns its refusal into one line).
    """
    if name is None:
        raise InvalidModelError(f"{file} lacks the metadata key '{Keys.General.ARCHITECTURE}' (re-convert the model)")
    if not isinstance(name, str) or not _ARCH_NAME.fullmatch(name):
        raise InvalidModelError(f"{file}: '{Keys.General.ARCHITECTURE}' = {name!r} is not an architecture name")
    return _BY_GGUF_ARCH.get(name) or Architecture.llamacpp_only(name)


def hparams_from_metadata(meta: Mapping[str, Any], tensor_names: set[str], file: str) -> HParams:
    """Read and check a model's hyper-parameters.

    For the architectures the reference implements, every value it computes with; for the others,
    what edgeinfer sizes the KV cache and checks the tensors by, leaving the rest to llama.cpp.
    """
    arch = architecture_for_gguf(meta.get(Keys.General.ARCHITECTURE), file)
    prefix = arch.gguf_arch

    def positive(
        key_template: str, default: Any = None, limit: float = MAX_DIM, low: float = 1, kind: type = int
    ) -> Any:
        key = key_template.format(arch=prefix)
        value = meta.get(key, default)
        if value is None and not any(k.startswith(f"{prefix}.") for k in meta):
            # None of the architecture's keys: the name is wrong, or the file was made for something else.
            raise InvalidModelError(
                f"{file} says its architecture is '{prefix}' but has none of its metadata ('{key}' first); "
                "re-convert the model or fix 'general.architecture'"
            )
        if value is None:
            raise InvalidModelError(f"{file} lacks the metadata key '{key}' (re-convert the model)")
        ok_type = isinstance(value, (int, float)) if kind is float else isinstance(value, int)
        if isinstance(value, bool) or not ok_type or not low <= value <= limit:  # NaN fails too
            raise InvalidModelError(
                f"{file}: metadata '{key}' = {value!r} is out of range ({low:g} to {limit:g}); re-convert the model"
            )
        return kind(value)

    def per_layer(key_template: str, default: int | tuple[int, ...]) -> tuple[int, ...]:
        """A count that some architectures give per layer (an array) and most once for all layers."""
        key = key_template.format(arch=prefix)
        value = meta.get(key, default)
        if isinstance(value, LongArray):
            value = [] if value.values is None else value.values.tolist()
        if isinstance(value, (list, tuple)):
            if len(value) != n_layer or not all(_is_count(v) for v in value):
                raise InvalidModelError(
                    f"{file}: metadata '{key}' must hold one count from 0 to {MAX_DIM} for each of the {n_layer} "
                    "layers; re-convert the model"
                )
            return tuple(value)
        return (positive(key_template, default, low=0 if not arch.reference else 1),) * n_layer

    n_layer = positive(Keys.LLM.BLOCK_COUNT, limit=MAX_LAYERS)
    n_embd = positive(Keys.LLM.EMBEDDING_LENGTH)
    # Recurrent architectures (Mamba, RWKV) have no attention heads at all.
    heads = per_layer(Keys.Attention.HEAD_COUNT, None if arch.reference else 0)
    kv_heads = per_layer(Keys.Attention.HEAD_COUNT_KV, heads)
    n_head, n_head_kv = max(heads), max(kv_heads)
    head_dim = positive(Keys.Attention.KEY_LENGTH, n_embd // n_head if n_head else 0, low=0 if n_head == 0 else 1)
    value_dim = positive(Keys.Attention.VALUE_LENGTH, head_dim, low=0 if n_head == 0 else 1)
    for q, kv in zip(heads, kv_heads, strict=True):
        if kv > q or (kv and q % kv):
            raise InvalidModelError(f"{file}: {q} attention heads do not divide into {kv} KV head groups")
    if arch.reference:
        if len({*heads}) > 1 or len({*kv_heads}) > 1:
            raise InvalidModelError(f"{file}: {prefix} models have the same number of heads in every layer")
        _check_reference_hparams(meta, prefix, head_dim, file)
    else:
        experts = positive(Keys.LLM.EXPERT_COUNT, 0, low=0)
        used = positive(Keys.LLM.EXPERT_USED_COUNT, 0, low=0)
        if used > experts or (experts and not used):  # llama.cpp asserts on these and ends the process
            raise InvalidModelError(f"{file}: {used} experts used per token out of {experts}; re-convert the model")
    scaling_key = Keys.Rope.SCALING_TYPE.format(arch=prefix)
    if meta.get(scaling_key, "none") not in ROPE_SCALING_TYPES:
        raise InvalidModelError(
            f"{file}: metadata '{scaling_key}' = {meta[scaling_key]!r} is not one of {', '.join(ROPE_SCALING_TYPES)}"
        )
    n_vocab = array_length(meta.get(Keys.Tokenizer.LIST))  # llama.cpp's definition of the vocabulary size
    if not 0 < n_vocab <= MAX_DIM:
        raise InvalidModelError(f"{file} has no usable vocabulary ({Keys.Tokenizer.LIST}); re-convert the model")
    window = positive(Keys.Attention.SLIDING_WINDOW, 0, low=0, limit=MAX_CONTEXT) if arch.swa_pattern else 0
    eps_key = Keys.Attention.LAYERNORM_RMS_EPS
    return HParams(
        arch=arch,
        n_vocab=n_vocab,
        n_embd=n_embd,
        n_layer=n_layer,
        n_head=n_head,
        n_head_kv=n_head_kv,
        head_dim=head_dim,
        n_ff=max(per_layer(Keys.LLM.FEED_FORWARD_LENGTH, None if arch.reference else 0)),
        n_ctx_train=positive(Keys.LLM.CONTEXT_LENGTH, limit=MAX_CONTEXT, low=MIN_CONTEXT),
        rope_base=positive(Keys.Rope.FREQ_BASE, 10000.0, low=ROPE_BASE_RANGE[0], limit=ROPE_BASE_RANGE[1], kind=float),
        # Only the reference computes with it; other architectures may use LayerNorm's key instead.
        rms_eps=positive(
            eps_key, None if arch.reference else 0.0, low=RMS_EPS_RANGE[0], limit=RMS_EPS_RANGE[1], kind=float
        )
        if arch.reference or eps_key.format(arch=prefix) in meta
        else 0.0,
        tied_embeddings=tensor_name(MODEL_TENSOR.OUTPUT) not in tensor_names,
        rope_scaling=meta.get(scaling_key, "none"),
        kv_heads_per_layer=kv_heads if len(set(kv_heads)) > 1 else (),
        value_dim=value_dim,
        recurrent=any(part in key for key in meta for part in _RECURRENT_KEY_PARTS if key.startswith(prefix + ".")),
        rope_freqs=arch.rope_freqs and tensor_name(MODEL_TENSOR.ROPE_FREQS) in tensor_names,
        sliding_window=window,
        swa_layers=_swa_layers(meta, prefix, arch.swa_pattern, n_layer, file) if window else (),
        rope_base_swa=positive(
            Keys.Rope.FREQ_BASE_SWA, ROPE_BASE_SWA, low=ROPE_BASE_RANGE[0], limit=ROPE_BASE_RANGE[1], kind=float
        )
        if window
        else ROPE_BASE_SWA,
        attn_scale=llamacpp_attn_scale(prefix, n_layer, n_embd, n_head),
        logit_softcap=positive(Keys.LLM.FINAL_LOGIT_SOFTCAPPING, 0.0, low=0, limit=MAX_DIM, kind=float)
        if arch.logit_softcap
        else 0.0,
    )


def _swa_layers(meta: Mapping[str, Any], prefix: str, pattern: int, n_layer: int, file: str) -> tuple[bool, ...]:
    """Which layers attend within the sliding window, as llama.cpp's ``load_swa_pattern`` reads it:
    '{arch}.attention.sliding_window_pattern' as one flag per layer, or as a count ``n`` (then the
    architecture's), meaning every n-th layer is global (and 0: none is)."""
    key = Keys.Attention.SLIDING_WINDOW_PATTERN.format(arch=prefix)
    value = meta.get(key, pattern)
    if isinstance(value, list):  # of bools, or of integers where any but 0 means true
        if len(value) != n_layer or not all(isinstance(flag, int) for flag in value):
            raise InvalidModelError(f"{file}: metadata '{key}' must hold one flag for each of the {n_layer} layers")
        return tuple(bool(flag) for flag in value)
    if not _is_count(value):
        raise InvalidModelError(f"{file}: metadata '{key}' = {value!r} is neither a layer count nor one flag per layer")
    return swa_pattern_layers(value, n_layer)


def llamacpp_attn_scale(arch: str, n_layer: int, n_embd: int, n_head: int) -> float | None:
    """The attention scale llama.cpp uses where it is not 1/sqrt(head size) (None elsewhere): Gemma 3 27B's
    query_pre_attn_scalar, n_embd / n_head, for the model llama.cpp knows by its 62 layers."""
    return 1 / math.sqrt(n_embd // n_head) if arch == "gemma3" and n_layer == 62 else None


def swa_pattern_layers(pattern: int, n_layer: int) -> tuple[bool, ...]:
    """Which of ``n_layer`` layers attend within the sliding window when every ``pattern``-th one is
    global (0: none is), as llama.cpp's ``set_swa_pattern`` lays them out."""
    return tuple(pattern == 0 or layer % pattern < pattern - 1 for layer in range(n_layer))


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_DIM


def _check_reference_hparams(meta: Mapping[str, Any], prefix: str, head_dim: int, file: str) -> None:
    """What the reference transformer cannot compute: odd heads, partial RoPE, a V head size of its own, experts.

    llama.cpp aborts on inconsistent expert counts and unknown scaling names.
    """
    if head_dim % 2:
        raise InvalidModelError(f"{file}: head dimension {head_dim} is odd; RoPE needs an even one")
    for key_template, expected in (
        (Keys.Rope.DIMENSION_COUNT, head_dim),
        (Keys.Attention.VALUE_LENGTH, head_dim),
        (Keys.Rope.DIMENSION_COUNT_SWA, head_dim),
        (Keys.Attention.KEY_LENGTH_SWA, head_dim),
        (Keys.Attention.VALUE_LENGTH_SWA, head_dim),
        (Keys.LLM.EXPERT_COUNT, 0),
        (Keys.LLM.EXPERT_USED_COUNT, 0),
    ):
        key = key_template.format(arch=prefix)
        if meta.get(key, expected) != expected:
            raise InvalidModelError(f"{file}: metadata '{key}' = {meta[key]!r}; {prefix} models need {expected}")


def tensor_name(kind: MODEL_TENSOR, layer: int | None = None, suffix: str = "weight") -> str:
    """The GGUF name of a tensor, e.g. ``tensor_name(MODEL_TENSOR.ATTN_Q, 3)`` -> ``blk.3.attn_q.weight``."""
    base = TENSOR_NAMES[kind]
    return f"{base.format(bid=layer) if layer is not None else base}.{suffix}"


def layer_tensors(hp: HParams, layer: int) -> Iterator[tuple[str, tuple[int, ...]]]:
    """Name and ggml shape of each tensor of one transformer block."""
    e, q, kv, ff = hp.n_embd, hp.q_dim, hp.kv_dim, hp.n_ff
    shapes: list[tuple[MODEL_TENSOR, str, tuple[int, ...]]] = [
        (MODEL_TENSOR.ATTN_NORM, "weight", (e,)),
        (MODEL_TENSOR.ATTN_Q, "weight", (e, q)),
        (MODEL_TENSOR.ATTN_K, "weight", (e, kv)),
        (MODEL_TENSOR.ATTN_V, "weight", (e, kv)),
        (MODEL_TENSOR.ATTN_OUT, "weight", (q, e)),
        (MODEL_TENSOR.FFN_NORM, "weight", (e,)),
        (MODEL_TENSOR.FFN_GATE, "weight", (e, ff)),
        (MODEL_TENSOR.FFN_UP, "weight", (e, ff)),
        (MODEL_TENSOR.FFN_DOWN, "weight", (ff, e)),
    ]
    if hp.arch.qkv_bias:
        shapes += [
            (MODEL_TENSOR.ATTN_Q, "bias", (q,)),
            (MODEL_TENSOR.ATTN_K, "bias", (kv,)),
            (MODEL_TENSOR.ATTN_V, "bias", (kv,)),
        ]
    if hp.arch.qk_norm:  # one weight per head dimension, shared by the heads
        shapes += [
            (MODEL_TENSOR.ATTN_Q_NORM, "weight", (hp.head_dim,)),
            (MODEL_TENSOR.ATTN_K_NORM, "weight", (hp.head_dim,)),
        ]
    if hp.arch.post_norms:
        shapes += [(MODEL_TENSOR.ATTN_POST_NORM, "weight", (e,)), (MODEL_TENSOR.FFN_POST_NORM, "weight", (e,))]
    for kind, suffix, shape in shapes:
        yield tensor_name(kind, layer, suffix), shape


def expected_tensors(hp: HParams) -> dict[str, tuple[int, ...]]:
    """Every tensor the model needs, by name, with its ggml shape."""
    tensors: dict[str, tuple[int, ...]] = {tensor_name(MODEL_TENSOR.TOKEN_EMBD): (hp.n_embd, hp.n_vocab)}
    if hp.rope_freqs:  # one factor per rotated pair, shared by every layer
        tensors[tensor_name(MODEL_TENSOR.ROPE_FREQS)] = (hp.head_dim // 2,)
    for layer in range(hp.n_layer):
        tensors.update(layer_tensors(hp, layer))
    tensors[tensor_name(MODEL_TENSOR.OUTPUT_NORM)] = (hp.n_embd,)
    if not hp.tied_embeddings:
        tensors[tensor_name(MODEL_TENSOR.OUTPUT)] = (hp.n_embd, hp.n_vocab)
    return tensors


def check_tensors(hp: HParams, shapes: Mapping[str, tuple[int, ...]], file: str) -> None:
    """Every tensor the architecture needs is present with the shape its hyper-parameters imply,
    and there is no other (llama.cpp refuses a file with tensors it does not load)."""
    if not hp.arch.reference:
        _check_llamacpp_tensors(hp, shapes, file)
        return
    expected = expected_tensors(hp)
    for name in expected:
        if name not in shapes:
            raise InvalidModelError(f"{file} lacks the tensor '{name}' that {hp.arch.gguf_arch} needs (re-convert it)")
    for name, shape in shapes.items():
        if name not in expected:
            raise InvalidModelError(f"{file}: tensor '{name}' is not part of a {hp.arch.gguf_arch} model")
        if tuple(shape) != expected[name]:
            raise InvalidModelError(
                f"{file}: tensor '{name}' has shape {list(shape)}, but the metadata implies {list(expected[name])}"
            )


def _check_llamacpp_tensors(hp: HParams, shapes: Mapping[str, tuple[int, ...]], file: str) -> None:
    """For an architecture left to llama.cpp: every tensor is one gguf-py's table has for it, in a layer
    the model has, and the embedding tables match the vocabulary, the one size llama.cpp indexes by a
    token id. llama.cpp checks the other shapes itself and refuses a mismatch in one message."""
    arch = hp.arch.gguf_arch
    embd = tensor_name(MODEL_TENSOR.TOKEN_EMBD)
    if embd not in shapes:
        raise InvalidModelError(f"{file} lacks the tensor '{embd}' that every {arch} model needs (re-convert it)")
    for name in (embd, tensor_name(MODEL_TENSOR.OUTPUT)):
        if name in shapes and tuple(shapes[name]) != (hp.n_embd, hp.n_vocab):
            raise InvalidModelError(
                f"{file}: tensor '{name}' has shape {list(shapes[name])}, but the metadata implies "
                f"{[hp.n_embd, hp.n_vocab]}"
            )
    # llama.cpp checks most shapes with layer 0's head counts and builds each layer's graph with its own:
    # where they differ, a key or value projection of the wrong size aborts the process.
    kv_heads = hp.kv_heads_per_layer or (hp.n_head_kv,) * hp.n_layer
    for layer, heads in enumerate(kv_heads):
        for kind, size in ((MODEL_TENSOR.ATTN_K, hp.head_dim), (MODEL_TENSOR.ATTN_V, hp.value_dim or hp.head_dim)):
            name = tensor_name(kind, layer)
            if name in shapes and len(shapes[name]) == 2 and shapes[name][1] != heads * size:
                raise InvalidModelError(
                    f"{file}: tensor '{name}' has {shapes[name][1]} outputs, but the metadata implies {heads} KV heads "
                    f"of {size} ({heads * size})"
                )
    if arch not in GGUF_PY_ARCHS:
        return  # newer than the installed gguf-py: llama.cpp's own checks stand alone
    bases = [TENSOR_NAMES[kind] for kind in MODEL_TENSORS[GGUF_PY_ARCHS[arch]]]
    for name in shapes:
        layer, _, rest = name.removeprefix("blk.").partition(".") if name.startswith("blk.") else ("", "", name)
        if layer and not (layer.isdigit() and int(layer) < hp.n_layer):
            raise InvalidModelError(f"{file}: tensor '{name}' belongs to no layer of this {hp.n_layer}-layer model")
        template = "blk.{bid}." + rest if layer else rest
        if not any(template == base or template.startswith(base + ".") for base in bases):
            raise InvalidModelError(f"{file}: tensor '{name}' is not part of a {arch} model")


def check_tensor_types(tensors: Iterable[TensorInfo], file: str) -> None:
    """Every tensor has a type llama.cpp computes with in its role: vectors f32, matrices MATRIX_TYPES."""
    for t in tensors:
        allowed = VECTOR_TYPES if len(t.shape) == 1 else MATRIX_TYPES
        if t.type not in allowed:
            role = "vector" if len(t.shape) == 1 else "matrix"
            raise InvalidModelError(
                f"{file}: tensor '{t.name}' has type {t.type.name}, which llama.cpp cannot use for a {role}"
            )
