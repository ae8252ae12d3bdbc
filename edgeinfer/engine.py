"""The engine: one decode loop, one sampler, one KV policy and one metrics path for every backend.

engine = Engine()                                  # the default model, best backend here
print(engine.chat([{"role": "user", "content": "Hi"}]).text)
for piece in engine.stream("Once upon a time", max_tokens=50):
    print(piece, end="", flush=True)
"""

from __future__ import annotations

import dataclasses
import os
import threading
import weakref
from collections.abc import Generator, Iterator, Sequence
from time import perf_counter
from typing import Any

import numpy as np

from edgeinfer.backends import backend_class
from edgeinfer.backends.base import DEFAULT_BATCH_SIZE, Backend, BackendOptions
from edgeinfer.chat import MAX_CONTENT_CHARS, ChatTemplate, Continuation, Message
from edgeinfer.errors import BackendError, ContextFull, EdgeInferError, InvalidOptionError
from edgeinfer.kv import DEFAULT_KV_BUDGET, MIN_KV_TOKENS, KVBudget, KVPolicy
from edgeinfer.metrics import Metrics
from edgeinfer.models.catalog import DEFAULT_MODEL, resolve_model
from edgeinfer.models.info import ModelInfo, load_model_info
from edgeinfer.sampling import Sampler, SamplingParams
from edgeinfer.streams import AsyncStream, FinishReason, Result, Stream, adrain, drain
from edgeinfer.system import check_memory, default_threads, estimate_memory, usable_cores
from edgeinfer.textstream import TextStream
from edgeinfer.tokenizer import Tokenizer

Prompt = str | Sequence[Message] | Continuation


