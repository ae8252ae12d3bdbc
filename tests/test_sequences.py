"""Several KV sequences in one engine: parallel answers sharing a prompt, conversations sharing a system prompt."""

from __future__ import annotations

import threading

import pytest

from edgeinfer import InvalidOptionError, SamplingParams

from support import JAPAN, MIN_MARGIN, greedy_margins

# Long enough to fill two whole prompt chunks of 64 tokens, which is what the engine reuses.
LONG_SYSTEM = (
    "You are a helpful assistant for a hardware shop. You answer questions about tools, screws, glue, paint, "
    "timber and garden supplies. Keep answers short and practical, name the product family when you can, and "
    "say so plainly when you do not know. Prices change weekly, so never quote a price; point to the shelf "
    "labels instead. Safety first: mention gloves or goggles when a task calls for them. Customers are often "
    "beginners, so explain any trade word you use in a few plain words, and suggest the simplest tool that does "
    "the job before the professional one. If a question is about electrical wiring, gas or structural work, "
    "recommend a licensed professional and do not give step-by-step instructions."
)


def conversation(question: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": LONG_SYSTEM}, {"role": "user", "content": question}]


def evaluated(result) -> int:
    """Answer tokens fed back into the cache: all but one that ended the answer at ``max_tokens``."""
    return len(result.tokens) - (result.finish_reason == "length")


def test_parallel_greedy_answers_equal_the_single_answer(engine):
    engine.reset()
    single = engine.chat(JAPAN, temperature=0)
    assert min(greedy_margins(engine, JAPAN, single)) > MIN_MARGIN  # the words below do not hang on rounding
    engine.reset()
    results = engine.generate_batch(JAPAN, [SamplingParams(temperature=0, max_tokens=32)] * 3)
    assert [r.text for r in results] == [single.text] * 3
    assert all(r.finish_reason == "stop" for r in results)
    # The prompt was evaluated once; the answers' cells are freed afterwards and the prompt stays cached.
    assert all(r.metrics.prompt_tokens == len(engine.tokenize(JAPAN)) for r in results)
    assert engine.kv_used == len(engine.tokenize(JAPAN))


def test_seeded_parallel_samples_are_reproducible_and_differ_from_each_other(engine):
    params = [SamplingParams(temperature=1.2, max_tokens=12, seed=seed) for seed in range(4)]
    first = [r.text for r in engine.generate_batch(JAPAN, params)]
    engine.reset()
    again = [r.text for r in engine.generate_batch(JAPAN, params)]
    assert first == again
    assert len(set(first)) > 1  # four seeds at a high temperature: not one answer four times


def test_more_answers_than_sequences_are_decoded_in_turns(engine):
    results = engine.generate_batch(JAPAN, [SamplingParams(temperature=0.7, max_tokens=6, seed=s) for s in range(6)])
    assert len(results) == 6 and all(1 <= len(r.tokens) <= 6 for r in results)


def test_a_cancelled_batch_stops_every_answer(engine):
    cancel = threading.Event()
    cancel.set()
    results = engine.generate_batch(JAPAN, [SamplingParams(max_tokens=50)] * 2, cancel=cancel)
    assert [r.finish_reason for r in results] == ["cancelled", "cancelled"]


def test_generate_batch_refuses_an_empty_list(engine):
    with pytest.raises(InvalidOptionError, match="one or more SamplingParams"):
        engine.generate_batch(JAPAN, [])


def test_conversations_sharing_a_system_prompt_share_its_kv_and_stay_cached(engine):
    engine.reset()
    a1 = conversation(
        "Which glue holds wood best? I am building a small oak bookshelf for my daughter's room, with dowel "
        "joints and a plywood back, and it has to carry heavy picture books for years without sagging."
    )
    first = engine.chat(a1, temperature=0, max_tokens=24)
    system_tokens = len(engine.tokenize(conversation("")))
    assert first.metrics.cached_tokens == 0 and system_tokens > 128

    b1 = conversation("How do I pick a drill bit for tiles?")
    other = engine.chat(b1, temperature=0, max_tokens=24)
    # The second conversation reused the system prompt's whole chunks instead of recomputing them...
    assert other.metrics.cached_tokens == system_tokens // engine.batch_size * engine.batch_size >= 128
    # ...and shares their cells with the first, which is still cached beside it.
    held_apart = len(engine.tokenize(a1)) + evaluated(first) + len(engine.tokenize(b1)) + evaluated(other)
    assert engine.kv_used == held_apart - other.metrics.cached_tokens

    a2 = [*a1, {"role": "assistant", "content": first.text}, {"role": "user", "content": "And for metal?"}]
    back = engine.chat(a2, temperature=0, max_tokens=8)
    prompt = len(engine.tokenize(a1))
    # Back to the first conversation: its own earlier turn is still cached, not just the system prompt.
    assert back.metrics.cached_tokens >= prompt // engine.batch_size * engine.batch_size > other.metrics.cached_tokens


def test_the_same_greedy_answer_whichever_sequence_holds_the_conversation(engine):
    engine.reset()
    cold = engine.chat(JAPAN, temperature=0, logprobs=True)
    engine.chat(conversation("Which screws for a deck?"), max_tokens=8, seed=1)
    engine.chat(conversation("Is oil paint food-safe?"), max_tokens=8, seed=2)
    warm = engine.chat(JAPAN, temperature=0, logprobs=True)
    assert (warm.tokens, warm.logprobs) == (cold.tokens, cold.logprobs) and len(cold.logprobs) == len(cold.tokens)


def test_one_sequence_still_serves_a_chat(model_path):
    from edgeinfer import Engine

    with Engine(model_path, kv_budget="512tok", threads=2, sequences=1) as single:
        result = single.chat(JAPAN, temperature=0)
        assert result.finish_reason == "stop" and result.tokens
        assert [r.finish_reason for r in single.generate_batch(JAPAN, [SamplingParams(max_tokens=4)] * 2)]


def test_a_batch_smaller_than_the_sequence_count_still_decodes_them_together(model_path):
    from edgeinfer import Engine

    with Engine(model_path, kv_budget="512tok", threads=2, batch_size=2) as narrow:
        results = narrow.generate_batch(
            JAPAN, [SamplingParams(temperature=0.7, max_tokens=4, seed=s) for s in range(4)]
        )
        assert len(results) == 4 and all(r.tokens for r in results)


def test_a_batch_cancelled_before_its_prompt_is_evaluated_ends_cancelled(model_path):
    from edgeinfer import Engine

    with Engine(model_path, kv_budget="512tok", threads=2) as fresh:  # nothing cached to replay
        cancel = threading.Event()
        cancel.set()
        results = fresh.generate_batch(JAPAN, [SamplingParams(max_tokens=8)] * 3, cancel=cancel)
        assert [r.finish_reason for r in results] == ["cancelled"] * 3 and fresh.kv_used == 0
        assert fresh.chat(JAPAN, max_tokens=2).tokens  # and the engine goes on


def test_the_answer_after_parallel_samples_is_the_cold_answer(model_path):
    # The router draws samples, decoded together, then answers: that answer must not depend on
    # where the samples' cells were (llama.cpp rounds by cell placement).
    from edgeinfer import Engine

    with Engine(model_path, kv_budget="1024tok", threads=2) as fresh:
        cold = fresh.chat(JAPAN, temperature=0, max_tokens=24, logprobs=True)
        fresh.reset()
        fresh.generate_batch(JAPAN, [SamplingParams(temperature=0.7, max_tokens=24, seed=s) for s in range(4)])
        after = fresh.chat(JAPAN, temperature=0, max_tokens=24, logprobs=True)
        assert after.metrics.cached_tokens == len(fresh.tokenize(JAPAN))  # the prompt itself was kept
        assert (after.tokens, after.logprobs) == (cold.tokens, cold.logprobs)
