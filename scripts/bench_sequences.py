"""Several KV sequences: answers decoded together against one after another, and the router's samples.

    python scripts/bench_sequences.py --threads 2 --runs 3 [--backend onnxruntime] [--held 3456]

Prints aggregate decode tokens/s for N greedy answers of the same prompt decoded together
(``Engine.generate_batch``, one ``llama_decode`` per step for all of them), asked from N threads at once
(``Engine.chat`` in each: the engine batches them the same way) and one after another,
and the router's time to first token with ``samples=4`` (the samples decoded together, sharing
the prompt's KV). Runs alternate, so both sides see the same machine.

With ``--held N`` it also prints one sequence's decode tokens/s, straight on the backend, alone and while
another sequence holds 128 cells placed above N cells of the pool: what the cells an idle conversation
keeps for the prefix cache cost every other sequence's steps. The placement is llama.cpp's (it hands out
the lowest free cells); on another backend the figure says nothing about where cells sit.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
from pathlib import Path
from time import perf_counter

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from edgeinfer import CloudModel, Engine, Policy, Router, SamplingParams  # noqa: E402
from edgeinfer.backends.base import Backend, Span  # noqa: E402
from edgeinfer.models.catalog import DEFAULT_MODEL  # noqa: E402

JAPAN = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the capital of Japan?"},
]
STORY = [{"role": "user", "content": "Tell me a long story about a lighthouse keeper."}]


def decode_rate(engine: Engine, n: int, tokens: int, how: str) -> float:
    """Aggregate output tokens per second of decode (prompt evaluation excluded) for ``n`` answers, decoded
    ``together`` (generate_batch), from ``threads``, or ``apart``."""
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    engine.reset()
    engine.chat(STORY, max_tokens=1)  # the prompt cached: both sides then decode only
    if how == "together":
        results = engine.generate_batch(STORY, [params] * n)
        decode_s = max(r.metrics.decode_s for r in results)  # one step decodes all of them
    elif how == "threads":
        results = []
        askers = [threading.Thread(target=lambda: results.append(engine.chat(STORY, params))) for _ in range(n)]
        for asker in askers:
            asker.start()
        for asker in askers:
            asker.join()
        decode_s = max(r.metrics.decode_s for r in results)  # each counts the steps it shared
    else:
        results = [engine.chat(STORY, params) for _ in range(n)]
        decode_s = sum(r.metrics.decode_s for r in results)
    return sum(len(r.tokens) - 1 for r in results) / decode_s  # the first token of each is drawn from the prompt


def held_cells_rate(backend: Backend, held: int, tokens: int) -> tuple[float, float]:
    """Decode tokens/s of sequence 0 after a 128-token prompt: alone, and with sequence 1 holding 128 cells above
    the ``held`` cells sequence 2 took first and gave back (llama.cpp hands out the lowest free cells)."""

    def fill(seq: int, n: int) -> None:
        for first in range(0, n, 64):
            backend.eval([Span(seq, first, [(first + i) % 1000 + 100 for i in range(min(64, n - first))])])

    def decode() -> float:
        fill(0, 128)
        start = perf_counter()
        for position in range(128, 128 + tokens):
            backend.eval([Span(0, position, [123])])
        rate = tokens / (perf_counter() - start)
        backend.truncate(0, 0)
        return rate

    alone = decode()
    fill(2, held)
    fill(1, 128)
    backend.truncate(2, 0)
    beside = decode()
    backend.truncate(1, 0)
    return alone, beside


def router_ttft(engine: Engine, samples: int) -> float:
    # The cloud is never called: threshold 10 keeps every prompt local; the URL is never dialled.
    router = Router(
        engine,
        CloudModel("http://127.0.0.1:9/v1", "none", api_key="unused"),
        policy=Policy("auto", threshold=10.0, samples=samples),
    )
    engine.reset()
    start = perf_counter()
    with router.stream(JAPAN, temperature=0, max_tokens=16) as stream:
        next(stream)
        ttft = perf_counter() - start
        for _ in stream:
            pass
    return ttft


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--sequences", type=int, nargs="+", default=[2, 4])
    parser.add_argument(
        "--held", type=int, metavar="N",
        help="also time decode beside 128 cells held above N (llama.cpp's cells: it hands out the lowest free ones)",
    )  # fmt: skip
    args = parser.parse_args()
    if args.held is not None:
        budget = f"{args.held + 128 + 128 + args.tokens}tok"
        with Engine(args.model, backend=args.backend, kv_budget=budget, threads=args.threads, sequences=3) as engine:
            pairs = [held_cells_rate(engine.backend, args.held, args.tokens) for _ in range(args.runs)]
        alone, beside = (statistics.median(pair[i] for pair in pairs) for i in (0, 1))
        print(
            f"one answer: alone {alone:.1f} tok/s, beside 128 cells held above {args.held} {beside:.1f} tok/s; "
            f"ratio {beside / alone:.2f}x"
        )
    with Engine(args.model, backend=args.backend, kv_budget="2048tok", threads=args.threads) as engine:
        for n in args.sequences:
            rates: dict[str, list[float]] = {"together": [], "threads": [], "apart": []}
            for _ in range(args.runs):
                for how, measured in rates.items():
                    measured.append(decode_rate(engine, n, args.tokens, how))
            t, th, a = (statistics.median(rates[how]) for how in ("together", "threads", "apart"))
            print(
                f"{n} answers: together {t:.1f} tok/s, from {n} threads {th:.1f} tok/s, one after another "
                f"{a:.1f} tok/s; ratios {t / a:.2f}x and {th / a:.2f}x"
            )
        for samples in (0, 4):
            ttft = statistics.median(router_ttft(engine, samples) for _ in range(args.runs))
            print(f"router samples={samples}: TTFT {ttft * 1000:.0f} ms")


if __name__ == "__main__":
    main()
