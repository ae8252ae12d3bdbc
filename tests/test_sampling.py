"""The sampler on real logit rows, and the incremental detokenizer."""

from __future__ import annotations

import math
import random
from collections import Counter

import numpy as np
import pytest

from edgeinfer import InvalidOptionError
from edgeinfer.sampler import Sampler, _top_k
from edgeinfer.sampling import SamplingParams
from edgeinfer.textstream import JOIN_EVERY, TextStream

RNG = np.random.default_rng(0)
LOGITS = RNG.normal(size=1000).astype(np.float32)


def draws(n: int = 300, **options) -> list[int]:
    sampler = Sampler(SamplingParams(**options))
    return [sampler(LOGITS) for _ in range(n)]


def test_greedy_is_argmax_and_leaves_the_logits_alone():
    before = LOGITS.copy()
    assert draws(5, temperature=0) == [int(LOGITS.argmax())] * 5
    sampler = Sampler(SamplingParams(temperature=0.7, repetition_penalty=1.3, seed=0))
    sampler(LOGITS, list(np.argsort(LOGITS)[-10:]))  # the penalty path works on a copy
    np.testing.assert_array_equal(LOGITS, before)


def test_top_k_restricts_to_the_k_best():
    best = set(np.argsort(LOGITS)[-5:].tolist())
    assert set(draws(top_k=5, top_p=1, min_p=0, temperature=2.0)) <= best


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = np.exp(LOGITS - LOGITS.max())
    probs /= probs.sum()
    order = np.argsort(probs)[::-1]
    nucleus = set(order[: int(np.searchsorted(np.cumsum(probs[order]), 0.5)) + 1].tolist())
    got = set(draws(top_k=0, top_p=0.5, min_p=0, temperature=1.0))
    assert got <= nucleus and len(got) > 1


def test_min_p_drops_tokens_below_a_share_of_the_best():
    probs = np.exp(LOGITS - LOGITS.max())
    allowed = set(np.flatnonzero(probs >= 0.3).tolist())
    assert set(draws(top_k=0, top_p=1, min_p=0.3, temperature=1.0)) <= allowed


def test_repetition_penalty_moves_away_from_recent_tokens():
    best = int(LOGITS.argmax())
    sampler = Sampler(SamplingParams(temperature=0, repetition_penalty=100.0))
    assert sampler(LOGITS, [best]) != best


def test_seed_reproduces_and_differs():
    assert draws(top_k=0, top_p=1, min_p=0, temperature=1.0, seed=1) == draws(
        top_k=0, top_p=1, min_p=0, temperature=1.0, seed=1
    )
    assert draws(top_k=0, top_p=1, min_p=0, temperature=1.0, seed=1) != draws(
        top_k=0, top_p=1, min_p=0, temperature=1.0, seed=2
    )


def chain_probabilities(logits: np.ndarray, params: SamplingParams) -> dict[int, float]:
    """The default chain's distribution, straight from its definition, in float64."""
    order = np.argsort(-logits, kind="stable")[: params.top_k]
    probs = np.exp((logits[order].astype(np.float64) - logits[order[0]]) / params.temperature)
    probs /= probs.sum()
    keep = min(int(np.searchsorted(np.cumsum(probs), params.top_p)) + 1, int((probs >= params.min_p * probs[0]).sum()))
    return dict(zip(order[:keep].tolist(), (probs[:keep] / probs[:keep].sum()).tolist(), strict=True))


def test_the_default_chain_draws_each_token_with_its_exact_probability_on_a_full_vocabulary():
    logits = RNG.normal(size=49_152).astype(np.float32)
    favourites = RNG.choice(len(logits), size=6, replace=False)
    logits[favourites] = [8.0, 7.5, 7.0, 6.5, 6.0, 4.0]  # the last falls to min-p, the tail to top-p
    params = SamplingParams(seed=3)
    expected = chain_probabilities(logits, params)
    sampler = Sampler(params)
    n = 20_000
    counts = Counter(sampler(logits) for _ in range(n))
    assert set(counts) <= set(expected)
    for token, p in expected.items():
        assert abs(counts[token] / n - p) < 5 * math.sqrt(p * (1 - p) / n) + 1e-3


def plain_chain_draws(logits: np.ndarray, params: SamplingParams, n: int) -> list[int]:
    """The chain straight from its definition (a full sort, every filter over the top k), drawing with
    the same generator as the sampler: the tokens the sampler must give, draw for draw."""
    order = np.argsort(-logits, kind="stable")
    if params.top_k:
        order = order[: params.top_k]
    weights = np.exp((logits[order].astype(np.float64) - logits[order[0]]) / params.temperature)
    mass = np.cumsum(weights)
    keep = min(
        len(order),
        int(np.searchsorted(mass, params.top_p * mass[-1])) + 1 if params.top_p < 1 else len(order),
        int((weights >= params.min_p).sum()),
    )
    rng = np.random.default_rng(params.seed)
    picks = (np.searchsorted(mass[:keep], rng.random(n) * mass[keep - 1], side="right")).clip(max=keep - 1)
    return order[picks].tolist()


def sampler_row(name: str) -> np.ndarray:
    rng = np.random.default_rng(list(SAMPLER_ROWS).index(name))
    n = 49_152
    row = rng.normal(size=n).astype(np.float32)
    if name == "peaked":  # min-p decides: the two passes alone
        row[rng.choice(n, size=4, replace=False)] = [9.0, 8.2, 7.9, 6.5]
    elif name == "favourites":  # min-p drops the last; top-p would cut inside min-p's set without the rest
        row[rng.choice(n, size=6, replace=False)] = [8.0, 7.5, 7.0, 6.5, 6.0, 4.0]
    elif name == "flat":  # top-p cuts inside min-p's set: the top-k pass
        row -= 10
        row[rng.choice(n, size=30, replace=False)] = 5.0
    elif name == "hot":  # thousands above min-p's bound, more than k
        row *= 0.1
    elif name == "tied":  # ties at the top and at the k-th place
        row = np.round(row * 2)
    return row


