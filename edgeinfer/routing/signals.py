"""Escalation signals, computed on the device: should the small local model answer, or the cloud?

Each signal is a number in [0, 1]; higher means "more likely beyond the local model".
They are cheap by design: regular expressions, counts, and log-probabilities and entropies
the local model computes as it samples when asked (``SamplingParams(logprobs=True)``, which the
router sets: one pass over each token's logits, ~30 µs on SmolLM2's 49,152-entry rows).

- ``length``: prompt tokens plus room for the answer, over the local KV capacity (1 = does not fit,
  and the prompt goes to the cloud whatever the score). Its scale depends on the KV budget, so the
  score weighs ``size`` instead.
- ``size``: the tokens of the user's message (the last one), over 64: longer questions pack more
  facts and steps for a small model to get wrong.
- ``arithmetic``: numbers joined by operators or asked about; multi-digit operands weigh more, since
  small models get one-digit sums right far more often than long ones.
- ``reasoning``: cue words of multi-step problems ("twice as", "how many ... left", "if ... then"),
  or several numbers in a longer question (a word problem).
- ``code``: programming vocabulary, code fences, calls with brackets, operators such as ``**`` or ``//``.
- ``language``: the share of words that are not English (non-Latin script, or common words of other
  languages), or a request for an answer in another language ("translate", "in German"), for a local
  model trained on English only.
- ``perplexity``: the mean negative log-probability per token the local model gives the user's message
  at prefill, scaled so 5 nats per token (a prompt the model finds very strange) is 1.
- ``uncertainty``: from the log-probabilities of the first K tokens the local model generates; a low
  quantile (the minimum by default; not the mean: a single coin-flip token is what derails a short
  answer) is scaled so -8 nats is 1.
- ``entropy``: the largest entropy of the next-token distribution over those same K tokens, scaled so
  8 nats is 1. Where ``uncertainty`` sees how likely the chosen token was, this sees how spread out the
  model's choice was at its least sure step (a near-tie between a few tokens versus no idea at all).
  The largest, for the same reason as the minimum above: on the questions of scripts/router_quality.py
  the median entropy ranks wrong answers worse (AUROC 0.59 against 0.67 over 16 tokens), and so does
  the margin between the two likeliest tokens (0.62), which is why neither is a signal.
- ``disagreement`` (only with ``Policy(samples=N)``): the local model also answers N times at
  temperature 0.7, ``sample_tokens`` tokens each, and the signal is 1 minus the mean overlap
  (Jaccard) between the content words of the first sentence of every pair of those answers and the
  probe's. Content words are those not in the question and not function words, so "The capital of
  Australia is Sydney" against "... is Canberra" disagrees, and "Canberra is the capital of
  Australia" against "... is Canberra" does not (a rephrasing that adds words counts partly).
  A model that knows a fact tends to state it every time; one that guesses names something new each
  time. It costs N × ``sample_tokens`` more local tokens before the first one is shown, so it is off
  by default: on scripts/router_quality.py it lifts the AUROC from 0.81 to 0.83-0.84, in and out of
  sample (docs/BENCHMARKS.md). The confidence signals above cannot see this: a small model states
  its wrong facts as confidently as its right ones.

The score is a weighted sum of the signals. ``WEIGHTS`` were fitted to SmolLM2-135M's right and wrong
answers on scripts/data/router_questions.jsonl by ``calibration.fit_weights`` (``python
scripts/router_quality.py --samples 4 --load RUNS.json`` prints the fit); the held-out questions
beside them (scripts/data/router_questions_heldout.jsonl) measure them out of sample.
``edgeinfer router calibrate --fit-weights`` fits them for another model or other questions.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

import numpy as np

SIGNALS = (
    "length",
    "size",
    "arithmetic",
    "reasoning",
    "code",
    "language",
    "perplexity",
    "uncertainty",
    "entropy",
    "disagreement",
)
SCORED = tuple(name for name in SIGNALS if name != "length")  # length acts as a rule (see above)

# How much each signal moves the escalation score (the log-odds of a wrong local answer it adds at
# full strength), fitted for SmolLM2-135M (see above). Code and perplexity do not predict its wrong
# answers there (it answers simple code questions well), so the fit gives them nothing; they are
# computed and reported, and ``Policy(weights=...)`` can weigh them for another model. They were
# fitted with ``disagreement`` present (Policy(samples=4)); without it, the others rank the fitted
# questions exactly as well as weights fitted without it (74.8% of the gap at 50% cloud, both ways).
WEIGHTS: Mapping[str, float] = {
    "length": 0.0,
    "size": 0.357,
    "arithmetic": 0.918,
    "reasoning": 0.584,
    "code": 0.0,
    "language": 0.805,
    "perplexity": 0.0,
    "uncertainty": 0.314,
    "entropy": 0.635,
    "disagreement": 1.33,
}
UNCERTAINTY_QUANTILE = 0.0  # the least likely token: one coin-flip token derails a short answer
_SIZE_SCALE = 64  # tokens
_PERPLEXITY_SCALE = 5.0  # nats per token
_UNCERTAINTY_SCALE = 8.0  # nats
_ENTROPY_SCALE = 8.0  # nats

_NUMBER = r"\d+(?:[.,]\d+)?"
_OPERATION = re.compile(
    rf"({_NUMBER})\s*(?:[-+*/×÷^x]|\*\*|plus|minus|times|divided by|fois|por|mal)\s*({_NUMBER})", re.I
)
_QUANTITY = re.compile(r"\b(how many|how much|what is|calculate|compute|percent|square root|sum of|product)\b", re.I)
_REASONING = re.compile(
    r"\b(twice|half|thrice|times as|more than|less than|older|younger|faster|each|per|equally|left|remaining|"
    r"all but|then|if|next number|sequence|probability|how long|what time|in total|altogether|step by step|"
    r"therefore|definitely|heavier|lighter)\b",
    re.I,
)
_CODE = re.compile(
    r"```|\b(python|javascript|java|c\+\+|rust|golang|sql|html|css|regex|function|def|class|return|print|"
    r"lambda|list|dict|array|string|compile|git|http|algorithm|complexity|big-o|typeof|sizeof|null|bash)\b|"
    r"\w+\([^)]*\)|\*\*|//|\[[^\]]*\]|\.\w+\(",
    re.I,
)
_WORD_PROBLEM_WORDS = 12
_LANGUAGES = r"(?:french|german|spanish|italian|portuguese|dutch|russian|chinese|japanese|korean|arabic|hindi|turkish)"
_TRANSLATION = re.compile(
    rf"\b(?:translate|translation|how do you say|in {_LANGUAGES}\b|{_LANGUAGES} (?:word|for|phrase))", re.I
)
_WORD = re.compile(r"[^\W\d_]+", re.UNICODE)
# Frequent short words of the larger European languages that are not also English words.
_FOREIGN_WORDS = frozenset(
    " ".join(
        (
            "le la les des une est sont du et ou quelle quel comment combien pourquoi avec pour dans sur très",
            "el los las es y qué cuál cuántos cuánto cómo dónde por para con una tiene",
            "der das ist sind und wie viele welche warum mit für ein eine heißt von",
            "os é são qual quantos com uma il gli sono che perché",
        )
    ).split()
)


_TOKEN = re.compile(r"\w+")
_SENTENCE_END = re.compile(r"(?<=[.!?])\s|\n")
# Words that say nothing about which answer was given (numbers and yes/no included: "one of the",
# "no doubt" are phrasing far more often than answers in a first sentence).
_FUNCTION_WORDS = frozenset(
    " ".join(
        (
            "the a an is are of in to and was were it its this that for on by as at with be which what who how",
            "do does called can you your i we our they their has have had not no yes or but so if then than also",
            "very more most some any all one two would will should could there here",
        )
    ).split()
)


def task_signals(text: str) -> dict[str, float]:
    """The prompt-only task features of ``text``: arithmetic, reasoning, code, language."""
    operations = _OPERATION.findall(text)
    numbers = re.findall(_NUMBER, text)
    if operations:
        longest = max(len(a.replace(".", "").replace(",", "")) for pair in operations for a in pair)
        arithmetic = 0.5 + 0.25 * min(longest - 1, 2) if longest > 1 or len(operations) > 1 else 0.25
    elif numbers and _QUANTITY.search(text):
        arithmetic = 0.5
    else:
        arithmetic = 0.0
    cues = len(_REASONING.findall(text))
    reasoning = min(1.0, cues / 3 + (0.25 if len(numbers) >= 2 else 0.0)) if cues else 0.0
    if len(numbers) >= 2 and len(text.split()) >= _WORD_PROBLEM_WORDS:
        reasoning = max(reasoning, 0.5)  # several quantities in a story: a word problem
    code = min(1.0, len(_CODE.findall(text)) / 2)
    language = foreign_share(text)
    if _TRANSLATION.search(text):
        language = max(language, 0.6)  # the answer itself must be in another language
    return {"arithmetic": arithmetic, "reasoning": reasoning, "code": code, "language": language}


def foreign_share(text: str) -> float:
    """The share of words in ``text`` that are not English: non-Latin script, or common foreign words."""
    words = _WORD.findall(text)
    if not words:
        return 0.0
    foreign = 0.0
    for word in words:
        if not all(ch.isascii() or "\u00c0" <= ch <= "\u024f" for ch in word):
            foreign += max(1, len(word) // 2)  # CJK runs are whole phrases without spaces
        elif word.lower() in _FOREIGN_WORDS:
            foreign += 1
    # Three foreign words in a row are already a clear sign.
    return min(1.0, 3 * foreign / len(words))


def length_signal(prompt_tokens: int, answer_room: int, capacity: int) -> float:
    """1 when the prompt and the room for its answer do not fit in the local KV cache."""
    return min(1.0, (prompt_tokens + answer_room) / capacity)


def size_signal(message_tokens: int) -> float:
    """The user's message length in tokens, scaled so 64 tokens is 1."""
    return min(1.0, message_tokens / _SIZE_SCALE)


