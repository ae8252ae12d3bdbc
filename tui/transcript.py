"""Saving a chat (Markdown to read, JSON to continue later) and loading it back.

The JSON holds the messages exactly as the model saw them (system prompt first, so
``engine.chat(data["messages"])`` replays them) and the settings they were made with.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from edgeinfer import EdgeInferError, Message
from edgeinfer.files import write_atomic
from edgeinfer.tui.settings import ChatSettings

FORMAT = "edgeinfer-chat"
VERSION = 1
ROLES = ("system", "user", "assistant")
_HEADINGS = {"system": "System", "user": "You", "assistant": "Assistant"}


class TranscriptError(EdgeInferError):
    """A transcript could not be written or read."""


def save_transcript(path: str | os.PathLike[str], messages: Sequence[Message], settings: ChatSettings) -> Path:
    """Write ``messages`` to ``path``: ``.md`` as Markdown, ``.json`` with the settings. Atomic."""
    path = Path(path).expanduser()
    suffix = path.suffix.lower()
    saved_at = datetime.now(timezone.utc).isoformat(timespec="seconds")
    if suffix == ".json":
        data = {
            "format": FORMAT,
            "version": VERSION,
            "saved_at": saved_at,
            "settings": settings.to_dict(),
            "messages": [{"role": m["role"], "content": m["content"]} for m in messages],
        }
        text = json.dumps(data, indent=2, ensure_ascii=False) + "\n"
    elif suffix in (".md", ".markdown"):
        text = _markdown(messages, settings, saved_at)
    else:
        raise TranscriptError(f"cannot save as {path.name!r}: name the file .md (Markdown) or .json (to /load later)")
    try:
        write_atomic(path, text)
    except OSError as exc:
        raise TranscriptError(f"cannot write {path}: {exc.strerror or exc}") from None
    return path


def load_transcript(path: str | os.PathLike[str]) -> tuple[list[Message], dict[str, Any]]:
    """The messages and settings of a ``.json`` transcript that ``save_transcript`` wrote."""
    path = Path(path).expanduser()
    if path.suffix.lower() != ".json":
        raise TranscriptError(f"cannot load {path.name!r}: only .json transcripts can be loaded (/save FILE.json)")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise TranscriptError(f"cannot read {path}: {exc.strerror or exc}") from None
    except (UnicodeDecodeError, ValueError) as exc:
        raise TranscriptError(f"{path} is not valid JSON ({exc})") from None
    not_ours = TranscriptError(f"{path} is not an edgeinfer chat transcript; load one that /save FILE.json wrote")
    if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("messages"), list):
        raise not_ours
    messages: list[Message] = []
    for m in data["messages"]:
        if not (isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), str)):
            raise not_ours
        messages.append({"role": m["role"], "content": m["content"]})
    settings = data.get("settings")
    return messages, settings if isinstance(settings, dict) else {}


def _markdown(messages: Sequence[Message], settings: ChatSettings, saved_at: str) -> str:
    lines = [
        f"# Chat with {Path(settings.model).name}",
        "",
        f"Saved {saved_at}; backend {settings.backend}, route {settings.route}, "
        f"temperature {settings.temperature}, max tokens {settings.max_tokens}, "
        f"KV budget {settings.kv_budget} ({settings.kv_policy or 'default policy'}).",
    ]
    for m in messages:
        lines += ["", f"## {_HEADINGS[m['role']]}", "", m["content"].strip()]
    return "\n".join(lines) + "\n"
