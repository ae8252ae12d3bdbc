"""A bounds-checked reader for the GGUF header: metadata and the tensor directory.

Weights are never read. gguf-py's GGUFReader builds a numpy array for every
vocabulary string (6 s for a 49k vocab), and trusts lengths and counts it reads;
this reader only walks past large arrays and checks every length against the
bytes left before it is used, so malformed files fail here with one line instead
of reaching native code. Counts are capped too, so a small file cannot make it
build millions of Python objects.
"""

from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from edgeinfer.errors import InvalidModelError, ModelNotFoundError

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4
MAX_NAME_BYTES = 63  # ggml's GGML_MAX_NAME, less the terminating NUL
# Limits far above any real model (tens of keys, a thousand tensors, vocabularies and merges
# of up to 262k entries) and low enough that no file makes the reader take seconds or build
# millions of Python objects.
MAX_KEYS = 1024
MAX_TENSORS = 1 << 16
MAX_STRINGS = 1 << 20  # in all metadata arrays together
MAX_VOCABULARY = 1 << 19
# Arrays longer than this (vocabularies, merges, scores) are not decoded into Python values;
# numeric ones up to MAX_KEPT_ELEMENTS are kept as numpy arrays.
MAX_DECODED_ARRAY = 256
MAX_KEPT_ELEMENTS = 1 << 21
# Kept as raw bytes whatever its length: llama.cpp hashes every token and aborts on a
# duplicate, so the vocabulary checks need them all.
VOCABULARY_KEY = "tokenizer.ggml.tokens"
# Kept as raw bytes too: the tokenizer that runs without llama.cpp merges by them.
MERGES_KEY = "tokenizer.ggml.merges"

_U64 = struct.Struct("<Q")
_SCALAR_FORMATS: dict[GGUFValueType, str] = {
    GGUFValueType.UINT8: "<B",
    GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I",
    GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f",
    GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT64: "<d",
}


@dataclass(frozen=True)
class LongArray:
    """A metadata array too long to decode into Python values (vocabularies, merges, scores).

    Numbers come as a numpy array in ``values`` (None past MAX_KEPT_ELEMENTS). Strings are
    walked over, except the vocabulary (``tokenizer.ggml.tokens``, always a LongArray), whose
    tokens ``strings`` holds as raw bytes.
    """

    element_type: GGUFValueType
    count: int
    values: np.ndarray | None = None
    strings: tuple[bytes, ...] | None = None


def type_name(value_type: GGUFValueType, element_type: GGUFValueType | None = None) -> str:
    """A metadata type as messages show it: ``uint32``, ``string``, ``array[int32]``..."""
    name = value_type.name.lower()
    return f"{name}[{element_type.name.lower()}]" if element_type is not None else name


def array_length(value: Any) -> int:
    """Elements in a metadata array, whether kept or skipped; 0 for anything else."""
    if isinstance(value, LongArray):
        return value.count
    return len(value) if isinstance(value, list) else 0


@dataclass(frozen=True)
class TensorInfo:
    """One entry of the tensor directory, checked when read to lie inside the file.

    ``shape`` is in ggml order (fastest dimension first; ``numpy_shape`` reverses it), ``offset``
    counts from the start of the file. The data is ``n_rows`` rows of ``shape[0]`` elements, each
    row ``blocks_per_row`` blocks of the type's ``GGML_QUANT_SIZES`` (one element a block for
    F32 and F16), ``row_bytes`` bytes.
    """

    name: str
    shape: tuple[int, ...]
    type: GGMLQuantizationType
    offset: int
    nbytes: int

    @property
    def numpy_shape(self) -> tuple[int, ...]:
        """The shape as numpy indexes the data: a projection is ``(n_out, n_in)``."""
        return self.shape[::-1]

    @property
    def n_rows(self) -> int:
        return math.prod(self.shape[1:])

    @property
    def blocks_per_row(self) -> int:
        return self.shape[0] // GGML_QUANT_SIZES[self.type][0]

    @property
    def row_bytes(self) -> int:
        return self.blocks_per_row * GGML_QUANT_SIZES[self.type][1]


