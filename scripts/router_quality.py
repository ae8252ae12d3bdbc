"""Router quality benchmark: how much of the local-to-cloud quality gap each escalation signal recovers.

The local side is SmolLM2-135M (greedy); the cloud side is the test OpenAI server from tests/,
run as an oracle that answers each question with its accepted answer. For every question the
local model answers in full and every signal is recorded; then, for each signal and for the
``auto`` score, questions go to the cloud in order of falling score and we report:

- local accuracy, and the accuracy a perfect router would reach at 50% cloud calls;
- the cloud share needed to recover 50% and 80% of the gap between local and cloud quality;
- APGR: the area under the gap-recovered-vs-cloud-share curve (random routing: 0.5; RouteLLM's metric);
- AUROC of the score for predicting a wrong local answer;
- the gap recovered at 50% cloud calls (the target: >= 75%; random recovers 50%).

The ``auto`` weights in edgeinfer/routing/signals.py were fitted to the questions of
scripts/data/router_questions.jsonl (``calibration.fit_weights``, a non-negative logistic
regression; the fit is printed at the end, to paste there), so the ``auto (shipped weights)``
figures on them are in-sample and optimistic. Two out-of-sample estimates follow:

- ``auto (5-fold CV)`` refits the weights the same way on four fifths of the questions and scores
  the fifth; it is averaged over 10 random splits into folds.
- the held-out questions (scripts/data/router_questions_heldout.jsonl, same categories in the
  same proportions) were written after the other weights were fitted; no weight and no variant
  of ``disagreement`` was chosen on them (docs/BENCHMARKS.md says what they did steer). The
  shipped weights score them as they would any user's questions. Both sets together are also
  cross-validated.

Finally the real Router runs every question with ``auto`` at the threshold ``calibrate`` picks
for a 50% cloud share, through real HTTP to the oracle, and the answers it returns are graded.

    python scripts/router_quality.py                      # about 8 minutes on 2 free cores
    python scripts/router_quality.py --save runs.json     # keep the per-question records
    python scripts/router_quality.py --load runs.json     # figures again, without the model
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from edgeinfer import CloudModel, Engine, Message, Policy, Router  # noqa: E402
from edgeinfer.routing.calibration import (  # noqa: E402
    apgr,
    auroc,
    fit_weights,
    is_correct,
    load_questions,
    recovery_curve,
    share_to_recover,
    threshold_for_share,
)
from edgeinfer.routing.router import assess, generation_signals  # noqa: E402
from edgeinfer.routing.signals import SCORED, SIGNALS, WEIGHTS, escalation_score, task_signals  # noqa: E402

from openai_server import OpenAIServer  # noqa: E402

SYSTEM = "You are a helpful assistant."  # SmolLM2's own system prompt makes it answer in French
QUESTIONS = ROOT / "scripts" / "data" / "router_questions.jsonl"
HELDOUT = ROOT / "scripts" / "data" / "router_questions_heldout.jsonl"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--questions", type=Path, default=QUESTIONS)
    parser.add_argument("--heldout", type=Path, default=HELDOUT, help="questions scored with the shipped weights")
    parser.add_argument("--no-heldout", action="store_true", help="skip the held-out questions")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument(
        "--samples", type=int, default=0, help="Policy(samples=N): the disagreement signal (--load: as saved)"
    )
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--save", type=Path, help="write the per-question records here (JSON)")
    parser.add_argument("--load", type=Path, help="read per-question records instead of running the model")
    parser.add_argument("--no-route", action="store_true", help="skip the end-to-end run through the Router")
    args = parser.parse_args()

    questions = load_questions(args.questions)
    heldout = [] if args.no_heldout else load_questions(args.heldout)
    answers = {q.question: q.answers[0] for q in questions}
    started = time.perf_counter()
    with OpenAIServer(answers=answers) as oracle:
        engine = None if args.load and args.no_route else Engine(kv_budget="2048tok", threads=args.threads)
        cloud = CloudModel(oracle.url, "oracle", api_key="not-needed")
        if args.load:
            saved = json.loads(args.load.read_text())
            records, held, samples = saved["questions"], saved["heldout"], saved["samples"]
        else:
            assert engine is not None
            samples = args.samples
            router = Router(engine, cloud, policy=Policy(samples=samples))
            records = assess_all(router, questions, args.max_tokens)
            held = assess_all(router, heldout, args.max_tokens)
        if args.save:
            args.save.write_text(json.dumps({"samples": samples, "questions": records, "heldout": held}))
        report(records)
        if held:
            report_heldout(records, held)
        if engine is not None and not args.no_route:
            route_all(engine, cloud, questions, records, args.max_tokens, samples)
    print(
        f"\n{len(records)} questions from {args.questions.name}, {len(held)} held out; "
        f"{time.perf_counter() - started:.0f} s in all"
    )


def messages_for(question: str) -> list[Message]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


def assess_all(router: Router, questions: list, max_tokens: int) -> list[dict]:
    records = []
    for i, q in enumerate(questions, 1):
        messages = messages_for(q.question)
        found = assess(router.local, messages, policy=router.policy, temperature=0, max_tokens=max_tokens)
        records.append(
            {
                "question": q.question,
                "category": q.category,
                "correct": is_correct(found.result.text, q.answers),
                "signals": found.signals,
                "score": found.score,
                "logprobs": found.result.logprobs,
                "entropies": found.result.entropies,
                "reply": found.result.text,
            }
        )
        print(f"\r{i}/{len(questions)} assessed", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    return records


def measures(scores: list[float], correct: list[bool]) -> np.ndarray:
    """Cloud share for 50% and 80% of the gap, APGR, AUROC, and the gap recovered at 50% cloud calls."""
    shares, recovered = recovery_curve(scores, correct)
    return np.array(
        [
            share_to_recover(scores, correct, 0.5),
            share_to_recover(scores, correct, 0.8),
            apgr(scores, correct),
            auroc(scores, [not c for c in correct]),
            float(np.interp(0.5, shares, recovered)),
        ]
    )


def figures(scores: list[float], correct: list[bool]) -> str:
    return formatted(measures(scores, correct))


def formatted(m: np.ndarray) -> str:
    return f"{m[0]:>6.2f} {m[1]:>6.2f} {m[2]:>6.3f} {m[3]:>6.3f} {m[4]:>8.1%}"


def rescore(records: list[dict]) -> None:
    """Scores from the signals as defined now, so --load follows changes to them."""
    k = Policy().probe_tokens
    for r in records:
        if "arithmetic" in r["signals"]:
            r["signals"].update(task_signals(r["question"]))
        r["signals"].update(generation_signals(r["logprobs"], r["entropies"], k))
        r["score"] = escalation_score(r["signals"])


def accuracy_and_header(records: list[dict]) -> None:
    """Local accuracy overall and by category, then the header of the figures' table."""
    correct: list[bool] = [r["correct"] for r in records]
    a = float(np.mean(correct))
    print(f"local accuracy: {a:.1%} ({sum(correct)}/{len(records)}); the oracle cloud: 100%")
    print(f"a perfect router recovers {min(1.0, 0.5 / (1 - a)):.0%} of the gap at 50% cloud calls; random 50%")
    by_category: dict[str, list[bool]] = {}
    for r in records:
        by_category.setdefault(r["category"], []).append(r["correct"])
    print("by category: " + ", ".join(f"{c} {np.mean(v):.0%} of {len(v)}" for c, v in sorted(by_category.items())))
    print(f"\n{'signal':<28} {'s@50%':>6} {'s@80%':>6} {'APGR':>6} {'AUROC':>6} {'gap@50%':>8}")


