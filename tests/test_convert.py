"""edgeinfer convert: tiny HF checkpoints built here, converted, and run in real llama.cpp."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QType
from tiny_hf import as_stored, write_safetensors, write_tiny_hf

from edgeinfer import Engine
from edgeinfer.converters.convert import convert
from edgeinfer.converters.plan import UNIFORM_TYPES
from edgeinfer.errors import ConversionError
from edgeinfer.models.info import load_model_info

from support import load_script

DATA = Path(__file__).parent / "data"
CALIB = DATA / "lighthouse.txt"
hf_forward = load_script("hf_forward").hf_forward
TOKENS = [5, 17, 42, 99, 3, 250, 7, 64, 128, 31, 200, 11, 90, 45, 6, 150]


def llamacpp_logits(path: Path, tokens: list[int]) -> np.ndarray:
    with Engine(path, backend="llamacpp", kv_budget="256tok", kv_type="f32", threads=2) as engine:
        return engine.logits(tokens).astype(np.float64)


def relative_error(ours: np.ndarray, truth: np.ndarray) -> float:
    return float(np.linalg.norm(ours - truth) / np.linalg.norm(truth))


@pytest.mark.parametrize(
    ("arch", "options"),
    [
        ("llama", {"tokenizer": "spm"}),
        ("mistral", {"tied": False}),
        ("qwen2", {"n_head": 4, "n_kv": 2, "hidden": 256}),  # biases, neox RoPE, GQA groups of 2
    ],
)
def test_f32_conversion_equals_hf_forward_pass(tmp_path, arch, options):
    weights = write_tiny_hf(tmp_path / "hf", arch=arch, **options)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    out = tmp_path / "model.gguf"
    report = convert(tmp_path / "hf", out, qtype="f32")
    assert report.file_bytes == out.stat().st_size
    assert load_model_info(out).hparams.arch.gguf_arch == ("qwen2" if arch == "qwen2" else "llama")
    truth = hf_forward(weights, config, TOKENS)
    ours = llamacpp_logits(out, TOKENS)
    assert relative_error(ours, truth) <= 1e-4
    assert (ours.argmax(1) == truth.argmax(1)).all()


def test_f16_checkpoints_convert_exactly_to_f32(tmp_path):
    weights = write_tiny_hf(tmp_path / "hf", dtype="f16")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    truth = hf_forward(as_stored(weights, "f16"), config, TOKENS)
    convert(tmp_path / "hf", tmp_path / "f32.gguf", qtype="f32")
    assert relative_error(llamacpp_logits(tmp_path / "f32.gguf", TOKENS), truth) <= 1e-4


def test_f16_conversion_is_close_and_bf16_shards_are_read(tmp_path):
    weights = write_tiny_hf(tmp_path / "hf", dtype="bf16", shards=3)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    truth = hf_forward(as_stored(weights, "bf16"), config, TOKENS)
    convert(tmp_path / "hf", tmp_path / "f32.gguf", qtype="f32")
    assert relative_error(llamacpp_logits(tmp_path / "f32.gguf", TOKENS), truth) <= 1e-4  # BF16 widens exactly
    convert(tmp_path / "hf", tmp_path / "f16.gguf", qtype="f16")
    assert relative_error(llamacpp_logits(tmp_path / "f16.gguf", TOKENS), truth) <= 5e-3


@pytest.fixture(scope="module")
def wide_hf(tmp_path_factory) -> Path:
    """Rows of 256, so K-quants apply to the matrices that read the hidden state."""
    folder = tmp_path_factory.mktemp("wide") / "hf"
    write_tiny_hf(folder, arch="llama", hidden=256, n_head=4, n_kv=2, ff=384, n_layer=2)
    return folder


@pytest.fixture(scope="module")
def wide_f32_logits(wide_hf, tmp_path_factory) -> np.ndarray:
    out = tmp_path_factory.mktemp("wide-f32") / "f32.gguf"
    convert(wide_hf, out, qtype="f32")
    return llamacpp_logits(out, TOKENS)


# Relative logit error each type may add on the tiny model: about twice what each measured.
TYPE_ERROR = {
    "q8_0": 0.04, "q4_0": 0.4, "q4_1": 0.35, "q5_0": 0.2, "q4_k": 0.35, "q5_k": 0.18, "q6_k": 0.09, "bf16": 0.012,
}  # fmt: skip


@pytest.mark.parametrize("qtype", list(TYPE_ERROR))
def test_quantized_outputs_load_and_generate(tmp_path, wide_hf, wide_f32_logits, qtype):
    out = tmp_path / f"{qtype}.gguf"
    report = convert(wide_hf, out, qtype=qtype)
    types = {t.name: t.type for t in load_model_info(out).tensors}
    assert types["blk.0.attn_q.weight"] == QType[qtype.upper()]
    assert types["blk.0.attn_norm.weight"] == QType.F32
    if qtype.endswith("_k"):
        # ffn_down reads 384-wide rows: not a multiple of 256, so it falls back, and says so.
        down = next(t for t in report.tensors if t.name == "blk.0.ffn_down.weight")
        assert down.requested == QType[qtype.upper()] and types[down.name] == down.qtype != down.requested
        assert f"{qtype.upper()} needs rows of 256" in report.format()
    assert relative_error(llamacpp_logits(out, TOKENS), wide_f32_logits) <= TYPE_ERROR[qtype]
    with Engine(out, backend="llamacpp", kv_budget="256tok", threads=2) as engine:
        result = engine.generate("The lighthouse", max_tokens=8, temperature=0)
    assert result.metrics.output_tokens == 8


def test_budgeted_conversion_fits_its_budget_and_spends_it(tmp_path, wide_hf):
    q8 = convert(wide_hf, tmp_path / "q8.gguf", qtype="q8_0")
    q4 = convert(wide_hf, tmp_path / "q4.gguf", qtype="q4_0")
    target = (q8.file_bytes + q4.file_bytes) // 2
    report = convert(wide_hf, tmp_path / "mix.gguf", target_size=target, calib=CALIB, sensitivity="activation")
    assert report.file_bytes == (tmp_path / "mix.gguf").stat().st_size <= target
    assert report.file_bytes > 0.99 * target  # the budget is spent, not left over
    matrices = [t for t in report.tensors if len(t.shape) == 2]
    assert len({t.qtype for t in matrices}) > 1
    assert all(t.error is not None and np.isfinite(t.error) for t in matrices)
    assert report.calib_tokens > 64
    by_bpw = convert(wide_hf, tmp_path / "bpw.gguf", target_bpw=4.0, calib=CALIB)
    assert by_bpw.bits_per_weight <= 4.0 < report.bits_per_weight
    with Engine(tmp_path / "mix.gguf", backend="llamacpp", kv_budget="256tok", threads=2) as engine:
        assert engine.generate("The lighthouse", max_tokens=4, temperature=0).metrics.output_tokens == 4


def test_a_measured_mix_beats_one_type_at_the_same_size(tmp_path, wide_hf):
    q4 = convert(wide_hf, tmp_path / "q4.gguf", qtype="q4_0", eval_text=CALIB)
    report = convert(wide_hf, tmp_path / "kld.gguf", target_size=q4.file_bytes, calib=CALIB, eval_text=CALIB)
    assert report.sensitivity == "kld" and report.file_bytes <= q4.file_bytes
    ours, theirs = report.evaluation, q4.evaluation
    assert ours is not None and ours.comparison is not None and theirs is not None and theirs.comparison is not None
    # Measured 0.143 against uniform Q4_0's 0.293 on this model.
    assert ours.comparison.kld_mean < 0.8 * theirs.comparison.kld_mean
    assert "KLD" in report.format()


def test_cli_convert_prints_a_table_and_json(tmp_path, wide_hf):
    from click.testing import CliRunner

    from edgeinfer.cli import cli

    out = tmp_path / "cli.gguf"
    result = CliRunner().invoke(cli, ["convert", str(wide_hf), "-o", str(out), "--type", "q8_0"])
    assert result.exit_code == 0, result.output
    assert "blk.1.ffn_down.weight" in result.output and "bits per weight" in result.output
    result = CliRunner().invoke(cli, ["convert", str(wide_hf), "-o", str(out), "--type", "q4_0", "--json"])
    data = json.loads(result.stdout)
    assert data["file_bytes"] == out.stat().st_size and data["type_mix"]["Q4_0"] > 0
    result = CliRunner().invoke(cli, ["convert", str(wide_hf), "-o", str(out), "--target-size", "1MB"])
    assert result.exit_code == 1 and "--calib" in result.output
    result = CliRunner().invoke(cli, ["convert", str(wide_hf), "-o", str(out), "--target-size", "lots"])
    assert result.exit_code == 1 and "'80MB'" in result.output
    type_option = next(p for p in cli.commands["convert"].params if p.name == "qtype")
    assert list(type_option.type.choices) == list(UNIFORM_TYPES)  # the CLI offers what the converter does


def test_bad_checkpoints_are_one_line_errors(tmp_path):
    hf = tmp_path / "hf"
    write_tiny_hf(hf, shards=2)
    out = tmp_path / "out.gguf"

    def error() -> str:
        with pytest.raises(ConversionError) as caught:
            convert(hf, out, qtype="f16")
        message = str(caught.value)
        assert "\n" not in message
        return message

    config = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**config, "architectures": ["GPTNeoXForCausalLM"]}))
    assert "LlamaForCausalLM" in error() and "Qwen2ForCausalLM" in error()
    (hf / "config.json").write_text(json.dumps({**config, "intermediate_size": 300}))
    assert "config.json implies" in error()
    (hf / "config.json").write_text(json.dumps(config))
    shard = hf / "model-00002-of-00002.safetensors"
    shard.rename(tmp_path / "aside")
    assert "shard model-00002-of-00002.safetensors" in error()
    (tmp_path / "aside").rename(shard)
    index = hf / "model.safetensors.index.json"
    weight_map = json.loads(index.read_text())["weight_map"]
    write_safetensors(hf / "extra.safetensors", {"model.layers.0.mlp.up_proj.scales": np.zeros(4, np.float32)})
    index.write_text(
        json.dumps({"weight_map": {**weight_map, "model.layers.0.mlp.up_proj.scales": "extra.safetensors"}})
    )
    assert "up_proj.scales" in error()
    header = b'{"x": {"dtype": "I64", "shape": [2], "data_offsets": [0, 16]}}'
    (hf / "extra.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + bytes(16))
    assert "I64" in error() and "F32, F16 and BF16" in error()
    assert not out.exists()
    with pytest.raises(ConversionError, match="no such file"):
        index.write_text(json.dumps({"weight_map": weight_map}))
        convert(hf, out, target_size=10**6, calib=tmp_path / "missing.txt")


def test_an_interrupted_conversion_leaves_the_old_file_and_no_partial(tmp_path):
    hf = tmp_path / "hf"
    write_tiny_hf(hf, hidden=512, n_head=8, n_kv=8, ff=2048, n_layer=8)  # ~100 MB of F32 to write
    out = tmp_path / "model.gguf"
    out.write_bytes(b"the previous model")
    proc = subprocess.Popen(
        [sys.executable, "-m", "edgeinfer", "convert", str(hf), "-o", str(out), "--type", "f32"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    deadline = time.monotonic() + 60
    while not list(tmp_path.glob(".model.gguf.*.partial")) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    assert proc.poll() is None, "the conversion finished before it could be interrupted"
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=60)
    assert proc.returncode != 0
    assert out.read_bytes() == b"the previous model"
    assert sorted(os.listdir(tmp_path)) == ["hf", "model.gguf"]  # no partial file, no temporary vocabulary


def test_converted_file_tokenizes_as_the_hf_tokenizer(tmp_path, wide_hf):
    from tokenizers import Tokenizer as HFTokenizer

    from edgeinfer.tokenizer import Tokenizer

    out = tmp_path / "q8.gguf"
    convert(wide_hf, out, qtype="q8_0")
    hf = HFTokenizer.from_file(str(wide_hf / "tokenizer.json"))
    ours = Tokenizer(out)
    try:
        for text in (
            "The keeper lit the lamp at 9:45, didn't she?  Twice.\n\nYes.",
            "def area(r: float) -> float:\n    return 3.14159 * r ** 2  # TODO\n",
            "Ο φάρος φωτίζει τη θάλασσα. 灯塔照亮了大海。 🚢⚓",
        ):
            assert (
                ours.encode(text, add_special=False, parse_special=False)
                == hf.encode(text, add_special_tokens=False).ids
            )
    finally:
        ours.close()
