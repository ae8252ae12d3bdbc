"""Prompt-lookup drafting (edgeinfer.speculative) through the real engine and llama.cpp."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from edgeinfer import Engine, InvalidOptionError, SamplingParams, Speculation
from edgeinfer.speculative import (
    DRAFT_TOKEN_COST,
    MATCH_PRIORS,
    MAX_DRAFT,
    MAX_MATCH,
    PRIOR_ACCEPTANCE,
    DraftControl,
    DraftCost,
    PromptLookup,
)

from support import MIN_MARGIN, active_sequence, greedy_margins

# Text that continues by copying itself: greedy SmolLM2 counts on, " 4 5 6 ... 18", and every token leads
# the runner-up by more than MIN_MARGIN (1.9 logits on AVX2 and AVX-512 builds; checked below), so drafting
# or not, the same tokens come out.
COUNT = "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20\n1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20\n1 2 3"


def test_lookup_drafts_what_followed_the_occurrence_that_matches_furthest_back():
    lookup = PromptLookup([1, 2, 3, 4, 5, 9, 2, 3, 7, 8])
    lookup.extend([1, 2, 3])  # "2 3" ended at 3 and at 8; the first occurrence matches "1 2 3", three tokens
    assert lookup.match(3) == ([4, 5, 9], 3)
    lookup.extend([6, 2, 3])  # "6 2 3" never occurred: every "2 3" matches two tokens, and the latest wins
    assert lookup.match(2) == ([6, 2], 2)
    lookup.extend([42])
    assert lookup.match(4) == ([], 0)  # "3 42" never occurred before
    assert PromptLookup([]).match(4) == ([], 0)


def test_of_the_four_latest_occurrences_the_one_matching_furthest_back_wins():
    # "3 50" after "1 2" at the start (a match of four tokens), then after "9" again and again (two).
    among_them = PromptLookup([1, 2, 3, 50, 60] + [9, 3, 50, 61] * 3 + [1, 2, 3, 50])
    assert among_them.match(2) == ([60, 9], 4)
    fifth_latest = PromptLookup([1, 2, 3, 50, 60] + [9, 3, 50, 61] * 4 + [1, 2, 3, 50])
    assert fifth_latest.match(2) == ([61, 1], 2)  # not tried: the latest of the four wins their tie


def test_a_long_match_drafts_further_than_a_short_one_at_the_start():
    short, long = PromptLookup([5, 6, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]), PromptLookup([])
    short.extend([9, 5, 6])  # "5 6" twice, neither matching further back than itself
    long.extend(list(range(40)) + list(range(20)))
    assert short.match(8)[1] == 2 and long.match(8)[1] == MAX_MATCH
    assert 0 < len(short.draft(8, 0.4)) < len(long.draft(8, 0.4))
    assert short.draft(8, 0.9) == [] and long.draft(8, 0.9) == []  # no class is expected to keep 0.9 of them


def _decode(control: DraftControl, acceptance: float, token_cost: float, assumed: float, tokens: int = 20_000) -> float:
    """Decode speed with ``control`` drafting as a ``Drafter`` asks it, as a share of decoding one token per step:
    each step's draft is of a kind drawn at random, each drafted token is right with chance ``acceptance`` (given
    the one before it was) and costs ``token_cost`` of a step, where the controller was told ``assumed``."""
    draws, kinds = random.Random(0), random.Random(1)
    steps = drafted = decoded = 0
    while decoded < tokens:
        kind = kinds.randrange(len(control.acceptance))
        k = control.length(MAX_DRAFT, assumed, kind) if control.may_pay(assumed) else 0
        if k == 0:
            control.skipped(assumed)
        accepted = 0
        while accepted < k and draws.random() < acceptance:
            accepted += 1
        if k:
            control.verified(k, accepted, kind)
        steps, drafted, decoded = steps + 1, drafted + k, decoded + accepted + 1
    return decoded / (steps + drafted * token_cost)


@pytest.mark.parametrize("priors", [(PRIOR_ACCEPTANCE,), MATCH_PRIORS], ids=["one kind", "match classes"])
@pytest.mark.parametrize("acceptance", [0.0, 0.2, 0.4, 0.6, 0.8, 0.95])
@pytest.mark.parametrize("token_cost", [0.2, 0.4, DRAFT_TOKEN_COST, 1.0])
def test_drafting_never_costs_more_than_three_percent_of_decode_speed(priors, acceptance, token_cost):
    # Where a drafted token costs what the controller was told (DraftCost measures it), at any acceptance.
    assert _decode(DraftControl(priors), acceptance, token_cost, assumed=token_cost) >= 0.97
    # Before a measurement: every draft rejected, with a drafted token as dear as a whole step.
    if acceptance == 0.0:
        assert _decode(DraftControl(priors), acceptance, 1.0, assumed=DRAFT_TOKEN_COST) >= 0.97


def test_drafting_pays_where_most_drafts_are_kept():
    assert _decode(DraftControl(), 0.95, token_cost=0.25, assumed=0.25) > 1.5  # F16's cost: a drafted token is cheap
    control = DraftControl()
    for _ in range(20):
        control.verified(4, 0)
    assert control.length(MAX_DRAFT) == 0  # off after a run of rejections


def test_each_kind_of_draft_keeps_its_own_estimate():
    control = DraftControl((0.8, 0.8))
    for _ in range(20):
        control.verified(4, 0, kind=0)  # short matches rejected: long ones still drafted
    assert control.length(MAX_DRAFT, 0.4, kind=0) == 0 < control.length(MAX_DRAFT, 0.4, kind=1)
    assert control.may_pay(0.4)
    for _ in range(20):
        control.verified(4, 0, kind=1)
    assert not control.may_pay(0.4)


def test_the_measured_draft_cost_is_kept_for_the_next_engine(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGEINFER_CACHE_DIR", str(tmp_path))
    cost = DraftCost("model on this machine")
    assert cost.value == DRAFT_TOKEN_COST and cost.measured() is None
    for _ in range(DraftCost.MIN_STEPS):
        cost.observe(1, 0.010)
        cost.observe(5, 0.022)  # four drafted tokens cost 1.2 steps: 0.3 each
    assert cost.measured() == pytest.approx(0.3)
    cost.value = 0.9  # an engine's figure stays what it started with; the next one reads the measurement
    cost.save()
    kept = DraftCost("model on this machine")
    assert kept.value == pytest.approx(0.3) and DraftCost("another model").value == DRAFT_TOKEN_COST
    for _ in range(DraftCost.MIN_STEPS):  # 0.35: within MIN_CHANGE of the kept figure, which stays
        kept.observe(1, 0.010)
        kept.observe(5, 0.024)
    kept.save()
    assert DraftCost("model on this machine").value == pytest.approx(0.3)
    (tmp_path / DraftCost.FILE).write_text("{not json")
    assert DraftCost("model on this machine").value == DRAFT_TOKEN_COST  # a damaged file is measured again


def test_an_unknown_mode_is_one_line_naming_the_choices():
    with pytest.raises(InvalidOptionError, match="unknown speculative mode 'fast'; choose one of lookup, draft, off"):
        Speculation.parse("fast")


@pytest.fixture(scope="module")
def engine(model_path, tmp_path_factory):
    """An engine that drafts by the prior figure (DRAFT_TOKEN_COST). One made after others had measured this
    machine's drafting cost would start from theirs, and where a drafted token costs nearly a whole step (0.94
    for this file on an AMD EPYC with AVX-512) it would hardly draft at all."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("EDGEINFER_CACHE_DIR", str(tmp_path_factory.mktemp("no-draft-cost")))
        drafting = Engine(model_path, kv_budget="2048tok", threads=2)
    with drafting:
        assert drafting.draft_token_cost == DRAFT_TOKEN_COST
        yield drafting


