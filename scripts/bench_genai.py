"""edgeinfer's ONNX Runtime backend against onnxruntime-genai on its own int4 export: decode tok/s and TTFT.

Issue 17's small-model regime: on a tiny checkpoint a step's own overhead decides. onnxruntime-genai
exports a Hugging Face checkpoint with its model builder, which needs torch, so it lives in an
environment of its own; this script runs edgeinfer in this one and onnxruntime-genai through that
environment's Python (``--genai-python``). Both get the same prompt ids (edgeinfer's tokenizer on
the same text), decode greedily exactly --gen-tokens new tokens with EOS ignored, use the same
threads, and start every run from an empty cache; the sides take turns run by run, the order
reversing each run, and the verdicts take medians. edgeinfer decodes one token a step, as onnxruntime-genai
does (``--speculative off``): the figure is the step's own cost, which is what the small-model regime is
about. ``--speculative lookup`` is the engine's default instead; this script's prompt repeats one sentence, so
lookup's drafts are mostly kept and the figure says more about drafting than about a step.

TTFT runs from the call, ids in hand, to the first new token (edgeinfer's tokenizing is taken off its
clock); decode tok/s is (gen_tokens - 1) over the time from the first new token to the last, each side
timing every token itself. A pause between sides lets ONNX Runtime's spinning threads of the one before
go idle.

Set up, once (the scratch environment is not the project's):

    python -m venv /tmp/genai-venv
    /tmp/genai-venv/bin/pip install onnxruntime-genai torch transformers onnx-ir onnxscript
    /tmp/genai-venv/bin/python -m onnxruntime_genai.models.builder -m HF_DIR -o /tmp/genai-int4 -p int4 -e cpu
    edgeinfer convert HF_DIR --type q4_0 -o /tmp/model-q4_0.gguf

Reproduce:

    python scripts/bench_genai.py --model /tmp/model-q4_0.gguf --genai-model /tmp/genai-int4 \\
        --genai-python /tmp/genai-venv/bin/python --threads 2 --runs 9
"""

from __future__ import annotations

import argparse
import json
import select
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from edgeinfer import Engine
from edgeinfer.system import thread_count

PROMPT_TEXT = "In the beginning God created the heaven and the earth."
WORKER_TIMEOUT_S = 600  # a load, or one run of --gen-tokens tokens
PAUSE_S = 0.1

# Run by the scratch environment's Python: reads one request per line on stdin, answers one line of JSON.
GENAI_WORKER = r"""
import json, sys, time
import onnxruntime_genai as og
path, threads = sys.argv[1], int(sys.argv[2])
config = og.Config(path)
config.overlay(json.dumps({"model": {"decoder": {"session_options": {"intra_op_num_threads": threads}}}}))
model = og.Model(config)
print(json.dumps({"ready": og.__version__}), flush=True)
for line in sys.stdin:
    ids, n = json.loads(line)
    start = time.perf_counter()
    params = og.GeneratorParams(model)
    length = len(ids) + n
    params.set_search_options(max_length=length, min_length=length, do_sample=False)
    generator = og.Generator(model, params)
    generator.append_tokens(ids)
    times, tokens = [], []
    while not generator.is_done():
        generator.generate_next_token()
        tokens.append(int(generator.get_next_tokens()[0]))
        times.append(time.perf_counter() - start)
    print(json.dumps({"times": times, "tokens": tokens}), flush=True)
"""


def edgeinfer_run(engine: Engine, prompt: str, gen_tokens: int) -> dict:
    engine.reset()  # an empty cache: TTFT includes the whole prefill
    stream = engine.stream(prompt, max_tokens=gen_tokens, temperature=0, ignore_eos=True)
    for _ in stream:
        pass
    assert stream.result is not None
    m = stream.result.metrics
    return {"times": [t - m.tokenize_s for t in m.token_times_s], "tokens": stream.tokens}


