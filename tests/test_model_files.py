"""Missing, truncated and non-GGUF model files fail with one clear line, before llama.cpp sees them."""

from __future__ import annotations

import struct

import pytest

from edgeinfer import Engine, InvalidModelError, ModelNotFoundError
from edgeinfer.models.gguf_file import read_header
from edgeinfer.models.info import load_model_info


def one_line(exc: pytest.ExceptionInfo) -> str:
    message = str(exc.value)
    assert message and "\n" not in message
    return message


def test_the_real_header(model_path):
    info = load_model_info(model_path)
    hp = info.hparams
    assert (info.architecture, hp.n_layer, hp.n_embd, hp.n_head, hp.n_ff) == ("llama", 30, 576, 9, 1536)
    assert hp.n_head_kv == 3 and hp.head_dim == 64 and hp.n_vocab == 49152 and hp.tied_embeddings
    assert hp.rope_base == 100000 and hp.arch.rope_style == "norm" and not hp.arch.qkv_bias
    assert hp.n_ctx_train == 8192 and info.kv_values_per_token == 11520  # 2 x 30 layers x 3 KV heads x 64
    assert info.tensor_types == {"Q8_0": 1, "F32": 61, "Q4_1": 210}


def test_missing_file(tmp_path):
    with pytest.raises(ModelNotFoundError) as exc:
        Engine(tmp_path / "nope.gguf")
    assert "nope.gguf" in one_line(exc)


def test_not_a_gguf(tmp_path):
    fake = tmp_path / "notes.gguf"
    fake.write_text("This is a text file, not a model. " * 10)
    with pytest.raises(InvalidModelError) as exc:
        Engine(fake)
    assert "not a GGUF file" in one_line(exc)


def test_empty_file(tmp_path):
    empty = tmp_path / "empty.gguf"
    empty.touch()
    with pytest.raises(InvalidModelError) as exc:
        Engine(empty)
    assert "0 bytes" in one_line(exc)


@pytest.mark.parametrize("keep", [0.5, 0.99, 0.001])
def test_truncated_file(model_path, tmp_path, keep):
    data = model_path.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(InvalidModelError) as exc:
        Engine(cut)
    assert "truncated" in one_line(exc)


def header(n_tensors: int, n_kv: int, body: bytes = b"") -> bytes:
    return b"GGUF" + struct.pack("<IQQ", 3, n_tensors, n_kv) + body


def kv_string(key: str, value: str) -> bytes:
    return struct.pack("<Q", len(key)) + key.encode() + struct.pack("<IQ", 8, len(value)) + value.encode()


@pytest.mark.parametrize(
    ("data", "field"),
    [
        (b"GGUF" + struct.pack("<I", 99) + bytes(16), "version 99"),
        (header(2**60, 0), f"tensor count {2**60} is more than"),
        (header(0, 2**40), f"metadata count {2**40} is more than"),
        (header(1000, 0), "counts of 0 keys and 1000 tensors do not fit"),
        (header(0, 1, struct.pack("<Q", 2**50) + b"key"), f"metadata key 0 ({2**50} bytes) runs past the end"),
        (header(0, 1, struct.pack("<Q", 3) + b"abc" + struct.pack("<IIQ", 9, 8, 2**55)), "claims"),
        (header(0, 2, kv_string("a", "x") + kv_string("a", "y")), "appears twice"),
        (header(0, 1, struct.pack("<Q", 1) + b"k" + struct.pack("<I", 77)), "unknown value type 77"),
        (header(0, 1, struct.pack("<Q", 1) + b"k" + struct.pack("<IQ", 8, 2) + b"\xff\xfe"), "not UTF-8"),
    ],
)
def test_malformed_headers_name_the_field(tmp_path, data, field):
    path = tmp_path / "bad.gguf"
    path.write_bytes(data + bytes(64))
    with pytest.raises(InvalidModelError) as exc:
        read_header(path)
    assert field in one_line(exc)


def test_missing_architecture_keys(tmp_path):
    path = tmp_path / "bare.gguf"
    path.write_bytes(header(0, 1, kv_string("general.architecture", "llama")) + bytes(64))
    with pytest.raises(InvalidModelError) as exc:
        load_model_info(path)
    assert "llama.block_count" in one_line(exc)