@pytest.fixture(scope="module")
def without_drafts(model_path):
    with Engine(model_path, kv_budget="2048tok", threads=2, speculative="off") as e:
        yield e


def test_greedy_answers_are_the_same_tokens_with_drafts_as_without(engine, without_drafts):
    assert engine.speculative is Speculation.LOOKUP  # the default
    drafted = engine.generate(COUNT, temperature=0, max_tokens=40, ignore_eos=True)
    plain = without_drafts.generate(COUNT, temperature=0, max_tokens=40, ignore_eos=True)
    # The cache keeps the kept tokens alone (all but the last, drawn and not yet evaluated), in as many
    # groups as decoding without drafts leaves.
    held = engine._cache.sequences[active_sequence(engine)]
    plain_held = without_drafts._cache.sequences[active_sequence(without_drafts)]
    assert held.tokens == plain_held.tokens == engine.tokenize(COUNT) + list(drafted.tokens[:-1])
    assert len(held._groups) == len(plain_held._groups)
    assert greedy_margins(without_drafts, COUNT, plain).min() > MIN_MARGIN
    assert drafted.tokens == plain.tokens and drafted.text == plain.text
    m = drafted.metrics
    assert m.accepted_tokens > 20 and m.drafted_tokens >= m.accepted_tokens  # most of the count came from drafts
    assert m.to_dict()["acceptance_rate"] == m.accepted_tokens / m.drafted_tokens
    assert "drafted tokens kept" in m.format()
    assert plain.metrics.drafted_tokens == 0 and "none verified" in plain.metrics.format()


