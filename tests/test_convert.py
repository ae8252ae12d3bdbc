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
from edgeinfer.converters.type_speed import RUNS
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
    # By error alone: which types are slow depends on the machine's kernels, and the budget is spent.
    report = convert(
        wide_hf, tmp_path / "mix.gguf", target_size=target, calib=CALIB, sensitivity="activation", speed_aware=False
    )
    assert report.file_bytes == (tmp_path / "mix.gguf").stat().st_size <= target
    assert report.file_bytes > 0.99 * target  # the budget is spent, not left over
    matrices = [t for t in report.tensors if len(t.shape) == 2]
    assert len({t.qtype for t in matrices}) > 1
    assert all(t.error is not None and np.isfinite(t.error) for t in matrices)
    assert report.calib_tokens > 64
    assert report.type_speeds is None and report.speed_trade is None and "probe" not in report.format()
    by_bpw = convert(wide_hf, tmp_path / "bpw.gguf", target_bpw=4.0, calib=CALIB)  # speed-aware, the default
    assert by_bpw.bits_per_weight <= 4.0 < report.bits_per_weight
    # The kernels were timed, and what the plan did with the figures is reported.
    trade = by_bpw.speed_trade
    assert by_bpw.type_speeds and trade is not None and trade.error_ratio <= 1.25 and trade.speedup > 0
    text = by_bpw.format()
    assert "llama.cpp here, on a probe of this width" in text and "Q4_0" in text.split("llama.cpp here")[1]
    with Engine(tmp_path / "mix.gguf", backend="llamacpp", kv_budget="256tok", threads=2) as engine:
        assert engine.generate("The lighthouse", max_tokens=4, temperature=0).metrics.output_tokens == 4


def test_a_budget_no_mix_fits_is_refused_before_calibrating(tmp_path, wide_hf):
    steps = []
    with pytest.raises(ConversionError, match=r"the smallest mix of types needs .* raise --target-size") as caught:
        convert(wide_hf, tmp_path / "tiny.gguf", target_bpw=1.0, calib=CALIB, progress=steps.append)
    assert "\n" not in str(caught.value) and not (tmp_path / "tiny.gguf").exists()
    assert not {step.stage for step in steps} & {"calibrating", "probing", "measuring"}


def test_a_held_out_text_too_short_to_measure_is_refused_before_converting(tmp_path, wide_hf):
    short = tmp_path / "short.txt"
    short.write_text("The lighthouse keeper wrote in his log every evening.")
    out = tmp_path / "q8.gguf"
    with pytest.raises(ConversionError) as caught:
        convert(wide_hf, out, qtype="q8_0", eval_text=short)
    message = str(caught.value)
    assert message.startswith("the --eval text has") and "--ctx" not in message and "\n" not in message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["short.txt"]


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
    result = CliRunner().invoke(cli, ["convert", str(wide_hf), "-o", str(out), "--target-size", "512tok"])
    assert result.exit_code == 1 and "--target-size '512tok' counts tokens, not bytes" in result.stderr
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


@pytest.fixture(scope="module")
def big_hf(tmp_path_factory) -> Path:
    """~100 MB of F32: seconds of work to quantize to Q4_K, time to interrupt a conversion mid-way."""
    folder = tmp_path_factory.mktemp("big") / "hf"
    write_tiny_hf(folder, hidden=512, n_head=8, n_kv=8, ff=2048, n_layer=8)
    return folder


def start_conversion(hf: Path, out: Path, *options: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "edgeinfer", "convert", str(hf), "-o", str(out), *options],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # A test runner started under nohup passes SIGHUP on ignored; the conversion must see the default.
        preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_DFL),
    )


