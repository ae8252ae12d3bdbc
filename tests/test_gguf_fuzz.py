"""Malformed GGUF files never reach llama.cpp: each is rejected with one line naming the field, or loads.

Hand-made files cover each field the 2024 GGUF CVEs were in, and each metadata mistake
that was seen to crash llama.cpp; a seeded fuzz subset covers the rest
(scripts/fuzz_gguf.py runs thousands more). Files validation accepts are loaded in real
llama.cpp in a child process, so a crash names the file instead of killing the run.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFValue, GGUFValueType
from gguf_mutate import Field, layout, limit_files, mutants, validate
from llamacpp_archs import write_tiny_granite
from native_load import load_in_llamacpp
from tiny_model import BPE_MERGES, CHATML_SPECIALS, SPM_PIECES, write_tiny_gguf

from edgeinfer import Engine, InvalidModelError
from edgeinfer.models.arch import expected_tensors
from edgeinfer.models.info import load_model_info
from edgeinfer.vocabulary import byte_symbols

from support import evaluate

SMALL = dict(n_layer=1, n_embd=64, n_head=2, n_head_kv=1, n_ff=128)
FUZZ_CASES = 300
MAX_SECONDS = 2.0
MAX_BYTES = 64 * 2**20
# Left to llama.cpp and the engine on purpose (see scripts/fuzz_gguf.py).
EXPECTED_NATIVE_REFUSALS = ("unknown pre-tokenizer type", "NaN or infinite logits")


@pytest.fixture(scope="module")
def bases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Three small valid models: llama with a BPE vocabulary and Q8_0 weights; qwen2 with SentencePiece, f32,
    untied; granite, which edgeinfer leaves to llama.cpp and checks by gguf-py's tables alone."""
    tmp = tmp_path_factory.mktemp("bases")
    return {
        "bpe": write_tiny_gguf(tmp / "bpe.gguf", arch="llama", tokenizer="gpt2", tensor_type="Q8_0", **SMALL),
        "spm": write_tiny_gguf(tmp / "spm.gguf", arch="qwen2", tokenizer="llama", tied=False, **SMALL),
        "granite": write_tiny_granite(tmp / "granite.gguf", tensor_type="Q8_0", **SMALL),
    }


