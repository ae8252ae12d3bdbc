"""llama.cpp's own prompt-lookup decoding (``llama-lookup``) against its plain decoding (``llama-completion``),
on the prompts ``bench_speculative.py`` uses, each rendered with the model's chat template as edgeinfer renders it.

Both programs come from the llama.cpp source llama-cpp-python vendors, built here beside the package with the
same instruction-set flags (``edgeinfer.buildflags``):

    pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36 && tar xzf llama_cpp_python-0.3.36.tar.gz
    cd llama_cpp_python-0.3.36/vendor/llama.cpp
    cmake -B build -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF $(python -c \\
        "from edgeinfer.buildflags import safe_cmake_args; print(safe_cmake_args())")
    cmake --build build --target llama-lookup llama-completion -j2
    python scripts/bench_llama_lookup.py --bin build/bin --threads 2

Per task: decode tok/s of each (llama-lookup's "decoded N tokens in T s"; llama-completion's eval time) and
their ratio, greedy, 128 tokens at most.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
from collections import defaultdict
from pathlib import Path

from edgeinfer import Engine
from edgeinfer.models.catalog import DEFAULT_MODEL

PROMPTS = Path(__file__).parent / "data" / "speculative_prompts.jsonl"
LOOKUP_SPEED = re.compile(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds")
PLAIN_SPEED = re.compile(r"eval time =\s+([\d.]+) ms /\s+(\d+) runs")


def decode(command: list[str], pattern: re.Pattern[str], tokens_first: bool) -> tuple[int, float]:
    """Tokens decoded and seconds, as the program reports them."""
    out = subprocess.run(command, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=600).stderr
    match = pattern.search(out)
    if match is None:
        raise SystemExit(f"{command[0]} printed no timing:\n{out[-2000:]}")
    if tokens_first:
        return int(match[1]), float(match[2])
    return int(match[2]), float(match[1]) / 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bin", type=Path, required=True, help="The folder holding llama-lookup and llama-completion.")
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--limit", type=int, help="At most this many prompts per task.")
    parser.add_argument("--json", action="store_true", help="Print one JSON object instead of a table.")
    args = parser.parse_args()
    rows = [json.loads(line) for line in PROMPTS.read_text().splitlines() if line.strip()]
    with Engine(args.model, threads=args.threads, kv_budget="512tok") as engine:
        path = str(engine.model_path)
        texts = [(row["task"], engine.render([{"role": "user", "content": row["prompt"]}])) for row in rows]
    common = ["-m", path, "-n", str(args.max_tokens), "--temp", "0", "-t", str(args.threads)]
    totals: dict[str, dict[str, list[float]]] = defaultdict(lambda: {"lookup": [0, 0.0], "plain": [0, 0.0]})
    seen: dict[str, int] = defaultdict(int)
    for task, text in texts:
        if args.limit is not None and seen[task] >= args.limit:
            continue
        seen[task] += 1
        lookup = decode([str(args.bin / "llama-lookup"), *common, "-p", text], LOOKUP_SPEED, tokens_first=True)
        plain = decode([str(args.bin / "llama-completion"), *common, "-no-cnv", "-p", text], PLAIN_SPEED, False)
        for name, (tokens, seconds) in (("lookup", lookup), ("plain", plain)):
            totals[task][name][0] += tokens
            totals[task][name][1] += seconds
    report = {
        task: {name: tokens / seconds for name, (tokens, seconds) in sides.items()} | {"prompts": seen[task]}
        for task, sides in totals.items()
    }
    for r in report.values():
        r["ratio"] = r["lookup"] / r["plain"]
    if args.json:
        print(json.dumps({"threads": args.threads, "tasks": report}, indent=2))
        return
    print(f"{'task':<10} {'llama-lookup':>13} {'plain':>8} {'ratio':>6}")
    for task, r in report.items():
        print(f"{task:<10} {r['lookup']:>13.1f} {r['plain']:>8.1f} {r['ratio']:>5.2f}x  ({r['prompts']} prompts)")


if __name__ == "__main__":
    main()