def figures(run: dict, gen_tokens: int) -> tuple[float, float]:
    """TTFT in ms and decode tok/s of one run."""
    times = run["times"]
    if len(times) != gen_tokens:
        sys.exit(f"a side made {len(times)} tokens, not {gen_tokens}")
    return times[0] * 1e3, (gen_tokens - 1) / (times[-1] - times[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="the GGUF edgeinfer runs")
    parser.add_argument("--genai-model", required=True, type=Path, help="onnxruntime-genai's export folder")
    parser.add_argument("--genai-python", required=True, help="the Python of the environment with onnxruntime-genai")
    parser.add_argument("--threads", type=int, default=None, help="default: the free cores")
    parser.add_argument("--prompt-words", type=int, default=70)
    parser.add_argument("--gen-tokens", type=int, default=128)
    parser.add_argument("--runs", type=int, default=9)
    parser.add_argument(
        "--kv-type", choices=["f16", "f32"], help="edgeinfer's KV cache type (default: the backend's own)"
    )
    parser.add_argument(
        "--speculative", choices=["off", "lookup"], default="off", help="edgeinfer's drafting (default: a token a step)"
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    threads = args.threads or thread_count()
    if args.gen_tokens < 2 or args.runs < 1 or args.prompt_words < 1:
        sys.exit("--gen-tokens must be at least 2, --runs and --prompt-words at least 1")
    if not (args.genai_model / "genai_config.json").is_file():
        sys.exit(f"{args.genai_model} is not an onnxruntime-genai export (no genai_config.json); see --help")
    if shutil.which(args.genai_python) is None:
        sys.exit(f"no Python at {args.genai_python}; give the scratch environment's, see --help")

    words = (PROMPT_TEXT.split() * args.prompt_words)[: args.prompt_words]
    prompt = " ".join(words)
    engine = Engine(
        args.model,
        backend="onnxruntime",
        threads=threads,
        kv_budget="1024tok",
        kv_type=args.kv_type,
        speculative=args.speculative,
    )
    ids = engine.tokenize(prompt)
    worker = subprocess.Popen(
        [args.genai_python, "-c", GENAI_WORKER, str(args.genai_model), str(threads)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert worker.stdin is not None and worker.stdout is not None

    def answer() -> dict:
        ready, _, _ = select.select([worker.stdout], [], [], WORKER_TIMEOUT_S)
        line = worker.stdout.readline() if ready else ""
        if not line:
            worker.kill()
            sys.exit(f"the onnxruntime-genai worker gave no answer (exit code {worker.wait()}); its error is above")
        return json.loads(line)

    genai_version = answer()["ready"]

    def genai_run() -> dict:
        try:
            worker.stdin.write(json.dumps([ids, args.gen_tokens]) + "\n")
            worker.stdin.flush()
        except BrokenPipeError:
            sys.exit(f"the onnxruntime-genai worker has stopped (exit code {worker.wait()}); its error is above")
        return answer()

    sides = {"edgeinfer": lambda: edgeinfer_run(engine, prompt, args.gen_tokens), "onnxruntime-genai": genai_run}
    for run in sides.values():  # warm-up
        run()
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in sides}
    same = []
    for i in range(args.runs):
        order = list(sides) if i % 2 == 0 else list(reversed(sides))
        runs = {}
        for name in order:
            time.sleep(PAUSE_S)
            runs[name] = sides[name]()
        for name, run in runs.items():
            results[name].append(figures(run, args.gen_tokens))
        same.append(runs["edgeinfer"]["tokens"] == runs["onnxruntime-genai"]["tokens"])
    worker.stdin.close()
    worker.wait()

    summary = {
        name: {
            "ttft_ms": statistics.median(t for t, _ in rows),
            "decode_tok_s": statistics.median(r for _, r in rows),
        }
        for name, rows in results.items()
    }
    ours, theirs = summary["edgeinfer"], summary["onnxruntime-genai"]
    verdict = {
        "decode_ratio": ours["decode_tok_s"] / theirs["decode_tok_s"],
        "ttft_difference_ms": ours["ttft_ms"] - theirs["ttft_ms"],
        "same_greedy_tokens_runs": sum(same),
    }
    if args.json:
        setting = {"prompt_tokens": len(ids), "threads": threads, "speculative": args.speculative}
        print(json.dumps({**setting, **summary, **verdict}))
        return
    print(
        f"{Path(args.model).name} against onnxruntime-genai {genai_version} on {args.genai_model.name}: "
        f"{len(ids)}-token prompt, {args.gen_tokens} new tokens, {threads} threads, {args.runs} runs, edgeinfer's"
        f" drafting {args.speculative}"
    )
    for name, row in summary.items():
        print(f"  {name:18} TTFT {row['ttft_ms']:7.2f} ms   decode {row['decode_tok_s']:8.1f} tok/s")
    print(f"decode edgeinfer / onnxruntime-genai: {verdict['decode_ratio']:.3f}x (target >= 1)")
    print(f"TTFT edgeinfer - onnxruntime-genai: {verdict['ttft_difference_ms']:+.2f} ms (target <= 1)")
    print(f"the same greedy tokens in {sum(same)} of {args.runs} runs (int4 export vs the GGUF's Q4_0: not expected)")


if __name__ == "__main__":
    sys.exit(main())
