"""How fast llama.cpp runs each ggml type on this machine: prefill and decode, measured, for the plan.

Kernels differ by CPU far more than bytes do. On x86, llama.cpp repacks Q4_0, IQ4_NL and Q4_K into
interleaved layouts and has a tiled sgemm for some types, while Q4_1 and Q5_1 take the generic dot
product: Q4_0, half a bit a weight smaller than Q4_1, prefilled 2.1-2.8x as fast on an AMD EPYC here.
So each type is timed here, on the threads the engine would use, in a probe model: ``PROBE_LAYERS``
llama layers as wide as the checkpoint's (rounded up to whole 256-value blocks, so every type fits the
rows; at most ``MAX_PROBE_WIDTH``), random weights, every matrix in the type, and a 258-token byte
vocabulary so the head costs little. Each probe is loaded in llama.cpp and timed on a ``PROMPT_TOKENS``
prompt in the engine's chunks (prefill) and on ``DECODE_TOKENS`` one-token steps (decode), best of
``RUNS`` taken in turn with the other types. The probes differ only in their matrices' type, so the
figures rank the types' kernels; ``scripts/bench_types.py`` prints them.
"""

from __future__ import annotations

import contextlib
import math
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter, TokenType

from edgeinfer.backends.base import DEFAULT_BATCH_SIZE, Backend, BackendOptions, Span
from edgeinfer.converters.quantize import quantize
from edgeinfer.converters.writer import add_hparams
from edgeinfer.errors import BackendError
from edgeinfer.models.arch import ARCHITECTURES, HParams, expected_tensors
from edgeinfer.models.info import load_model_info
from edgeinfer.system import thread_count
from edgeinfer.vocabulary import byte_symbols

QType = GGMLQuantizationType
PROBE_LAYERS = 2
PROMPT_TOKENS = 256
DECODE_TOKENS = 32
RUNS = 3
BLOCK = 256  # the widest block of any type (K-quants, IQ4_XS)
# Wide enough that the kernels, not the calls around them, set the pace; a 7B model's probe stays a few seconds.
MAX_PROBE_WIDTH = 1024
HEAD_DIM = 64
# A type whose prefill is this many times slower than that of a type no larger, and whose decode is no faster,
# costs speed and bytes at once: the plan avoids it unless quality insists.
SLOW_FACTOR = 1.3
DECODE_JITTER = 0.1  # decode timings of a probe move by this much from run to run: "as fast" allows for it


@dataclass(frozen=True)
class TypeSpeed:
    """One type's probe: tokens/s of prefill and of decode, and the matrix parameters each token ran through."""

    qtype: QType
    prefill: float
    decode: float
    probe_params: int

    @property
    def prefill_params_per_s(self) -> float:
        """Matrix parameters per second a prompt token runs through: what a plan's prefill time is reckoned by."""
        return self.prefill * self.probe_params


def bits_per_weight(qtype: QType) -> float:
    block, nbytes = GGML_QUANT_SIZES[qtype]
    return 8 * nbytes / block