class Engine:
    """A model loaded on a backend, with a fixed-budget KV cache.

    Args:
        model: a ``.gguf`` path, a catalog alias (``edgeinfer list``) or ``hf:ORG/REPO/FILE.gguf``.
        backend: a backend name, or ``"auto"`` for the best one that runs here.
        kv_budget: the KV cache cap, in bytes (``"64MB"``, or an int) or tokens (``"512tok"``).
        kv_policy: ``"sinks"``, ``"shift"`` or ``"error"`` (see ``KVPolicy``), or a ``KVPolicy``.
        kv_type: KV element type, ``"f16"`` or ``"q8_0"`` where the backend supports it.
        threads: CPU threads; default: the cores that are free right now. More than this
            process may use are capped to them.
        batch_size: prompt tokens evaluated in one step. Prompts are evaluated in chunks
            aligned to multiples of it, and a cached prefix is reused in whole chunks.
        force: load even if the memory estimate says it will not fit.

    One engine serves one generation at a time; calls from other threads wait their turn.

    Greedy output does not depend on what the KV cache held: llama.cpp's arithmetic for a
    position depends on how many tokens one evaluation carries, so the engine computes every
    prompt position in the same aligned chunk as a cold run would, and reuses only cached
    positions that were computed that way (whole prompt chunks, not generated tokens and not
    positions after an eviction), or the whole of the last prompt prefilled, with its saved
    last logits, when it is asked again. The same prompt, options, thread count and llama.cpp build
    give the same logits cold, after another call, after a chat turn and after ``reset()``.
    Another thread count or another build may still round differently.
    """

    def __init__(
        self,
        model: str | os.PathLike[str] = DEFAULT_MODEL,
        *,
        backend: str = "auto",
        kv_budget: str | int | KVBudget = DEFAULT_KV_BUDGET,
        kv_policy: str | KVPolicy = "sinks",
        kv_type: str = "f16",
        threads: int | None = None,
        batch_size: int = DEFAULT_BATCH_SIZE,
        force: bool = False,
    ) -> None:
        backend_cls = backend_class(backend)
        self.kv_budget = KVBudget.parse(kv_budget)
        self.kv_policy = KVPolicy.parse(kv_policy)
        if kv_type not in backend_cls.kv_types:
            raise InvalidOptionError(
                f"KV type {kv_type!r} is not supported by the {backend_cls.name} backend; "
                f"choose one of {', '.join(backend_cls.kv_types)}"
            )
        if threads is not None and threads < 1:
            raise InvalidOptionError(f"threads must be at least 1, got {threads}")
        if batch_size < 1:
            raise InvalidOptionError(f"batch_size must be at least 1, got {batch_size}")
        self.model_path = resolve_model(model)
        self.info: ModelInfo = load_model_info(self.model_path)
        block = backend_cls.kv_block
        wanted = min(
            self.kv_budget.capacity(self.info.kv_bytes_per_token(kv_type), block), self.info.hparams.n_ctx_train
        )
        if wanted < MIN_KV_TOKENS:
            raise InvalidOptionError(f"a KV budget of {wanted} tokens is too small; give at least {MIN_KV_TOKENS}")
        kv_tokens = -(-wanted // block) * block
        weights = backend_cls.weight_bytes(self.info)
        check_memory(estimate_memory(self.info, kv_tokens, kv_type, batch_size, weights), force=force)

        # More threads than cores makes llama.cpp's spinning threads fight: up to 100x slower.
        self.threads = min(threads, usable_cores()) if threads else default_threads()
        self.batch_size = batch_size
        self.kv_type = kv_type
        self.tokenizer = Tokenizer(self.model_path)
        self.template = ChatTemplate(
            self.info.chat_template,
            bos_token=self.tokenizer.token_text(self.tokenizer.bos_id),
            eos_token=self.tokenizer.token_text(self.tokenizer.eos_id),
        )
        self.backend: Backend = backend_cls(
            self.info, BackendOptions(kv_tokens=wanted, kv_type=kv_type, threads=self.threads, batch_size=batch_size)
        )
        self.capacity = min(wanted, self.backend.capacity)
        self._budget_text = self.kv_budget.describe(self.capacity)  # for ContextFull messages
        self._cached: list[int] = []  # the tokens in the backend's KV cache, by position
        # How many leading cached positions were computed in whole aligned prompt chunks, as a
        # cold run computes them: only these are reused (a multiple of batch_size).
        self._exact = 0
        # The last prompt prefilled in full, and its last row of logits: while the cache still holds
        # that prompt, asking it again (a replay, the router's samples) evaluates nothing.
        self._last_prompt: tuple[list[int], np.ndarray] | None = None
        self._lock = threading.Lock()
        self._owner: int | None = None
        self._async_streams: weakref.WeakSet[AsyncStream] = weakref.WeakSet()  # started, for _started_async
        self._async_lock = threading.Lock()
        self._closed = False
        if self.kv_policy.name != "error" and not self.backend.can_shift:
            self.close()
            raise InvalidOptionError(
                f"this model's KV cache cannot shift positions, so the {self.kv_policy.name} policy cannot work; "
                "use --kv-policy error"
            )

    # -- public API ----------------------------------------------------------------------------

    def generate(self, prompt: str, params: SamplingParams | None = None, **options: Any) -> Result:
        """Complete raw ``prompt`` text (no chat template)."""
        return drain(self.stream(prompt, params, **options))

    def chat(self, messages: Sequence[Message], params: SamplingParams | None = None, **options: Any) -> Result:
        """Answer the conversation ``messages`` through the model's chat template."""
        return drain(self.stream(messages, params, **options))

    def stream(self, prompt: Prompt, params: SamplingParams | None = None, **options: Any) -> Stream:
        """Stream text chunks. A string is completed raw; a list of messages is chatted; a
        ``Continuation`` goes on with an assistant answer already begun.

        Sampling options (``max_tokens``, ``temperature``, ``seed``, ``stop``, ...) are the
        fields of ``SamplingParams`` and override ``params``.
        """
        if not isinstance(prompt, (str, Continuation)) and not (
            isinstance(prompt, Sequence) and not isinstance(prompt, bytes)
        ):
            raise InvalidOptionError(f"the prompt must be a string or a list of messages, got {type(prompt).__name__}")
        if params is not None and not isinstance(params, SamplingParams):
            raise InvalidOptionError(f"params must be a SamplingParams, got {type(params).__name__}")
        params = params or SamplingParams()
        if options:
            unknown = set(options) - {f.name for f in dataclasses.fields(SamplingParams)}
            if unknown:
                raise InvalidOptionError(
                    f"unknown sampling option {', '.join(sorted(unknown))}; see SamplingParams for the options"
                )
            params = dataclasses.replace(params, **options)
        cancel = threading.Event()
        logprobs: list[float] = []
        entropies: list[float] = []
        return Stream(self._run(prompt, params, cancel, logprobs, entropies), cancel, logprobs, entropies)

    async def agenerate(self, prompt: str, params: SamplingParams | None = None, **options: Any) -> Result:
        """Async ``generate``; cancelling the awaiting task cancels the generation."""
        return await adrain(self.astream(prompt, params, **options))

    async def achat(self, messages: Sequence[Message], params: SamplingParams | None = None, **options: Any) -> Result:
        """Async ``chat``; cancelling the awaiting task cancels the generation."""
        return await adrain(self.astream(messages, params, **options))

    def astream(self, prompt: Prompt, params: SamplingParams | None = None, **options: Any) -> AsyncStream:
        """Async ``stream``: ``async for piece in engine.astream(...)``."""
        return AsyncStream(self.stream(prompt, params, **options), on_start=self._started_async)

    def _started_async(self, stream: AsyncStream) -> None:
        """A task whose new stream starts has left its earlier unfinished one: cancel that one."""
        with self._async_lock:  # event loops in several threads may share the engine
            for earlier in list(self._async_streams):
                if stream.owner is not None and earlier.owner is stream.owner and not earlier.finished:
                    earlier.cancel()
            self._async_streams.add(stream)

    def render(self, messages: Sequence[Message]) -> str:
        """The prompt text the chat template makes of ``messages``."""
        return self.template.render(messages)

    def tokenize(self, prompt: Prompt) -> list[int]:
        """The token ids the engine feeds the model for ``prompt``."""
        if isinstance(prompt, str):
            if len(prompt) > MAX_CONTENT_CHARS:
                raise InvalidOptionError(
                    f"the prompt is {len(prompt):,} characters, over the limit of {MAX_CONTENT_CHARS:,}; shorten it"
                )
            return self.tokenizer.encode(prompt)
        if isinstance(prompt, Continuation):
            messages: list[Message] = [*prompt.messages, {"role": "assistant", "content": prompt.answer}]
            text = self.template.render(messages, add_generation_prompt=False)
            spans = self.template.content_spans(messages, text, add_generation_prompt=False)
            if spans is None:
                raise InvalidOptionError(
                    "this model's chat template rewrites message text, so an answer cannot be continued"
                )
            text = text[: max(end for _, end in spans)]  # the answer's turn stays open
            literal = spans if self._has_markers(messages) else None
        else:
            messages, text = list(prompt), self.render(prompt)
            literal = self._literal_spans(messages, text) if self._has_markers(messages) else None
        bos = self.tokenizer.token_text(self.tokenizer.bos_id)
        # A template that writes BOS itself must not get a second one.
        return self.tokenizer.encode(text, add_special=not (bos and text.startswith(bos)), literal=literal or ())

    def _has_markers(self, messages: Sequence[Message]) -> bool:
        """Whether message content spells a control token, in one message or across neighbours.

        One check of the contents joined covers both: a marker inside one content is inside the join.
        """
        return self.tokenizer.has_markers("".join(m["content"] for m in messages))

    def _literal_spans(self, messages: Sequence[Message], text: str) -> list[tuple[int, int]]:
        """Where message content stands in ``text``, to be tokenized as text whatever control tokens it spells.

        Only the template's own markup may open or close a turn, so no message can forge a system turn.
        """
        spans = self.template.content_spans(messages, text)
        if spans is None:
            raise InvalidOptionError(
                "a message contains control-token text such as '<|im_end|>', and this model's chat template "
                "rewrites message text, so it cannot be kept as plain text; remove it"
            )
        return spans

    def logits(self, tokens: Sequence[int]) -> np.ndarray:
        """The ``(len(tokens), n_vocab)`` logits of every position, from an empty cache (for scoring).

        The cache is left empty afterwards, so the next generation starts cold.
        """
        if not 0 < len(tokens) <= self.capacity:
            raise InvalidOptionError(
                f"can score 1 to {self.capacity} tokens at once (the KV capacity), got {len(tokens)}"
            )
        with self._hold():
            self._forget(0)
            try:
                return np.array(self.backend.eval(tokens, 0, all_logits=True), dtype=np.float32)
            finally:
                self.backend.truncate(0)

    def prompt_logprobs(self, prompt: Prompt, start: int = 1) -> list[float]:
        """The log-probability of each prompt token from index ``start`` on, given the tokens before it.

        Their mean is minus the log-perplexity: how familiar the prompt looks to the model.
        The prompt stays in the KV cache, so a following call on it only evaluates its last chunk.
        Raises ``ContextFull`` if the prompt alone does not fit in the cache.
        """
        with self._hold():
            tokens = self.tokenize(prompt)
            if len(tokens) > self.capacity:
                raise ContextFull(
                    f"the prompt has {len(tokens)} tokens, more than the KV budget of {self._budget_text}"
                )
            start = max(1, min(start, len(tokens)))
            # Row i of the logits predicts token i + 1, so scoring from ``start`` evaluates from ``start - 1``.
            first = self._reuse(tokens, start - 1)
            scores: list[float] = []
            try:
                for chunk_start, rows in self._prefill(tokens, first, rows_from=start - 1):
                    if rows.ndim == 1:  # a chunk before the scored tokens: only its last row came back
                        continue
                    for offset, row in enumerate(rows):
                        position = chunk_start + offset
                        if start - 1 <= position < len(tokens) - 1:
                            scores.append(float(row[tokens[position + 1]]) - _logsumexp(row))
            except BaseException:
                self._forget(0)
                raise
            return scores

    def reset(self) -> None:
        """Forget the cached conversation."""
        with self._hold():
            self._forget(0)

    @property
    def kv_used(self) -> int:
        """Tokens in the KV cache now."""
        return len(self._cached)

    @property
    def cached_tokens(self) -> list[int]:
        """A copy of the token ids in the KV cache, by position."""
        return list(self._cached)

    def close(self) -> None:
        """Free the model now; waits for a generation running in another thread."""
        if self._closed:
            return
        with self._hold():
            self._closed = True
            self.backend.close()
            self.tokenizer.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the decode loop -----------------------------------------------------------------------

    def _run(
        self,
        prompt: Prompt,
        params: SamplingParams,
        cancel: threading.Event,
        logprobs: list[float],
        entropies: list[float],
    ) -> Generator[str, None, Result]:
        start = perf_counter()  # TTFT counts any wait for another generation to finish
        with self._hold():
            m = Metrics(kv_capacity=self.capacity)
            t = perf_counter()
            tokens = self.tokenize(prompt)
            m.tokenize_s = perf_counter() - t
            if not tokens:
                raise InvalidOptionError("the prompt is empty: give the model some text to continue")
            try:
                result = yield from self._decode(tokens, params, cancel, m, start, logprobs, entropies)
            except (ContextFull, GeneratorExit):
                raise
            except BaseException:
                # A backend that failed mid-evaluation may hold a partial batch: start clean.
                self._forget(0)
                raise
            return result

    def _decode(
        self,
        prompt: list[int],
        params: SamplingParams,
        cancel: threading.Event,
        m: Metrics,
        start: float,
        logprobs: list[float],
        entropies: list[float],
    ) -> Generator[str, None, Result]:
        cached, backend, tokenizer = self._cached, self.backend, self.tokenizer
        sampler = Sampler(params)
        text = TextStream(params.stop)
        reserve = min(params.max_tokens, self.capacity // 4)
        fitted = self.kv_policy.fit_prompt(
            prompt, self.capacity, reserve, has_bos=tokenizer.add_bos, budget=self._budget_text
        )
        m.prompt_tokens, m.prompt_cut = len(fitted), len(prompt) - len(fitted)
        prompt = fitted

        # Reuse the cached prefix (a chat's earlier turns). The first new token is drawn from the
        # last prompt token's logits: saved if this prompt was the last one prefilled, else evaluated.
        t = perf_counter()
        logits: np.ndarray | None = None  # stays None only if cancelled before the first chunk
        if self._last_prompt is not None and self._last_prompt[0] == prompt:
            self._forget(len(prompt))  # drop the answer that followed it
            logits = self._last_prompt[1]
            m.cached_tokens = len(prompt)
        else:
            m.cached_tokens = self._reuse(prompt, len(prompt) - 1)
            # Prefill a chunk at a time, so a cancel waits for one chunk, not the whole prompt.
            for _, chunk_logits in self._prefill(prompt, m.cached_tokens, cancel=cancel):
                logits = chunk_logits
            if logits is not None and len(cached) == len(prompt):
                self._last_prompt = (list(prompt), np.array(logits))
        m.prefill_s = perf_counter() - t
        if logits is not None and not np.isfinite(logits).all():
            raise BackendError(
                f"{self.model_path.name} produced NaN or infinite logits: its weights are corrupt; re-download it"
            )

        output: list[int] = []
        finish: FinishReason = "length"
        try:
            while True:
                if logits is None or cancel.is_set():
                    finish = "cancelled"
                    break
                t = perf_counter()
                token = sampler(logits, cached)
                logprob, entropy = _confidence(logits, token)  # the router's signals
                t_sampled = perf_counter()
                m.sample_s += t_sampled - t
                if not output:
                    m.ttft_s = t_sampled - start
                if not params.ignore_eos and tokenizer.is_end_of_generation(token):
                    finish = "stop"
                    break
                output.append(token)
                m.token_times_s.append(t_sampled - start)
                logprobs.append(logprob)
                entropies.append(entropy)
                t = perf_counter()
                chunk = text.push(tokenizer.piece(token))
                m.detokenize_s += perf_counter() - t
                if chunk:
                    yield chunk
                if text.stopped:
                    finish = "stop"
                    break
                if len(output) >= params.max_tokens:
                    break
                if len(cached) + 1 > self.capacity:
                    self._make_room(1, m)
                t = perf_counter()
                logits = backend.eval((token,), len(cached))
                cached.append(token)
                m.decode_s += perf_counter() - t
        except ContextFull as exc:
            raise ContextFull(str(exc), partial=text.text) from None
        tail = text.flush()
        if tail:
            yield tail
        m.output_tokens = len(output)
        m.total_s = perf_counter() - start
        m.kv_used = len(cached)
        return Result(
            text.text, output, finish, m, self.model_path.name, backend.name, logprobs=logprobs, entropies=entropies
        )

    def _make_room(self, n_incoming: int, m: Metrics) -> None:
        start, end = self.kv_policy.eviction(
            len(self._cached),
            n_incoming,
            self.capacity,
            has_bos=self.tokenizer.add_bos,
            budget=self._budget_text,
        )
        self.backend.evict(start, end)
        del self._cached[start:end]
        # Shifted positions were re-rotated, not computed as a cold run computes them.
        self._exact = min(self._exact, start // self.batch_size * self.batch_size)
        self._last_prompt = None
        m.kv_evicted += end - start

    # -- the prompt cache ----------------------------------------------------------------------

    def _reuse(self, tokens: Sequence[int], limit: int) -> int:
        """Keep the longest cached prefix of ``tokens`` (at most ``limit``) that a cold run would compute alike.

        That is a whole number of aligned chunks, all computed as prompt chunks. Returns its length.
        """
        reuse = min(_common_prefix(self._cached, tokens), limit, self._exact)
        self._forget(reuse // self.batch_size * self.batch_size)
        return len(self._cached)

    def _forget(self, n: int) -> None:
        """Drop cached positions from ``n`` on."""
        self.backend.truncate(n)
        del self._cached[n:]
        self._exact = min(self._exact, n)
        if self._last_prompt is not None and n < len(self._last_prompt[0]):
            self._last_prompt = None

    def _prefill(
        self,
        tokens: Sequence[int],
        first: int,
        *,
        cancel: threading.Event | None = None,
        rows_from: int | None = None,
    ) -> Iterator[tuple[int, np.ndarray]]:
        """Evaluate ``tokens[first:]`` in chunks aligned to multiples of ``batch_size``; yield each chunk's logits.

        ``first`` must be the number of cached positions, a chunk boundary. A chunk that
        reaches ``rows_from`` yields every row's logits, any other only its last row's.
        Stops between chunks once ``cancel`` is set.
        """
        size = self.batch_size
        for start in range(first, len(tokens), size):
            if cancel is not None and cancel.is_set():
                return
            chunk = tokens[start : start + size]
            all_rows = rows_from is not None and start + len(chunk) > rows_from
            logits = self.backend.eval(chunk, start, all_logits=all_rows)
            self._cached.extend(chunk)
            if len(chunk) == size and self._exact == start:
                self._exact = start + size
            yield start, logits

    def _hold(self) -> _EngineLock:
        return _EngineLock(self)


class _EngineLock:
    """The engine's lock, which refuses re-entry from its own thread instead of deadlocking."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine

    def __enter__(self) -> None:
        engine = self._engine
        if engine._owner == threading.get_ident():
            raise EdgeInferError(
                "this engine is already generating in this thread; finish or close the other stream first"
            )
        engine._lock.acquire()
        if engine._closed:
            engine._lock.release()
            raise EdgeInferError("this engine is closed; create a new Engine")
        engine._owner = threading.get_ident()

    def __exit__(self, *exc: object) -> None:
        self._engine._owner = None
        self._engine._lock.release()


def _confidence(logits: np.ndarray, token: int) -> tuple[float, float]:
    """The log-probability of ``token`` and the entropy (nats) of the softmax of ``logits``, in one pass."""
    below = logits.max() - logits  # >= 0, so exp() cannot overflow
    weights = np.exp(-below)
    total = float(weights.sum(dtype=np.float64))
    log_total = float(np.log(total))
    # With p = weights / total: log p(token) = -below[token] - log(total); H = sum(p * below) + log(total).
    return -float(below[token]) - log_total, float(weights @ below) / total + log_total


def _logsumexp(logits: np.ndarray) -> float:
    top = float(logits.max())
    return top + float(np.log(np.exp(logits - top).sum(dtype=np.float64)))


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
