"""Escalation signals, computed on the device: should the small local model answer, or the cloud?

Each signal is a number in [0, 1]; higher means "more likely beyond the local model".
They are cheap by design: regular expressions, counts, and log-probabilities the local
model computes anyway.

- ``length``: prompt tokens plus room for the answer, over the local KV capacity (1 = does not fit).
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
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

import numpy as np

SIGNALS = ("length", "arithmetic", "reasoning", "code", "language", "perplexity", "uncertainty")

# How much each signal moves the escalation score, set by hand for SmolLM2-135M from
# scripts/router_quality.py. Code and perplexity do not predict its wrong answers there (AUROC
# 0.45 and 0.48: it answers simple code questions well), so they are computed and reported but
# weigh nothing; give ``Policy(weights=...)`` to weigh them for another model.
WEIGHTS: Mapping[str, float] = {
    "length": 1.0,
    "arithmetic": 0.6,
    "reasoning": 0.4,
    "code": 0.0,
    "language": 0.8,
    "perplexity": 0.0,
    "uncertainty": 0.6,
}
UNCERTAINTY_QUANTILE = 0.0  # the least likely token: one coin-flip token derails a short answer
_PERPLEXITY_SCALE = 5.0  # nats per token
_UNCERTAINTY_SCALE = 8.0  # nats

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
