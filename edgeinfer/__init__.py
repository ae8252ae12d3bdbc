"""edgeinfer: low-bit GGUF language models on the device, hard prompts to the cloud."""

from __future__ import annotations

from pathlib import Path as _Path

# pyproject maps the sibling folders backends/, models/, ... under edgeinfer.
# When Python imports straight from a source checkout (the repo root on sys.path)
# that mapping is not in force, so point the package at the checkout too.
_checkout = _Path(__file__).resolve().parent.parent
if (_checkout / "pyproject.toml").is_file() and (_checkout / "backends").is_dir():
    __path__.append(str(_checkout))

from edgeinfer.chat import Message  # noqa: E402
from edgeinfer.engine import AsyncStream, Engine, Result, Stream  # noqa: E402
from edgeinfer.errors import (  # noqa: E402
    BackendError,
    BackendUnavailableError,
    ContextFull,
    DownloadError,
    EdgeInferError,
    InsufficientMemoryError,
    InvalidModelError,
    InvalidOptionError,
    ModelNotFoundError,
    TemplateError,
)
from edgeinfer.kv import KVBudget, KVPolicy  # noqa: E402
from edgeinfer.metrics import Metrics  # noqa: E402
from edgeinfer.sampling import SamplingParams  # noqa: E402

__all__ = [
    "AsyncStream",
    "BackendError",
    "BackendUnavailableError",
    "ContextFull",
    "DownloadError",
    "EdgeInferError",
    "Engine",
    "InsufficientMemoryError",
    "InvalidModelError",
    "InvalidOptionError",
    "KVBudget",
    "KVPolicy",
    "Message",
    "Metrics",
    "ModelNotFoundError",
    "Result",
    "SamplingParams",
    "Stream",
    "TemplateError",
]
