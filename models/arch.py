"""The architectures edgeinfer runs, as data: hyper-parameters from GGUF metadata, tensor names
and shapes, RoPE style and tied embeddings. Every backend and the converter read models through here.

Shapes are in ggml order (the fastest-varying dimension first), as GGUF stores them: a
projection from ``n_in`` to ``n_out`` features is ``(n_in, n_out)``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from gguf import MODEL_TENSOR, TENSOR_NAMES, GGMLQuantizationType, Keys

from edgeinfer.errors import InvalidModelError
from edgeinfer.models.gguf_file import TensorInfo, array_length

RopeStyle = Literal["norm", "neox"]


@dataclass(frozen=True)
class Architecture:
    """What distinguishes one family of decoder-only transformers from another.

    ``rope_style``: ``norm`` rotates adjacent pairs (x0, x1), (x2, x3)...; ``neox`` rotates
    (x_i, x_{i+d/2}). llama.cpp runs llama with ``norm`` because its converter permutes the
    Q and K rows of Hugging Face's checkpoints (``permute_qk``), which were trained with ``neox``.
    """

    name: str  # Hugging Face's name for it (the converter's key)
    gguf_arch: str  # general.architecture in GGUF
    hf_classes: tuple[str, ...]
    rope_style: RopeStyle
    permute_qk: bool
    qkv_bias: bool


ARCHITECTURES: dict[str, Architecture] = {
    a.name: a
    for a in (
        Architecture("llama", "llama", ("LlamaForCausalLM",), "norm", permute_qk=True, qkv_bias=False),
        # llama.cpp runs Mistral (full attention, no sliding window) as llama.
        Architecture("mistral", "llama", ("MistralForCausalLM",), "norm", permute_qk=True, qkv_bias=False),
        Architecture("qwen2", "qwen2", ("Qwen2ForCausalLM",), "neox", permute_qk=False, qkv_bias=True),
    )
}
_BY_GGUF_ARCH = {"llama": ARCHITECTURES["llama"], "qwen2": ARCHITECTURES["qwen2"]}

# Metadata every supported architecture needs, besides the vocabulary; "{arch}" is general.architecture.
REQUIRED_KEYS = (
    Keys.LLM.CONTEXT_LENGTH,
    Keys.LLM.EMBEDDING_LENGTH,
    Keys.LLM.BLOCK_COUNT,
    Keys.LLM.FEED_FORWARD_LENGTH,
    Keys.Attention.HEAD_COUNT,
    Keys.Attention.LAYERNORM_RMS_EPS,
)
# The largest sizes we accept: far above any model that runs on an edge device, low enough
# that arithmetic on them cannot overflow llama.cpp's 32-bit fields.
MAX_DIM = 1 << 20
MAX_LAYERS = 512  # llama.cpp's LLAMA_MAX_LAYERS
MAX_CONTEXT = 1 << 24
MIN_CONTEXT = 64  # below any real model's, and too short to hold a chat turn
# A RoPE base below 1 makes RoPE's frequencies grow past float range: NaN logits.
ROPE_BASE_RANGE = (1.0, float(1 << 40))
RMS_EPS_RANGE = (1e-12, 1.0)
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

    @property
    def q_dim(self) -> int:
        return self.n_head * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_head_kv * self.head_dim


def architecture_for_gguf(name: object, file: str) -> Architecture:
    """The Architecture a GGUF's ``general.architecture`` names, or a one-line error."""
    if name is None:
        raise InvalidModelError(f"{file} lacks the metadata key '{Keys.General.ARCHITECTURE}' (re-convert the model)")
    if not isinstance(name, str) or name not in _BY_GGUF_ARCH:
        raise InvalidModelError(
            f"{file}: architecture {name!r} is not supported; edgeinfer runs {', '.join(_BY_GGUF_ARCH)} models"
        )
    return _BY_GGUF_ARCH[str(name)]


