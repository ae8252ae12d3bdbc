"""models/tensors.py: raw blocks as views of one map, floats as gguf-py makes them, and a cut-short file named."""

from __future__ import annotations

import gc
import mmap
from pathlib import Path

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize
from tiny_model import write_tiny_gguf

from edgeinfer.errors import InvalidModelError, ModelNotFoundError
from edgeinfer.models.info import load_model_info
from edgeinfer.models.tensors import GGUFTensors, open_tensors

TINY_TYPES = ("F32", "F16", "Q8_0", "Q4_0", "Q4_1")


@pytest.fixture(scope="module", params=["default", *TINY_TYPES])
def gguf(request, model_path, tmp_path_factory) -> Path:
    if request.param == "default":
        return model_path
    return write_tiny_gguf(tmp_path_factory.mktemp("tiny") / f"{request.param}.gguf", tensor_type=request.param)


@pytest.fixture(scope="module")
def reader(gguf) -> GGUFReader:
    return GGUFReader(gguf)


@pytest.fixture
def tiny(tmp_path) -> Path:
    return write_tiny_gguf(tmp_path / "tiny.gguf", tensor_type="Q4_1")


def one_line(exc: pytest.ExceptionInfo) -> str:
    message = str(exc.value)
    assert message and "\n" not in message
    return message


def whole_map(view: np.ndarray) -> np.ndarray:
    """The array at the end of a view's ``base`` chain: the map of the whole file."""
    while isinstance(view.base, np.ndarray):
        view = view.base
    return view


def address(array: np.ndarray) -> int:
    return array.__array_interface__["data"][0]


def test_names_types_shapes_and_offsets_are_gguf_readers(gguf, reader):
    with open_tensors(gguf) as tensors:
        assert list(tensors) == [t.name for t in reader.tensors]
        for expected in reader.tensors:
            t = tensors[expected.name]
            assert t.type == expected.tensor_type
            assert t.shape == tuple(expected.shape.tolist())  # ggml order
            assert t.numpy_shape == tuple(reversed(expected.shape.tolist()))
            assert (t.offset, t.nbytes) == (expected.data_offset, expected.n_bytes)
            block_size, type_size = GGML_QUANT_SIZES[t.type]
            assert t.blocks_per_row == t.shape[0] // block_size
            assert t.row_bytes == t.blocks_per_row * type_size


def test_raw_is_a_read_only_view_of_one_map(gguf, reader):
    with open_tensors(gguf) as tensors:
        first = tensors.raw(reader.tensors[0].name)
        file = whole_map(first)
        assert isinstance(file.base, mmap.mmap) and file.shape == (gguf.stat().st_size,)
        for expected in reader.tensors:
            t = tensors[expected.name]
            raw = tensors.raw(t.name)
            assert raw.dtype == np.uint8 and raw.shape == (t.n_rows, t.row_bytes)
            assert not raw.flags.writeable
            assert whole_map(raw) is file and np.shares_memory(raw, file)
            assert address(raw) - address(file) == t.offset  # no copy: the file's own bytes, in place
            assert np.array_equal(raw.reshape(-1), expected.data.reshape(-1).view(np.uint8))


def test_float_types_view_as_their_elements(tmp_path):
    path = write_tiny_gguf(tmp_path / "f16.gguf", tensor_type="F16")
    reader = GGUFReader(path)
    with open_tensors(path) as tensors:
        for expected in reader.tensors:
            t = tensors[expected.name]
            elements = tensors.raw(t.name).view(np.float16 if t.type == GGMLQuantizationType.F16 else np.float32)
            assert np.array_equal(elements.reshape(t.numpy_shape), expected.data)


def test_dequantize_is_gguf_pys_and_the_callers_own(gguf, reader):
    with open_tensors(load_model_info(gguf)) as tensors:
        for expected in reader.tensors:
            t = tensors[expected.name]
            floats = tensors.dequantize(t.name)
            assert floats.dtype == np.float32 and floats.shape == t.numpy_shape
            assert floats.flags.writeable and not np.shares_memory(floats, tensors.raw(t.name))
            from_reader = dequantize(expected.data, t.type).reshape(t.numpy_shape)
            assert np.array_equal(floats, from_reader)
            assert np.array_equal(floats, dequantize(tensors.raw(t.name), t.type).reshape(t.numpy_shape))


def test_a_file_cut_short_after_its_header_was_read_names_the_tensor(tiny):
    info = load_model_info(tiny)
    last = info.tensors[-1]
    with tiny.open("r+b") as f:
        f.truncate(last.offset + 1)
    with pytest.raises(InvalidModelError) as exc:
        open_tensors(info)
    assert f"tensor '{last.name}' data ends at byte {last.offset + last.nbytes}" in one_line(exc)
    assert "truncated" in one_line(exc)
    with pytest.raises(InvalidModelError) as from_path:
        open_tensors(tiny)  # reads the header again: the same check, the same line
    assert one_line(from_path) == one_line(exc)


def test_a_file_that_changed_size_is_refused(tiny):
    info = load_model_info(tiny)
    with tiny.open("ab") as f:
        f.write(bytes(64))
    with pytest.raises(InvalidModelError) as exc:
        open_tensors(info)
    assert "changed since its header was read" in one_line(exc)


def test_a_file_gone_since_its_header_was_read(tiny):
    info = load_model_info(tiny)
    tiny.unlink()
    with pytest.raises(ModelNotFoundError) as exc:
        open_tensors(info)
    assert tiny.name in one_line(exc)


def test_close_is_safe_twice_and_views_outlive_it(tiny):
    tensors = GGUFTensors(load_model_info(tiny))
    name = next(iter(tensors))
    raw = tensors.raw(name)
    copy = raw.copy()
    tensors.close()
    tensors.close()
    gc.collect()
    assert np.array_equal(raw, copy)  # the view holds the map
    for use in (tensors.raw, tensors.dequantize):
        with pytest.raises(ValueError, match="closed"):
            use(name)


def test_unmapped_once_the_last_view_is_gone(tiny):
    maps = Path("/proc/self/maps")  # the process's mappings, by file
    if not maps.exists():
        pytest.skip("needs Linux's /proc/self/maps")
    tensors = open_tensors(tiny)
    raw = tensors.raw(next(iter(tensors)))
    tensors.close()
    assert str(tiny) in maps.read_text()
    del raw
    gc.collect()
    assert str(tiny) not in maps.read_text()
