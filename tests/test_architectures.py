"""Models of every architecture llama.cpp runs: Gemma 3 270M from PyPI, and tiny models of architectures
edgeinfer's reference does not implement (Granite), of none llama.cpp knows, and of a recurrent one (Mamba)."""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
from pathlib import Path

import llama_cpp
import pytest
from click.testing import CliRunner
from llamacpp_archs import write_tiny_granite, write_tiny_mamba

from edgeinfer import (
    EdgeInferError,
    Engine,
    InvalidModelError,
    InvalidOptionError,
    ModelNotFoundError,
    SamplingParams,
    Speculation,
)
from edgeinfer.backends import backend_status
from edgeinfer.cli import cli
from edgeinfer.models.catalog import CATALOG, resolve_model
from edgeinfer.models.info import load_model_info
from edgeinfer.models.packaged import assembled_file

from support import evaluate

SMALL = dict(n_layer=2, n_embd=64, n_head=2, n_head_kv=1, n_ff=128)


@pytest.fixture(scope="module")
def gemma() -> Path:
    return resolve_model("gemma3-270m")


def test_gemma3_270m_is_assembled_from_its_packages_and_checked(gemma):
    entry = CATALOG["gemma3-270m"]
    digest = hashlib.sha256(gemma.read_bytes()).hexdigest()
    assert digest == entry.sha256 and gemma.stat().st_size == entry.size_bytes
    info = load_model_info(gemma)
    assert (info.architecture, info.hparams.n_layer, info.hparams.n_vocab) == ("gemma3", 18, 262_144)


def test_gemma3_270m_runs_on_the_command_line(gemma, tmp_path):
    runner = CliRunner()
    shown = runner.invoke(cli, ["info", "gemma3-270m", "--json"])
    assert shown.exit_code == 0, shown.output
    model = json.loads(shown.output)["model"]
    assert model["architecture"] == "gemma3" and model["chat_template"].startswith("none")
    # Five local layers to each global one; llama.cpp's f16 cache: 18 layers x 1 KV head x (256 + 256) x 2 bytes.
    assert (model["sliding_window"], model["sliding_window_layers"]) == (512, 15)
    assert model["kv_bytes_per_token_f16"] == 18_432 and model["reference_implements"]

    # A base model continues text: --raw gives it the prompt as it is.
    done = runner.invoke(
        cli, ["run", "The capital of France is", "--raw", "--model", "gemma3-270m", "--max-tokens", "8", "--json"]
    )
    assert done.exit_code == 0, done.output
    answer = json.loads(done.output)
    assert answer["finish_reason"] in ("length", "stop") and answer["text"].strip()

    text = tmp_path / "held-out.txt"
    text.write_text("The lighthouse keeper wrote in his log every evening: the wind, the colour of the sea. " * 4)
    scored = runner.invoke(cli, ["eval", "gemma3-270m", "--text", str(text), "--ctx", "64", "--json"])
    assert scored.exit_code == 0, scored.output
    assert 1 < json.loads(scored.output)["perplexity"] < 1000

    timed = runner.invoke(
        cli, ["bench", "gemma3-270m", "--prompt-tokens", "16", "--gen-tokens", "4", "--runs", "1", "--json"]
    )
    assert timed.exit_code == 0, timed.output
    (config,) = json.loads(timed.stdout)["configs"]
    assert config["backend"] == "llamacpp" and len(config["runs"]) == 1


def test_a_chat_with_a_base_model_is_a_transcript_that_ends_at_the_next_turn(gemma):
    with Engine(gemma, kv_budget="512tok", threads=2) as engine:
        assert engine.template.is_transcript
        messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
        assert engine.render(messages) == "Be brief.\n\nUser: Name a colour.\nAssistant:"
        # Left alone, the base model writes further turns of its own, the user's or (as here, at some
        # seeds on some CPUs) its own again: either ends the answer.
        assert set(engine.template.stops) == {"\nUser:", "\nAssistant:"}
        for conversation in (messages, [{"role": "user", "content": "The capital of France is"}]):
            for seed in range(8):
                result = engine.chat(conversation, max_tokens=48, seed=seed)
                assert "\nUser:" not in result.text and "\nAssistant:" not in result.text


