"""Whether a model's 4-bit products take int8 activations: measured once per model, not assumed.

MatMulNBits with ``accuracy_level`` 4 quantizes its activations to int8 a block at a time, as
llama.cpp does; with 0 it computes in float32, exactly what the file holds. int8 decodes faster
(SmolLM2 1.27x), but how far it moves a model depends on the model. Over 256 tokens of English,
KLD from the float graph: tiny-qwen2 Q4_0 6.0e-5; SmolLM2 Q4_1 2.7e-2 and Gemma 3 270M Q4_K_M
3.2e-2, models whose activations have outliers a shared int8 scale flattens (docs/BENCHMARKS.md).

So each model is measured at its first load: ``CALIBRATION_TOKENS`` of its own text (a few random
tokens, then what the float graph samples after them) are scored by both graphs, and int8 is
kept where the mean KLD is at most ``INT8_KLD_LIMIT``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Protocol

import numpy as np

from edgeinfer.logits import kl_divergence, log_softmax

from ..base import Span

FLOAT = 0  # MatMulNBits' accuracy_level: float32 activations
INT8 = 4  # int8 activations
# llama.cpp's own int8 activations move SmolLM2 3.6e-3 from exact arithmetic: int8 may cost no more than that.
INT8_KLD_LIMIT = 5e-3
CALIBRATION_TOKENS = 64  # every model's context holds as many (models/arch.py, MIN_CONTEXT)
RANDOM_TOKENS = 4  # the text's start: random tokens, so no one vocabulary's special tokens are assumed
SEED = 0


class _Model(Protocol):
    @property
    def n_vocab(self) -> int: ...

    def eval(self, spans: list[Span]) -> list[np.ndarray]: ...

    def close(self) -> None: ...


def int8_kld(load: Callable[[int], _Model]) -> float:
    """Mean KLD of int8 activations from float ones over a text the float model writes: ``load(level)`` gives
    the model at an accuracy level, each loaded and closed in turn (two at once would need twice the memory)."""
    rng = np.random.default_rng(SEED)
    with contextlib.closing(load(FLOAT)) as model:
        tokens = [int(t) for t in rng.integers(model.n_vocab, size=RANDOM_TOKENS)]
        rows = [model.eval([Span(0, 0, tokens, all_logits=True)])[0].copy()]
        while len(tokens) < CALIBRATION_TOKENS:
            tokens.append(_sample(rows[-1][-1], rng))
            rows.append(model.eval([Span(0, len(tokens) - 1, tokens[-1:])])[0][None].copy())
    expected = np.concatenate(rows)[:-1]  # the last row predicts no token of the text
    with contextlib.closing(load(INT8)) as model:
        actual = model.eval([Span(0, 0, tokens[:-1], all_logits=True)])[0]
    # Scored where the text is the model's own: from the row that predicted its first sampled token.
    written = slice(RANDOM_TOKENS - 1, None)
    return float(kl_divergence(expected[written], actual[written]).mean())


def _sample(row: np.ndarray, rng: np.random.Generator) -> int:
    """A token drawn from ``row``'s distribution at temperature 1."""
    cumulative = np.cumsum(np.exp(log_softmax(row)))
    return int(min(np.searchsorted(cumulative, rng.random() * cumulative[-1], side="right"), len(row) - 1))