def wait_for(proc: subprocess.Popen, folder: Path, pattern: str) -> None:
    """Return once a file matching ``pattern`` is in ``folder``: the conversion is at that step."""
    deadline = time.monotonic() + 120
    while not list(folder.glob(pattern)) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    assert proc.poll() is None and list(folder.glob(pattern)), "the conversion never reached that step"


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=lambda signum: signum.name)
def test_an_interrupted_conversion_leaves_the_old_file_and_no_partial(tmp_path, big_hf, signum):
    out = tmp_path / "model.gguf"
    out.write_bytes(b"the previous model")
    proc = start_conversion(big_hf, out, "--type", "q4_k")
    wait_for(proc, tmp_path, ".model.gguf.*.partial")
    proc.send_signal(signum)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signum and "Traceback" not in stderr
    if signum != signal.SIGINT:  # Ctrl-C's own line is the terminal's ^C
        assert stderr.splitlines()[-1] == f"error: interrupted by {signum.name}"
    assert out.read_bytes() == b"the previous model"
    assert os.listdir(tmp_path) == ["model.gguf"]  # no partial file, no temporary vocabulary


def test_a_hangup_during_the_evaluation_removes_the_unquantized_copy(tmp_path, big_hf):
    out = tmp_path / "model.gguf"
    proc = start_conversion(big_hf, out, "--type", "q8_0", "--eval", str(CALIB))
    wait_for(proc, tmp_path, ".*base-*/*.partial")  # writing the F32 model to compare with
    proc.send_signal(signal.SIGHUP)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGHUP and stderr.splitlines()[-1] == "error: interrupted by SIGHUP"
    assert os.listdir(tmp_path) == ["model.gguf"]  # written before the evaluation began; the copy is gone


def test_the_next_conversion_removes_what_a_killed_one_left(tmp_path, big_hf):
    out = tmp_path / "model.gguf"
    proc = start_conversion(big_hf, out, "--type", "q4_k")
    wait_for(proc, tmp_path, ".model.gguf.*.partial")
    proc.kill()  # SIGKILL cannot be caught: the partial file stays
    proc.wait()
    (partial,) = tmp_path.glob(".model.gguf.*.partial")
    dead_folder = tmp_path / f".model.gguf.{proc.pid}.base-x1y2"
    dead_folder.mkdir()
    (dead_folder / "base-f32.gguf").write_bytes(b"an unquantized copy")
    running = tmp_path / f".model.gguf.{os.getppid()}.partial"  # a live process's: still being written
    running.write_bytes(b"in progress")
    notes: list[str] = []
    convert(big_hf, out, qtype="f32", log=notes.append)
    assert sorted(os.listdir(tmp_path)) == sorted(["model.gguf", running.name])
    assert f"note: removed {partial.name}, left by a conversion that was killed" in notes


def test_an_output_that_is_an_input_is_refused_before_any_work(tmp_path):
    from click.testing import CliRunner

    from edgeinfer.cli import cli

    hf = tmp_path / "hf"
    write_tiny_hf(hf, shards=2)
    text = tmp_path / "calib.txt"
    text.write_text(CALIB.read_text())
    (tmp_path / "shard-link.gguf").symlink_to(hf / "model-00001-of-00002.safetensors")
    os.link(hf / "tokenizer.json", tmp_path / "tokenizer-link.gguf")
    budget = ["--target-size", "1MB", "--sensitivity", "activation"]
    cases = {
        hf / "config.json": [],
        hf / "model-00002-of-00002.safetensors": [],
        hf / "model.safetensors.index.json": [],
        tmp_path / "shard-link.gguf": [],
        tmp_path / "tokenizer-link.gguf": [],
        text: [*budget, "--calib", str(text)],
        tmp_path / "held-out.gguf": ["--eval", str(tmp_path / "held-out.gguf")],
    }
    (tmp_path / "held-out.gguf").write_text(CALIB.read_text())
    before = {path: path.read_bytes() for path in cases}
    for output, options in cases.items():
        result = CliRunner().invoke(cli, ["convert", str(hf), "-o", str(output), *options])
        assert result.exit_code == 1, (output, result.output)
        assert result.stderr.count("\n") == 1 and "an input of this conversion" in result.stderr  # nothing ran
    assert {path: path.read_bytes() for path in cases} == before
    assert (tmp_path / "shard-link.gguf").is_symlink()
    convert(hf, hf / "model.gguf", qtype="q8_0")
    convert(hf, hf / "model.gguf", qtype="q4_0")  # a GGUF in the folder is an earlier output, not an input


