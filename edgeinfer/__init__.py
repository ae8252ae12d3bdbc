"""edgeinfer: low-bit GGUF language models on the device, hard prompts to the cloud.

The public names load on first use, so ``import edgeinfer`` is instant and the
command line can start (and be interrupted) before numpy or llama.cpp load.
"""

from __future__ import annotations

import importlib
from pathlib import Path as _Path
from typing import TYPE_CHECKING, Any

# pyproject maps the sibling folders backends/, models/, ... under edgeinfer.
# When Python imports straight from a source checkout (the repo root on sys.path)
# that mapping is not in force, so point the package at the checkout too.
_checkout = _Path(__file__).resolve().parent.parent
if (_checkout / "pyproject.toml").is_file() and (_checkout / "backends").is_dir():
    __path__.append(str(_checkout))

_EXPORTS = {
    "Continuation": "edgeinfer.chat",
    "Message": "edgeinfer.chat",
    "Cancellation": "edgeinfer.cloud",
    "CircuitBreaker": "edgeinfer.cloud",
    "CloudModel": "edgeinfer.cloud",
    "Usage": "edgeinfer.cloud",
    "AsyncStream": "edgeinfer.engine",
    "Engine": "edgeinfer.engine",
    "Result": "edgeinfer.engine",
    "Stream": "edgeinfer.engine",
    "BackendError": "edgeinfer.errors",
    "BackendUnavailableError": "edgeinfer.errors",
    "CloudError": "edgeinfer.errors",
    "ContextFull": "edgeinfer.errors",
    "DownloadError": "edgeinfer.errors",
    "EdgeInferError": "edgeinfer.errors",
    "InsufficientMemoryError": "edgeinfer.errors",
    "InvalidModelError": "edgeinfer.errors",
    "InvalidOptionError": "edgeinfer.errors",
    "ModelNotFoundError": "edgeinfer.errors",
    "TemplateError": "edgeinfer.errors",
    "KVBudget": "edgeinfer.kv",
    "KVPolicy": "edgeinfer.kv",
    "Metrics": "edgeinfer.metrics",
    "PrivacyRule": "edgeinfer.privacy",
    "Budget": "edgeinfer.router",
    "Policy": "edgeinfer.router",
    "RoutedResult": "edgeinfer.router",
    "Router": "edgeinfer.router",
    "SamplingParams": "edgeinfer.sampling",
}
__all__ = [
    "AsyncStream",
    "BackendError",
    "BackendUnavailableError",
    "Budget",
    "Cancellation",
    "CircuitBreaker",
    "CloudError",
    "CloudModel",
    "ContextFull",
    "Continuation",
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
    "Policy",
    "PrivacyRule",
    "Result",
    "RoutedResult",
    "Router",
    "SamplingParams",
    "Stream",
    "TemplateError",
    "Usage",
]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'edgeinfer' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


if TYPE_CHECKING:
    from edgeinfer.chat import Continuation, Message
    from edgeinfer.cloud import Cancellation, CircuitBreaker, CloudModel, Usage
    from edgeinfer.engine import AsyncStream, Engine, Result, Stream
    from edgeinfer.errors import (
        BackendError,
        BackendUnavailableError,
        CloudError,
        ContextFull,
        DownloadError,
        EdgeInferError,
        InsufficientMemoryError,
        InvalidModelError,
        InvalidOptionError,
        ModelNotFoundError,
        TemplateError,
    )
    from edgeinfer.kv import KVBudget, KVPolicy
    from edgeinfer.metrics import Metrics
    from edgeinfer.privacy import PrivacyRule
    from edgeinfer.router import Budget, Policy, RoutedResult, Router
    from edgeinfer.sampling import SamplingParams
