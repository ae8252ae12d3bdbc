"""edgeinfer: low-bit GGUF language models on the device, hard prompts to the cloud.

The public names load on first use, so ``import edgeinfer`` is instant and the
command line can start (and be interrupted) before numpy or llama.cpp load.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from pathlib import Path as _Path
from typing import TYPE_CHECKING, Any

# pyproject installs the sibling folders backends/, converters/, models/ and tui/ as
# edgeinfer.backends and so on. Imported straight from a source checkout (the repo root on
# sys.path), that mapping is not in force: this finder applies it, for those four names only,
# so the checkout and the installed package import the same modules, once each.
_SIBLINGS = ("backends", "converters", "models", "tui")
_checkout = _Path(__file__).resolve().parent.parent


class _CheckoutFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: object = None, target: object = None) -> importlib.machinery.ModuleSpec | None:
        package, _, sibling = name.partition(".")
        if package != __name__ or sibling not in _SIBLINGS:
            return None
        folder = _checkout / sibling
        return importlib.util.spec_from_file_location(
            name, folder / "__init__.py", submodule_search_locations=[str(folder)]
        )


if (_checkout / "pyproject.toml").is_file() and not any(isinstance(f, _CheckoutFinder) for f in sys.meta_path):
    # First: an editable install of another checkout must not lend this one its folders.
    sys.meta_path.insert(0, _CheckoutFinder())

_EXPORTS = {
    "Continuation": "edgeinfer.chat",
    "Message": "edgeinfer.chat",
    "Cancellation": "edgeinfer.routing.cloud",
    "CircuitBreaker": "edgeinfer.routing.cloud",
    "CloudModel": "edgeinfer.routing.cloud",
    "Usage": "edgeinfer.routing.cloud",
    "AsyncStream": "edgeinfer.streams",
    "Engine": "edgeinfer.engine",
    "Result": "edgeinfer.streams",
    "Stream": "edgeinfer.streams",
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
    "PrivacyRule": "edgeinfer.routing.privacy",
    "Budget": "edgeinfer.routing.router",
    "Policy": "edgeinfer.routing.router",
    "RoutedResult": "edgeinfer.routing.router",
    "Router": "edgeinfer.routing.router",
    "SamplingParams": "edgeinfer.sampling",
    "Speculation": "edgeinfer.speculative",
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
    "Speculation",
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
    from edgeinfer.engine import Engine
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
    from edgeinfer.routing.cloud import Cancellation, CircuitBreaker, CloudModel, Usage
    from edgeinfer.routing.privacy import PrivacyRule
    from edgeinfer.routing.router import Budget, Policy, RoutedResult, Router
    from edgeinfer.sampling import SamplingParams
    from edgeinfer.speculative import Speculation
    from edgeinfer.streams import AsyncStream, Result, Stream
