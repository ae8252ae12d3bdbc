"""The prompt cache on disk (edgeinfer.prompt_cache) through the real engine and llama.cpp."""

from __future__ import annotations

import json
import logging

import pytest
from click.testing import CliRunner

from edgeinfer import Engine
from edgeinfer.cli import cli
from edgeinfer.prompt_cache import MAGIC, SUFFIX

# A system prompt of about 250 tokens: three whole 64-token chunks of it are kept.
SYSTEM = " ".join(f"Rule {i}: answer briefly and politely." for i in range(28))
QUESTION = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is the capital of Japan?"}]
GREEDY = {"temperature": 0, "max_tokens": 8, "logprobs": True}


def answer(model_path, folder, messages=QUESTION, **options):
    with Engine(model_path, kv_budget="1024tok", threads=2, prompt_cache=folder, **options) as engine:
        return engine.chat(messages, **GREEDY)


def test_the_next_engine_reads_the_system_prompt_from_disk_and_answers_as_cold(model_path, tmp_path):
    cold = answer(model_path, tmp_path)
    assert cold.metrics.prompt_cache == "saved" and cold.metrics.cached_tokens == 0
    (saved,) = tmp_path.glob(f"*{SUFFIX}")
    assert saved.read_bytes().startswith(MAGIC)
    warm = answer(model_path, tmp_path)
    m = warm.metrics
    assert m.prompt_cache == "hit" and m.disk_cached_tokens == m.cached_tokens
    assert m.disk_cached_tokens % 64 == 0 and 128 <= m.disk_cached_tokens < m.prompt_tokens
    assert "hit: " in m.format() and "prompt tokens read from disk" in m.format()
    # The state read back is the one a cold run computes: the same tokens, the same log-probabilities.
    assert warm.tokens == cold.tokens and warm.logprobs == cold.logprobs
    # Another question after the same system prompt reads it too; one without a system prompt keeps nothing.
    other = answer(model_path, tmp_path, [QUESTION[0], {"role": "user", "content": "Name a colour."}])
    assert other.metrics.prompt_cache == "hit"
    plain = answer(model_path, tmp_path, QUESTION[1:])
    assert plain.metrics.prompt_cache == "nothing to keep" and len(list(tmp_path.glob(f"*{SUFFIX}"))) == 1


@pytest.mark.parametrize("damage", ["truncated", "flipped", "foreign", "not ours"])
def test_a_damaged_or_foreign_state_is_ignored_in_one_line_and_saved_again(model_path, tmp_path, caplog, damage):
    cold = answer(model_path, tmp_path)
    (saved,) = tmp_path.glob(f"*{SUFFIX}")
    raw = saved.read_bytes()
    if damage == "truncated":
        raw = raw[: len(raw) // 2]
    elif damage == "flipped":
        raw = raw[:-100] + bytes([raw[-100] ^ 0xFF]) + raw[-99:]
    elif damage == "foreign":  # the same name, another model's or build's header
        start = len(MAGIC) + 4
        size = int.from_bytes(raw[len(MAGIC) : start], "little")
        header = json.loads(raw[start : start + size])
        header["identity"] = header["identity"].replace("/f16/", "/q8_0/")
        encoded = json.dumps(header).encode()
        raw = MAGIC + len(encoded).to_bytes(4, "little") + encoded + raw[start + size :]
    else:
        raw = b"GGUF" + raw[4:]
    saved.write_bytes(raw)
    with caplog.at_level(logging.WARNING, logger="edgeinfer"):
        again = answer(model_path, tmp_path)
    assert again.metrics.prompt_cache == "saved" and again.tokens == cold.tokens
    (line,) = [r.getMessage() for r in caplog.records if "prompt cache" in r.getMessage()]
    assert saved.name in line and "ignored" in line and "\n" not in line
    assert answer(model_path, tmp_path).metrics.prompt_cache == "hit"  # rebuilt


def test_the_folder_keeps_the_most_recently_used_states_within_its_size(model_path, tmp_path):
    first = answer(model_path, tmp_path)
    (kept,) = tmp_path.glob(f"*{SUFFIX}")
    size = kept.stat().st_size
    second = [{"role": "system", "content": SYSTEM.replace("briefly", "kindly")}, QUESTION[1]]
    answer(model_path, tmp_path, second, prompt_cache_size=int(size * 1.5))
    (left,) = tmp_path.glob(f"*{SUFFIX}")  # the older state went to make room
    assert left != kept and first.metrics.prompt_cache == "saved"
    assert answer(model_path, tmp_path, second).metrics.prompt_cache == "hit"


def test_a_backend_that_cannot_save_skips_the_cache_with_a_note(model_path, tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="edgeinfer"):
        result = answer(model_path, tmp_path, backend="reference")
    assert "the reference backend cannot save its KV state: the prompt cache is skipped" in caplog.text
    assert result.metrics.prompt_cache == "off" and not list(tmp_path.iterdir())


def test_run_prompt_cache_says_whether_it_hit(tmp_path):
    args = ["run", "What is the capital of Japan?", "--system", SYSTEM, "--temperature", "0", "--max-tokens", "4"]
    args += ["--threads", "2", "--prompt-cache", str(tmp_path / "kv"), "--stats"]
    runner = CliRunner()
    cold, warm = runner.invoke(cli, args), runner.invoke(cli, args)
    assert cold.exit_code == 0 and warm.exit_code == 0, cold.output + warm.output
    assert "prompt cache: saved" in cold.stderr and "prompt cache: hit: " in warm.stderr
    assert cold.stdout == warm.stdout


def test_the_folder_holds_only_what_checks_out_and_touches_nothing_else(tmp_path):
    from edgeinfer.prompt_cache import PromptCache

    cache = PromptCache(tmp_path, "model A", max_bytes=1000)
    (tmp_path / "notes.kv").write_bytes(b"x" * 5000)  # not one of its files: never counted or removed
    cache.save([1, 2, 3], b"s" * 400)
    cache.save([4, 5, 6], b"t" * 400)  # over the cap with both: the older goes
    assert cache.load([1, 2, 3]) is None and cache.load([4, 5, 6]) == b"t" * 400
    assert (tmp_path / "notes.kv").exists()
    cache.save([7], b"u" * 2000)  # larger than the cap alone: not written
    assert cache.load([7]) is None and cache.load([4, 5, 6]) == b"t" * 400
    path = cache.path([4, 5, 6])
    raw = path.read_bytes().replace(b'"tokens": 3', b'"tokens": "3"')
    path.write_bytes(raw)
    assert cache.load([4, 5, 6]) is None and not path.exists()  # a damaged header: ignored, removed
    assert PromptCache(tmp_path, "model B", 1000).load([1, 2, 3]) is None  # another identity: another name