def test_an_output_that_is_not_a_regular_file_is_left_alone(tmp_path):
    from click.testing import CliRunner

    from edgeinfer.cli import cli

    write_tiny_hf(tmp_path / "hf")
    fifo = tmp_path / "pipe.gguf"
    os.mkfifo(fifo)
    result = CliRunner().invoke(cli, ["convert", str(tmp_path / "hf"), "-o", str(fifo)])
    assert result.exit_code == 1 and result.stderr.count("\n") == 1
    assert result.stderr.startswith(f"error: {fifo} exists and is not a regular file")
    assert fifo.is_fifo()


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


def cli_error(*args: str) -> str:
    """The line ``edgeinfer convert ARGS`` ends with when it refuses: exit 1, no traceback."""
    from click.testing import CliRunner

    from edgeinfer.cli import cli

    result = CliRunner().invoke(cli, ["convert", *args])
    assert result.exit_code == 1, result.output
    last = result.stderr.splitlines()[-1]
    assert last.startswith("error: ") and "internal error" not in last and "Traceback" not in result.stderr
    return last


def test_unwritable_and_empty_outputs_are_one_true_line(tmp_path):
    hf = tmp_path / "hf"
    write_tiny_hf(hf)
    # sysfs refuses new files even to root, whom a chmod-ed folder would not stop: it stands in
    # for any folder this process cannot create files in.
    if not Path("/sys").is_dir():
        pytest.skip("needs /sys")
    assert "cannot create files in /sys (Permission denied)" in cli_error(str(hf), "-o", "/sys/model.gguf")
    assert "the output path is empty" in cli_error(str(hf), "-o", "")
    assert sorted(os.listdir(tmp_path)) == ["hf"]


def test_non_finite_weights_are_refused_by_name(tmp_path):
    hf = tmp_path / "hf"
    weights = write_tiny_hf(hf)
    weights["model.layers.1.mlp.up_proj.weight"][3, 5] = np.nan
    weights["model.layers.0.self_attn.k_proj.weight"][0, 1] = np.inf
    write_safetensors(hf / "model.safetensors", weights)
    message = cli_error(str(hf), "-o", str(tmp_path / "out.gguf"), "--type", "q8_0")
    assert "'model.layers.0.self_attn.k_proj.weight' holds NaN or infinite values" in message
    weights["model.layers.0.self_attn.k_proj.weight"][0, 1] = 0.0
    write_safetensors(hf / "model.safetensors", weights)
    message = cli_error(str(hf), "-o", str(tmp_path / "out.gguf"), "--target-bpw", "5", "--calib", str(CALIB))
    assert "'model.layers.1.mlp.up_proj.weight' holds NaN or infinite values" in message
    assert not (tmp_path / "out.gguf").exists()


def test_float_hyperparameters_the_loader_would_refuse_are_refused_by_name(tmp_path):
    hf = tmp_path / "hf"
    write_tiny_hf(hf)
    config = json.loads((hf / "config.json").read_text())
    for key, value in [
        ("rope_theta", float("nan")),
        ("rope_theta", float("inf")),
        ("rope_theta", -10000.0),
        ("rope_theta", 0.5),  # frequencies past float range: NaN logits
        ("rms_norm_eps", float("nan")),
        ("rms_norm_eps", float("-inf")),
        ("rms_norm_eps", 1e-12),  # stored in 32 bits, it falls just under the loader's minimum
        ("rms_norm_eps", 2.0),
    ]:
        (hf / "config.json").write_text(json.dumps({**config, key: value}))
        assert f"'{key}' is {value!r}; it must be a number from" in cli_error(str(hf), "-o", str(tmp_path / "m.gguf"))
    assert not (tmp_path / "m.gguf").exists()
    (hf / "config.json").write_text(json.dumps({**config, "rope_theta": 1e6, "rms_norm_eps": 1.0001e-12}))
    convert(hf, tmp_path / "m.gguf", qtype="f16")
    hparams = load_model_info(tmp_path / "m.gguf").hparams  # what the converter accepts, the loader does
    assert hparams.rope_base == 1e6 and hparams.rms_eps == pytest.approx(1.0001e-12, rel=1e-6)


