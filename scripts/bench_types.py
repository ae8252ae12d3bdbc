"""Each ggml type's prefill and decode speed in llama.cpp on this machine, for a model of a given width.

The probe models are the ones a speed-aware ``edgeinfer convert`` times (``converters/type_speed.py``): a few
layers as wide as MODEL's, every matrix in one type. Printed with each type's size and which types are slow for
their size here, the ones a budgeted mix avoids unless quality insists.

    python scripts/bench_types.py [MODEL] [--threads N] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys

from edgeinfer.converters.plan import MIX_TYPES
from edgeinfer.converters.quantize import available
from edgeinfer.converters.type_speed import bits_per_weight, measure_type_speeds, probe_hparams, slow_types
from edgeinfer.errors import EdgeInferError
from edgeinfer.models.catalog import DEFAULT_MODEL, resolve_model
from edgeinfer.models.info import load_model_info
from edgeinfer.system import thread_count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?", default=DEFAULT_MODEL, help="a .gguf path or alias whose width to probe")
    parser.add_argument("--threads", type=int)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    try:
        hp = load_model_info(resolve_model(args.model)).hparams
        threads = thread_count(args.threads)
        types = [t for t in MIX_TYPES if available(t)]
        speeds = measure_type_speeds(types, hp, threads, lambda done, total: print(f"{done}/{total}", file=sys.stderr))
    except EdgeInferError as exc:
        sys.exit(f"error: {exc}")
    slow = slow_types(speeds)
    probe = probe_hparams(hp)
    if args.json:
        rows = {
            t.name: {"bpw": bits_per_weight(t), "prefill_tok_s": s.prefill, "decode_tok_s": s.decode}
            | ({"slow_beside": [u.name for u in slow[t]]} if t in slow else {})
            for t, s in speeds.items()
        }
        print(json.dumps({"threads": threads, "probe": {"n_embd": probe.n_embd, "n_ff": probe.n_ff}, "types": rows}))
        return
    best = max(s.prefill for s in speeds.values())
    print(f"probe: {probe.n_layer} layers, width {probe.n_embd}, FFN {probe.n_ff}; {threads} threads")
    header = f"{'type':<8} {'bpw':>5} {'prefill tok/s':>14} {'vs best':>8} {'decode tok/s':>13}"
    print(f"{header}  slow: no larger, faster at prefill")
    for t in sorted(speeds, key=bits_per_weight):
        s = speeds[t]
        beside = ", ".join(f"{u.name} {speeds[u].prefill / s.prefill:.2f}x" for u in slow.get(t, []))
        print(
            f"{t.name:<8} {bits_per_weight(t):>5.2f} {s.prefill:>14.0f} {s.prefill / best:>8.2f} "
            f"{s.decode:>13.0f}  {beside}"
        )


if __name__ == "__main__":
    main()
