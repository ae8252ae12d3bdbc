"""Backends by name. Each is imported only when asked for, so a missing optional
dependency of one backend never stops another from loading."""

from __future__ import annotations

import importlib
import logging

from edgeinfer.errors import NATIVE_LOAD_ERRORS, BackendUnavailableError
from edgeinfer.models.info import ModelInfo

from .base import Backend, BackendOptions

log = logging.getLogger("edgeinfer.backends")

# name -> "module:Class", in the order "auto" tries them. A backend registered here runs
# through tests/test_backend_conformance.py without further ado.
BACKENDS: dict[str, str] = {
    "llamacpp": "edgeinfer.backends.llamacpp:LlamaCppBackend",
    "onnxruntime": "edgeinfer.backends.onnx.backend:OnnxRuntimeBackend",
    "opencl": "edgeinfer.backends.opencl.backend:OpenCLBackend",
    "reference": "edgeinfer.backends.reference:ReferenceBackend",
}

AVAILABLE = "available"


def backend_class(name: str) -> type[Backend]:
    """The class registered as ``name``; BackendUnavailableError if it is unknown or cannot load here."""
    if name not in BACKENDS:
        raise BackendUnavailableError(f"unknown backend {name!r}; choose one of auto, {', '.join(BACKENDS)}")
    module_name, _, class_name = BACKENDS[name].partition(":")
    try:
        module = importlib.import_module(module_name)
    except NATIVE_LOAD_ERRORS as exc:
        raise BackendUnavailableError(f"backend {name!r} cannot be loaded: {exc}") from None
    return getattr(module, class_name)


def choose_backend(name: str, info: ModelInfo) -> type[Backend]:
    """The backend to run ``info`` on: ``name``, or for ``"auto"`` the first that loads here and supports it.

    Raises BackendUnavailableError naming each backend's reason when none can.
    """
    if name != "auto":
        cls = backend_class(name)
        reason = cls.supports(info)
        if reason is not None:
            # Name the backends that do run the model, if any, and point at auto, which finds them.
            others = [other for other, status in backend_status(info).items() if other != name and status == AVAILABLE]
            hint = f"; {' and '.join(others)} can: use --backend auto" if others else ""
            raise BackendUnavailableError(f"the {name} backend cannot run this model: {reason}{hint}")
        return cls
    reasons = []
    for status_name, status in backend_status(info).items():
        if status == AVAILABLE:
            if reasons:
                log.info("auto chose %s for %s; skipped %s", status_name, info.path.name, "; ".join(reasons))
            return backend_class(status_name)
        reasons.append(f"{status_name}: {status}")
    raise BackendUnavailableError(f"no backend can run {info.path.name} here (" + "; ".join(reasons) + ")")


def backend_status(info: ModelInfo | None = None) -> dict[str, str]:
    """Each backend's name and either ``"available"`` or why not: it cannot load here, or cannot run ``info``."""
    status = {}
    for name in BACKENDS:
        try:
            cls = backend_class(name)  # loaded, model or not: one that cannot load here is not available
            reason = cls.supports(info) if info is not None else None
        except BackendUnavailableError as exc:
            reason = str(exc)
        status[name] = AVAILABLE if reason is None else reason
    return status


__all__ = ["AVAILABLE", "BACKENDS", "Backend", "BackendOptions", "backend_class", "backend_status", "choose_backend"]