# Variables by which rich is told, whatever the stream is, that it is or is not a terminal.
RICH_TERMINAL_OVERRIDES = ("FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE")


def test_cli_convert_reports_its_stages_in_plain_lines_off_a_terminal(tmp_path, wide_hf, monkeypatch):
    from click.testing import CliRunner

    from edgeinfer.cli import _ConversionProgress, cli

    monkeypatch.setattr(_ConversionProgress, "PLAIN_EVERY_S", 0.0)  # a line for every step, not one a half-minute
    for name in RICH_TERMINAL_OVERRIDES:
        monkeypatch.delenv(name, raising=False)
    out = tmp_path / "mix.gguf"
    args = ["convert", str(wide_hf), "-o", str(out), "--target-bpw", "5", "--calib", str(CALIB), "--json"]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["file_bytes"] == out.stat().st_size  # stdout holds the report alone
    assert "\r" not in result.stderr and "\x1b" not in result.stderr  # no cursor movement, no colour: a log
    lines = result.stderr.splitlines()
    stages = [line.split(":")[0] for line in lines]
    assert list(dict.fromkeys(stages)) == ["reading", "calibrating", "probing", "timing", "measuring", "writing"]
    n_matrices = 1 + 2 * 7  # the tied embedding and two layers of seven
    report = json.loads(result.stdout)
    n_types = len(report["type_speeds"])  # the types rows of 256 and of 384 allow
    assert n_types >= 10 and report["speed_trade"] is not None
    for stage, unit, total in [
        ("calibrating", "layer", 2),
        ("probing", "layer", 3),  # the head counts as one more
        ("timing", "run", n_types * RUNS),  # each type timed RUNS times, in turn
        ("measuring", "tensor", n_matrices),
        ("writing", "tensor", n_matrices + 1 + 2 * 2),  # and the norms
    ]:
        assert f"{stage}: {unit} 0 of {total}" in lines
        assert any(line.startswith(f"{stage}: {unit} {total} of {total}, done in ") for line in lines)
    between = [line for line in lines if line.startswith("measuring: tensor 7 of")]
    assert between and between[0].endswith(" left") and " so far, about " in between[0]


def test_cli_convert_draws_progress_bars_on_a_terminal(tmp_path, wide_hf):
    import pty

    out = tmp_path / "mix.gguf"
    terminal, its_end = pty.openpty()
    child = subprocess.Popen(
        [sys.executable, "-m", "edgeinfer", "convert", str(wide_hf), "-o", str(out), "--target-bpw", "5"]
        + ["--calib", str(CALIB), "--sensitivity", "activation", "--json"],
        stdout=subprocess.PIPE,
        stderr=its_end,
        env={**{k: v for k, v in os.environ.items() if k not in RICH_TERMINAL_OVERRIDES}, "TERM": "xterm-256color"},
    )
    os.close(its_end)
    drawn = b""
    while True:
        try:
            chunk = os.read(terminal, 1 << 16)
        except OSError:  # EIO: the child has closed its end
            break
        if not chunk:
            break
        drawn += chunk
    stdout, _ = child.communicate(timeout=120)
    os.close(terminal)
    assert child.returncode == 0, drawn.decode(errors="replace")
    assert json.loads(stdout)["file_bytes"] == out.stat().st_size
    screen = drawn.decode(errors="replace")
    assert "\x1b[" in screen  # redrawn in place
    for stage in ("reading", "calibrating", "measuring", "writing"):
        assert stage in screen
    assert "probing" not in screen  # --sensitivity activation measures no divergence
    assert "left" in screen and "tensor 20 of 20" in screen  # the count of each bar, and the time left


