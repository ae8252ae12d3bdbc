"""What one reads off rows of logits: log-probabilities, their normaliser, a token's log-probability, the entropy.

Two precisions for two jobs. ``log_softmax`` works in float64: evaluation compares whole
distributions offline, and KL divergences of 1e-5 would drown in float32's rounding.
``logsumexp``, ``token_logprobs`` and ``confidence`` keep the logits' own dtype (float32 from
every backend): they run while a prompt is scored or an answer decoded, a pass over the whole
vocabulary each, where a float64 copy of the row would cost more than the arithmetic itself.
In float32, with the row's maximum subtracted first, a log-probability or an entropy comes out
within 3e-5 nats of the float64 figure on a 49,152-entry row (tests/test_logits.py), most of it
from rounding ``logit - max`` to float32 for logits far below the maximum.

Entries of -inf (masked tokens) get probability 0 and leave the results finite.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np


def logsumexp(logits: np.ndarray) -> np.ndarray:
    """log(sum(exp(row))) of each row (the last axis), in the logits' dtype: a 0-d array for one row."""
    top = logits.max(axis=-1, keepdims=True)  # subtracted first, so exp() cannot overflow
    shifted = logits - top
    total = np.exp(shifted, out=shifted).sum(axis=-1, keepdims=True)  # in place: evaluation's blocks are large
    return (top + np.log(total))[..., 0]


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Rows of logits as log-probabilities, in float64."""
    x = np.array(logits, dtype=np.float64)  # a copy, always: it is overwritten
    x -= logsumexp(x)[..., None]
    return x


def kl_divergence(expected: np.ndarray, actual: np.ndarray) -> np.ndarray:
    """KL(expected || actual) of each pair of rows of logits, in nats, float64."""
    p, q = log_softmax(expected), log_softmax(actual)
    return np.sum(np.exp(p) * (p - q), axis=-1)


def token_logprobs(rows: np.ndarray, tokens: Sequence[int]) -> np.ndarray:
    """The log-probability of ``tokens[i]`` under row ``i``, for a block of rows."""
    return rows[np.arange(len(rows)), tokens] - logsumexp(rows)


class Confidence(NamedTuple):
    """How sure a row of logits was of the token drawn from it, in nats."""

    logprob: float  # log p(token): near 0 when the token was the obvious choice
    entropy: float  # of the whole distribution: how spread out the choice was


def confidence(logits: np.ndarray, token: int) -> Confidence:
    """The log-probability of ``token`` under one row of logits, and the row's entropy.

    One exp over the row; the sums are dot products, which BLAS does at a fraction of the
    cost of numpy's float32 sum. With w = exp(s), s = logits - max and Z = sum(w):
    log p(token) = s[token] - log Z, and H = -sum(p log p) = log Z - (w . s) / Z.
    """
    shifted = logits - logits.max()
    weights = np.exp(shifted)
    total = float(weights @ _ones(len(weights), weights.dtype))
    with np.errstate(invalid="ignore"):  # a masked (-inf) entry makes 0 * -inf: handled below
        spread = float(weights @ shifted)
    if math.isnan(spread):  # the masked entries' weight is 0, so they add nothing
        spread = float(weights @ np.maximum(shifted, np.finfo(shifted.dtype).min))
    log_total = math.log(total)
    return Confidence(float(shifted[token]) - log_total, log_total - spread / total)


@functools.lru_cache(maxsize=4)
def _ones(n: int, dtype: np.dtype) -> np.ndarray:
    ones = np.ones(n, dtype=dtype)
    ones.flags.writeable = False  # shared by every call
    return ones
