"""tokload's settings read from the environment: the one job of this module is to
read an integer setting and refuse a value that is not one, naming the variable."""

from __future__ import annotations

import os

from tokload.errors import UsageError


def env_int(name: str, default: int, low: int, expected: str, high: int = (1 << 63) - 1) -> int:
    """The integer in environment variable ``name``, or ``default`` where it is
    unset or empty. UsageError (a ValueError; the command line exits with 2)
    naming the variable, its value and ``expected``
    (what it should be, e.g. "a number of bytes (>= 0)") where it is not an
    integer or is outside ``[low, high]`` (by default, what C's int64 holds: a
    larger one would overflow where the value reaches C)."""
    raw = os.environ.get(name, "")
    if raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        value = low - 1
    if not low <= value <= high:
        raise UsageError(f"{name}={raw!r}: expected {expected}, at most {high:,}")
    return value
