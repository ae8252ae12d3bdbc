"""KV budget arithmetic and the eviction policies' plans."""

from __future__ import annotations

import pytest

from edgeinfer import ContextFull, InvalidOptionError, KVBudget, KVPolicy
from edgeinfer.sizes import format_size, parse_size

SMOLLM2_BYTES_PER_TOKEN = 23040  # 2 x 30 layers x 3 KV heads x 64 head dim x 2 bytes (f16)


@pytest.mark.parametrize(
    ("text", "budget"),
    [
        ("64MB", KVBudget(bytes=64_000_000)),
        ("64 MiB", KVBudget(bytes=64 * 2**20)),
        ("1.5GB", KVBudget(bytes=1_500_000_000)),
        ("512tok", KVBudget(tokens=512)),
        ("300 tokens", KVBudget(tokens=300)),
        (1000000, KVBudget(bytes=1_000_000)),
    ],
)
def test_budget_parsing(text, budget):
    assert KVBudget.parse(text) == budget


@pytest.mark.parametrize("bad", ["lots", "64XB", "-5MB", "0tok", "", 2.5, "١٢tok", "٦٤MB", "12\u2003tok"])
def test_bad_budgets_are_one_line_errors(bad):
    with pytest.raises(InvalidOptionError) as info:
        KVBudget.parse(bad)
    assert "\n" not in str(info.value)


def test_bytes_have_their_own_parser_which_refuses_tokens():
    assert parse_size("80MB") == 80_000_000 and parse_size("1.5 GiB") == 3 * 2**29 and parse_size(4096) == 4096
    assert format_size(64_000_000) == "64.0 MB" and str(KVBudget.parse("64MB")) == "64.0 MB"
    for bad, needle in [("512tok", "counts tokens, not bytes"), ("0MB", "is zero"), ("lots", "cannot read")]:
        with pytest.raises(InvalidOptionError, match=needle) as info:
            parse_size(bad, "--target-size")
        assert "--target-size" in str(info.value) and "'80MB'" in str(info.value)
    with pytest.raises(InvalidOptionError, match="cannot read KV budget 'lots'.* or tokens such as '512tok'"):
        KVBudget.parse("lots")


def test_byte_budget_rounds_down_to_whole_blocks_so_the_allocation_never_exceeds_it():
    budget = KVBudget.parse("64MB")
    tokens = budget.capacity(SMOLLM2_BYTES_PER_TOKEN, block=256)
    assert tokens == 2560  # 2,777 fit; 2,560 is the last whole 256-token block
    assert tokens * SMOLLM2_BYTES_PER_TOKEN <= 64_000_000
    assert budget.capacity(SMOLLM2_BYTES_PER_TOKEN, block=1) == 2777


def test_token_budget_is_exact_whatever_the_block():
    assert KVBudget.parse("300tok").capacity(SMOLLM2_BYTES_PER_TOKEN, block=256) == 300


def test_sinks_keep_four_and_drop_a_quarter_of_the_window():
    start, end = KVPolicy("sinks").eviction(512, 1, 512, has_bos=False, budget="512 tokens")
    assert (start, end) == (4, 4 + (512 - 4) // 4)


def test_shift_keeps_bos_and_drops_half():
    assert KVPolicy("shift").eviction(512, 1, 512, has_bos=True, budget="") == (1, 1 + 511 // 2)
    assert KVPolicy("shift", n_keep=10, n_discard=32).eviction(512, 1, 512, has_bos=False, budget="") == (10, 42)


def test_eviction_makes_room_for_a_big_batch():
    start, end = KVPolicy("sinks").eviction(500, 200, 512, has_bos=False, budget="")
    assert end - start >= 500 + 200 - 512


def test_error_policy_names_the_budget_and_the_options():
    with pytest.raises(ContextFull, match=r"KV budget \(512 tokens\).*--kv-budget.*sinks or shift"):
        KVPolicy("error").eviction(512, 1, 512, has_bos=False, budget="512 tokens")


def test_long_prompt_keeps_head_and_newest_tail():
    tokens = list(range(1000))
    fitted = KVPolicy("sinks").fit_prompt(tokens, 512, 100, has_bos=False, budget="")
    assert len(fitted) == 412
    assert fitted[:4] == [0, 1, 2, 3] and fitted[4:] == tokens[-408:]
    with pytest.raises(ContextFull, match="the prompt is 1000 tokens"):
        KVPolicy("error").fit_prompt(tokens, 512, 100, has_bos=False, budget="512 tokens")
    # Under `error` a prompt that fits is left whole, even if the answer may not.
    assert KVPolicy("error").fit_prompt(tokens[:500], 512, 100, has_bos=False, budget="") == tokens[:500]


def test_unknown_policy():
    with pytest.raises(InvalidOptionError, match="sinks, shift, error"):
        KVPolicy("lru")  # type: ignore[arg-type]