def test_answers_decoded_together_draft_and_keep_their_own_tokens(engine, without_drafts):
    single = without_drafts.generate(COUNT, temperature=0, max_tokens=30, ignore_eos=True)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (30, 7, 30)]
    answers = engine.generate_batch(COUNT, params)
    assert [a.tokens for a in answers] == [single.tokens, single.tokens[:7], single.tokens]
    assert all(a.metrics.accepted_tokens for a in answers)


def test_a_call_cancelled_mid_draft_leaves_no_unverified_tokens_in_the_cache(model_path, monkeypatch, tmp_path):
    monkeypatch.setenv("EDGEINFER_CACHE_DIR", str(tmp_path))  # no drafting cost measured: the prior drafts
    with Engine(model_path, kv_budget="1024tok", threads=2) as engine:
        with engine.stream(COUNT, temperature=0, max_tokens=40, ignore_eos=True) as stream:
            for _ in range(4):
                next(stream)
            stream.cancel()
            list(stream)
        result = stream.result
        assert result.finish_reason == "cancelled" and result.metrics.drafted_tokens
        seq = active_sequence(engine)
        held = engine._cache.sequences[seq].tokens
        assert held == engine.tokenize(COUNT) + list(result.tokens[: len(held) - len(engine.tokenize(COUNT))])
        assert len(held) <= len(engine.tokenize(COUNT)) + len(result.tokens)
        assert engine.backend._lengths[seq] == len(held)


# Each arm samples this many answers; a draft-acceptance rule that favoured drafted tokens would shift the
# commonest answers' shares by far more than the test's tolerance.
SAMPLES = 240
SAMPLED = "one two three four five, one two three four five, one two three four five, one two"


def test_sampled_answers_follow_the_same_distribution_with_drafts_as_without(engine, without_drafts):
    """A chi-squared test of homogeneity between the answers drawn with drafts and without, each arm with
    its own seeds; it also checks the drafts were both kept and rejected, so the test covers verification."""
    counts = {}
    drafted = accepted = 0
    for arm, e, seeds in (("lookup", engine, range(SAMPLES)), ("off", without_drafts, range(SAMPLES, 2 * SAMPLES))):
        params = [SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, max_tokens=4, seed=s) for s in seeds]
        answers = e.generate_batch(SAMPLED, params)
        counts[arm] = Counter(a.text for a in answers)
        drafted += sum(a.metrics.drafted_tokens for a in answers)
        accepted += sum(a.metrics.accepted_tokens for a in answers)
    assert 0 < accepted < drafted
    both = counts["lookup"] + counts["off"]
    common = [text for text, n in both.most_common() if n >= 10]
    assert len(common) >= 2
    cells = [(counts["lookup"][t], counts["off"][t]) for t in common]
    rest = [(SAMPLES - sum(a for a, _ in cells), SAMPLES - sum(b for _, b in cells))]
    chi2 = 0.0
    for a, b in cells + (rest if sum(rest[0]) else []):
        expected = (a + b) / 2
        chi2 += (a - expected) ** 2 / expected + (b - expected) ** 2 / expected
    df = len(cells) + bool(sum(rest[0])) - 1
    # The 99.9th percentile of chi-squared with df degrees of freedom (Wilson-Hilferty), a false alarm in 1,000 runs.
    z = 3.09
    limit = df * (1 - 2 / (9 * df) + z * (2 / (9 * df)) ** 0.5) ** 3
    assert chi2 < limit, (chi2, limit, counts)


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    """A tiny target model and a far smaller draft for it: random weights, one byte-level BPE vocabulary."""
    from tiny_model import write_tiny_gguf

    folder = tmp_path_factory.mktemp("draft-pair")
    target = write_tiny_gguf(folder / "target.gguf", seed=0, n_layer=4, n_embd=256, n_head=4, n_ff=512)
    draft = write_tiny_gguf(folder / "draft.gguf", seed=1, n_layer=1, n_embd=64, n_ff=128)
    return target, draft


