"""The router quality benchmark: its question files, and its figures from the real local model's answers."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter

import pytest

from edgeinfer import CloudModel, Router
from edgeinfer.routing.calibration import auroc, is_correct, load_questions
from edgeinfer.routing.signals import escalation_score

from openai_server import OpenAIServer
from support import SCRIPTS, load_script

QUESTIONS = SCRIPTS / "data" / "router_questions.jsonl"
HELDOUT = SCRIPTS / "data" / "router_questions_heldout.jsonl"
CATEGORIES = {"facts", "everyday", "arithmetic", "reasoning", "code", "language"}


def test_question_files_are_disjoint_gradable_and_share_one_mix_of_categories():
    main, held = load_questions(QUESTIONS), load_questions(HELDOUT)
    assert len(main) >= 100 and len(held) >= 100
    texts = [q.question for q in main + held]
    assert len(set(texts)) == len(texts)  # the held-out set shares no question with the fitted one
    for q in main + held:
        assert all(is_correct(answer, q.answers) for answer in q.answers), q
    shares = [{c: n / len(qs) for c, n in Counter(q.category for q in qs).items()} for qs in (main, held)]
    assert set(shares[0]) == set(shares[1]) == CATEGORIES
    assert all(abs(shares[0][c] - shares[1][c]) < 0.03 for c in CATEGORIES)


def test_held_out_figures_come_from_the_shipped_weights(engine, tmp_path):
    script = load_script("router_quality")

    def picked(path):  # 8 easy facts (3-6 right on AVX2 and AVX-512 builds) and 4 hard sums (wrong)
        qs = load_questions(path)
        return [q for q in qs if q.category == "facts"][:8] + [q for q in qs if q.category == "arithmetic"][-4:]

    with OpenAIServer(default_answer="unused") as server:
        router = Router(engine, CloudModel(server.url, "oracle", api_key="not-needed"))
        records = script.assess_all(router, picked(QUESTIONS), 16)
        held = script.assess_all(router, picked(HELDOUT), 16)
    assert any(r["correct"] for r in held) and not all(r["correct"] for r in held)
    runs = tmp_path / "runs.json"
    runs.write_text(json.dumps({"samples": 0, "questions": records, "heldout": held}))

    out = subprocess.run(
        [sys.executable, str(SCRIPTS / "router_quality.py"), "--load", str(runs), "--no-route"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    heldout_part = out.split("held-out questions, scored with the shipped weights:")[1]
    shipped = next(line for line in heldout_part.splitlines() if line.startswith("auto (shipped weights)"))
    expected = auroc([escalation_score(r["signals"]) for r in held], [not r["correct"] for r in held])
    assert float(shipped.split()[-2]) == pytest.approx(expected, abs=5e-4)
    assert "both sets, auto (5-fold CV)" in heldout_part
    assert f"{len(records)} questions from router_questions.jsonl, {len(held)} held out" in out
