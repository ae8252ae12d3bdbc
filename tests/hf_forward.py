"""A forward pass over Hugging Face tensors in their own layout, as transformers computes it
(RoPE on half-split pairs, no Q/K permutation): the ground truth a conversion is checked against.
Deliberately independent of models/reference.py, which works in GGUF's layout."""

from __future__ import annotations

import numpy as np


def _rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _rotate_half(x: np.ndarray) -> np.ndarray:
    half = x.shape[-1] // 2
    return np.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def hf_forward(weights: dict[str, np.ndarray], config: dict, tokens: list[int]) -> np.ndarray:
    """Logits ``(len(tokens), vocab)`` for ``tokens`` at positions 0, 1, ..., in float64."""
    w = {k: v.astype(np.float64) for k, v in weights.items()}
    e, eps = config["hidden_size"], config["rms_norm_eps"]
    n_head, n_kv = config["num_attention_heads"], config["num_key_value_heads"]
    d = config.get("head_dim") or e // n_head
    n = len(tokens)
    inv_freq = config["rope_theta"] ** (-np.arange(0, d, 2) / d)
    angles = np.arange(n)[:, None] * inv_freq[None, :]
    cos, sin = np.cos(np.concatenate([angles, angles], -1)), np.sin(np.concatenate([angles, angles], -1))
    mask = np.triu(np.full((n, n), -np.inf), 1)
    x = w["model.embed_tokens.weight"][tokens]
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."

        def proj(name: str, h: np.ndarray, p: str = p) -> np.ndarray:
            out = h @ w[p + name + ".weight"].T
            return out + w[p + name + ".bias"] if p + name + ".bias" in w else out

        h = _rms_norm(x, w[p + "input_layernorm.weight"], eps)
        q = proj("self_attn.q_proj", h).reshape(n, n_head, d).transpose(1, 0, 2)
        k = proj("self_attn.k_proj", h).reshape(n, n_kv, d).transpose(1, 0, 2)
        v = proj("self_attn.v_proj", h).reshape(n, n_kv, d).transpose(1, 0, 2)
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        k, v = np.repeat(k, n_head // n_kv, axis=0), np.repeat(v, n_head // n_kv, axis=0)
        scores = q @ k.transpose(0, 2, 1) / np.sqrt(d) + mask
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        attn = (probs @ v).transpose(1, 0, 2).reshape(n, n_head * d)
        x = x + proj("self_attn.o_proj", attn)
        h = _rms_norm(x, w[p + "post_attention_layernorm.weight"], eps)
        gate, up = proj("mlp.gate_proj", h), proj("mlp.up_proj", h)
        x = x + proj("mlp.down_proj", gate / (1 + np.exp(-gate)) * up)
    x = _rms_norm(x, w["model.norm.weight"], eps)
    head = w["model.embed_tokens.weight"] if config["tie_word_embeddings"] else w["lm_head.weight"]
    return x @ head.T
