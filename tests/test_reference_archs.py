"""The reference forward pass equals llama.cpp on every architecture, on tiny F32 models; the ONNX Runtime and
OpenCL backends equal the reference.

Each model is evaluated the same way on both backends, f32 KV cache: a prompt in one evaluation
(every token's logits), then the rest one token at a time through the cache. Measured with
llama-cpp-python 0.3.36 (AVX2, 2 threads), relative error of the logits against llama.cpp's:

    llama, mistral, qwen2, llama + rope_freqs, qwen3     2e-7 to 6e-7
    gemma3                                                3e-4 to 4e-4

Gemma 3's FFN gate is GELU, which llama.cpp's CPU backend looks up in a table of float16 values
(ggml's GGML_GELU_FP16): a rounding of up to 5e-4 per activation, which the reference (exact, as
Gemma was trained and as ggml's CUDA backend computes it) does not copy. With the table swapped in, the
reference's error falls to 5e-5 to 1.4e-4 (``test_gemma3_differs_from_llamacpp_by_its_gelu_table``),
and no lower: the last bits of the table's inputs differ between any two computations, and round to
neighbouring entries. llama.cpp's own batched and one-token paths disagree by 1e-6 to 8e-5 on these
models for the same reason (seeds 0 to 4), where its paths on the other models agree to 2e-7.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf import GGUFValue, GGUFValueType
from tiny_model import write_tiny_gguf

from edgeinfer import BackendUnavailableError, Engine, InvalidModelError
from edgeinfer.backends import backend_class
from edgeinfer.backends.base import BackendOptions, Span
from edgeinfer.models.info import load_model_info
from edgeinfer.models.reference import Transformer, gguf_weights

from support import evaluate

WINDOW = 16  # the tiny Gemma 3's sliding window: well inside the 64 tokens
MODELS: dict[str, dict] = {
    "llama": {"arch": "llama", "tokenizer": "llama"},
    "mistral": {"arch": "mistral", "tied": False},
    "qwen2": {"arch": "qwen2", "n_head": 4, "n_embd": 256, "n_head_kv": 2},  # q/k/v biases, neox RoPE, GQA groups of 2
    "llama-rope_freqs": {"arch": "llama", "rope_freqs": True},  # Llama 3.1's RoPE frequency factors
    # Per-head Q/K norms, and a head size that is not n_embd / n_head.
    "qwen3": {"arch": "qwen3", "n_head": 4, "n_head_kv": 2, "head_dim": 48},
    # llama.cpp's built-in pattern: five sliding-window layers (RoPE base 10000), then a global one (1e6).
    "gemma3": {"arch": "gemma3", "n_layer": 6, "n_head": 4, "head_dim": 64, "sliding_window": WINDOW},
    # The pattern, the local RoPE base and capped logits as metadata keys.
    "gemma3-keys": {
        "arch": "gemma3",
        "n_layer": 3,
        "head_dim": 64,
        "sliding_window": WINDOW,
        "swa_layers": (True, False, True),
        "rope_base_swa": 500.0,
        "logit_softcap": 3.0,
        "tokenizer": "llama",
    },
}
TOKENS = [int(t) for t in np.random.default_rng(1).integers(3, 250, size=64)]
N_PROMPT = 40  # evaluated at once; the other 24 one at a time
TOLERANCE = 1e-5  # relative error of the logits
GEMMA3_TOLERANCE = 1e-3  # llama.cpp's float16 GELU table, see the docstring


def relative_error(ours: np.ndarray, theirs: np.ndarray) -> float:
    return float(np.linalg.norm(ours - theirs) / np.linalg.norm(theirs))


def prompt_then_decode(path: Path, backend: str) -> np.ndarray:
    """Logits of every token of TOKENS: the first N_PROMPT in one evaluation, then one at a time."""
    with Engine(path, backend=backend, kv_budget="256tok", kv_type="f32", threads=2) as engine:
        rows = [evaluate(engine.backend, TOKENS[:N_PROMPT], 0, all_logits=True).copy()]
        rows += [evaluate(engine.backend, [t], i)[None].copy() for i, t in enumerate(TOKENS[N_PROMPT:], N_PROMPT)]
    return np.concatenate(rows).astype(np.float64)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("archs")
    return {name: write_tiny_gguf(folder / f"{name}.gguf", **options) for name, options in MODELS.items()}


@pytest.fixture(scope="module")
def llamacpp(files: dict[str, Path]) -> Callable[[str], np.ndarray]:
    """llama.cpp's prompt-then-decode logits for TOKENS, by model, computed once when first asked for."""

    @functools.cache
    def logits(model: str) -> np.ndarray:
        return prompt_then_decode(files[model], "llamacpp")

    return logits


def tolerance(model: str) -> float:
    return GEMMA3_TOLERANCE if MODELS[model]["arch"] == "gemma3" else TOLERANCE


@pytest.mark.parametrize("model", list(MODELS))
def test_reference_equals_llamacpp(files, llamacpp, model):
    ours, theirs = prompt_then_decode(files[model], "reference"), llamacpp(model)
    prompt, decoded = slice(0, N_PROMPT), slice(N_PROMPT, None)
    assert relative_error(ours[prompt], theirs[prompt]) < tolerance(model)
    assert relative_error(ours[decoded], theirs[decoded]) < tolerance(model)
    assert (ours.argmax(axis=1) == theirs.argmax(axis=1)).all()


@functools.cache
def reference(path: Path) -> np.ndarray:
    return prompt_then_decode(path, "reference")


