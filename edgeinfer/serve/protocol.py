"""The OpenAI wire format: a request body parsed once into a typed ``CompletionRequest``, and the bodies sent back.

Only what the engine honours is accepted. A field it does not support is refused by name (400), except where
the value a client sends asks for nothing (``n: 1``, ``frequency_penalty: 0``, ``logprobs: false``, ...), and
JSON ``null`` means "not given", as OpenAI reads it. ``ignore_eos``, ``top_k`` and ``min_p`` are extensions,
as in llama.cpp's server.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from edgeinfer.chat import Message
from edgeinfer.errors import InvalidOptionError
from edgeinfer.routing.router import RoutedResult
from edgeinfer.sampling import SamplingParams
from edgeinfer.streams import Result

ROLES = ("system", "user", "assistant")
# OpenAI's newer name for the system role.
ROLE_ALIASES = {"developer": "system"}
MAX_STOPS = 4  # OpenAI's limit
EXTENSION = "edgeinfer"  # the field of every response that carries route, reason, degraded and timings

# Fields the client may send with a value that asks for nothing beyond what the engine does anyway.
NEUTRAL = {
    "n": 1,
    "best_of": 1,
    "frequency_penalty": 0,
    "presence_penalty": 0,
    "logprobs": False,
    "echo": False,
    "suffix": "",
    "parallel_tool_calls": True,
}
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "max_tokens", "stop", "seed", "ignore_eos")
COMMON_FIELDS = ("model", "stream", "stream_options", "user", *SAMPLING_FIELDS, *NEUTRAL)
CHAT_FIELDS = frozenset((*COMMON_FIELDS, "messages", "max_completion_tokens"))
COMPLETION_FIELDS = frozenset((*COMMON_FIELDS, "prompt"))


class APIError(Exception):
    """A request refused with an OpenAI error object: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        kind: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class CompletionRequest:
    """One ``/v1/chat/completions`` (``messages``) or ``/v1/completions`` (``prompt``, raw text) request."""

    model: str
    params: SamplingParams
    messages: list[Message] | None = None
    prompt: str | None = None
    stream: bool = False
    include_usage: bool = False

    @property
    def chat(self) -> bool:
        return self.messages is not None


def parse_request(body: bytes, *, chat: bool) -> CompletionRequest:
    """The request in ``body``, or an ``APIError`` (400) naming what is wrong and how to put it right."""
    try:
        data = json.loads(body)
    except UnicodeDecodeError:
        raise APIError(400, "the request body is not valid UTF-8; send JSON encoded as UTF-8") from None
    except json.JSONDecodeError as exc:
        raise APIError(400, f"the request body is not valid JSON ({exc.msg} at character {exc.pos})") from None
    if not isinstance(data, dict):
        raise APIError(400, f"the request body must be a JSON object, not {_json_type(data)}")
    given = {key: value for key, value in data.items() if value is not None}
    allowed = CHAT_FIELDS if chat else COMPLETION_FIELDS
    for key, value in given.items():
        if key not in allowed:
            raise APIError(400, f"the field {key!r} is not supported by this server; remove it", param=key)
        if key in NEUTRAL and value != NEUTRAL[key]:
            neutral = json.dumps(NEUTRAL[key])
            raise APIError(400, f"{key}={json.dumps(value)} is not supported; omit it or send {neutral}", param=key)
    model = given.get("model", "")
    if not isinstance(model, str):
        raise APIError(400, "model must be a string", param="model")
    stream = _typed(given, "stream", bool, False)
    options = given.get("stream_options", {})
    if not isinstance(options, dict) or set(options) - {"include_usage"}:
        raise APIError(400, 'stream_options takes only {"include_usage": true|false}', param="stream_options")
    include_usage = _typed(options, "include_usage", bool, False, param="stream_options.include_usage")
    if options and not stream:
        raise APIError(400, "stream_options needs stream: true", param="stream_options")
    if chat and "max_completion_tokens" in given:
        given.setdefault("max_tokens", given["max_completion_tokens"])
    params = _sampling(given)
    request = CompletionRequest(
        model=model,
        params=params,
        stream=stream,
        include_usage=include_usage,
    )
    if chat:
        return dataclasses.replace(request, messages=_messages(given.get("messages")))
    return dataclasses.replace(request, prompt=_prompt(given.get("prompt")))


def _sampling(given: dict[str, Any]) -> SamplingParams:
    values: dict[str, Any] = {}
    for name in ("temperature", "top_p", "min_p"):
        if name in given:
            value = given[name]
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise APIError(400, f"{name} must be a number", param=name)
            values[name] = float(value)
    for name in ("top_k", "max_tokens", "seed"):
        if name in given:
            values[name] = _typed(given, name, int, None)
    if "ignore_eos" in given:
        values["ignore_eos"] = _typed(given, "ignore_eos", bool, False)
    if "stop" in given:
        stop = given["stop"]
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > MAX_STOPS:
            raise APIError(400, f"stop must be a string or a list of up to {MAX_STOPS} non-empty strings", param="stop")
        values["stop"] = tuple(_text(s, "stop") for s in stops)
    try:
        return SamplingParams(**values)
    except InvalidOptionError as exc:
        raise APIError(400, str(exc)) from None


