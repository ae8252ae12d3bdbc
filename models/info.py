"""What the engine needs to know about a model before loading it, read from the GGUF header and
checked against its architecture, so that nothing malformed ever reaches native code."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gguf import Keys

from edgeinfer.errors import InvalidModelError
from edgeinfer.models.arch import HParams, check_tensors, hparams_from_metadata
from edgeinfer.models.gguf_file import GGUFHeader, TensorInfo, array_length, read_header

# Bytes one cached K or V element takes, by KV cache type. q8_0 stores 32 values in 34 bytes.
KV_TYPE_BYTES: dict[str, float] = {"f16": 2.0, "q8_0": 34 / 32}
# llama.cpp's tokenizers for the architectures we run: SentencePiece and byte-level BPE.
TOKENIZER_MODELS = ("llama", "gpt2")


@dataclass(frozen=True)
class ModelInfo:
    """A model's architecture, size and tensors, as its (checked) GGUF header states them."""

    path: Path
    name: str
    hparams: HParams
    chat_template: str | None
    file_size: int
    tensors: tuple[TensorInfo, ...]

    @property
    def architecture(self) -> str:
        return self.hparams.arch.gguf_arch

    @property
    def tensor_types(self) -> dict[str, int]:
        """ggml type name -> how many tensors have it."""
        return dict(Counter(t.type.name for t in self.tensors))

    def kv_bytes_per_token(self, kv_type: str = "f16") -> float:
        """Bytes of KV cache one token takes: K and V, every layer, every KV head."""
        hp = self.hparams
        return 2 * hp.n_layer * hp.kv_dim * KV_TYPE_BYTES[kv_type]


def load_model_info(path: str | Path) -> ModelInfo:
    """Read and check the GGUF at ``path``; raises InvalidModelError naming the field at fault."""
    return model_info_from_header(read_header(path))


def model_info_from_header(header: GGUFHeader) -> ModelInfo:
    meta, file = header.metadata, header.path.name
    shapes = {t.name: t.shape for t in header.tensors}
    hparams = hparams_from_metadata(meta, set(shapes), file)
    _check_vocabulary(meta, hparams.n_vocab, file)
    check_tensors(hparams, shapes, file)
    template = meta.get(Keys.Tokenizer.CHAT_TEMPLATE)
    return ModelInfo(
        path=header.path,
        name=str(meta.get(Keys.General.NAME) or header.path.stem),
        hparams=hparams,
        chat_template=template if isinstance(template, str) else None,
        file_size=header.file_size,
        tensors=header.tensors,
    )


def _check_vocabulary(meta: Mapping[str, Any], n_vocab: int, file: str) -> None:
    """Check that the tokenizer is one llama.cpp has and that every per-token array and special id fits.

    llama.cpp indexes the scores and token types by token id and trusts the special ids.
    """
    model = meta.get(Keys.Tokenizer.MODEL)
    if model not in TOKENIZER_MODELS:
        raise InvalidModelError(
            f"{file}: tokenizer model {model!r} is not supported (expected one of {', '.join(TOKENIZER_MODELS)})"
        )
    for key in (Keys.Tokenizer.SCORES, Keys.Tokenizer.TOKEN_TYPE):
        if key in meta and array_length(meta[key]) != n_vocab:
            raise InvalidModelError(f"{file}: '{key}' has {array_length(meta[key])} entries for {n_vocab} tokens")
    if model == "gpt2" and not array_length(meta.get(Keys.Tokenizer.MERGES)):
        raise InvalidModelError(f"{file}: a BPE vocabulary needs '{Keys.Tokenizer.MERGES}'; re-convert the model")
    special_ids = {k: v for k, v in meta.items() if k.startswith("tokenizer.ggml.") and k.endswith("_token_id")}
    for key, value in special_ids.items():
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < n_vocab:
            raise InvalidModelError(f"{file}: '{key}' = {value!r} is not a token id below {n_vocab}")
