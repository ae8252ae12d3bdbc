"""The OpenCL backend: the GGUF's own blocks on any OpenCL 1.2 device, with kernels of our own (``kernels/``).

Weights are uploaded once, the quantized ones in the flat layout the kernels read (scales apart
from codes). Each chunk of tokens runs as a chain of kernels: ``products.cl`` for every product, ``ops.cl``
for norms, RoPE, the KV cache, attention and the greedy token. Only the logits row, or the token, comes
back. The KV cache lives in device buffers, f16 or f32, in cells that sequences share as llama.cpp's
unified cache shares them (``backends/cells.py``): a copied prefix shares its cells, and an eviction
re-rotates the kept keys on the device. The embedding rows are dequantized on the host, from the mapped file.

A prompt runs in chunks of ``batch_size`` tokens: each matrix is dequantized to float32 into one scratch
buffer and multiplied by the chunk's rows in tiles (``gemm``); a token being decoded runs matrix-vector
kernels on the blocks themselves, each product in the shape (layout, rows a work-item, group size) measured
fastest for its type and size on this device at the first load (``tuning.py``). Attention splits each
head's positions into parts that run side by side, joined after. A greedy step (``Span.argmax``) takes its
token's argmax on the device, and only the token comes back. Not yet here: tuned tiles for the prompt's
products, and kernels for Q2_K, Q3_K, Q5_1, Q5_K and the IQ types.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import ClassVar

import numpy as np
import pyopencl as cl
from gguf import GGML_QUANT_SIZES, MODEL_TENSOR
from gguf import GGMLQuantizationType as QType
from gguf.quants import dequantize

from edgeinfer.errors import BackendError, BackendUnavailableError, InvalidOptionError, first_line
from edgeinfer.models.arch import tensor_name
from edgeinfer.models.gguf_file import TensorInfo
from edgeinfer.models.info import ModelInfo
from edgeinfer.models.reference import Transformer
from edgeinfer.models.tensors import GGUFTensors, open_tensors
from edgeinfer.system import BASE_OVERHEAD_BYTES, MemoryNeed, cache_dir

from ..base import ARGMAX_NOT_FINITE, CPU, BackendOptions, Device, Span, check_spans, compute_bytes
from ..cells import CellPool, PooledBackend
from .device import INSTALL_HINT, choose_device, opencl_devices
from .tuning import (
    LANES,
    Shape,
    Timer,
    first_shape,
    record_shapes,
    recorded_shapes,
    shape_key,
    shapes_for,
    tuning_path,
)

if not opencl_devices():  # as a backend whose library is missing: it cannot load here, whatever the model
    raise BackendUnavailableError(f"no OpenCL device here; {INSTALL_HINT}")

log = logging.getLogger("edgeinfer.backends.opencl")
KERNELS = Path(__file__).parent / "kernels"
# The matrix types with a kernel of their own; a model with another is refused, naming it.
MATVEC_TYPES = (QType.F32, QType.F16, QType.Q4_0, QType.Q4_1, QType.Q5_0, QType.Q8_0, QType.Q4_K, QType.Q6_K)
# Where each type's block splits into the flat layout's buffers (byte offsets within a block), in the order the
# kernel takes them; F32 and F16 go up as they are.
FLAT_PARTS: dict[QType, tuple[int, ...]] = {
    QType.Q4_0: (0, 2),  # d | codes
    QType.Q4_1: (0, 2, 4),  # d | m | codes
    QType.Q5_0: (0, 2, 6),  # d | fifth bits | codes
    QType.Q8_0: (0, 2),  # d | codes
    QType.Q4_K: (0, 2, 4, 16),  # d | dmin | 6-bit scales and minimums | codes
    QType.Q6_K: (0, 128, 192, 208),  # low 4 bits | high 2 bits | scales | d
}
# The flat parts (indices into FLAT_PARTS' buffers) that hold a block's half-precision scales, which a shape may
# have uploaded as float32 (tuning.py).
HALF_SCALES: dict[QType, tuple[int, ...]] = {QType.Q4_0: (0,), QType.Q4_1: (0, 1), QType.Q5_0: (0,), QType.Q8_0: (0,)}
# The types with kernels for the lanes layout too (products.cl): their flat parts with rows across lanes.
LANES_TYPES = (QType.Q4_0, QType.Q4_1, QType.Q8_0)
FOUR_BIT_LANES = (QType.Q4_0, QType.Q4_1)  # their codes in 32-bit words of 8 (products.cl)
_KV_DTYPES: dict[str, type] = {"f16": np.float16, "f32": np.float32}
# Cells of the cache a part of attention covers when the cache is full: a decode step's attention over a long
# context then runs as that many work-items a head, joined after.
ATTENTION_PART = 64
GEMM_TOKENS_ARG = 6  # the index of gemm's `tokens` argument
# Elements a dequantize_<type> work-item writes: a block, a K-quant's super-block, or (F16) one value.
DEQUANTIZED_PER_ITEM = {QType.F16: 1, QType.Q4_K: 256, QType.Q6_K: 256}


@dataclass
class _Matrix:
    """A matrix on the device, in the layout its type's kernel reads: ``n`` rows of ``k``."""

    type: QType
    buffers: tuple[cl.Buffer, ...]
    n: int
    k: int
    lanes: bool = False  # in the lanes layout (LANES_TYPES)

    def kernel(self, name: str) -> str:
        """The kernel ``name`` (matvec, dequantize) of this matrix's type and layout."""
        return kernel_name(name, self.type, self.lanes)


@dataclass(frozen=True)
class Launch:
    """A kernel with its arguments set, run over ``size`` work-items for each of a chunk's tokens. The arguments
    are kept too: a kernel holds no reference to its buffers, which Python would otherwise free under it."""

    kernel: cl.Kernel
    size: int
    args: tuple[object, ...]
    local: tuple[int, int] | None = None  # the group size; None: the driver's choice

    def enqueue(self, queue: cl.CommandQueue, tokens: int = 1) -> None:
        cl.enqueue_nd_range_kernel(queue, self.kernel, (self.size, tokens), self.local)


