"""Helpers the tests share (fixtures live in conftest.py)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
from gguf import GGUFReader, GGUFValueType

SCRIPTS = Path(__file__).parents[1] / "scripts"
SYSTEM = "You are a helpful assistant."
# Greedy SmolLM2-135M answers this "The capital of Japan is Tokyo." on AVX2 and AVX-512 builds alike:
# every token of it, the end of generation included, leads the runner-up by more than 1.6 logits,
# far more than the builds' rounding moves a logit (test_engine checks the margin). France, the
# old question, led by 0.09 and became "La femme de France, ..." on AVX2.
JAPAN = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is the capital of Japan?"}]
MIN_MARGIN = 1.0  # logits; a greedy answer a test depends on must lead by this much at every token


def greedy_margins(engine, prompt, result) -> np.ndarray:
    """How far each token of a greedy ``result`` led the runner-up, in logits (and the end token, if it stopped).

    Scored from a fresh prefill of prompt and answer: a margin well above the tenths of a logit
    that batching or another instruction set moves means the answer does not hang on rounding.
    """
    prompt_tokens = engine.tokenize(prompt)
    rows = engine.logits(prompt_tokens + list(result.tokens))[len(prompt_tokens) - 1 :]
    if result.finish_reason != "stop":  # the last row chose the token after the answer
        rows = rows[:-1]
    top_two = np.sort(rows, axis=1)[:, -2:]
    return top_two[:, 1] - top_two[:, 0]


def rewrite_gguf(src: Path, dst: Path, *, drop: tuple[str, ...] = (), strings: dict[str, str] | None = None) -> Path:
    """Copy a GGUF, dropping metadata keys and setting string keys; tensors are copied as they are."""
    reader = GGUFReader(src)
    strings = strings or {}
    fields = [
        f
        for name, f in reader.fields.items()
        if not name.startswith("GGUF.") and name not in drop and name not in strings
    ]
    header = bytearray(b"GGUF")
    header += np.uint32(3).tobytes()
    header += np.uint64(len(reader.tensors)).tobytes()
    header += np.uint64(len(fields) + len(strings)).tobytes()
    for field in fields:
        header += b"".join(part.tobytes() for part in field.parts)
    for key, value in strings.items():
        header += _gguf_string(key) + np.uint32(GGUFValueType.STRING).tobytes() + _gguf_string(value)
    for tensor in reader.tensors:
        header += b"".join(part.tobytes() for part in tensor.field.parts)
    alignment = 32
    header += b"\0" * (-len(header) % alignment)
    with src.open("rb") as f_in, dst.open("wb") as f_out:
        f_out.write(header)
        f_in.seek(reader.data_offset)
        while chunk := f_in.read(1 << 22):
            f_out.write(chunk)
    return dst


def _gguf_string(text: str) -> bytes:
    data = text.encode()
    return np.uint64(len(data)).tobytes() + data


def load_script(name: str) -> ModuleType:
    """A module from scripts/ (not a package: scripts run on their own)."""
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # where dataclasses look their module up while the script runs
    spec.loader.exec_module(module)
    return module


def evaluate(backend, tokens, start, *, seq=0, all_logits=False) -> np.ndarray:
    """One sequence's logits through the backend contract (sequence 0 unless told)."""
    from edgeinfer.backends.base import Span

    return backend.eval([Span(seq, start, list(tokens), all_logits=all_logits)])[0]


def active_sequence(engine) -> int:
    """The KV sequence the engine's last call ran in."""
    states = engine._cache.sequences
    return max(range(len(states)), key=lambda s: states[s].used_at)


def reference_copies(folder: Path, model_path: Path, kinds: tuple[str, ...]) -> tuple[list[int], dict]:
    """SmolLM2 rewritten with every matrix as each of ``kinds`` (``dequantize_gguf``'s ``f32``, ``q8_0``), 512
    tokens of tests/data/lighthouse.txt, and the reference backend's logits of them on each copy:
    ``tokens, {kind: (info, logits)}``."""
    from edgeinfer.backends.base import BackendOptions, Span
    from edgeinfer.backends.reference import ReferenceBackend
    from edgeinfer.models.info import load_model_info
    from edgeinfer.tokenizer import Tokenizer

    tokenizer = Tokenizer(model_path)
    try:
        tokens = (tokenizer.encode((Path(__file__).parent / "data" / "lighthouse.txt").read_text()) * 2)[:512]
    finally:
        tokenizer.close()
    copies = {}
    for kind in kinds:
        path = folder / f"smollm2-{kind}.gguf"
        load_script("dequantize_gguf").write_copy(load_model_info(model_path), path, kind)
        info = load_model_info(path)
        backend = ReferenceBackend(info, BackendOptions(kv_tokens=len(tokens), kv_type="f32", threads=2))
        try:
            copies[kind] = (info, np.array(backend.eval([Span(0, 0, tokens, all_logits=True)])[0]))
        finally:
            backend.close()
    return tokens, copies
