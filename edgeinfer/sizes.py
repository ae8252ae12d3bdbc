"""Sizes as people write them: bytes (``"80MB"``, ``"1.5GiB"``, ``"4096"``), read and written back,
and the token counts (``"512tok"``) a KV budget may be given in instead."""

from __future__ import annotations

import re

from edgeinfer.errors import InvalidOptionError

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}
# ASCII digits only: \d takes any script's, and "١٢tok" read as 12 tokens.
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmg]i?b|b)?\s*$", re.IGNORECASE | re.ASCII)
TOKEN_COUNT = re.compile(r"^\s*(\d+)\s*tok(?:ens)?\s*$", re.IGNORECASE | re.ASCII)


def parse_size(value: str | int, name: str = "size", *, or_else: str = "") -> int:
    """Bytes in ``value``: decimal units (``"80MB"``), binary ones (``"1.5GiB"``), or none (bytes).

    A malformed, zero or token-counted value is a one-line ``InvalidOptionError`` that says what
    the value was for (``name``, e.g. ``"--target-size"``) and the forms it takes; ``or_else``
    adds another form the caller accepts to the fix, e.g. ``" or tokens such as '512tok'"``.
    """
    text = str(value) if isinstance(value, (str, int)) and not isinstance(value, bool) else ""
    if TOKEN_COUNT.match(text):  # where bytes are due, say so rather than 'cannot read'
        raise InvalidOptionError(f"{name} {value!r} counts tokens, not bytes; give a size such as '80MB' or '1.5GiB'")
    match = _SIZE.match(text)
    if match is None:
        raise InvalidOptionError(f"cannot read {name} {value!r}: give a size such as '80MB' or '1.5GiB'{or_else}")
    size = int(float(match.group(1)) * _UNITS[(match.group(2) or "").lower()])
    if size <= 0:
        raise InvalidOptionError(f"{name} {value!r} is zero; give a positive size such as '80MB'{or_else}")
    return size


def format_size(n: int) -> str:
    """``n`` bytes in decimal units, one decimal: ``"64.0 MB"``."""
    for unit, size in (("GB", 10**9), ("MB", 10**6), ("KB", 10**3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"
