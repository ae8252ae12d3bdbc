"""Calibration: run text through the reference forward pass one layer at a time and record
what each weight matrix sees.

* The importance matrix: for every matrix, the mean squared input activation of each column
  (what llama.cpp's ``llama-imatrix`` collects). A weight error in column ``j`` moves the output
  by ``error * x_j``, so these are the weights of the expected squared output error.
* The probe, for ``--sensitivity kld``: every layer's input for the first tokens, and the
  unquantized model's log-probabilities there, so one tensor's effect on the output
  distribution can be measured by re-running only the layers after it.

Every token of every chunk goes through layer ``l`` before any reaches layer ``l + 1``, so memory
holds one layer's weights and the activations, never the whole model.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
from gguf import MODEL_TENSOR

from edgeinfer.converters.checkpoint import Checkpoint
from edgeinfer.logits import log_softmax
from edgeinfer.models.arch import tensor_name
from edgeinfer.models.reference import Transformer, rms_norm

OUTPUT_NORM = tensor_name(MODEL_TENSOR.OUTPUT_NORM)
TOKEN_EMBD = tensor_name(MODEL_TENSOR.TOKEN_EMBD)
OUTPUT = tensor_name(MODEL_TENSOR.OUTPUT)


@dataclass
class Probe:
    """The first tokens of the calibration text, the input of every layer for them (the last entry
    is the final hidden state), and the unquantized model's log-probabilities after them."""

    tokens: list[int]
    layer_inputs: list[np.ndarray]
    base_logprobs: np.ndarray


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
    """Weights by name from the checkpoint, keeping only the current layer's in memory."""

    def __init__(self, ckpt: Checkpoint, overrides: dict[str, np.ndarray] | None = None) -> None:
        self.ckpt = ckpt
        self.overrides = overrides or {}
        self._layer: dict[str, np.ndarray] = {}
        self._layer_prefix = ""

    def __call__(self, name: str) -> np.ndarray:
        if name in self.overrides:
            return self.overrides[name]
        if not name.startswith("blk."):
            return self.ckpt.weight(name)
        prefix = name[: name.index(".", 4) + 1]
        if prefix != self._layer_prefix:
            self._layer, self._layer_prefix = {}, prefix
        if name not in self._layer:
            self._layer[name] = self.ckpt.weight(name)
        return self._layer[name]


def calibrate(
    ckpt: Checkpoint, tokens: Sequence[int], ctx: int = 512, probe_tokens: int = 0, bos: int | None = None
) -> Calibration:
    """The importance matrix of ``tokens`` run in chunks of ``ctx`` (each led by ``bos`` if the
    model wants one), and a probe of the first ``probe_tokens`` of them (0: none)."""
    hp = ckpt.hparams
    model = Transformer(hp, LayerWeights(ckpt))
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
    # One read of the embedding table for every chunk, not one per chunk.
    xs = np.split(model.embed([t for chunk in chunks for t in chunk]), np.cumsum([len(c) for c in chunks[:-1]]))
    for layer in range(hp.n_layer):
        inputs.append(xs[0][:n_probe].copy())
        xs = [model.block(layer, x, np.arange(len(x)), observe=observe) for x in xs]
    inputs.append(xs[0][:n_probe].copy())
    head = TOKEN_EMBD if hp.tied_embeddings else OUTPUT
    norm = ckpt.weight(OUTPUT_NORM)
    for x in xs:
        observe(head, rms_norm(x, norm, hp.rms_eps))
    calib.importance = {name: (total / calib.n_tokens).astype(np.float32) for name, total in sums.items()}
    if n_probe:
        calib.probe = Probe(chunks[0][:n_probe], inputs, log_softmax(model.head(inputs[-1])))
    return calib


def output_kld(ckpt: Checkpoint, probe: Probe, name: str, replacement: np.ndarray) -> float:
    """Mean KL divergence of the model's next-token distribution over the probe tokens when the
    tensor ``name`` is replaced, from the unquantized model's. Only the layers from the replaced
    tensor's on are re-run."""
    hp = ckpt.hparams
    model = Transformer(hp, LayerWeights(ckpt, {name: replacement}))
    if name == TOKEN_EMBD:
        first, x = 0, model.embed(probe.tokens)
    elif name.startswith("blk."):
        first = int(name.split(".")[1])
        x = probe.layer_inputs[first]
    else:
        first, x = hp.n_layer, probe.layer_inputs[-1]
    positions = np.arange(len(x))
    for layer in range(first, hp.n_layer):
        x = model.block(layer, x, positions)
    logprobs = log_softmax(model.head(x))
    base = probe.base_logprobs
    return float(np.mean(np.sum(np.exp(base) * (base - logprobs), axis=1)))
