"""edgeinfer convert on Llama 3.1+ (RoPE scaling "llama3"), Qwen3 and Gemma 3: tiny HF checkpoints built
here, converted, run in real llama.cpp and compared with the float64 forward pass in HF's layout
(scripts/hf_forward.py, which shares no code with the converter or the reference)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from tiny_hf import LLAMA3_SCALING, write_tiny_hf

from edgeinfer import Engine
from edgeinfer.converters.checkpoint import Checkpoint
from edgeinfer.converters.convert import convert
from edgeinfer.errors import ConversionError
from edgeinfer.models.arch import HParams
from edgeinfer.models.info import load_model_info
from edgeinfer.models.reference import Transformer

from support import load_script

CALIB = Path(__file__).parent / "data" / "lighthouse.txt"
hf_forward = load_script("hf_forward")
# Long enough to pass Gemma's 5-token window many times over and to rotate Llama 3's slowed pairs.
TOKENS = [int(t) for t in np.random.default_rng(3).integers(3, 250, size=48)]

CASES = {
    # Tied embeddings, a byte-level BPE vocabulary, transformers 4's rope_scaling.
    "llama3": {"arch": "llama", "rope_scaling": LLAMA3_SCALING},
    # Its own output matrix, transformers 5's rope_parameters, GQA groups of 2.
    "llama3-v5": {"arch": "llama", "rope_scaling": LLAMA3_SCALING, "style": 5, "tied": False, "n_head": 4, "n_kv": 2},
    # Q/K norms, a head size of its own (4 x 64 = 256 query features from 128).
    "qwen3": {"arch": "qwen3", "n_head": 4, "n_kv": 2, "head_dim": 64},
    "qwen3-v5": {"arch": "qwen3", "n_head": 4, "n_kv": 2, "head_dim": 64, "style": 5},
    # Norms of 1 + w, post-norms, GELU, a scaled embedding, sliding layers with their own RoPE base, laid
    # out as in every Gemma 3 (five sliding, then one global: llama.cpp's built-in pattern, not written).
    "gemma3": {"arch": "gemma3", "n_head": 4, "n_kv": 2, "head_dim": 64, "tokenizer": "spm", "n_layer": 6},
    # Sliding and global layers alternating (a pattern the file states), capped logits.
    "gemma3-v5": {"arch": "gemma3", "n_head": 4, "n_kv": 2, "head_dim": 64, "tokenizer": "spm", "style": 5},
}
# Changes to config.json after writing, where a case needs one tiny_hf does not make.
CONFIG_CHANGES: dict[str, dict[str, Any]] = {
    "gemma3": {"sliding_window_pattern": 6},
    "gemma3-v5": {"final_logit_softcapping": 5.0},
}


def write_case(folder: Path, case: str) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """The case's checkpoint in ``folder``: its float32 weights by HF name, and its config."""
    weights = write_tiny_hf(folder, **CASES[case])
    return weights, change_config(folder, **CONFIG_CHANGES.get(case, {}))


def change_config(folder: Path, **changes: Any) -> dict[str, Any]:
    config = {**json.loads((folder / "config.json").read_text()), **changes}
    (folder / "config.json").write_text(json.dumps(config))
    return config


def logits(path: Path, tokens: list[int], backend: str) -> np.ndarray:
    with Engine(path, backend=backend, kv_budget="256tok", kv_type="f32", threads=2) as engine:
        return engine.logits(tokens).astype(np.float64)


def meaning(hp: HParams) -> dict[str, Any]:
    """What the hyper-parameters make the model compute, with the RMS epsilon as a GGUF stores it
    (32 bits). A V head size equal to K's is the same whether stated (the loader) or not (the converter)."""
    fields = {f.name: getattr(hp, f.name) for f in dataclasses.fields(hp)}
    fields["rms_eps"] = float(np.float32(hp.rms_eps))
    fields["value_dim"] = hp.value_dim or hp.head_dim
    return fields


