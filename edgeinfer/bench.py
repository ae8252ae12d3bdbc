"""``edgeinfer bench``: models and backends side by side, from launch to the last token.

For each configuration (a model on a backend) it reports load time, cold start, TTFT,
time per output token (P50/P95/P99), prefill and decode tokens/s, peak RSS, the share
of each engine stage (tokenize, prefill, decode, sample, detokenize) and the decode
speed that memory bandwidth allows.

How it measures:

- Every configuration runs in its own fresh worker process (``python -m edgeinfer.bench``),
  so load time and peak RSS are that configuration's alone.
- The prompt is text that tokenizes to exactly ``prompt_tokens`` ids; decoding is greedy
  with end-of-generation ignored, so every run generates exactly ``gen_tokens`` tokens.
  The KV cache holds prompt and answer (nothing is evicted) and is emptied before every
  run, so each run prefills the whole prompt.
- Load: the worker's ``Engine(...)`` call. Cold start: from launching the worker (before
  its interpreter starts) to its first text arriving here: interpreter, imports, load,
  prefill and the first token. One sample per configuration; that first generation is
  also the warm-up.
- Then ``runs`` measured runs. Wall time on a shared machine drifts by more than the
  differences measured, so when every configuration fits in RAM at once they stay loaded
  and take turns run by run, the order reversing each round; otherwise they run one
  after another.
- TTFT, prefill and decode tokens/s and stage times are the engine's ``Metrics``, median
  over runs; TPOT percentiles pool the gaps between consecutive tokens of every run.
- Peak RSS: the worker's own high-water mark (``VmHWM`` on Linux), which counts the pages of
  mapped weights it touched.
- Decode roofline: the bytes one decode step must read (every weight tensor in the GGUF,
  less the token embedding when a separate output matrix exists, scaled by how much the
  backend expands the file in RAM (4 bytes a weight for the reference), plus the f16 KV cache
  at the middle of the answer) divided by the read bandwidth numpy reaches summing a
  buffer of that size (at most 1 GiB) on the same number of threads, best of 3 passes.
  A model that fits in the CPU cache is thus held to the cache's bandwidth, as its
  backend is.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from time import perf_counter
from typing import IO, Any

import numpy as np
import psutil

from edgeinfer.backends import backend_class
from edgeinfer.engine import Engine
from edgeinfer.errors import BackendError, EdgeInferError, InvalidOptionError
from edgeinfer.kv import MIN_KV_TOKENS
from edgeinfer.metrics import Metrics, percentile
from edgeinfer.models.catalog import resolve_model
from edgeinfer.models.info import ModelInfo, load_model_info
from edgeinfer.system import available_ram, default_threads, estimate_memory, usable_cores

STAGES = ("tokenize", "prefill", "decode", "sample", "detokenize")
BANDWIDTH_BUFFER_CAP = 2**30
_Note = Callable[[dict[str, float], str], str]  # a remark after a table cell, from its column's summary
PROMPT_TEXT = (
    "At dawn the ferry left the harbour with crates of apples, two bicycles and a sleeping dog. "
    "The captain counted the gulls, checked the compass and hummed an old song about the tides. "
)


@dataclass(frozen=True)
class Config:
    """One column of the report: a model on a backend."""

    model: str  # as the user named it
    path: Path
    backend: str  # a registered name, "auto" already resolved

    @property
    def model_label(self) -> str:
        return Path(self.model).stem if self.model.endswith(".gguf") else self.model


@dataclass
class Outcome:
    """What one configuration measured."""

    config: Config
    threads: int = 0
    load_s: float = 0.0
    cold_start_s: float = 0.0
    peak_rss_bytes: int = 0
    runs: list[Metrics] = field(default_factory=list)
    bytes_per_token: int | None = None  # what a decode step reads; None where it cannot be told
    read_bandwidth: float | None = None  # bytes/s

    def summary(self) -> dict[str, float]:
        """The headline figures: medians over runs, TPOT percentiles over every token of every run."""
        runs = self.runs
        gaps = [gap for m in runs for gap in m.token_gaps_s]
        out = {
            "load_s": self.load_s,
            "cold_start_s": self.cold_start_s,
            "ttft_s": statistics.median(m.ttft_s for m in runs),
            "tpot_p50_s": percentile(gaps, 50),
            "tpot_p95_s": percentile(gaps, 95),
            "tpot_p99_s": percentile(gaps, 99),
            "prefill_tokens_per_s": statistics.median(m.prefill_tokens_per_s for m in runs),
            "decode_tokens_per_s": statistics.median(m.tokens_per_s for m in runs),
            "peak_rss_bytes": self.peak_rss_bytes,
            "total_s": statistics.median(m.total_s for m in runs),
        }
        for stage in STAGES:
            out[f"{stage}_s"] = statistics.median(getattr(m, f"{stage}_s") for m in runs)
        # What no stage covers: the engine's bookkeeping, and the caller's time between tokens.
        out["other_s"] = statistics.median(m.total_s - sum(getattr(m, f"{s}_s") for s in STAGES) for m in runs)
        if self.bytes_per_token and self.read_bandwidth:
            out["roofline_tokens_per_s"] = self.read_bandwidth / self.bytes_per_token
        return out


@dataclass
class BenchReport:
    """Every configuration's outcome, in the order asked for; ratios are to the first."""

    prompt_tokens: int
    gen_tokens: int
    runs: int
    interleaved: bool
    outcomes: list[Outcome]

    def to_dict(self) -> dict[str, Any]:
        first = self.outcomes[0].summary()
        configs = []
        for outcome in self.outcomes:
            summary = outcome.summary()
            configs.append(
                {
                    "model": outcome.config.model,
                    "path": str(outcome.config.path),
                    "backend": outcome.config.backend,
                    "threads": outcome.threads,
                    "summary": summary,
                    "ratios": {k: v / first[k] for k, v in summary.items() if first.get(k)},
                    "decode_bytes_per_token": outcome.bytes_per_token,
                    "read_bandwidth_bytes_per_s": outcome.read_bandwidth,
                    "runs": [{**m.to_dict(), "token_times_s": m.token_times_s} for m in outcome.runs],
                }
            )
        return {
            "prompt_tokens": self.prompt_tokens,
            "gen_tokens": self.gen_tokens,
            "runs": self.runs,
            "warmup_runs": 1,
            "interleaved": self.interleaved,
            "configs": configs,
        }

    def format(self) -> str:
        """A table for people: a row per figure, a column per configuration, ratios to the first."""
        summaries = [o.summary() for o in self.outcomes]
        first = summaries[0]
        threads = "/".join(str(n) for n in sorted({o.threads for o in self.outcomes}))
        order = "configurations took turns run by run" if self.interleaved else "configurations ran one after another"
        lines = [
            f"{self.prompt_tokens}-token prompt, {self.gen_tokens} tokens generated (greedy), "
            f"{self.runs} runs after 1 warm-up, {threads} thread{'s' * (threads != '1')}"
            + (f"; {order}" if len(self.outcomes) > 1 else ""),
            "medians over runs; TPOT percentiles over every token; ratios are to the first column",
            "",
        ]
        table: list[list[str]] = [
            ["", *(o.config.model_label for o in self.outcomes)],
            ["", *(o.config.backend for o in self.outcomes)],
        ]

        def row(label: str, key: str, show: Callable[[float], str], note: _Note | None = None) -> None:
            cells = [label]
            for i, s in enumerate(summaries):
                if key not in s:
                    cells.append("-")
                    continue
                cell = show(s[key]) + (note(s, key) if note else "")
                if i > 0 and first.get(key):
                    cell += f"  {s[key] / first[key]:.2f}x"
                cells.append(cell)
            table.append(cells)

        row("load", "load_s", _duration)
        row("cold start", "cold_start_s", _duration)
        row("TTFT", "ttft_s", _duration)
        for q in (50, 95, 99):
            row(f"TPOT P{q}", f"tpot_p{q}_s", _duration)
        row("prefill", "prefill_tokens_per_s", _rate)
        row("decode", "decode_tokens_per_s", _rate)
        row("roofline", "roofline_tokens_per_s", _rate, _reached)
        row("peak RSS", "peak_rss_bytes", lambda v: f"{v / 2**20:,.0f} MiB")
        table.append(["time by stage:", *([""] * len(summaries))])
        for stage in (*STAGES, "other"):
            row(f"  {stage}", f"{stage}_s", _duration, _share)
        row("  total", "total_s", _duration)

        widths = [max(len(r[c]) for r in table) for c in range(len(table[0]))]
        for r in table:
            cells = [r[0].ljust(widths[0])] + [cell.rjust(w) for cell, w in zip(r[1:], widths[1:], strict=True)]
            lines.append("   ".join(cells).rstrip())
        if any("roofline_tokens_per_s" in s for s in summaries):
            lines.append("roofline: the fastest decode memory allows (bytes a step reads / bandwidth measured here)")
        return "\n".join(lines)

    def plot(self, path: Path) -> None:
        """Draw the TPOT spread and the stage times per configuration into a PNG at ``path``."""
        plt = _pyplot()
        labels = [f"{o.config.model_label}\n{o.config.backend}" for o in self.outcomes]
        figure, (spread, stages) = plt.subplots(1, 2, figsize=(6 + 2 * len(labels), 4.5))
        spread.boxplot(
            [[gap * 1000 for m in o.runs for gap in m.token_gaps_s] for o in self.outcomes],
            whis=(5, 99),
            showfliers=False,
        )
        spread.set_xticks(range(1, len(labels) + 1), labels)
        spread.set_ylabel("ms per output token (P5-P99)")
        summaries = [o.summary() for o in self.outcomes]
        columns = np.arange(len(labels))  # by position: two columns may carry the same label
        bottom = np.zeros(len(labels))
        for stage in (*STAGES, "other"):
            heights = np.array([s[f"{stage}_s"] * 1000 for s in summaries])
            stages.bar(columns, heights, bottom=bottom, label=stage)
            bottom += heights
        stages.set_xticks(columns, labels)
        stages.set_ylabel("ms per run (median)")
        stages.legend(fontsize="small")
        figure.suptitle(f"{self.prompt_tokens}-token prompt, {self.gen_tokens} tokens generated, {self.runs} runs")
        figure.tight_layout()
        # Written beside the target and renamed over it, so a failed draw leaves no half a file.
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            figure.savefig(tmp, format="png", dpi=120)
            os.replace(tmp, path)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            raise EdgeInferError(f"cannot write the plot to {path}: {exc.strerror or exc}") from None
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        finally:
            plt.close(figure)


