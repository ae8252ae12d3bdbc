"""The edgeinfer command, through click's runner and as a real subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from click.testing import CliRunner

from edgeinfer.cli import cli

from support import SYSTEM

JAPAN_ARGS = [
    "run",
    "What is the capital of Japan?",
    "--system",
    SYSTEM,
    "--temperature",
    "0",
    "--threads",
    "2",
    "--kv-budget",
    "512tok",
]


@pytest.fixture
def runner():
    return CliRunner()


def test_run_streams_the_answer(runner):
    result = runner.invoke(cli, JAPAN_ARGS)
    assert result.exit_code == 0, result.output
    assert "Tokyo" in result.stdout


def test_run_json_and_stats(runner):
    result = runner.invoke(cli, [*JAPAN_ARGS, "--json", "--stats"])
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    assert "Tokyo" in payload["text"] and payload["finish_reason"] == "stop"
    assert payload["metrics"]["ttft_s"] > 0 and payload["metrics"]["kv_capacity"] == 512
    for line in ("TTFT", "decode", "prefill", "KV cache", "route: local", "tokenize"):
        assert line in result.stderr


@pytest.mark.parametrize("mode", ["lookup", "off"])
def test_run_speculative_shows_the_drafts(runner, mode, monkeypatch, tmp_path):
    monkeypatch.setenv("EDGEINFER_CACHE_DIR", str(tmp_path))  # no drafting cost measured yet: the prior drafts
    count = "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20\n1 2 3"
    args = ["run", count, "--raw", "--temperature", "0", "--max-tokens", "16", "--threads", "2", "--json", "--stats"]
    result = runner.invoke(cli, [*args, "--speculative", mode])
    assert result.exit_code == 0, result.output
    metrics = json.loads(result.stdout)["metrics"]
    if mode == "lookup":  # the default: the count is drafted from the prompt
        assert metrics["accepted_tokens"] > 0 and "drafted tokens kept" in result.stderr
    else:
        assert metrics["drafted_tokens"] == 0 and "drafts: none verified" in result.stderr


def test_run_reads_the_prompt_from_stdin(runner):
    result = runner.invoke(
        cli, JAPAN_ARGS[:1] + JAPAN_ARGS[2:] + ["--no-stream"], input="What is the capital of Japan?"
    )
    assert result.exit_code == 0, result.output
    assert "Tokyo" in result.stdout


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["run", "hi", "--model", "/no/such/model.gguf"], "model file not found"),
        (["run", "hi", "--model", "not-a-model"], "unknown model"),
        (["run", "hi", "--kv-budget", "lots"], "cannot read KV budget"),
        (["run", "hi", "--temperature", "-1"], "temperature must be"),
        (["run", "hi", "--threads", "0"], "threads must be"),
        (["run", "hi", "--backend", "cuda"], "unknown backend"),
        (["run", "hi", "--device", "nowhere"], "here has a device 'nowhere': "),
        (["run", "hi", "--gpu-layers", "4"], "--gpu-layers needs a GPU device"),
        (["run", "hi", "--kv-type", "q8_0", "--backend", "reference"], "KV type 'q8_0' is not supported"),
        (["run", "   "], "the prompt is empty"),
        (["info", "/no/such.gguf"], "model file not found"),
    ],
)
def test_user_errors_are_one_line_on_stderr(runner, args, needle):
    result = runner.invoke(cli, args)
    assert result.exit_code == 1
    assert result.stdout == ""
    assert result.stderr.startswith("error: ") and needle in result.stderr
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr


def test_not_a_gguf_through_the_cli(runner, tmp_path):
    fake = tmp_path / "model.gguf"
    fake.write_bytes(b"<html>404</html>" * 10)
    result = runner.invoke(cli, ["run", "hi", "--model", str(fake)])
    assert result.exit_code == 1 and "not a GGUF file" in result.stderr


def test_info_reports_machine_and_model(runner, model_path):
    result = runner.invoke(cli, ["info", str(model_path)])
    assert result.exit_code == 0, result.output
    for needle in (
        "CPU features:",
        "backend llamacpp: available",
        "30 layers",
        "KV heads",
        "8,192 tokens",
        "Q4_1 x210",
    ):
        assert needle in result.stdout
    report = json.loads(runner.invoke(cli, ["info", "smollm2-135m", "--json"]).stdout)
    assert report["model"]["kv_bytes_per_token_f16"] == 23040 and report["cores"] >= 1
    assert set(report["model"]["backends"]) == set(report["backends"]) >= {"llamacpp", "reference"}
    assert report["model"]["backends"]["llamacpp"] == "available"
    # auto's choice: llama.cpp on the CPU, unless a real GPU of a Vulkan build is here (lavapipe is not one).
    real_gpu = report["backends"].get("vulkan") == "available" and not any(
        d["emulated"] for d in report["devices"]["vulkan"][:1]
    )
    chosen = "vulkan" if real_gpu else "llamacpp"
    assert report["model"]["auto_backend"] == chosen
    assert result.stdout.count("(auto's choice)") == 1 and f"{chosen}: supports it (auto's choice)" in result.stdout


def test_list_shows_the_default_model_on_disk(runner):
    result = runner.invoke(cli, ["list"])
    assert result.exit_code == 0
    line = next(row for row in result.stdout.splitlines() if row.startswith("smollm2-135m"))
    assert "93.8 MiB" in line and "yes" in line
    rows = json.loads(runner.invoke(cli, ["list", "--json"]).stdout)
    assert any(r["name"] == "smollm2-135m" and r["path"] for r in rows)


def run_edgeinfer(*args: str, stdin: str | None = None, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "edgeinfer", *args],
        input=stdin, capture_output=True, text=True, timeout=120, env={**os.environ, **env},
    )  # fmt: skip


def test_real_subprocess_answers_and_pipes():
    proc = run_edgeinfer(*JAPAN_ARGS, "--stats")
    assert proc.returncode == 0, proc.stderr
    assert "Tokyo" in proc.stdout and "TTFT" in proc.stderr


def _imported(*args: str) -> set[str]:
    """The modules ``edgeinfer ARGS`` imports, from Python's -X importtime report."""
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "edgeinfer", *args], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return {line.rsplit("|", 1)[1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}


def test_the_command_imports_only_what_it_uses():
    # --help answers before numpy, llama.cpp, huggingface_hub or httpx: each costs tenths of a second.
    slow = {"numpy", "llama_cpp", "huggingface_hub", "httpx", "jinja2"}
    assert not slow & _imported("--help") and not slow & _imported("run", "--help")
    # A local answer from a packaged model needs neither the Hub's client nor the cloud's.
    answered = _imported("run", "hi", "--max-tokens", "1", "--threads", "2")
    assert {"numpy", "llama_cpp"} <= answered and not {"huggingface_hub", "httpx", "openai"} & answered


def test_real_subprocess_error_is_one_line(tmp_path):
    proc = run_edgeinfer("run", "hi", "--model", str(tmp_path / "missing.gguf"))
    assert proc.returncode == 1
    assert proc.stderr.startswith("error: model file not found") and proc.stderr.count("\n") == 1


def test_pull_then_run_by_hf_reference(model_path, tmp_path):
    from hf_server import FakeHub

    ref = "hf:edge-test/SmolLM2-GGUF/smollm2.gguf"
    with FakeHub({("edge-test/SmolLM2-GGUF", "smollm2.gguf"): model_path.read_bytes()}) as hub:
        env = {"HF_ENDPOINT": hub.url, "HF_HOME": str(tmp_path), "HF_HUB_DISABLE_TELEMETRY": "1"}
        pulled = run_edgeinfer("pull", ref, **env)
        assert pulled.returncode == 0, pulled.stderr
        path = pulled.stdout.strip()
        assert path.startswith(str(tmp_path)) and os.path.getsize(path) == model_path.stat().st_size
        answered = run_edgeinfer(*JAPAN_ARGS, "--model", ref, **env)
        assert answered.returncode == 0, answered.stderr
        assert "Tokyo" in answered.stdout
        listed = run_edgeinfer("list", **env)
        assert any(line.startswith(ref) and "yes" in line for line in listed.stdout.splitlines())


def test_pull_without_network_is_one_line(tmp_path):
    import socket

    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = run_edgeinfer(
        "pull", "hf:org/repo/model.gguf", HF_ENDPOINT=f"http://127.0.0.1:{port}", HF_HOME=str(tmp_path)
    )
    assert proc.returncode == 1
    assert proc.stderr.startswith("error: cannot download hf:org/repo/model.gguf: no network connection")
    assert proc.stderr.count("\n") == 1


def test_closed_pipe_and_ctrl_c_end_quietly():
    import signal
    import time

    args = [sys.executable, "-m", "edgeinfer", "run", "Tell me a long story.", "--max-tokens", "2000", "--threads", "2"]
    reader = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert reader.stdout.read(1)
    reader.stdout.close()  # like `| head -c 1`
    assert reader.wait(timeout=60) == 0
    assert b"Traceback" not in reader.stderr.read()

    interrupted = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert interrupted.stdout.read(1)
    time.sleep(0.2)
    interrupted.send_signal(signal.SIGINT)
    assert interrupted.wait(timeout=60) == 130
    assert b"Traceback" not in interrupted.stderr.read()


@pytest.mark.parametrize(
    "args",
    [["run", "hi", "--kv-policy", "nope"], ["run", "hi", "--max-tokens", "abc"], ["frobnicate"], ["pull"]],
)
def test_usage_errors_are_one_line_too(args):
    proc = run_edgeinfer(*args)
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: ") and proc.stderr.count("\n") == 1 and "--help" in proc.stderr


def test_invalid_utf8_prompt_is_refused_before_loading():
    proc = subprocess.run(
        [sys.executable, "-m", "edgeinfer", "run", b"caf\xe9"], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 1 and proc.stderr == "error: the prompt is not valid UTF-8 text; pass UTF-8\n"


def test_context_full_keeps_the_partial_answer(runner):
    args = [
        "run",
        "Write a long story about a robot.",
        "--kv-budget",
        "48tok",
        "--kv-policy",
        "error",
        "--threads",
        "2",
    ]
    result = runner.invoke(cli, [*args, "--json"])
    assert result.exit_code == 1
    payload = json.loads(result.stdout)
    assert payload["finish_reason"] == "context_full" and len(payload["text"]) > 0
    assert result.stderr.startswith("error: KV cache full")
    no_stream = runner.invoke(cli, [*args, "--no-stream", "--seed", "1"])
    assert no_stream.exit_code == 1 and no_stream.stdout.strip()


def test_a_full_disk_is_a_clear_error():
    with open("/dev/full", "w") as full:
        proc = subprocess.run(
            [sys.executable, "-m", "edgeinfer", *JAPAN_ARGS],
            stdout=full,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
        )
    assert proc.returncode == 1
    assert proc.stderr.startswith("error: cannot write the output: No space left on device")


def test_pull_of_a_file_that_is_not_a_model(runner, tmp_path):
    fake = tmp_path / "image.gguf"
    fake.write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(100))
    result = runner.invoke(cli, ["pull", str(fake)])
    assert result.exit_code == 1 and "not a GGUF file" in result.stderr


def test_a_directory_is_not_a_model(runner, tmp_path, monkeypatch):
    result = runner.invoke(cli, ["run", "hi", "--model", str(tmp_path)])
    assert result.exit_code == 1 and "is a directory" in result.stderr
    # Given by its bare name from inside its parent, it is still that folder, not an unknown alias.
    monkeypatch.chdir(tmp_path.parent)
    result = runner.invoke(cli, ["run", "hi", "--model", tmp_path.name])
    assert result.exit_code == 1 and f"{tmp_path.name} is a directory" in result.stderr
    (tmp_path / "config.json").write_text("{}")
    result = runner.invoke(cli, ["run", "hi", "--model", tmp_path.name])
    assert result.exit_code == 1 and f"convert it first: edgeinfer convert {tmp_path.name} -o" in result.stderr


def test_an_endless_standard_input_is_refused_at_the_limit():
    # `yes | edgeinfer run` read all of its input before checking it: gigabytes in seconds.
    for source in (["yes"], ["cat", "/dev/zero"]):
        feeder = subprocess.Popen(source, stdout=subprocess.PIPE)
        try:
            proc = subprocess.run(
                [sys.executable, "-m", "edgeinfer", "run"],
                stdin=feeder.stdout,
                capture_output=True,
                text=True,
                timeout=60,
            )
        finally:
            feeder.kill()
            feeder.wait()
        assert proc.returncode == 1
        assert proc.stderr == "error: the prompt on standard input is over 1,000,000 characters; pass a shorter one\n"


def test_a_closed_standard_input_is_one_line():
    proc = subprocess.run(
        [sys.executable, "-m", "edgeinfer", "run"], stdin=None, capture_output=True, text=True, timeout=60,
        pass_fds=(), close_fds=True, preexec_fn=lambda: os.close(0),
    )  # fmt: skip
    assert proc.returncode == 1
    assert proc.stderr == "error: no prompt: pass it as an argument or on standard input (standard input is closed)\n"


@pytest.mark.parametrize(
    ("make", "says"),
    [
        (lambda p: os.mkfifo(p), "is a named pipe (FIFO), not a model file"),
        (lambda p: os.symlink(p, p), "is a loop of symbolic links"),
        (lambda p: os.symlink(p.parent / "gone.gguf", p), "gone.gguf, which does not exist"),
    ],
)
def test_a_model_path_that_is_not_a_file_says_what_it_is(runner, tmp_path, make, says):
    path = tmp_path / "model.gguf"
    make(path)
    result = runner.invoke(cli, ["run", "hi", "--model", str(path)])
    assert result.exit_code == 1 and says in result.stderr and result.stderr.count("\n") == 1


def test_a_device_is_not_a_model(runner):
    result = runner.invoke(cli, ["run", "hi", "--model", "/dev/zero"])
    assert result.exit_code == 1 and "/dev/zero is a character device, not a model file" in result.stderr


def test_a_prompt_cut_to_fit_the_budget_is_a_warning(runner):
    prompt = "The quick brown fox jumps over the lazy dog. " * 150  # ~1,500 tokens
    result = runner.invoke(cli, ["run", prompt, "--kv-budget", "512tok", "--max-tokens", "4", "--threads", "2"])
    assert result.exit_code == 0, result.output
    warning = next(line for line in result.stderr.splitlines() if line.startswith("warning:"))
    assert "fit the KV budget" in warning and "--kv-budget" in warning
    assert "\nwarning: the prompt was" in result.output  # on a line of its own after the answer, on one screen
    quiet = runner.invoke(cli, ["run", "Hello", "--kv-budget", "512tok", "--max-tokens", "4", "--threads", "2"])
    assert quiet.exit_code == 0 and "warning" not in quiet.stderr
