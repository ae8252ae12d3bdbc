"""A GGUF model as one ONNX graph for ONNX Runtime, built from the file alone (no checkpoint, no torch).

The graph computes what ``models/reference.py`` computes, with ONNX Runtime's contrib ops for
language models:

- every quantized matrix as ``MatMulNBits`` over the file's own blocks (``weights.py``), Q8_0's in
  two int8 passes at the FLOAT level (``residual_pass``); F32, F16 and BF16 matrices as a float32 ``MatMul``;
- the embedding table as ``GatherBlockQuantized`` over the same blocks (a float ``Gather`` for
  float tables), plus each block's offset where the type has one;
- ``SimplifiedLayerNormalization`` and ``SkipSimplifiedLayerNormalization`` (the residual add and the
  next norm in one op);
- ``GroupQueryAttention``, which rotates queries and keys (RoPE from cos/sin tables, interleaved
  pairs for the ``norm`` style), applies Q/K norms and sliding windows, and keeps each layer's keys,
  already rotated, and values in a buffer the caller owns: past and present are one buffer.

One evaluation takes S new tokens of each of B sequences (B > 1 for sequences decoded together, a
token each). Inputs and outputs::

    input_ids        int64 (B, S)          the new tokens
    position_ids     int64 (B, S)          their positions
    seqlens_k        int32 (B,)            positions each sequence holds after this step, minus 1
    total_sequence_length  int32 ()        the most positions a sequence holds after this step
    logit_rows       int64 (R,)            which of the B * S tokens get logits (the last, or all)
    past_key.L, past_value.L   (B, kv heads, C, head_dim)  layer L's cache of C cells a sequence, f16 or f32
    logits           float32 (R, n_vocab)
    present_key.L, present_value.L         the same buffers as past_key.L, past_value.L
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
from gguf import MODEL_TENSOR
from gguf import GGMLQuantizationType as QType
from onnx import ModelProto, NodeProto, TensorProto, helper, numpy_helper

from edgeinfer.models.arch import HParams, tensor_name
from edgeinfer.models.info import ModelInfo
from edgeinfer.models.reference import Transformer
from edgeinfer.models.tensors import GGUFTensors

from .spec import (
    BUILDER_VERSION,
    FLOAT,
    FLOAT_TYPES,
    INPUT_IDS,
    INT8,
    IR_VERSION,
    LOGIT_ROWS,
    LOGITS,
    POSITION_IDS,
    SEQLENS_K,
    TOTAL_LENGTH,
    GraphSpec,
    past_names,
    present_names,
    rope_positions,
)
from .weights import NBits, ZeroPoints, concat, matmul, nbits, pack4

OPSET = 21  # IR_VERSION 10's
MS_DOMAIN = "com.microsoft"
KV_ELEMENT = {"f32": TensorProto.FLOAT, "f16": TensorProto.FLOAT16}
EIGHT_BIT_ACCURACY_LEVEL = INT8


def build_graph(
    info: ModelInfo, tensors: GGUFTensors, spec: GraphSpec, progress: Callable[[int, int], None] | None = None
) -> ModelProto:
    """The model of ``info`` as an ONNX graph; ``progress(layers_done, n_layer)`` is called as it goes."""
    return _Builder(info, tensors, spec).build(progress)


class _Builder:
    def __init__(self, info: ModelInfo, tensors: GGUFTensors, spec: GraphSpec) -> None:
        self.hp: HParams = info.hparams
        self.tensors = tensors
        self.spec = spec
        self.nodes: list[NodeProto] = []
        self.initializers: list[TensorProto] = []
        self._names: set[str] = set()
        self.rotary = Transformer(self.hp, tensors.dequantize)  # its RoPE frequencies: it loads no other weight

    # -- helpers ----------------------------------------------------------------------------------

    def constant(self, name: str, value: np.ndarray) -> str:
        if name not in self._names:
            self._names.add(name)
            self.initializers.append(numpy_helper.from_array(np.ascontiguousarray(value), name))
        return name

    def node(self, op: str, inputs: list[str], output: str, domain: str = "", **attrs: object) -> str:
        self.nodes.append(helper.make_node(op, inputs, [output], name=output, domain=domain, **attrs))
        return output

    def vector(self, name: str) -> str:
        """A float32 vector of the file (norm weights, biases)."""
        return self.constant(name, self.tensors.dequantize(name).reshape(-1))

    def project(self, names: list[str], a: str, y: str, rank: int = 3, biases: list[str] | None = None) -> str:
        """``y = a @ W.T (+ b)`` for the file's matrices ``names`` stacked into one ``W`` (all of one type), and their
        ``biases`` into one ``b``: one kernel for Q, K and V, or for the FFN's gate and up, where several would each
        pay their own overhead."""
        kind = self.tensors[names[0]].type
        bias = None if biases is None else np.concatenate([self.tensors.dequantize(name) for name in biases])
        if kind in FLOAT_TYPES:
            w = np.concatenate([self.tensors.dequantize(name) for name in names])
            if bias is None:
                return self.node("MatMul", [a, self.constant(f"{y}.transposed", w.T)], y)
            product = self.node("MatMul", [a, self.constant(f"{y}.transposed", w.T)], f"{y}.unbiased")
            return self.node("Add", [product, self.constant(f"{y}.bias", bias)], y)
        weight = concat([nbits(self.tensors.raw(n), kind, self.tensors[n].shape[0], ZeroPoints.SPLIT) for n in names])
        # 8-bit codes have a fast kernel only for int8 activations: 72x slower without at 4096² (docs/BENCHMARKS.md).
        level = EIGHT_BIT_ACCURACY_LEVEL if weight.bits == 8 else self.spec.accuracy_level
        nodes, arrays = matmul(weight, a, y, y, level, rank, bias, self.residual_pass(kind, level))
        self.nodes += nodes
        self.initializers += arrays
        return y

    def residual_pass(self, kind: QType, level: int) -> bool:
        """Whether a product of ``kind`` at ``level`` takes a second pass over its activations' int8 rounding
        (``weights.matmul``): Q8_0's, at the FLOAT level. Q8_0's codes lose next to nothing, so int8 activations were
        most of a Q8_0 product's error: SmolLM2's Q8_0 copy moved 6.0e-3 KLD from the reference in one pass, 6.8e-8
        in two, at 0.6x the decode speed (docs/BENCHMARKS.md)."""
        return kind == QType.Q8_0 and level == INT8 and self.spec.accuracy_level == FLOAT

    def fusable(self, names: list[str]) -> bool:
        """Whether these matrices can be stacked into one product: they share a type."""
        return len({self.tensors[name].type for name in names}) == 1

    def split(self, x: str, sizes: list[int], outputs: list[str]) -> list[str]:
        """``x``'s last axis cut into parts of ``sizes``."""
        parts = self.constant(f"{x}.sizes", np.array(sizes, np.int64))
        self.nodes.append(helper.make_node("Split", [x, parts], outputs, name=f"{x}.split", axis=-1))
        return outputs

    def norm(self, x: str, weight: str, y: str) -> str:
        return self.node(
            "SimplifiedLayerNormalization", [x, self.vector(weight)], y, axis=-1, epsilon=self.hp.rms_eps, stash_type=1
        )

    def skip_norm(self, x: str, skip: str, weight: str, y: str, total: str) -> tuple[str, str]:
        """``total = x + skip`` and ``y = norm(total)``, in one op."""
        self.nodes.append(
            helper.make_node(
                "SkipSimplifiedLayerNormalization",
                [x, skip, self.vector(weight)],
                [y, "", "", total],
                name=y,
                domain=MS_DOMAIN,
                epsilon=self.hp.rms_eps,
            )
        )
        return y, total

    # -- the model --------------------------------------------------------------------------------

    def embed(self) -> str:
        name = tensor_name(MODEL_TENSOR.TOKEN_EMBD)
        t = self.tensors[name]
        if t.type in FLOAT_TYPES:
            x = self.node(
                "Gather", [self.constant(f"{name}.rows", self.tensors.dequantize(name)), INPUT_IDS], "embedded"
            )
        else:
            x = self._gather_blocks(name, nbits(self.tensors.raw(name), t.type, t.shape[0], ZeroPoints.SPLIT))
        if self.hp.arch.embed_scale:
            scale = self.constant("embed_scale", np.array(math.sqrt(self.hp.n_embd), np.float32))
            x = self.node("Mul", [x, scale], "embedded.scaled")
        return x

    def _gather_blocks(self, name: str, weight: NBits) -> str:
        """The rows ``input_ids`` names, dequantized from their blocks: (1, S, n_embd)."""
        blocks = weight.k // weight.block_size
        zero_points = weight.zero_points
        if zero_points is None:  # the default zero point, given: GatherBlockQuantized's default is 0
            default = np.full((weight.n, blocks), 1 << (weight.bits - 1), np.uint8)
            zero_points = default if weight.bits == 8 else pack4(default)
        rows = self.node(
            "GatherBlockQuantized",
            [
                self.constant(f"{name}.rows", weight.codes.reshape(weight.n, -1)),
                INPUT_IDS,
                self.constant(f"{name}.row_scales", weight.scales.reshape(weight.n, blocks)),
                self.constant(f"{name}.row_zero_points", zero_points.reshape(weight.n, -1)),
            ],
            "embedded.codes",
            domain=MS_DOMAIN,
            bits=weight.bits,
            block_size=weight.block_size,
            gather_axis=0,
            quantize_axis=1,
        )
        if weight.offsets is None:
            return rows
        # Each block's offset, gathered by row and added to its block's elements.
        offsets = self.node("Gather", [self.constant(f"{name}.row_offsets", weight.offsets), INPUT_IDS], "offsets")
        shape = self.constant("embedded.block_shape", np.array([0, 0, blocks, weight.block_size], np.int64))
        split = self.node("Reshape", [rows, shape], "embedded.blocks")
        axes = self.constant("unsqueeze_last", np.array([-1], np.int64))
        added = self.node("Add", [split, self.node("Unsqueeze", [offsets, axes], "offsets.column")], "embedded.sums")
        flat = self.constant("embedded.shape", np.array([0, 0, self.hp.n_embd], np.int64))
        return self.node("Reshape", [added, flat], "embedded")

    def rope_tables(self, layer: int) -> tuple[str, str]:
        """cos and sin of every position's angles for ``layer``'s frequencies, (``rope_positions``, head_dim / 2)."""
        key = f"rope.{self.hp.layer_rope_base(layer):g}"  # layers of one base share their tables
        if key + ".cos" not in self._names:
            angles = np.arange(rope_positions(self.hp), dtype=np.float64)[:, None] * self.rotary.inv_freq[layer]
            dtype = np.float16 if self.spec.kv_type == "f16" else np.float32  # GQA's computing type
            self.constant(key + ".cos", np.cos(angles).astype(dtype))
            self.constant(key + ".sin", np.sin(angles).astype(dtype))
        return key + ".cos", key + ".sin"

    def attention(self, layer: int, h: str) -> str:
        hp, arch = self.hp, self.hp.arch
        prefix = f"blk.{layer}"
        kinds = (MODEL_TENSOR.ATTN_Q, MODEL_TENSOR.ATTN_K, MODEL_TENSOR.ATTN_V)
        names = [tensor_name(kind, layer) for kind in kinds]
        sizes = [hp.q_dim, hp.kv_dim, hp.kv_dim]
        labels = [f"{prefix}.{label}" for label in ("q", "k", "v")]
        biases = [tensor_name(kind, layer, "bias") for kind in kinds] if arch.qkv_bias else None
        if self.fusable(names):  # one product, which GQA takes packed unless Q and K need norms first
            qkv = [self.project(names, h, f"{prefix}.qkv", biases=biases)]
            if arch.qk_norm:
                qkv = self.split(qkv[0], sizes, labels)
        else:
            qkv = [
                self.project([name], h, label, biases=[bias] if bias else None)
                for name, label, bias in zip(names, labels, biases or [""] * 3, strict=True)
            ]
        if arch.qk_norm:  # over each head's own vector, before RoPE (GQA's own Q/K norm inputs are GPU-only)
            heads = self.constant("heads_shape", np.array([0, 0, -1, hp.head_dim], np.int64))
            flat = self.constant("flat_shape", np.array([0, 0, -1], np.int64))
            for i, kind in ((0, MODEL_TENSOR.ATTN_Q_NORM), (1, MODEL_TENSOR.ATTN_K_NORM)):
                split = self.node("Reshape", [qkv[i], heads], f"{qkv[i]}.heads")
                normed = self.norm(split, tensor_name(kind, layer), f"{qkv[i]}.normed")
                qkv[i] = self.node("Reshape", [normed, flat], f"{qkv[i]}.flat")
        cos, sin = self.rope_tables(layer)
        attrs: dict[str, object] = {}
        if hp.window(layer):
            attrs["local_window_size"] = hp.window(layer)  # measured: the same keys as the reference's window
        if hp.attn_scale is not None:
            attrs["scale"] = hp.attn_scale
        kv = KV_ELEMENT[self.spec.kv_type]
        if kv != TensorProto.FLOAT:  # the CPU kernel computes in its cache's type: a float one would be cast whole
            qkv = [self.node("Cast", [y], f"{y}.{self.spec.kv_type}", to=kv) for y in qkv]
        past_key, past_value = past_names(layer)
        present_key, present_value = present_names(layer)
        output = f"{prefix}.attended"
        self.nodes.append(
            helper.make_node(
                "GroupQueryAttention",
                [*qkv, *[""] * (3 - len(qkv)), past_key, past_value, SEQLENS_K, TOTAL_LENGTH, cos, sin, POSITION_IDS],
                [output, present_key, present_value],
                name=output,
                domain=MS_DOMAIN,
                num_heads=hp.n_head,
                kv_num_heads=hp.n_head_kv,
                do_rotary=1,
                rotary_interleaved=int(arch.rope_style == "norm"),
                **attrs,
            )
        )
        if kv != TensorProto.FLOAT:
            output = self.node("Cast", [output], f"{output}.float", to=TensorProto.FLOAT)
        return self.project([tensor_name(MODEL_TENSOR.ATTN_OUT, layer)], output, f"{prefix}.attn_out")

    def feed_forward(self, layer: int, h: str) -> str:
        prefix = f"blk.{layer}"
        names = [tensor_name(MODEL_TENSOR.FFN_GATE, layer), tensor_name(MODEL_TENSOR.FFN_UP, layer)]
        if self.fusable(names):
            both = self.project(names, h, f"{prefix}.gate_up")
            gate, up = self.split(both, [self.hp.n_ff, self.hp.n_ff], [f"{prefix}.gate", f"{prefix}.up"])
        else:
            gate, up = (
                self.project([name], h, f"{prefix}.{label}") for name, label in zip(names, ("gate", "up"), strict=True)
            )
        if self.hp.arch.ffn_act == "silu":
            active = self.node("Mul", [gate, self.node("Sigmoid", [gate], f"{prefix}.sigmoid")], f"{prefix}.silu")
        else:
            active = self.node("Gelu", [gate], f"{prefix}.gelu", approximate="tanh")
        product = self.node("Mul", [active, up], f"{prefix}.gated")
        return self.project([tensor_name(MODEL_TENSOR.FFN_DOWN, layer)], product, f"{prefix}.ffn_out")

    def head(self, x: str) -> str:
        hp = self.hp
        flat = self.node("Reshape", [x, self.constant("rows_shape", np.array([-1, hp.n_embd], np.int64))], "rows")
        chosen = self.node("Gather", [flat, LOGIT_ROWS], "chosen")
        h = self.norm(chosen, tensor_name(MODEL_TENSOR.OUTPUT_NORM), "final")
        out = MODEL_TENSOR.TOKEN_EMBD if hp.tied_embeddings else MODEL_TENSOR.OUTPUT
        if not hp.logit_softcap:
            return self.project([tensor_name(out)], h, LOGITS, rank=2)
        logits = self.project([tensor_name(out)], h, "uncapped", rank=2)
        cap = self.constant("softcap", np.array(hp.logit_softcap, np.float32))
        capped = self.node("Tanh", [self.node("Div", [logits, cap], "scaled")], "capped")
        return self.node("Mul", [capped, cap], LOGITS)

    def build(self, progress: Callable[[int, int], None] | None) -> ModelProto:
        hp, arch = self.hp, self.hp.arch
        x = self.embed()
        h = self.norm(x, tensor_name(MODEL_TENSOR.ATTN_NORM, 0), "blk.0.attn_in")
        for layer in range(hp.n_layer):
            prefix = f"blk.{layer}"
            out = self.attention(layer, h)
            ffn_norm = tensor_name(MODEL_TENSOR.FFN_NORM, layer)
            if arch.post_norms:
                out = self.norm(out, tensor_name(MODEL_TENSOR.ATTN_POST_NORM, layer), f"{prefix}.attn_post")
            h, x = self.skip_norm(x, out, ffn_norm, f"{prefix}.ffn_in", f"{prefix}.mid")
            out = self.feed_forward(layer, h)
            if arch.post_norms:
                out = self.norm(out, tensor_name(MODEL_TENSOR.FFN_POST_NORM, layer), f"{prefix}.ffn_post")
            if layer + 1 < hp.n_layer:
                next_norm = tensor_name(MODEL_TENSOR.ATTN_NORM, layer + 1)
                h, x = self.skip_norm(x, out, next_norm, f"blk.{layer + 1}.attn_in", f"{prefix}.out")
            else:
                x = self.node("Add", [x, out], f"{prefix}.out")
            if progress is not None:
                progress(layer + 1, hp.n_layer)
        self.head(x)
        return self._model()

    def _model(self) -> ModelProto:
        hp = self.hp
        kv = KV_ELEMENT[self.spec.kv_type]
        inputs = [
            helper.make_tensor_value_info(INPUT_IDS, TensorProto.INT64, ["batch", "tokens"]),
            helper.make_tensor_value_info(POSITION_IDS, TensorProto.INT64, ["batch", "tokens"]),
            helper.make_tensor_value_info(SEQLENS_K, TensorProto.INT32, ["batch"]),
            helper.make_tensor_value_info(TOTAL_LENGTH, TensorProto.INT32, []),
            helper.make_tensor_value_info(LOGIT_ROWS, TensorProto.INT64, ["rows"]),
        ]
        outputs = [helper.make_tensor_value_info(LOGITS, TensorProto.FLOAT, ["rows", hp.n_vocab])]
        cache_shape = ["batch", hp.n_head_kv, "cells", hp.head_dim]
        for layer in range(hp.n_layer):
            inputs += [helper.make_tensor_value_info(name, kv, cache_shape) for name in past_names(layer)]
            outputs += [helper.make_tensor_value_info(name, kv, cache_shape) for name in present_names(layer)]
        graph = helper.make_graph(self.nodes, "edgeinfer", inputs, outputs)
        model = helper.make_model(
            graph,
            opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid(MS_DOMAIN, 1)],
            ir_version=IR_VERSION,
        )
        # Moved in one by one, each copy's original let go at once: make_graph and make_model each copy
        # what they are given, which took a build to 3x the weights (SmolLM2: 514 MiB for a 141 MiB graph).
        self.initializers.reverse()
        while self.initializers:
            model.graph.initializer.append(self.initializers.pop())
        model.producer_name = "edgeinfer"
        model.producer_version = str(BUILDER_VERSION)
        return model
