"""Prompt lookup replayed over recorded greedy answers: the decode speed-up its drafts would give at a given cost.

Greedy decoding with drafts gives the answer decoding without them gives (to llama.cpp's rounding of near ties),
so how prompt lookup drafts can be judged offline: the answers to ``scripts/data/speculative_prompts.jsonl`` are
recorded once with ``speculative="off"``, then ``PromptLookup`` drafts along each of them exactly as the engine
drives it, a step that verifies ``k`` drafted tokens costing ``1 + k * cost`` one-token steps (``--cost``: what
``bench_verify_cost.py`` measures, or the engine's ``draft_token_cost``). It prints per task the speed-up over
one token a step and the drafted tokens kept, and beside it the ceiling: a drafter that knew each answer and
drafted, from the same matches, exactly the tokens that would be kept.

    python scripts/replay_drafts.py --answers /tmp/answers.json            # records them the first time
    python scripts/replay_drafts.py --answers /tmp/answers.json --cost 0.25 --cost 0.4 --cost 0.7
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

from edgeinfer import Engine
from edgeinfer.models.catalog import DEFAULT_MODEL
from edgeinfer.speculative import MAX_DRAFT, PromptLookup
from edgeinfer.system import thread_count

PROMPTS = Path(__file__).parent / "data" / "speculative_prompts.jsonl"
# Draws a draft for a lookup over an answer's text so far: (lookup, room, the answer's tokens still to come) -> draft.
Policy = Callable[[PromptLookup, int, list[int]], list[int]]


def record(path: Path, model: str, threads: int, max_tokens: int) -> list[dict]:
    rows = [json.loads(line) for line in PROMPTS.read_text().splitlines() if line.strip()]
    answers = []
    with Engine(model, threads=threads, kv_budget="2048tok", speculative="off") as engine:
        for row in rows:
            messages = [{"role": "user", "content": row["prompt"]}]
            result = engine.chat(messages, temperature=0, max_tokens=max_tokens)
            answers.append({"task": row["task"], "prompt": engine.tokenize(messages), "answer": result.tokens})
    path.write_text(json.dumps(answers))
    return answers


def kept_of(draft: list[int], coming: list[int]) -> int:
    """How many of ``draft`` greedy verification keeps: those that are the answer's next tokens (the last of the
    answer is drawn, never drafted)."""
    kept = 0
    while kept < len(draft) and kept < len(coming) - 1 and draft[kept] == coming[kept]:
        kept += 1
    return kept


def replay(answers: list[dict], cost: float, policy: Policy, max_tokens: int) -> dict[str, tuple[float, int, int]]:
    """Per task: the speed-up over one token a step, drafted tokens kept, drafted tokens."""
    totals: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0, 0])
    for item in answers:
        answer = item["answer"]
        lookup = PromptLookup(item["prompt"] + answer[:1])  # the first token comes from the prompt's evaluation
        done, steps, drafted, kept = 1, 0.0, 0, 0
        while done < len(answer):
            room = max(0, min(max_tokens - done - 1, MAX_DRAFT))
            draft = policy(lookup, room, answer[done:])
            accepted = kept_of(draft, answer[done:])
            if draft:
                lookup.verified(len(draft), accepted)
            steps += 1 + len(draft) * cost
            drafted, kept = drafted + len(draft), kept + accepted
            lookup.extend(answer[done : done + accepted + 1])
            done += accepted + 1
        total = totals[item["task"]]
        total[0] += len(answer) - 1
        total[1] += steps
        total[2] += kept
        total[3] += drafted
    return {task: (tokens / steps, int(kept), int(drafted)) for task, (tokens, steps, kept, drafted) in totals.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--answers", type=Path, required=True, help="recorded answers: read, or recorded here")
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--threads", type=int)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--cost", type=float, action="append", help="a drafted token's cost (default: 0.4, 0.7)")
    args = parser.parse_args()
    if args.answers.exists():
        answers = json.loads(args.answers.read_text())
    else:
        answers = record(args.answers, args.model, thread_count(args.threads), args.max_tokens)
    for cost in args.cost or [0.4, 0.7]:
        engine_like = replay(
            answers, cost, lambda lookup, room, coming, cost=cost: lookup.draft(room, cost), args.max_tokens
        )
        ceiling = replay(
            answers,
            cost,
            lambda lookup, room, coming: (match := lookup.match(room)[0])[: kept_of(match, coming)],
            args.max_tokens,
        )
        print(f"a drafted token at {cost} of a step")
        print(f"  {'task':10} {'lookup':>8} {'kept/drafted':>14} {'ceiling':>8}")
        for task, (speedup, kept, drafted) in engine_like.items():
            print(f"  {task:10} {speedup:7.3f}x {f'{kept}/{drafted}':>14} {ceiling[task][0]:7.3f}x")


if __name__ == "__main__":
    main()
