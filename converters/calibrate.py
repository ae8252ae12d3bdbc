"""Calibration: run text through the reference forward pass one layer at a time, record what each
weight matrix sees, and measure what quantizing each matrix does to the output.

* The importance matrix: for every matrix, the mean squared input activation of each column
  (what llama.cpp's ``llama-imatrix`` collects). A weight error in column ``j`` moves the output
  by ``error * x_j``, so these are the weights of the expected squared output error.
* The probe, for ``--sensitivity kld``: every layer's input for the first tokens, so that a
  matrix's effect on the output distribution can be measured by re-running only the layers from
  its own on (``output_klds``).

Every token of every chunk goes through layer ``l`` before any reaches layer ``l + 1``, so memory
holds one layer's weights and the activations, never the whole model; the vocabulary-sized
matrices are read a block of rows at a time (``rows.py``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
from gguf import MODEL_TENSOR, GGMLQuantizationType

from edgeinfer.converters.checkpoint import Checkpoint
from edgeinfer.converters.quantize import dequantize, quantize
from edgeinfer.converters.rows import OUTPUT, TOKEN_EMBD, gather_rows, row_blocks
from edgeinfer.logits import logsumexp
from edgeinfer.models.arch import HParams, layer_tensors, tensor_name
from edgeinfer.models.reference import Transformer, Weights, rms_norm

OUTPUT_NORM = tensor_name(MODEL_TENSOR.OUTPUT_NORM)
OnStep = Callable[[int, float], None]
"""Told after each unit of work (a layer) how many are done, and what share of the work that is."""
# The matrices that write into the residual stream: their quantization noise lands there as it is,
# while the other matrices' errors reach it through one of these, into directions the model reads.
# So per unit of squared change of a layer's output the kinds cost the output differently (on
# tiny-qwen2, trained: ffn_down 0.4 to 0.7 times its layer's average, attn_q and attn_k 1.2 to 2.8
# times), and each kind is probed on its own.
RESIDUAL_WRITERS = (MODEL_TENSOR.ATTN_OUT, MODEL_TENSOR.FFN_DOWN)
LOGITS_BYTES = 64 << 20  # the float32 logits computed at once by the divergence pass


@dataclass
class Probe:
    """The first tokens of the calibration text, the input of every layer for them (the last entry
    is the final hidden state), and the log of the normaliser of the unquantized model's
    next-token distribution after each (``logsumexp`` of its logits)."""

    tokens: list[int]
    layer_inputs: list[np.ndarray]
    base_lse: np.ndarray


@dataclass
class Calibration:
    n_tokens: int
    importance: dict[str, np.ndarray] = field(default_factory=dict)
    """Mean squared input activation per column, by matrix name (none for a lookup-only embedding)."""
    probe: Probe | None = None


def column_importance(calib: Calibration | None, name: str, n_cols: int) -> np.ndarray:
    """The measured importance of a matrix's columns, or equal importance where none was measured
    (no calibration text, or a lookup-only embedding): ggml then still searches for the best
    scales instead of rounding with its reference quantizers (Q4_0's relative error on random data
    drops from 0.086 to 0.082)."""
    found = calib.importance.get(name) if calib is not None else None
    return found if found is not None else np.ones(n_cols, np.float32)


class LayerWeights:
    """Weights by name from the checkpoint, keeping only the current layer's in memory. The
    vocabulary-sized matrices are never asked for whole: ``embed`` and ``head_logits`` read theirs."""

    def __init__(self, ckpt: Checkpoint) -> None:
        self.ckpt = ckpt
        self._layer: dict[str, np.ndarray] = {}
        self._layer_prefix = ""

    def __call__(self, name: str) -> np.ndarray:
        if not name.startswith("blk."):
            return self.ckpt.weight(name)
        prefix = name[: name.index(".", 4) + 1]
        if prefix != self._layer_prefix:
            self._layer, self._layer_prefix = {}, prefix
        if name not in self._layer:
            self._layer[name] = self.ckpt.weight(name)
        return self._layer[name]


def replacing(weights: Weights, replaced: Mapping[str, np.ndarray]) -> Weights:
    """``weights`` with some tensors swapped for others."""
    return lambda name: replaced[name] if name in replaced else weights(name)


def embed(
    ckpt: Checkpoint, weights: Weights, tokens: Sequence[int], table: Callable[[np.ndarray], np.ndarray]
) -> np.ndarray:
    """The tokens' embeddings, reading only their rows of the table (passed through ``table``)."""
    wanted, index = np.unique(np.asarray(tokens), return_inverse=True)
    rows = table(gather_rows(ckpt, TOKEN_EMBD, wanted))
    return Transformer(ckpt.hparams, replacing(weights, {TOKEN_EMBD: rows})).embed(index)


def head_name(ckpt: Checkpoint) -> str:
    return TOKEN_EMBD if ckpt.hparams.tied_embeddings else OUTPUT