def probe_hparams(hp: HParams) -> HParams:
    """The probe model's shape: PROBE_LAYERS llama layers as wide as ``hp``'s, rounded up to whole blocks, at most
    MAX_PROBE_WIDTH wide (the FFN narrowed alike), with ``hp``'s share of KV heads where it divides."""
    n_embd = min(_blocks(hp.n_embd), MAX_PROBE_WIDTH)
    n_head = n_embd // HEAD_DIM
    # llama.cpp needs the heads to be a whole multiple of the KV heads: the divisor nearest hp's share.
    share = n_head * hp.n_head_kv / hp.n_head
    n_head_kv = min((d for d in range(1, n_head + 1) if n_head % d == 0), key=lambda d: abs(d - share))
    return HParams(
        arch=ARCHITECTURES["llama"],
        n_vocab=len(_probe_tokens()),
        n_embd=n_embd,
        n_layer=PROBE_LAYERS,
        n_head=n_head,
        n_head_kv=n_head_kv,
        head_dim=HEAD_DIM,
        n_ff=min(_blocks(hp.n_ff), _blocks(n_embd * hp.n_ff // hp.n_embd)),
        n_ctx_train=PROMPT_TOKENS + DECODE_TOKENS,
        rope_base=10_000.0,
        rms_eps=1e-5,
        tied_embeddings=True,
    )


def measure_type_speeds(
    types: Iterable[QType],
    hp: HParams,
    threads: int | None = None,
    progress: Callable[[int, int], None] = lambda done, total: None,
) -> dict[QType, TypeSpeed]:
    """Each of ``types``' probe speed in llama.cpp for a model shaped like ``hp``, on ``threads`` (the engine's
    rule without it); a type llama.cpp refuses to load is left out. Every probe is loaded first and then timed in
    turn, RUNS rounds of one run each, so that a slow moment of the machine falls on every type alike, not on
    one. ``progress(done, total)`` follows the runs."""
    from edgeinfer.backends.llamacpp import LlamaCppBackend

    types = list(types)
    probe = probe_hparams(hp)
    options = BackendOptions(kv_tokens=probe.n_ctx_train, threads=thread_count(threads))
    rng = np.random.default_rng(0)
    weights = {
        name: rng.standard_normal(tuple(reversed(shape))) * 0.02 for name, shape in expected_tensors(probe).items()
    }
    params = sum(w.size for name, w in weights.items() if name.startswith("blk.") and w.ndim == 2)
    tokens = [int(t) for t in rng.integers(0, 256, PROMPT_TOKENS + DECODE_TOKENS)]
    total = RUNS * len(types)
    progress(0, total)
    with tempfile.TemporaryDirectory(prefix="edgeinfer-types-") as folder, contextlib.ExitStack() as loaded:
        backends: dict[QType, Backend] = {}
        for qtype in types:
            path = _write_probe(Path(folder) / f"{qtype.name}.gguf", probe, weights, qtype)
            try:
                backends[qtype] = loaded.enter_context(
                    contextlib.closing(LlamaCppBackend(load_model_info(path), options))
                )
            except BackendError:  # a type this build cannot run: nothing to weigh it by
                total -= RUNS
        best = {qtype: (math.inf, math.inf) for qtype in backends}
        for run in range(RUNS):
            for done, (qtype, backend) in enumerate(backends.items(), 1):
                prefill, decode = _time(backend, tokens)
                best[qtype] = (min(best[qtype][0], prefill), min(best[qtype][1], decode))
                progress(run * len(backends) + done, total)
    return {t: TypeSpeed(t, PROMPT_TOKENS / p, DECODE_TOKENS / d, params) for t, (p, d) in best.items()}


def _blocks(n: int) -> int:
    return -(-n // BLOCK) * BLOCK


def slow_types(speeds: Mapping[QType, TypeSpeed]) -> dict[QType, list[QType]]:
    """Each type whose kernels are slow here, with the types no larger that prefill SLOW_FACTOR times as fast and
    decode as fast (within DECODE_JITTER), the fastest first: bytes and speed both lost to them, which only
    quality can justify. Timings jitter, so a type near either line can fall on either side from run to run."""
    slow = {}
    for t, s in speeds.items():
        faster = [
            u
            for u, f in speeds.items()
            if bits_per_weight(u) <= bits_per_weight(t)
            and f.prefill >= SLOW_FACTOR * s.prefill
            and f.decode >= (1 - DECODE_JITTER) * s.decode
        ]
        if faster:
            slow[t] = sorted(faster, key=lambda u: -speeds[u].prefill)
    return slow


def _time(backend: Backend, tokens: list[int]) -> tuple[float, float]:
    """Seconds for the prompt in the engine's chunks, then for the one-token decode steps after it."""
    backend.truncate(0, 0)
    start = time.perf_counter()
    for at in range(0, PROMPT_TOKENS, DEFAULT_BATCH_SIZE):
        backend.eval([Span(0, at, tokens[at : at + DEFAULT_BATCH_SIZE])])
    prefill = time.perf_counter() - start
    start = time.perf_counter()
    for at in range(PROMPT_TOKENS, PROMPT_TOKENS + DECODE_TOKENS):
        backend.eval([Span(0, at, tokens[at : at + 1], argmax=True)])
    return prefill, time.perf_counter() - start


def _probe_tokens() -> list[str]:
    return byte_symbols() + ["Ġt", "<|endoftext|>"]  # a BPE vocabulary needs a merge


def _write_probe(path: Path, hp: HParams, weights: Mapping[str, np.ndarray], qtype: QType) -> Path:
    writer = GGUFWriter(path, hp.arch.gguf_arch)
    add_hparams(writer, hp)
    tokens = _probe_tokens()
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types([TokenType.NORMAL] * (len(tokens) - 1) + [TokenType.CONTROL])
    writer.add_token_merges(["Ġ t"])
    writer.add_bos_token_id(len(tokens) - 1)
    writer.add_eos_token_id(len(tokens) - 1)
    for name, values in weights.items():
        if values.ndim == 1:
            writer.add_tensor(name, (values + 1).astype(np.float32))  # norms near 1
        elif name.startswith("blk."):
            writer.add_tensor(name, quantize(values.astype(np.float32), qtype), raw_dtype=qtype)
        else:  # the small head, alike in every probe
            writer.add_tensor(name, values.astype(np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
