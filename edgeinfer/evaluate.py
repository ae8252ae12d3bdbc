"""Perplexity of a model on a text, and how far its next-token distributions are from a base model's.

The convention is llama-perplexity's, so figures compare with llama.cpp's: the text is
tokenized once, cut into chunks of ``ctx`` tokens, each chunk is evaluated from an empty
cache (its first token replaced by BOS when the model adds one), and only the second half
of each chunk is scored, so every scored token has at least ``ctx / 2`` tokens of context.

Against a base model (the unquantized original, or the same model on another backend):
KL divergence KL(base || model) per scored token (mean, median, 99th percentile), how often
both pick the same most likely token, and the change in perplexity.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from time import perf_counter
from typing import Any

import numpy as np

from edgeinfer.engine import Engine
from edgeinfer.errors import InvalidOptionError
from edgeinfer.kv import MIN_KV_TOKENS
from edgeinfer.logits import log_softmax


@dataclass(frozen=True)
class Comparison:
    """How a model's next-token distributions differ from a base model's on the same tokens."""

    base: str
    base_backend: str
    base_perplexity: float
    kld_mean: float
    kld_median: float
    kld_p99: float
    top1_agreement: float  # fraction of scored tokens where both rank the same token first


@dataclass(frozen=True)
class Report:
    """The result of ``evaluate``."""

    model: str
    backend: str
    text_tokens: int
    ctx: int
    chunks: int
    scored_tokens: int
    perplexity: float
    perplexity_stderr: float
    seconds: float
    comparison: Comparison | None = None

    @property
    def delta_perplexity(self) -> float | None:
        return None if self.comparison is None else self.perplexity - self.comparison.base_perplexity

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["delta_perplexity"] = self.delta_perplexity
        return out

    def format(self) -> str:
        rows = [
            ("model", f"{self.model} ({self.backend})"),
            (
                "text",
                f"{self.text_tokens:,} tokens: {self.chunks} chunks of {self.ctx}, {self.scored_tokens:,} scored",
            ),
            ("perplexity", f"{self.perplexity:.4f} ± {self.perplexity_stderr:.4f}"),
        ]
        c = self.comparison
        if c is not None:
            delta = self.perplexity - c.base_perplexity
            rows += [
                ("base", f"{c.base} ({c.base_backend}): perplexity {c.base_perplexity:.4f}"),
                ("Δ perplexity", f"{delta:+.4f} ({delta / c.base_perplexity:+.2%})"),
                ("KLD", f"mean {c.kld_mean:.6f}, median {c.kld_median:.6f}, p99 {c.kld_p99:.6f}"),
                ("top-1 agree", f"{c.top1_agreement:.2%}"),
            ]
        rows.append(("time", f"{self.seconds:.1f} s"))
        width = max(len(name) for name, _ in rows)
        return "\n".join(f"{name:>{width}}: {value}" for name, value in rows)


def evaluate(engine: Engine, text: str, ctx: int = 512, base: Engine | None = None) -> Report:
    """Perplexity of ``engine``'s model on ``text``, and its divergence from ``base`` if given.

    Both engines need a KV capacity of at least ``ctx`` tokens and the same vocabulary.
    """
    start = perf_counter()
    tokens = _chunkable_tokens(engine, text, ctx)
    if base is not None and (
        base.backend.n_vocab != engine.backend.n_vocab or _chunkable_tokens(base, text, ctx) != tokens
    ):
        raise InvalidOptionError(
            "the base model tokenizes the text differently; compare models that share a vocabulary"
        )
    nll: list[np.ndarray] = []
    base_nll: list[np.ndarray] = []
    kld: list[np.ndarray] = []
    agree: list[np.ndarray] = []
    for chunk, targets in _chunks(engine, tokens, ctx):
        logprobs = _scored_logprobs(engine, chunk)
        nll.append(-np.take_along_axis(logprobs, targets[:, None], axis=1)[:, 0])
        if base is not None:
            base_logprobs = _scored_logprobs(base, chunk)
            base_nll.append(-np.take_along_axis(base_logprobs, targets[:, None], axis=1)[:, 0])
            kld.append(np.sum(np.exp(base_logprobs) * (base_logprobs - logprobs), axis=1))
            agree.append(base_logprobs.argmax(axis=1) == logprobs.argmax(axis=1))
    all_nll = np.concatenate(nll)
    ppl, stderr = _perplexity(all_nll)
    comparison = None
    if base is not None:
        all_kld = np.concatenate(kld)
        comparison = Comparison(
            base=base.model_path.name,
            base_backend=base.backend.name,
            base_perplexity=_perplexity(np.concatenate(base_nll))[0],
            kld_mean=float(all_kld.mean()),
            kld_median=float(np.median(all_kld)),
            kld_p99=float(np.percentile(all_kld, 99)),
            top1_agreement=float(np.concatenate(agree).mean()),
        )
    return Report(
        model=engine.model_path.name,
        backend=engine.backend.name,
        text_tokens=len(tokens),
        ctx=ctx,
        chunks=len(nll),
        scored_tokens=len(all_nll),
        perplexity=ppl,
        perplexity_stderr=stderr,
        seconds=perf_counter() - start,
        comparison=comparison,
    )


def _chunkable_tokens(engine: Engine, text: str, ctx: int) -> list[int]:
    if ctx < MIN_KV_TOKENS or ctx > engine.capacity:
        raise InvalidOptionError(
            f"ctx must be {MIN_KV_TOKENS} to {engine.capacity} tokens (the KV capacity), got {ctx}"
        )
    tokens = engine.tokenizer.encode(text, parse_special=False)
    if len(tokens) < ctx:
        raise InvalidOptionError(
            f"the text has {len(tokens)} tokens, fewer than one chunk of {ctx}; give a longer text or a smaller --ctx"
        )
    return tokens


def _chunks(engine: Engine, tokens: list[int], ctx: int) -> Iterator[tuple[list[int], np.ndarray]]:
    """Each chunk as evaluated, and the tokens its second half predicts."""
    first = ctx // 2
    bos = engine.tokenizer.bos_id if engine.tokenizer.add_bos else None
    for start in range(0, len(tokens) - ctx + 1, ctx):
        chunk = tokens[start : start + ctx]
        targets = np.array(chunk[first + 1 :])
        if bos is not None:
            chunk = [bos, *chunk[1:]]
        yield chunk, targets


def _scored_logprobs(engine: Engine, chunk: list[int]) -> np.ndarray:
    """Log-probabilities at the scored positions: ctx/2 .. ctx-2."""
    return log_softmax(engine.logits(chunk)[len(chunk) // 2 : -1])


def _perplexity(nll: np.ndarray) -> tuple[float, float]:
    """Perplexity and its standard error (by the delta method, as llama-perplexity reports it)."""
    mean = float(nll.mean())
    stderr = float(nll.std(ddof=1) / math.sqrt(len(nll))) if len(nll) > 1 else 0.0
    return math.exp(mean), math.exp(mean) * stderr
