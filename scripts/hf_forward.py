"""A numpy forward pass over a Hugging Face checkpoint, in HF's own tensor layout and conventions.

It reads safetensors as HF writes them and computes as transformers' LlamaForCausalLM,
Qwen2ForCausalLM, Qwen3ForCausalLM and Gemma3ForCausalLM do: RoPE by rotating halves
(``rotate_half``) with Llama 3's frequency scaling where configured, grouped-query attention by
repeating KV heads, RMSNorm, a gated MLP, q/k/v biases where the checkpoint has them, per-head
Q/K norms (Qwen3, Gemma 3), and Gemma 3's ways: norms that scale by ``1 + w``, a scaled
embedding, norms after attention and MLP, sliding-window layers with their own RoPE base.
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
    checkpoint: str | Path | Mapping[str, np.ndarray],
    config: Mapping[str, Any] | None,
    tokens: Sequence[int],
    *,
    f16_gelu: bool = False,
) -> np.ndarray:
    """Logits ``(len(tokens), vocab_size)`` in float64 for ``tokens`` from position 0.

    ``checkpoint`` is an HF folder (``config`` None reads its config.json) or tensors by HF name.
    ``f16_gelu`` computes GELU with the float16 rounding of llama.cpp's CPU backend (``gelu_f16_table``),
    the one place llama.cpp's F32 arithmetic departs from float64 by more than float32 rounding.
    """
    if not isinstance(checkpoint, Mapping):
        folder_config, checkpoint = read_checkpoint(checkpoint)
        config = config or folder_config
    assert config is not None
    tensors = checkpoint
    gemma = config["architectures"][0].startswith("Gemma")

    def w(name: str) -> np.ndarray:
        return tensors[name].astype(np.float64)

    def linear(x: np.ndarray, prefix: str) -> np.ndarray:
        y = x @ w(prefix + ".weight").T
        return y + w(prefix + ".bias") if prefix + ".bias" in tensors else y

    def norm(x: np.ndarray, name: str) -> np.ndarray:
        weight = w(name)
        return rms_norm(x, 1 + weight if gemma else weight, eps)  # Gemma's RMSNorm scales by 1 + w

    n_head = config["num_attention_heads"]
    n_kv_head = config.get("num_key_value_heads") or n_head
    head_dim = config.get("head_dim") or config["hidden_size"] // n_head
    eps = config["rms_norm_eps"]
    act = ACTIVATIONS[config.get("hidden_activation") or config.get("hidden_act", "silu")]
    if f16_gelu and act is gelu_tanh:
        act = gelu_f16_table
    scale = (config["query_pre_attn_scalar"] if gemma else head_dim) ** -0.5
    layer_types = config.get("layer_types") or [
        "sliding_attention" if gemma and (i + 1) % config.get("sliding_window_pattern", 6) else "full_attention"
        for i in range(config["num_hidden_layers"])
    ]

    n = len(tokens)
    rope = {kind: rope_cos_sin(params, head_dim, n) for kind, params in rope_parameters(config).items()}
    distance = np.subtract.outer(np.arange(n), np.arange(n))  # query position - key position
    masks = {
        "full_attention": np.where(distance >= 0, 0.0, -np.inf),
        "sliding_attention": np.where((distance >= 0) & (distance < (config.get("sliding_window") or n)), 0.0, -np.inf),
    }

    x = w("model.embed_tokens.weight")[np.asarray(tokens)]
    if gemma:
        x = x * math.sqrt(config["hidden_size"])
    for layer, kind in enumerate(layer_types):
        p = f"model.layers.{layer}."
        cos, sin = rope[kind]
        h = norm(x, p + "input_layernorm.weight")
        q = linear(h, p + "self_attn.q_proj").reshape(n, n_head, head_dim).transpose(1, 0, 2)  # (head, n, d)
        k = linear(h, p + "self_attn.k_proj").reshape(n, n_kv_head, head_dim).transpose(1, 0, 2)
        v = linear(h, p + "self_attn.v_proj").reshape(n, n_kv_head, head_dim).transpose(1, 0, 2)
        if p + "self_attn.q_norm.weight" in tensors:  # Qwen3 and Gemma 3 normalize each head's q and k
            q, k = norm(q, p + "self_attn.q_norm.weight"), norm(k, p + "self_attn.k_norm.weight")
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        k, v = np.repeat(k, n_head // n_kv_head, axis=0), np.repeat(v, n_head // n_kv_head, axis=0)
        scores = q @ k.transpose(0, 2, 1) * scale + masks[kind]
        attended = linear(
            (softmax(scores) @ v).transpose(1, 0, 2).reshape(n, n_head * head_dim), p + "self_attn.o_proj"
        )
        if gemma:
            x = x + norm(attended, p + "post_attention_layernorm.weight")
            h = norm(x, p + "pre_feedforward_layernorm.weight")
        else:
            x = x + attended
            h = norm(x, p + "post_attention_layernorm.weight")
        mlp = linear(act(linear(h, p + "mlp.gate_proj")) * linear(h, p + "mlp.up_proj"), p + "mlp.down_proj")
        x = x + (norm(mlp, p + "post_feedforward_layernorm.weight") if gemma else mlp)
    x = norm(x, "model.norm.weight")
    head = "model.embed_tokens.weight" if config.get("tie_word_embeddings", gemma) else "lm_head.weight"
    logits = x @ w(head).T
    if cap := config.get("final_logit_softcapping"):
        logits = np.tanh(logits / cap) * cap
    return logits


def rope_parameters(config: Mapping[str, Any]) -> dict[str, Mapping[str, Any]]:
    """RoPE's base and scaling for each kind of layer, from either config style: transformers 5's
    ``rope_parameters`` (flat, or by layer kind) or transformers 4's ``rope_theta`` and ``rope_scaling``
    (with Gemma 3's ``rope_local_base_freq`` for its sliding-window layers)."""
    if params := config.get("rope_parameters"):
        if "full_attention" in params:
            return dict(params)
        return {"full_attention": params, "sliding_attention": params}
    full = {**(config.get("rope_scaling") or {}), "rope_theta": config.get("rope_theta", 10000.0)}
    local = {"rope_theta": config.get("rope_local_base_freq", full["rope_theta"])}
    return {"full_attention": full, "sliding_attention": local}


def rope_cos_sin(params: Mapping[str, Any], head_dim: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin ``(n, head_dim)`` of each position's angles, as transformers' rotary embedding computes them."""
    inv_freq = 1.0 / params["rope_theta"] ** (np.arange(0, head_dim, 2) / head_dim)
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "llama3":
        inv_freq = llama3_inv_freq(inv_freq, params)
    elif kind == "linear":
        inv_freq = inv_freq / params["factor"]
    elif kind != "default":
        raise NotImplementedError(f"RoPE type {kind!r}")
    angles = np.outer(np.arange(n), inv_freq)
    angles = np.concatenate([angles, angles], axis=-1)
    return np.cos(angles), np.sin(angles)


def llama3_inv_freq(inv_freq: np.ndarray, params: Mapping[str, Any]) -> np.ndarray:
    """Llama 3.1's frequencies: long wavelengths slowed by ``factor``, short ones kept, a smooth blend between."""
    factor, low, high = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
    old_context = params["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_context / wavelen - low) / (high - low)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    return np.where(
        wavelen < old_context / high, inv_freq, np.where(wavelen > old_context / low, inv_freq / factor, blended)
    )


def rotate_half(x: np.ndarray) -> np.ndarray:
    half = x.shape[-1] // 2
    return np.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1 + np.exp(-x))


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


def gelu_f16_table(x: np.ndarray) -> np.ndarray:
    """GELU as llama.cpp's CPU backend computes it (ggml's ``GGML_GELU_FP16``): looked up in a float16
    table by the input rounded to float16, and exact (0 or x) outside (-10, 10). On a Gemma 3 model
    its rounding moves the logits by about 1e-4 of their size."""
    table = gelu_tanh(x.astype(np.float16).astype(np.float64)).astype(np.float16).astype(np.float64)
    return np.where(x <= -10, 0.0, np.where(x >= 10, x, table))


ACTIVATIONS = {"silu": silu, "gelu_pytorch_tanh": gelu_tanh}


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
