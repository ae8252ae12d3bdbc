"""The numpy reference backend: the same answers as llama.cpp, and the same KV operations."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from edgeinfer import Engine
from edgeinfer.models.arch import layer_tensors
from edgeinfer.models.catalog import resolve_model
from edgeinfer.models.reference import Transformer

from support import JAPAN, evaluate

TEXT = (Path(__file__).parent / "data" / "lighthouse.txt").read_text()


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    x -= x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def kld(p_logits: np.ndarray, q_logits: np.ndarray) -> float:
    p, q = log_softmax(p_logits), log_softmax(q_logits)
    return float((np.exp(p) * (p - q)).sum(axis=-1).mean())


def top1(a: np.ndarray, b: np.ndarray) -> float:
    return float((a.argmax(axis=-1) == b.argmax(axis=-1)).mean())


@pytest.fixture(scope="module")
def reference(model_path):
    with Engine(model_path, backend="reference", kv_budget="256tok") as e:
        yield e


def test_agrees_with_llamacpp_as_closely_as_llamacpp_agrees_with_itself(engine, reference):
    tokens = engine.tokenize(TEXT)[:128]
    batched = engine.logits(tokens)
    # llama.cpp rounds activations to 8 bits for Q4_1 weights, differently in batched and
    # one-token evaluation: its two paths set the scale of disagreement for this file.
    engine.reset()
    one_by_one = np.stack([evaluate(engine.backend, [t], i).copy() for i, t in enumerate(tokens)])
    engine.reset()
    ours = reference.logits(tokens)
    assert np.isfinite(ours).all()
    assert_agrees_as_llamacpp_with_itself(batched, one_by_one, ours)
    assert top1(batched, ours) >= 0.93


def assert_agrees_as_llamacpp_with_itself(batched: np.ndarray, one_by_one: np.ndarray, ours: np.ndarray) -> None:
    """The criterion for a quantized file: the reference's logits are no further (KLD) from either of llama.cpp's
    two paths, batched and one token at a time, than twice the paths are from each other."""
    llamacpp_self = kld(batched, one_by_one)
    assert kld(batched, ours) < max(2 * llamacpp_self, 0.002)
    assert kld(one_by_one, ours) < max(2 * llamacpp_self, 0.002)


def test_gemma3_270m_agrees_with_llamacpp_as_closely_as_llamacpp_agrees_with_itself():
    """The criterion above, on Gemma 3 270M Q4_K_M (its K-quants and Q5_0 also multiply 8-bit activations),
    over 48 tokens: its 262k-token head makes each slow. The reference evaluates 40 at once, then 8
    through its cache, sliding-window layers and global ones alike."""
    path = resolve_model("gemma3-270m")
    with Engine(path, kv_budget="256tok", threads=2) as engine:
        tokens = engine.tokenize(TEXT)[:48]
        batched = engine.logits(tokens)
        engine.reset()
        one_by_one = np.stack([evaluate(engine.backend, [t], i).copy() for i, t in enumerate(tokens)])
    with Engine(path, backend="reference", kv_budget="256tok", threads=2) as reference:
        rows = [evaluate(reference.backend, tokens[:40], 0, all_logits=True)]
        rows += [evaluate(reference.backend, [t], i)[None] for i, t in enumerate(tokens[40:], 40)]
    ours = np.concatenate(rows)
    assert np.isfinite(ours).all()
    # Measured (AVX2): llama.cpp against itself KLD 4.4e-3, top-1 94%; the reference 4.6e-3 and 96%. With
    # flash attention (AVX-512): llama.cpp against itself 3.6e-3 and 96%; the reference 4.8e-3 and 87.5%.
    assert_agrees_as_llamacpp_with_itself(batched, one_by_one, ours)
    # Over 48 tokens one near-tie is 2% of top-1; every token ranked first differently is one, as
    # llama.cpp's two paths split some too (measured: the leader 0.002 to 0.22 logits ahead, 6 of 48 with
    # flash attention, whose sums of values round in half precision).
    assert top1(batched, ours) >= 0.85
    differ = np.flatnonzero(batched.argmax(axis=1) != ours.argmax(axis=1))
    leads = batched[differ, batched.argmax(axis=1)[differ]] - batched[differ, ours.argmax(axis=1)[differ]]
    assert (leads < 0.25).all(), leads


def test_generates_the_same_greedy_answer(reference):
    assert "Tokyo" in reference.chat(JAPAN, temperature=0, max_tokens=12).text


def test_one_token_at_a_time_equals_one_batch(reference):
    backend = reference.backend
    tokens = reference.tokenize(TEXT)[:40]
    reference.reset()
    batch = evaluate(backend, tokens, 0, all_logits=True)
    backend.truncate(0, 0)
    stepped = np.stack([evaluate(backend, [t], i) for i, t in enumerate(tokens)])
    backend.truncate(0, 0)
    assert stepped.dtype == np.float32
    assert kld(batch, stepped) < 1e-6 and top1(batch, stepped) == 1.0


def test_truncate_forgets_what_a_fresh_evaluation_never_saw(reference):
    backend = reference.backend
    tokens = reference.tokenize(TEXT)[:50]
    reference.reset()
    evaluate(backend, tokens[:50], 0)
    backend.truncate(0, 30)
    after_truncate = evaluate(backend, tokens[30:40], 30, all_logits=True)
    backend.truncate(0, 0)
    fresh = evaluate(backend, tokens[:40], 0, all_logits=True)[30:]
    backend.truncate(0, 0)
    assert kld(fresh, after_truncate) < 1e-6 and top1(fresh, after_truncate) == 1.0


def test_evict_shifts_the_cache_as_llamacpp_does(engine, reference):
    tokens = engine.tokenize(TEXT)[:80]
    outputs = []
    for e in (engine, reference):
        e.reset()
        evaluate(e.backend, tokens[:60], 0)
        e.backend.evict(0, 4, 24)  # drop positions 4..23; 24..59 move down to 4..39, keys re-rotated
        outputs.append(np.array(evaluate(e.backend, tokens[60:80], 40, all_logits=True)))
        e.reset()
    # Keys left at their old rotation give KLD 1.6 and top-1 35%; llama.cpp and the reference
    # agree to 0.005 and 85% (its 8-bit activations add noise, see the first test).
    assert kld(*outputs) < 0.02 and top1(*outputs) >= 0.7


def test_layer_by_layer_with_observed_inputs_equals_the_forward_pass(reference):
    model: Transformer = reference.backend.model
    hp = model.hp
    tokens = reference.tokenize(TEXT)[:24]
    positions = np.arange(len(tokens))
    seen: dict[str, tuple[int, ...]] = {}
    x = model.embed(tokens)
    for layer in range(hp.n_layer):
        x = model.block(layer, x, positions, observe=lambda name, inputs: seen.__setitem__(name, inputs.shape))
    logits = model.head(x)
    assert np.allclose(logits, model.forward(tokens, positions), atol=1e-3)
    matrices = {
        name: shape for layer in range(hp.n_layer) for name, shape in layer_tensors(hp, layer) if len(shape) == 2
    }
    assert seen == {name: (len(tokens), shape[0]) for name, shape in matrices.items()}
