"""What checking a draft costs: one backend evaluation of 1 + k tokens against one of a single token.

Speculative decoding pays where verifying k drafted tokens costs little more than decoding one. This
times, through the backend contract, a decode step that carries the drawn token and k drafted ones
(``Span(..., all_logits=True)``, as the engine's verification does) after a 64-token prefix, for
each model file given, and prints each k's time as a multiple of k = 0's and the cost of one drafted
token as a share of a step ((t(k) / t(0) - 1) / k), the figure ``edgeinfer.speculative`` assumes:

    python scripts/bench_verify_cost.py --threads 2
    python scripts/bench_verify_cost.py model-q4_0.gguf model-f16.gguf --threads 2 --json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from edgeinfer import Engine
from edgeinfer.backends.base import Span
from edgeinfer.models.catalog import DEFAULT_MODEL
from edgeinfer.system import thread_count

PREFIX = 64
DRAFTS = (0, 1, 2, 3, 4, 8)


def step_seconds(engine: Engine, drafted: int, repeats: int) -> float:
    """The median time of one evaluation of 1 + ``drafted`` tokens after a PREFIX-token prefix."""
    backend = engine.backend
    tokens = [(17 * i + 3) % 1000 + 100 for i in range(PREFIX + 1 + drafted)]
    backend.eval([Span(0, 0, tokens[:PREFIX])])
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        backend.eval([Span(0, PREFIX, tokens[PREFIX:], all_logits=True)])
        times.append(time.perf_counter() - start)
        backend.truncate(0, PREFIX)
    backend.truncate(0, 0)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", nargs="*", default=[DEFAULT_MODEL])
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--threads", type=int)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--json", action="store_true", help="Print one JSON object instead of a table.")
    args = parser.parse_args()
    threads = thread_count(args.threads)
    report = {}
    for model in args.models:
        with Engine(model, backend=args.backend, threads=threads, kv_budget="512tok") as engine:
            step_seconds(engine, 0, 3)  # warm-up
            seconds = {k: step_seconds(engine, k, args.repeats) for k in DRAFTS}
        report[model] = {
            "step_ms": {k: s * 1e3 for k, s in seconds.items()},
            "drafted_token_cost": {k: (seconds[k] / seconds[0] - 1) / k for k in DRAFTS if k},
        }
    if args.json:
        print(json.dumps({"threads": threads, "prefix": PREFIX, "models": report}, indent=2))
        return
    print(f"{'model':<40} " + " ".join(f"{f'1+{k}':>13}" for k in DRAFTS))
    for model, r in report.items():
        cells = [f"{r['step_ms'][0]:>10.1f} ms"] + [
            f"{r['step_ms'][k]:>6.1f} ({r['drafted_token_cost'][k]:.2f})" for k in DRAFTS if k
        ]
        print(f"{model[-40:]:<40} " + " ".join(f"{c:>13}" for c in cells))
    print("each: ms for the step (what one drafted token costs, as a share of a one-token step)")


if __name__ == "__main__":
    main()
