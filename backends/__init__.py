"""Backends by name. Each is imported only when asked for, so a missing optional
dependency of one backend never stops another from loading."""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable

from edgeinfer.errors import NATIVE_LOAD_ERRORS, BackendUnavailableError, InvalidOptionError, NoSuchDeviceError
from edgeinfer.kv import MIN_KV_TOKENS
from edgeinfer.models.info import ModelInfo

from .base import CPU, Backend, BackendOptions, check_options

log = logging.getLogger("edgeinfer.backends")

# name -> "module:Class", in the order "auto" tries them. A backend registered here runs
# through tests/test_backend_conformance.py without further ado.
BACKENDS: dict[str, str] = {
    "vulkan": "edgeinfer.backends.vulkan:VulkanBackend",  # first: a real GPU the model fits is auto's choice
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


def choose_backend(
    name: str, info: ModelInfo, options: Callable[[type[Backend]], BackendOptions] | None = None
) -> type[Backend]:
    """The backend to run ``info`` on: ``name``, or for ``"auto"`` the first that loads here and supports it,
    passing over a GPU emulated on the CPU or one the model does not fit (``_passed_over``) with the options
    ``options(cls)`` would load it with (by default the smallest KV cache), and one without the device they ask
    for: ``--opencl-device pocl`` chooses the OpenCL backend.

    Raises BackendUnavailableError naming each backend's reason when none can, and NoSuchDeviceError naming each
    one's devices where none has the device asked for.
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
    reasons, skipped = [], []  # why each backend was not taken; of those that load here, for the note
    missing, passed_over = [], 0  # of those that run the model: without the device asked for; passed over else
    refused = []  # those that load here but cannot run the model: one of them may have the device
    for candidate in BACKENDS:
        try:
            cls = backend_class(candidate)
        except BackendUnavailableError as exc:  # cannot load here: `edgeinfer info` says why, the note does not
            reasons.append(f"{candidate}: {exc}")
            continue
        reason = cls.supports(info)
        if reason is not None:
            refused.append(f"{candidate} cannot run it: {reason}")
        else:
            try:
                reason = _passed_over(cls, info, options)
            except NoSuchDeviceError as exc:
                missing.append(exc)
                reason = str(exc)
            passed_over += reason is not None
        if reason is None:
            if skipped:
                log.info("auto chose %s for %s; skipped %s", candidate, info.path.name, "; ".join(skipped))
            return cls
        reasons.append(f"{candidate}: {reason}")
        skipped.append(f"{candidate}: {reason}")
    if missing and len(missing) == passed_over:  # the device is what to change
        devices = "; ".join([*(f"{exc.backend}'s are {', '.join(exc.devices)}" for exc in missing), *refused])
        raise NoSuchDeviceError(
            f"no backend that runs {info.path.name} here has a device {missing[0].wanted!r}: {devices} (a part of "
            "a name or description chooses one too; `edgeinfer info` describes them)",
            missing[0].wanted,
            "auto",
            [name for exc in missing for name in exc.devices],
        )
    raise BackendUnavailableError(f"no backend can run {info.path.name} here (" + "; ".join(reasons) + ")")


def _passed_over(
    cls: type[Backend], info: ModelInfo, options: Callable[[type[Backend]], BackendOptions] | None
) -> str | None:
    """Why auto passes over a backend that runs ``info``; None where auto may choose it. A backend whose default
    device is a GPU is passed over where that GPU is emulated on the CPU (unless a device was asked for), where
    the options do not suit a GPU (``--gpu-layers 0``), or where its free memory does not fit the model and its
    cache. Options another backend would refuse too are the caller's to fix: their error stands."""
    default = cls.devices()[0]
    try:
        fallback = BackendOptions(kv_tokens=MIN_KV_TOKENS, kv_type=None)  # its default device and KV type
        loading = options(cls) if options is not None else check_options(cls, fallback)
    except InvalidOptionError as exc:
        if isinstance(exc, NoSuchDeviceError) or not default.has_own_memory:
            raise
        return str(exc)
    if loading.device == CPU and default.emulated:
        return f"its device is emulated on the CPU ({default.description}); --backend {cls.name} runs it there"
    need = cls.memory(info, loading)
    if need.device_free is not None and need.device_bytes > need.device_free:
        mib = 2**20
        return (
            f"{info.path.name} needs {need.device_bytes / mib:,.0f} MiB on {need.device}, which has "
            f"{need.device_free / mib:,.0f} MiB free; --backend {cls.name} --gpu-layers N puts part of it there"
        )
    return None


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
