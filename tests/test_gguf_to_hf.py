"""scripts/gguf_to_hf.py writes an HF checkpoint that computes and tokenizes as llama.cpp does on the GGUF."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFValue, GGUFValueType
from tiny_model import write_tiny_gguf
from tokenizers import Tokenizer

from edgeinfer import Engine
from edgeinfer.tokenizer import Tokenizer as LlamaTokenizer

from support import load_script

CHECKOUT = Path(__file__).parents[1]
SCRIPTS = CHECKOUT / "scripts"


gguf_to_hf = load_script("gguf_to_hf")
hf_forward = load_script("hf_forward")


@pytest.mark.parametrize(
    ("arch", "options"),
    [
        ("llama", {}),  # Q/K rows permuted back, two heads sharing one KV head
        ("mistral", {"tied": False}),  # a GGUF "llama" with its own output matrix: lm_head.weight
        ("qwen2", {"n_head": 4, "n_embd": 256, "n_head_kv": 2}),  # q/k/v biases, no permutation
    ],
)
def test_hf_layout_forward_equals_llamacpp_on_the_gguf(tmp_path, arch, options):
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf", arch=arch, **options)
    gguf_to_hf.gguf_to_hf(gguf, tmp_path / "hf")
    tokens = list(np.random.default_rng(2).integers(3, 250, size=32))
    with Engine(gguf, backend="llamacpp", kv_budget="256tok", kv_type="f32", threads=2) as engine:
        theirs = engine.logits(tokens).astype(np.float64)
    ours = hf_forward.hf_forward(tmp_path / "hf", None, tokens)
    assert hf_forward.relative_error(ours, theirs) < 1e-4
    assert (ours.argmax(axis=1) == theirs.argmax(axis=1)).all()


def test_bf16_checkpoint_holds_each_weight_rounded_to_nearest_even(tmp_path):
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf")
    gguf_to_hf.gguf_to_hf(gguf, tmp_path / "f32")
    gguf_to_hf.gguf_to_hf(gguf, tmp_path / "bf16", dtype="bf16")
    exact = hf_forward.read_safetensors(tmp_path / "f32" / "model.safetensors")
    rounded = hf_forward.read_safetensors(tmp_path / "bf16" / "model.safetensors")
    assert rounded.keys() == exact.keys()
    for name, x in exact.items():
        # The two bfloat16 neighbours of each float32: truncated, and one unit further from zero.
        low = (x.view(np.uint32) & 0xFFFF0000).view(np.float32)
        high = ((x.view(np.uint32) & 0xFFFF0000) + 0x10000).view(np.float32)
        nearest = np.where(np.abs(x - low) <= np.abs(high - x), low, high)
        tie = np.abs(x - low) == np.abs(high - x)
        even = np.where((low.view(np.uint32) >> 16) & 1, high, low)
        np.testing.assert_array_equal(rounded[name], np.where(tie, even, nearest), err_msg=name)
    halfway = np.array([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8)], dtype=np.float32)
    assert gguf_to_hf.to_dtype(halfway, "bf16").tolist() == [0x3F80, 0x3F82, 0xBF80]


SAMPLES = [
    "The keeper climbed the ninety-two steps at 7:45 pm, didn't he?  Twice.\n\n",
    "def mean(xs: list[float]) -> float:\n\treturn sum(xs) / len(xs)  # 1e-3\n",
    "Η Αθήνα είναι η πρωτεύουσα. 北京是中国的首都。 🚀 naïve",
]


@pytest.mark.parametrize("pre", ["gpt-2", "smollm", "qwen2", "llama-bpe"])
def test_tokenizer_json_splits_and_merges_as_llamacpp(tmp_path, pre):
    gguf = write_tiny_gguf(
        tmp_path / "tiny.gguf", metadata={"tokenizer.ggml.pre": GGUFValue(pre, GGUFValueType.STRING)}
    )
    gguf_to_hf.gguf_to_hf(gguf, tmp_path / "hf")
    ours = Tokenizer.from_file(str(tmp_path / "hf" / "tokenizer.json"))
    theirs = LlamaTokenizer(gguf)
    for text in SAMPLES:
        assert ours.encode(text, add_special_tokens=False).ids == theirs.encode(
            text, add_special=False, parse_special=False
        )
    chat = "<|im_start|>user\nHi there<|im_end|>\n"
    assert ours.encode(chat).ids == theirs.encode(chat, add_special=True, parse_special=True)
    assert ours.decode(ours.encode(SAMPLES[2]).ids) == SAMPLES[2]


def test_a_gguf_it_cannot_express_fails_in_one_line_and_writes_nothing(tmp_path):
    gguf = write_tiny_gguf(tmp_path / "spm.gguf", tokenizer="llama")  # SentencePiece: no tokenizer.json for it
    out = tmp_path / "hf"
    pythonpath = os.pathsep.join(filter(None, [str(CHECKOUT), os.environ.get("PYTHONPATH")]))  # this tree's edgeinfer
    run = subprocess.run(
        [sys.executable, SCRIPTS / "gguf_to_hf.py", gguf, "-o", out],
        capture_output=True,
        text=True,
        timeout=60,
        env=dict(os.environ, PYTHONPATH=pythonpath),
    )
    assert run.returncode == 1
    assert run.stderr.strip().splitlines() == [
        "error: spm.gguf: only byte-level BPE vocabularies (tokenizer.ggml.model 'gpt2') can be written as "
        "tokenizer.json; this one is 'llama'"
    ]
    assert not out.exists()