@pytest.mark.parametrize("case", list(CASES))
def test_f32_conversion_equals_hf_forward_pass(tmp_path, case):
    weights, config = write_case(tmp_path / "hf", case)
    out = tmp_path / "model.gguf"
    convert(tmp_path / "hf", out, qtype="f32")
    # What the converter understood config.json to mean is what the loader reads from the file.
    assert meaning(load_model_info(out).hparams) == meaning(Checkpoint(tmp_path / "hf").hparams)
    exact = hf_forward.hf_forward(weights, config, TOKENS)
    # The file holds the checkpoint's model: run by the reference backend, which computes GELU exactly.
    assert hf_forward.relative_error(logits(out, TOKENS, "reference"), exact) <= 1e-4
    ours = logits(out, TOKENS, "llamacpp")
    # llama.cpp's CPU GELU rounds to float16 (a lookup table, ggml-cpu/vec.h defines GGML_GELU_FP16
    # unconditionally): the Gemma cases measured 2.7e-4 and 1.7e-4 off the exact GELU, 3.9e-5 and 3.8e-6 off
    # the same rounding (what is left: inputs whose float32 and float64 values round to different float16s).
    # The other cases are within float32 rounding (4e-7).
    truth = hf_forward.hf_forward(weights, config, TOKENS, f16_gelu=True)
    assert hf_forward.relative_error(ours, truth) <= 1e-4
    assert (ours.argmax(1) == truth.argmax(1)).all()
    assert hf_forward.relative_error(ours, exact) <= 1e-3


def test_the_features_the_comparison_rests_on_change_the_logits(tmp_path):
    """The F32 comparisons above would catch a converter that dropped Llama 3's RoPE scaling or
    Gemma 3's sliding window: each moves the HF logits by far more than the tolerance."""
    weights, config = write_case(tmp_path / "llama3", "llama3")
    scaled = hf_forward.hf_forward(weights, config, TOKENS)
    assert (
        hf_forward.relative_error(hf_forward.hf_forward(weights, {**config, "rope_scaling": None}, TOKENS), scaled)
        > 0.1
    )
    weights, config = write_case(tmp_path / "gemma3", "gemma3")
    windowed = hf_forward.hf_forward(weights, config, TOKENS)
    every_layer_global = {**config, "sliding_window_pattern": 1}
    assert hf_forward.relative_error(hf_forward.hf_forward(weights, every_layer_global, TOKENS), windowed) > 0.1
    local_base_as_global = {**config, "rope_local_base_freq": config["rope_theta"]}
    assert hf_forward.relative_error(hf_forward.hf_forward(weights, local_base_as_global, TOKENS), windowed) > 0.01


@pytest.mark.parametrize("case", ["llama3", "qwen3", "gemma3-v5"])
def test_calibration_runs_the_checkpoint_as_hf_does(tmp_path, case):
    """Calibration measures what each tensor's error does to the output with the reference transformer
    over the converter's view of the checkpoint (GGUF layout, Gemma's norms shifted, rope_freqs made)."""
    weights, config = write_case(tmp_path / "hf", case)
    ckpt = Checkpoint(tmp_path / "hf")
    ours = Transformer(ckpt.hparams, ckpt.weight).forward(TOKENS, np.arange(len(TOKENS))).astype(np.float64)
    assert hf_forward.relative_error(ours, hf_forward.hf_forward(weights, config, TOKENS)) <= 1e-4


def test_a_budgeted_gemma3_conversion_measures_its_mix(tmp_path):
    hf = tmp_path / "hf"
    # Rows of 256 and 512, so K-quants apply to every matrix.
    write_tiny_hf(hf, arch="gemma3", tokenizer="spm", hidden=256, n_head=4, n_kv=2, head_dim=64, ff=512)
    f32 = convert(hf, tmp_path / "f32.gguf", qtype="f32")
    q8 = convert(hf, tmp_path / "q8.gguf", qtype="q8_0")
    q4 = convert(hf, tmp_path / "q4.gguf", qtype="q4_0")
    target = (q8.file_bytes + q4.file_bytes) // 2
    report = convert(hf, tmp_path / "mix.gguf", target_size=target, calib=CALIB)
    assert report.sensitivity == "kld" and report.calib_tokens > 64
    assert report.file_bytes == (tmp_path / "mix.gguf").stat().st_size <= target
    assert report.file_bytes > 0.99 * target  # the budget is spent, not left over
    matrices = [t for t in report.tensors if len(t.shape) == 2]
    assert len({t.qtype for t in matrices}) > 1
    assert all(t.error is not None and np.isfinite(t.error) for t in matrices)
    exact = logits(Path(f32.output), TOKENS, "llamacpp")
    mixed = hf_forward.relative_error(logits(tmp_path / "mix.gguf", TOKENS, "llamacpp"), exact)
    assert mixed < hf_forward.relative_error(logits(tmp_path / "q4.gguf", TOKENS, "llamacpp"), exact)
    with Engine(tmp_path / "mix.gguf", backend="llamacpp", kv_budget="256tok", threads=2) as engine:
        assert engine.generate("The lighthouse", max_tokens=4, temperature=0).metrics.output_tokens == 4


