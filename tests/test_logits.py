"""What is read off rows of logits, against the float64 formulas, on rows of a real vocabulary's size."""

from __future__ import annotations

import math

import numpy as np
import pytest

from edgeinfer.logits import confidence, log_softmax, logsumexp, token_logprobs

N_VOCAB = 49_152  # SmolLM2's
RNG = np.random.default_rng(0)


def reference_logprobs(row: np.ndarray) -> np.ndarray:
    x = row.astype(np.float64)
    return x - (x.max() + math.log(math.fsum(np.exp(x - x.max()))))


def rows(scale: float, n: int = 3) -> np.ndarray:
    """Rows of float32 logits as models give them: an offset, a spread, a few clear favourites."""
    out = RNG.normal(size=(n, N_VOCAB)) * scale + RNG.normal(size=(n, 1)) * 20
    out[np.arange(n), RNG.integers(N_VOCAB, size=n)] += 4 * scale
    return out.astype(np.float32)


@pytest.mark.parametrize("scale", [0.3, 1.0, 3.0, 10.0, 30.0])
def test_log_softmax_and_logsumexp_agree_with_float64_formulas(scale):
    block = rows(scale)
    expected = np.stack([reference_logprobs(row) for row in block])
    np.testing.assert_allclose(log_softmax(block), expected, rtol=0, atol=1e-9)
    np.testing.assert_allclose(log_softmax(block[0]), expected[0], rtol=0, atol=1e-9)
    np.testing.assert_allclose(block[:, 0] - logsumexp(block), expected[:, 0], rtol=0, atol=1e-4)
    tokens = RNG.integers(N_VOCAB, size=len(block))
    np.testing.assert_allclose(token_logprobs(block, tokens), expected[np.arange(len(block)), tokens], atol=1e-4)


@pytest.mark.parametrize("scale", [0.3, 1.0, 3.0, 10.0, 30.0])
def test_confidence_matches_the_float64_log_probability_and_entropy(scale):
    for row in rows(scale):
        logp = reference_logprobs(row)
        entropy = -float(np.sum(np.exp(logp) * logp))
        # Each token's log-probability: the drawn one is usually a favourite, but any may be.
        for token in (int(row.argmax()), int(RNG.integers(N_VOCAB))):
            got = confidence(row, token)
            assert got.logprob == pytest.approx(logp[token], abs=3e-5)
            assert got.entropy == pytest.approx(entropy, abs=3e-5)


def test_certain_and_uniform_rows_have_the_textbook_values():
    certain = np.zeros(N_VOCAB, dtype=np.float32)
    certain[7] = 1e4
    assert confidence(certain, 7) == pytest.approx((0.0, 0.0), abs=1e-6)
    assert confidence(certain, 8).logprob == pytest.approx(-1e4)
    uniform = np.full(N_VOCAB, -3.0, dtype=np.float32)
    assert confidence(uniform, 0) == pytest.approx((-math.log(N_VOCAB), math.log(N_VOCAB)), abs=1e-5)


def test_extreme_and_masked_logits_stay_finite():
    row = rows(3.0, 1)[0]
    row[:100] = -1e4
    row[100] = 1e4
    row[200:300] = -np.inf  # masked tokens: probability 0
    logp = log_softmax(row)
    assert np.isfinite(logp[:200]).all() and np.isneginf(logp[200:300]).all() and np.isfinite(logp[300:]).all()
    assert math.isfinite(float(logsumexp(row)))
    got = confidence(row, 100)
    assert math.isfinite(got.entropy) and got.entropy >= 0 and got.logprob == pytest.approx(0.0, abs=1e-6)
    assert confidence(row, 250).logprob == -math.inf
    masked = rows(3.0, 1)[0]
    masked[::2] = -np.inf
    finite = masked[1::2]
    expected = reference_logprobs(finite)
    assert confidence(masked, 1) == pytest.approx((expected[0], -float(np.sum(np.exp(expected) * expected))), abs=3e-5)