def test_vocabulary_matrices_are_read_in_blocks_and_written_the_same(tmp_path, monkeypatch):
    from edgeinfer.converters import rows
    from edgeinfer.converters.checkpoint import Checkpoint

    hf = tmp_path / "hf"
    write_tiny_hf(hf, dtype="bf16", tied=False)
    convert(hf, tmp_path / "whole.gguf", qtype="q4_0")  # each matrix of this model fits in one block
    ckpt = Checkpoint(hf)
    monkeypatch.setattr(rows, "BLOCK_BYTES", 3 * 4 * 128)  # three rows of 128 float32
    for name in (rows.TOKEN_EMBD, rows.OUTPUT):
        whole = ckpt.weight(name)
        blocks = list(rows.row_blocks(ckpt, name))
        assert len(blocks) == -(-len(whole) // 3) and np.array_equal(np.concatenate(blocks), whole)
        picked = [5, 0, 5, len(whole) - 1, 17, 18, 200]
        assert np.array_equal(rows.gather_rows(ckpt, name, picked), whole[picked])
    convert(hf, tmp_path / "blocks.gguf", qtype="q4_0")
    assert (tmp_path / "blocks.gguf").read_bytes() == (tmp_path / "whole.gguf").read_bytes()


def test_output_klds_measure_vocabulary_matrices_exactly_and_share_out_layers_closely(tmp_path, monkeypatch):
    from edgeinfer.converters import rows
    from edgeinfer.converters.calibrate import calibrate, column_importance, output_klds
    from edgeinfer.converters.checkpoint import Checkpoint
    from edgeinfer.converters.quantize import dequantize, quantize
    from edgeinfer.logits import log_softmax
    from edgeinfer.models.reference import Transformer

    hf = tmp_path / "hf"
    write_tiny_hf(hf, tied=False)
    ckpt = Checkpoint(hf)
    hp = ckpt.hparams
    tokens = np.random.default_rng(0).integers(0, hp.n_vocab, 96).tolist()
    calib = calibrate(ckpt, tokens, ctx=48, probe_tokens=32)
    assert calib.probe is not None
    probe_types = {name: QType.Q4_0 for name, shape in ckpt.shapes.items() if len(shape) == 2}
    klds = output_klds(ckpt, calib, probe_types)
    assert set(klds) == set(probe_types)

    # What quantizing each matrix alone does to the whole model's output, run in full.
    weights = {name: ckpt.weight(name) for name in ckpt.shapes}
    base = log_softmax(Transformer(hp, weights).head(calib.probe.layer_inputs[-1]))

    def divergence(replaced: str) -> float:
        w = weights[replaced]
        importance = column_importance(calib, replaced, w.shape[1])
        model = Transformer(hp, {**weights, replaced: dequantize(quantize(w, QType.Q4_0, importance), QType.Q4_0)})
        x = model.embed(calib.probe.tokens)
        for layer in range(hp.n_layer):
            x = model.block(layer, x, np.arange(len(x)))
        logprobs = log_softmax(model.head(x))
        return float(np.mean(np.sum(np.exp(base) * (base - logprobs), axis=1)))

    for name in probe_types:
        if name in (rows.TOKEN_EMBD, rows.OUTPUT):  # measured as such
            assert klds[name] == pytest.approx(divergence(name), rel=1e-3)
        else:  # shared out from its group's run by the layer's squared change: 0.83 to 1.16 of it here
            assert 1 / 1.5 < klds[name] / divergence(name) < 1.5, name
    monkeypatch.setattr(rows, "BLOCK_BYTES", 7 * 4 * 128)  # the head a few rows at a time
    assert output_klds(ckpt, calib, probe_types) == pytest.approx(klds, rel=1e-6)
