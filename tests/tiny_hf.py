"""Tiny Hugging Face checkpoints built in the test: config.json (in transformers 4's style or 5's),
random weights in safetensors (f32, f16 or bf16, one file or sharded with an index, written by
scripts/gguf_to_hf.py's writer) and a tokenizer trained on the spot.

Weights are random but scaled like a trained model's (unit-variance activations), so logits
are well spread and a converter bug shows as a large error, not a small one.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

import numpy as np
from hf_tokenizers import write_byte_level_bpe, write_sentencepiece

from support import load_script

gguf_to_hf = load_script("gguf_to_hf")

Arch = Literal["llama", "mistral", "qwen2", "qwen3", "gemma3"]
HF_CLASSES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
}
MODEL_TYPES = {"gemma3": "gemma3_text"}  # config.json's model_type, where it is not the architecture's name
# Llama 3.1's RoPE scaling with a short original context, so that most rotated pairs of a 64-wide
# head are slowed or blended: a converter that drops it is off by far more than rounding.
LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}


def hf_weights(config: dict, seed: int = 0) -> dict[str, np.ndarray]:
    """Random float32 weights with the names and (out, in) shapes transformers gives the model."""
    rng = np.random.default_rng(seed)
    e, ff, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    n_head, n_kv = config["num_attention_heads"], config["num_key_value_heads"]
    d = config.get("head_dim") or e // n_head
    cls = config["architectures"][0]
    gemma = cls == HF_CLASSES["gemma3"]

    def matrix(n_out: int, n_in: int) -> np.ndarray:
        return (rng.standard_normal((n_out, n_in)) / np.sqrt(n_in)).astype(np.float32)

    def norm(n: int) -> np.ndarray:
        # Gemma's norms scale by 1 + w, so its weights sit around 0: a converter that forgets the 1 fails.
        return ((0 if gemma else 1) + 0.1 * rng.standard_normal(n)).astype(np.float32)

    # Scaled so the tied head gives logits of a few units: a spread distribution, as trained models have.
    weights = {"model.embed_tokens.weight": (0.2 * rng.standard_normal((v, e))).astype(np.float32)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        weights |= {
            p + "input_layernorm.weight": norm(e),
            p + "self_attn.q_proj.weight": matrix(n_head * d, e),
            p + "self_attn.k_proj.weight": matrix(n_kv * d, e),
            p + "self_attn.v_proj.weight": matrix(n_kv * d, e),
            p + "self_attn.o_proj.weight": matrix(e, n_head * d),
            p + "post_attention_layernorm.weight": norm(e),
            p + "mlp.gate_proj.weight": matrix(ff, e),
            p + "mlp.up_proj.weight": matrix(ff, e),
            p + "mlp.down_proj.weight": matrix(e, ff),
        }
        if cls == HF_CLASSES["qwen2"]:
            for proj, n in (("q", n_head * d), ("k", n_kv * d), ("v", n_kv * d)):
                weights[p + f"self_attn.{proj}_proj.bias"] = (0.1 * rng.standard_normal(n)).astype(np.float32)
        if cls in (HF_CLASSES["qwen3"], HF_CLASSES["gemma3"]):
            weights |= {p + "self_attn.q_norm.weight": norm(d), p + "self_attn.k_norm.weight": norm(d)}
        if gemma:
            weights |= {
                p + "pre_feedforward_layernorm.weight": norm(e),
                p + "post_feedforward_layernorm.weight": norm(e),
            }
    weights["model.norm.weight"] = norm(e)
    if not config["tie_word_embeddings"]:
        weights["lm_head.weight"] = matrix(v, e)
    return weights


def tiny_config(
    arch: Arch,
    *,
    n_vocab: int,
    n_layer: int = 2,
    hidden: int = 128,
    n_head: int = 2,
    n_kv: int = 1,
    ff: int = 256,
    tied: bool = True,
    head_dim: int | None = None,
    rope_scaling: dict[str, Any] | None = None,
    style: Literal[4, 5] = 4,
    dtype: str = "f32",
) -> dict[str, Any]:
    """config.json for a tiny model, with RoPE's settings in transformers 4's keys (``rope_theta``,
    ``rope_scaling``, Gemma 3's ``rope_local_base_freq`` and ``sliding_window_pattern``) or 5's
    (``rope_parameters``, per layer kind for Gemma 3, and ``layer_types``)."""
    qwen = arch in ("qwen2", "qwen3")
    gemma = arch == "gemma3"
    theta = 1_000_000.0 if qwen or gemma else 10_000.0
    config: dict[str, Any] = {
        "architectures": [HF_CLASSES[arch]],
        "model_type": MODEL_TYPES.get(arch, arch),
        "hidden_size": hidden,
        "intermediate_size": ff,
        "num_hidden_layers": n_layer,
        "num_attention_heads": n_head,
        "num_key_value_heads": n_kv,
        "hidden_act": "silu",
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-6 if qwen or gemma else 1e-5,
        "tie_word_embeddings": tied,
        "vocab_size": n_vocab,
        "torch_dtype": {"f32": "float32", "f16": "float16", "bf16": "bfloat16"}[dtype],
    }
    if head_dim is not None or gemma:
        config["head_dim"] = head_dim or hidden // n_head
    if arch == "qwen3":
        config |= {"attention_bias": False, "use_sliding_window": False, "sliding_window": None}
    local_theta = 10_000.0  # Gemma 3's sliding-window layers' RoPE base
    if gemma:
        del config["hidden_act"]
        # Every second layer slides over the last 5 tokens: both kinds of layer, in a 2-layer model.
        config |= {
            "hidden_activation": "gelu_pytorch_tanh",
            "query_pre_attn_scalar": config["head_dim"],
            "sliding_window": 5,
            "final_logit_softcapping": None,
            "attn_logit_softcapping": None,
        }
    if style == 4:
        config |= {"rope_theta": theta, "rope_scaling": rope_scaling}
        if gemma:
            config |= {"rope_local_base_freq": local_theta, "sliding_window_pattern": 2}
    elif gemma:
        config["rope_parameters"] = {
            "full_attention": {"rope_type": "default", "rope_theta": theta, **(rope_scaling or {})},
            "sliding_attention": {"rope_type": "default", "rope_theta": local_theta},
        }
        config["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n_layer)]
    else:
        config["rope_parameters"] = {"rope_type": "default", "rope_theta": theta, **(rope_scaling or {})}
    return config


def write_tiny_hf(
    folder: Path,
    *,
    arch: Arch = "llama",
    tokenizer: Literal["bpe", "spm"] = "bpe",
    dtype: str = "f32",
    shards: int = 1,
    seed: int = 0,
    **config_options: Any,
) -> dict[str, np.ndarray]:
    """Write a checkpoint to ``folder``, configured by ``tiny_config(arch, **config_options)``; return its
    float32 weights (before any F16/BF16 rounding)."""
    folder.mkdir(parents=True, exist_ok=True)
    if tokenizer == "bpe":
        write_byte_level_bpe(folder, pre="qwen2" if arch.startswith("qwen") else "llama-bpe")
    else:
        write_sentencepiece(folder)
    n_vocab = _tokenizer_size(folder) + 5  # padded like real checkpoints, to a round embedding size
    config = tiny_config(arch, n_vocab=n_vocab, dtype=dtype, **config_options)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    weights = hf_weights(config, seed)
    if shards == 1:
        write_safetensors(folder / "model.safetensors", weights, dtype)
        return weights
    names = list(weights)
    weight_map = {}
    for k in range(shards):
        file = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        part = names[k::shards]
        write_safetensors(folder / file, {n: weights[n] for n in part}, dtype)
        weight_map |= dict.fromkeys(part, file)
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return weights


def write_safetensors(path: Path, tensors: dict[str, np.ndarray], dtype: str = "f32") -> None:
    gguf_to_hf.write_safetensors(path, {n: t.shape for n, t in tensors.items()}, dtype, tensors.__getitem__)


def as_stored(weights: dict[str, np.ndarray], dtype: str) -> dict[str, np.ndarray]:
    """The weights as the checkpoint holds them, widened back to float32."""
    if dtype == "bf16":
        return {
            k: (gguf_to_hf.to_dtype(v, "bf16").astype(np.uint32) << 16).view(np.float32) for k, v in weights.items()
        }
    return {k: gguf_to_hf.to_dtype(v, dtype).astype(np.float32) for k, v in weights.items()}


def _tokenizer_size(folder: Path) -> int:
    if (folder / "tokenizer.json").is_file():
        data = json.loads((folder / "tokenizer.json").read_text())
        ids = list(data["model"]["vocab"].values()) + [t["id"] for t in data["added_tokens"]]
        return max(ids) + 1
    import sentencepiece

    return int(sentencepiece.SentencePieceProcessor(model_file=str(folder / "tokenizer.model")).vocab_size())
