"""Decode speed with prompt-lookup drafting against without it, side by side, on the same prompts.

Two engines on one model, one with ``speculative="lookup"`` and one with ``"off"``, answer every
prompt of ``scripts/data/speculative_prompts.jsonl`` greedily, taking turns as to which goes first.
Per task it prints decode tok/s (output tokens after the first, over the time from the first to the
last) for both and their ratio; the ratio again over the prompts where both gave the same tokens
(greedy output may differ where llama.cpp's batch-dependent rounding flips a near tie), and on how
many they did; how many drafted tokens were kept; and, where the answers parted, the widest margin between
the two best logits at the parting token:

    python scripts/bench_speculative.py --threads 2
    python scripts/bench_speculative.py --threads 2 --json > /tmp/spec.json
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

from edgeinfer import Engine, Result
from edgeinfer.models.catalog import DEFAULT_MODEL
from edgeinfer.system import thread_count

PROMPTS = Path(__file__).parent / "data" / "speculative_prompts.jsonl"
MODES = ("lookup", "off")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--threads", type=int)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--prompts", type=Path, default=PROMPTS, help="JSON Lines: task, prompt.")
    parser.add_argument("--tasks", nargs="*", help="Only these tasks (default: every task in the file).")
    parser.add_argument("--limit", type=int, help="At most this many prompts per task.")
    parser.add_argument("--json", action="store_true", help="Print one JSON object instead of a table.")
    args = parser.parse_args()
    threads = thread_count(args.threads)
    rows = [json.loads(line) for line in args.prompts.read_text().splitlines() if line.strip()]
    by_task: dict[str, list[str]] = defaultdict(list)
    for row in rows:
        if not args.tasks or row["task"] in args.tasks:
            by_task[row["task"]].append(row["prompt"])
    engines = {
        mode: Engine(args.model, backend=args.backend, threads=threads, kv_budget="2048tok", speculative=mode)
        for mode in MODES
    }
    cost = engines["lookup"].draft_token_cost
    report: dict[str, dict[str, float | int]] = {}
    try:
        for task, prompts in by_task.items():
            runs = [
                answer_both(engines, prompt, args.max_tokens, first=MODES[i % 2])
                for i, prompt in enumerate(prompts[: args.limit])
            ]
            for i, run in enumerate(runs):
                on = run["lookup"]
                print(f"  {task} {i + 1}: {speed([run], 'lookup'):.1f} vs {speed([run], 'off'):.1f} tok/s, "
                      f"{on.metrics.accepted_tokens}/{on.metrics.drafted_tokens} kept", file=sys.stderr)  # fmt: skip
            same = [run for run in runs if run["lookup"].tokens == run["off"].tokens]
            parted = [(p, run) for p, run in zip(prompts[: args.limit], runs, strict=True) if run not in same]
            ties = [tie_margin(engines["off"], prompt, run) for prompt, run in parted]
            drafted = sum(run["lookup"].metrics.drafted_tokens for run in runs)
            accepted = sum(run["lookup"].metrics.accepted_tokens for run in runs)
            report[task] = {
                "prompts": len(runs),
                "lookup_tok_s": speed(runs, "lookup"),
                "off_tok_s": speed(runs, "off"),
                "ratio": speed(runs, "lookup") / speed(runs, "off"),
                "same_tokens": len(same),
                "same_tokens_ratio": speed(same, "lookup") / speed(same, "off") if same else 0.0,
                "widest_tie": max((t for t in ties if t is not None), default=0.0),
                "drafted": drafted,
                "accepted": accepted,
                "acceptance": accepted / drafted if drafted else 0.0,
            }
    finally:
        for engine in engines.values():
            engine.close()
    if args.json:
        print(
            json.dumps(
                {"threads": threads, "max_tokens": args.max_tokens, "draft_token_cost": cost, "tasks": report}, indent=2
            )
        )
        return
    print(f"a drafted token costs {cost:.2f} of a step, as the engine drafted by")
    print(f"{'task':<10} {'lookup':>8} {'off':>8} {'ratio':>6}  {'same tokens':>16}  {'kept/drafted':>14}  widest tie")
    for task, r in report.items():
        print(
            f"{task:<10} {r['lookup_tok_s']:>8.1f} {r['off_tok_s']:>8.1f} {r['ratio']:>5.2f}x  "
            f"{r['same_tokens_ratio']:>5.2f}x on {r['same_tokens']:>2}/{r['prompts']:<3}  "
            f"{r['accepted']:>6}/{r['drafted']:<7}  {r['widest_tie']:.3f}"
        )


def answer_both(engines: dict[str, Engine], prompt: str, max_tokens: int, first: str) -> dict[str, Result]:
    """Both engines' greedy answers to ``prompt``, ``first`` first, each from a cache that holds none of it."""
    results = {}
    for mode in sorted(MODES, key=lambda m: m != first):
        engines[mode].reset()
        results[mode] = engines[mode].chat([{"role": "user", "content": prompt}], temperature=0, max_tokens=max_tokens)
    return results


def tie_margin(engine: Engine, prompt: str, run: dict[str, Result]) -> float | None:
    """Where the two answers part: how far the best logit led the second there, in a fresh prefill of the
    prompt and the tokens both share (None where one answer is the other's start)."""
    on, off = run["lookup"].tokens, run["off"].tokens
    parted = next((i for i, (a, b) in enumerate(zip(on, off, strict=False)) if a != b), None)
    if parted is None:
        return None
    row = engine.logits(engine.tokenize([{"role": "user", "content": prompt}]) + list(off[:parted]))[-1]
    best, second = sorted(row)[-2:][::-1]
    return float(best - second)


def speed(runs: list[dict[str, Result]], mode: str) -> float:
    """Decode tok/s of ``mode`` over ``runs``: tokens after the first, over the time from the first to the last."""
    seconds = tokens = 0.0
    for run in runs:
        times = run[mode].metrics.token_times_s
        if len(times) > 1:
            seconds, tokens = seconds + times[-1] - times[0], tokens + len(times) - 1
    return tokens / seconds if seconds else 0.0


if __name__ == "__main__":
    main()