def head_logits(ckpt: Checkpoint, weights: Weights, x: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """The logits of the final hidden states ``x`` for the tokens whose head rows are ``rows``
    (a block of the vocabulary: every step of the head is per token or per logit)."""
    return Transformer(ckpt.hparams, replacing(weights, {head_name(ckpt): rows})).head(x)


def calibrate(
    ckpt: Checkpoint,
    tokens: Sequence[int],
    ctx: int = 512,
    probe_tokens: int = 0,
    bos: int | None = None,
    on_layer: OnStep = lambda done, share: None,
) -> Calibration:
    """The importance matrix of ``tokens`` run in chunks of ``ctx`` (each led by ``bos`` if the
    model wants one), and a probe of the first ``probe_tokens`` of them (0: none). ``on_layer`` is
    told as each layer is done."""
    hp = ckpt.hparams
    weights = LayerWeights(ckpt)
    model = Transformer(hp, weights)
    lead = [] if bos is None else [bos]
    step = ctx - len(lead)
    chunks = [lead + list(tokens[i : i + step]) for i in range(0, len(tokens), step)]
    calib = Calibration(n_tokens=sum(map(len, chunks)))
    sums: dict[str, np.ndarray] = {}

    def observe(name: str, x: np.ndarray) -> None:
        x64 = x.astype(np.float64)
        sums[name] = sums.get(name, 0.0) + np.einsum("ij,ij->j", x64, x64)

    n_probe = min(probe_tokens, len(chunks[0])) if chunks else 0
    inputs: list[np.ndarray] = []
    flat = [t for chunk in chunks for t in chunk]
    xs = np.split(embed(ckpt, weights, flat, lambda rows: rows), np.cumsum([len(c) for c in chunks[:-1]]))
    for layer in range(hp.n_layer):
        inputs.append(xs[0][:n_probe].copy())
        xs = [model.block(layer, x, np.arange(len(x)), observe=observe) for x in xs]
        on_layer(layer + 1, (layer + 1) / hp.n_layer)
    inputs.append(xs[0][:n_probe].copy())
    norm = ckpt.weight(OUTPUT_NORM)
    for x in xs:
        observe(head_name(ckpt), rms_norm(x, norm, hp.rms_eps))
    calib.importance = {name: (total / calib.n_tokens).astype(np.float32) for name, total in sums.items()}
    if n_probe:
        lse = np.full(n_probe, -np.inf)
        for rows in row_blocks(ckpt, head_name(ckpt)):
            lse = np.logaddexp(lse, logsumexp(head_logits(ckpt, weights, inputs[-1], rows).astype(np.float64)))
        calib.probe = Probe(chunks[0][:n_probe], inputs, lse)
    return calib


def output_klds(
    ckpt: Checkpoint,
    calib: Calibration,
    probe_types: Mapping[str, GGMLQuantizationType],
    on_layer: OnStep = lambda done, share: None,
) -> dict[str, float]:
    """For each matrix of ``probe_types``, the mean KL divergence of the model's next-token
    distribution over the probe tokens from the unquantized model's, when that matrix alone is
    quantized to its type. ``on_layer`` counts the layers done, and the head as one more.

    The token embedding and the output matrix are measured as such: their quantized rows run
    through the whole model. A layer's matrices are measured in two groups, ``RESIDUAL_WRITERS``
    and the rest: with a group quantized, the layer's output runs through the rest of the model and
    the head, so there are two such runs per layer rather than one per matrix. Each matrix gets its
    group's divergence per unit of squared change of the layer's output, times its own squared
    change, measured by running that layer alone with the matrix quantized. All runs advance
    together, one layer at a time, so each layer's weights are read once.
    """
    hp = ckpt.hparams
    assert calib.probe is not None
    probe = calib.probe
    weights = LayerWeights(ckpt)
    positions = np.arange(len(probe.tokens))

    def quantized(name: str, w: np.ndarray) -> np.ndarray:
        qtype = probe_types[name]
        raw = quantize(w, qtype, column_importance(calib, name, w.shape[1]))
        return dequantize(raw, qtype).reshape(w.shape)

    groups = [_groups(hp, layer, probe_types) for layer in range(hp.n_layer)]
    # The work, in runs of one layer over the probe tokens: each layer runs its matrices one at a
    # time, its groups, and every run begun before it; the head costs its share of a layer's
    # multiply-adds per run (a 128k vocabulary makes it several layers' worth).
    head_cost = hp.n_vocab * hp.n_embd / sum(math.prod(shape) for _, shape in layer_tensors(hp, 0))
    begun = int(TOKEN_EMBD in probe_types)  # the runs begun before a layer
    cost = []
    for layer_groups in groups:
        cost.append(sum(map(len, layer_groups)) + len(layer_groups) + begun)
        begun += len(layer_groups)
    total = sum(cost) + (begun + int(OUTPUT in probe_types)) * head_cost

    # What each run quantizes (the embedding, a group of a layer's matrices), and its hidden state so far.
    runs: dict[str, np.ndarray] = {}
    if TOKEN_EMBD in probe_types:
        runs[TOKEN_EMBD] = embed(ckpt, weights, probe.tokens, lambda rows: quantized(TOKEN_EMBD, rows))
    change: dict[str, float] = {}  # mean squared change of its layer's output, by matrix and by group
    group_of: dict[str, str] = {}
    model = Transformer(hp, weights)
    for layer in range(hp.n_layer):
        runs = {key: model.block(layer, x, positions) for key, x in runs.items()}
        x, clean = probe.layer_inputs[layer], probe.layer_inputs[layer + 1]
        replaced = {name: quantized(name, weights(name)) for group in groups[layer] for name in group}
        for name in replaced:
            alone = Transformer(hp, replacing(weights, {name: replaced[name]})).block(layer, x, positions)
            change[name] = _mean_square(alone - clean)
        for group in groups[layer]:
            key = "+".join(group)
            runs[key] = Transformer(hp, replacing(weights, {n: replaced[n] for n in group})).block(layer, x, positions)
            change[key] = _mean_square(runs[key] - clean)
            group_of.update(dict.fromkeys(group, key))
        del replaced  # before the next layer's are made
        on_layer(layer + 1, sum(cost[: layer + 1]) / total)
    head = head_name(ckpt)
    if OUTPUT in probe_types:
        runs[OUTPUT] = probe.layer_inputs[-1]
    klds = _head_klds(ckpt, weights, probe, runs, head, lambda rows: quantized(head, rows))
    on_layer(hp.n_layer + 1, 1.0)
    for name, key in group_of.items():
        klds[name] = klds[key] * change[name] / change[key] if change[key] > 0 else 0.0
    return {name: klds[name] for name in probe_types}


def _groups(hp: HParams, layer: int, probe_types: Mapping[str, GGMLQuantizationType]) -> list[tuple[str, ...]]:
    """The layer's matrices to probe, in the groups that are probed together."""
    writers = {tensor_name(kind, layer) for kind in RESIDUAL_WRITERS}
    matrices = [name for name, shape in layer_tensors(hp, layer) if len(shape) == 2 and name in probe_types]
    split = (tuple(n for n in matrices if n in writers), tuple(n for n in matrices if n not in writers))
    return [group for group in split if group]


def _head_klds(
    ckpt: Checkpoint,
    weights: Weights,
    probe: Probe,
    runs: Mapping[str, np.ndarray],
    head: str,
    quantized: Callable[[np.ndarray], np.ndarray],
) -> dict[str, float]:
    """Each run's mean KL divergence from the unquantized model over the probe tokens; the run
    named ``head`` (the embedding when tied, else the output matrix) also goes through the quantized head.

    The vocabulary is taken a block of rows at a time. With base logits ``b`` and the run's ``z``,
    KL = Σ p (b - z) + lse(z) - lse(b), and each term sums over the blocks. ``p`` is taken as
    exp(b - shift) with the probe's ``base_lse`` as the shift and renormalised at the end, so
    every figure comes from this pass's own logits (all in float64: divergences of 1e-6 are
    differences of terms of 1e-2)."""
    n = len(probe.tokens)
    keys = [key for key in runs if key != head]
    stacked = np.concatenate([probe.layer_inputs[-1], *(runs[key] for key in keys)])
    shift = probe.base_lse
    mass = np.zeros(n)  # Σ exp(b - shift)
    cross = {key: np.zeros(n) for key in runs}  # Σ exp(b - shift) (b - z)
    lse = {key: np.full(n, -np.inf) for key in runs}
    per_matmul = max(1, LOGITS_BYTES // (4 * len(stacked)))
    for block in row_blocks(ckpt, head):
        for rows in np.array_split(block, -(-len(block) // per_matmul)):
            logits = head_logits(ckpt, weights, stacked, rows)
            base = logits[:n].astype(np.float64)
            p = np.exp(base - shift[:, None])
            mass += p.sum(axis=1)
            found = [(key, logits[n * (i + 1) : n * (i + 2)]) for i, key in enumerate(keys)]
            if head in runs:
                found.append((head, head_logits(ckpt, weights, runs[head], quantized(rows))))
            for key, z in found:
                z64 = z.astype(np.float64)
                cross[key] += np.einsum("tv,tv->t", p, base - z64)
                lse[key] = np.logaddexp(lse[key], logsumexp(z64))
    base_lse = shift + np.log(mass)
    return {key: max(float(np.mean(cross[key] / mass + lse[key] - base_lse)), 0.0) for key in runs}


def _mean_square(diff: np.ndarray) -> float:
    """The mean over tokens of a change's squared length."""
    return float(np.einsum("ij,ij->", diff, diff, dtype=np.float64)) / len(diff)
