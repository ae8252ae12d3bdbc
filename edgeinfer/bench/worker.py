"""One benchmark configuration's process: ``python -m edgeinfer.bench.worker``, driven by ``runner``.

It reads a job (one JSON line) and then one ``run`` line per measured run from stdin, and answers
with one JSON object a line: ``first_token``, ``ready``, one ``run`` each, then ``done`` once stdin
closes, or ``error`` with a message. It imports only what a model needs, so its cold start is
the engine's.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict
from time import perf_counter
from typing import IO, Any

from edgeinfer.engine import Engine
from edgeinfer.errors import EdgeInferError
from edgeinfer.system import peak_rss


def serve(commands: IO[str]) -> None:
    """Load, warm up (marking the first text), then one run per ``run`` line until stdin closes."""
    # Replies go to the original stdout; anything else printed, native code's too, goes to stderr.
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)

    def reply(event: str, **fields: Any) -> None:
        replies.write(json.dumps({"event": event, **fields}) + "\n")

    job = json.loads(commands.readline())
    sampling = {"temperature": 0.0, "max_tokens": job["gen_tokens"], "ignore_eos": True}
    try:
        start = perf_counter()
        engine = Engine(
            job["path"], backend=job["backend"], kv_budget=f"{job['kv_tokens']}tok", kv_policy="error",
            threads=job["threads"], device=job["device"], gpu_layers=job["gpu_layers"], speculative=job["speculative"],
        )  # fmt: skip
        load_s = perf_counter() - start
        with engine.stream(job["prompt"], **sampling) as warmup:
            next(warmup, None)  # the first text (or the end of a generation that printed none)
            reply("first_token")
            for _ in warmup:
                pass
        reply("ready", load_s=load_s, threads=engine.threads)
        for _ in commands:
            engine.reset()  # every run prefills the whole prompt
            reply("run", metrics=asdict(engine.generate(job["prompt"], **sampling).metrics))
        engine.close()
    except EdgeInferError as exc:
        reply("error", message=str(exc))
        sys.exit(1)
    reply("done", peak_rss_bytes=peak_rss())


if __name__ == "__main__":
    serve(sys.stdin)