PROMPT = "the cat sat on the mat"
GREEDY = {"temperature": 0, "max_tokens": 24, "ignore_eos": True}


def test_a_draft_model_drafts_and_the_greedy_answer_is_unchanged(tiny_pair):
    target, draft = tiny_pair
    with Engine(target, threads=2, kv_budget="512tok", speculative="off") as plain:
        alone = plain.generate(PROMPT, **GREEDY)
        assert greedy_margins(plain, PROMPT, alone).min() > 0.01  # F32 rounds by far less than this
    with Engine(target, threads=2, kv_budget="512tok", draft=draft) as engine:
        assert engine.speculative is Speculation.DRAFT
        drafted = engine.generate(PROMPT, **GREEDY)
        assert len(engine.generate(PROMPT + " and", **GREEDY).tokens) == 24  # the draft follows another prompt
    assert drafted.tokens == alone.tokens and drafted.metrics.drafted_tokens > 0


def test_the_draft_model_follows_each_answer_and_keeps_its_kept_drafts(tiny_pair):
    from edgeinfer.draft_model import DraftModel

    target, _ = tiny_pair
    with Engine(target, threads=2, kv_budget="512tok", speculative="off") as plain:
        greedy = list(plain.generate(PROMPT, **GREEDY).tokens)
        prompt = plain.tokenize(PROMPT)
        # The target drafting for itself: its drafts are its own greedy tokens.
        model = DraftModel(plain.backend, plain.capacity)
        plain.reset()
        assert model.draft(1, [*prompt, greedy[0]], 4) == greedy[1:5]
        # Two of them kept and another token drawn: the sequence keeps what it shares and drafts on from there.
        after = [*prompt, *greedy[:3], greedy[3]]
        assert model.draft(1, after, 3) == greedy[4:7]
        assert model._held[1][: len(after)] == after
        # Another turn after the prompt: cut back to the prompt, then the same drafts as a sequence never used.
        assert model.draft(1, [*prompt, 7], 2) == model.draft(2, [*prompt, 7], 2)
        assert model._held[1][: len(prompt) + 1] == [*prompt, 7] == model._held[2][: len(prompt) + 1]
        assert model.draft(1, prompt, 0) == []


def test_a_draft_model_with_another_vocabulary_is_refused_in_one_line(tiny_pair, tmp_path):
    from tiny_model import write_tiny_gguf

    target, _ = tiny_pair
    other = write_tiny_gguf(tmp_path / "sentencepiece.gguf", tokenizer="llama")
    with pytest.raises(InvalidOptionError, match="has another vocabulary than target.gguf") as refused:
        Engine(target, threads=2, kv_budget="512tok", draft=other)
    assert "same family" in str(refused.value) and "\n" not in str(refused.value)
    with pytest.raises(InvalidOptionError, match="--speculative draft needs a draft model"):
        Engine(target, threads=2, kv_budget="512tok", speculative="draft")


def test_a_recurrent_draft_model_is_refused_in_one_line(tiny_pair, tmp_path):
    from llamacpp_archs import write_tiny_mamba

    target, _ = tiny_pair
    mamba = write_tiny_mamba(tmp_path / "mamba.gguf")  # the same byte-level vocabulary, no KV cache
    with pytest.raises(InvalidOptionError, match="keeps a recurrent state") as refused:
        Engine(target, threads=2, kv_budget="512tok", draft=mamba)
    assert "\n" not in str(refused.value)
