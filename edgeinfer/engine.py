"""The engine: one decode loop, one sampler, one KV policy and one metrics path for every backend.

engine = Engine()                                  # the default model, best backend here
print(engine.chat([{"role": "user", "content": "Hi"}]).text)
for piece in engine.stream("Once upon a time", max_tokens=50):
    print(piece, end="", flush=True)
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import threading
import weakref
from collections.abc import Generator, Iterator, Sequence
from time import perf_counter
from typing import Any

import numpy as np

from edgeinfer.backends import choose_backend
from edgeinfer.backends.base import (
    ARGMAX_NOT_FINITE,
    CPU,
    DEFAULT_BATCH_SIZE,
    Backend,
    BackendOptions,
    Span,
    check_options,
)
from edgeinfer.chat import CHATML_MARKER, MAX_CONTENT_CHARS, ChatTemplate, Continuation, Message
from edgeinfer.errors import BackendError, ContextFull, EdgeInferError, InvalidOptionError
from edgeinfer.kv import DEFAULT_KV_BUDGET, MIN_KV_TOKENS, KVBudget, KVPolicy
from edgeinfer.logits import confidence, token_logprobs
from edgeinfer.metrics import Metrics
from edgeinfer.models.catalog import DEFAULT_MODEL, resolve_model
from edgeinfer.models.info import ModelInfo, load_model_info
from edgeinfer.sampling import Sampler, SamplingParams, sampling_params
from edgeinfer.sequences import CachedSequence, SequenceCache
from edgeinfer.streams import AsyncStream, FinishReason, Result, Stream, adrain, drain
from edgeinfer.system import check_memory, thread_count
from edgeinfer.textstream import TextStream
from edgeinfer.tokenizer import Tokenizer

log = logging.getLogger("edgeinfer.engine")

Prompt = str | Sequence[Message] | Continuation
# Sequences an engine keeps by default: a few conversations cached side by side, and the width of
# generate_batch (the router's four samples). With llama.cpp's unified cache they cost no memory
# beyond the one KV budget.
DEFAULT_SEQUENCES = 4


class Engine:
    """A model loaded on a backend, with a fixed-budget KV cache.

    Args:
        model: a ``.gguf`` path, a catalog alias (``edgeinfer list``) or ``hf:ORG/REPO/FILE.gguf``.
        backend: a backend name, or ``"auto"`` for the first that runs here and supports the model.
        kv_budget: the KV cache cap, in bytes (``"64MB"``, or an int) or tokens (``"512tok"``): one
            total across all sequences.
        kv_policy: ``"sinks"``, ``"shift"`` or ``"error"`` (see ``KVPolicy``), or a ``KVPolicy``. Default:
            ``sinks``, or ``error`` for a model whose cache cannot drop old tokens (recurrent layers),
            with a warning logged.
        kv_type: KV element type, ``"f16"`` or ``"q8_0"`` where the backend supports it.
        threads: CPU threads; default: the cores that are free right now. More than this
            process may use are capped to them.
        batch_size: prompt tokens evaluated in one step. Prompts are evaluated in chunks
            aligned to multiples of it, and a cached prefix is reused in whole chunks.
        sequences: KV sequences the backend keeps: conversations cached side by side (a new
            conversation that shares a system prompt with a cached one copies its KV instead of
            recomputing it), and how many answers ``generate_batch`` decodes together.
        device: where the backend runs (``"cpu"``, or a GPU its ``devices()`` lists).
        gpu_layers: layers placed on ``device`` when it is a GPU (-1, the default: all).
        force: load even if the memory estimate says it will not fit.

    One engine serves one generation at a time; calls from other threads wait their turn.

    Greedy output does not depend on what the KV cache held: llama.cpp's arithmetic for a
    position depends on how many tokens one evaluation carries, so the engine computes every
    prompt position in the same aligned chunk as a cold run would, and reuses only cached
    positions that were computed that way (whole prompt chunks, not generated tokens and not
    positions after an eviction), or the whole of the last prompt prefilled, with its saved
    last logits, when it is asked again. The same prompt, options, thread count and llama.cpp build
    give the same logits cold, after another call, after a chat turn and after ``reset()``.
    Another thread count or another build may still round differently, and so may a conversation
    that shares a cached one's prefix, whose cells llama.cpp places after the other's; a prompt that
    shares nothing reusable empties the pool first, and ``sequences=1`` rules the case out.
    """

    def __init__(
        self,
        model: str | os.PathLike[str] = DEFAULT_MODEL,
        *,
        backend: str = "auto",
        kv_budget: str | int | KVBudget = DEFAULT_KV_BUDGET,
        kv_policy: str | KVPolicy | None = None,
        kv_type: str = "f16",
        threads: int | None = None,
        batch_size: int = DEFAULT_BATCH_SIZE,
        sequences: int = DEFAULT_SEQUENCES,
        device: str = CPU,
        gpu_layers: int = -1,
        force: bool = False,
    ) -> None:
        self.kv_budget = KVBudget.parse(kv_budget)
        self.kv_policy = KVPolicy.parse(kv_policy or "sinks")
        for name, value in (("batch_size", batch_size), ("sequences", sequences)):
            if value < 1:
                raise InvalidOptionError(f"{name} must be at least 1, got {value}")
        self.model_path = resolve_model(model)
        self.info: ModelInfo = load_model_info(self.model_path)
        self.threads = thread_count(threads)
        requested = BackendOptions(
            kv_tokens=0,
            kv_type=kv_type,
            threads=self.threads,
            batch_size=batch_size,
            n_seq=sequences,
            device=device,
            gpu_layers=gpu_layers,
        )

        def loading(cls: type[Backend]) -> BackendOptions:
            """The options ``cls`` would load the model with: its device by name, the budget in its cells."""
            options = check_options(cls, requested)
            wanted = min(
                self.kv_budget.capacity(cls.kv_bytes_per_token(self.info, kv_type), cls.kv_block),
                self.info.hparams.n_ctx_train,
            )
            return dataclasses.replace(options, kv_tokens=wanted)

        backend_cls = choose_backend(backend, self.info, loading)
        options = loading(backend_cls)
        if options.kv_tokens < MIN_KV_TOKENS:
            raise InvalidOptionError(
                f"a KV budget of {options.kv_tokens} tokens is too small; give at least {MIN_KV_TOKENS}"
            )
        check_memory(backend_cls.memory(self.info, options), force=force)

        self.batch_size = batch_size
        self.kv_type = kv_type
        self.tokenizer = Tokenizer(self.model_path)
        self.template = ChatTemplate(
            self.info.chat_template,
            bos_token=self.tokenizer.token_text(self.tokenizer.bos_id),
            eos_token=self.tokenizer.token_text(self.tokenizer.eos_id),
            chatml=self.tokenizer.has_markers(CHATML_MARKER),
        )
        self.backend: Backend = backend_cls(self.info, options)
        self.capacity = min(options.kv_tokens, self.backend.capacity)
        self._budget_text = self.kv_budget.describe(self.capacity)  # for ContextFull messages
        self._cache = SequenceCache(self.backend, batch_size, self.capacity)
        self._calls = 0  # counts calls, to find the least recently used sequence
        self._lock = threading.Lock()
        self._owner: int | None = None
        self._async_streams: weakref.WeakSet[AsyncStream] = weakref.WeakSet()  # started, for _started_async
        self._async_lock = threading.Lock()
        self._closed = False
        if self.kv_policy.name != "error" and not self.backend.can_shift:
            reason = f"{self.info.name}'s cache cannot drop old tokens ({self._unshiftable_why()})"
            if kv_policy is not None:
                self.close()
                raise InvalidOptionError(
                    f"{reason}, so the {self.kv_policy.name} policy cannot work; use --kv-policy error"
                )
            log.warning("%s: a full cache ends the answer (KV policy error)", reason)
            self.kv_policy = KVPolicy("error")

    def _unshiftable_why(self) -> str:
        if self.info.hparams.recurrent:
            return "its recurrent layers keep a state, not one entry per token"
        return f"the {self.backend.name} backend cannot shift its positions"

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
        _check_prompt(prompt)
        params = self._with_template_stops(prompt, sampling_params(params, options))
        cancel = threading.Event()
        generation = _Generation(params)
        chunks = self._run(prompt, [generation], cancel)
        return Stream(chunks, cancel, generation.logprobs, generation.entropies, generation.output)

    def generate_batch(
        self, prompt: Prompt, params: Sequence[SamplingParams], *, cancel: threading.Event | None = None
    ) -> list[Result]:
        """One answer to ``prompt`` per entry of ``params``, decoded together as parallel sequences.

        The prompt is evaluated once; the other sequences share its KV. Up to ``sequences``
        answers are decoded in one step, more in turns; fewer when their prompt and
        ``max_tokens`` would not fit the KV budget side by side. Setting ``cancel`` stops
        them all after the current token (``finish_reason == "cancelled"``).
        """
        _check_prompt(prompt)
        if not params or not all(isinstance(p, SamplingParams) for p in params):
            raise InvalidOptionError("generate_batch needs a list of one or more SamplingParams")
        cancel = cancel or threading.Event()
        generations = [_Generation(self._with_template_stops(prompt, p)) for p in params]
        drain(Stream(self._run(prompt, generations, cancel), cancel))
        return [g.result for g in generations]  # type: ignore[misc]  # each set once the run ends

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

    def _with_template_stops(self, prompt: Prompt, params: SamplingParams) -> SamplingParams:
        """A chat also stops where the template says an answer ends (a base model's transcript)."""
        if isinstance(prompt, str) or not self.template.stops:
            return params
        return dataclasses.replace(params, stop=params.stop + self.template.stops)

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

        The whole pool is emptied first, so the positions fill the cells a cold run does and the scores
        do not depend on what was cached (llama.cpp rounds by cell placement). It is left empty.
        """
        if not 0 < len(tokens) <= self.capacity:
            raise InvalidOptionError(
                f"can score 1 to {self.capacity} tokens at once (the KV capacity), got {len(tokens)}"
            )
        with self._hold():
            for seq in range(len(self._cache.sequences)):
                self._cache.forget(seq, 0)
            try:
                (rows,) = self.backend.eval([Span(0, 0, tokens, all_logits=True)])
                return np.array(rows, dtype=np.float32)
            finally:
                self.backend.truncate(0, 0)

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
            seq = self._claim(tokens, start - 1)
            self._cache.drop_others([seq], len(tokens) - len(self._cache.sequences[seq].tokens))
            scores: list[float] = []
            try:
                for chunk_start, rows in self._prefill(seq, tokens, rows_from=start - 1):
                    if rows.ndim == 1:  # a chunk before the scored tokens: only its last row came back
                        continue
                    first = max(start - 1, chunk_start)
                    last = min(len(tokens) - 1, chunk_start + len(rows))
                    if first < last:
                        picked = rows[first - chunk_start : last - chunk_start]
                        scores.extend(token_logprobs(picked, tokens[first + 1 : last + 1]).tolist())
            except BaseException:
                self._cache.forget(seq, 0)
                raise
            return scores

    def reset(self) -> None:
        """Forget every cached conversation."""
        with self._hold():
            for seq in range(len(self._cache.sequences)):
                self._cache.forget(seq, 0)

    @property
    def kv_used(self) -> int:
        """KV cells in use now, across all sequences (a shared prefix counts once)."""
        return self._cache.cells_used()

    @property
    def cached_tokens(self) -> list[int]:
        """A copy of the token ids the last call left in the KV cache, by position."""
        return list(max(self._cache.sequences, key=lambda s: s.used_at).tokens)

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
        self, prompt: Prompt, generations: list[_Generation], cancel: threading.Event
    ) -> Generator[str, None, Result]:
        """Answer ``prompt`` once per generation; yields the text of the first (the only one, for ``stream``)."""
        start = perf_counter()  # TTFT counts any wait for another generation to finish
        with self._hold():
            t = perf_counter()
            tokens = self.tokenize(prompt)
            tokenize_s = perf_counter() - t
            if not tokens:
                raise InvalidOptionError("the prompt is empty: give the model some text to continue")
            for generation in generations:
                generation.metrics = Metrics(kv_capacity=self.capacity, tokenize_s=tokenize_s)
            try:
                for wave in self._waves(tokens, generations):
                    yield from self._decode(tokens, wave, cancel, start)
            except (ContextFull, GeneratorExit):
                raise
            except BaseException:
                # A backend that failed mid-evaluation may hold a partial batch: start clean.
                for seq in range(len(self._cache.sequences)):
                    self._cache.forget(seq, 0)
                raise
        return generations[0].result  # type: ignore[return-value]  # set by _decode

    def _waves(self, prompt: list[int], generations: list[_Generation]) -> Iterator[list[_Generation]]:
        """The generations in groups decoded together: as many as there are sequences and as fit side by side."""
        longest = max(g.params.max_tokens for g in generations)
        # Each answer takes its own cells; where the backend copies a prompt rather than sharing it, its copy too.
        side_by_side = max(1, (self.capacity - len(prompt)) // (longest + self._cache.copy_cost(len(prompt))))
        size = min(len(self._cache.sequences), side_by_side)
        for first in range(0, len(generations), size):
            yield generations[first : first + size]

    def _decode(
        self, prompt: list[int], generations: list[_Generation], cancel: threading.Event, start: float
    ) -> Generator[str, None, None]:
        lead = generations[0]
        reserve = min(lead.params.max_tokens, self.capacity // 4)
        fitted = self.kv_policy.fit_prompt(
            prompt, self.capacity, reserve, has_bos=self.tokenizer.add_bos, budget=self._budget_text
        )
        prompt_cut = len(prompt) - len(fitted)
        prompt = fitted

        # Reuse a cached prefix (a chat's earlier turns, a shared system prompt). The first new token is drawn
        # from the last prompt token's logits: saved if this prompt was the last one prefilled there, else evaluated.
        t = perf_counter()
        seq = self._claim(prompt, len(prompt) - 1, replay=True)
        state = self._cache.sequences[seq]
        logits: np.ndarray | None = None  # stays None if cancelled before the prompt's last chunk
        if state.last_prompt == prompt:
            self._cache.forget(seq, len(prompt))  # drop the answer that followed it (all, on a recurrent model)
        copies = (len(generations) - 1) * self._cache.copy_cost(len(prompt))  # the other answers' prompts
        if state.last_prompt == prompt:
            logits, cached = state.last_logits, len(prompt)
            if copies:
                self._cache.drop_others([seq], len(generations) * reserve + copies)
        else:
            cached = len(state.tokens)
            self._cache.drop_others([seq], len(prompt) - cached + len(generations) * reserve + copies)
            # Prefill a chunk at a time, so a cancel waits for one chunk, not the whole prompt.
            for _, chunk_logits in self._prefill(seq, prompt, cancel=cancel):
                logits = chunk_logits
            if len(state.tokens) < len(prompt):  # cancelled mid-prefill: every answer ends before its first token
                logits = None
            elif logits is not None:
                state.last_prompt, state.last_logits = list(prompt), np.array(logits)
        prefill_s = perf_counter() - t
        if logits is not None and not np.isfinite(logits).all():
            raise _corrupt(self.model_path.name)
        seqs = [seq]
        for _ in generations[1:]:
            seqs.append(self._spare_sequence(seqs))
        for other, generation in zip(seqs, generations, strict=True):
            if other != seq and logits is not None:
                self._cache.share(seq, other, len(prompt))
            m = generation.metrics
            m.prompt_tokens, m.prompt_cut, m.cached_tokens, m.prefill_s = len(prompt), prompt_cut, cached, prefill_s
            generation.start(other, logits, self._cache.sequences[other], self.model_path.name)
        try:
            yield from self._decode_steps(generations, cancel, start)
        except ContextFull as exc:
            raise ContextFull(str(exc), partial=lead.text.text) from None
        if len(generations) == 1:
            tail = lead.text.flush()
            if tail:
                yield tail
        for generation in generations:
            generation.finish(self, perf_counter() - start)
        if len(generations) > 1:
            # Answers decoded together are not conversations to go on with: free their cells and keep the
            # prompt. Freed, the cells after the prompt are where a cold run puts the next answer's tokens,
            # so the answer that usually follows (the router's, after its samples) is the cold answer.
            for generation in generations:
                self._cache.forget(generation.seq, len(prompt) if generation.seq == seq else 0)

    def _decode_steps(
        self, generations: list[_Generation], cancel: threading.Event, start: float
    ) -> Generator[str, None, None]:
        """Sample a token for every running generation, then evaluate them all in one step, until all end."""
        streaming = len(generations) == 1
        running = list(generations)
        tokenizer, backend = self.tokenizer, self.backend
        while running:
            stepping = []
            for generation in running:
                if generation.logits is None or cancel.is_set():
                    generation.finish_reason = "cancelled"
                    continue
                token = generation.sample(tokenizer, start)
                if streaming and generation.chunk:
                    yield generation.chunk
                if generation.finish_reason is None:
                    stepping.append((generation, token))
            running = [generation for generation, _ in stepping]
            if not running:
                return
            self._make_room(running)
            spans = [Span(g.seq, len(g.state.tokens), (token,), argmax=g.params.argmax_only) for g, token in stepping]
            t = perf_counter()
            rows = backend.eval(spans)
            elapsed = perf_counter() - t
            for span, generation, row in zip(spans, running, rows, strict=True):
                self._cache.append(span.seq, span.tokens)
                generation.logits = row
                generation.metrics.decode_s += elapsed

    def _make_room(self, running: list[_Generation]) -> None:
        """Free a cell for each running generation's next token: other sequences' first; then, for one
        generation, the KV policy's."""
        n_incoming = len(running)
        if self._cache.has_room(n_incoming):
            return
        self._cache.drop_others([g.seq for g in running], n_incoming)
        free = self.capacity - self._cache.cells_used()
        if free >= n_incoming:
            return
        if len(running) > 1:  # _waves fits parallel answers side by side; only a shrunken budget gets here
            raise ContextFull(f"{len(running)} answers decoded together outgrew the KV budget ({self._budget_text})")
        generation = running[0]
        evict_from, evict_to = self.kv_policy.eviction(
            len(generation.state.tokens),
            n_incoming,
            len(generation.state.tokens) + free,
            has_bos=self.tokenizer.add_bos,
            budget=self._budget_text,
        )
        self._cache.evict(generation.seq, evict_from, evict_to)
        generation.metrics.kv_evicted += evict_to - evict_from

    # -- the prompt cache ----------------------------------------------------------------------

    def _claim(self, tokens: Sequence[int], limit: int, *, replay: bool = False) -> int:
        """The sequence to evaluate ``tokens`` in, already holding as much of them as can be reused.

        The one holding the longest reusable prefix (at most ``limit``), or with ``replay`` the one that
        last prefilled exactly ``tokens`` (its saved logits stand for their evaluation). If it holds
        another conversation, which ``tokens`` do not continue, that one stays cached and the prefix
        is shared into a spare sequence.
        """
        self._calls += 1
        sequences = self._cache.sequences
        if replay:
            asked = list(tokens)
            for seq, state in enumerate(sequences):
                if state.last_prompt == asked:
                    state.used_at = self._calls
                    return seq
        reuse = [state.reusable(tokens, limit, self.batch_size) for state in sequences]
        best = max(range(len(sequences)), key=lambda s: (reuse[s], sequences[s].used_at))
        if reuse[best] == 0:
            # Nothing cached helps: start from an empty pool, so the prompt's cells are the ones a cold
            # run fills and its answer is the cold answer (llama.cpp rounds by cell placement).
            for other in range(len(sequences)):
                self._cache.forget(other, 0)
            sequences[best].used_at = self._calls
            return best
        held = sequences[best].last_prompt
        # A sequence without a last prompt (scored, sampled, or evicted from) holds nothing a later call could
        # reuse beyond what this one does, so it is overwritten in place, cell for cell as a cold run fills them.
        if held is None or list(tokens[: len(held)]) == held or len(sequences) == 1:
            seq = best
            self._cache.forget(seq, reuse[best])
        else:  # another conversation: keep it, and share what is common
            seq = self._spare_sequence([best])
            self._cache.forget(seq, 0)
            cost = self._cache.copy_cost(reuse[best])
            self._cache.drop_others([best, seq], cost)
            if reuse[best] and self._cache.capacity - self._cache.cells_used() >= cost:  # else computed afresh
                self._cache.share(best, seq, reuse[best])
        sequences[seq].used_at = self._calls
        return seq

    def _spare_sequence(self, taken: Sequence[int]) -> int:
        """An empty sequence not in ``taken``, else the least recently used one (emptied by the caller)."""
        free = [s for s in range(len(self._cache.sequences)) if s not in taken]
        state = self._cache.sequences
        return min(free, key=lambda s: (bool(state[s].tokens), state[s].used_at))

    def _prefill(
        self,
        seq: int,
        tokens: Sequence[int],
        *,
        cancel: threading.Event | None = None,
        rows_from: int | None = None,
    ) -> Iterator[tuple[int, np.ndarray]]:
        """Evaluate ``tokens`` past what ``seq`` holds, in chunks aligned to multiples of ``batch_size``; yield each
        chunk's logits.

        What ``seq`` holds must end on a chunk boundary. A chunk that reaches ``rows_from`` yields
        every row's logits, any other only its last row's. Stops between chunks once ``cancel`` is set.
        """
        size = self.batch_size
        for first in range(len(self._cache.sequences[seq].tokens), len(tokens), size):
            if cancel is not None and cancel.is_set():
                return
            chunk = tokens[first : first + size]
            all_rows = rows_from is not None and first + len(chunk) > rows_from
            (logits,) = self.backend.eval([Span(seq, first, chunk, all_logits=all_rows)])
            self._cache.append(seq, chunk, exact_chunk=len(chunk) == size)
            yield first, logits

    def _hold(self) -> _EngineLock:
        return _EngineLock(self)


class _Generation:
    """One answer in the decode loop: its sampler, text, metrics and sequence."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self.sampler = Sampler(params)
        self.text = TextStream(params.stop)
        self.output: list[int] = []
        self.logprobs: list[float] = []
        self.entropies: list[float] = []
        self.metrics = Metrics()
        self.finish_reason: FinishReason | None = None
        self.chunk = ""
        self.result: Result | None = None

    def start(self, seq: int, logits: np.ndarray | None, state: CachedSequence, model_name: str) -> None:
        self.seq, self.logits, self.state, self.model_name = seq, logits, state, model_name

    def sample(self, tokenizer: Tokenizer, start: float) -> int:
        """Draw the next token. Sets ``chunk``, the text it adds, and ``finish_reason`` when the answer ends."""
        m, params, logits = self.metrics, self.params, self.logits
        t = perf_counter()
        if logits.ndim == 0:  # the backend's own argmax of the row (Span.argmax)
            token = int(logits)
            if token == ARGMAX_NOT_FINITE:
                raise _corrupt(self.model_name)
        else:
            try:
                token = self.sampler(logits, self.state.tokens)
            except ValueError:  # the sampler refuses a row whose largest logit is NaN or infinite
                if not np.isfinite(logits).all():
                    raise _corrupt(self.model_name) from None
                raise
            if not math.isfinite(logits[token]):  # a NaN wins the argmax: one look instead of a pass over the row
                raise _corrupt(self.model_name)
        if params.logprobs:  # the router's signals, only when asked: a pass over the whole row
            logprob, entropy = confidence(logits, token)
        t_sampled = perf_counter()
        m.sample_s += t_sampled - t
        if not self.output:
            m.ttft_s = t_sampled - start
        self.chunk = ""
        if not params.ignore_eos and tokenizer.is_end_of_generation(token):
            self.finish_reason = "stop"
            return token
        self.output.append(token)
        m.token_times_s.append(t_sampled - start)
        if params.logprobs:
            self.logprobs.append(logprob)
            self.entropies.append(entropy)
        t = perf_counter()
        self.chunk = self.text.push(tokenizer.piece(token))
        m.detokenize_s += perf_counter() - t
        if self.text.stopped:
            self.finish_reason = "stop"
        elif len(self.output) >= params.max_tokens:
            self.finish_reason = "length"
        return token

    def finish(self, engine: Engine, elapsed: float) -> None:
        self.text.flush()
        m = self.metrics
        m.output_tokens = len(self.output)
        m.total_s = elapsed
        m.kv_used = engine.kv_used
        self.result = Result(
            self.text.text,
            self.output,
            self.finish_reason or "length",
            m,
            engine.model_path.name,
            engine.backend.name,
            logprobs=self.logprobs,
            entropies=self.entropies,
        )


def _corrupt(model_name: str) -> BackendError:
    return BackendError(f"{model_name} produced NaN or infinite logits: its weights are corrupt; re-download it")


def _check_prompt(prompt: object) -> None:
    if not isinstance(prompt, (str, Continuation)) and not (
        isinstance(prompt, Sequence) and not isinstance(prompt, bytes)
    ):
        raise InvalidOptionError(f"the prompt must be a string or a list of messages, got {type(prompt).__name__}")


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
