"""The benchmark's parent side: check everything, start a worker process per configuration, take the runs."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from time import perf_counter
from typing import Any

import numpy as np

from edgeinfer.backends import backend_class, choose_backend
from edgeinfer.backends.base import CPU, Backend, BackendOptions, check_options
from edgeinfer.bench.report import BenchReport, Config, Outcome
from edgeinfer.errors import BackendError, EdgeInferError, InvalidOptionError
from edgeinfer.kv import MIN_KV_TOKENS
from edgeinfer.metrics import Metrics
from edgeinfer.models.catalog import resolve_model
from edgeinfer.models.info import ModelInfo, load_model_info
from edgeinfer.speculative import Speculation
from edgeinfer.system import available_ram, child_env, thread_count

BANDWIDTH_BUFFER_CAP = 2**30
PROMPT_TEXT = (
    "At dawn the ferry left the harbour with crates of apples, two bicycles and a sleeping dog. "
    "The captain counted the gulls, checked the compass and hummed an old song about the tides. "
)


def bench(
    models: Sequence[str],
    backends: Sequence[str] = ("auto",),
    *,
    prompt_tokens: int = 128,
    gen_tokens: int = 128,
    runs: int = 5,
    threads: int | None = None,
    device: str = CPU,
    gpu_layers: int = -1,
    speculative: Speculation = Speculation.LOOKUP,
    progress: Callable[[str], None] = lambda line: None,
) -> BenchReport:
    """Benchmark every model on every backend; see the package docstring for the method.

    Models are ``.gguf`` paths, catalog aliases or ``hf:`` references; backends are
    registered names or ``"auto"``; ``device``, ``gpu_layers`` and ``speculative`` (lookup or off) are the
    engine's.
    Everything is checked before any worker starts.
    """
    for name, value, least in (("prompt_tokens", prompt_tokens, 1), ("gen_tokens", gen_tokens, 2), ("runs", runs, 1)):
        if value < least:
            raise InvalidOptionError(f"{name} must be at least {least}, got {value}")
    if speculative not in (Speculation.LOOKUP, Speculation.OFF):
        raise InvalidOptionError(f"bench drafts by lookup or not at all, not {speculative.value}: choose lookup or off")
    threads = thread_count(threads)  # as the engine will
    if not models:
        raise InvalidOptionError("name at least one model to benchmark")
    infos: dict[str, ModelInfo] = {}
    for model in models:
        info = infos[model] = load_model_info(resolve_model(model))
        if prompt_tokens + gen_tokens > info.hparams.n_ctx_train:
            raise InvalidOptionError(
                f"{model}: a {prompt_tokens}-token prompt and {gen_tokens} generated tokens exceed its "
                f"{info.hparams.n_ctx_train}-token context; lower --prompt-tokens or --gen-tokens"
            )
    kv_tokens = max(prompt_tokens + gen_tokens, MIN_KV_TOKENS)
    options = BackendOptions(kv_tokens=kv_tokens, kv_type=None, threads=threads, device=device, gpu_layers=gpu_layers)

    def loading(cls: type[Backend]) -> BackendOptions:
        return check_options(cls, options)

    configs = [  # "auto" resolved per model, as the workers' engines will resolve it
        Config(model, infos[model].path, choose_backend(backend, infos[model], loading).name)
        for model in models
        for backend in backends or ("auto",)
    ]
    resolved = {backend: loading(backend_class(backend)) for backend in dict.fromkeys(c.backend for c in configs)}
    prompts = {model: exact_prompt(info.path, prompt_tokens) for model, info in infos.items()}

    needs = [backend_class(c.backend).memory(infos[c.model], resolved[c.backend]) for c in configs]
    device_free = min((n.device_free for n in needs if n.device_free is not None), default=None)
    fit = sum(n.total for n in needs) < available_ram() and (
        device_free is None or sum(n.device_bytes for n in needs) < device_free
    )
    interleaved = len(configs) > 1 and fit
    groups = [configs] if interleaved else [[c] for c in configs]

    roofline: dict[Config, tuple[int | None, float | None]] = dict.fromkeys(configs, (None, None))
    bandwidths: dict[int, float] = {}  # by bytes read, measured once for configurations that read the same
    for config, need in zip(configs, needs, strict=True):
        if need.device_bytes:  # on a GPU (--device, or the vulkan backend): host bandwidth says nothing of it
            continue
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
                    "device": device,
                    "gpu_layers": gpu_layers,
                    "speculative": speculative.value,
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
    return BenchReport(prompt_tokens, gen_tokens, runs, interleaved, outcomes, device, gpu_layers, speculative)


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
    """Bytes one decode step on the CPU reads: the weights as ``backend`` holds them, and a ``context``-token
    KV cache of its default type, as the bench's engines keep."""
    backend_cls = backend_class(backend)
    # The embedding table gives one row per token, unless it doubles as the output matrix.
    skipped = None if info.hparams.tied_embeddings else "token_embd.weight"
    in_file = sum(t.nbytes for t in info.tensors if t.name != skipped)
    options = check_options(backend_cls, BackendOptions(kv_tokens=context, kv_type=None))  # its default KV type
    # A backend that expands the weights (the reference holds f32) reads that much more.
    expansion = backend_cls.memory(info, options).weights / info.file_size
    return int(in_file * expansion) + int(context * backend_cls.kv_bytes_per_token(info, options.kv_type))


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
    """One configuration's process (``worker``), driven over its stdin and stdout, one JSON object a line."""

    def __init__(self, config: Config, job: dict[str, Any]) -> None:
        self.config = config
        self._stderr = tempfile.TemporaryFile("w+")  # noqa: SIM115 (kept for the worker's life; read if it dies)
        launched = perf_counter()
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "edgeinfer.bench.worker"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr, env=child_env(), text=True,
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
