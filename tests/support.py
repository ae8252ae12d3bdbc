"""Helpers the tests share (fixtures live in conftest.py)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import numpy as np
from gguf import GGUFReader, GGUFValueType

# Answers "Paris" greedily with this system prompt; SmolLM2's built-in one makes it ramble.
SCRIPTS = Path(__file__).parents[1] / "scripts"
SYSTEM = "You are a helpful assistant."
FRANCE = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is the capital of France?"}]


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
    spec.loader.exec_module(module)
    return module
