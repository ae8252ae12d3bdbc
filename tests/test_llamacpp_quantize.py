"""scripts/llamacpp_quantize.py: llama.cpp's own quantization recipes, for the converter's benchmark."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from tiny_model import write_tiny_gguf

from edgeinfer import BackendError, Engine
from edgeinfer.models.info import load_model_info

spec = importlib.util.spec_from_file_location(
    "llamacpp_quantize", Path(__file__).parents[1] / "scripts" / "llamacpp_quantize.py"
)
assert spec is not None and spec.loader is not None
llamacpp_quantize = importlib.util.module_from_spec(spec)
spec.loader.exec_module(llamacpp_quantize)


def test_q4_k_m_falls_back_where_rows_are_not_256_wide_and_the_result_runs(tmp_path):
    src = write_tiny_gguf(tmp_path / "f32.gguf", n_embd=128, n_ff=512)
    dst = tmp_path / "q4_k_m.gguf"
    llamacpp_quantize.quantize_with_llamacpp(src, dst, "Q4_K_M", threads=2)
    types = {t.name: t.type.name for t in load_model_info(dst).tensors}
    # Rows of 128 cannot hold a K-quant block of 256: llama.cpp falls back to a legacy type;
    # ffn_down's rows are 512 wide and get the K-quant itself.
    assert types["blk.0.attn_q.weight"] == "Q5_0"
    assert types["blk.0.ffn_down.weight"] in ("Q4_K", "Q6_K")
    assert not list(tmp_path.glob("*.partial"))
    with Engine(dst, backend="llamacpp", kv_budget="64tok", threads=2) as engine:
        assert len(engine.generate("the", max_tokens=4, temperature=0).tokens) == 4


def test_a_failing_quantization_is_one_line_and_leaves_no_file(tmp_path):
    quantized = write_tiny_gguf(tmp_path / "q4_0.gguf", tensor_type="Q4_0")
    dst = tmp_path / "out.gguf"
    with pytest.raises(BackendError, match=r"^llama.cpp failed quantizing q4_0.gguf to Q8_0: .*requantizing") as err:
        llamacpp_quantize.quantize_with_llamacpp(quantized, dst, "Q8_0", threads=2)
    assert "\n" not in str(err.value)
    assert not dst.exists() and not list(tmp_path.glob("*.partial"))
