"""Which activations a model's products take: measured once per model, not assumed.

MatMulNBits with ``accuracy_level`` 4 quantizes its activations to int8 a block at a time, as
llama.cpp does; with 0 it computes in float32, exactly what the file holds. int8 decodes SmolLM2
about 1.7x as fast, but how far it moves a model depends on the model: a model whose activations
have outliers that one int8 scale a block flattens can move far (tests/test_onnx_backend.py).
8-bit codes run fast only with int8; Q8_0's can take a second int8 pass over what the first one's
rounding left, which leaves about 1/250 of one pass's error (``weights.matmul``'s
``residual_pass``) at about a second product's cost. So a graph is built at one of two levels:

- ``FLOAT``: float activations for 4-bit codes, Q8_0 in two int8 passes;
- ``INT8``: int8 activations in one pass, as llama.cpp computes.

Other 8-bit codes (Q5_0, Q5_1, Q5_K, Q6_K, Q2_K, Q3_K, IQ4_NL, IQ4_XS), whose own rounding is coarser,
take one int8 pass at either level. Each model with 4-bit codes or Q8_0 ones is measured at its first
load: ``CALIBRATION_TOKENS`` of its own text (a few random tokens, then what the ``FLOAT`` graph writes
after them with the engine's default sampling) are scored by both graphs, and int8 is kept where the
mean KLD between them is at most ``INT8_KLD_LIMIT``, or ``LOSSLESS_KLD_LIMIT`` for a file whose
matrices lose next to nothing.
Over 2,048 tokens of kjv-genesis, int8 moves SmolLM2 Q4_1 6.55e-3 and Gemma 3 270M Q4_K_M 1.2e-2
from float, where llama.cpp's own int8 activations move them 4.8e-3 and 1.7e-2; one 64-token
calibration text measured 6.5e-3 and 5.2e-3 on average over 8 seeds, at most 1.8e-2
(docs/BENCHMARKS.md).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from typing import Protocol

import numpy as np

from edgeinfer.logits import kl_divergence
from edgeinfer.sampler import Sampler
from edgeinfer.sampling import SamplingParams

from ..base import Span
from .spec import FLOAT, INT8

# int8 may move a model as far as llama.cpp's own int8 activations do (Gemma 3 270M: 1.7e-2 from float), and as
# the conformance suite lets llama.cpp move the default model from the reference (0.02).
INT8_KLD_LIMIT = 2e-2
# A file of Q8_0 (and float) matrices, whose codes lose next to nothing, is held to issue 17's bound for Q8_0 files,
# 0.001 over 512 tokens of text: its 64 calibration tokens to half that. One pass moved SmolLM2's Q8_0 copy 6.0e-3
# on kjv-genesis; tiny-qwen2's, 6.5e-5.
LOSSLESS_KLD_LIMIT = 5e-4
CALIBRATION_TOKENS = 64  # every model's context holds as many (models/arch.py, MIN_CONTEXT)
RANDOM_TOKENS = 4  # the text's start: random tokens, so no one vocabulary's special tokens are assumed
SEED = 0


class _Model(Protocol):
    @property
    def n_vocab(self) -> int: ...

    def eval(self, spans: list[Span]) -> list[np.ndarray]: ...

    def close(self) -> None: ...


def int8_kld(load: Callable[[int], _Model]) -> float:
    """Mean KLD of the INT8 level from the FLOAT one over a text the FLOAT model writes: ``load(level)`` gives
    the model at an accuracy level, each loaded and closed in turn (two at once would need twice the memory)."""
    rng = np.random.default_rng(SEED)
    sample = Sampler(SamplingParams(seed=SEED))  # the engine's default chain: text as the model writes it
    with contextlib.closing(load(FLOAT)) as model:
        tokens = [int(t) for t in rng.integers(model.n_vocab, size=RANDOM_TOKENS)]
        rows = [model.eval([Span(0, 0, tokens, all_logits=True)])[0].copy()]
        while len(tokens) < CALIBRATION_TOKENS:
            if not np.isfinite(rows[-1][-1]).all():  # corrupt weights: FLOAT kept, and decoding says so in one line
                return math.inf
            tokens.append(sample(rows[-1][-1]))
            rows.append(model.eval([Span(0, len(tokens) - 1, tokens[-1:])])[0][None].copy())
    expected = np.concatenate(rows)[:-1]  # the last row predicts no token of the text
    with contextlib.closing(load(INT8)) as model:
        actual = model.eval([Span(0, 0, tokens[:-1], all_logits=True)])[0]
    # Scored where the text is the model's own: from the row that predicted its first sampled token.
    written = slice(RANDOM_TOKENS - 1, None)
    return float(kl_divergence(expected[written], actual[written]).mean())
