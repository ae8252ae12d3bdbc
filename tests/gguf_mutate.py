"""Malformed GGUF files, made from a valid one, and how validation takes each.

``layout`` walks a valid file (it trusts what it reads) and lists every header field with
its byte range, so a mutation can hit exactly the fields the 2024 GGUF CVEs were in:
counts, string and array lengths, tensor dimensions, types and offsets. ``mutants`` yields
seeded files with one to three mutations each, saying what was done; ``validate`` runs
edgeinfer's validation on one, timing it and measuring the memory it allocates.
"""

from __future__ import annotations

import random
import re
import struct
import time
import tracemalloc
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

_SCALAR_SIZES = {
    GGUFValueType.UINT8: 1, GGUFValueType.INT8: 1, GGUFValueType.UINT16: 2, GGUFValueType.INT16: 2,
    GGUFValueType.UINT32: 4, GGUFValueType.INT32: 4, GGUFValueType.FLOAT32: 4, GGUFValueType.BOOL: 1,
    GGUFValueType.UINT64: 8, GGUFValueType.INT64: 8, GGUFValueType.FLOAT64: 8,
}  # fmt: skip


@dataclass(frozen=True)
class Field:
    """One field of a GGUF header: what it is, where it is, and whose it is (a key or tensor name)."""

    kind: str
    offset: int
    size: int
    owner: str = ""

    @property
    def end(self) -> int:
        return self.offset + self.size


