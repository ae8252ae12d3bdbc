"""How closely the reference backend agrees with llama.cpp, llama.cpp with itself, and ONNX Runtime with both.

Evaluates the same N tokens of a text several ways, each from an empty cache: llama.cpp in one
batch, llama.cpp one token at a time, the reference backend, and the ONNX Runtime backend with
MatMulNBits' float32 activations (accuracy_level 0) and int8 ones (4) for 4-bit codes; then prints
top-1 agreement and KL divergence for each pair. llama.cpp's two paths round activations to 8 bits
differently for quantized weights, so their disagreement is the floor any other
implementation can reach on a quantized file. On an F32 copy (scripts/dequantize_gguf.py)
that floor disappears.

    python scripts/reference_agreement.py --text ../shared/data/text/kjv-genesis.txt
    python scripts/dequantize_gguf.py smollm2-135m /tmp/smollm2-f32.gguf
    python scripts/reference_agreement.py --model /tmp/smollm2-f32.gguf --text ../shared/data/text/kjv-genesis.txt
"""

from __future__ import annotations

import argparse

import numpy as np

from edgeinfer import Engine
from edgeinfer.backends.base import BackendOptions, Span
from edgeinfer.backends.onnx.activations import FLOAT, INT8
from edgeinfer.backends.onnx.backend import OnnxRuntimeBackend
from edgeinfer.logits import kl_divergence
from edgeinfer.models.catalog import DEFAULT_MODEL
from edgeinfer.models.info import load_model_info
from edgeinfer.system import thread_count


def compare(name: str, a: np.ndarray, b: np.ndarray) -> None:
    kld = kl_divergence(a, b)
    top1 = (a.argmax(axis=-1) == b.argmax(axis=-1)).mean()
    print(
        f"{name:<34} top-1 {top1:7.2%}   KLD mean {kld.mean():.2e}  median {np.median(kld):.2e}  "
        f"p99 {np.percentile(kld, 99):.2e}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--text", required=True)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--skip", type=int, default=1000, help="tokens to skip at the start of the text")
    parser.add_argument("--kv-type", default="f16", choices=("f16", "f32"))
    parser.add_argument("--threads", type=int)
    args = parser.parse_args()

    budget = f"{args.tokens}tok"
    with Engine(args.model, backend="llamacpp", kv_budget=budget, kv_type=args.kv_type, threads=args.threads) as e:
        with open(args.text, encoding="utf-8") as f:
            tokens = e.tokenize(f.read())[args.skip : args.skip + args.tokens]
        batched = e.logits(tokens)
        one_by_one = np.stack([e.backend.eval([Span(0, i, [t])])[0].copy() for i, t in enumerate(tokens)])
    with Engine(args.model, backend="reference", kv_budget=budget, kv_type=args.kv_type) as e:
        reference = e.logits(tokens)
        info = load_model_info(e.model_path)
    onnx = {}
    options = BackendOptions(kv_tokens=len(tokens), kv_type=args.kv_type, threads=thread_count(args.threads))
    for level in (FLOAT, INT8):  # both, whichever the backend chose for the model
        backend = OnnxRuntimeBackend(info, options, accuracy_level=level)
        try:
            onnx[level] = backend.eval([Span(0, 0, tokens, all_logits=True)])[0]
        finally:
            backend.close()
    print(f"{args.model}: {len(tokens)} tokens of {args.text}, KV cache {args.kv_type}")
    compare("llama.cpp batch vs one-by-one", batched, one_by_one)
    compare("llama.cpp batch vs reference", batched, reference)
    compare("llama.cpp one-by-one vs reference", one_by_one, reference)
    for level, rows in onnx.items():
        compare(f"onnxruntime acc{level} vs reference", rows, reference)
        compare(f"onnxruntime acc{level} vs llama.cpp batch", rows, batched)


if __name__ == "__main__":
    main()
