"""Our budgeted conversion against llama.cpp's Q4_K_M and Q3_K_M at the same file size.

For each HF checkpoint: convert it to F32 (the unquantized base) and F16 with edgeinfer,
quantize the F16 file with llama.cpp's own ``llama_model_quantize`` to Q4_K_M and Q3_K_M,
then convert the checkpoint again with ``--target-size`` set to each of those files' sizes.
Every file is scored with llama.cpp on held-out text: perplexity, and mean KL divergence from
the F32 base. Target: our KLD at least 20% below llama.cpp's at no larger a file.

    python scripts/convert_quality.py ../shared/models/tiny-qwen2 /tmp/smollm2-hf \\
        --calib calib.txt --eval heldout.txt --work /tmp/cq --json results.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from llamacpp_quantize import quantize_with_llamacpp  # noqa: E402

from edgeinfer.converters.convert import convert  # noqa: E402
from edgeinfer.engine import Engine  # noqa: E402
from edgeinfer.evaluate import evaluate  # noqa: E402
from edgeinfer.models.info import load_model_info  # noqa: E402

SCHEMES = ("Q4_K_M", "Q3_K_M")


def type_mix(path: Path) -> str:
    """Parameters per tensor type, as shares of the whole."""
    counts: dict[str, int] = {}
    for t in load_model_info(path).tensors:
        counts[t.type.name] = counts.get(t.type.name, 0) + math.prod(t.shape)
    total = sum(counts.values())
    return ", ".join(f"{name} {n / total:.0%}" for name, n in sorted(counts.items(), key=lambda kv: -kv[1]))


def score(path: Path, base: Engine, text: str, ctx: int, threads: int) -> dict:
    with Engine(path, backend="llamacpp", kv_budget=f"{ctx}tok", batch_size=ctx, threads=threads) as engine:
        report = evaluate(engine, text, ctx, base=base)
    assert report.comparison is not None
    info = load_model_info(path)
    n_params = sum(math.prod(t.shape) for t in info.tensors)
    return {
        "file": path.name,
        "bytes": path.stat().st_size,
        "bpw": 8 * sum(t.nbytes for t in info.tensors) / n_params,
        "ppl": report.perplexity,
        "kld": report.comparison.kld_mean,
        "top1": report.comparison.top1_agreement,
        "mix": type_mix(path),
    }


def run_checkpoint(hf: Path, args: argparse.Namespace) -> list[dict]:
    work = args.work / hf.name
    work.mkdir(parents=True, exist_ok=True)
    text = Path(args.eval).read_text(encoding="utf-8")
    base_path, f16 = work / "base-f32.gguf", work / "f16.gguf"
    convert(hf, base_path, qtype="f32")
    convert(hf, f16, qtype="f16")
    ctx = min(args.ctx, load_model_info(base_path).hparams.n_ctx_train)
    rows = []
    kv = f"{ctx}tok"
    with Engine(base_path, backend="llamacpp", kv_budget=kv, batch_size=ctx, threads=args.threads) as base:
        for scheme in SCHEMES:
            theirs = work / f"llamacpp-{scheme}.gguf"
            quantize_with_llamacpp(f16, theirs, scheme, args.threads)
            ours = work / f"ours-{scheme}-size.gguf"
            report = convert(
                hf, ours, target_size=theirs.stat().st_size, calib=args.calib, sensitivity=args.sensitivity
            )
            print(f"{hf.name} {scheme}: converted in {report.seconds:.1f} s, peak RSS "
                  f"{report.peak_rss_bytes / 2**20:.0f} MiB", file=sys.stderr)  # fmt: skip
            for who, path in (("llama.cpp " + scheme, theirs), ("edgeinfer at its size", ours)):
                row = {
                    "checkpoint": hf.name,
                    "scheme": scheme,
                    "who": who,
                    **score(path, base, text, ctx, args.threads),
                }
                print(json.dumps(row), file=sys.stderr)
                rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoints", nargs="+", type=Path, help="HF checkpoint folders")
    parser.add_argument("--calib", required=True, help="calibration text")
    parser.add_argument("--eval", required=True, help="held-out text, disjoint from --calib")
    parser.add_argument("--work", type=Path, default=Path("/tmp/convert-quality"))
    parser.add_argument("--ctx", type=int, default=512)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--sensitivity", choices=("activation", "kld"), default="kld")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args()
    rows = [row for hf in args.checkpoints for row in run_checkpoint(hf, args)]
    print("| checkpoint | scheme | file | type mix | MB | bpw | PPL | KLD | top-1 | KLD vs llama.cpp |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for theirs, ours in zip(rows[::2], rows[1::2], strict=True):
        for row in (theirs, ours):
            ratio = "" if row is theirs else f"{row['kld'] / theirs['kld'] - 1:+.1%}"
            print(
                f"| {row['checkpoint']} | {row['scheme']} | {row['who']} | {row['mix']} | {row['bytes'] / 1e6:.2f} "
                f"| {row['bpw']:.3f} | {row['ppl']:.4f} | {row['kld']:.5f} | {row['top1']:.2%} | {ratio} |"
            )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