SAMPLER_ROWS = ("peaked", "favourites", "flat", "hot", "tied")


@pytest.mark.parametrize("row", SAMPLER_ROWS)
@pytest.mark.parametrize(
    "options",
    [{}, {"top_k": 0}, {"top_k": 5, "top_p": 0.5}, {"min_p": 0.0}, {"top_p": 1.0}, {"temperature": 2.5, "min_p": 0.2}],
)
def test_every_draw_is_the_one_the_plain_chain_gives(row, options):
    params = SamplingParams(seed=11, **options)
    logits = sampler_row(row)
    sampler = Sampler(params)
    assert [sampler(logits) for _ in range(200)] == plain_chain_draws(logits, params, 200)


@pytest.mark.parametrize("bad", [np.nan, np.inf])
@pytest.mark.parametrize("options", [{}, {"min_p": 0.0}, {"top_k": 0}])
def test_a_nan_or_infinite_logit_is_refused_not_drawn_around(bad, options):
    logits = RNG.normal(size=1000).astype(np.float32)
    logits[500] = bad
    with pytest.raises(ValueError, match="largest logit"):
        Sampler(SamplingParams(seed=0, **options))(logits)


@pytest.mark.parametrize("n", [2048, 32_000, 49_152, 151_936])
def test_top_k_finds_the_k_best_however_they_lie(n):
    for k in (1, 40, 127):
        clustered = RNG.normal(size=n).astype(np.float32)
        clustered[: 3 * k] += 10  # the best all in a few of the groups top-k bounds them with
        tied = np.round(RNG.normal(size=n) * 2).astype(np.float32)
        masked = RNG.normal(size=n).astype(np.float32)
        masked[RNG.choice(n, size=n - k // 2, replace=False)] = -np.inf  # fewer finite logits than k
        for logits in (clustered, tied, masked):
            expected = np.argsort(-logits, kind="stable")[:k]
            indices, values = _top_k(logits, k)
            np.testing.assert_array_equal(indices, expected)
            np.testing.assert_array_equal(values, logits[expected])


def test_split_multibyte_characters_wait_for_their_last_byte():
    stream = TextStream()
    euro = "€".encode()
    assert stream.push(b"price: " + euro[:1]) == "price: "
    assert stream.push(euro[1:2]) == ""
    assert stream.push(euro[2:] + b"5") == "€5"
    assert stream.text == "price: €5"


def test_a_stop_string_split_across_tokens_is_never_shown():
    stream = TextStream(stop=["<END>"])
    shown = [stream.push(p) for p in (b"done <E", b"N", b"D> and more")]
    assert shown == ["done ", "", ""]
    assert stream.stopped and stream.text == "done "


def test_a_false_start_of_a_stop_string_is_released():
    stream = TextStream(stop=["<END>"])
    assert stream.push(b"a <E") == "a "
    assert stream.push(b"X") == "<EX"
    assert stream.push(b" <") == " "
    assert stream.flush() == "<"
    assert not stream.stopped


@pytest.mark.parametrize(
    "options",
    [
        {"seed": -1},
        {"seed": 1.5},
        {"stop": None},
        {"stop": [1]},
        {"max_tokens": "5"},
        {"max_tokens": 2.5},
        {"temperature": float("inf")},
        {"top_p": float("nan")},
    ],
)
def test_bad_sampling_values_are_option_errors(options):
    with pytest.raises(InvalidOptionError):
        SamplingParams(**options)


def test_a_character_cut_off_by_max_tokens_is_dropped_not_replaced():
    stream = TextStream()
    assert stream.push("ok 🤖".encode()[:-2]) == "ok "
    assert stream.flush() == ""
    assert stream.text == "ok "


@pytest.mark.parametrize("stop", [(), ("<END>",)])
def test_a_long_answers_text_is_every_piece_shown_in_order(stop):
    """Past the pieces joined every JOIN_EVERY (the text is kept in pieces, not copied whole each token), with a
    character split across tokens at a join and a stop string held back over one."""
    stream, shown = TextStream(stop=stop), []
    euro = "€".encode()
    n = 2 * JOIN_EVERY + 7
    for i in range(n):
        piece = euro[:1] if i == JOIN_EVERY else euro[1:] if i == JOIN_EVERY + 1 else f"{i} ".encode()
        shown.append(stream.push(piece))
    shown.append(stream.push(b" <EN"))
    shown.append(stream.push(b"D> never shown" if stop else b"D>"))
    shown.append(stream.flush())
    assert stream.text == "".join(shown) and "€" in stream.text
    assert stream.text.endswith(f"{n - 1}  ") if stop else stream.text.endswith(f"{n - 1}  <END>")
    assert stream.stopped == bool(stop)


def test_the_held_back_tail_is_the_longest_that_could_begin_a_stop_string():
    # Against every prefix length tried in turn, on texts and stop strings of few letters, where a stop string's
    # first character recurs inside it and in the text.
    rng = random.Random(5)
    for _ in range(3000):
        stops = ["".join(rng.choices("ab<", k=rng.randint(1, 5))) for _ in range(rng.randint(1, 3))]
        text = "".join(rng.choices("ab<x", k=rng.randint(0, 8)))
        expected = max(
            (n for stop in stops for n in range(1, min(len(stop) - 1, len(text)) + 1) if text.endswith(stop[:n])),
            default=0,
        )
        assert TextStream(stop=stops)._partial_stop_len(text) == expected, (stops, text)