@dataclass(frozen=True)
class GGUFHeader:
    """Everything in a GGUF file except the weights."""

    path: Path
    version: int
    file_size: int
    metadata: dict[str, Any]
    types: dict[str, str]  # key -> its value's type_name(), e.g. "uint32", "array[string]"
    tensors: tuple[TensorInfo, ...]
    data_offset: int


class _Cursor:
    # Reads copy small byte strings out of the map; holding memoryview slices instead would
    # keep the map from closing while an exception's traceback is alive.
    def __init__(self, buf: mmap.mmap, path: Path) -> None:
        self.buf = buf
        self.pos = 0
        self.path = path
        self.strings_left = MAX_STRINGS

    def fail(self, what: str) -> InvalidModelError:
        return _invalid(self.path, what)

    def truncated(self, what: str) -> InvalidModelError:
        return self.fail(f"{what}; the file is truncated or corrupt")

    def past_end(self, what: str) -> InvalidModelError:
        return self.truncated(f"{what} runs past the end of the file at offset {self.pos}")

    def skip(self, n: int, what: str) -> None:
        if n < 0 or n > len(self.buf) - self.pos:
            raise self.past_end(f"{what} ({n} bytes)")
        self.pos += n

    def take(self, n: int, what: str) -> bytes:
        start = self.pos
        self.skip(n, what)
        return self.buf[start : self.pos]

    def scalar(self, fmt: str, what: str) -> Any:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt), what))[0]

    def string(self, what: str) -> str:
        raw = self.take(self.scalar("<Q", f"{what} length"), what)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail(f"{what} {raw[:64]!r} is not UTF-8") from None

    def strings(self, count: int, key: str, *, keep: bool) -> list[bytes]:
        """Walk past ``count`` strings, checking each length; with ``keep``, return their raw bytes."""
        # The hot loop of a header read (two 49k-entry vocab arrays): kept free of calls.
        buf, pos, end = self.buf, self.pos, len(self.buf)
        unpack_length = _U64.unpack_from
        kept: list[bytes] = []
        add = kept.append
        for i in range(count):
            if pos + 8 > end or pos + 8 + unpack_length(buf, pos)[0] > end:
                self.pos = pos
                length = f" ({unpack_length(buf, pos)[0]} bytes)" if pos + 8 <= end else ""
                raise self.past_end(f"element {i} of '{key}'{length}")
            following = pos + 8 + unpack_length(buf, pos)[0]
            if keep:
                add(buf[pos + 8 : following])
            pos = following
        self.pos = pos
        return kept

    def value(self, vtype: int, key: str) -> tuple[Any, str]:
        """The value of metadata ``key`` and its type_name()."""
        try:
            vtype = GGUFValueType(vtype)
        except ValueError:
            raise self.fail(f"key '{key}' has unknown value type {vtype}") from None
        if vtype == GGUFValueType.STRING:
            return self.string(f"value of '{key}'"), "string"
        if vtype == GGUFValueType.ARRAY:
            return self.array(key)
        return self.scalar(_SCALAR_FORMATS[vtype], f"value of '{key}'"), type_name(vtype)

    def array(self, key: str) -> tuple[Any, str]:
        etype_raw = self.scalar("<I", f"array type of '{key}'")
        count = self.scalar("<Q", f"array length of '{key}'")
        try:
            etype = GGUFValueType(etype_raw)
        except ValueError:
            raise self.fail(f"array '{key}' has unknown element type {etype_raw}") from None
        if etype == GGUFValueType.ARRAY:
            raise self.fail(f"array '{key}' nests arrays, which GGUF does not allow")
        kind = type_name(GGUFValueType.ARRAY, etype)
        min_size = 8 if etype == GGUFValueType.STRING else struct.calcsize(_SCALAR_FORMATS[etype])
        if count * min_size > len(self.buf) - self.pos:
            raise self.truncated(f"array '{key}' claims {count} elements, more than the file holds")
        if etype == GGUFValueType.STRING:
            return self.string_array(key, count), kind
        fmt = _SCALAR_FORMATS[etype]
        if count > MAX_KEPT_ELEMENTS:
            self.skip(count * min_size, f"array '{key}'")
            return LongArray(etype, count), kind
        values = np.frombuffer(self.take(count * min_size, f"array '{key}'"), fmt)
        return (values.tolist() if count <= MAX_DECODED_ARRAY else LongArray(etype, count, values=values)), kind

    def string_array(self, key: str, count: int) -> Any:
        # Every string costs a step of a Python loop, so a file full of empty strings could
        # keep the reader busy for seconds: all arrays together get a budget.
        if count > self.strings_left:
            raise self.fail(f"array '{key}' has {count} strings; all arrays together may hold {MAX_STRINGS}")
        self.strings_left -= count
        if key == VOCABULARY_KEY:
            if count > MAX_VOCABULARY:
                raise self.fail(f"'{key}' has {count} tokens, more than {MAX_VOCABULARY}")
            return LongArray(GGUFValueType.STRING, count, strings=tuple(self.strings(count, key, keep=True)))
        if key == MERGES_KEY:
            return LongArray(GGUFValueType.STRING, count, strings=tuple(self.strings(count, key, keep=True)))
        if count > MAX_DECODED_ARRAY:
            self.strings(count, key, keep=False)
            return LongArray(GGUFValueType.STRING, count)
        decoded = []
        for i, raw in enumerate(self.strings(count, key, keep=True)):
            try:
                decoded.append(raw.decode("utf-8"))
            except UnicodeDecodeError:
                raise self.fail(f"element {i} of '{key}' {raw[:64]!r} is not UTF-8") from None
        return decoded


