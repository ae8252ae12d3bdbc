"""Fuzz edgeinfer's GGUF validation: mutate small valid models, validate each, load what passes in llama.cpp.

    python scripts/fuzz_gguf.py --count 2000 --seed 0

Every mutant must either be rejected with InvalidModelError (counted by the field its
message names) or load in real llama.cpp, tokenize, render its vocabulary and generate,
in a child process that a crash cannot take this one down with. Validation must take
under --max-seconds per file and allocate under --max-mb. Files that sit exactly at the
reader's limits (the most keys, strings, tokens) are timed too, each in a fresh process
that reports its peak RSS (from /proc: Linux only). Exits 1 on any failure.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
import traceback
from collections import Counter
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(CHECKOUT), str(CHECKOUT / "tests")]  # this checkout's edgeinfer, not an installed one

from gguf_mutate import limit_files, mutants, reason, validate  # noqa: E402
from native_load import load_in_llamacpp  # noqa: E402
from tiny_model import write_tiny_gguf  # noqa: E402

# Two small models that between them cover both tokenizers, biases, an output matrix and quantized weights.
BASES = {
    "llama-gpt2-q8": dict(arch="llama", tokenizer="gpt2", tensor_type="Q8_0", tied=True),
    "qwen2-spm-f32": dict(arch="qwen2", tokenizer="llama", tensor_type="F32", tied=False),
}
SMALL = dict(n_layer=1, n_embd=64, n_head=2, n_head_kv=1, n_ff=128)
# Left to llama.cpp and the engine on purpose: llama.cpp's list of pre-tokenizers changes from
# release to release, and validation reads no weights (a flipped byte can make a NaN).
EXPECTED_NATIVE_REFUSALS = ("unknown pre-tokenizer type", "NaN or infinite logits")

# Validation in a fresh process, without tracemalloc (which slows the string loops 20-fold):
# prints seconds, peak RSS growth in bytes, and the outcome. The peak is Linux's VmHWM:
# ru_maxrss would include the parent's RSS, which Linux carries across exec.
_MEASURE = """
import sys, time
from edgeinfer.errors import InvalidModelError
from edgeinfer.models.info import load_model_info
def peak_kib():
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:"))
before = peak_kib()
start = time.perf_counter()
try:
    load_model_info(sys.argv[1])
    outcome = "accepted"
except InvalidModelError as exc:
    outcome = str(exc)
seconds = time.perf_counter() - start
print(seconds, (peak_kib() - before) * 1024, outcome, sep="\\n")
"""


def measure_in_child(path: Path) -> tuple[float, int, str]:
    out = subprocess.run(
        [sys.executable, "-c", _MEASURE, str(path)], capture_output=True, text=True, check=True, cwd=CHECKOUT
    ).stdout
    seconds, rss, outcome = out.split("\n", 2)
    return float(seconds), int(rss), outcome.strip()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=2000, help="mutants in all, split between the base models")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-seconds", type=float, default=2.0, help="longest validation allowed per file")
    parser.add_argument("--max-mb", type=float, default=64.0, help="most memory validation may allocate per file")
    parser.add_argument("--no-native", action="store_true", help="validate only; skip loading in llama.cpp")
    args = parser.parse_args()

    failures: list[str] = []
    rejected: Counter[str] = Counter()
    accepted: list[tuple[Path, str]] = []
    worst_time, worst_mem = (0.0, ""), (0, "")
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="fuzz-gguf-") as tmp:
        workdir = Path(tmp)
        bases = {name: write_tiny_gguf(workdir / f"{name}.gguf", **spec, **SMALL) for name, spec in BASES.items()}
        per_base = -(-args.count // len(bases))
        for name, base in bases.items():
            for i, data, what in mutants(base.read_bytes(), per_base, args.seed):
                case = f"{name}#{i} ({what})"
                path = workdir / f"{name}-{i:05d}.gguf"
                path.write_bytes(data)
                try:
                    result = validate(path)
                except Exception as exc:  # a traceback instead of a one-line error: the bug this hunts
                    failures.append(f"{case}: {type(exc).__name__}: {exc} at {traceback.format_exc(limit=-1)}")
                    path.unlink()
                    continue
                worst_time = max(worst_time, (result.seconds, case))
                worst_mem = max(worst_mem, (result.peak_bytes, case))
                if result.seconds > args.max_seconds:
                    failures.append(f"{case}: validation took {result.seconds:.2f} s")
                if result.peak_bytes > args.max_mb * 2**20:
                    failures.append(f"{case}: validation allocated {result.peak_bytes / 2**20:.1f} MiB")
                if result.accepted:
                    accepted.append((path, case))
                else:
                    rejected[reason(result.message, path.name)] += 1
                    path.unlink()
        validated = time.perf_counter()

        limits = []
        for name, data in limit_files().items():
            path = workdir / "limit.gguf"
            path.write_bytes(data)
            seconds, rss, outcome = measure_in_child(path)
            limits.append(
                f"  {name} ({len(data) / 2**20:.1f} MiB): {seconds * 1000:.0f} ms, +{rss / 2**20:.1f} MiB RSS"
            )
            if seconds > args.max_seconds or rss > args.max_mb * 2**20:
                failures.append(f"at the limits, {name}: {seconds:.2f} s, {rss / 2**20:.1f} MiB: {outcome}")
            path.unlink()
        measured = time.perf_counter()

        native: Counter[str] = Counter()
        if accepted and not args.no_native:
            valid = next(iter(bases.values()))
            for outcome, (_, case) in zip(load_in_llamacpp([p for p, _ in accepted], valid), accepted, strict=True):
                native[outcome.status] += 1
                if outcome.status in ("crashed", "hung"):
                    failures.append(f"{case}: llama.cpp {outcome.status}: {outcome.detail}")
                elif outcome.status == "refused":
                    native[f"refused: {reason(outcome.detail, outcome.path.name)}"] += 1
                    if not any(r in outcome.detail for r in EXPECTED_NATIVE_REFUSALS):
                        failures.append(f"{case}: passed validation, but llama.cpp refused it: {outcome.detail}")

    total = per_base * len(bases)
    print(f"{total} mutants (seed {args.seed}) from {', '.join(BASES)}")
    print(f"rejected by validation: {sum(rejected.values())}")
    for message, n in rejected.most_common():
        print(f"  {n:5d}  {message}")
    print(f"accepted by validation: {len(accepted)}")
    if not args.no_native:
        for status, n in sorted(native.items()):
            print(f"  {n:5d}  llama.cpp {status}")
    print(f"worst validation time: {worst_time[0] * 1000:.1f} ms ({worst_time[1]})")
    print(f"peak validation memory: {worst_mem[0] / 2**20:.2f} MiB ({worst_mem[1]})")
    print("validation of files at the reader's limits, each in a fresh process:")
    print("\n".join(limits))
    print(
        f"time: validation {validated - started:.1f} s, limits {measured - validated:.1f} s, "
        f"llama.cpp loads {time.perf_counter() - measured:.1f} s"
    )
    print(f"failures: {len(failures)}")
    for failure in failures:
        print(f"  {failure}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
