"""Chat templates: the GGUF's own ``tokenizer.chat_template``, rendered in jinja2's sandbox.

A chat template is code shipped inside a model file, so it is untrusted
(CVE-2024-34359 ran shell commands from one). It renders in jinja2's
ImmutableSandboxedEnvironment: attribute access to Python internals raises
SecurityError before anything runs, and the template cannot mutate its inputs.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from functools import cached_property
from typing import Any, TypedDict

import jinja2
from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from edgeinfer.errors import InvalidOptionError, TemplateError


class Message(TypedDict):
    """One chat turn: ``{"role": "system"|"user"|"assistant", "content": "..."}``."""

    role: str
    content: str


@dataclass(frozen=True)
class Continuation:
    """A chat whose last turn, the assistant's ``answer`` so far, is to be continued rather than answered.

    The answer's turn is left open; like every message's content, the answer is text, whatever
    control tokens it spells.
    """

    messages: Sequence[Message]
    answer: str


# Used when a model ships no template; ChatML is what most small instruct models expect.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


# Used when a model ships no template and has no ChatML tokens either: a base model, which knows
# no turns but continues a plain transcript well enough. The next "User:" line ends its answer.
TRANSCRIPT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'] + '\n\n' }}"
    "{% else %}{{ message['role'] | capitalize + ': ' + message['content'] + '\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)
# A base model writes further turns of both speakers; the answer ends at the first.
TRANSCRIPT_STOPS = ("\nUser:", "\nAssistant:")
CHATML_MARKER = "<|im_start|>"


# The most text a conversation's messages may hold, all together: far beyond any KV budget
# of an edge model, and a bound on what a caller can make us hold.
MAX_CONTENT_CHARS = 1_000_000
# What a template may add around the messages; more is a broken or hostile template
# (`{{ 'A' * 10**9 }}` would take gigabytes before anything else could object).
MAX_RENDERED_CHARS = 1_000_000


class _TemplateSandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox, plus a cap on what ``*`` and ``**`` may build."""

    intercepted_binops = frozenset({"*", "**"})

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and len(seq) * n > MAX_RENDERED_CHARS:
                    raise TemplateError(f"the chat template builds a value of {len(seq) * n:,} items; refused")
        if operator == "**" and isinstance(right, int) and right > 1000:
            raise TemplateError(f"the chat template raises a number to the power {right}; refused")
        return super().call_binop(context, operator, left, right)


# Stands for message i's content while a template renders, to find where the content goes.
_PLACEHOLDER = re.compile("\ue000([0-9]+)\ue001")


def _raise_exception(message: str) -> None:
    # Templates call raise_exception() to reject conversations they cannot format.
    raise TemplateError(f"the chat template rejected the conversation: {message}")


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(value: Any, indent: int | None = None) -> str:
    # jinja2's own tojson HTML-escapes quotes and non-ASCII, which corrupts tool schemas.
    return json.dumps(value, ensure_ascii=False, indent=indent)


class ChatTemplate:
    """A compiled, sandboxed chat template.

    ``bos_token`` and ``eos_token`` are exposed to the template as Hugging Face does;
    the rendered text is tokenized with special-token parsing, so do not add BOS again.
    """

    def __init__(self, source: str | None, *, bos_token: str = "", eos_token: str = "", chatml: bool = True) -> None:
        """``source`` None or blank: ChatML, or where the vocabulary has no ChatML tokens (``chatml`` false),
        a plain transcript whose answers end where the next user line would start (``stops``)."""
        self.is_default = source is None or not source.strip()
        self.is_transcript = self.is_default and not chatml
        self.source = TRANSCRIPT_TEMPLATE if self.is_transcript else source or CHATML_TEMPLATE
        self.stops: tuple[str, ...] = TRANSCRIPT_STOPS if self.is_transcript else ()
        self._bos_token = bos_token
        self._eos_token = eos_token

    @cached_property
    def _template(self) -> jinja2.Template:
        env = _TemplateSandbox(trim_blocks=True, lstrip_blocks=True)
        env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now)
        env.filters["tojson"] = _tojson
        try:
            return env.from_string(self.source)
        except jinja2.TemplateError as exc:
            raise TemplateError(f"the model's chat template does not compile: {_one_line(exc)}") from None

    def render(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True) -> str:
        """Render ``messages`` to the prompt text the model was trained on."""
        if isinstance(messages, (str, bytes)) or not messages:
            raise TemplateError("a chat needs a non-empty list of messages")
        for i, message in enumerate(messages):
            if not isinstance(message, Mapping) or "role" not in message or "content" not in message:
                raise TemplateError(f"message {i} must be a mapping with 'role' and 'content' keys")
            if not isinstance(message["role"], str) or not isinstance(message["content"], str):
                raise TemplateError(f"message {i}: 'role' and 'content' must be strings")
        content_chars = sum(len(m["content"]) for m in messages)
        if content_chars > MAX_CONTENT_CHARS:
            raise InvalidOptionError(
                f"the conversation is {content_chars:,} characters, over the limit of {MAX_CONTENT_CHARS:,}; shorten it"
            )
        limit = content_chars + MAX_RENDERED_CHARS
        try:
            pieces = self._template.generate(
                messages=[dict(m) for m in messages],
                add_generation_prompt=add_generation_prompt,
                bos_token=self._bos_token,
                eos_token=self._eos_token,
            )
            out, size = [], 0
            for piece in pieces:
                size += len(piece)
                if size > limit:
                    raise TemplateError(
                        f"the chat template adds over {MAX_RENDERED_CHARS:,} characters to the messages; refused"
                    )
                out.append(piece)
            return "".join(out)
        except SecurityError as exc:
            raise TemplateError(
                f"the chat template tried to reach Python internals and was stopped ({_one_line(exc)}); "
                "this model file is unsafe: use a model from a source you trust"
            ) from None
        except TemplateError:
            raise
        except Exception as exc:  # template code can raise anything: TypeError, ZeroDivisionError, ...
            raise TemplateError(f"the chat template failed to render: {type(exc).__name__}: {_one_line(exc)}") from None

    def content_spans(
        self, messages: Sequence[Mapping[str, Any]], rendered: str, *, add_generation_prompt: bool = True
    ) -> list[tuple[int, int]] | None:
        """Exactly where the messages' contents stand in ``rendered``, this template's rendering of them.

        Found by rendering a placeholder in each content's place and putting the contents back,
        as they are or trimmed (Gemma's templates trim). None if that does not give ``rendered``
        back: the template rewrites content some other way, or looks inside it.
        """
        marks = [dict(m, content=f"\ue000{i}\ue001") for i, m in enumerate(messages)]
        skeleton = self.render(marks, add_generation_prompt=add_generation_prompt)
        for fill in (str, str.strip):
            pieces: list[str] = []
            spans: list[tuple[int, int]] = []
            size = done = 0
            for mark in _PLACEHOLDER.finditer(skeleton):
                content = fill(messages[int(mark[1])]["content"])
                pieces += [skeleton[done : mark.start()], content]
                size += mark.start() - done
                spans.append((size, size + len(content)))
                size += len(content)
                done = mark.end()
            pieces.append(skeleton[done:])
            if "".join(pieces) == rendered:
                return spans
        return None


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())