def test_a_file_split_over_packages_is_joined_once_and_checked(tmp_path, monkeypatch):
    site = tmp_path / "site"
    blobs = [b"GGUF" + bytes(range(256)) * 40, b"second part" * 300]
    parts = []
    for i, blob in enumerate(blobs):
        name = f"model-part{i + 1}"
        folder = site / f"model_part{i + 1}"
        folder.mkdir(parents=True)
        (folder / f"m.gguf.part{i:02d}").write_bytes(blob)
        info = site / f"model_part{i + 1}-1.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
        (info / "RECORD").write_text(f"model_part{i + 1}/m.gguf.part{i:02d},,\n")
        parts.append((name, f"m.gguf.part{i:02d}"))
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv("EDGEINFER_CACHE_DIR", str(tmp_path / "cache"))
    sha = hashlib.sha256(b"".join(blobs)).hexdigest()

    assert assembled_file(parts, "m.gguf", sha, build=False) is None  # not joined yet
    path = assembled_file(parts, "m.gguf", sha)
    assert path is not None and path.read_bytes() == b"".join(blobs)
    assert assembled_file(parts, "m.gguf", sha, build=False) == path  # the check is remembered

    with pytest.raises(ModelNotFoundError, match="sha256") as wrong:
        assembled_file(parts, "other.gguf", "0" * 64)
    assert "\n" not in str(wrong.value) and not (path.parent / "other.gguf").exists()  # nothing half-made left

    not_a_folder = tmp_path / "a-file"
    not_a_folder.write_text("")
    monkeypatch.setenv("EDGEINFER_CACHE_DIR", str(not_a_folder / "cache"))
    with pytest.raises(ModelNotFoundError, match="set EDGEINFER_CACHE_DIR to a writable folder") as unwritable:
        assembled_file(parts, "m.gguf", sha)
    assert "\n" not in str(unwritable.value)
    monkeypatch.setenv("EDGEINFER_CACHE_DIR", str(tmp_path / "cache"))

    shutil.rmtree(site / "model_part2-1.0.dist-info")
    with pytest.raises(ModelNotFoundError, match="pip install model-part2"):
        assembled_file(parts, "third.gguf", sha)
    assert assembled_file([("not-installed", "x")], "none.gguf", sha) is None


def test_an_architecture_llamacpp_does_not_know_is_one_line_naming_it_and_the_version(tmp_path):
    path = write_tiny_granite(tmp_path / "zzz.gguf", **SMALL)
    data = path.read_bytes().replace(b"granite", b"zzzzzzz")  # same length: every offset still holds
    path.write_bytes(data)
    with pytest.raises(EdgeInferError) as refused:
        Engine(path, threads=2, backend="llamacpp")
    message = str(refused.value)
    assert "'zzzzzzz'" in message and llama_cpp.__version__ in message and "\n" not in message
    assert "--backend auto" not in message  # no other backend runs it either
    # info says so too, before anything is loaded for real, and auto has nothing to pick.
    assert "does not run the 'zzzzzzz' architecture" in backend_status(load_model_info(path))["llamacpp"]
    with pytest.raises(EdgeInferError, match="zzzzzzz"):
        Engine(path, threads=2)


def test_an_architecture_left_to_llamacpp_runs_there_and_the_reference_says_why_not(tmp_path):
    path = write_tiny_granite(tmp_path / "granite.gguf", **SMALL)
    info = load_model_info(path)
    assert info.architecture == "granite" and not info.hparams.arch.reference
    with Engine(path, threads=2, kv_budget="256tok") as engine:  # auto: llama.cpp
        assert engine.backend.name == "llamacpp"
        assert len(engine.generate("hello there", max_tokens=6, temperature=0, ignore_eos=True).tokens) == 6
    with pytest.raises(EdgeInferError, match="does not implement the granite architecture") as refused:
        Engine(path, backend="reference")
    assert "\n" not in str(refused.value)