LLAMA3_WITHOUT = {k: v for k, v in LLAMA3_SCALING.items() if k != "low_freq_factor"}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}


@pytest.mark.parametrize(
    ("case", "changes", "expected"),
    [
        ("llama3", {"rope_scaling": YARN}, "RoPE scaling 'yarn' ('rope_scaling') is not supported"),
        (
            "llama3-v5",
            {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}},
            "RoPE scaling 'dynamic' ('rope_parameters') is not supported",
        ),
        ("qwen3", {"rope_scaling": LLAMA3_SCALING}, "RoPE scaling 'llama3' ('rope_scaling') is not supported"),
        ("qwen3-v5", {"rope_scaling": YARN}, "'rope_scaling' ('yarn') and 'rope_parameters' ('default') say different"),
        ("llama3-v5", {"rope_scaling": {**LLAMA3_SCALING, "factor": 2.0}}, "say different things"),
        ("llama3", {"rope_scaling": LLAMA3_WITHOUT}, "'rope_scaling.low_freq_factor' is None"),
        ("llama3", {"num_local_experts": 8, "num_experts_per_tok": 2}, "'num_local_experts' = 8 is not supported"),
        ("qwen3", {"num_experts": 4, "moe_intermediate_size": 64}, "'num_experts' = 4 is not supported"),
        ("qwen3", {"use_sliding_window": True}, "'use_sliding_window' = True is not supported"),
        ("qwen3", {"layer_types": ["sliding_attention", "full_attention"]}, "'layer_types' must name one of"),
        ("llama3", {"partial_rotary_factor": 0.5}, "'partial_rotary_factor' = 0.5 is not supported"),
        ("llama3", {"final_logit_softcapping": 30.0}, "'final_logit_softcapping' = 30.0 is not supported"),
        ("gemma3", {"attn_logit_softcapping": 50.0}, "'attn_logit_softcapping' = 50.0 is not supported"),
        ("gemma3", {"query_pre_attn_scalar": 128}, "'query_pre_attn_scalar' = 128 is not supported"),
        ("gemma3", {"hidden_activation": "gelu"}, "'hidden_activation' = 'gelu' is not supported"),
        ("gemma3", {"rope_scaling": {"rope_type": "linear", "factor": 8.0}}, "RoPE scaling 'linear'"),
        (
            "gemma3",
            {"architectures": ["Gemma3ForConditionalGeneration"]},
            "Gemma3ForConditionalGeneration is a multimodal checkpoint",
        ),
    ],
)
def test_unsupported_config_fields_are_one_line_naming_the_field(tmp_path, case, changes, expected):
    hf = tmp_path / "hf"
    write_case(hf, case)
    change_config(hf, **changes)
    out = tmp_path / "out.gguf"
    with pytest.raises(ConversionError) as caught:
        convert(hf, out, qtype="f16")
    message = str(caught.value)
    assert "\n" not in message and expected in message
    assert not out.exists()


def test_the_cli_says_what_is_supported_in_one_line(tmp_path):
    from click.testing import CliRunner

    from edgeinfer.cli import cli

    hf = tmp_path / "hf"
    write_case(hf, "qwen3")
    change_config(hf, rope_scaling=YARN)
    result = CliRunner().invoke(cli, ["convert", str(hf), "-o", str(tmp_path / "out.gguf")])
    assert result.exit_code == 1 and "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]  # after any progress lines
    assert errors == [
        f"error: {hf / 'config.json'}: RoPE scaling 'yarn' ('rope_scaling') is not supported; "
        "the converter reads models without RoPE scaling for qwen3"
    ]
    assert result.stderr.strip().endswith(errors[0])
