"""The reference forward pass equals llama.cpp on every architecture, on tiny F32 models."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGUFValue, GGUFValueType
from tiny_model import write_tiny_gguf

from edgeinfer import BackendUnavailableError, Engine

from support import evaluate


@pytest.mark.parametrize(
    ("arch", "options"),
    [
        ("llama", {"tokenizer": "llama"}),
        ("mistral", {"tied": False}),
        ("qwen2", {"n_head": 4, "n_embd": 256, "n_head_kv": 2}),  # q/k/v biases, neox RoPE, GQA groups of 2
    ],
)
def test_reference_equals_llamacpp(tmp_path, arch, options):
    path = write_tiny_gguf(tmp_path / f"{arch}.gguf", arch=arch, **options)
    tokens = list(np.random.default_rng(1).integers(3, 250, size=64))
    logits = {}
    for backend in ("llamacpp", "reference"):
        with Engine(path, backend=backend, kv_budget="256tok", kv_type="f32", threads=2) as engine:
            logits[backend] = engine.logits(tokens).astype(np.float64)
            # Decoding one token at a time goes through the cache on both sides too.
            stepped = [evaluate(engine.backend, [t], i).copy() for i, t in enumerate(tokens[:8])]
            logits[backend + " decode"] = np.stack(stepped)
    ours, theirs = logits["reference"], logits["llamacpp"]
    assert np.linalg.norm(ours - theirs) / np.linalg.norm(theirs) < 1e-4
    assert (ours.argmax(axis=1) == theirs.argmax(axis=1)).all()
    ours, theirs = logits["reference decode"], logits["llamacpp decode"]
    assert np.linalg.norm(ours - theirs) / np.linalg.norm(theirs) < 1e-4


def test_rope_scaling_it_does_not_implement_is_refused_in_one_line(tmp_path):
    scaled = {"llama.rope.scaling.type": GGUFValue("linear", GGUFValueType.STRING)}
    path = write_tiny_gguf(tmp_path / "scaled.gguf", metadata=scaled)
    with pytest.raises(BackendUnavailableError, match="scales RoPE for a longer context.*use --backend auto"):
        Engine(path, backend="reference", kv_budget="64tok")