def hparams_from_metadata(meta: Mapping[str, Any], tensor_names: set[str], file: str) -> HParams:
    """Read and check the hyper-parameters of a supported architecture."""
    arch = architecture_for_gguf(meta.get(Keys.General.ARCHITECTURE), file)
    prefix = arch.gguf_arch

    def positive(
        key_template: str, default: Any = None, limit: float = MAX_DIM, low: float = 1, kind: type = int
    ) -> Any:
        key = key_template.format(arch=prefix)
        value = meta.get(key, default)
        if value is None:
            raise InvalidModelError(f"{file} lacks the metadata key '{key}' (re-convert the model)")
        ok_type = isinstance(value, (int, float)) if kind is float else isinstance(value, int)
        if isinstance(value, bool) or not ok_type or not low <= value <= limit:  # NaN fails too
            raise InvalidModelError(
                f"{file}: metadata '{key}' = {value!r} is out of range ({low:g} to {limit:g}); re-convert the model"
            )
        return kind(value)

    n_layer = positive(Keys.LLM.BLOCK_COUNT, limit=MAX_LAYERS)
    n_embd = positive(Keys.LLM.EMBEDDING_LENGTH)
    n_head = positive(Keys.Attention.HEAD_COUNT)
    n_head_kv = positive(Keys.Attention.HEAD_COUNT_KV, n_head)
    head_dim = positive(Keys.Attention.KEY_LENGTH, n_embd // n_head or None)
    if n_head % n_head_kv:
        raise InvalidModelError(f"{file}: {n_head} attention heads do not divide into {n_head_kv} KV head groups")
    if head_dim % 2:
        raise InvalidModelError(f"{file}: head dimension {head_dim} is odd; RoPE needs an even one")
    # Partial RoPE, a V head size of its own, experts and unknown RoPE scaling are not these
    # architectures; llama.cpp aborts on inconsistent expert counts and unknown scaling names.
    for key_template, expected in (
        (Keys.Rope.DIMENSION_COUNT, head_dim),
        (Keys.Attention.VALUE_LENGTH, head_dim),
        (Keys.LLM.EXPERT_COUNT, 0),
        (Keys.LLM.EXPERT_USED_COUNT, 0),
    ):
        key = key_template.format(arch=prefix)
        if meta.get(key, expected) != expected:
            raise InvalidModelError(f"{file}: metadata '{key}' = {meta[key]!r}; {prefix} models need {expected}")
    scaling_key = Keys.Rope.SCALING_TYPE.format(arch=prefix)
    if meta.get(scaling_key, "none") not in ROPE_SCALING_TYPES:
        raise InvalidModelError(
            f"{file}: metadata '{scaling_key}' = {meta[scaling_key]!r} is not one of {', '.join(ROPE_SCALING_TYPES)}"
        )
    n_vocab = array_length(meta.get(Keys.Tokenizer.LIST))  # llama.cpp's definition of the vocabulary size
    if not 0 < n_vocab <= MAX_DIM:
        raise InvalidModelError(f"{file} has no usable vocabulary ({Keys.Tokenizer.LIST}); re-convert the model")
    return HParams(
        arch=arch,
        n_vocab=n_vocab,
        n_embd=n_embd,
        n_layer=n_layer,
        n_head=n_head,
        n_head_kv=n_head_kv,
        head_dim=head_dim,
        n_ff=positive(Keys.LLM.FEED_FORWARD_LENGTH),
        n_ctx_train=positive(Keys.LLM.CONTEXT_LENGTH, limit=MAX_CONTEXT, low=MIN_CONTEXT),
        rope_base=positive(Keys.Rope.FREQ_BASE, 10000.0, low=ROPE_BASE_RANGE[0], limit=ROPE_BASE_RANGE[1], kind=float),
        rms_eps=positive(Keys.Attention.LAYERNORM_RMS_EPS, low=RMS_EPS_RANGE[0], limit=RMS_EPS_RANGE[1], kind=float),
        tied_embeddings=tensor_name(MODEL_TENSOR.OUTPUT) not in tensor_names,
        rope_scaling=meta.get(scaling_key, "none"),
    )


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
    for kind, suffix, shape in shapes:
        yield tensor_name(kind, layer, suffix), shape


def expected_tensors(hp: HParams) -> dict[str, tuple[int, ...]]:
    """Every tensor the model needs, by name, with its ggml shape."""
    tensors: dict[str, tuple[int, ...]] = {tensor_name(MODEL_TENSOR.TOKEN_EMBD): (hp.n_embd, hp.n_vocab)}
    for layer in range(hp.n_layer):
        tensors.update(layer_tensors(hp, layer))
    tensors[tensor_name(MODEL_TENSOR.OUTPUT_NORM)] = (hp.n_embd,)
    if not hp.tied_embeddings:
        tensors[tensor_name(MODEL_TENSOR.OUTPUT)] = (hp.n_embd, hp.n_vocab)
    return tensors


def optional_tensors(hp: HParams) -> dict[str, tuple[int, ...]]:
    """Tensors a model may have besides expected_tensors(): the RoPE frequency factors of
    Llama 3.1+ ("llama3" RoPE scaling), one per rotated pair, which llama.cpp applies when present."""
    return {tensor_name(MODEL_TENSOR.ROPE_FREQS): (hp.head_dim // 2,)}


def check_tensors(hp: HParams, shapes: Mapping[str, tuple[int, ...]], file: str) -> None:
    """Every tensor the architecture needs is present with the shape its hyper-parameters imply,
    and there is no other (llama.cpp refuses a file with tensors it does not load)."""
    expected = expected_tensors(hp)
    for name in expected:
        if name not in shapes:
            raise InvalidModelError(f"{file} lacks the tensor '{name}' that {hp.arch.gguf_arch} needs (re-convert it)")
    allowed = {**expected, **optional_tensors(hp)}
    for name, shape in shapes.items():
        if name not in allowed:
            raise InvalidModelError(f"{file}: tensor '{name}' is not part of a {hp.arch.gguf_arch} model")
        if tuple(shape) != allowed[name]:
            raise InvalidModelError(
                f"{file}: tensor '{name}' has shape {list(shape)}, but the metadata implies {list(allowed[name])}"
            )


def check_tensor_types(tensors: Iterable[TensorInfo], file: str) -> None:
    """Every tensor has a type llama.cpp computes with in its role: vectors f32, matrices MATRIX_TYPES."""
    for t in tensors:
        allowed = VECTOR_TYPES if len(t.shape) == 1 else MATRIX_TYPES
        if t.type not in allowed:
            role = "vector" if len(t.shape) == 1 else "matrix"
            raise InvalidModelError(
                f"{file}: tensor '{t.name}' has type {t.type.name}, which llama.cpp cannot use for a {role}"
            )
