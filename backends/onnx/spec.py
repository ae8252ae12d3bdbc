"""What the ONNX graph takes and gives, and what it is built from: its inputs' and outputs' names, the spec it is built
under, the GGUF types it maps. Without onnx, whose import takes 0.8 s (ml_dtypes' 0.66 s of it), so that a load that
finds its graph built (``graph_cache.py``) never imports it; ``graph.py`` builds the graph these name.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from gguf import MODEL_TENSOR
from gguf import GGMLQuantizationType as QType

from edgeinfer.models.arch import HParams, tensor_name
from edgeinfer.models.info import ModelInfo

# Bumped whenever the graph built from the same file changes: cached graphs of another version are rebuilt, and
# older ones removed. 9: Q8_0 products in two int8 passes (graph.py, ``residual_pass``).
BUILDER_VERSION = 9
# The ONNX IR version the graph declares, whichever onnx release builds it, so that its name in the cache needs no
# onnx at load: 10, the first with opset 21, which ONNX Runtime has read since 1.20.
IR_VERSION = 10
FLOAT_TYPES = (QType.F32, QType.F16, QType.BF16)
# MatMulNBits' accuracy levels, and the graph's (GraphSpec.accuracy_level): FLOAT computes in float32 (the graph's
# level: float activations for 4-bit codes, two int8 passes for Q8_0), INT8 rounds activations to int8 a block at a
# time (the graph's: one pass, as llama.cpp computes).
FLOAT = 0
INT8 = 4
FOUR_BIT_TYPES = (QType.Q4_0, QType.Q4_1, QType.Q4_K)  # MatMulNBits' 4-bit codes; the other types become 8-bit
# The types ``nbits`` maps.
NBITS_TYPES = (
    QType.Q4_0, QType.Q4_1, QType.Q4_K, QType.Q5_0, QType.Q5_1, QType.Q5_K, QType.Q6_K, QType.Q8_0, QType.IQ4_NL,
    QType.Q2_K, QType.Q3_K, QType.IQ4_XS,
)  # fmt: skip

# The most positions the RoPE tables hold: a model trained on 16M positions made tables of 8 GiB, a graph protobuf
# cannot write; 2^17 covers a 128K-token context, and a sequence never holds more positions than its cache.
ROPE_POSITIONS = 1 << 17

INPUT_IDS = "input_ids"
POSITION_IDS = "position_ids"
SEQLENS_K = "seqlens_k"
TOTAL_LENGTH = "total_sequence_length"
LOGIT_ROWS = "logit_rows"
LOGITS = "logits"


def rope_positions(hp: HParams) -> int:
    """The positions the graph's RoPE tables hold for a model: as many as it was trained on, or ROPE_POSITIONS."""
    return min(hp.n_ctx_train, ROPE_POSITIONS)


def past_names(layer: int) -> tuple[str, str]:
    return f"past_key.{layer}", f"past_value.{layer}"


def present_names(layer: int) -> tuple[str, str]:
    return f"present_key.{layer}", f"present_value.{layer}"


@dataclass(frozen=True)
class GraphSpec:
    """What the graph depends on besides the file."""

    kv_type: str  # "f16" or "f32": the cache buffers' element type
    accuracy_level: int  # FLOAT or INT8

    @property
    def key(self) -> str:
        """A name part for the cached graph."""
        return f"kv{self.kv_type}-acc{self.accuracy_level}"

    def describe(self, info: ModelInfo) -> str:
        """The spec of ``info``'s graph for a person: its cache type and its products' activations."""
        return f"{self.kv_type} cache, {activations(info, self.accuracy_level)}"


def product_types(info: ModelInfo) -> set[QType]:
    """The types of the matrices ``info``'s graph multiplies by: every matrix but an embedding table that is not
    also the head (its rows are gathered)."""
    embedding = tensor_name(MODEL_TENSOR.TOKEN_EMBD)
    return {t.type for t in info.tensors if len(t.shape) > 1 and (t.name != embedding or info.hparams.tied_embeddings)}


def activations(info: ModelInfo, level: int) -> str:
    """What ``info``'s graph at ``level`` does with its products' activations, for a person."""
    if level == INT8:
        return "int8 activations"
    types = product_types(info)
    parts = [
        part
        for part, present in (
            ("float activations for 4-bit codes", not types.isdisjoint(FOUR_BIT_TYPES)),
            ("two int8 passes for Q8_0", QType.Q8_0 in types),
            ("int8 activations for other codes", bool(types - {*FOUR_BIT_TYPES, QType.Q8_0, *FLOAT_TYPES})),
        )
        if present
    ]
    return ", ".join(parts) or "float activations"


def unmapped_types(info: ModelInfo) -> list[str]:
    """The file's tensor types this builder cannot put in a graph, by name."""
    mapped = {*NBITS_TYPES, *FLOAT_TYPES}
    return sorted({t.type.name for t in info.tensors if t.type not in mapped})


def graph_bytes(info: ModelInfo) -> int:
    """About how many bytes the graph's weights take, an upper bound: 4-bit codes with a float32 scale and offset
    per 32 elements, 8-bit codes with both per 16, floats as float32; a tied embedding twice (rows and head)."""
    total = 0
    for tensor in info.tensors:
        n = math.prod(tensor.shape)
        if tensor.type in FLOAT_TYPES or len(tensor.shape) == 1:
            size = 4 * n
        elif tensor.type in FOUR_BIT_TYPES:
            size = n // 2 + n // 4
        else:
            size = n + n // 2
        tied = info.hparams.tied_embeddings and tensor.name == tensor_name(MODEL_TENSOR.TOKEN_EMBD)
        total += 2 * size if tied else size
    return total
