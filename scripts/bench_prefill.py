"""Prompt chunk size (Engine's batch_size): cold prefill speed against what a chat's next turn re-evaluates.

The engine evaluates prompts in chunks aligned to multiples of batch_size and reuses a
cached prefix only in whole chunks, so that greedy output does not depend on the cache.
Large chunks prefill a little faster; small chunks keep more of a chat cached.

For each batch size, in one process on the same model and threads, taking turns run by
run so drifting load hits all sizes alike:

- cold prefill tok/s: a --prompt-tokens raw prompt from an empty cache (median over runs);
- next turn: a chat of --turns short turns; for the last turn, the prompt tokens the engine
  evaluates (not reused from the cache) and its time to first token (median over runs).

Reproduce (on a quiet machine; --threads at most the free physical cores):

    python scripts/bench_prefill.py --threads 2 --prompt-tokens 1024 --runs 5
"""

from __future__ import annotations

import argparse
import json
import statistics
from typing import Any

from edgeinfer import Engine
from edgeinfer.models.catalog import DEFAULT_MODEL
from edgeinfer.system import thread_count

SIZES = (16, 32, 64, 128, 256, 512)
TEXT = (
    "The lighthouse keeper wrote in his log every evening: the wind, the colour of the sea, "
    "the ships that passed and the birds that rested on the rail. "
)
QUESTIONS = (
    "Which ships passed today?",
    "What was the wind like?",
    "Did any birds rest on the rail?",
    "What colour was the sea?",
    "Write tomorrow's first log line.",
)


def cold_prefill(engine: Engine, text: str) -> float:
    engine.reset()
    m = engine.generate(text, max_tokens=1, temperature=0).metrics
    return m.prompt_tokens / m.prefill_s


def next_turn(engine: Engine, turns: int) -> tuple[int, float]:
    """Evaluated prompt tokens and TTFT of a chat's last turn, the earlier turns answered greedily."""
    engine.reset()
    messages: list[dict[str, str]] = [{"role": "system", "content": "You keep a lighthouse. Answer briefly."}]
    for question in QUESTIONS[: turns - 1]:
        messages.append({"role": "user", "content": question})
        messages.append({"role": "assistant", "content": engine.chat(messages, temperature=0, max_tokens=32).text})
    messages.append({"role": "user", "content": QUESTIONS[turns - 1]})
    m = engine.chat(messages, temperature=0, max_tokens=1).metrics
    return m.prompt_tokens - m.cached_tokens, m.ttft_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--turns", type=int, default=len(QUESTIONS), choices=range(2, len(QUESTIONS) + 1))
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    threads = thread_count(args.threads)

    engines = {size: Engine(args.model, kv_budget="2048tok", threads=threads, batch_size=size) for size in SIZES}
    try:
        first = engines[SIZES[0]]
        ids = first.tokenize(TEXT * (args.prompt_tokens // 20 + 1))[: args.prompt_tokens]
        text = first.tokenizer.decode(ids)
        rows: dict[int, dict[str, list[float]]] = {size: {"prefill": [], "evaluated": [], "ttft": []} for size in SIZES}
        for run in range(args.runs + 1):  # run 0 warms up
            order = SIZES if run % 2 else SIZES[::-1]
            for size in order:
                speed = cold_prefill(engines[size], text)
                evaluated, ttft = next_turn(engines[size], args.turns)
                if run:
                    rows[size]["prefill"].append(speed)
                    rows[size]["evaluated"].append(evaluated)
                    rows[size]["ttft"].append(ttft)
    finally:
        for engine in engines.values():
            engine.close()

    report: list[dict[str, Any]] = []
    best = max(statistics.median(r["prefill"]) for r in rows.values())
    for size in SIZES:
        prefill = statistics.median(rows[size]["prefill"])
        report.append(
            {
                "batch_size": size,
                "prefill_tok_s": round(prefill, 1),
                "prefill_vs_best": round(prefill / best, 3),
                "next_turn_evaluated_tokens": int(statistics.median(rows[size]["evaluated"])),
                "next_turn_ttft_ms": round(1000 * statistics.median(rows[size]["ttft"]), 1),
            }
        )
    if args.json:
        print(json.dumps({"threads": threads, "prompt_tokens": len(ids), "turns": args.turns, "rows": report}))
        return
    print(f"{len(ids)}-token cold prefill and turn {args.turns} of a chat, {threads} threads, {args.runs} runs")
    print("batch  prefill tok/s  vs best  next turn: evaluated tokens  TTFT ms")
    for r in report:
        print(
            f"{r['batch_size']:5}  {r['prefill_tok_s']:13.1f}  {r['prefill_vs_best']:7.3f}  "
            f"{r['next_turn_evaluated_tokens']:26}  {r['next_turn_ttft_ms']:7.1f}"
        )


if __name__ == "__main__":
    main()
