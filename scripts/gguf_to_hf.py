"""Write a GGUF model out as a Hugging Face checkpoint folder, laid out as Hugging Face itself would.

The converter's benchmark starts from HF checkpoints, but some models we measure (SmolLM2-135M)
ship here only as GGUF. This dequantizes every tensor and undoes what llama.cpp's converter did:
GGUF tensor names become HF's, and llama's Q/K rows go back to the order HF's RoPE expects.

    python scripts/gguf_to_hf.py smollm2-135m -o /tmp/smollm2-hf [--dtype f32|bf16|f16]

The folder holds config.json, model.safetensors, tokenizer.json (byte-level BPE rebuilt from the
GGUF vocabulary, with the pre-tokenizer its ``tokenizer.ggml.pre`` names), tokenizer_config.json
and generation_config.json. Tensors are written one at a time; every file atomically.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
from gguf import Keys
from tokenizers import Tokenizer, decoders, processors

from edgeinfer.errors import ConversionError, EdgeInferError
from edgeinfer.files import atomic_path
from edgeinfer.models.arch import HParams
from edgeinfer.models.catalog import resolve_model
from edgeinfer.models.info import load_model_info
from edgeinfer.models.tensors import GGUFTensors, open_tensors
from edgeinfer.vocabulary import GGUFVocabulary

# GGUF tensor name (after "blk.N.") -> HF name (after "model.layers.N.").
LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
HF_CLASSES = {"llama": ("LlamaForCausalLM", "llama"), "qwen2": ("Qwen2ForCausalLM", "qwen2")}
SPECIAL_TOKEN_IDS = {
    "bos": Keys.Tokenizer.BOS_ID,
    "eos": Keys.Tokenizer.EOS_ID,
    "pad": Keys.Tokenizer.PAD_ID,
    "unk": Keys.Tokenizer.UNK_ID,
}
# dtype name -> (safetensors dtype, config.json torch_dtype, bytes per element)
DTYPES = {"f32": ("F32", "float32", 4), "bf16": ("BF16", "bfloat16", 2), "f16": ("F16", "float16", 2)}


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation for llama (HF rotates halves, llama.cpp adjacent pairs).

    llama.cpp's converter reorders each head's rows from (half, index) to (index, half); this
    reorders them back.
    """
    head_dim = w.shape[0] // n_head
    return w.reshape(n_head, head_dim // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_name(gguf_name: str) -> str:
    if gguf_name in GLOBAL_NAMES:
        return GLOBAL_NAMES[gguf_name]
    _, layer, rest = gguf_name.split(".", 2)
    if rest not in LAYER_NAMES:
        raise ConversionError(f"tensor '{gguf_name}' has no Hugging Face counterpart this script knows")
    return f"model.layers.{layer}.{LAYER_NAMES[rest]}"


def hf_weights(hp: HParams, tensors: GGUFTensors) -> tuple[dict[str, tuple[int, ...]], Callable[[str], np.ndarray]]:
    """HF tensor shapes, and a function that dequantizes one tensor by HF name, in HF layout."""
    by_hf_name = {hf_name(t.name): t for t in tensors.values()}
    shapes = {name: t.numpy_shape for name, t in sorted(by_hf_name.items())}

    def tensor(name: str) -> np.ndarray:
        w = tensors.dequantize(by_hf_name[name].name)
        if hp.arch.permute_qk and name.endswith("q_proj.weight"):
            return unpermute_qk(w, hp.n_head)
        if hp.arch.permute_qk and name.endswith("k_proj.weight"):
            return unpermute_qk(w, hp.n_head_kv)
        return w

    return shapes, tensor


def to_dtype(x: np.ndarray, dtype: str) -> np.ndarray:
    """float32 -> the on-disk dtype; bf16 is float32's top half, rounded to nearest even."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if dtype == "f32":
        return x
    if dtype == "f16":
        return x.astype(np.float16)
    bits = x.view(np.uint32)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(np.isnan(x), np.uint16(0x7FC0), rounded)  # rounding could carry a NaN into infinity


@contextlib.contextmanager
def atomic_write(path: Path) -> Iterator[BinaryIO]:
    """Open ``path`` for writing through a temporary file that replaces it only once complete."""
    with atomic_path(path) as partial, open(partial, "wb") as f:
        yield f


def write_text(path: Path, text: str) -> None:
    with atomic_write(path) as f:
        f.write(text.encode())


def write_json(path: Path, data: Mapping[str, Any]) -> None:
    write_text(path, json.dumps(data, indent=2, ensure_ascii=False) + "\n")


def write_safetensors(
    path: Path, shapes: Mapping[str, tuple[int, ...]], dtype: str, tensor: Callable[[str], np.ndarray]
) -> None:
    """Write a .safetensors file, holding one tensor in memory at a time.

    The format: an 8-byte little-endian header length, a JSON header giving each tensor's dtype,
    shape and byte range in the data that follows, then the raw little-endian data.
    """
    st_dtype, _, size = DTYPES[dtype]
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in shapes.items():
        n_bytes = int(np.prod(shape, dtype=np.int64)) * size
        header[name] = {"dtype": st_dtype, "shape": list(shape), "data_offsets": [offset, offset + n_bytes]}
        offset += n_bytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned, as HF's writer does it
    with atomic_write(path) as f:
        f.write(len(encoded).to_bytes(8, "little"))
        f.write(encoded)
        for name in shapes:
            f.write(to_dtype(tensor(name), dtype).data)  # the array's buffer, without a copy


def gguf_tokenizer(path: Path) -> tuple[dict[str, Any], Tokenizer]:
    """The GGUF's tokenizer metadata (its single values), and its vocabulary as an HF byte-level BPE tokenizer
    (edgeinfer's own, which tokenizes as llama.cpp does), with the decoder and BOS rule transformers wants in
    tokenizer.json."""
    vocabulary = GGUFVocabulary(path)
    if vocabulary.model != "gpt2":
        raise ConversionError(
            f"{path.name}: only byte-level BPE vocabularies (tokenizer.ggml.model 'gpt2') can be written as "
            f"tokenizer.json; this one is {vocabulary.model!r}"
        )
    tokenizer, tokens = vocabulary.hf_tokenizer, vocabulary.tokens
    tokenizer.decoder = decoders.ByteLevel()
    if vocabulary.add_bos and vocabulary.bos_id >= 0:
        bos = tokens[vocabulary.bos_id]
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, vocabulary.bos_id)]
        )
    return vocabulary.metadata, tokenizer


def model_config(hp: HParams, special_ids: Mapping[str, int], dtype: str) -> dict[str, Any]:
    """config.json as transformers writes it for this architecture."""
    hf_class, model_type = HF_CLASSES[hp.arch.gguf_arch]
    config: dict[str, Any] = {
        "architectures": [hf_class],
        "model_type": model_type,
        "hidden_act": "silu",
        "hidden_size": hp.n_embd,
        "intermediate_size": hp.n_ff,
        "num_hidden_layers": hp.n_layer,
        "num_attention_heads": hp.n_head,
        "num_key_value_heads": hp.n_head_kv,
        "head_dim": hp.head_dim,
        "max_position_embeddings": hp.n_ctx_train,
        # GGUF keeps these as float32: write the shortest decimal that reads back as the same float32.
        "rms_norm_eps": float(str(np.float32(hp.rms_eps))),
        "rope_theta": float(str(np.float32(hp.rope_base))),
        "rope_scaling": None,
        "vocab_size": hp.n_vocab,
        "tie_word_embeddings": hp.tied_embeddings,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": DTYPES[dtype][1],
        **special_ids,
    }
    if model_type == "llama":
        config.update(attention_bias=False, mlp_bias=False, pretraining_tp=1)
    else:
        config.update(use_sliding_window=False, sliding_window=None, max_window_layers=hp.n_layer)
    return config


def tokenizer_config(meta: Mapping[str, Any], tokenizer: Tokenizer, hp: HParams) -> dict[str, Any]:
    config: dict[str, Any] = {
        "added_tokens_decoder": {
            str(i): {
                "content": t.content,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": t.special,
            }
            for i, t in sorted(tokenizer.get_added_tokens_decoder().items())
        },
        "clean_up_tokenization_spaces": False,
        "model_max_length": hp.n_ctx_train,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    for role, key in SPECIAL_TOKEN_IDS.items():
        if key in meta:
            config[f"{role}_token"] = tokenizer.id_to_token(meta[key])
    config["add_bos_token"] = bool(meta.get(Keys.Tokenizer.ADD_BOS, False))
    if Keys.Tokenizer.CHAT_TEMPLATE in meta:
        config["chat_template"] = meta[Keys.Tokenizer.CHAT_TEMPLATE]
    return config


def gguf_to_hf(gguf_path: str | Path, out_dir: Path, dtype: str = "f32") -> None:
    """Write the GGUF model at ``gguf_path`` (a path or catalog alias) as an HF checkpoint in ``out_dir``."""
    info = load_model_info(resolve_model(gguf_path))
    hp = info.hparams
    if hp.rope_scaling != "none":
        raise ConversionError(f"{info.path.name} scales RoPE ({hp.rope_scaling}); this script cannot carry that over")
    meta, tokenizer = gguf_tokenizer(info.path)
    # transformers' configs name no unknown token.
    special_ids = {
        f"{role}_token_id": meta[key] for role, key in SPECIAL_TOKEN_IDS.items() if key in meta and role != "unk"
    }
    with open_tensors(info) as tensors:
        shapes, tensor = hf_weights(hp, tensors)  # before any file, so an unknown tensor stops it early
        out_dir.mkdir(parents=True, exist_ok=True)
        write_safetensors(out_dir / "model.safetensors", shapes, dtype, tensor)
    write_text(out_dir / "tokenizer.json", tokenizer.to_str(pretty=True))
    write_json(out_dir / "tokenizer_config.json", tokenizer_config(meta, tokenizer, hp))
    write_json(out_dir / "generation_config.json", special_ids)
    write_json(out_dir / "config.json", model_config(hp, special_ids, dtype))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="a .gguf path or catalog alias")
    parser.add_argument("-o", "--output", type=Path, required=True, help="the HF checkpoint folder to write")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="f32", help="tensor dtype on disk (default f32)")
    args = parser.parse_args()
    try:
        gguf_to_hf(args.model, args.output, args.dtype)
    except EdgeInferError as exc:
        sys.exit(f"error: {exc}")
    size = sum(f.stat().st_size for f in args.output.iterdir())
    print(f"wrote {args.output}/ ({size / 2**20:,.1f} MiB)")


if __name__ == "__main__":
    main()