@dataclass(frozen=True)
class Product:
    """One planned product: for one token a matrix-vector kernel on the blocks, for several the matrix
    dequantized to float32 (unless it is float32) and multiplied in tiles."""

    one: Launch
    dequantize: Launch | None
    gemm: cl.Kernel  # its arguments set but the token count, which a chunk sets
    n: int
    args: tuple[object, ...]
    shape: Shape  # the gemm's groups too

    def enqueue(self, queue: cl.CommandQueue, tokens: int = 1) -> None:
        if tokens == 1:
            self.one.enqueue(queue)
            return
        if self.dequantize is not None:
            self.dequantize.enqueue(queue)
        self.gemm.set_arg(GEMM_TOKENS_ARG, np.int32(tokens))
        cl.enqueue_nd_range_kernel(queue, self.gemm, self.shape.gemm_size(self.n, tokens), self.shape.gemm_local)


class OpenCLBackend(PooledBackend):
    """GGUF models on an OpenCL device: kernels in ``kernels/``, a fixed KV cache in device buffers."""

    name: ClassVar[str] = "opencl"
    kv_block: ClassVar[int] = 1
    kv_types: ClassVar[tuple[str, ...]] = ("f16", "f32")
    shares_cells: ClassVar[bool] = True
    loads_llamacpp: ClassVar[bool] = False
    follows: ClassVar[bool] = False

    @classmethod
    def supports(cls, info: ModelInfo) -> str | None:
        hp = info.hparams
        if not hp.arch.reference:
            return f"its kernels do not implement the {info.architecture} architecture"
        if hp.rope_scaling != "none":
            return f"{info.path.name} scales RoPE for a longer context ({hp.rope_scaling}), which it does not do"
        if hp.kv_heads_per_layer or hp.value_dim not in (None, hp.head_dim):
            return f"{info.path.name} has layers of different attention shapes, which it does not run"
        types = sorted({t.type.name for t in info.tensors if len(t.shape) > 1 and t.type not in MATVEC_TYPES})
        if types:
            kernels = ", ".join(t.name for t in MATVEC_TYPES)
            return f"{info.path.name} has {', '.join(types)} matrices; its kernels take {kernels}"
        return None

    @classmethod
    def devices(cls) -> list[Device]:
        """The default device first (as ``cpu``: where the backend runs unless told), then each by ``P:D``."""
        found = opencl_devices()
        if not found:
            return []
        try:
            default, _ = choose_device(None)
            chosen = f"{default.index} {default.name}"
        except InvalidOptionError as exc:  # EDGEINFER_OPENCL_DEVICE names none: a device given by name still runs
            chosen = f"none, {exc}"
        return [Device(CPU, f"the default OpenCL device: {chosen}")] + [
            Device(info.index, info.describe(), None if not info.gpu else info.global_bytes, info.global_bytes)
            for info, _ in found
        ]

    @classmethod
    def kv_bytes_per_token(cls, info: ModelInfo, kv_type: str) -> float:
        return info.kv_values_per_token * np.dtype(_KV_DTYPES[kv_type]).itemsize

    @classmethod
    def memory(cls, info: ModelInfo, options: BackendOptions) -> MemoryNeed:
        weights = _uploaded_bytes(info)
        kv = int(options.kv_tokens * cls.kv_bytes_per_token(info, options.kv_type))
        overhead = BASE_OVERHEAD_BYTES + compute_bytes(info, options) + _scratch_bytes(info, options)
        device, _ = choose_device(None if options.device == CPU else options.device)
        if not device.gpu:  # a CPU device's buffers are host memory
            return MemoryNeed(weights=weights, kv=kv, overhead=overhead)
        return MemoryNeed(
            weights=0,
            kv=0,
            overhead=overhead,
            device=device.index,
            device_bytes=weights + kv,
            device_free=device.global_bytes,
        )

    def __init__(self, info: ModelInfo, options: BackendOptions) -> None:
        reason = self.supports(info)
        if reason is not None:
            raise BackendUnavailableError(f"the opencl backend cannot run this model: {reason}")
        self._closed = True  # until loaded
        hp = self._hp = info.hparams
        self._n_vocab = hp.n_vocab
        self.device, self._cl_device = choose_device(None if options.device == CPU else options.device)
        kv = int(options.kv_tokens * self.kv_bytes_per_token(info, options.kv_type))
        need = _uploaded_bytes(info) + kv + _scratch_bytes(info, options)
        if need > self.device.global_bytes:
            raise InvalidOptionError(
                f"{info.path.name} needs {need / 2**20:.0f} MiB on {self.device.name}, which has "
                f"{self.device.global_bytes / 2**20:.0f} MiB; choose a smaller model or --kv-budget"
            )
        self._stack = contextlib.ExitStack()
        try:
            self._load(info, options)
        except BaseException as exc:
            self._stack.close()
            if not isinstance(exc, cl.Error):
                raise
            if exc.code in ALLOCATION_FAILURES:
                raise BackendError(
                    f"{self.device.name} could not hold {info.path.name} and its cache ({first_line(exc)}): lower "
                    "--kv-budget or choose a smaller model"
                ) from None
            raise BackendError(f"{self.device.name} failed loading {info.path.name}: {first_line(exc)}") from None
        self._closed = False

    def _load(self, info: ModelInfo, options: BackendOptions) -> None:
        hp = self._hp
        self._context = cl.Context([self._cl_device])
        self._queue = cl.CommandQueue(self._context)
        self._splits = _splits(options.kv_tokens)
        defines = [f"-DHEAD_DIM={hp.head_dim}", f"-DSPLITS={self._splits}"]
        defines += ["-DKV_HALF"] if options.kv_type == "f16" else []
        self._defines = defines
        self._programs: dict[tuple[str, tuple[str, ...]], cl.Program] = {}
        self._binaries = _binaries_folder()
        tensors = self._stack.enter_context(open_tensors(info))
        self._rows = options.batch_size  # tokens a chunk holds
        self._shapes = self._tune(info, tensors)
        embedding = tensor_name(MODEL_TENSOR.TOKEN_EMBD)
        self._embedding, self._embedding_type = tensors.raw(embedding), tensors[embedding].type
        self._rotary = Transformer(hp, tensors.dequantize)  # RoPE frequencies, per layer
        self._pool = CellPool(options.kv_tokens, options.n_seq)
        itemsize = np.dtype(_KV_DTYPES[options.kv_type]).itemsize
        cache_bytes = options.kv_tokens * hp.kv_dim * itemsize
        self._cache = [(self._scratch(cache_bytes), self._scratch(cache_bytes)) for _ in range(hp.n_layer)]
        f, rows = 4, options.batch_size  # bytes of a float32; tokens a chunk holds
        self._x, self._h, self._out = (self._scratch(rows * hp.n_embd * f) for _ in range(3))
        self._qkv_dim = hp.q_dim + 2 * hp.kv_dim
        self._qkv = self._scratch(rows * self._qkv_dim * f)
        self._attended = self._scratch(rows * hp.q_dim * f)
        self._parts = self._scratch(rows * hp.n_head * self._splits * (hp.head_dim + 2) * f)  # attention's parts
        self._gate_up = self._scratch(rows * 2 * hp.n_ff * f)
        self._last = self._scratch(hp.n_embd * f)  # the normed row the head multiplies
        self._logits = self._scratch(hp.n_vocab * f)
        self._token = self._scratch(4)  # the greedy token of an argmax span: all that comes back of its row
        self._cells = self._scratch(options.kv_tokens * 4)  # the cells of the sequence a span runs on, by position
        self._cells_held: tuple[int, int] | None = None  # that sequence, and how many positions' cells stand there
        # The last copy of the cells and of the token rows, each kept until the next: pyopencl's event holds the
        # host array, and letting it go waits for the copy (and all before it) to end.
        self._cells_copy: cl.Event | None = None
        self._rows_copy: cl.Event | None = None
        self._start = self._scratch(4)  # the chunk's first position
        self._dequantized = self._scratch(4 * _largest_matrix(info))
        # cos and sin of RoPE's angles at every position the cache can hold (a row each), for each base the layers
        # use: computed once, so that a step uploads no angles.
        positions = np.arange(options.kv_tokens)
        firsts = {hp.layer_rope_base(layer): layer for layer in reversed(range(hp.n_layer))}  # a layer a base
        self._angles = {base: self._rope_table(layer, positions) for base, layer in firsts.items()}
        half = hp.head_dim // 2 * f
        self._rerotation = (self._scratch(half), self._scratch(half))  # an eviction's one angle
        self._body, self._tail, self._head = self._plan(tensors)
        best, at = self._scratch(ARGMAX_PARTS * f), self._scratch(ARGMAX_PARTS * 4)  # float32s, int32s
        stretch = np.int32(-(-hp.n_vocab // ARGMAX_PARTS))
        self._argmax = (
            self._op("argmax_part", ARGMAX_PARTS, self._logits, np.int32(hp.n_vocab), stretch, best, at),
            self._op("argmax_join", 1, best, at, np.int32(ARGMAX_PARTS), np.int32(ARGMAX_NOT_FINITE), self._token),
        )

    def _plan(self, tensors: GGUFTensors) -> tuple[list[Launch | Product], Launch, Product]:
        """Every kernel of a chunk with its arguments set, weights uploaded as it goes: the layers; the last
        residual add with the final norm; the head (run for each token whose logits are wanted)."""
        hp, arch = self._hp, self._hp.arch
        eps, neox, qkv_dim = np.float32(hp.rms_eps), np.int32(arch.rope_style == "neox"), self._qkv_dim

        def vector(name: str) -> cl.Buffer:
            return self._buffer(tensors.dequantize(name).astype(np.float32).reshape(-1))

        def norm(x: cl.Buffer, name: str, y: cl.Buffer, heads: int = 0, at: int = 0, stride: int = 0) -> Launch:
            """RMSNorm of the model's width, or of each of ``heads`` heads from ``at`` (Q/K norms), a token's row
            ``stride`` values from the next."""
            rows, width = (heads, hp.head_dim) if heads else (1, hp.n_embd)
            args = (x, vector(name), y, np.int32(width), eps, np.int32(at), np.int32(stride or hp.n_embd))
            return self._op("rms_norm", rows, *args)

        def add_norm(y: cl.Buffer, name: str) -> Launch:
            return self._op("add_norm", 1, self._x, y, vector(name), self._h, np.int32(hp.n_embd), eps)

        def products(
            kinds: Sequence[MODEL_TENSOR],
            layer: int,
            x: tuple[cl.Buffer, int],
            y: tuple[cl.Buffer, int],
            biased: bool,
            gate: str | None = None,
        ) -> list[Product]:
            """``y = [W1 x | W2 x | ...]`` for each token's row of x and of y (buffer, row length): one product
            where the matrices share a type, else one each. With ``gate``, the FFN's gate and up in one product
            write gate(gate) * up (``products.cl``'s GATE)."""
            planned, at = [], 0
            for stack in _stacks(kinds, layer, types):
                names = [tensor_name(kind, layer) for kind in stack]
                shape = self._shapes[_product_key([tensors[name] for name in names])]
                matrix = self._upload_matrix(tensors, names, shape, interleave=gate is not None)
                biases = [tensors.dequantize(tensor_name(kind, layer, "bias")) for kind in stack] if biased else []
                bias = self._buffer(np.concatenate(biases)) if biased else None
                planned.append(self._product(matrix, shape, x, y, bias, at, gate=gate))
                at += matrix.n
            return planned

        types = {name: tensors[name].type for name in tensors}
        h, out, qkv = (self._h, hp.n_embd), (self._out, hp.n_embd), (self._qkv, qkv_dim)
        body: list[Launch | Product] = [norm(self._x, tensor_name(MODEL_TENSOR.ATTN_NORM, 0), self._h)]
        for layer in range(hp.n_layer):
            keys, values = self._cache[layer]
            cos, sin = self._angles[hp.layer_rope_base(layer)]
            qkv_products, out_product, gate_up_products, down_product = LAYER_PRODUCTS
            body += products(qkv_products, layer, h, qkv, arch.qkv_bias)
            if arch.qk_norm:
                q_norm, k_norm = (
                    tensor_name(MODEL_TENSOR.ATTN_Q_NORM, layer),
                    tensor_name(MODEL_TENSOR.ATTN_K_NORM, layer),
                )
                body.append(norm(self._qkv, q_norm, self._qkv, hp.n_head, stride=qkv_dim))
                body.append(norm(self._qkv, k_norm, self._qkv, hp.n_head_kv, at=hp.q_dim, stride=qkv_dim))
            body.append(self._op(
                "rope_store", (hp.n_head + hp.n_head_kv) * hp.head_dim // 2, self._qkv, cos, sin, keys,
                values, self._cells, self._start, np.int32(hp.n_head), np.int32(hp.n_head_kv), neox,
                np.float32(self._rotary.attn_scale),
            ))  # fmt: skip
            body.append(self._op(
                "attention_part", hp.n_head * self._splits, self._qkv, keys, values, self._cells,
                self._start, np.int32(hp.n_head_kv), np.int32(hp.window(layer)), self._parts,
            ))  # fmt: skip
            body.append(self._op("attention_join", hp.n_head, self._parts, self._attended))
            body += products(out_product, layer, (self._attended, hp.q_dim), out, False)
            if arch.post_norms:
                body.append(norm(self._out, tensor_name(MODEL_TENSOR.ATTN_POST_NORM, layer), self._out))
            body.append(add_norm(self._out, tensor_name(MODEL_TENSOR.FFN_NORM, layer)))
            gate_up = (self._gate_up, 2 * hp.n_ff)
            if len(_stacks(gate_up_products, layer, types)) == 1:  # one product, which applies the gate as it writes
                body += products(gate_up_products, layer, h, gate_up, False, gate=arch.ffn_act)
            else:
                body += products(gate_up_products, layer, h, gate_up, False)
                body.append(self._launch("products.cl", f"{arch.ffn_act}_gate", hp.n_ff, self._gate_up,
                                         np.int32(hp.n_ff), build=Shape()))  # fmt: skip
            body += products(down_product, layer, gate_up, out, False)  # the gate half of each row
            if arch.post_norms:
                body.append(norm(self._out, tensor_name(MODEL_TENSOR.FFN_POST_NORM, layer), self._out))
            if layer + 1 < hp.n_layer:
                body.append(add_norm(self._out, tensor_name(MODEL_TENSOR.ATTN_NORM, layer + 1)))
        head = tensor_name(MODEL_TENSOR.TOKEN_EMBD if hp.tied_embeddings else MODEL_TENSOR.OUTPUT)
        shape = self._shapes[_product_key([tensors[head]])]
        head_matrix = self._upload_matrix(tensors, [head], shape)
        last, logits = (self._last, hp.n_embd), (self._logits, hp.n_vocab)
        head_product = self._product(head_matrix, shape, last, logits, None, 0, gemm=False)
        return body, add_norm(self._out, tensor_name(MODEL_TENSOR.OUTPUT_NORM)), head_product

    # -- contract -----------------------------------------------------------------------------------

    @property
    def n_vocab(self) -> int:
        return self._n_vocab

    def eval(self, spans: Sequence[Span]) -> list[np.ndarray]:
        self._check_open()
        check_spans(spans, self._pool.lengths(), self._n_vocab)
        self._pool.take(spans)
        out = []
        try:
            for span in spans:
                self._upload_cells(span)
                rows = []
                for first in range(0, len(span.tokens), self._rows):
                    chunk = span.tokens[first : first + self._rows]
                    last = first + len(chunk) == len(span.tokens)
                    wanted = range(len(chunk)) if span.all_logits else [len(chunk) - 1] if last else []
                    # A softcap's tanh can make two large logits equal, which their raw values are not.
                    argmax = span.argmax and not span.all_logits and not self._hp.logit_softcap
                    rows += self._run(chunk, span.start + first, wanted, argmax)
                out.append(np.stack(rows) if span.all_logits else rows[-1])
        except cl.Error as exc:
            for span in spans:  # a failed evaluation changes nothing
                self._pool.truncate(span.seq, span.start)
            raise BackendError(f"the OpenCL device failed mid-evaluation: {first_line(exc)}") from None
        except BaseException:
            for span in spans:
                self._pool.truncate(span.seq, span.start)
            raise
        return out

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        super().copy_prefix(src, dst, n)
        if self._cells_held is not None and self._cells_held[0] == dst:  # its positions hold other cells now
            self._cells_held = None

    def evict(self, seq: int, start: int, end: int) -> None:
        self._check_open()
        kept = self._pool.evict(seq, start, end)
        if not kept:
            return
        hp = self._hp
        self._cells_held = None  # the buffer lists the kept cells instead
        # Rotating by -(end - start) positions moves the keys' RoPE to their new places.
        neox = np.int32(hp.arch.rope_style == "neox")
        cos, sin = self._rerotation
        try:
            cl.enqueue_copy(self._queue, self._cells, np.asarray(kept, np.int32))
            for layer in range(hp.n_layer):
                angles = (start - end) * self._rotary.inv_freq[layer]  # as the reference computes them
                cl.enqueue_copy(self._queue, cos, np.cos(angles).astype(np.float32))
                cl.enqueue_copy(self._queue, sin, np.sin(angles).astype(np.float32))
                self._op(
                    "rerotate", len(kept) * hp.n_head_kv * hp.head_dim // 2,
                    self._cache[layer][0], self._cells, cos, sin, np.int32(hp.n_head_kv), neox,
                ).enqueue(self._queue)  # fmt: skip
            self._queue.finish()
        except cl.Error as exc:  # the moved keys may be rotated in some layers and not others: they are gone
            self._pool.truncate(seq, start)
            raise BackendError(f"the OpenCL device failed re-rotating the kept keys: {first_line(exc)}") from None

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._queue.finish()
        self._body, self._cache = [], []  # the device buffers, let go
        self._stack.close()

    # -- inside -------------------------------------------------------------------------------------

    def _build(self, name: str, defines: list[str]) -> cl.Program:
        """A program from ``kernels/``, built for this device, or its binary from an earlier build where the driver
        gives and takes binaries (pyopencl's cache, keyed by the device, the source and the options); its first
        compiler error in one line if it fails."""
        try:
            program = cl.Program(self._context, (KERNELS / name).read_text())
            return program.build(options=defines, cache_dir=self._binaries)
        except cl.RuntimeError as exc:
            errors = [line for line in str(exc).splitlines() if "error" in line.lower()]
            first = errors[1] if len(errors) > 1 else first_line(exc)  # errors[0] is pyopencl's own heading
            raise BackendError(f"the OpenCL compiler of {self.device.name} refused {name}: {first.strip()}") from None

    def _buffer(self, array: np.ndarray) -> cl.Buffer:
        flags = cl.mem_flags.READ_ONLY | cl.mem_flags.COPY_HOST_PTR
        return cl.Buffer(self._context, flags, hostbuf=np.ascontiguousarray(array))

    def _scratch(self, size: int) -> cl.Buffer:
        return cl.Buffer(self._context, cl.mem_flags.READ_WRITE, size)

    def _program(self, name: str, build: Shape | None = None, gate: str | None = None) -> cl.Program:
        """``kernels/name`` built for this device (``products.cl`` for the products of ``build``, applying the FFN's
        ``gate`` as they write), once."""
        options = (build.defines() if build else ()) + ((f"-DGATE={gate}",) if gate else ())
        if (name, options) not in self._programs:
            self._programs[name, options] = self._build(name, [*self._defines, *options])
        return self._programs[name, options]

    def _op(self, name: str, size: int, *args: object) -> Launch:
        """``ops.cl``'s kernel ``name`` with ``args`` set, over ``size`` work-items: in the driver's groups on a GPU;
        on a CPU device, whose driver runs a group on one core and may make a small kernel one group, in
        OP_GROUPS_PER_UNIT groups a core or as near as divides ``size`` within the largest group the kernel takes.
        On PoCL attention over 200 positions took 1.32 ms a step in the driver's groups and 0.80 ms in 18 groups of
        2, where RoPE's 384 work-items took 0.11 ms in the driver's groups, 0.18-0.21 ms in groups of one and
        0.10-0.13 ms in 16 groups of 24."""
        launch = self._launch("ops.cl", name, size, *args)
        if self.device.gpu:
            return launch
        largest = launch.kernel.get_work_group_info(cl.kernel_work_group_info.WORK_GROUP_SIZE, self._cl_device)
        local = max(1, min(size // (OP_GROUPS_PER_UNIT * self.device.compute_units), largest))
        while size % local:
            local -= 1
        return replace(launch, local=(local, 1))

    def _launch(
        self,
        program: str,
        name: str,
        size: int,
        *args: object,
        build: Shape | None = None,
        local: tuple[int, int] | None = None,
        gate: str | None = None,
    ) -> Launch:
        """``name`` of ``program`` (built for ``build``'s products and ``gate``) with ``args`` set, over ``size``
        work-items in groups of ``local`` (None: the driver's choice)."""
        kernel = cl.Kernel(self._program(program, build, gate), name)
        kernel.set_args(*args)
        return Launch(kernel, int(size), args, local)

    def _tune(self, info: ModelInfo, tensors: GGUFTensors) -> dict[str, Shape]:
        """The shape of each product the model has (by ``shape_key``) on this device: recorded, or timed on the
        model's own matrices (``tuning.py``) and recorded."""
        path = tuning_path(self._cl_device, (KERNELS / "products.cl").read_text())
        shapes, products = recorded_shapes(path), self._products_of(info)
        tried = {key: shapes_of(tensors[names[0]].type) for key, names in products.items()}
        missing = {
            key: names
            for key, names in products.items()
            if key not in shapes or replace(shapes[key], gemm_local=None) not in tried[key]
        }
        if missing:
            timer = Timer(self._context)
            for done, (key, names) in enumerate(missing.items()):
                log.info(
                    "timing the OpenCL products of %s on %s, once for this device: %d of %d",
                    info.path.name,
                    self.device.name,
                    done + 1,
                    len(missing),
                    extra={"progress": done + 1 < len(missing)},  # rewritten in place on a terminal (notes.py)
                )
                layouts = {
                    layout: self._upload_matrix(tensors, names, first_shape(layout))
                    for layout in dict.fromkeys(shape.layout for shape in tried[key])
                }
                x = self._buffer(np.ones(tensors[names[0]].shape[0], np.float32))
                y = self._scratch(4 * sum(tensors[name].shape[1] for name in names))

                def launch(
                    shape: Shape,
                    layouts: dict[tuple[bool, bool], _Matrix] = layouts,
                    x: cl.Buffer = x,
                    y: cl.Buffer = y,
                ) -> tuple[cl.Kernel, int]:
                    matrix = layouts[shape.layout]
                    return self._matvec(matrix, x, y, None, 0, shape).kernel, matrix.n

                shapes[key], _ = timer.tune(launch, tried[key])
                shapes[key] = self._tune_gemm(timer, layouts[shapes[key].layout], shapes[key], info)
            record_shapes(path, {key: shapes[key] for key in missing})  # the record is the device's, for every model
        return {key: shapes[key] for key in products}

    def _tune_gemm(self, timer: Timer, matrix: _Matrix, shape: Shape, info: ModelInfo) -> Shape:
        """``shape`` with the groups the prompt's tiled product runs fastest in, for ``matrix``'s size and a chunk
        of ``batch_size`` tokens (the head, multiplied a row at a time, takes any)."""
        if matrix.n * matrix.k > _largest_matrix(info):  # the head alone is larger than any matrix a chunk multiplies
            return shape
        tokens = self._rows
        weights = self._scratch(4 * matrix.n * matrix.k)
        x, y = self._scratch(4 * tokens * matrix.k), self._scratch(4 * tokens * matrix.n)
        for buffer, size in ((weights, matrix.n * matrix.k), (x, tokens * matrix.k)):
            cl.enqueue_fill_buffer(self._queue, buffer, np.float32(1), 0, 4 * size)
        gemm = cl.Kernel(self._program("products.cl", shape), "gemm")
        gemm.set_args(weights, x, y, None, np.int32(matrix.k), np.int32(matrix.n), np.int32(tokens),
                      np.int32(matrix.k), np.int32(matrix.n), np.int32(0))  # fmt: skip
        self._queue.finish()
        return timer.fastest_gemm(gemm, shape, matrix.n, tokens)

    def _products_of(self, info: ModelInfo) -> dict[str, list[str]]:
        """Each size of product a decode step runs (by ``shape_key``), with the matrices of one: Q, K and V
        stacked, gate and up stacked (where their types allow, as ``_plan`` stacks them), the others, the head."""
        hp, by_name = self._hp, {t.name: t for t in info.tensors}
        types = {name: t.type for name, t in by_name.items()}
        head = tensor_name(MODEL_TENSOR.TOKEN_EMBD if hp.tied_embeddings else MODEL_TENSOR.OUTPUT)
        stacks = [
            [tensor_name(kind, layer) for kind in stack]
            for layer in range(hp.n_layer)
            for kinds in LAYER_PRODUCTS
            for stack in _stacks(kinds, layer, types)
        ]
        products: dict[str, list[str]] = {}
        for stack in [*stacks, [head]]:
            products.setdefault(_product_key([by_name[name] for name in stack]), stack)
        return products

    def _matvec(
        self,
        matrix: _Matrix,
        x: cl.Buffer,
        y: cl.Buffer,
        bias: cl.Buffer | None,
        at: int,
        shape: Shape,
        gate: str | None = None,
    ) -> Launch:
        """``y[at:at + n] = W x (+ bias)``, by ``matrix``'s matrix-vector kernel in ``shape`` (whose layout the
        matrix was uploaded in); with ``gate``, half as many values, gate(row 2i) * row 2i + 1."""
        return self._launch("products.cl", matrix.kernel("matvec"), shape.global_size(matrix.n),
                            *matrix.buffers, x, y, bias, np.int32(matrix.k), np.int32(at), np.int32(matrix.n),
                            build=shape, local=shape.local_size(), gate=gate)  # fmt: skip

    def _product(
        self,
        matrix: _Matrix,
        shape: Shape,
        x: tuple[cl.Buffer, int],
        y: tuple[cl.Buffer, int],
        bias: cl.Buffer | None,
        at: int,
        *,
        gemm: bool = True,
        gate: str | None = None,
    ) -> Product:
        """``y[t][at:at + n] = W x[t] (+ bias)`` for each token t's row of x and y (buffer, row length), a token
        being decoded in ``shape``; with ``gate``, the gated pairs of rows (``_matvec``)."""
        one = self._matvec(matrix, x[0], y[0], bias, at, shape, gate)
        if not gemm:  # the head: a chunk's logits are wanted a row at a time
            return Product(one, None, one.kernel, matrix.n, one.args, shape)
        dequantize, weights = None, matrix.buffers[0]
        if matrix.type != QType.F32:
            items = matrix.n * matrix.k // DEQUANTIZED_PER_ITEM.get(matrix.type, 32)
            sizes = (np.int32(matrix.k),) if matrix.lanes else ()  # where a row's blocks lie
            # Built as the matrix's layout (build=shape) was.
            dequantize = self._launch(
                "products.cl", matrix.kernel("dequantize"), items, *matrix.buffers, self._dequantized, *sizes,
                build=shape, gate=gate,
            )  # fmt: skip
            weights = self._dequantized
        args = (weights, x[0], y[0], bias, np.int32(matrix.k), np.int32(matrix.n), np.int32(1), np.int32(x[1]),
                np.int32(y[1]), np.int32(at))  # fmt: skip
        gemm_kernel = cl.Kernel(self._program("products.cl", shape, gate), "gemm")
        gemm_kernel.set_args(*args)
        # The groups were timed on the plain build; a gated one may take fewer work-items a group on a GPU.
        largest = gemm_kernel.get_work_group_info(cl.kernel_work_group_info.WORK_GROUP_SIZE, self._cl_device)
        if shape.gemm_local is not None and math.prod(shape.gemm_local) > largest:
            shape = replace(shape, gemm_local=None)
        return Product(one, dequantize, gemm_kernel, matrix.n, args, shape)

    def _upload_matrix(
        self, tensors: GGUFTensors, names: list[str], shape: Shape, *, interleave: bool = False
    ) -> _Matrix:
        """The matrices ``names`` (of one type and width) stacked by rows, in the layout their kernel reads in
        ``shape``; with ``interleave``, two matrices of as many rows with their rows taken in turns (the gated
        products')."""
        first = tensors[names[0]]
        raw = np.concatenate([tensors.raw(name) for name in names]) if len(names) > 1 else tensors.raw(names[0])
        if interleave:
            raw = np.stack(np.split(raw, 2), axis=1).reshape(raw.shape)
        return self._matrix_of(first.type, raw, first.shape[0], shape)

    def _matrix_of(self, kind: QType, raw: np.ndarray, k: int, shape: Shape) -> _Matrix:
        """Rows of ``k`` values of type ``kind`` as the file holds them (a row of ``raw`` each), uploaded in the
        layout the type's kernel reads in ``shape`` (``layout_parts``)."""
        parts = layout_parts(kind, raw, k, shape.float_scales and kind in HALF_SCALES, shape.lanes)
        return _Matrix(kind, tuple(self._buffer(part) for part in parts), raw.shape[0], k, shape.lanes)

    def _rope_table(self, layer: int, positions: np.ndarray) -> tuple[cl.Buffer, cl.Buffer]:
        """cos and sin of ``layer``'s RoPE angles at ``positions`` (a row each), in buffers of their own."""
        angles = np.asarray(positions, np.float64)[:, None] * self._rotary.inv_freq[layer]  # as the reference
        return self._buffer(np.cos(angles).astype(np.float32)), self._buffer(np.sin(angles).astype(np.float32))

    def _upload_cells(self, span: Span) -> None:
        """The cells of ``span``'s sequence into the device's list, up to the span's last position: only those
        not there already, since a sequence's earlier positions keep their cells (a copy of 30 us on PoCL, where
        a fill of one value takes 1 us to enqueue)."""
        cells = self._pool.cells(span.seq)
        held = self._cells_held
        first = min(held[1], span.start) if held is not None and held[0] == span.seq else 0
        if len(cells) - first == 1:  # a decode step's one new cell
            cl.enqueue_fill_buffer(self._queue, self._cells, np.int32(cells[first]), 4 * first, 4)
        else:
            self._cells_copy = cl.enqueue_copy(self._queue, self._cells, np.asarray(cells[first:], np.int32),
                                               dst_offset=4 * first, is_blocking=False)  # fmt: skip
        self._cells_held = (span.seq, len(cells))

    def _run(self, tokens: Sequence[int], start: int, wanted: Sequence[int], argmax: bool) -> list[np.ndarray]:
        """A chunk of one sequence's tokens from position ``start``, its keys and values into their cells (the
        sequence's cells, uploaded); the logits of the tokens ``wanted`` (indices into the chunk), or with
        ``argmax`` the last one's greedy token alone (``Span.argmax``)."""
        hp, queue, n = self._hp, self._queue, len(tokens)
        x = dequantize(self._embedding[np.asarray(tokens)], self._embedding_type).reshape(n, hp.n_embd)
        if hp.arch.embed_scale:
            x = x * np.float32(math.sqrt(hp.n_embd))
        self._rows_copy = cl.enqueue_copy(queue, self._x, np.ascontiguousarray(x, np.float32), is_blocking=False)
        cl.enqueue_fill_buffer(queue, self._start, np.int32(start), 0, 4)
        for planned in self._body:
            planned.enqueue(queue, n)
        if not wanted:
            return []
        self._tail.enqueue(queue, n)
        rows = []
        for t in wanted:
            cl.enqueue_copy(queue, self._last, self._h, src_offset=4 * t * hp.n_embd, byte_count=4 * hp.n_embd)
            self._head.enqueue(queue)
            if argmax and t == wanted[-1]:
                for launch in self._argmax:
                    launch.enqueue(queue)
                token = np.empty(1, np.int32)
                cl.enqueue_copy(queue, token, self._token)  # blocking: the token is the chunk's result
                rows.append(np.array(token[0], np.int64))
                continue
            row = np.empty(hp.n_vocab, np.float32)
            cl.enqueue_copy(queue, row, self._logits)  # blocking: the row is the chunk's result
            if hp.logit_softcap:
                cap = np.float32(hp.logit_softcap)
                row = cap * np.tanh(row / cap)
            rows.append(row)
        return rows


# What a device says when a buffer is past its memory, or past the largest one it allocates (a cache's layer, say).
ALLOCATION_FAILURES = (
    cl.status_code.MEM_OBJECT_ALLOCATION_FAILURE,
    cl.status_code.OUT_OF_RESOURCES,
    cl.status_code.OUT_OF_HOST_MEMORY,
    cl.status_code.INVALID_BUFFER_SIZE,
)
# Groups a compute unit for the small kernels of ops.cl on a CPU device (OpenCLBackend._op): enough for its driver
# to share them out among the cores as they come free.
OP_GROUPS_PER_UNIT = 8
# Work-items that scan a row of logits for its greedy token (argmax_part), each a stretch of the row: enough for
# a GPU's cores, few enough that joining them is one work-item's short loop.
ARGMAX_PARTS = 256

# The products of a layer, each over matrices that one product can stack when they share a type.
LAYER_PRODUCTS = (
    (MODEL_TENSOR.ATTN_Q, MODEL_TENSOR.ATTN_K, MODEL_TENSOR.ATTN_V),
    (MODEL_TENSOR.ATTN_OUT,),
    (MODEL_TENSOR.FFN_GATE, MODEL_TENSOR.FFN_UP),
    (MODEL_TENSOR.FFN_DOWN,),
)


def kernel_name(name: str, kind: QType, lanes: bool) -> str:
    """``products.cl``'s kernel ``name`` (matvec, dequantize) for matrices of ``kind``, in the lanes layout or not."""
    return f"{name}_{kind.name.lower()}" + ("_lanes" if lanes else "")


def layout_parts(kind: QType, raw: np.ndarray, k: int, float_scales: bool, lanes: bool) -> list[np.ndarray]:
    """The buffers of rows of ``k`` values of type ``kind`` as the file holds them (a row of ``raw`` each), in
    the layout its kernel reads: as they are for F32 and F16, else the flat one (FLAT_PARTS), its half scales
    widened to float32 if ``float_scales``; with ``lanes`` (LANES_TYPES, and float32 scales), each part's rows in
    groups of LANES, zero rows padding the last, and within a group a block's values for the LANES rows side
    by side, 4-bit codes as words of 8 (``products.cl``)."""
    n = raw.shape[0]
    if kind not in FLAT_PARTS:
        return [raw]
    block, _ = GGML_QUANT_SIZES[kind]
    blocks = raw.reshape(n, k // block, -1)
    cuts = (*FLAT_PARTS[kind], blocks.shape[-1])
    parts = [np.ascontiguousarray(blocks[..., a:b]) for a, b in itertools.pairwise(cuts)]
    for i in HALF_SCALES[kind] if float_scales else ():
        parts[i] = parts[i].view(np.float16).astype(np.float32)
    if not lanes:
        return parts
    if kind in FOUR_BIT_LANES:  # GGUF's byte p holds elements p and p + 16; a word holds 8 elements in order
        codes = parts[-1]
        elements = np.concatenate([codes & 15, codes >> 4], axis=-1).astype(np.uint32)
        nibbles = elements.reshape(*elements.shape[:-1], 4, 8) << (4 * np.arange(8, dtype=np.uint32))
        parts[-1] = np.bitwise_or.reduce(nibbles, axis=-1)  # in the host's byte order, as the floats are
    groups = -(-n // LANES)
    across = []
    for part in parts:  # (rows, blocks, values of a block) -> (groups, blocks, values, LANES)
        padded = np.zeros((groups * LANES, *part.shape[1:]), part.dtype)
        padded[:n] = part
        across.append(np.ascontiguousarray(padded.reshape(groups, LANES, *part.shape[1:]).transpose(0, 2, 3, 1)))
    return across


def shapes_of(kind: QType) -> tuple[Shape, ...]:
    """The shapes a product of ``kind`` may run in (``shapes_for``): a record of another (edited by hand, say)
    is measured again."""
    return shapes_for(kind in HALF_SCALES, kind in LANES_TYPES)


def _stacks(kinds: Sequence[MODEL_TENSOR], layer: int, types: dict[str, QType]) -> list[list[MODEL_TENSOR]]:
    """The matrices ``kinds`` of ``layer`` as products run them: stacked by rows in one where they share a type,
    else one each."""
    return [list(kinds)] if len({types[tensor_name(kind, layer)] for kind in kinds}) == 1 else [[k] for k in kinds]


def _product_key(stack: Sequence[TensorInfo]) -> str:
    """How the tuning's record names the product of the matrices ``stack``, stacked by rows."""
    return shape_key(stack[0].type.name, sum(t.shape[1] for t in stack), stack[0].shape[0])


def _uploaded_bytes(info: ModelInfo) -> int:
    """Bytes the weights take on the device: the file's matrices as stored (the embedding stays on the host
    unless it is also the head), vectors as float32."""
    total = 0
    for t in info.tensors:
        if len(t.shape) == 1:
            total += 4 * t.shape[0]
        elif t.name != tensor_name(MODEL_TENSOR.TOKEN_EMBD) or info.hparams.tied_embeddings:
            blocks = math.prod(t.shape) // GGML_QUANT_SIZES[t.type][0]
            widened = t.nbytes + 2 * blocks * len(HALF_SCALES.get(t.type, ()))  # scales widened, if tuned so
            rows = t.shape[1]
            padding = -rows % LANES if t.type in LANES_TYPES else 0  # the lanes layout's zero rows, if tuned so
            total += widened + padding * (widened // rows)
    return total


def _splits(kv_tokens: int) -> int:
    """Parts attention splits the positions into: one per ATTENTION_PART cells the cache holds, 1 to 16."""
    return max(1, min(16, -(-kv_tokens // ATTENTION_PART)))


def _scratch_bytes(info: ModelInfo, options: BackendOptions) -> int:
    """The device buffers a chunk works in: its activations, attention's parts and the largest product
    dequantized; and the RoPE tables, cos and sin at every position for each base."""
    hp = info.hparams
    parts = hp.n_head * _splits(options.kv_tokens) * (hp.head_dim + 2)
    rows = 3 * hp.n_embd + hp.q_dim + 2 * hp.kv_dim + hp.q_dim + 2 * hp.n_ff + parts  # x, h, out, qkv, ...
    bases = len({hp.layer_rope_base(layer) for layer in range(hp.n_layer)})
    tables = bases * options.kv_tokens * hp.head_dim
    return 4 * (options.batch_size * rows + _largest_matrix(info) + hp.n_vocab + options.kv_tokens + tables)


def _largest_matrix(info: ModelInfo) -> int:
    """Elements of the largest product a chunk dequantizes: Q, K and V or the gate and up stacked, or any one
    matrix but the embedding and the head (the head's logits are computed a row at a time)."""
    hp = info.hparams
    skipped = {tensor_name(MODEL_TENSOR.TOKEN_EMBD), tensor_name(MODEL_TENSOR.OUTPUT)}
    largest = max((math.prod(t.shape) for t in info.tensors if len(t.shape) > 1 and t.name not in skipped), default=0)
    return max(largest, (hp.q_dim + 2 * hp.kv_dim) * hp.n_embd, 2 * hp.n_ff * hp.n_embd)


def _binaries_folder() -> str | bool:
    """Where built kernels are kept (``EDGEINFER_CACHE_DIR/opencl/binaries``); False, building from source at every
    load, where that folder cannot be made (pyopencl would warn in many lines at each build)."""
    folder = cache_dir() / "opencl" / "binaries"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):  # a folder there already may still be read-only
            pass
    except OSError:
        return False
    return str(folder)
