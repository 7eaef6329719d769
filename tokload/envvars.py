"""tokload's settings read from the environment: the one job of this module is to
read an integer setting and refuse a value that is not one, naming the variable."""

from __future__ import annotations

import os


def env_int(name: str, default: int, low: int, expected: str) -> int:
    """The integer in environment variable ``name``, or ``default`` where it is
    unset or empty. ValueError naming the variable, its value and ``expected``
    (what it should be, e.g. "a number of bytes (>= 0)") where it is not an
    integer or is below ``low``."""
    raw = os.environ.get(name, "")
    if raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        value = low - 1
    if value < low:
        raise ValueError(f"{name}={raw!r}: expected {expected}")
    return value