@pytest.mark.parametrize("backend", ["onnxruntime", "opencl"])
@pytest.mark.parametrize("model", list(MODELS))
def test_the_other_backends_compute_every_architecture_as_the_reference_does(files, model, backend):
    """Issues 17 and 18: every architecture of the reference, on backends that build it from parts of their own
    (a graph of ONNX Runtime's operators; OpenCL kernels). Measured on PoCL and ONNX Runtime 1.32: relative
    error 3.5e-7 to 5.5e-7, Gemma 3 8e-7 to 1.1e-6."""
    try:
        backend_class(backend)
    except BackendUnavailableError as exc:
        pytest.skip(f"the {backend} backend cannot run here: {exc}")
    ours, truth = prompt_then_decode(files[model], backend), reference(files[model])
    assert relative_error(ours, truth) < TOLERANCE
    assert (ours.argmax(axis=1) == truth.argmax(axis=1)).all()


def reference_without_cache(
    path: Path, tokens: list[int] = TOKENS, activation: Callable[[np.ndarray], np.ndarray] | None = None, **changes: Any
) -> np.ndarray:
    """The reference's logits for ``tokens`` in one pass without a KV cache, its hyper-parameters changed
    as given, and its FFN activation if given."""
    info = load_model_info(path)
    model = Transformer(replace(info.hparams, **changes), gguf_weights(info))
    if activation is not None:
        model.activation = activation
    return model.forward(tokens, np.arange(len(tokens))).astype(np.float64)


@pytest.mark.parametrize(
    ("model", "changes"),
    [
        ("gemma3", {"sliding_window": len(TOKENS)}),  # a window as long as the text: none at all
        ("gemma3", {"rope_base_swa": 1e6}),  # the local layers rotating with the global base
        ("llama-rope_freqs", {"rope_freqs": False}),
    ],
)
def test_what_an_architecture_adds_matters(files, llamacpp, model, changes):
    # Without the change, the same cache-less pass agrees as closely as test_reference_equals_llamacpp
    # says; with it (measured: 0.94, 0.50 and 0.014), far beyond any tolerance above.
    assert relative_error(reference_without_cache(files[model]), llamacpp(model)) < tolerance(model)
    assert relative_error(reference_without_cache(files[model], **changes), llamacpp(model)) > 10 * GEMMA3_TOLERANCE


def gelu_float16_table(x: np.ndarray) -> np.ndarray:
    """GELU as ggml's CPU backend computes it (GGML_GELU_FP16): the input rounded to float16 indexes
    a table of the tanh approximation rounded to float16, outside (-10, 10) 0 or the input itself."""
    table_x = np.arange(1 << 16, dtype=np.uint16).view(np.float16).astype(np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        table = (0.5 * table_x * (1 + np.tanh(np.float32(0.7978846) * table_x * (1 + 0.044715 * table_x**2)))).astype(
            np.float16
        )
    looked_up = table[x.astype(np.float16).view(np.uint16)].astype(np.float32)
    return np.where(x <= -10, 0, np.where(x >= 10, x, looked_up)).astype(np.float32)


@pytest.mark.parametrize("model", ["gemma3", "gemma3-keys"])
def test_gemma3_differs_from_llamacpp_by_its_gelu_table(files, llamacpp, model):
    exact = relative_error(reference_without_cache(files[model]), llamacpp(model))
    table = relative_error(reference_without_cache(files[model], activation=gelu_float16_table), llamacpp(model))
    # Measured over seeds 0 to 4: the table leaves 16% to 35% of the exact GELU's error.
    assert table < exact / 2


def test_sliding_windows_hold_per_sequence(files):
    """Two sequences evaluated together, each past the window, see only their own keys within it."""
    texts = [TOKENS, [int(t) for t in np.random.default_rng(2).integers(3, 250, size=56)]]
    options = BackendOptions(kv_tokens=256, kv_type="f32", n_seq=2, batch_size=128)
    backend = backend_class("reference")(load_model_info(files["gemma3"]), options)
    try:  # sequence 0 in calls of 40 and 24 tokens, sequence 1 of 20 and 36
        first = backend.eval([Span(0, 0, texts[0][:40], all_logits=True), Span(1, 0, texts[1][:20], all_logits=True)])
        rest = backend.eval([Span(0, 40, texts[0][40:], all_logits=True), Span(1, 20, texts[1][20:], all_logits=True)])
    finally:
        backend.close()
    for seq, tokens in enumerate(texts):
        together = np.concatenate([first[seq], rest[seq]]).astype(np.float64)
        assert relative_error(together, reference_without_cache(files["gemma3"], tokens)) < TOLERANCE


def test_a_sliding_window_pattern_that_does_not_fit_the_layers_is_refused_in_one_line(tmp_path):
    pattern = {"gemma3.attention.sliding_window_pattern": GGUFValue([True, False, True], GGUFValueType.ARRAY)}
    path = write_tiny_gguf(tmp_path / "pattern.gguf", arch="gemma3", sliding_window=WINDOW, metadata=pattern)
    with pytest.raises(InvalidModelError, match="sliding_window_pattern' must hold one flag for each of the 2 layers"):
        load_model_info(path)


def test_rope_scaling_it_does_not_implement_is_refused_in_one_line(tmp_path):
    scaled = {"llama.rope.scaling.type": GGUFValue("linear", GGUFValueType.STRING)}
    path = write_tiny_gguf(tmp_path / "scaled.gguf", metadata=scaled)
    with pytest.raises(BackendUnavailableError, match="scales RoPE for a longer context.*use --backend auto"):
        Engine(path, backend="reference", kv_budget="64tok")
