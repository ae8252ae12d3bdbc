"""Labelled questions, answer grading, and the quality-vs-cloud-share figures of a router.

A question file is JSON Lines, one object a line::

    {"question": "What is 47 * 38?", "answers": ["1786"], "category": "arithmetic"}

``answers`` are the accepted answers. A reply is right when one of them appears in it as a whole
word or number (anywhere, for Chinese and Japanese answers), ignoring case (except for all-capital
answers such as ``ABC`` or ``SELECT``) and thousands separators. That is lenient towards rambling
replies that also name the answer, and strict towards right answers phrased another way ("seven"
for "7" unless both are accepted).

With a cloud that is always right, sending the share ``s`` of questions with the highest
escalation scores to it recovers part of the gap between the local accuracy ``a`` and 1;
a perfect score recovers ``s / (1 - a)``, random routing ``s``.

``fit_weights`` fits the signals' weights to graded answers: a logistic regression of "the local
answer is wrong" on the signals, with weights kept non-negative (the router relies on a score that
only grows as signals come in) and an L2 penalty that keeps correlated signals from taking
extreme, opposite weights on a few hundred questions.
"""

from __future__ import annotations

import json
import re
import unicodedata
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from edgeinfer.errors import InvalidOptionError


@dataclass(frozen=True)
class Question:
    question: str
    answers: tuple[str, ...]
    category: str = ""
    extra: dict[str, object] = field(default_factory=dict, compare=False)


