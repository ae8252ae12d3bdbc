"""Tiny Hugging Face checkpoints built in the test: config.json, random weights in safetensors
(f32, f16 or bf16, one file or sharded with an index, written by scripts/gguf_to_hf.py's
writer) and a tokenizer trained on the spot.

Weights are random but scaled like a trained model's (unit-variance activations), so logits
are well spread and a converter bug shows as a large error, not a small one.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

import numpy as np
from hf_tokenizers import write_byte_level_bpe, write_sentencepiece

from support import load_script

gguf_to_hf = load_script("gguf_to_hf")

Arch = Literal["llama", "mistral", "qwen2"]
HF_CLASSES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}


def hf_weights(config: dict, seed: int = 0) -> dict[str, np.ndarray]:
    """Random float32 weights with the names and (out, in) shapes transformers gives the model."""
    rng = np.random.default_rng(seed)
    e, ff, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    n_head, n_kv = config["num_attention_heads"], config["num_key_value_heads"]
    d = config.get("head_dim") or e // n_head

    def matrix(n_out: int, n_in: int) -> np.ndarray:
        return (rng.standard_normal((n_out, n_in)) / np.sqrt(n_in)).astype(np.float32)

    def norm(n: int) -> np.ndarray:
        return (1 + 0.1 * rng.standard_normal(n)).astype(np.float32)

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
        if config["architectures"] == ["Qwen2ForCausalLM"]:
            for proj, n in (("q", n_head * d), ("k", n_kv * d), ("v", n_kv * d)):
                weights[p + f"self_attn.{proj}_proj.bias"] = (0.1 * rng.standard_normal(n)).astype(np.float32)
    weights["model.norm.weight"] = norm(e)
    if not config["tie_word_embeddings"]:
        weights["lm_head.weight"] = matrix(v, e)
    return weights


def write_tiny_hf(
    folder: Path,
    *,
    arch: Arch = "llama",
    tokenizer: Literal["bpe", "spm"] = "bpe",
    dtype: str = "f32",
    shards: int = 1,
    n_layer: int = 2,
    hidden: int = 128,
    n_head: int = 2,
    n_kv: int = 1,
    ff: int = 256,
    tied: bool = True,
    seed: int = 0,
) -> dict[str, np.ndarray]:
    """Write a checkpoint to ``folder``; return its float32 weights (before any F16/BF16 rounding)."""
    folder.mkdir(parents=True, exist_ok=True)
    if tokenizer == "bpe":
        write_byte_level_bpe(folder, pre="qwen2" if arch == "qwen2" else "llama-bpe")
    else:
        write_sentencepiece(folder)
    n_vocab = _tokenizer_size(folder) + 5  # padded like real checkpoints, to a round embedding size
    config = {
        "architectures": [HF_CLASSES[arch]],
        "model_type": arch,
        "hidden_size": hidden,
        "intermediate_size": ff,
        "num_hidden_layers": n_layer,
        "num_attention_heads": n_head,
        "num_key_value_heads": n_kv,
        "hidden_act": "silu",
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-6 if arch == "qwen2" else 1e-5,
        "rope_theta": 1_000_000.0 if arch == "qwen2" else 10_000.0,
        "tie_word_embeddings": tied,
        "vocab_size": n_vocab,
        "torch_dtype": {"f32": "float32", "f16": "float16", "bf16": "bfloat16"}[dtype],
    }
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