def report(records: list[dict]) -> None:
    rescore(records)
    correct: list[bool] = [r["correct"] for r in records]
    accuracy_and_header(records)
    for name in SIGNALS:
        print(f"{name:<28} {figures([r['signals'].get(name, 0.0) for r in records], correct)}")
    for n in (4, 8, 16, 32):  # K, and the statistic over the first K tokens
        for q in (0.0, 0.1, 0.25):
            scores = [-float(np.quantile(r["logprobs"][:n], q)) if r["logprobs"] else 0.0 for r in records]
            print(f"{f'  log-prob q{q:g} of first {n}':<28} {figures(scores, correct)}")
        for q in (0.5, 1.0):
            scores = [float(np.quantile(r["entropies"][:n], q)) if r["entropies"] else 0.0 for r in records]
            print(f"{f'  entropy q{q:g} of first {n}':<28} {figures(scores, correct)}")
    print(f"{'auto (shipped weights)':<28} {figures([r['score'] for r in records], correct)}")
    print(f"{'auto (5-fold CV)':<28} {formatted(cross_validated(records, correct))}")
    print(f"{'random (all tied)':<28} {figures([0.0] * len(records), correct)}")
    print(f"shipped weights: {', '.join(f'{k} {v:g}' for k, v in WEIGHTS.items() if v)}")
    fitted = fit_weights([r["signals"] for r in records], [not c for c in correct], SCORED)
    print(f"weights fitted to these answers: {fitted}")