def load_questions(path: str | Path) -> list[Question]:
    """Read a question file; a bad line is a one-line error naming the file and line."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise InvalidOptionError(f"question file {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidOptionError(f"cannot read question file {path}: {exc}") from None
    questions = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            text, answers = row["question"], row["answers"]
            if not isinstance(text, str) or not text.strip():
                raise ValueError("question must be non-empty text")
            if isinstance(answers, str):
                answers = [answers]
            if not answers or not all(isinstance(a, str) and a.strip() for a in answers):
                raise ValueError("answers must be a non-empty list of non-empty strings")
        except (ValueError, KeyError, TypeError) as exc:
            detail = f"missing key {exc}" if isinstance(exc, KeyError) else str(exc).splitlines()[0]
            raise InvalidOptionError(
                f'{path}:{number}: not a question line ({detail}); write {{"question": "...", "answers": ["..."]}}'
            ) from None
        extra = {k: v for k, v in row.items() if k not in ("question", "answers", "category")}
        questions.append(Question(text, tuple(answers), str(row.get("category", "")), extra))
    if not questions:
        raise InvalidOptionError(f"question file {path} has no questions")
    return questions


def is_correct(reply: str, answers: Sequence[str]) -> bool:
    """Whether one of the accepted ``answers`` appears in ``reply`` (see the module doc)."""
    text = _normalize(reply)
    for answer in answers:
        wanted = _normalize(answer)
        case = 0 if len(wanted) > 1 and wanted.isupper() else re.IGNORECASE
        if any(unicodedata.east_asian_width(ch) in "WF" for ch in wanted):
            # Chinese and Japanese write words without spaces: "巴黎" stands inside "首都是巴黎。".
            if wanted in text:
                return True
        # Not inside a longer word or number: "5" is not found in "15" or "0.5".
        elif re.search(rf"(?<!\w)(?<!\d[.,]){re.escape(wanted)}(?!\w)(?![.,]\d)", text, case):
            return True
    return False


def _normalize(text: str) -> str:
    text = unicodedata.normalize("NFKC", text)
    return re.sub(r"(?<=\d),(?=\d{3}\b)", "", text)


def fit_weights(
    signals: Sequence[Mapping[str, float]], wrong: Sequence[bool], names: Sequence[str], l2: float = 0.01
) -> dict[str, float]:
    """Non-negative logistic-regression weights of the signals ``names`` for predicting ``wrong``.

    A weight is the log-odds of a wrong answer its signal adds at full strength (1); the intercept
    is dropped, since only the order of the scores matters to a threshold. A missing signal is 0.
    """
    y = np.asarray(wrong, dtype=np.float64)
    if len(signals) != len(y) or len(y) < 2 or y.min() == y.max():
        raise InvalidOptionError("fitting weights needs at least one right and one wrong local answer")
    x = np.array([[row.get(name, 0.0) for name in names] for row in signals], dtype=np.float64)
    x = np.c_[x, np.ones(len(x))]  # the intercept, neither penalised nor kept non-negative
    penalty = np.r_[np.full(len(names), 2 * l2), 0.0]
    # Accelerated projected gradient descent (FISTA) on the mean log loss; convex, so it converges
    # from zero with the step 1/L, L bounding the gradient's Lipschitz constant.
    step = 1 / (np.linalg.norm(x, 2) ** 2 / (4 * len(x)) + 2 * l2)
    w = ahead = np.zeros(x.shape[1])
    t = 1.0
    for _ in range(3000):
        p = 1 / (1 + np.exp(-(x @ ahead)))
        moved = ahead - step * (x.T @ (p - y) / len(x) + penalty * ahead)
        moved[:-1] = np.maximum(moved[:-1], 0.0)
        t_next = (1 + np.sqrt(1 + 4 * t * t)) / 2
        ahead = moved + (t - 1) / t_next * (moved - w)
        w, t = moved, t_next
    return {name: round(float(v), 3) for name, v in zip(names, w[:-1], strict=True)}


def threshold_for_share(scores: Sequence[float], share: float) -> float:
    """The threshold that sends the share ``share`` of these scores (those >= it) to the cloud."""
    if not 0.0 <= share <= 1.0:
        raise InvalidOptionError(f"the cloud share must be between 0 and 1, got {share}")
    ranked = sorted(scores, reverse=True)
    k = round(share * len(ranked))
    if k == 0:
        return ranked[0] + 1e-6 if ranked else 1.0
    if k == len(ranked):
        return ranked[-1]
    return (ranked[k - 1] + ranked[k]) / 2


def recovery_curve(scores: Sequence[float], correct: Sequence[bool]) -> tuple[np.ndarray, np.ndarray]:
    """Cloud share and the share of the quality gap recovered, for every number of escalations.

    Questions go to the (always right) cloud in order of falling score. Tied scores are taken as a
    random order among themselves, so the curve is the expectation, not a lucky tie-break.
    """
    n = len(scores)
    wrong = ~np.asarray(correct, dtype=bool)
    gap = int(wrong.sum())
    shares = np.arange(n + 1) / n
    if gap == 0:
        return shares, np.ones(n + 1)
    fixed = np.zeros(n + 1)
    order = np.argsort(-np.asarray(scores, dtype=np.float64), kind="stable")
    ordered = np.asarray(scores, dtype=np.float64)[order]
    done, start = 0.0, 0
    while start < n:
        end = start
        while end < n and ordered[end] == ordered[start]:
            end += 1
        group_wrong = wrong[order[start:end]].sum()
        for k in range(1, end - start + 1):
            fixed[start + k] = done + group_wrong * k / (end - start)
        done += group_wrong
        start = end
    return shares, fixed / gap


def share_to_recover(scores: Sequence[float], correct: Sequence[bool], target: float) -> float:
    """The smallest cloud share that recovers ``target`` (0..1) of the quality gap."""
    shares, recovered = recovery_curve(scores, correct)
    return float(shares[int(np.argmax(recovered >= target - 1e-9))])


def apgr(scores: Sequence[float], correct: Sequence[bool]) -> float:
    """Average performance gap recovered (RouteLLM): the area under the recovery curve; random is 0.5."""
    shares, recovered = recovery_curve(scores, correct)
    return float(np.sum((recovered[1:] + recovered[:-1]) / 2 * np.diff(shares)))


def auroc(scores: Sequence[float], wrong: Sequence[bool]) -> float:
    """How well the scores rank wrong local answers above right ones (0.5 is chance; ties count half)."""
    s = np.asarray(scores, dtype=np.float64)
    w = np.asarray(wrong, dtype=bool)
    pos, neg = s[w], s[~w]
    if len(pos) == 0 or len(neg) == 0:
        return float("nan")
    greater = (pos[:, None] > neg[None, :]).sum()
    ties = (pos[:, None] == neg[None, :]).sum()
    return float((greater + ties / 2) / (len(pos) * len(neg)))
