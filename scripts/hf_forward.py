"""A numpy forward pass over a Hugging Face checkpoint, in HF's own tensor layout and conventions.

It reads safetensors as HF writes them and computes as transformers' LlamaForCausalLM and
Qwen2ForCausalLM do: RoPE by rotating halves (``rotate_half``), grouped-query attention by
repeating KV heads, RMSNorm, a SiLU-gated MLP, q/k/v biases where the checkpoint has them.
It shares no code with ``edgeinfer.models.reference`` (which works in GGUF's layout), and
computes in float64, so a disagreement with llama.cpp is llama.cpp's rounding or a conversion error.

    logits = hf_forward("/tmp/smollm2-hf", None, tokens)

Run as a script, it compares a checkpoint with a GGUF in llama.cpp: logits, and the HF
tokenizer's ids against llama.cpp's on English, code and non-Latin text:

    python scripts/hf_forward.py /tmp/smollm2-hf /tmp/smollm2-f32.gguf
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

SAFETENSORS_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}
TOKENIZER_SAMPLES = {
    "English": "The keeper climbed the ninety-two steps at 7:45 pm, didn't he?  Twice.\n\nYes.",
    "code": 'def mean(xs: list[float]) -> float:\n    """Average."""\n    return sum(xs) / len(xs)  # 1e-3\n',
    "Greek": "Η Αθήνα είναι η πρωτεύουσα της Ελλάδας.",
    "Chinese": "北京是中国的首都，有三千多年的历史。",
    "emoji": "Ship it 🚀🚀 — café ½ naïve 👩‍💻",
}


def read_safetensors(path: str | Path) -> dict[str, np.ndarray]:
    """Every tensor of a .safetensors file, as float32."""
    with open(path, "rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(header_len))
    data = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + header_len)
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        begin, end = entry["data_offsets"]
        raw = data[begin:end].view(SAFETENSORS_DTYPES[entry["dtype"]]).reshape(entry["shape"])
        if entry["dtype"] == "BF16":  # bfloat16 is the top half of a float32
            tensors[name] = (raw.astype(np.uint32) << 16).view(np.float32)
        else:
            tensors[name] = raw.astype(np.float32)
    return tensors


def read_checkpoint(folder: str | Path) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """config.json and every tensor of an HF checkpoint folder (one safetensors file or shards)."""
    folder = Path(folder)
    config = json.loads((folder / "config.json").read_text())
    index = folder / "model.safetensors.index.json"
    files = (
        sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else ["model.safetensors"]
    )
    tensors: dict[str, np.ndarray] = {}
    for file in files:
        tensors.update(read_safetensors(folder / file))
    return config, tensors


def hf_forward(
    checkpoint: str | Path | Mapping[str, np.ndarray], config: Mapping[str, Any] | None, tokens: Sequence[int]
) -> np.ndarray:
    """Logits ``(len(tokens), vocab_size)`` in float64 for ``tokens`` from position 0.

    ``checkpoint`` is an HF folder (``config`` None reads its config.json) or tensors by HF name.
    """
    if not isinstance(checkpoint, Mapping):
        folder_config, checkpoint = read_checkpoint(checkpoint)
        config = config or folder_config
    assert config is not None
    tensors = checkpoint

    def w(name: str) -> np.ndarray:
        return tensors[name].astype(np.float64)

    def linear(x: np.ndarray, prefix: str) -> np.ndarray:
        y = x @ w(prefix + ".weight").T
        return y + w(prefix + ".bias") if prefix + ".bias" in tensors else y

    n_head = config["num_attention_heads"]
    n_kv_head = config.get("num_key_value_heads") or n_head
    head_dim = config.get("head_dim") or config["hidden_size"] // n_head
    eps = config["rms_norm_eps"]
    theta = config.get("rope_theta") or config["rope_parameters"]["rope_theta"]  # transformers 5 moved it

    n = len(tokens)
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim)
    angles = np.outer(np.arange(n), inv_freq)
    cos, sin = np.cos(np.concatenate([angles, angles], axis=-1)), np.sin(np.concatenate([angles, angles], axis=-1))
    causal = np.triu(np.full((n, n), -np.inf), 1)

    x = w("model.embed_tokens.weight")[np.asarray(tokens)]
    for layer in range(config["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        h = rms_norm(x, w(p + "input_layernorm.weight"), eps)
        q = linear(h, p + "self_attn.q_proj").reshape(n, n_head, head_dim).transpose(1, 0, 2)  # (head, n, d)
        k = linear(h, p + "self_attn.k_proj").reshape(n, n_kv_head, head_dim).transpose(1, 0, 2)
        v = linear(h, p + "self_attn.v_proj").reshape(n, n_kv_head, head_dim).transpose(1, 0, 2)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        k, v = np.repeat(k, n_head // n_kv_head, axis=0), np.repeat(v, n_head // n_kv_head, axis=0)
        scores = q @ k.transpose(0, 2, 1) / math.sqrt(head_dim) + causal
        attended = (softmax(scores) @ v).transpose(1, 0, 2).reshape(n, n_head * head_dim)
        x = x + linear(attended, p + "self_attn.o_proj")
        h = rms_norm(x, w(p + "post_attention_layernorm.weight"), eps)
        x = x + linear(silu(linear(h, p + "mlp.gate_proj")) * linear(h, p + "mlp.up_proj"), p + "mlp.down_proj")
    x = rms_norm(x, w("model.norm.weight"), eps)
    head = "model.embed_tokens.weight" if config.get("tie_word_embeddings") else "lm_head.weight"
    return x @ w(head).T


def rotate_half(x: np.ndarray) -> np.ndarray:
    half = x.shape[-1] // 2
    return np.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1 + np.exp(-x))


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def relative_error(ours: np.ndarray, theirs: np.ndarray) -> float:
    return float(np.linalg.norm(ours - theirs) / np.linalg.norm(theirs))


def main() -> None:
    from tokenizers import Tokenizer

    from edgeinfer import Engine
    from edgeinfer.tokenizer import Tokenizer as LlamaTokenizer

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", type=Path, help="an HF checkpoint folder")
    parser.add_argument("gguf", type=Path, help="the same model as GGUF (an F32 one for exact logits)")
    parser.add_argument("--tokens", type=int, default=32, help="how many tokens of text to compare logits on")
    args = parser.parse_args()

    hf_tokenizer = Tokenizer.from_file(str(args.checkpoint / "tokenizer.json"))
    llama_tokenizer = LlamaTokenizer(args.gguf)
    for label, text in TOKENIZER_SAMPLES.items():
        hf_ids = hf_tokenizer.encode(text, add_special_tokens=False).ids
        llama_ids = llama_tokenizer.encode(text, add_special=False, parse_special=False)
        print(f"tokens, {label:8}: {'equal' if hf_ids == llama_ids else 'DIFFERENT'} ({len(llama_ids)} tokens)")

    text = (Path(__file__).parents[1] / "tests" / "data" / "lighthouse.txt").read_text()
    tokens = llama_tokenizer.encode(text, add_special=True)[: args.tokens]
    with Engine(args.gguf, backend="llamacpp", kv_budget="256tok", kv_type="f32") as engine:
        theirs = engine.logits(tokens).astype(np.float64)
    ours = hf_forward(args.checkpoint, None, tokens)
    top1 = (ours.argmax(axis=-1) == theirs.argmax(axis=-1)).mean()
    print(
        f"logits over {len(tokens)} tokens: relative error {relative_error(ours, theirs):.2e}, top-1 equal {top1:.0%}"
    )


if __name__ == "__main__":
    main()