def _invalid(path: Path, what: str) -> InvalidModelError:
    """The one-line error for a malformed GGUF file, ``what`` naming the field at fault."""
    return InvalidModelError(f"{path.name} is not a valid GGUF file: {what} (re-download or re-convert it)")


def check_in_file(tensor: TensorInfo, path: Path, file_size: int) -> None:
    """Raise InvalidModelError, naming the tensor, if its data runs past the file's ``file_size`` bytes."""
    end = tensor.offset + tensor.nbytes
    if end > file_size:
        raise _invalid(
            path,
            f"tensor '{tensor.name}' data ends at byte {end}, past the end of the file ({file_size} bytes); "
            "the file is truncated",
        )


def read_header(path: str | Path) -> GGUFHeader:
    """Read and check a GGUF file's metadata and tensor directory.

    Raises ModelNotFoundError for a missing file and InvalidModelError, with one
    line naming the field, for anything malformed.
    """
    path = Path(path)
    if not path.is_file():
        raise ModelNotFoundError(f"model file not found: {path}")
    file_size = path.stat().st_size
    if file_size < 24:
        raise InvalidModelError(f"{path.name} is not a GGUF file: only {file_size} bytes (re-download it)")
    try:
        with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            return _parse(_Cursor(mm, path), file_size)
    except OSError as exc:
        raise InvalidModelError(f"cannot read {path}: {exc.strerror or exc}") from None