def report_heldout(records: list[dict], held: list[dict]) -> None:
    """The shipped weights on questions they were not fitted to, then both sets cross-validated."""
    rescore(held)
    correct: list[bool] = [r["correct"] for r in held]
    print("\nheld-out questions, scored with the shipped weights:")
    accuracy_and_header(held)
    for name in SCORED:
        print(f"{name:<28} {figures([r['signals'].get(name, 0.0) for r in held], correct)}")
    print(f"{'auto (shipped weights)':<28} {figures([r['score'] for r in held], correct)}")
    both = records + held
    print(f"{'both sets, auto (5-fold CV)':<28} {formatted(cross_validated(both, [r['correct'] for r in both]))}")


def cross_validated(records: list[dict], correct: list[bool], folds: int = 5, splits: int = 10) -> np.ndarray:
    """The measures of out-of-fold scores, weights refitted on the other folds; mean over random splits."""
    signals = [r["signals"] for r in records]
    found = []
    for seed in range(splits):
        order = np.random.default_rng(seed).permutation(len(records))
        scores = np.zeros(len(records))
        for test in np.array_split(order, folds):
            train = np.setdiff1d(order, test)
            weights = fit_weights([signals[i] for i in train], [not correct[i] for i in train], SCORED)
            scores[test] = [escalation_score(signals[i], weights) for i in test]
        found.append(measures(scores.tolist(), correct))
    return np.mean(found, axis=0)


def route_all(
    engine: Engine, cloud: CloudModel, questions: list, records: list[dict], max_tokens: int, samples: int
) -> None:
    threshold = threshold_for_share([r["score"] for r in records], 0.5)
    router = Router(engine, cloud, policy=Policy("auto", threshold=threshold, samples=samples))
    routes, right, started = [], [], time.perf_counter()
    for i, q in enumerate(questions, 1):
        result = router.chat(messages_for(q.question), temperature=0, max_tokens=max_tokens)
        routes.append(result.route)
        right.append(is_correct(result.text, q.answers))
        print(f"\r{i}/{len(questions)} routed", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    elapsed = time.perf_counter() - started
    local_accuracy = np.mean([r["correct"] for r in records])
    accuracy = np.mean(right)
    share = routes.count("cloud") / len(routes)
    print(
        f"\nend to end, auto at threshold {threshold:.3f} (calibrated for 50% cloud): {share:.1%} cloud calls, "
        f"accuracy {accuracy:.1%} (local alone {local_accuracy:.1%}), "
        f"{(accuracy - local_accuracy) / (1 - local_accuracy):.1%} of the gap recovered; "
        f"{elapsed / len(questions):.2f} s per question"
    )


if __name__ == "__main__":
    main()