def test_kv_heads_given_per_layer_size_the_cache_layer_by_layer(tmp_path):
    path = write_tiny_granite(tmp_path / "granite.gguf", kv_heads=[1, 1], **SMALL)
    assert load_model_info(path).kv_values_per_token == 2 * 2 * 32  # two layers of one KV head of 32, K and V
    # A layer whose key projection does not match its head count would abort llama.cpp mid-graph.
    path = write_tiny_granite(tmp_path / "uneven.gguf", kv_heads=[1, 2], **SMALL)
    with pytest.raises(InvalidModelError, match=r"'blk\.1\.attn_k\.weight' has 32 outputs") as refused:
        load_model_info(path)
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize(
    ("old", "new", "problem"),
    [
        (b"blk.0.attn_q.weight", b"blk.0.ssm_dt.weight", "'blk.0.ssm_dt.weight' is not part of a granite model"),
        (b"blk.1.attn_q.weight", b"blk.7.attn_q.weight", "'blk.7.attn_q.weight' belongs to no layer"),
    ],
)
def test_tensors_the_architecture_does_not_have_are_refused_in_one_line(tmp_path, old, new, problem):
    path = write_tiny_granite(tmp_path / "granite.gguf", **SMALL)
    path.write_bytes(path.read_bytes().replace(old, new, 1))  # same length: every offset still holds
    with pytest.raises(InvalidModelError) as refused:
        load_model_info(path)
    assert problem in str(refused.value) and "\n" not in str(refused.value)


def test_a_recurrent_model_runs_with_the_error_policy_and_says_why(tmp_path, caplog):
    path = write_tiny_mamba(tmp_path / "mamba.gguf")
    assert load_model_info(path).hparams.recurrent
    with pytest.raises(InvalidOptionError, match="recurrent layers keep a state") as refused:
        Engine(path, kv_policy="sinks", threads=2)
    assert "use --kv-policy error" in str(refused.value) and "\n" not in str(refused.value)

    with caplog.at_level(logging.WARNING), Engine(path, kv_budget="256tok", threads=2) as engine:
        assert engine.kv_policy.name == "error" and "KV policy error" in caplog.text
        assert not engine.backend.can_shift and not engine.backend.can_truncate
        first = engine.generate("hello there", max_tokens=6, temperature=0, ignore_eos=True).tokens
        # Rejected drafts would need truncating: a recurrent model decodes one token per step.
        assert engine.speculative is Speculation.OFF
        # Another prompt, then the first again: the state cannot be cut back to a shared prefix, so the
        # engine starts over and answers as it did the first time.
        engine.chat([{"role": "user", "content": "hello there"}], max_tokens=4, temperature=0)
        assert engine.generate("hello there", max_tokens=6, temperature=0, ignore_eos=True).tokens == first
        answers = engine.generate_batch(
            "hello there", [SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)] * 2
        )
        assert [a.tokens for a in answers] == [first, first]


@pytest.mark.parametrize("model", ["gemma3-270m", "granite", "mamba"])
def test_kv_bytes_per_token_are_what_llamacpp_stores(tmp_path, model):
    """Each token a sequence takes in grows llama.cpp's saved state by the KV bytes edgeinfer budgets for it,
    plus a few bytes of bookkeeping per cell (position, sequence ids) in each cache the model has."""
    if model == "granite":
        model = write_tiny_granite(tmp_path / "granite.gguf", kv_heads=[1, 1], **SMALL)
    elif model == "mamba":
        model = write_tiny_mamba(tmp_path / "mamba.gguf")
    with Engine(model, kv_budget="512tok", kv_type="f16", threads=2, backend="llamacpp") as engine:
        backend = engine.backend
        tokens = [5 + i % 200 for i in range(300)]
        evaluate(backend, tokens[:100], 0)
        before = llama_cpp.llama_state_seq_get_size(backend._ctx, 0)
        evaluate(backend, tokens[100:], 100)
        grown = (llama_cpp.llama_state_seq_get_size(backend._ctx, 0) - before) / 200
        budgeted = type(backend).kv_bytes_per_token(engine.info, "f16")
    assert budgeted <= grown <= budgeted + 32, (grown, budgeted)