def _parse(cur: _Cursor, file_size: int) -> GGUFHeader:
    if bytes(cur.take(4, "magic")) != GGUF_MAGIC:
        raise InvalidModelError(f"{cur.path.name} is not a GGUF file (no GGUF magic); pass a .gguf model")
    version = cur.scalar("<I", "version")
    if version not in SUPPORTED_VERSIONS:
        raise cur.fail(f"version {version} is not supported (only {', '.join(map(str, SUPPORTED_VERSIONS))})")
    n_tensors = cur.scalar("<Q", "tensor count")
    n_kv = cur.scalar("<Q", "metadata count")
    if n_kv > MAX_KEYS:
        raise cur.fail(f"metadata count {n_kv} is more than {MAX_KEYS}")
    if n_tensors > MAX_TENSORS:
        raise cur.fail(f"tensor count {n_tensors} is more than {MAX_TENSORS}")
    # Each key/value needs at least 8 (key length) + 4 (type) + 1 bytes; each tensor 8 + 4 + 4 + 8.
    if n_kv * 13 > file_size or n_tensors * 24 > file_size:
        raise cur.truncated(f"counts of {n_kv} keys and {n_tensors} tensors do not fit in {file_size} bytes")

    metadata: dict[str, Any] = {}
    types: dict[str, str] = {}
    for i in range(n_kv):
        key = cur.string(f"metadata key {i}")
        if not key or "\0" in key:  # llama.cpp looks keys up as C strings: "a\0b" would be found as "a"
            raise cur.fail(f"metadata key {i} ({key!r}) is empty or has a NUL byte")
        if key in metadata:
            raise cur.fail(f"metadata key '{key}' appears twice")
        metadata[key], types[key] = cur.value(cur.scalar("<I", f"type of '{key}'"), key)

    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if "general.alignment" in types and types["general.alignment"] != "uint32":
        raise cur.fail(f"general.alignment is {types['general.alignment']}, not uint32")
    if alignment <= 0 or alignment & (alignment - 1):
        raise cur.fail(f"general.alignment is {alignment}, not a power of two")

    raw_tensors = []
    names: set[str] = set()
    for i in range(n_tensors):
        name = cur.string(f"tensor name {i}")
        if len(name.encode()) > MAX_NAME_BYTES or "\0" in name:
            raise cur.fail(f"tensor name {name[:80]!r} is longer than {MAX_NAME_BYTES} bytes or has a NUL byte")
        if name in names:
            raise cur.fail(f"tensor '{name}' appears twice")
        names.add(name)
        n_dims = cur.scalar("<I", f"dimension count of '{name}'")
        if not 1 <= n_dims <= MAX_DIMS:
            raise cur.fail(f"tensor '{name}' has {n_dims} dimensions (1 to {MAX_DIMS} allowed)")
        shape = tuple(cur.scalar("<Q", f"shape of '{name}'") for _ in range(n_dims))
        type_raw = cur.scalar("<I", f"type of '{name}'")
        offset = cur.scalar("<Q", f"offset of '{name}'")
        raw_tensors.append((name, shape, type_raw, offset))

    data_offset = -(-cur.pos // alignment) * alignment
    tensors = []
    expected_offset = 0  # llama.cpp wants the tensors' data back to back, in directory order
    for name, shape, type_raw, offset in raw_tensors:
        if offset != expected_offset:
            raise cur.fail(
                f"tensor '{name}' has data offset {offset}; it should follow the previous one at {expected_offset}"
            )
        tensor = _check_tensor(cur, data_offset, file_size, name, shape, type_raw, offset)
        expected_offset += -(-tensor.nbytes // alignment) * alignment
        tensors.append(tensor)
    return GGUFHeader(cur.path, version, file_size, metadata, types, tuple(tensors), data_offset)


def _check_tensor(
    cur: _Cursor,
    data_offset: int,
    file_size: int,
    name: str,
    shape: tuple[int, ...],
    type_raw: int,
    offset: int,
) -> TensorInfo:
    if any(d <= 0 or d >= 2**63 for d in shape):  # llama.cpp reads dimensions as signed
        raise cur.fail(f"tensor '{name}' has shape {list(shape)} with a dimension that is not positive")
    n_elements = math.prod(shape)
    if n_elements >= 2**62:
        raise cur.fail(f"tensor '{name}' has shape {list(shape)}, too many elements")
    try:
        qtype = GGMLQuantizationType(type_raw)
        block_size, type_size = GGML_QUANT_SIZES[qtype]
    except (ValueError, KeyError):
        raise cur.fail(f"tensor '{name}' has unknown type {type_raw}") from None
    if shape[0] % block_size:
        raise cur.fail(f"tensor '{name}' rows of {shape[0]} do not divide into {qtype.name} blocks of {block_size}")
    tensor = TensorInfo(name, shape, qtype, data_offset + offset, n_elements // block_size * type_size)
    check_in_file(tensor, cur.path, file_size)
    return tensor
