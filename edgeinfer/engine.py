"""The engine: one decode loop, one sampler, one KV policy and one metrics path for every backend.

engine = Engine()                                  # the default model, best backend here
print(engine.chat([{"role": "user", "content": "Hi"}]).text)
for piece in engine.stream("Once upon a time", max_tokens=50):
    print(piece, end="", flush=True)
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import errno
import importlib.metadata
import logging
import math
import os
import threading
import weakref
from collections.abc import Callable, Generator, Iterator, Sequence
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
from edgeinfer.draft_model import DraftModel, ModelDrafts
from edgeinfer.errors import (
    BackendError,
    ContextFull,
    EdgeInferError,
    InsufficientMemoryError,
    InvalidOptionError,
    first_line,
)
from edgeinfer.kv import DEFAULT_KV_BUDGET, DEFAULT_PROMPT_CACHE_SIZE, MIN_KV_TOKENS, KVBudget, KVPolicy
from edgeinfer.logits import confidence, token_logprobs
from edgeinfer.metrics import Metrics
from edgeinfer.models.catalog import DEFAULT_MODEL, resolve_model
from edgeinfer.models.info import ModelInfo, load_model_info
from edgeinfer.prompt_cache import PromptCache
from edgeinfer.sampler import Sampler
from edgeinfer.sampling import SamplingParams, sampling_params
from edgeinfer.sequences import CachedSequence, SequenceCache
from edgeinfer.sizes import parse_size
from edgeinfer.speculative import MAX_DRAFT, DraftCost, Drafter, PromptLookup, Speculation
from edgeinfer.streams import AsyncStream, FinishReason, Result, Stream, adrain, drain
from edgeinfer.system import check_memory, cpu_features, thread_count
from edgeinfer.textstream import TextStream
from edgeinfer.tokenizer import Tokenizer, engine_tokenizer

log = logging.getLogger("edgeinfer.engine")

Prompt = str | Sequence[Message] | Continuation
# Sequences an engine keeps by default: a few conversations cached side by side, and the width of
# generate_batch (the router's four samples). With llama.cpp's unified cache they cost no memory
# beyond the one KV budget.
DEFAULT_SEQUENCES = 4
# A lone greedy answer's backend may go on drawing tokens itself for up to this long a step (``Span.follow``): the
# engine's own Python around a step, about 45 us, then counts once per several tokens of a tiny model (tiny-qwen2
# on ONNX Runtime: a 250 us step; docs/BENCHMARKS.md), while its text still arrives about every 4 ms, and a call
# that comes meanwhile waits about that long at most for its turn.
FOLLOW_S = 0.004


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
        kv_type: KV element type, ``"f16"``, ``"f32"`` or ``"q8_0"`` where the backend supports it; default:
            the backend's own (``kv_types[0]``): f16, or f32 on the onnxruntime backend, whose CPU attention has
            no fast half-precision kernel.
        threads: CPU threads; default: the cores that are free right now. More than this
            process may use are capped to them.
        batch_size: prompt tokens evaluated in one step. Prompts are evaluated in chunks
            aligned to multiples of it, and a cached prefix is reused in whole chunks.
        sequences: KV sequences the backend keeps: conversations cached side by side (a new
            conversation that shares a system prompt with a cached one copies its KV instead of
            recomputing it), and how many answers ``generate_batch`` decodes together.
        device: where the backend runs (``"cpu"`` or None, or a GPU its ``devices()`` lists: by name, by index
            after the default, or by a part of its name or description).
        gpu_layers: layers placed on ``device`` when it is a GPU (-1, the default: all).
        speculative: ``"lookup"`` (the default without ``draft``) drafts tokens from the prompt and the answer
            so far and verifies them in one evaluation (``edgeinfer.speculative``), where that pays at the
            acceptance seen; ``"draft"`` (the default with ``draft``) drafts them with the ``draft`` model;
            ``"off"`` decodes one token per step. Off (and ``speculative`` says so) on a model whose cache
            cannot be truncated.
        draft: a smaller model with the same vocabulary (a .gguf path or an alias) to draft with. It runs on
            a backend of its own, with a KV cache of the same ``kv_budget``.
        prompt_cache: a folder to keep the KV state of each chat's system prompt in (``edgeinfer.prompt_cache``):
            the next engine, in this process or another, reads it from there instead of evaluating it. Its
            whole chunks of ``batch_size`` tokens are kept; the backend must save states (llama.cpp's do).
        prompt_cache_size: the most the folder holds (bytes, or ``"2GB"``); the least recently used go first.
        force: load even if the memory estimate says it will not fit.

    Calls from several threads (or several streams read in turn) are decoded together: each step
    evaluates one token of every running answer in one backend call, and a new call joins at the
    next step once its prompt and answer fit the KV budget beside the others (until then it waits;
    its TTFT counts the wait). Its prompt is evaluated a chunk per step between the others' tokens.

    Greedy output does not depend on what the KV cache held: llama.cpp's arithmetic for a
    position depends on how many tokens one evaluation carries, so the engine computes every
    prompt position in the same aligned chunk as a cold run would, and reuses only cached
    positions that were computed that way (whole prompt chunks, not generated tokens and not
    positions after an eviction), or the whole of the last prompt prefilled, with its saved
    last logits, when it is asked again. The same prompt, options, thread count, llama.cpp build and
    drafting figure (``draft_token_cost``) give the same logits cold, after another call, after a chat
    turn and after ``reset()``.
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
        kv_type: str | None = None,
        threads: int | None = None,
        batch_size: int = DEFAULT_BATCH_SIZE,
        sequences: int = DEFAULT_SEQUENCES,
        device: str | int | None = CPU,
        gpu_layers: int = -1,
        speculative: str | Speculation | None = None,
        draft: str | os.PathLike[str] | None = None,
        prompt_cache: str | os.PathLike[str] | None = None,
        prompt_cache_size: str | int = DEFAULT_PROMPT_CACHE_SIZE,
        force: bool = False,
    ) -> None:
        self.kv_budget = KVBudget.parse(kv_budget)
        self.speculative = Speculation.parse(speculative or (Speculation.DRAFT if draft else Speculation.LOOKUP))
        if (self.speculative is Speculation.DRAFT) != (draft is not None):
            raise InvalidOptionError(
                "--speculative draft needs a draft model (--draft-model, Engine(draft=...)); a draft model needs "
                "--speculative draft"
            )
        self.kv_policy = KVPolicy.parse(kv_policy or "sinks")
        for name, value in (("batch_size", batch_size), ("sequences", sequences)):
            if value < 1:
                raise InvalidOptionError(f"{name} must be at least 1, got {value}")
        if device is None or (isinstance(device, int) and not isinstance(device, bool)):
            device = CPU if device is None else str(device)
        elif not isinstance(device, str):
            raise InvalidOptionError(f"device must be a name or an index, such as 'cpu' or 0; got {device!r}")
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
            """The options ``cls`` would load the model with: its device by name, its KV type, the budget in its
            cells (no more than the model's context)."""
            options = check_options(cls, requested)
            wanted = min(_cells_bought(self.kv_budget, cls, self.info, options.kv_type), self.info.hparams.n_ctx_train)
            return dataclasses.replace(options, kv_tokens=wanted)

        backend_cls = choose_backend(backend, self.info, loading)
        options = loading(backend_cls)
        asked = _cells_bought(self.kv_budget, backend_cls, self.info, options.kv_type)
        if asked > options.kv_tokens and self.kv_budget != KVBudget.parse(DEFAULT_KV_BUDGET):
            log.warning(
                "the KV budget of %s is more than %s's context of %d tokens: the cache holds %d",
                self.kv_budget.describe(asked), self.model_path.name, options.kv_tokens, options.kv_tokens,
            )  # fmt: skip
        if options.kv_tokens < MIN_KV_TOKENS:
            raise InvalidOptionError(
                f"a KV budget of {options.kv_tokens} token{'s' * (options.kv_tokens != 1)} is too small; give at "
                f"least {MIN_KV_TOKENS}"
            )
        check_memory(backend_cls.memory(self.info, options), force=force)
        self.batch_size = batch_size
        self.kv_type = options.kv_type
        self._prompt_cache: PromptCache | None = None  # a folder that cannot be used is refused before the load
        if prompt_cache is not None:
            cache_bytes = parse_size(prompt_cache_size, "prompt_cache_size")
            identity = self._state_identity(backend_cls.name, options)
            self._prompt_cache = PromptCache(prompt_cache, identity, cache_bytes)
        try:
            self.backend: Backend = backend_cls(self.info, options)
        except (MemoryError, OSError) as exc:  # past the check above (or forced): others took memory, or a limit
            if isinstance(exc, OSError) and exc.errno != errno.ENOMEM:  # a map refused: mmap's ENOMEM
                raise
            raise InsufficientMemoryError(
                f"out of memory loading {self.model_path.name} on the {backend_cls.name} backend ({first_line(exc)});"
                " free memory, lower --kv-budget or choose a smaller model"
            ) from None
        try:
            # After the backend: llama.cpp's tokenizer shares the model the llama.cpp backend loaded.
            self.tokenizer = engine_tokenizer(self.info, backend_cls.loads_llamacpp)
            self.template = ChatTemplate(
                self.info.chat_template,
                bos_token=self.tokenizer.token_text(self.tokenizer.bos_id),
                eos_token=self.tokenizer.token_text(self.tokenizer.eos_id),
                chatml=self.tokenizer.has_markers(CHATML_MARKER),
            )
        except BaseException:
            self.backend.close()
            raise
        self._draft_model: DraftModel | None = None
        self._draft_share = 0.0  # a draft model's step, as a share of this model's (by their files' sizes)
        if draft is not None:
            try:
                self._draft_model, self._draft_share = self._load_draft(draft, backend_cls, options, force)
            except BaseException:
                self.tokenizer.close()
                self.backend.close()
                raise
        # What a drafted token costs depends on the model's kernels on this CPU, on the device and the threads.
        st = self.model_path.stat()
        self._draft_cost = DraftCost(
            f"{self.backend.name}/{options.device}/{self.threads}t/{options.kv_type}/{'+'.join(cpu_features())}/"
            f"{self.model_path.name}:{st.st_size}:{st.st_mtime_ns}"
        )
        self.capacity = min(options.kv_tokens, self.backend.capacity)
        self._budget_text = self.kv_budget.describe(self.capacity)  # for ContextFull messages
        self._cache = SequenceCache(self.backend, batch_size, self.capacity)
        self._calls = 0  # counts calls, to find the least recently used sequence
        # The decode loop's state: _state guards _waiting, _stepping and _draining; the thread that set _stepping
        # alone touches _jobs, the cache and the backend until it clears it.
        self._state = threading.Condition()
        self._stepping = False  # a thread is running a step, or holds the engine between steps (_exclusive)
        self._draining = 0  # threads waiting in _exclusive for a condition: no job is admitted meanwhile
        self._sleepers = 0  # threads waiting on _state, to be woken when a step ends
        self._stepper: int | None = None  # the thread that set _stepping
        self._waiting: collections.deque[_Job] = collections.deque()  # submitted, not yet admitted, in order
        self._jobs: list[_Job] = []  # admitted: evaluating their prompt, decoding, or between waves
        self._decode_steps = 0
        self._decoded_tokens = 0
        self._token_s = math.inf  # what evaluating one token took in the last step of one answer without a draft
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
        if self._prompt_cache is not None and self.backend.save_state(0) is None:
            log.warning("the %s backend cannot save its KV state: the prompt cache is skipped", self.backend.name)
            self._prompt_cache = None
        if self.speculative is not Speculation.OFF and not self.backend.can_truncate:
            # Rejected drafts are truncated: a cache that cannot truncate (a recurrent state) cannot take them back.
            log.info("%s's cache cannot take back rejected drafts: one token a step (speculative off)", self.info.name)
            self.speculative = Speculation.OFF
            if self._draft_model is not None:
                self._draft_model.close()
                self._draft_model = None

    def _load_draft(
        self, draft: str | os.PathLike[str], backend_cls: type[Backend], options: BackendOptions, force: bool
    ) -> tuple[DraftModel, float]:
        """The draft model on a backend of its own, with a cache of the same budget (memory checked for it too);
        refused, in one line, where its cache cannot be truncated or its vocabulary is not this model's."""
        path = resolve_model(draft)
        info = load_model_info(path)
        if info.hparams.recurrent:
            raise InvalidOptionError(
                f"the draft model {path.name} keeps a recurrent state, which cannot take back its rejected drafts; "
                "give a transformer of the same family"
            )
        cells = min(_cells_bought(self.kv_budget, backend_cls, info, options.kv_type), info.hparams.n_ctx_train)
        draft_options = dataclasses.replace(options, kv_tokens=cells)
        check_memory(backend_cls.memory(info, draft_options), force=force)
        backend = backend_cls(info, draft_options)
        try:
            # After the backend, as the engine's own: llama.cpp's tokenizer shares the model it loaded.
            with contextlib.closing(engine_tokenizer(info, backend_cls.loads_llamacpp)) as theirs:
                mine = self.tokenizer
                differs = mine.n_vocab != theirs.n_vocab or any(
                    mine.piece(t) != theirs.piece(t) for t in range(mine.n_vocab)
                )
                n_vocab = theirs.n_vocab
            if differs:
                raise InvalidOptionError(
                    f"the draft model {path.name} has another vocabulary than {self.model_path.name} "
                    f"({n_vocab} tokens against {mine.n_vocab}, or other tokens); drafts must be "
                    "token ids of the same vocabulary: give a draft model of the same family"
                )
        except BaseException:
            backend.close()
            raise
        return DraftModel(backend, min(cells, backend.capacity)), info.file_size / self.info.file_size

    def _state_identity(self, backend_name: str, options: BackendOptions) -> str:
        """What decides the KV state a prompt leaves: the model file, the backend and its build, its device, the
        KV type, and the chunks prompts are evaluated in."""
        st = self.model_path.stat()
        builds = []
        for package in ("edgeinfer", "llama-cpp-python"):
            try:
                builds.append(f"{package} {importlib.metadata.version(package)}")
            except importlib.metadata.PackageNotFoundError:
                builds.append(f"{package} none")
        return (
            f"{self.model_path.name}:{st.st_size}:{st.st_mtime_ns}/{backend_name}/{options.device}:"
            f"{options.gpu_layers}/{options.threads}t/{options.kv_type}/{self.batch_size}/{', '.join(builds)}"
        )

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
        self._check_open()  # before the arguments: a closed engine is the first thing wrong
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
        return self._encode_rendered(text, literal or ())

    def _encode_rendered(self, text: str, literal: Sequence[tuple[int, int]] = ()) -> list[int]:
        """The tokens of a chat template's text; ``literal`` spans are text whatever control tokens they spell."""
        bos = self.tokenizer.token_text(self.tokenizer.bos_id)
        # A template that writes BOS itself must not get a second one.
        return self.tokenizer.encode(text, add_special=not (bos and text.startswith(bos)), literal=literal)

    def _system_prefix(self, prompt: Sequence[Message] | Continuation, tokens: list[int]) -> int:
        """How much of a chat's ``tokens`` the prompt cache keeps: its system prompt's whole chunks, which the
        next chat with the same system prompt starts with (0: none)."""
        messages = list(prompt.messages if isinstance(prompt, Continuation) else prompt)
        first = next((i for i, m in enumerate(messages) if m["role"] != "system"), len(messages))
        if first in (0, len(messages)):
            return 0
        text = self.render(messages)
        spans = self.template.content_spans(messages, text)
        if spans is None:
            return 0
        head = self._encode_rendered(text[: spans[first][0]])
        same = next((i for i, (a, b) in enumerate(zip(head, tokens, strict=False)) if a != b), len(head))
        return min(same, len(tokens) - 1) // self.batch_size * self.batch_size

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
        self._check_open()
        if not 0 < len(tokens) <= self.capacity:
            raise InvalidOptionError(
                f"can score 1 to {self.capacity} tokens at once (the KV capacity), got {len(tokens)}"
            )
        n_vocab = self.backend.n_vocab
        bad = tokens if isinstance(tokens, (str, bytes)) else next((t for t in tokens if not _is_id(t, n_vocab)), None)
        if bad is not None:
            raise InvalidOptionError(
                f"logits takes token ids from 0 to {n_vocab - 1} (tokenize text first), got {bad!r}"
            )
        with self._exclusive(self._idle):
            self._check_open()
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
        tokens = self.tokenize(prompt)
        if len(tokens) > self.capacity:
            raise ContextFull(f"the prompt has {len(tokens)} tokens, more than the KV budget of {self._budget_text}")
        with self._exclusive(lambda: self._room_for(len(tokens))):
            self._check_open()
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
        """Forget every cached conversation (once the calls running have ended)."""
        with self._exclusive(self._idle):
            self._check_open()
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

    @property
    def running(self) -> int:
        """Calls decoding now, or evaluating their prompt."""
        return len(self._jobs)

    @property
    def waiting(self) -> int:
        """Calls waiting for room in the KV budget or for a free sequence."""
        return len(self._waiting)

    @property
    def draft_token_cost(self) -> float:
        """What a drafted token costs to verify, as a share of a one-token step, as this engine drafts by: measured
        on this machine by an earlier engine for the same model, backend and threads (``DraftCost``)."""
        return self._draft_cost.value

    @property
    def decode_steps(self) -> tuple[int, int]:
        """Decode steps run so far, and how many answers they evaluated a drawn token of (each with the tokens drafted
        after it, or drawn after it by the backend, if any): their ratio is the mean batch."""
        return self._decode_steps, self._decoded_tokens

    def close(self) -> None:
        """Free the model now; waits for the calls running in other threads to end."""
        if self._closed:
            return
        with self._exclusive(self._idle):
            if self._closed:
                return
            with self._state:
                self._closed = True
                waiting = list(self._waiting)
            for job in waiting:
                self._fail_job(job, _closed_error())
            self._draft_cost.save()
            if self._draft_model is not None:
                self._draft_model.close()
            self.backend.close()
            self.tokenizer.close()

    def _check_open(self) -> None:
        if self._closed:
            raise _closed_error()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the decode loop -----------------------------------------------------------------------
    #
    # Every call is a _Job. A job waits until its prompt and answers fit beside the running ones, then joins
    # the batch: its prompt is evaluated a chunk per step, and its answers are decoded with every other
    # running answer in one backend evaluation per step; a finished one leaves at once. No thread of its own
    # runs the loop: a caller whose job has no text ready runs the next step for everyone, while the others
    # wait for that step to end (and find their text), so a lone call drives itself with no hand-over.

    def _run(
        self, prompt: Prompt, generations: list[_Generation], cancel: threading.Event
    ) -> Generator[str, None, Result]:
        """Answer ``prompt`` once per generation; yields the text of the first (the only one, for ``stream``)."""
        start = perf_counter()  # TTFT counts any wait for other calls
        self._check_open()
        t = perf_counter()
        tokens = self.tokenize(prompt)
        tokenize_s = perf_counter() - t
        if not tokens:
            raise InvalidOptionError("the prompt is empty: give the model some text to continue")
        for generation in generations:
            generation.metrics = Metrics(kv_capacity=self.capacity, tokenize_s=tokenize_s)
        reserve = min(generations[0].params.max_tokens, self.capacity // 4)
        fitted = self.kv_policy.fit_prompt(
            tokens, self.capacity, reserve, has_bos=self.tokenizer.add_bos, budget=self._budget_text
        )
        job = _Job(fitted, len(tokens) - len(fitted), generations, cancel, start)
        if self._prompt_cache is not None:
            chat = not isinstance(prompt, str) and fitted is tokens  # a prompt cut to fit keeps no system prompt
            job.checkpoint = self._system_prefix(prompt, tokens) if chat else 0
            for generation in generations:  # unless the wave reads it from disk or saves it (_read_prefix)
                generation.metrics.prompt_cache = "in memory" if job.checkpoint else "nothing to keep"
        with self._state:
            if self._closed:
                raise _closed_error()
            self._waiting.append(job)
        chunks = job.chunks
        try:
            while True:
                done = job.done  # read first: a step in another thread may append its last text and end it
                while chunks:
                    yield chunks.popleft()
                if done:
                    break
                self._drive(job)
        except BaseException:  # closed early (GeneratorExit), or Ctrl-C while waiting
            cancel.set()
            if not job.done and self._stepper != threading.get_ident():  # else the next step ends it
                with self._exclusive():  # out of the batch before the next step
                    self._cancel_job(job)
            raise
        if job.error is not None:
            raise job.error
        return generations[0].result  # type: ignore[return-value]  # set when its wave ended

    def _drive(self, job: _Job) -> None:
        """Run the next step for every job, or wait for the one another thread is running to end."""
        with self._state:
            if job.chunks or job.done:
                return
            if self._stepping or (self._draining and job in self._waiting):
                self._sleep()
                return
            self._stepping, self._stepper = True, threading.get_ident()
        try:
            self._step()
        finally:
            with self._state:
                self._stepping, self._stepper = False, None
                if self._sleepers:
                    self._state.notify_all()

    def _sleep(self) -> None:
        """Wait, holding ``_state``, until a step or an exclusive call ends."""
        self._sleepers += 1
        try:
            self._state.wait()
        finally:
            self._sleepers -= 1

    @contextlib.contextmanager
    def _exclusive(self, ready: Callable[[], bool] | None = None) -> Iterator[None]:
        """Hold the engine between steps, once ``ready()`` (with the jobs it waits for stepped meanwhile, by
        this thread if no other does); no job is admitted while it waits. The caller checks whether the engine
        has been closed meanwhile."""
        with self._state:
            self._draining += ready is not None
            try:
                while self._stepping or (ready is not None and not ready()):
                    if self._stepping or not self._jobs:
                        self._sleep()
                        continue
                    # Nobody else steps the jobs it waits for: step them here.
                    self._stepping, self._stepper = True, threading.get_ident()
                    self._state.release()
                    try:
                        self._step()
                    finally:
                        self._state.acquire()
                        self._stepping, self._stepper = False, None
                        self._state.notify_all()
                self._stepping, self._stepper = True, threading.get_ident()
            finally:
                self._draining -= ready is not None
                self._state.notify_all()  # jobs that waited for the draining to end
        try:
            yield
        finally:
            with self._state:
                self._stepping, self._stepper = False, None
                self._state.notify_all()

    def _idle(self) -> bool:
        return not self._jobs

    def _room_for(self, n: int) -> bool:
        """Whether a sequence no job holds, and ``n`` cells, are free."""
        return self._free_cells() >= n and not all(state.busy for state in self._cache.sequences)

    def _free_cells(self) -> int:
        """Cells neither a running job holds nor a running answer has reserved for its tokens to come (a job
        still evaluating its prompt, for the rest of it too)."""
        reserved = 0
        for job in self._jobs:
            if job.prefill is not None:
                rest = len(job.prompt) - len(self._cache.sequences[job.seqs[0]].tokens)
                reserved += rest + len(job.wave) * min(job.wave[0].params.max_tokens, self.capacity - len(job.prompt))
            else:
                reserved += sum(g.reserved() for g in job.wave if g.finish_reason is None)
        return self.capacity - self._cache.cells_used(busy_only=True) - reserved

    def _step(self) -> None:
        """One turn of the loop: admit what fits, evaluate one prompt chunk, then one token of every answer."""
        jobs = self._jobs
        if self._waiting or not all(job.wave for job in jobs):
            self._admit()
        for job in jobs:
            if job.prefill is not None:
                self._prefill_step(job)
                break
        decoding = [g for job in jobs if job.prefill is None for g in job.wave if g.finish_reason is None]
        if decoding:
            self._decode_step(decoding)

    def _admit(self) -> None:
        """Start the next wave of jobs between waves, then waiting jobs in order, while they fit."""
        for job in [job for job in self._jobs if not job.wave and job.prefill is None]:
            if job.cancel.is_set():
                self._cancel_job(job)
            else:
                self._try_start(job)  # or waits its turn
        with self._state:
            waiting = list(self._waiting)
            draining = self._draining
        for job in [job for job in waiting if job.cancel.is_set()]:
            self._cancel_job(job)
        for job in [] if draining else waiting:
            if job.done:
                continue
            if not self._try_start(job):
                return  # first come, first served: nothing overtakes a job that does not fit yet
            if not job.done:
                with self._state:
                    self._waiting.remove(job)
                self._jobs.append(job)

    def _try_start(self, job: _Job) -> bool:
        """``_start_wave``, with its failure ``job``'s own (its caller raises it), not the stepping thread's."""
        try:
            return self._start_wave(job)
        except Exception as exc:
            self._fail_job(job, exc)
            return True

    def _start_wave(self, job: _Job) -> bool:
        """Claim sequences for as many of ``job``'s answers as fit side by side; start its prompt's evaluation.

        False, with nothing changed, while they do not fit beside the running jobs.
        """
        prompt, cache, sequences = job.prompt, self._cache, self._cache.sequences
        free = [s for s, state in enumerate(sequences) if not state.busy]
        longest = max(g.params.max_tokens for g in job.pending)
        # Each answer takes its own cells; where the backend copies a prompt rather than sharing it, its copy too.
        side_by_side = max(1, (self.capacity - len(prompt)) // (longest + cache.copy_cost(len(prompt))))
        size = min(len(job.pending), side_by_side, len(free))
        if size == 0:
            return False
        reserve = min(longest, self.capacity // 4)
        copies = (size - 1) * cache.copy_cost(len(prompt))  # the other answers' prompts
        if len(free) < len(sequences):  # others are running: this job needs room for its whole answers
            answers = size * min(longest, self.capacity - len(prompt))
            reused = max(state.reusable(prompt, len(prompt) - 1, self.batch_size) for state in sequences)
            if any(state.last_prompt == prompt and not state.busy for state in sequences):
                reused = len(prompt)
            if len(prompt) - reused + answers + copies > self._free_cells():
                return False
        seq = self._claim(prompt, len(prompt) - 1, replay=True)
        state = sequences[seq]
        state.busy = True
        job.seqs = [seq]
        for _ in range(size - 1):
            spare = self._spare_sequence(job.seqs)
            sequences[spare].busy = True
            job.seqs.append(spare)
        job.wave, job.pending = job.pending[:size], job.pending[size:]
        job.prefill_s = 0.0
        if state.last_prompt == prompt:
            cache.forget(seq, len(prompt))  # drop the answer that followed it (all, on a recurrent model)
        if state.last_prompt == prompt:  # asked again: on a recurrent model the forget above emptied it
            job.cached = len(prompt)
            if copies:
                cache.drop_others(job.seqs, size * reserve + copies)
            self._launch(job, state.last_logits)
        else:
            job.cached = len(state.tokens)
            cache.drop_others(job.seqs, len(prompt) - job.cached + size * reserve + copies)
            save = self._read_prefix(job, seq)
            job.prefill = self._prefill(seq, prompt, cancel=job.cancel, checkpoint=save)
        return True

    def _read_prefix(self, job: _Job, seq: int) -> int:
        """Fill ``seq`` with ``job``'s prefix from the prompt cache on disk, where it is there and not in memory
        already. Returns where the prefill should save the prefix for the next start (0: nowhere)."""
        prefix = job.checkpoint
        if self._prompt_cache is None or job.cached >= prefix:
            return 0
        tokens = job.prompt[:prefix]
        # Into an empty sequence only: cells it shares with another would not be freed for the state's.
        state = self._prompt_cache.load(tokens) if job.cached == 0 and self._cache.has_room(prefix) else None
        if state is not None and self._cache.restore(seq, tokens, state):
            job.cached = prefix
            for generation in job.wave:
                generation.metrics.prompt_cache, generation.metrics.disk_cached_tokens = "hit", prefix
            return 0
        if state is not None:  # llama.cpp found no run of free cells for it, or cannot read it: saved again below
            log.warning("prompt cache: the state of this prompt could not be loaded; evaluating it")
        for generation in job.wave:
            generation.metrics.prompt_cache = "saved"
        return prefix

    def _prefill_step(self, job: _Job) -> None:
        """Evaluate the next chunk of ``job``'s prompt; once it is all in, start its answers."""
        t = perf_counter()
        try:
            _, logits = next(job.prefill)  # type: ignore[arg-type]  # set while prefilling
        except StopIteration:
            logits = None
        except Exception as exc:
            self._fail_job(job, exc)
            return
        except BaseException as exc:  # Ctrl-C: this job is over, and the caller stops
            self._fail_job(job, exc)
            raise
        job.prefill_s += perf_counter() - t
        if logits is not None:
            job.logits = logits
            if len(self._cache.sequences[job.seqs[0]].tokens) < len(job.prompt):
                return  # more chunks to go
        job.prefill = None
        state = self._cache.sequences[job.seqs[0]]
        if len(state.tokens) < len(job.prompt) or job.logits is None:  # cancelled: every answer ends unstarted
            self._launch(job, None)
            return
        # A copy: the row is the backend's buffer, which this step's decode evaluation overwrites.
        state.last_prompt, state.last_logits = list(job.prompt), np.array(job.logits)
        self._launch(job, state.last_logits)

    def _launch(self, job: _Job, logits: np.ndarray | None) -> None:
        """Give each answer of the wave its sequence, sharing the prompt's KV, and the logits to draw from."""
        job.logits = None
        if logits is not None and not np.isfinite(logits).all():
            self._fail_job(job, _corrupt(self.model_path.name))
            return
        seq, n, follows = job.seqs[0], len(job.prompt), self.backend.follows
        for other, generation in zip(job.seqs, job.wave, strict=True):
            if other != seq and logits is not None:
                self._cache.share(seq, other, n)
            m = generation.metrics
            m.prompt_tokens, m.prompt_cut, m.cached_tokens, m.prefill_s = n, job.prompt_cut, job.cached, job.prefill_s
            generation.start(other, logits, self._cache.sequences[other], self.model_path.name, self.capacity - n)
            # A greedy answer on a backend that follows is not drafted from its prompt: it would then be drafted or
            # followed as the steps' timing has it, and a drafted step's batch rounds its rows otherwise than one
            # token a run (ONNX Runtime: by up to 0.05 logits), so the same call could give other text run to run.
            if logits is not None and self.speculative is Speculation.LOOKUP and not (generation.argmax and follows):
                generation.drafts = PromptLookup(job.prompt)
            elif logits is not None and self.speculative is Speculation.DRAFT and self._draft_model is not None:
                generation.drafts = ModelDrafts(self._draft_model, other, job.prompt)

    def _decode_step(self, decoding: list[_Generation]) -> None:
        """Evaluate the token each answer drew last step, all in one call; then draw each one's next token."""
        stepping = [g for g in decoding if g.token is not None]
        if stepping and not self._make_room(stepping):
            stepping = [g for g in stepping if g.finish_reason is None and not g.job.done]
        if stepping:
            drafts = self._drafts(stepping)
            follow, ends = self._follow(stepping, drafts)
            spans = [
                Span(g.seq, len(g.state.tokens), (g.token, *d), bool(d), g.argmax and not d, follow, ends)
                for g, d in zip(stepping, drafts, strict=True)
            ]
            t = perf_counter()
            try:
                rows = self.backend.eval(spans)
            except BaseException as exc:
                for job in {g.job: None for g in stepping}:
                    self._fail_job(job, exc)
                if not isinstance(exc, Exception):
                    raise
                # The answers _make_room ended meanwhile still end below: their calls would wait for ever.
            else:
                self._evaluated(spans, stepping, rows, drafts, perf_counter() - t)
        tokenizer, ended = self.tokenizer, []
        for generation in decoding:
            job = generation.job
            if job.done:
                continue
            if generation.finish_reason is not None:  # out of room
                ended.append(job)
                continue
            if generation.logits is None or job.cancel.is_set():
                if generation.draft:  # evaluated, never verified: the cache keeps none of it
                    self._cache.rollback(generation.seq, len(generation.state.tokens) - len(generation.draft))
                    generation.draft = ()
                generation.finish_reason = "cancelled"
                ended.append(job)
                continue
            try:
                token = generation.draw(tokenizer, job.start)
            except Exception as exc:
                self._fail_job(job, exc)
                continue
            if generation.kept < len(generation.state.tokens):  # drafted tokens it did not keep
                self._cache.rollback(generation.seq, generation.kept)
            if job.streaming and generation.chunk:
                job.chunks.append(generation.chunk)
            if generation.finish_reason is None:
                generation.token = token
            else:
                ended.append(job)
        for job in ended:
            if not job.done and job.wave and all(g.finish_reason is not None for g in job.wave):
                self._end_wave(job)

    def _evaluated(
        self,
        spans: list[Span],
        stepping: list[_Generation],
        rows: list[np.ndarray],
        drafts: list[tuple[int, ...]],
        elapsed: float,
    ) -> None:
        """Keep what a decode step evaluated: each answer's tokens in the cache, and the rows to draw from."""
        follow = spans[0].follow  # only ever for one answer alone
        if len(spans) == 1 and not drafts[0]:
            self._token_s = elapsed / (len(rows[0]) if follow else 1)
        if len(spans) == 1 and self.speculative is not Speculation.OFF:  # one answer alone times its draft's cost
            # against what a token costs undrafted: a followed step's tokens count as one-token steps
            self._draft_cost.observe(len(spans[0].tokens), self._token_s if follow else elapsed)
        self._decode_steps += 1
        self._decoded_tokens += len(spans)
        for span, generation, row, draft in zip(spans, stepping, rows, drafts, strict=True):
            evaluated, generation.followed = span.tokens, bool(follow)
            if follow:  # the backend's own tokens: every one it returned but the last is evaluated, a draft kept
                draft = tuple(row[:-1].tolist())
                evaluated, row = (*span.tokens, *draft), row if draft else row[0]
            self._cache.append(span.seq, evaluated)
            generation.logits, generation.token, generation.draft = row, None, draft
            generation.metrics.decode_s += elapsed

    def _drafts(self, stepping: list[_Generation]) -> list[tuple[int, ...]]:
        """The tokens each stepping answer drafts to follow the one it drew: as many as pay for themselves
        (its ``Drafter``), within its ``max_tokens``; none at all where the pool has no cells free for them, or only
        cells reserved for other answers."""
        drafts: list[tuple[int, ...]] = []
        # A draft model's tokens cost its steps too, besides their share of the verifying step.
        cost = self._draft_cost.value + self._draft_share
        for generation in stepping:
            draft: tuple[int, ...] = ()
            if generation.drafts is not None:
                # The drawn token is its answer's; each kept draft token draws one more, so the last to verify
                # is the one before max_tokens.
                room = max(0, min(generation.params.max_tokens - len(generation.output) - 1, MAX_DRAFT))
                draft = tuple(generation.drafts.draft(room, cost))
            drafts.append(draft)
        extra = sum(map(len, drafts))
        if extra and not (self._cache.has_room(len(stepping) + extra) and self._within_reservations(stepping, drafts)):
            return [()] * len(stepping)
        return drafts

    def _within_reservations(self, stepping: list[_Generation], drafts: Sequence[tuple[int, ...]] = ()) -> bool:
        """Whether the cells the stepping answers take this step (their drawn tokens', and ``drafts``') beyond the
        cells reserved for them fit the cells reserved for nobody: an answer past its reservation must not take the
        cells another's prompt or answer was promised (it would fail mid-call)."""
        beyond = sum(max(0, 1 + (len(drafts[i]) if drafts else 0) - g.reserved()) for i, g in enumerate(stepping))
        return beyond == 0 or beyond <= self._free_cells()

    def _follow(self, stepping: list[_Generation], drafts: list[tuple[int, ...]]) -> tuple[int, frozenset[int]]:
        """How many tokens the backend may draw and evaluate itself after a lone greedy answer's drawn one, and
        the tokens it stops after (``Span.follow``): as many as FOLLOW_S of its steps hold, within the answer's
        ``max_tokens`` and the free cells."""
        # Only an answer alone in the engine: another call's prompt has cells reserved, and waits for each step.
        alone = len(self._jobs) == 1 and not self._waiting and len(stepping) == 1
        if not self.backend.follows or not alone or drafts[0] or not stepping[0].argmax:
            return 0, frozenset()
        params = stepping[0].params
        n = min(int(FOLLOW_S / self._token_s), params.max_tokens - len(stepping[0].output) - 1)
        if n > 0 and not self._cache.has_room(1 + n):
            n = min(n, self.capacity - self._cache.cells_used() - 1)
        if n <= 0:
            return 0, frozenset()
        return n, frozenset() if params.ignore_eos else self.tokenizer.end_ids

    def _make_room(self, stepping: list[_Generation]) -> bool:
        """Free a cell for each stepping answer's next token: idle sequences' first; then, for an answer alone in
        the cache, the KV policy's (whose ContextFull ends its call). Where others run, the answers past their
        reservation end there instead, as ``length``: the budget is full. True if every stepping answer has its cell."""
        n_incoming = len(stepping)
        if self._cache.has_room(n_incoming) and self._within_reservations(stepping):
            return True
        self._cache.drop_others([], n_incoming)
        free = self.capacity - self._cache.cells_used()
        if free >= n_incoming and self._within_reservations(stepping):
            return True
        if len(stepping) > 1 or sum(state.busy for state in self._cache.sequences) > 1:
            for generation in [g for g in stepping if not g.reserved()] or stepping:
                generation.finish_reason, generation.token = "length", None
            return False
        generation = stepping[0]
        try:
            evict_from, evict_to = self.kv_policy.eviction(
                len(generation.state.tokens),
                n_incoming,
                len(generation.state.tokens) + free,
                has_bos=self.tokenizer.add_bos,
                budget=self._budget_text,
            )
        except ContextFull as exc:
            self._fail_job(generation.job, ContextFull(str(exc), partial=generation.text.text))
            return False
        self._cache.evict(generation.seq, evict_from, evict_to)
        generation.metrics.kv_evicted += evict_to - evict_from
        return True

    def _end_wave(self, job: _Job) -> None:
        """The wave's answers are all done: hand over their results and free their sequences."""
        wave, sequences = job.wave, self._cache.sequences
        if job.streaming:
            tail = wave[0].text.flush()
            if tail:
                job.chunks.append(tail)
        elapsed = perf_counter() - job.start
        for generation in wave:
            generation.finish(self, elapsed)
        if len(wave) > 1:
            # Answers decoded together are not conversations to go on with: free their cells and keep the
            # prompt. Freed, the cells after the prompt are where a cold run puts the next answer's tokens,
            # so the answer that usually follows (the router's, after its samples) is the cold answer.
            for generation in wave:
                self._cache.forget(generation.seq, len(job.prompt) if generation.seq == job.seqs[0] else 0)
        for seq in job.seqs:
            sequences[seq].busy = False
        job.wave, job.seqs = [], []
        if not job.pending:
            self._retire(job)

    def _cancel_job(self, job: _Job) -> None:
        """End ``job`` now, each answer not yet finished as cancelled."""
        if job.done:
            return
        if job.prefill is not None:  # the prompt's chunks evaluated so far stay cached
            job.prefill = None
            self._launch(job, None)
        for generation in job.wave + job.pending:
            if generation.finish_reason is None:
                generation.finish_reason = "cancelled"
        pending, job.pending = job.pending, []
        if job.wave:
            self._end_wave(job)
        elapsed = perf_counter() - job.start
        for generation in pending:
            generation.finish(self, elapsed)
        self._retire(job)

    def _fail_job(self, job: _Job, exc: BaseException) -> None:
        """End ``job`` with ``exc``, which its caller raises; its sequences are emptied (kept, for ContextFull)."""
        job.error = exc
        for seq in job.seqs:
            if not isinstance(exc, ContextFull):
                self._cache.forget(seq, 0)
            self._cache.sequences[seq].busy = False
        job.seqs, job.wave, job.pending, job.prefill = [], [], [], None
        self._retire(job)

    def _retire(self, job: _Job) -> None:
        job.done = True
        with self._state:
            if job in self._waiting:
                self._waiting.remove(job)
        if job in self._jobs:
            self._jobs.remove(job)

    # -- the prompt cache ----------------------------------------------------------------------

    def _claim(self, tokens: Sequence[int], limit: int, *, replay: bool = False) -> int:
        """A sequence no running job holds, to evaluate ``tokens`` in, already holding as much of them as can be
        reused.

        The one holding the longest reusable prefix (at most ``limit``), or with ``replay`` the one that
        last prefilled exactly ``tokens`` (its saved logits stand for their evaluation). If it holds
        another conversation, which ``tokens`` do not continue, or a running job holds it, that one stays
        and the prefix is shared into a spare sequence.
        """
        self._calls += 1
        sequences = self._cache.sequences
        if replay:
            asked = list(tokens)
            for seq, state in enumerate(sequences):
                if state.last_prompt == asked and not state.busy:
                    state.used_at = self._calls
                    return seq
        reuse = [state.reusable(tokens, limit, self.batch_size) for state in sequences]
        best = max(range(len(sequences)), key=lambda s: (reuse[s], not sequences[s].busy, sequences[s].used_at))
        if reuse[best] == 0:
            if any(state.busy for state in sequences):  # the cells are not a cold run's anyway
                seq = self._spare_sequence([])
                self._cache.forget(seq, 0)
            else:
                # Nothing cached helps: start from an empty pool, so the prompt's cells are the ones a cold
                # run fills and its answer is the cold answer (llama.cpp rounds by cell placement).
                for other in range(len(sequences)):
                    self._cache.forget(other, 0)
                seq = best
            sequences[seq].used_at = self._calls
            return seq
        held = sequences[best].last_prompt
        # A sequence without a last prompt (scored, sampled, or evicted from) holds nothing a later call could
        # reuse beyond what this one does, so it is overwritten in place, cell for cell as a cold run fills them.
        in_place = held is None or list(tokens[: len(held)]) == held
        if not sequences[best].busy and (in_place or self._spare_sequence([best]) == best):
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
        """A sequence no job holds, not in ``taken``: an empty one, else the least recently used (emptied by the
        caller); where there is none but ``taken``'s, its first."""
        state = self._cache.sequences
        free = [s for s in range(len(state)) if s not in taken and not state[s].busy]
        if not free:
            return taken[0]
        return min(free, key=lambda s: (bool(state[s].tokens), state[s].used_at))

    def _prefill(
        self,
        seq: int,
        tokens: Sequence[int],
        *,
        cancel: threading.Event | None = None,
        rows_from: int | None = None,
        checkpoint: int = 0,
    ) -> Iterator[tuple[int, np.ndarray]]:
        """Evaluate ``tokens`` past what ``seq`` holds, in chunks aligned to multiples of ``batch_size``; yield each
        chunk's logits.

        What ``seq`` holds must end on a chunk boundary. A chunk that reaches ``rows_from`` yields
        every row's logits, any other only its last row's. Stops between chunks once ``cancel`` is set. Where a
        chunk ends at ``checkpoint``, the sequence's state there goes to the prompt cache on disk.
        """
        size = self.batch_size
        for first in range(len(self._cache.sequences[seq].tokens), len(tokens), size):
            if cancel is not None and cancel.is_set():
                return
            chunk = tokens[first : first + size]
            all_rows = rows_from is not None and first + len(chunk) > rows_from
            (logits,) = self.backend.eval([Span(seq, first, chunk, all_logits=all_rows)])
            self._cache.append(seq, chunk, exact_chunk=len(chunk) == size)
            if checkpoint and first + len(chunk) == checkpoint and self._prompt_cache is not None:
                state = self.backend.save_state(seq)
                if state is not None:
                    self._prompt_cache.save(tokens[:checkpoint], state)
            yield first, logits


class _Job:
    """One call in the decode loop: its prompt, its answers (decoded in waves of as many as fit side by side), and
    the text it hands its caller."""

    def __init__(
        self,
        prompt: list[int],
        prompt_cut: int,
        generations: list[_Generation],
        cancel: threading.Event,
        start: float,
    ) -> None:
        self.prompt = prompt  # as evaluated, after the KV policy's cut
        self.prompt_cut = prompt_cut
        self.pending = list(generations)  # answers no wave has taken yet
        self.wave: list[_Generation] = []  # the answers decoding now
        self.seqs: list[int] = []  # the wave's sequences, the prompt's first
        self.prefill: Iterator[tuple[int, np.ndarray]] | None = None  # the prompt's chunks still to evaluate
        self.logits: np.ndarray | None = None  # the last chunk's, while prefilling
        self.prefill_s = 0.0
        self.cached = 0  # prompt tokens the wave found in the cache
        self.checkpoint = 0  # the prefix the prompt cache on disk keeps (its system prompt's whole chunks)
        self.cancel = cancel
        self.start = start
        self.streaming = len(generations) == 1  # its text is the caller's stream
        self.chunks: collections.deque[str] = collections.deque()  # text ready for the caller
        self.done = False
        self.error: BaseException | None = None  # what the caller raises
        for generation in generations:
            generation.job = self


class _Generation:
    """One answer in the decode loop: its sampler, text, metrics and sequence."""

    job: _Job

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self.token: int | None = None  # drawn, not yet evaluated
        self.drafts: Drafter | None = None  # drafts its next tokens, where the engine drafts
        self.draft: tuple[int, ...] = ()  # drafted tokens evaluated after ``token`` in the last step
        self.followed = False  # the backend drew that draft itself, greedily (``Span.follow``): each one is kept
        self.kept = 0  # positions its sequence keeps once the last step's draft is verified
        self.reserve = 0  # cells kept free for its tokens while others run
        self.sampler = Sampler(params)
        self.argmax = params.argmax_only
        self.text = TextStream(params.stop)
        self.output: list[int] = []
        self.logprobs: list[float] = []
        self.entropies: list[float] = []
        self.metrics = Metrics()
        self.finish_reason: FinishReason | None = None
        self.chunk = ""
        self.result: Result | None = None

    def start(self, seq: int, logits: np.ndarray | None, state: CachedSequence, model_name: str, room: int) -> None:
        self.seq, self.logits, self.state, self.model_name = seq, logits, state, model_name
        self.reserve = min(self.params.max_tokens, room)

    def reserved(self) -> int:
        """Cells still kept for its tokens to come."""
        return max(0, self.reserve - len(self.output))

    def draw(self, tokenizer: Tokenizer, start: float) -> int:
        """Draw the next token, and before it the tokens of the last step's draft it keeps: each drafted token is
        kept only where the token drawn from the row before it is that token. Sets ``chunk`` (all the text they
        add), ``finish_reason``, and ``kept``: the positions of its sequence that stand."""
        draft, rows, tokens = self.draft, self.logits, self.state.tokens
        self.kept = len(tokens)
        if not draft:
            return self.sample(tokenizer, start, len(tokens))
        self.draft = ()
        base = len(tokens) - len(draft)  # the positions up to the drawn token the draft follows
        chunks = []
        for accepted, row in enumerate(rows):
            self.logits = row
            token = self.sample(tokenizer, start, base + accepted)
            chunks.append(self.chunk)
            if self.finish_reason is not None or accepted == len(draft) or token != draft[accepted]:
                break
        self.chunk = "".join(chunks)
        self.kept = base + accepted
        if not self.followed:
            self.metrics.drafted_tokens += len(draft)
            self.metrics.accepted_tokens += accepted
            self.drafts.verified(len(draft), accepted)  # type: ignore[union-attr]  # a draft came from it
        return token

    def sample(self, tokenizer: Tokenizer, start: float, history: int) -> int:
        """Draw the next token from ``logits``, which follow the sequence's first ``history`` positions. Sets
        ``chunk``, the text it adds, and ``finish_reason`` when the answer ends."""
        m, params, logits = self.metrics, self.params, self.logits
        t = perf_counter()
        if logits.ndim == 0:  # the backend's own argmax of the row (Span.argmax)
            token = int(logits)
            if token == ARGMAX_NOT_FINITE:
                raise _corrupt(self.model_name)
        else:
            try:
                tokens = self.state.tokens
                recent = tokens if history == len(tokens) else tokens[max(0, history - params.repeat_last_n) : history]
                token = self.sampler(logits, recent)
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
        if self.drafts is not None:
            self.drafts.extend((token,))
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


def _cells_bought(budget: KVBudget, cls: type[Backend], info: ModelInfo, kv_type: str) -> int:
    """The cells ``budget`` buys for ``info`` on ``cls`` at ``kv_type``, before the model's context caps them."""
    return budget.capacity(cls.kv_bytes_per_token(info, kv_type), cls.kv_block)


def _is_id(token: object, n_vocab: int) -> bool:
    """Whether ``token`` is a token id of a vocabulary of ``n_vocab``: an integer, not a bool, in range."""
    return isinstance(token, (int, np.integer)) and not isinstance(token, bool) and 0 <= token < n_vocab


def _closed_error() -> EdgeInferError:
    return EdgeInferError("this engine is closed; create a new Engine")


def _corrupt(model_name: str) -> BackendError:
    return BackendError(f"{model_name} produced NaN or infinite logits: its weights are corrupt; re-download it")


def _check_prompt(prompt: object) -> None:
    if not isinstance(prompt, (str, Continuation)) and not (
        isinstance(prompt, Sequence) and not isinstance(prompt, bytes)
    ):
        raise InvalidOptionError(f"the prompt must be a string or a list of messages, got {type(prompt).__name__}")