def layout(data: bytes) -> list[Field]:
    """Every field of a valid GGUF header, in file order, then the tensor data as one field."""
    fields = [Field("magic", 0, 4), Field("version", 4, 4), Field("tensor count", 8, 8), Field("key count", 16, 8)]
    n_tensors, n_kv = struct.unpack_from("<QQ", data, 8)
    pos = 24

    def take(kind: str, size: int, owner: str) -> int:
        nonlocal pos
        fields.append(Field(kind, pos, size, owner))
        pos += size
        return pos - size

    def string(kind: str, owner: str) -> str:
        """A string field; a key or tensor name is its own owner."""
        nonlocal pos
        (n,) = struct.unpack_from("<Q", data, pos)
        text = data[pos + 8 : pos + 8 + n].decode()
        take(f"{kind} length", 8, owner or text)
        take(kind, n, owner or text)
        return text

    for _ in range(n_kv):
        key = string("key", "")
        (vtype,) = struct.unpack_from("<I", data, take("value type", 4, key))
        if vtype == GGUFValueType.ARRAY:
            (etype,) = struct.unpack_from("<I", data, take("array type", 4, key))
            (count,) = struct.unpack_from("<Q", data, take("array length", 8, key))
            if etype == GGUFValueType.STRING:
                for _ in range(count):
                    string("array string", key)
            else:
                take("array data", count * _SCALAR_SIZES[GGUFValueType(etype)], key)
        elif vtype == GGUFValueType.STRING:
            string("string", key)
        else:
            take("value", _SCALAR_SIZES[GGUFValueType(vtype)], key)
    for _ in range(n_tensors):
        name = string("tensor name", "")
        (n_dims,) = struct.unpack_from("<I", data, take("dimension count", 4, name))
        for _ in range(n_dims):
            take("dimension", 8, name)
        take("tensor type", 4, name)
        take("tensor offset", 8, name)
    alignment = 32
    fields.append(Field("tensor data", -(-pos // alignment) * alignment, len(data) - pos))
    return fields


# Values that break naive arithmetic: zero, one, sign and width boundaries, the largest.
EDGE_U64 = [0, 1, 2, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**40, 2**62, 2**63 - 1, 2**63, 2**64 - 1]
EDGE_U32 = [0, 1, 2, 3, 4, 2**8, 2**16, 2**31 - 1, 2**31, 2**32 - 1]


def _edge(rng: random.Random, size: int, old: int, file_size: int) -> int:
    near = [old - 1, old + 1, old * 2, old // 2, old + 32, file_size, file_size + 1]
    pool = (EDGE_U64 if size == 8 else EDGE_U32) + near
    value = rng.choice(pool) if rng.random() < 0.85 else rng.getrandbits(8 * size)
    return value % (1 << (8 * size))


def _set_int(buf: bytearray, field: Field, value: int) -> None:
    buf[field.offset : field.end] = value.to_bytes(field.size, "little")


def _pick(rng: random.Random, fields: list[Field], *kinds: str) -> Field:
    return rng.choice([f for f in fields if f.kind in kinds])


def _mutate_once(buf: bytearray, fields: list[Field], rng: random.Random) -> str:
    if len(buf) < 2:  # truncated to nothing by an earlier step
        return "no-op (empty file)"
    header_end = fields[-1].offset
    kind = rng.choice(
        ["flip", "flip", "data flip", "truncate", "count", "length", "length", "dimension", "type",
         "offset", "duplicate", "value", "splice"]
    )  # fmt: skip
    if kind == "flip":
        at = rng.randrange(min(header_end, len(buf)))
        buf[at] = rng.randrange(256)
        return f"byte {at} := {buf[at]}"
    if kind == "data flip":
        at = rng.randrange(min(header_end, len(buf) - 1), len(buf))  # the header's last byte if no data is left
        buf[at] = rng.randrange(256)
        return f"data byte {at} := {buf[at]}"
    if kind == "truncate":
        cut = rng.randrange(header_end) if rng.random() < 0.7 else rng.randrange(len(buf))
        del buf[cut:]
        return f"truncated to {cut} bytes"
    if kind == "splice":  # insert or delete a few bytes, shifting everything after them
        at, n = rng.randrange(header_end), rng.randint(1, 16)
        if rng.random() < 0.5:
            buf[at:at] = rng.randbytes(n)
            return f"{n} bytes inserted at {at}"
        del buf[at : at + n]
        return f"{n} bytes deleted at {at}"
    if kind == "duplicate":  # one name written over another of the same length
        names = [f for f in fields if f.kind in ("tensor name", "key")]
        src = rng.choice(names)
        same = [f for f in names if f.size == src.size and f.kind == src.kind and f != src]
        dst = rng.choice(same or names)
        n = min(src.size, dst.size)
        buf[dst.offset : dst.offset + n] = buf[src.offset : src.offset + n]
        return f"{dst.kind} at {dst.offset} := copy of the one at {src.offset}"
    kinds = {
        "count": ("tensor count", "key count"),
        "length": ("key length", "string length", "array length", "array string length", "tensor name length"),
        "dimension": ("dimension", "dimension count"),
        "type": ("value type", "array type", "tensor type"),
        "offset": ("tensor offset",),
        "value": ("value", "version"),
    }[kind]
    field = _pick(rng, fields, *kinds)
    if field.offset + field.size > len(buf):
        return "no-op (field beyond the end)"
    old = int.from_bytes(buf[field.offset : field.end], "little")
    if kind == "type" and rng.random() < 0.6:
        known = list(GGML_QUANT_SIZES) if field.kind == "tensor type" else list(GGUFValueType)
        new = int(rng.choice(known + [GGMLQuantizationType.I32, 4, 5, 31, 32, 33, 36, 37, 38, 42, 99]))
    else:
        new = _edge(rng, field.size, old, len(buf))
    _set_int(buf, field, new)
    return f"{field.kind} of {field.owner or '?'} at {field.offset}: {old} := {new}"


def mutate(data: bytes, fields: list[Field], rng: random.Random) -> tuple[bytes, str]:
    """One to three random mutations of the valid file ``data`` (whose ``layout`` is ``fields``)."""
    buf = bytearray(data)
    steps = [_mutate_once(buf, fields, rng) for _ in range(rng.choice([1, 1, 1, 2, 3]))]
    return bytes(buf), "; ".join(steps)


def mutants(base: bytes, count: int, seed: int) -> Iterator[tuple[int, bytes, str]]:
    """``count`` mutated copies of ``base``: (index, data, what was done). Case i depends only on (seed, i)."""
    fields = layout(base)
    for i in range(count):
        data, what = mutate(base, fields, random.Random(f"{seed}:{i}"))
        yield i, data, what


@dataclass(frozen=True)
class Validation:
    """How edgeinfer's validation took one file."""

    accepted: bool
    message: str  # the InvalidModelError's, when rejected
    seconds: float
    peak_bytes: int  # Python memory allocated at the peak, over what was in use before


def validate(path: Path) -> Validation:
    """Run load_model_info on ``path`` in this process; anything but InvalidModelError propagates."""
    from edgeinfer.errors import InvalidModelError
    from edgeinfer.models.info import load_model_info

    started_tracing = not tracemalloc.is_tracing()
    if started_tracing:
        tracemalloc.start()
    tracemalloc.reset_peak()
    before = tracemalloc.get_traced_memory()[0]
    start = time.perf_counter()
    try:
        load_model_info(path)
        accepted, message = True, ""
    except InvalidModelError as exc:
        accepted, message = False, str(exc)
    seconds = time.perf_counter() - start
    peak = tracemalloc.get_traced_memory()[1] - before
    if started_tracing:
        tracemalloc.stop()
    return Validation(accepted, message, seconds, peak)


def reason(message: str, file_name: str) -> str:
    """A rejection message without the file's name, quoted names and numbers, to count rejections by field."""
    message = message.replace(f"{file_name} is not a valid GGUF file: ", "").replace(f"{file_name}: ", "")
    message = message.replace(file_name, "the file")
    message = re.sub(r"b?'[^']*'|b?\"[^\"]*\"", "'…'", message)
    message = re.sub(r"\[[^\]]*\]", "[…]", message)
    message = re.sub(r"0x[0-9A-Fa-f]+", "0xN", message)
    message = re.sub(r"(?<![\w-])-?\d+(\.\d+)?([eE][-+]?\d+)?(?!\w)", "N", message)
    return message.replace(" (re-download or re-convert it)", "").replace(" (re-convert the model)", "")


def _array_kv(key: str, element_type: GGUFValueType, count: int, payload: bytes) -> bytes:
    raw_key = key.encode()
    return (
        struct.pack("<Q", len(raw_key))
        + raw_key
        + struct.pack("<IIQ", GGUFValueType.ARRAY, element_type, count)
        + payload
    )


def _header_only(kvs: list[bytes]) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", 3, 0, len(kvs)) + b"".join(kvs)


def limit_files(extra: int = 0) -> dict[str, bytes]:
    """Header-only files that sit exactly at the reader's limits (``extra=1``: one past each).

    They are the most work a file can make validation do: the most keys, each a fully decoded
    array; the most strings; the largest vocabulary, every token a distinct object.
    """
    from edgeinfer.models.gguf_file import MAX_DECODED_ARRAY, MAX_KEYS, MAX_STRINGS, MAX_VOCABULARY

    n = MAX_DECODED_ARRAY
    empty = struct.pack("<Q", 0)
    return {
        "most keys, float arrays": _header_only(
            [_array_kv(f"k{i}", GGUFValueType.FLOAT32, n, bytes(4 * n)) for i in range(MAX_KEYS + extra)]
        ),
        "most keys, string arrays": _header_only(
            [_array_kv(f"s{i}", GGUFValueType.STRING, n, empty * n) for i in range(MAX_KEYS + extra)]
        ),
        "most strings": _header_only(
            [_array_kv("x", GGUFValueType.STRING, MAX_STRINGS + extra, empty * (MAX_STRINGS + extra))]
        ),
        "largest vocabulary": _header_only(
            [
                _array_kv(
                    "tokenizer.ggml.tokens",
                    GGUFValueType.STRING,
                    MAX_VOCABULARY + extra,
                    b"".join(struct.pack("<QI", 4, i) for i in range(MAX_VOCABULARY + extra)),
                )
            ]
        ),
    }