def check_plot_possible(path: Path) -> None:
    """Refuse ``--plot`` before a long run rather than after it."""
    _pyplot()
    folder = path.parent
    if not folder.is_dir() or not os.access(folder, os.W_OK):
        raise InvalidOptionError(f"cannot write the plot to {path}: {folder} is not a folder this user can write to")


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise InvalidOptionError("--plot needs matplotlib, which is not installed: pip install matplotlib") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _duration(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"


def _rate(per_s: float) -> str:
    return f"{per_s:,.1f} tok/s"


def _reached(summary: dict[str, float], key: str) -> str:
    return f" (decode {summary['decode_tokens_per_s'] / summary[key]:.0%})"


def _share(summary: dict[str, float], key: str) -> str:
    return f" ({summary[key] / summary['total_s']:.1%})"


# -- the parent ----------------------------------------------------------------------------------


def bench(
    models: Sequence[str],
    backends: Sequence[str] = ("auto",),
    *,
    prompt_tokens: int = 128,
    gen_tokens: int = 128,
    runs: int = 5,
    threads: int | None = None,
    progress: Callable[[str], None] = lambda line: None,
) -> BenchReport:
    """Benchmark every model on every backend; see the module docstring for the method.

    Models are ``.gguf`` paths, catalog aliases or ``hf:`` references; backends are
    registered names or ``"auto"``. Everything is checked before any worker starts.
    """
    for name, value, least in (("prompt_tokens", prompt_tokens, 1), ("gen_tokens", gen_tokens, 2), ("runs", runs, 1)):
        if value < least:
            raise InvalidOptionError(f"{name} must be at least {least}, got {value}")
    if threads is not None and threads < 1:
        raise InvalidOptionError(f"threads must be at least 1, got {threads}")
    if not models:
        raise InvalidOptionError("name at least one model to benchmark")
    backend_names = [backend_class(name).name for name in backends or ("auto",)]
    infos: dict[str, ModelInfo] = {}
    for model in models:
        info = infos[model] = load_model_info(resolve_model(model))
        if prompt_tokens + gen_tokens > info.hparams.n_ctx_train:
            raise InvalidOptionError(
                f"{model}: a {prompt_tokens}-token prompt and {gen_tokens} generated tokens exceed its "
                f"{info.hparams.n_ctx_train}-token context; lower --prompt-tokens or --gen-tokens"
            )
    configs = [Config(model, infos[model].path, backend) for model in models for backend in backend_names]
    threads = min(threads, usable_cores()) if threads else default_threads()  # as the engine will
    prompts = {model: exact_prompt(info.path, prompt_tokens) for model, info in infos.items()}

    kv_tokens = max(prompt_tokens + gen_tokens, MIN_KV_TOKENS)
    needed = sum(
        estimate_memory(
            infos[c.model], kv_tokens, "f16", 512, backend_class(c.backend).weight_bytes(infos[c.model])
        ).total
        for c in configs
    )
    interleaved = len(configs) > 1 and needed < available_ram()
    groups = [configs] if interleaved else [[c] for c in configs]

    roofline = {}
    bandwidths: dict[int, float] = {}  # by bytes read, measured once for configurations that read the same
    for config in configs:
        per_token = decode_bytes_per_token(infos[config.model], config.backend, prompt_tokens + gen_tokens // 2)
        if per_token not in bandwidths:
            bandwidths[per_token] = read_bandwidth(per_token, threads)
        roofline[config] = (per_token, bandwidths[per_token])

    outcomes: list[Outcome] = []
    for group in groups:
        workers: list[tuple[_Worker, Outcome]] = []
        try:
            for config in group:
                progress(f"loading {config.model_label} on {config.backend}")
                job = {
                    "path": str(config.path),
                    "backend": config.backend,
                    "prompt": prompts[config.model],
                    "gen_tokens": gen_tokens,
                    "kv_tokens": kv_tokens,
                    "threads": threads,
                }
                worker = _Worker(config, job)
                per_token, bandwidth = roofline[config]
                outcome = Outcome(
                    config,
                    threads=worker.threads,
                    load_s=worker.load_s,
                    cold_start_s=worker.cold_start_s,
                    bytes_per_token=per_token,
                    read_bandwidth=bandwidth,
                )
                workers.append((worker, outcome))
            which = "" if interleaved else f" of {group[0].model_label} on {group[0].backend}"
            for i in range(runs):
                progress(f"run {i + 1}/{runs}{which}")
                for worker, outcome in workers if i % 2 == 0 else reversed(workers):
                    outcome.runs.append(worker.run())
            for worker, outcome in workers:
                outcome.peak_rss_bytes = worker.finish()
                outcomes.append(outcome)
        finally:
            for worker, _ in workers:
                worker.kill()
    return BenchReport(prompt_tokens, gen_tokens, runs, interleaved, outcomes)


def exact_prompt(model_path: Path, n: int) -> str:
    """Text that the engine turns into exactly ``n`` token ids (BOS included, if the model adds one)."""
    from edgeinfer.tokenizer import Tokenizer

    tokenizer = Tokenizer(model_path)
    try:
        body = n - tokenizer.add_bos
        ids = tokenizer.encode(PROMPT_TEXT * (body // 16 + 2), add_special=False)
        # A cut inside a word can re-tokenize differently; starting a token later usually mends it.
        for start in range(16):
            text = tokenizer.decode(ids[start : start + body])
            if text.strip() and len(tokenizer.encode(text)) == n:
                return text
    finally:
        tokenizer.close()
    raise InvalidOptionError(f"cannot build a prompt of exactly {n} tokens for {model_path.name}; try another length")


def decode_bytes_per_token(info: ModelInfo, backend: str, context: int) -> int:
    """Bytes one decode step reads: the weights as ``backend`` holds them, and a ``context``-token KV cache."""
    # The embedding table gives one row per token, unless it doubles as the output matrix.
    skipped = None if info.hparams.tied_embeddings else "token_embd.weight"
    in_file = sum(t.nbytes for t in info.tensors if t.name != skipped)
    # A backend that expands the weights (the reference holds f32) reads that much more.
    expansion = backend_class(backend).weight_bytes(info) / info.file_size
    return int(in_file * expansion) + int(context * info.kv_bytes_per_token("f16"))


def read_bandwidth(nbytes: int, threads: int) -> float:
    """Bytes per second ``threads`` threads read from a buffer of ``nbytes`` (capped), best of 3."""
    size = max(2**20, min(nbytes, BANDWIDTH_BUFFER_CAP, available_ram() // 4))
    buffer = np.ones(size // 8, dtype=np.int64)
    parts = np.array_split(buffer, threads)
    best = float("inf")
    with ThreadPoolExecutor(threads) as pool:
        for _ in range(3):
            start = perf_counter()
            list(pool.map(np.sum, parts))  # numpy lets go of the GIL while it sums
            best = min(best, perf_counter() - start)
    return buffer.nbytes / best


class _Worker:
    """One configuration's process, driven over its stdin and stdout, one JSON object a line."""

    def __init__(self, config: Config, job: dict[str, Any]) -> None:
        self.config = config
        self._stderr = tempfile.TemporaryFile("w+")  # noqa: SIM115 (kept for the worker's life; read if it dies)
        package_root = str(Path(__file__).resolve().parent.parent)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")])))
        launched = perf_counter()
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "edgeinfer.bench"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr, env=env, text=True,
        )  # fmt: skip
        try:
            self._send(json.dumps(job))
            self._receive("first_token")
            self.cold_start_s = perf_counter() - launched
            ready = self._receive("ready")
        except BaseException:  # Ctrl-C included: no worker outlives the benchmark
            self.kill()
            raise
        self.load_s: float = ready["load_s"]
        self.threads: int = ready["threads"]

    def run(self) -> Metrics:
        self._send("run")
        return Metrics(**self._receive("run")["metrics"])

    def finish(self) -> int:
        """End the worker; its peak RSS in bytes."""
        assert self._proc.stdin is not None
        self._proc.stdin.close()
        peak: int = self._receive("done")["peak_rss_bytes"]
        self._proc.wait()
        return peak

    def kill(self) -> None:
        if self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()
        self._stderr.close()

    def _send(self, line: str) -> None:
        assert self._proc.stdin is not None
        try:
            self._proc.stdin.write(line + "\n")
            self._proc.stdin.flush()
        except BrokenPipeError:
            raise self._died() from None

    def _receive(self, event: str) -> dict[str, Any]:
        assert self._proc.stdout is not None
        line = self._proc.stdout.readline()
        if not line.endswith("\n"):
            raise self._died()
        message: dict[str, Any] = json.loads(line)
        if message["event"] == "error":
            raise EdgeInferError(f"{self.config.model_label} on {self.config.backend}: {message['message']}")
        if message["event"] != event:
            raise BackendError(f"the benchmark worker sent {message['event']!r} where {event!r} was due")
        return message

    def _died(self) -> BackendError:
        code = self._proc.wait()
        how = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
        self._stderr.seek(0)
        last = [line.strip() for line in self._stderr if line.strip()][-1:]
        return BackendError(
            f"the benchmark process for {self.config.model_label} on {self.config.backend} died ({how})"
            + (f": {last[0]}" if last else "")
        )


# -- the worker ----------------------------------------------------------------------------------


def _worker(commands: IO[str]) -> None:
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
            threads=job["threads"],
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
    reply("done", peak_rss_bytes=_peak_rss())


def _peak_rss() -> int:
    """This process's peak resident set, in bytes."""
    if sys.platform == "win32":
        return int(psutil.Process().memory_info().peak_wset)
    if sys.platform == "linux":
        # Not ru_maxrss: Linux carries it over from the parent across fork and exec, so a worker
        # started by a parent that had just read a large buffer would report the parent's peak.
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # Linux counts KiB


if __name__ == "__main__":
    _worker(sys.stdin)