def _messages(value: object) -> list[Message]:
    if not isinstance(value, list) or not value:
        raise APIError(400, "messages must be a non-empty list of {role, content} objects", param="messages")
    messages: list[Message] = []
    for i, message in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise APIError(400, f"{where} must be an object with role and content", param=where)
        message = {key: value for key, value in message.items() if value is not None}  # null: not given
        extra = set(message) - {"role", "content", "name"}
        if extra:
            raise APIError(400, f"{where}.{sorted(extra)[0]} is not supported; send role and content", param=where)
        role = message.get("role")
        role = ROLE_ALIASES.get(role, role) if isinstance(role, str) else role
        if role not in ROLES:
            raise APIError(
                400, f"{where}.role {message.get('role')!r} is unknown; use one of {', '.join(ROLES)}", param=where
            )
        messages.append({"role": role, "content": _content(message.get("content"), f"{where}.content")})
    return messages


def _content(value: object, where: str) -> str:
    """A message's text: a string, or OpenAI's list of text parts."""
    if isinstance(value, str):
        return _text(value, where)
    if isinstance(value, list) and all(isinstance(part, dict) for part in value):
        texts = []
        for part in value:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise APIError(400, f"{where} may hold only text parts; this model reads text", param=where)
            texts.append(_text(part["text"], where))
        return "".join(texts)
    raise APIError(400, f"{where} must be a string or a list of text parts", param=where)


def _prompt(value: object) -> str:
    if isinstance(value, list) and len(value) == 1:  # the OpenAI client's one-prompt batch
        value = value[0]
    if not isinstance(value, str):
        raise APIError(
            400, "prompt must be one string (token ids and batches of prompts are not supported)", param="prompt"
        )
    return _text(value, "prompt")


def _text(value: str, where: str) -> str:
    """``value`` if it is UTF-8 text; JSON's ``\\ud800`` escapes can spell halves of a character that UTF-8 lacks."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise APIError(400, f"{where} is not valid UTF-8 text (it holds a lone surrogate)", param=where) from None
    return value


def _typed(data: Mapping[str, Any], name: str, kind: type, default: Any, *, param: str | None = None) -> Any:
    if name not in data:
        return default
    value = data[name]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        what = "an integer" if kind is int else "true or false"
        raise APIError(400, f"{param or name} must be {what}", param=param or name)
    return value


def _json_type(value: object) -> str:
    return {list: "an array", str: "a string", bool: "a boolean", int: "a number", float: "a number"}.get(
        type(value), "null"
    )


# -- responses -----------------------------------------------------------------------------------


def usage(result: Result) -> dict[str, int]:
    m = result.metrics
    return {
        "prompt_tokens": m.prompt_tokens,
        "completion_tokens": m.output_tokens,
        "total_tokens": m.prompt_tokens + m.output_tokens,
    }


def extension(result: Result) -> dict[str, Any]:
    """Where the answer came from and why, and our timings: the field ``edgeinfer`` of each response."""
    m = result.metrics
    routed = isinstance(result, RoutedResult)
    return {
        "route": result.route,
        "reason": result.reason if routed else "answered on this device",
        "degraded": result.degraded if routed else False,
        "backend": result.backend,
        "timings": {
            "prompt_tokens": m.prompt_tokens,
            "cached_tokens": m.cached_tokens,
            "completion_tokens": m.output_tokens,
            "ttft_ms": round(m.ttft_s * 1000, 3),
            "tpot_ms": round(m.tpot_s * 1000, 3),
            "prefill_ms": round(m.prefill_s * 1000, 3),
            "total_ms": round(m.total_s * 1000, 3),
        },
    }


def finish_reason(result: Result) -> str:
    return "stop" if result.finish_reason == "stop" else "length"


def response_body(request: CompletionRequest, result: Result, ident: str, created: int, model: str) -> dict[str, Any]:
    """The whole answer, not streamed."""
    reason = finish_reason(result)
    if request.chat:
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": result.text},
            "finish_reason": reason,
            "logprobs": None,
        }
    else:
        choice = {"index": 0, "text": result.text, "finish_reason": reason, "logprobs": None}
    return {
        "id": ident,
        "object": "chat.completion" if request.chat else "text_completion",
        "created": created,
        "model": model,
        "choices": [choice],
        "usage": usage(result),
        EXTENSION: extension(result),
    }


def chunk_body(
    request: CompletionRequest,
    ident: str,
    created: int,
    model: str,
    *,
    text: str | None = None,
    result: Result | None = None,
    first: bool = False,
) -> dict[str, Any]:
    """One event of a streamed answer: a piece of ``text``, or the last one (``result``: why it ended)."""
    reason = finish_reason(result) if result is not None else None
    if request.chat:
        delta: dict[str, Any] = {}
        if first:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": reason, "logprobs": None}
    else:
        choice = {"index": 0, "text": text or "", "finish_reason": reason, "logprobs": None}
    body: dict[str, Any] = {
        "id": ident,
        "object": "chat.completion.chunk" if request.chat else "text_completion",
        "created": created,
        "model": model,
        "choices": [choice],
    }
    if request.include_usage:
        body["usage"] = None
    if result is not None:
        body[EXTENSION] = extension(result)
    return body


def usage_chunk(request: CompletionRequest, ident: str, created: int, model: str, result: Result) -> dict[str, Any]:
    """The event ``stream_options.include_usage`` asks for, after the last choice: no choices, the usage."""
    return {
        "id": ident,
        "object": "chat.completion.chunk" if request.chat else "text_completion",
        "created": created,
        "model": model,
        "choices": [],
        "usage": usage(result),
    }
