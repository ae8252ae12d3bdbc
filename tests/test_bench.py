"""``edgeinfer bench`` on tiny real runs (the shape of its output, not its speed), and the per-token timings."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import numpy as np
import pytest
from click.testing import CliRunner

from edgeinfer.bench.runner import exact_prompt
from edgeinfer.cli import cli

TINY = ["--prompt-tokens", "16", "--gen-tokens", "8", "--runs", "2", "--threads", "1"]
ROWS = ("load", "cold start", "TTFT", "TPOT P50", "TPOT P95", "TPOT P99", "prefill", "decode", "roofline", "peak RSS")
STAGES = ("tokenize", "prefill", "decode", "sample", "detokenize", "other", "total")


@pytest.fixture
def runner():
    return CliRunner()


def test_every_output_token_is_timed(engine):
    engine.reset()
    m = engine.generate("The sea was calm and", temperature=0, max_tokens=12, ignore_eos=True).metrics
    assert len(m.token_times_s) == 12 and m.token_times_s[0] == m.ttft_s
    gaps = m.token_gaps_s
    assert len(gaps) == 11 and min(gaps) > 0
    assert min(gaps) <= m.tpot_percentile(50) <= m.tpot_percentile(95) <= m.tpot_percentile(99) <= max(gaps)
    assert m.tpot_percentile(50) == pytest.approx(float(np.median(gaps)))
    summary = m.to_dict()
    assert "token_times_s" not in summary  # `edgeinfer run --json` stays short
    assert summary["tpot_p99_s"] == m.tpot_percentile(99) and json.dumps(summary)
    assert "P99" in m.format()


@pytest.mark.parametrize("n", [1, 2, 16, 100, 257])
def test_the_prompt_has_exactly_the_tokens_asked_for(engine, model_path, n):
    assert len(engine.tokenize(exact_prompt(model_path, n))) == n


def test_two_configurations_side_by_side_as_json(runner, model_path):
    result = runner.invoke(cli, ["bench", "smollm2-135m", str(model_path), *TINY, "--speculative", "off", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert (report["prompt_tokens"], report["gen_tokens"], report["runs"]) == (16, 8, 2)
    assert report["speculative"] == "off"
    assert report["interleaved"] is True and (report["device"], report["gpu_layers"]) == ("cpu", -1)
    first, second = report["configs"]
    assert first["model"] == "smollm2-135m" and second["model"] == str(model_path)
    assert first["path"] == second["path"] == str(model_path)
    for config in report["configs"]:
        assert config["backend"] == "llamacpp" and config["threads"] == 1  # "auto" is resolved
        s = config["summary"]
        assert 0 < s["load_s"] < s["cold_start_s"]  # a cold start loads, then prefills and decodes
        assert 0 < s["tpot_p50_s"] <= s["tpot_p95_s"] <= s["tpot_p99_s"]
        assert s["ttft_s"] > 0 and s["prefill_tokens_per_s"] > 0 and s["decode_tokens_per_s"] > 0
        assert s["peak_rss_bytes"] > model_path.stat().st_size  # every weight is touched, plus the runtime
        assert s["roofline_tokens_per_s"] > 0 and config["decode_bytes_per_token"] > model_path.stat().st_size // 2
        stage_sum = sum(s[f"{stage}_s"] for stage in STAGES[:-1])
        assert stage_sum == pytest.approx(s["total_s"], rel=0.2) and s["prefill_s"] > 0 and s["decode_s"] > 0
        assert len(config["runs"]) == 2
        for run in config["runs"]:
            assert (run["prompt_tokens"], run["cached_tokens"], run["output_tokens"]) == (16, 0, 8)
            assert len(run["token_times_s"]) == 8 and run["kv_evicted"] == 0
            assert run["drafted_tokens"] == 0  # one token a step
        assert "acceptance_rate" not in s
    assert set(first["ratios"].values()) == {1.0}
    assert second["ratios"]["decode_tokens_per_s"] == pytest.approx(
        second["summary"]["decode_tokens_per_s"] / first["summary"]["decode_tokens_per_s"]
    )
    assert "bench: loading smollm2-135m on llamacpp" in result.stderr  # progress goes to stderr
    assert f"bench: loading {model_path.stem} on llamacpp" in result.stderr and "run 2/2" in result.stderr


def test_the_table_for_people():
    proc = subprocess.run(
        [sys.executable, "-m", "edgeinfer", "bench", *TINY, "--backend", "auto", "--backend", "llamacpp"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith(
        "16-token prompt, 8 tokens generated (greedy, lookup drafting), 2 runs after 1 warm-up, 1 thread;"
    )
    header = next(line for line in lines if "smollm2-135m" in line)
    assert header.split() == ["smollm2-135m", "smollm2-135m"]
    rows = {line[:16].rstrip(): line[16:] for line in lines[lines.index(header) + 2 :]}
    for label in ROWS + ("drafts kept",) + tuple(f"  {stage}" for stage in STAGES):
        assert label in rows, label
    assert rows["decode"].count("tok/s") == 2 and rows["decode"].rstrip().endswith("x")  # ratio to the first
    assert rows["TTFT"].count(" ms") + rows["TTFT"].count(" s") == 2
    assert rows["decode"].split()[0].replace(",", "").replace(".", "").isdigit()
    assert rows["  prefill"].count("%)") == 2 and "MiB" in rows["peak RSS"]
    kept = rows["drafts kept"].split()  # a share of drafted tokens, or "-" where none were drafted
    assert len(kept) == 2 and all(cell == "-" or 0 <= float(cell.rstrip("%")) <= 100 for cell in kept)


def test_a_draft_model_is_refused_before_any_worker_starts():
    from edgeinfer.bench.runner import bench
    from edgeinfer.errors import InvalidOptionError
    from edgeinfer.speculative import Speculation

    with pytest.raises(InvalidOptionError, match="choose lookup or off"):
        bench(["smollm2-135m"], speculative=Speculation.DRAFT)


def test_a_worker_that_fails_is_one_line(runner, model_path, tmp_path):
    from edgeinfer.models.gguf_file import read_header

    norm = next(t for t in read_header(model_path).tensors if t.name == "output_norm.weight")
    data = bytearray(model_path.read_bytes())
    data[norm.offset : norm.offset + norm.nbytes] = np.full(norm.nbytes // 4, np.nan, dtype=np.float32).tobytes()
    broken = tmp_path / "nan.gguf"
    broken.write_bytes(data)
    result = runner.invoke(cli, ["bench", str(broken), *TINY])
    assert result.exit_code == 1 and result.stdout == ""
    error = result.stderr.splitlines()[-1]
    assert error.startswith("error: nan on llamacpp: nan.gguf produced NaN or infinite logits")
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["bench", "--backend", "cuda"], "unknown backend 'cuda'"),
        (["bench", "smollm2-135m", "--backend", "llamacpp", "--backend", "nope"], "unknown backend 'nope'"),
        (["bench", "/no/such/model.gguf"], "model file not found"),
        (["bench", "--prompt-tokens", "9000"], "exceed its 8192-token context"),
        (["bench", "--threads", "0"], "threads must be at least 1"),
        (["bench", "--device", "nowhere"], "here has a device 'nowhere': "),
        (["bench", "--gpu-layers", "4"], "--gpu-layers needs a GPU device (--device)"),
    ],
)
def test_bad_input_is_one_line_before_any_worker_starts(runner, args, needle):
    result = runner.invoke(cli, args)
    assert result.exit_code == 1 and result.stdout == ""
    # One line in all: no progress line, so no worker was started.
    assert result.stderr.startswith("error: ") and needle in result.stderr and result.stderr.count("\n") == 1


@pytest.mark.parametrize("option", ["--runs", "--gen-tokens", "--prompt-tokens"])
def test_counts_out_of_range_are_usage_errors(option):
    proc = subprocess.run(
        [sys.executable, "-m", "edgeinfer", "bench", option, "0"], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.startswith(f"error: Invalid value for '{option}'") and proc.stderr.count("\n") == 1


def test_plot_draws_a_png_or_says_what_is_missing(runner, tmp_path):
    target = tmp_path / "bench.png"
    result = runner.invoke(cli, ["bench", *TINY, "--plot", str(target)])
    if importlib.util.find_spec("matplotlib") is None:
        assert result.exit_code == 1 and not target.exists()
        assert result.stderr == "error: --plot needs matplotlib, which is not installed: pip install matplotlib\n"
    else:
        assert result.exit_code == 0, result.output
        assert target.read_bytes().startswith(b"\x89PNG") and "TPOT P99" in result.stdout
