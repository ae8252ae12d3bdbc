"""A long generation through a small KV budget: memory must stay flat.

Expected: a 20,000-token generation through a 512-token budget completes under
``sinks`` and ``shift``, evicting as it goes, with resident memory flat once the
cache has filled; under ``error`` it stops with ContextFull at the budget.

For each policy, a fresh Engine streams a short raw prompt with EOS ignored and
samples the process RSS about every 500 tokens. "RSS growth" is the RSS at the end
minus the RSS at the first sample from 1,000 tokens on (the cache is full and the
first evictions are done by then): with a fixed budget it should be ~0.

Reproduce (on a quiet machine; --threads at most the free physical cores):

    python scripts/kv_soak.py --tokens 20000 --kv-budget 512tok --threads 2 --seed 0 [--backend onnxruntime]
"""

from __future__ import annotations

import argparse
import json
from time import perf_counter
from typing import Any

import psutil

from edgeinfer import Engine
from edgeinfer.errors import ContextFull
from edgeinfer.kv import POLICIES
from edgeinfer.models.catalog import DEFAULT_MODEL
from edgeinfer.system import thread_count

PROMPT = "Here is a long story about a lighthouse keeper and the sea. Chapter one."
SAMPLE_EVERY = 500
WARM = 1000  # tokens after which the cache has filled and RSS should stop moving
MIB = 2**20


def soak(model: str, backend: str, policy: str, budget: str, n_tokens: int, threads: int, seed: int) -> dict[str, Any]:
    process = psutil.Process()
    samples: list[tuple[int, int]] = []  # (chunks so far, RSS bytes)
    out: dict[str, Any] = {"policy": policy}
    with Engine(model, backend=backend, kv_budget=budget, kv_policy=policy, threads=threads) as engine:
        stream = engine.stream(PROMPT, max_tokens=n_tokens, ignore_eos=True, temperature=0.8, seed=seed)
        # A chunk is one token's text, except that a character split across tokens arrives
        # once whole and an empty piece yields nothing: chunks count tokens closely enough
        # to place RSS samples; the exact totals come from the engine afterwards.
        chunks, first, error = 0, 0.0, None
        try:
            for _ in stream:
                chunks += 1
                if chunks == 1:
                    first = perf_counter()
                if chunks % SAMPLE_EVERY == 0:
                    samples.append((chunks, process.memory_info().rss))
        except ContextFull as exc:
            error = exc
        end = perf_counter()
        if error is not None:
            # The last sampled token was shown but not yet cached, hence the + 1.
            out.update(tokens=engine.kv_used - len(engine.tokenize(PROMPT)) + 1, finish_reason="ContextFull")
            out.update(error=str(error), kv_evicted=0)  # the error policy raises instead of evicting
        else:
            assert stream.result is not None
            m = stream.result.metrics
            out.update(tokens=m.output_tokens, finish_reason=stream.result.finish_reason, error=None)
            out.update(kv_evicted=m.kv_evicted)
        # One clock for every policy (ContextFull carries no metrics): first chunk to the end.
        out["decode_tok_s"] = (out["tokens"] - 1) / (end - first) if chunks > 1 else None
        samples.append((chunks, process.memory_info().rss))
        out.update(kv_used=engine.kv_used, kv_capacity=engine.capacity)
    warm = next((rss for n, rss in samples if n >= WARM), None)
    out.update(
        rss_samples_mib=[(n, rss / MIB) for n, rss in samples],
        rss_warm_mib=None if warm is None else warm / MIB,
        rss_max_mib=max(rss for _, rss in samples) / MIB,
        rss_end_mib=samples[-1][1] / MIB,
        rss_growth_mib=None if warm is None else (samples[-1][1] - warm) / MIB,
    )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--tokens", type=int, default=20000)
    ap.add_argument("--kv-budget", default="512tok")
    ap.add_argument("--policies", default="sinks,shift,error", help="comma-separated: sinks, shift, error")
    ap.add_argument("--threads", type=int, default=None, help="default: the free cores (edgeinfer.system)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = ap.parse_args()
    threads = thread_count(args.threads)
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    if not policies or not set(policies) <= set(POLICIES):
        ap.error(f"--policies takes a comma-separated subset of {','.join(POLICIES)}")
    runs = [soak(args.model, args.backend, p, args.kv_budget, args.tokens, threads, args.seed) for p in policies]

    if args.json:
        print(json.dumps({"tokens": args.tokens, "kv_budget": args.kv_budget, "threads": threads,
                          "seed": args.seed, "policies": runs}, indent=2))  # fmt: skip
        return

    def num(v: float | None) -> str:
        return "-" if v is None else f"{v:.1f}"

    print(f"{args.tokens} tokens through a {args.kv_budget} KV budget, threads={threads}, seed={args.seed}")
    print(f"{'policy':<7} {'tokens':>7} {'finish':<12} {'evicted':>8} {'KV used':>9} {'tok/s':>7} "
          f"{'RSS@1k MiB':>10} {'max':>7} {'end':>7} {'growth':>7}")  # fmt: skip
    for r in runs:
        print(f"{r['policy']:<7} {r['tokens']:>7} {r['finish_reason']:<12} {r['kv_evicted']:>8} "
              f"{r['kv_used']:>4}/{r['kv_capacity']:<4} {num(r['decode_tok_s']):>7} {num(r['rss_warm_mib']):>10} "
              f"{num(r['rss_max_mib']):>7} {num(r['rss_end_mib']):>7} {num(r['rss_growth_mib']):>7}")  # fmt: skip
    for r in runs:
        if r["error"]:
            print(f"{r['policy']}: stopped after {r['tokens']} tokens: {r['error']}")


if __name__ == "__main__":
    main()
