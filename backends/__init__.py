"""Backends by name. Each is imported only when asked for, so a missing optional
dependency of one backend never stops another from loading."""

from __future__ import annotations

import importlib

from edgeinfer.errors import NATIVE_LOAD_ERRORS, BackendUnavailableError

from .base import Backend, BackendOptions

# name -> "module:Class", in the order "auto" tries them.
BACKENDS: dict[str, str] = {
    "llamacpp": "edgeinfer.backends.llamacpp:LlamaCppBackend",
    "reference": "edgeinfer.backends.reference:ReferenceBackend",
}


def backend_class(name: str) -> type[Backend]:
    """The class registered as ``name`` (``"auto"``: the first one that imports)."""
    if name == "auto":
        reasons = []
        for candidate in BACKENDS:
            try:
                return backend_class(candidate)
            except BackendUnavailableError as exc:
                reasons.append(f"{candidate}: {exc}")
        raise BackendUnavailableError("no backend can run here (" + "; ".join(reasons) + ")")
    if name not in BACKENDS:
        raise BackendUnavailableError(f"unknown backend {name!r}; choose one of auto, {', '.join(BACKENDS)}")
    module_name, _, class_name = BACKENDS[name].partition(":")
    try:
        module = importlib.import_module(module_name)
    except NATIVE_LOAD_ERRORS as exc:
        raise BackendUnavailableError(f"backend {name!r} cannot be loaded: {exc}") from None
    return getattr(module, class_name)


def backend_status() -> dict[str, str]:
    """Each backend's name and either ``"available"`` or why not (for ``edgeinfer info``)."""
    status = {}
    for name in BACKENDS:
        try:
            backend_class(name)
            status[name] = "available"
        except BackendUnavailableError as exc:
            status[name] = str(exc)
    return status


__all__ = ["BACKENDS", "Backend", "BackendOptions", "backend_class", "backend_status"]
