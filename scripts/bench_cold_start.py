"""Cold start of the ``edgeinfer`` command, as a user meets it: process start to first token, and to exit.

Runs the real command in a fresh process several times and reports min and median of

- ``edgeinfer --help``: process start to exit;
- ``edgeinfer run "hi" --max-tokens 1``: process start to the first byte of the answer on stdout, and to exit;
- llama.cpp's own load of the same file, for scale: a process that imports llama-cpp-python's bindings
  and loads the model and a context, nothing else (process start to exit, and the load alone);
- the same ``run`` with a system prompt of ``--system-tokens`` tokens, to the first token: without the
  prompt cache, and with it (``--prompt-cache``, filled by a run before), and the state file's size; and
  the TTFT of that prompt in a freshly loaded engine, the load not counted, without and with the cache.

    python scripts/bench_cold_start.py
    python scripts/bench_cold_start.py --runs 10 --json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from edgeinfer.models.catalog import DEFAULT_MODEL, resolve_model

# The bare llama.cpp load: the same calls edgeinfer's backend makes, with none of edgeinfer around them.
LLAMA_LOAD = """
import sys, time
start = time.perf_counter()
import llama_cpp
llama_cpp.llama_backend_init()
params = llama_cpp.llama_model_default_params()
model = llama_cpp.llama_model_load_from_file(sys.argv[1].encode(), params)
ctx_params = llama_cpp.llama_context_default_params()
ctx_params.n_ctx = 2048
ctx = llama_cpp.llama_init_from_model(model, ctx_params)
print(f"{time.perf_counter() - start:.4f}")
"""


def timed(command: list[str], *, first_byte: bool = False) -> tuple[float, float | None, str]:
    """Seconds from process start to exit, to the first byte on stdout (when asked), and the stdout."""
    start = time.perf_counter()
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=os.environ)
    assert proc.stdout is not None
    first = None
    if first_byte:
        head = proc.stdout.read(1)
        first = time.perf_counter() - start
    else:
        head = b""
    out = head + proc.stdout.read()
    proc.wait()
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed with exit code {proc.returncode}")
    return time.perf_counter() - start, first, out.decode(errors="replace")


def long_system_prompt(path: str, tokens: int) -> str:
    """A system prompt of rules, ``tokens`` tokens long or just over with the model's tokenizer."""
    from edgeinfer.tokenizer import Tokenizer

    tokenizer = Tokenizer(path)
    rules: list[str] = []
    while len(tokenizer.encode(" ".join(rules))) < tokens:
        rules.append(f"Rule {len(rules)}: answer briefly and politely.")
    tokenizer.close()
    return " ".join(rules)


def in_process_ttft(path: str, system: str, folder: Path | None, threads: int | None) -> float:
    """TTFT of the system prompt and a question in a freshly loaded engine (the load not counted)."""
    from edgeinfer import Engine

    messages = [{"role": "system", "content": system}, {"role": "user", "content": "hi"}]
    with Engine(path, threads=threads, prompt_cache=folder) as engine:
        return engine.chat(messages, max_tokens=1).metrics.ttft_s


def summary(values: list[float]) -> dict[str, float]:
    return {"min_s": min(values), "median_s": statistics.median(values)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--threads", type=int, help="Pass --threads (default: none, as a user would run it).")
    parser.add_argument("--system-tokens", type=int, default=1000, help="About how long the system prompt is.")
    parser.add_argument("--json", action="store_true", help="Print one JSON object instead of a table.")
    args = parser.parse_args()
    path = str(resolve_model(args.model))
    edgeinfer = [sys.executable, "-m", "edgeinfer"]
    run = [*edgeinfer, "run", "hi", "--model", args.model, "--max-tokens", "1"]
    if args.threads is not None:
        run += ["--threads", str(args.threads)]
    names = ("help", "run_first_token", "run_exit", "llama_exit", "llama_load", "system_cold", "system_cached")
    names += ("ttft_cold", "ttft_cached")
    results: dict[str, list[float]] = {name: [] for name in names}
    system = long_system_prompt(path, args.system_tokens)
    with_system = [*run, "--system", system]
    folder = Path(tempfile.mkdtemp(prefix="edgeinfer-prompt-cache-"))
    cached = [*with_system, "--prompt-cache", str(folder)]
    timed(run)  # warms the page cache: every figure is a start with the file in memory
    timed(cached)  # fills the prompt cache
    for _ in range(args.runs):
        results["system_cold"].append(timed(with_system, first_byte=True)[1] or 0.0)
        results["system_cached"].append(timed(cached, first_byte=True)[1] or 0.0)
        results["ttft_cold"].append(in_process_ttft(path, system, None, args.threads))
        results["ttft_cached"].append(in_process_ttft(path, system, folder, args.threads))
        results["help"].append(timed([*edgeinfer, "--help"])[0])
        total, first, _ = timed(run, first_byte=True)
        results["run_exit"].append(total)
        results["run_first_token"].append(first or total)
        total, _, out = timed([sys.executable, "-c", LLAMA_LOAD, path])
        results["llama_exit"].append(total)
        results["llama_load"].append(float(out.split()[-1]))
    report: dict[str, object] = {name: summary(values) for name, values in results.items()}
    report["state_file_bytes"] = sum(path.stat().st_size for path in folder.iterdir())
    if args.json:
        print(json.dumps({"runs": args.runs, "model": args.model, **report}, indent=2))
        return
    labels = {
        "help": "edgeinfer --help, to exit",
        "run_first_token": "edgeinfer run, to first token",
        "run_exit": "edgeinfer run, to exit",
        "llama_exit": "llama.cpp load alone, to exit",
        "llama_load": "llama.cpp load alone, the load",
        "system_cold": f"run, {args.system_tokens}-token system, to first token",
        "system_cached": "the same with the prompt cache",
        "ttft_cold": "in a loaded engine, its TTFT",
        "ttft_cached": "the same with the prompt cache",
    }
    print(f"{'':<40} {'min':>8} {'median':>8}   ({args.runs} runs)")
    for name, label in labels.items():
        print(f"{label:<40} {report[name]['min_s']:>7.3f}s {report[name]['median_s']:>7.3f}s")
    print(f"the prompt cache's state file: {report['state_file_bytes'] / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
