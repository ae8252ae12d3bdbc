"""The default experience: how often `edgeinfer run "QUESTION"` answers an everyday question right.

A new user's first command has no options: the catalog's default model, our default
sampling, and the system prompt the GGUF's chat template writes when none is given.
This scores sampling settings and system prompts on the 20 everyday questions of
scripts/data/everyday_questions.jsonl, 5 seeds each (1 for greedy), generating as `run`
does and grading the first --max-tokens tokens with the router's lenient grader
(``calibration.is_correct``: an accepted answer appears as a word). Also counted: answers
that loop (a word trigram three times or more).

Sampling settings compared:

- ``llama.cpp``: llama.cpp's defaults (temperature 0.8, top-k 40, top-p 0.95, min-p 0.05,
  no repetition penalty), which were edgeinfer's until this benchmark;
- ``ollama``: Ollama's documented defaults (temperature 0.8, top-k 40, top-p 0.9, min-p 0,
  repeat penalty 1.1 over the last 64 tokens);
- ``model card``: SmolLM2's card (temperature 0.2, top-p 0.9; transformers' top-k 50);
- variations of one knob each: temperature 0.5 and 0.2, repetition penalty 1.1, greedy.

System prompts: the template's own (no system message), and two short ones.

    python scripts/default_experience.py --threads 2            # about 15 minutes on 2 free cores
    python scripts/default_experience.py --json > figures.json
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT)]

from edgeinfer import Engine, SamplingParams  # noqa: E402
from edgeinfer.models.catalog import DEFAULT_MODEL  # noqa: E402
from edgeinfer.routing.calibration import is_correct, load_questions  # noqa: E402
from edgeinfer.system import thread_count  # noqa: E402

QUESTIONS = ROOT / "scripts" / "data" / "everyday_questions.jsonl"
SEEDS = (1, 2, 3, 4, 5)
SAMPLING = {
    "llama.cpp": SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05),
    "ollama": SamplingParams(temperature=0.8, top_k=40, top_p=0.9, min_p=0.0, repetition_penalty=1.1),
    "model card": SamplingParams(temperature=0.2, top_k=50, top_p=0.9, min_p=0.0),
    "temperature 0.5": SamplingParams(temperature=0.5, top_k=40, top_p=0.95, min_p=0.05),
    "temperature 0.2": SamplingParams(temperature=0.2, top_k=40, top_p=0.95, min_p=0.05),
    "repeat penalty 1.1": SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, repetition_penalty=1.1),
    "greedy": SamplingParams(temperature=0.0),
}
SYSTEMS = {
    "template's own": None,
    "helpful assistant": "You are a helpful assistant.",
    "brief and accurate": "Answer the question briefly and accurately.",
}
_WORD = re.compile(r"\w+")


def loops(text: str) -> bool:
    words = [w.lower() for w in _WORD.findall(text)]
    trigrams = Counter(zip(words, words[1:], words[2:], strict=False))
    return bool(trigrams) and max(trigrams.values()) >= 3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens generated and graded per answer")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    questions = load_questions(QUESTIONS)
    rows = []
    with Engine(args.model, kv_budget="1024tok", threads=thread_count(args.threads)) as engine:
        for system_name, system in SYSTEMS.items():
            for sampling_name, params in SAMPLING.items():
                seeds = SEEDS[:1] if params.temperature == 0 else SEEDS
                right = looping = 0
                for q in questions:
                    messages = ([{"role": "system", "content": system}] if system else []) + [
                        {"role": "user", "content": q.question}
                    ]
                    for seed in seeds:
                        text = engine.chat(messages, params, max_tokens=args.max_tokens, seed=seed).text
                        right += is_correct(text, q.answers)
                        looping += loops(text)
                n = len(questions) * len(seeds)
                row = {
                    "system": system_name,
                    "sampling": sampling_name,
                    "answers": n,
                    "correct": round(right / n, 3),
                    "looping": round(looping / n, 3),
                }
                rows.append(row)
                if not args.json:
                    line = f"{system_name:20} {sampling_name:20} correct {right:3}/{n}  looping {looping:3}/{n}"
                    print(line, flush=True)
    if args.json:
        print(json.dumps({"max_tokens": args.max_tokens, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
