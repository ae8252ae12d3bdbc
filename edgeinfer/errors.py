"""The errors edgeinfer raises on purpose.

Every one carries a single-line message that names the problem and the fix;
the CLI prints it as ``error: <message>`` and exits non-zero.
"""

from __future__ import annotations


class EdgeInferError(Exception):
    """Base class: a problem the user can fix, described in one line."""


class ModelNotFoundError(EdgeInferError):
    """The model path, alias or hf: reference does not lead to a file."""


class InvalidModelError(EdgeInferError):
    """The file is not a GGUF model edgeinfer can load (bad magic, truncated, missing keys)."""


class DownloadError(EdgeInferError):
    """A model could not be downloaded (no network, unknown repo or file)."""


class BackendUnavailableError(EdgeInferError):
    """The requested backend cannot run here (not installed, or its native build faults)."""


class InsufficientMemoryError(EdgeInferError):
    """Loading the model would not fit in the RAM that is available."""


class TemplateError(EdgeInferError):
    """The chat template failed to render or tried to escape the sandbox."""


class ContextFull(EdgeInferError):
    """The KV cache is full and the policy is ``error``.

    ``partial`` holds the text generated before the cache filled, if any.
    """

    def __init__(self, message: str, partial: str = "") -> None:
        super().__init__(message)
        self.partial = partial


class InvalidOptionError(EdgeInferError, ValueError):
    """An option is out of range or malformed (a sampling parameter, a KV budget, a thread count)."""


class NoSuchDeviceError(InvalidOptionError):
    """A backend has no device ``wanted``: ``backend``, and the names of its ``devices``."""

    def __init__(self, message: str, wanted: str, backend: str, devices: list[str]) -> None:
        super().__init__(message)
        self.wanted, self.backend, self.devices = wanted, backend, devices


class BackendError(EdgeInferError):
    """A backend failed while loading or evaluating (a native error code, out of memory)."""


class CloudError(EdgeInferError):
    """A cloud model call failed for good (after its retries).

    ``kind`` says how: ``timeout``, ``connection``, ``rate_limited``, ``server``, ``auth``, ``quota``,
    ``bad_request``, ``protocol`` (a malformed answer), ``circuit_open`` or ``cancelled``;
    ``status`` is the HTTP status if there was one; ``retry_after`` the wait the server asked for.
    """

    def __init__(self, message: str, kind: str, status: int | None = None, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.status = status
        self.retry_after = retry_after


class ConversionError(EdgeInferError):
    """A Hugging Face checkpoint cannot be converted (missing file or shard, unsupported
    architecture or dtype, a tensor whose shape contradicts config.json)."""


# What importing a native library's Python binding raises when the package is missing or its
# shared library will not load (a backend, the tokenizer's llama.cpp).
NATIVE_LOAD_ERRORS = (ImportError, OSError, RuntimeError)


def first_line(exc: BaseException) -> str:
    """What ``exc`` says, in one line (a native library's message may run to many), or its class if it says nothing."""
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]
