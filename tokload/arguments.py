"""What an integer argument is, in one place.

Every count, size, index and seed a user gives tokload is checked with
``is_integer``: a Python ``int`` or a NumPy integer (a length or an index read
from an array), never a ``bool`` (``window=True`` is a mistake, not a window of
1) and never a float that would be truncated (``seed=1.5`` is not seed 1).
"""

from __future__ import annotations

import math
import numbers
from typing import Any, TypeGuard

import numpy as np

from tokload._permute import MAX_ROUNDS


def is_integer(value: object) -> TypeGuard[int]:
    """Whether ``value`` is an integer argument: an ``int`` or NumPy integer, not a bool.

    Typed as a guard for ``int``: a NumPy integer compares and converts as one.
    """
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))


def is_positive_seconds(value: object) -> bool:
    """Whether ``value`` is a number of seconds > 0 a float holds (not a bool, NaN,
    infinity or an int past a float's range)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        return False
    try:
        return 0 < float(value) < math.inf
    except OverflowError:
        return False


def positive_integer(name: str, value: object, error: type[ValueError] = ValueError) -> int:
    """``value`` as an ``int`` if it is an integer >= 1; ``error`` naming ``name`` if not."""
    if not is_integer(value) or value < 1:
        raise error(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def seed_and_rounds(seed: object, rounds: object) -> tuple[int, int]:
    """A permutation's ``seed`` and ``rounds`` as ints; ValueError naming the one out of range.

    Checked where they are given (a loader, a blend), not at the first epoch's
    permutation: a seed of 1.5 would otherwise run, and resume, as seed 1.
    """
    if not is_integer(seed) or not 0 <= seed < 1 << 64:
        raise ValueError(f"seed must be an integer in [0, 2**64 - 1], got {seed!r}")
    if not is_integer(rounds) or not 0 <= rounds <= MAX_ROUNDS:
        raise ValueError(f"rounds must be an integer in [0, {MAX_ROUNDS}], got {rounds!r}")
    return int(seed), int(rounds)


def check_fits(value: int, dtype: Any, what: str, name: str | None = None) -> int:
    """``value`` as an ``int`` if every field of ``dtype`` (named ``name`` when it is
    one field of a view's) holds it; OverflowError naming ``what``, the value and
    the field if not. (NumPy refuses a Python int out of range, but casts a NumPy
    integer with wraparound: ``np.int64(-1)`` as ``uint16`` is 65535.)"""
    dt = np.dtype(dtype)
    v = int(value)
    fields = [(n, dt.fields[n][0]) for n in dt.names] if dt.fields else [(name, dt)]
    for field_name, field in fields:
        if field.kind in "iu":
            info = np.iinfo(field)
            if not info.min <= v <= info.max:
                where = f"the field {field_name!r} " if field_name is not None else ""
                raise OverflowError(f"{what} {v} does not fit {where}({field})")
    return v