# -- the tiny model builder ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("arch", "tensor_type", "tokenizer", "tied"),
    [
        ("llama", "F32", "gpt2", True),
        ("mistral", "Q4_0", "llama", True),
        ("qwen2", "Q8_0", "gpt2", False),
        ("qwen2", "F16", "llama", True),
        ("llama", "Q4_1", "llama", False),
    ],
)
def test_tiny_models_are_valid_and_generate(tmp_path, arch, tensor_type, tokenizer, tied):
    path = write_tiny_gguf(tmp_path / "tiny.gguf", arch=arch, tensor_type=tensor_type, tokenizer=tokenizer, tied=tied)
    info = load_model_info(path)
    hp = info.hparams
    assert (hp.n_layer, hp.n_embd, hp.n_head, hp.n_head_kv, hp.head_dim, hp.n_ff) == (2, 128, 2, 1, 64, 256)
    assert hp.arch.name == ("llama" if arch == "mistral" else arch) and hp.tied_embeddings == tied
    assert {t.name: t.shape for t in info.tensors} == expected_tensors(hp)
    assert {t.type.name for t in info.tensors if len(t.shape) == 2} == {tensor_type}
    with Engine(path, kv_budget="256tok", threads=1) as engine:
        assert engine.tokenizer.n_vocab == hp.n_vocab
        assert len(engine.tokenizer.encode("<|im_start|>", add_special=False)) == 1  # a control token, whole
        logits = evaluate(engine.backend, engine.tokenize("Hi, the wörld €!"), 0)
        assert np.isfinite(logits).all() and logits.std() > 1e-3
        engine.reset()
        result = engine.chat([{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0)
        assert 1 <= len(result.tokens) <= 4 and result.finish_reason in ("length", "stop")


def test_tiny_models_differ_by_seed_and_not_otherwise(tmp_path):
    a, b, c = (write_tiny_gguf(tmp_path / f"{n}.gguf", seed=s, **SMALL) for n, s in (("a", 1), ("b", 1), ("c", 2)))
    assert a.read_bytes() == b.read_bytes() != c.read_bytes()


# -- hand-made files, one per field --------------------------------------------------------------


def field(data: bytes, kind: str, owner: str) -> Field:
    """The first field of ``kind`` belonging to ``owner`` (a key or tensor name, "" for the file)."""
    return next(f for f in layout(data) if f.kind == kind and f.owner == owner)


def overwrite(data: bytes, at: Field, raw: bytes) -> bytes:
    return data[: at.offset] + raw + data[at.offset + len(raw) :]


def set_field(data: bytes, kind: str, owner: str, value: int) -> bytes:
    at = field(data, kind, owner)
    return overwrite(data, at, value.to_bytes(at.size, "little"))


def add_to_field(data: bytes, kind: str, owner: str, delta: int) -> bytes:
    at = field(data, kind, owner)
    return set_field(data, kind, owner, int.from_bytes(data[at.offset : at.end], "little") + delta)


def copy_name(data: bytes, kind: str, src: str, dst: str) -> bytes:
    """Write name ``src`` over name ``dst`` (of the same length)."""
    source = field(data, kind, src)
    return overwrite(data, field(data, kind, dst), data[source.offset : source.end])


def gpt2_tokens() -> list[str]:
    return byte_symbols() + [a + b for a, b in BPE_MERGES] + CHATML_SPECIALS


def spm_tokens(without: int) -> list[str]:
    byte_tokens = [f"<0x{b:02X}>" for b in range(256) if b != without]
    return ["<unk>", "<s>", "</s>", *byte_tokens, *SPM_PIECES, *CHATML_SPECIALS[1:]]


N_VOCAB = len(gpt2_tokens())  # of the "bpe" base


E = 2**64 - 1  # the largest u64: what a count or length overflows with
Patch = Callable[[bytes], bytes]
PATCHES: list[tuple[str, Patch, str]] = [
    ("magic", lambda d: b"GGML" + d[4:], "is not a GGUF file (no GGUF magic)"),
    ("version", lambda d: set_field(d, "version", "", 4), "version 4 is not supported"),
    ("tensor count huge", lambda d: set_field(d, "tensor count", "", 2**63), f"tensor count {2**63} is more than"),
    ("tensor count too big", lambda d: set_field(d, "tensor count", "", 60000), "keys and 60000 tensors do not fit"),
    ("key count huge", lambda d: set_field(d, "key count", "", E), f"metadata count {E} is more than"),
    ("key length huge", lambda d: set_field(d, "key length", "general.name", E), f"metadata key 1 ({E} bytes) runs"),
    (
        "string length huge",
        lambda d: set_field(d, "string length", "tokenizer.chat_template", 2**40),
        f"value of 'tokenizer.chat_template' ({2**40} bytes) runs past the end",
    ),
    (
        "array length huge",
        lambda d: set_field(d, "array length", "tokenizer.ggml.token_type", E),
        f"array 'tokenizer.ggml.token_type' claims {E} elements",
    ),
    (
        "array string length huge",
        lambda d: set_field(d, "array string length", "tokenizer.ggml.tokens", 2**63),
        f"element 0 of 'tokenizer.ggml.tokens' ({2**63} bytes) runs past the end",
    ),
    (
        "value type",
        lambda d: set_field(d, "value type", "general.name", 13),
        "key 'general.name' has unknown value type 13",
    ),
    (
        "array of arrays",
        lambda d: set_field(d, "array type", "tokenizer.ggml.merges", GGUFValueType.ARRAY),
        "array 'tokenizer.ggml.merges' nests arrays",
    ),
    (
        "tensor name length huge",
        lambda d: set_field(d, "tensor name length", "token_embd.weight", E),
        f"tensor name 0 ({E} bytes) runs past the end",
    ),
    (
        "duplicate key",
        lambda d: copy_name(d, "key", "tokenizer.ggml.model", "llama.context_length"),
        "metadata key 'tokenizer.ggml.model' appears twice",
    ),
    (
        "duplicate tensor",
        lambda d: copy_name(d, "tensor name", "blk.0.attn_k.weight", "blk.0.attn_q.weight"),
        "tensor 'blk.0.attn_k.weight' appears twice",
    ),
    (
        "NUL in a key",
        lambda d: overwrite(d, field(d, "key", "general.name"), b"general.nam\0"),
        "metadata key 1 ('general.nam\\x00') is empty or has a NUL byte",
    ),
    (
        "too many dimensions",
        lambda d: set_field(d, "dimension count", "token_embd.weight", 5),
        "tensor 'token_embd.weight' has 5 dimensions (1 to 4 allowed)",
    ),
    (
        "no dimensions",
        lambda d: set_field(d, "dimension count", "output_norm.weight", 0),
        "tensor 'output_norm.weight' has 0 dimensions",
    ),
    (
        "zero dimension",
        lambda d: set_field(d, "dimension", "token_embd.weight", 0),
        f"tensor 'token_embd.weight' has shape [0, {N_VOCAB}] with a dimension that is not positive",
    ),
    (
        "negative dimension",
        lambda d: set_field(d, "dimension", "token_embd.weight", 2**64 - 64),
        "with a dimension that is not positive",
    ),
    (
        "element count overflow",
        lambda d: set_field(d, "dimension", "token_embd.weight", 2**58),
        f"tensor 'token_embd.weight' has shape [{2**58}, {N_VOCAB}], too many elements",
    ),
    (
        "unknown tensor type",
        lambda d: set_field(d, "tensor type", "token_embd.weight", 99),
        "tensor 'token_embd.weight' has unknown type 99",
    ),
    (
        "rows not whole blocks",
        lambda d: set_field(d, "dimension", "token_embd.weight", 48),
        "tensor 'token_embd.weight' rows of 48 do not divide into Q8_0 blocks of 32",
    ),
    (
        "integer weights",
        lambda d: set_field(d, "tensor type", "output_norm.weight", 26),
        "tensor 'output_norm.weight' has type I32, which llama.cpp cannot use for a vector",
    ),
    (
        "misaligned offset",
        lambda d: add_to_field(d, "tensor offset", "blk.0.attn_q.weight", 1),
        "tensor 'blk.0.attn_q.weight' has data offset 18977; it should follow the previous one at 18976",
    ),
    (
        "overlapping offset",
        lambda d: set_field(d, "tensor offset", "blk.0.attn_q.weight", 0),
        "tensor 'blk.0.attn_q.weight' has data offset 0; it should follow the previous one at",
    ),
    (
        "offset past the end",
        lambda d: set_field(d, "tensor offset", "output_norm.weight", 2**62),
        f"tensor 'output_norm.weight' has data offset {2**62}",
    ),
    ("data cut short", lambda d: d[:-100], "tensor 'output_norm.weight' data ends at byte"),
]


@pytest.mark.parametrize(("patch", "field"), [(p, f) for _, p, f in PATCHES], ids=[n for n, _, _ in PATCHES])
def test_malformed_fields_are_named(bases, tmp_path, patch, field):
    path = tmp_path / "bad.gguf"
    path.write_bytes(patch(bases["bpe"].read_bytes()))
    assert field in rejection(path)


def u32(value: int) -> GGUFValue:
    return GGUFValue(value, GGUFValueType.UINT32)


def array(values: list, element_type: GGUFValueType) -> GGUFValue:
    return GGUFValue(values, GGUFValueType.ARRAY, element_type)


# Metadata that is well-formed GGUF but wrong for llama.cpp. Those marked "crash" were seen to
# abort llama.cpp (the build llama-cpp-python 0.3.36 ships) when validation let them through.
METADATA: list[tuple[str, str, dict, str]] = [
    ("missing key", "gpt2", {"llama.block_count": None}, "lacks the metadata key 'llama.block_count'"),
    ("no architecture", "gpt2", {"general.architecture": None}, "lacks the metadata key 'general.architecture'"),
    (
        "architecture renamed",
        "gpt2",
        {"general.architecture": GGUFValue("zzzzz", GGUFValueType.STRING)},
        "says its architecture is 'zzzzz' but has none of its metadata",
    ),
    ("no tokenizer", "gpt2", {"tokenizer.ggml.model": None}, "lacks the metadata key 'tokenizer.ggml.model'"),
    (
        "wrong key type",
        "gpt2",
        {"llama.block_count": GGUFValue(1, GGUFValueType.UINT8)},
        "'llama.block_count' is uint8",
    ),
    (
        "architecture not a string",
        "gpt2",
        {"general.architecture": array(["llama"], GGUFValueType.STRING)},
        "'general.architecture' = ['llama'] is not an architecture name",
    ),
    ("alignment", "gpt2", {"general.alignment": u32(48)}, "general.alignment is 48, not a power of two"),
    (
        "alignment type",
        "gpt2",
        {"general.alignment": GGUFValue(32, GGUFValueType.UINT64)},
        "general.alignment is uint64",
    ),
    (
        "shape disagrees",
        "gpt2",
        {"llama.feed_forward_length": u32(512)},
        "tensor 'blk.0.ffn_gate.weight' has shape [64, 128], but the metadata implies [64, 512]",
    ),
    (
        "scores too short",
        "llama",
        {"tokenizer.ggml.scores": array([0.0] * 10, GGUFValueType.FLOAT32)},
        "'tokenizer.ggml.scores' has 10 entries for 277 tokens",
    ),
    (
        "token types too long",
        "gpt2",
        {"tokenizer.ggml.token_type": array([1] * 300, GGUFValueType.INT32)},
        "'tokenizer.ggml.token_type' has 300 entries for 275 tokens",
    ),
    (
        "scores of the wrong type",
        "llama",
        {"tokenizer.ggml.scores": array([0] * 277, GGUFValueType.UINT8)},
        "'tokenizer.ggml.scores' is array[uint8], but llama.cpp reads it as array[float32]",
    ),
    (
        "special id out of range",
        "gpt2",
        {"tokenizer.ggml.eos_token_id": u32(10**6)},
        "'tokenizer.ggml.eos_token_id' = 1000000 is not a token id below 275",
    ),
    (
        "special id signed",
        "gpt2",
        {"tokenizer.ggml.bos_token_id": GGUFValue(-1, GGUFValueType.INT32)},
        "'tokenizer.ggml.bos_token_id' is int32",
    ),
    (
        "zero KV heads",
        "gpt2",
        {"llama.attention.head_count_kv": u32(0)},
        "'llama.attention.head_count_kv' = 0 is out of range",
    ),
    (
        "too many layers",
        "gpt2",
        {"llama.block_count": u32(513)},
        "'llama.block_count' = 513 is out of range (1 to 512)",
    ),
    (
        "tiny RoPE base",
        "gpt2",
        {"llama.rope.freq_base": GGUFValue(1e-40, GGUFValueType.FLOAT32)},
        "e-41 is out of range (1 to",
    ),
    (
        "NaN epsilon",
        "gpt2",
        {"llama.attention.layer_norm_rms_epsilon": GGUFValue(float("nan"), GGUFValueType.FLOAT32)},
        "= nan is out of range",
    ),
    ("short context", "gpt2", {"llama.context_length": u32(3)}, "'llama.context_length' = 3 is out of range (64 to"),
    (
        "partial RoPE",
        "gpt2",
        {"llama.rope.dimension_count": u32(16)},
        "'llama.rope.dimension_count' = 16; llama models need 32",
    ),
    # crash: GGML_ASSERT(hparams.n_expert_used <= hparams.n_expert)
    ("experts used", "gpt2", {"llama.expert_used_count": u32(2)}, "'llama.expert_used_count' = 2; llama models need 0"),
    # crash: GGML_ASSERT(hparams.n_expert <= LLAMA_MAX_EXPERTS)
    ("experts", "gpt2", {"llama.expert_count": u32(100000)}, "'llama.expert_count' = 100000; llama models need 0"),
    # crash: GGML_ASSERT(rope_scaling_type_train != LLAMA_ROPE_SCALING_TYPE_UNSPECIFIED)
    (
        "RoPE scaling",
        "gpt2",
        {"llama.rope.scaling.type": GGUFValue("bogus", GGUFValueType.STRING)},
        "'llama.rope.scaling.type' = 'bogus' is not one of none, linear, yarn, longrope",
    ),
    # crash: GGML_ASSERT(id_to_token.size() == token_to_id.size())
    (
        "duplicate token",
        "gpt2",
        {"tokenizer.ggml.tokens": array(gpt2_tokens()[:-1] + ["Ġt"], GGUFValueType.STRING)},
        "token 274 b'\\xc4\\xa0t' in 'tokenizer.ggml.tokens' repeats token 256",
    ),
    (
        "empty token named like a real one",
        "gpt2",
        {"tokenizer.ggml.tokens": array(gpt2_tokens()[:-2] + ["[EMPTY_274]", ""], GGUFValueType.STRING)},
        "token 274 b'[EMPTY_274]' in 'tokenizer.ggml.tokens' repeats token 273",
    ),
    # crash: std::out_of_range from unordered_map::at, tokenizing text with the missing byte
    (
        "SentencePiece without a byte token",
        "llama",
        {
            "tokenizer.ggml.tokens": array(spm_tokens(without=0xE2), GGUFValueType.STRING),
            "tokenizer.ggml.scores": array([0.0] * 276, GGUFValueType.FLOAT32),
            "tokenizer.ggml.token_type": array([2, 3, 3] + [6] * 255 + [1] * 16 + [3, 3], GGUFValueType.INT32),
            "tokenizer.ggml.eos_token_id": u32(275),
        },
        "lacks the byte token <0xE2>",
    ),
    (
        "byte token not spelled as one",
        "gpt2",
        {"tokenizer.ggml.token_type": array([6] + [1] * 274, GGUFValueType.INT32)},
        "token 0 b'\\xc4\\x80' has type BYTE in 'tokenizer.ggml.token_type' but is not spelled <0xXX>",
    ),
]


@pytest.mark.parametrize(("tokenizer", "metadata", "field"), [m[1:] for m in METADATA], ids=[m[0] for m in METADATA])
def test_malformed_metadata_is_named(tmp_path, tokenizer, metadata, field):
    path = write_tiny_gguf(tmp_path / "bad.gguf", tokenizer=tokenizer, metadata=metadata, **SMALL)
    assert field in rejection(path)


PAST_THE_LIMITS = {
    "most keys, float arrays": "metadata count 1025 is more than 1024",
    "most keys, string arrays": "metadata count 1025 is more than 1024",
    "most strings": "array 'x' has 1048577 strings; all arrays together may hold 1048576",
    "largest vocabulary": "'tokenizer.ggml.tokens' has 524289 tokens, more than 524288",
}


def test_files_past_the_readers_limits_are_rejected(tmp_path):
    """The caps that keep any file from costing seconds or millions of objects (scripts/fuzz_gguf.py
    times files exactly at them)."""
    files = limit_files(extra=1)
    assert files.keys() == PAST_THE_LIMITS.keys()
    for name, data in files.items():
        path = tmp_path / "limit.gguf"
        path.write_bytes(data)
        assert PAST_THE_LIMITS[name] in rejection(path), name


def rejection(path: Path) -> str:
    with pytest.raises(InvalidModelError) as exc:
        load_model_info(path)
    message = str(exc.value)
    assert message and "\n" not in message and path.name in message
    return message


# -- fuzzing ------------------------------------------------------------------------------------------


def test_mutated_files_are_rejected_or_load_in_llamacpp(bases, tmp_path):
    """Seeded mutants of both bases: each is rejected in one line, fast and in bounded memory, or loads."""
    accepted: list[tuple[Path, str]] = []
    rejected = 0
    for name, base in bases.items():
        for i, data, what in mutants(base.read_bytes(), FUZZ_CASES // len(bases), seed=7):
            path = tmp_path / f"{name}-{i:04d}.gguf"
            path.write_bytes(data)
            result = validate(path)  # anything but InvalidModelError fails the test here
            case = f"{path.name} ({what})"
            assert result.seconds < MAX_SECONDS, case
            assert result.peak_bytes < MAX_BYTES, case
            if result.accepted:
                accepted.append((path, case))
            else:
                rejected += 1
                assert "\n" not in result.message and path.name in result.message, case
                path.unlink()
    # Enough of both outcomes that the test means something; the seed fixes the numbers.
    assert rejected > FUZZ_CASES // 2 and len(accepted) > 10

    outcomes = load_in_llamacpp([p for p, _ in accepted], bases["bpe"])
    problems = [
        f"{case}: {o.status} {o.detail}"
        for o, (_, case) in zip(outcomes, accepted, strict=True)
        if o.status != "ok" and not any(r in o.detail for r in EXPECTED_NATIVE_REFUSALS)
    ]
    assert not problems


def test_the_fuzz_harness_catches_a_native_crash(bases, tmp_path):
    """A file llama.cpp aborts on is reported as a crash by name, and the files after it still load."""
    crash = tmp_path / "crash.gguf"
    crash.write_bytes(set_field(bases["bpe"].read_bytes(), "tensor type", "output_norm.weight", 26))  # I32 norm
    outcomes = load_in_llamacpp([bases["spm"], crash, bases["spm"]], bases["bpe"], checked=False)
    assert [o.status for o in outcomes] == ["ok", "crashed", "ok"]
    assert outcomes[1].path == crash


def test_mutants_are_reproducible(bases):
    data = bases["bpe"].read_bytes()
    first = [d for _, d, _ in mutants(data, 20, seed=3)]
    assert first == [d for _, d, _ in mutants(data, 20, seed=3)]
    assert first != [d for _, d, _ in mutants(data, 20, seed=4)]