def perplexity_signal(prompt_logprobs: Sequence[float]) -> float:
    """The prompt's mean negative log-probability per token, scaled to [0, 1]."""
    if not prompt_logprobs:
        return 0.0
    return float(np.clip(-np.mean(prompt_logprobs) / _PERPLEXITY_SCALE, 0.0, 1.0))


def uncertainty_signal(token_logprobs: Sequence[float]) -> float:
    """A low quantile of the generated tokens' log-probabilities, scaled to [0, 1]."""
    if not token_logprobs:
        return 0.0
    low = float(np.quantile(np.asarray(token_logprobs, dtype=np.float64), UNCERTAINTY_QUANTILE))
    return float(np.clip(-low / _UNCERTAINTY_SCALE, 0.0, 1.0))


def entropy_signal(token_entropies: Sequence[float]) -> float:
    """The largest next-token entropy over the generated tokens, scaled to [0, 1]."""
    if not token_entropies:
        return 0.0
    return float(np.clip(max(token_entropies) / _ENTROPY_SCALE, 0.0, 1.0))


def disagreement_signal(question: str, answers: Sequence[str]) -> float:
    """1 minus the mean pairwise overlap of the answers' first-sentence content words (see above).

    Two answers without content words (both only restate the question) count as agreeing.
    """
    asked = {word.lower() for word in _TOKEN.findall(question)}
    bags = [_content_words(answer, asked) for answer in answers]
    overlaps = [len(a & b) / len(a | b) if a | b else 1.0 for i, a in enumerate(bags) for b in bags[i + 1 :]]
    return float(1.0 - np.mean(overlaps)) if overlaps else 0.0


def _content_words(answer: str, asked: set[str]) -> set[str]:
    first_sentence = _SENTENCE_END.split(answer.strip(), maxsplit=1)[0]
    words = {word.lower() for word in _TOKEN.findall(first_sentence)}
    return words - asked - _FUNCTION_WORDS


def escalation_score(signals: Mapping[str, float], weights: Mapping[str, float] = WEIGHTS) -> float:
    """The weighted sum of the signals given; a missing signal counts as 0.

    With no negative weight, a score from some signals is a lower bound of the score with all
    of them: a prompt already over the threshold need not wait for the rest.
    """
    return sum(weights.get(name, 0.0) * value for name, value in signals.items())


def top_signals(signals: Mapping[str, float], weights: Mapping[str, float] = WEIGHTS, n: int = 2) -> str:
    """The ``n`` signals that add most to the score, for a route's reason: ``"arithmetic 1.00, language 0.50"``."""
    ranked = sorted((weights.get(k, 0.0) * v, k) for k, v in signals.items() if weights.get(k, 0.0) * v > 0)[::-1]
    return ", ".join(f"{name} {signals[name]:.2f}" for _, name in ranked[:n]) or "none"
