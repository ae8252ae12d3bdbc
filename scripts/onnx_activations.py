"""Which activations the ONNX Runtime backend chooses for each model, measured afresh: exact (float for 4-bit
codes, two int8 passes for Q8_0) or int8 in one pass.

Runs the backend's first-load measurement (``backends/onnx/activations.py``) in an empty graph
cache, so both graphs are built and scored: prints the KLD of int8 activations from the other level's,
the level chosen, and how long measuring took (both builds included).

    python scripts/onnx_activations.py smollm2-135m gemma3-270m /tmp/tiny-qwen2-q4_0.gguf --threads 2
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

from edgeinfer.backends.base import BackendOptions
from edgeinfer.backends.onnx.backend import OnnxRuntimeBackend
from edgeinfer.backends.onnx.spec import activations
from edgeinfer.errors import EdgeInferError
from edgeinfer.models.catalog import resolve_model
from edgeinfer.models.info import load_model_info
from edgeinfer.system import thread_count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", nargs="+", help="catalog aliases or .gguf paths")
    parser.add_argument("--kv-type", default="f16", choices=("f16", "f32"))
    parser.add_argument("--threads", type=int)
    args = parser.parse_args()
    options = BackendOptions(kv_tokens=512, kv_type=args.kv_type, threads=thread_count(args.threads))
    for model in args.models:
        try:
            info = load_model_info(resolve_model(model, download=False))
        except EdgeInferError as exc:
            raise SystemExit(f"error: {exc}") from None
        with tempfile.TemporaryDirectory() as cache:
            os.environ["EDGEINFER_CACHE_DIR"] = cache
            start = time.perf_counter()
            level = OnnxRuntimeBackend.accuracy_level(info, options)
            took = time.perf_counter() - start
            records = list(Path(cache, "onnx").glob("*-activations.json"))
            kld = json.loads(records[0].read_text())["int8_kld"] if records else None
        measured = "not measured: no 4-bit or Q8_0 codes" if kld is None else f"int8 KLD from the other {kld:.1e}"
        print(f"{info.path.name}: {measured}, {activations(info, level)}; measuring took {took:.1f} s")


if __name__ == "__main__":
    main()
