"""The loader's assembly stage: sample indices -> raw arrays, through the view protocol.

The one job of this module is to turn the sample indices of one or several
steps into raw arrays by asking the view (``Stack``, the batching policy of
windows and records, reads through it), and to check what the view returned.
The protocol itself is ``tokload.views.contract``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tokload.transfer import is_tensor
from tokload.views.contract import RESERVED_KEYS, Alloc, check_view


class Assembly:
    """Sample indices -> raw batches, through the view protocol.

    Args:
        view: any ``BatchView``.
        alloc: the transfer stage's allocator.
    """

    def __init__(self, view: Any, alloc: Alloc) -> None:
        check_view(view)
        self.view = view
        self.alloc = alloc
        self.rowwise = bool(getattr(view, "rowwise", False))
        steps = getattr(view, "read_steps", None)
        self.stepwise = self.rowwise and callable(steps) and bool(getattr(view, "batch_keys", ()))

    def read(self, indices: np.ndarray, positions: np.ndarray) -> dict[str, Any]:
        """The raw batch of samples ``indices`` at global ``positions`` (both 1-D)."""
        return self._finish(self.view.read_batch(indices, self.alloc), indices, positions)

    def read_steps(
        self, indices: np.ndarray, positions: np.ndarray, cuts: list[tuple[int, int]]
    ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """``read`` of several steps' samples through the view's ``read_steps``:
        the raw arrays, and each step's per-batch values (a ``slice`` of a raw
        array, or a value)."""
        got = self.view.read_steps(indices, cuts, self.alloc)
        name = type(self.view).__name__
        if not (isinstance(got, tuple) and len(got) == 2 and isinstance(got[1], list)):
            raise TypeError(f"{name}.read_steps returned {type(got).__name__}, not (dict, list)")
        raw, steps = got
        if len(steps) != len(cuts):
            raise TypeError(f"{name}.read_steps gave {len(steps)} steps for {len(cuts)}")
        out = self._finish(raw, indices, positions, "read_steps")
        # Every step the first's keys, each a slice in every step or a value in every
        # one: the loader cuts a task's steps by the first's (no call a key or step).
        first: dict[str, Any] = steps[0] if steps and isinstance(steps[0], dict) else {}
        nkeys = len(first)
        for j, st in enumerate(steps):
            if not isinstance(st, dict):
                raise TypeError(f"{name}.read_steps gave a step of {type(st).__name__}, not a dict")
            n = 0
            for key in st:
                n += 1
                if key in RESERVED_KEYS:
                    raise ValueError(
                        f"{name}.read_steps gave a step the key {key!r}, which the loader sets"
                    )
                is_slice = st[key].__class__ is slice
                if key not in first or (first[key].__class__ is slice) is not is_slice:
                    self._unlike(j, key, first, st)
                if is_slice and key not in out:
                    raise ValueError(
                        f"{name}.read_steps gave a step a slice of {key!r}, which its arrays "
                        f"lack (they hold {', '.join(map(repr, raw))})"
                    )
            if n != nkeys:
                self._unlike(j, next(k for k in first if k not in st), first, st)
        return out, steps

    def _unlike(self, j: int, key: str, first: dict[str, Any], st: dict[str, Any]) -> None:
        """ValueError: step ``j`` of ``read_steps`` gives ``key`` otherwise than step 0."""

        def given(step: dict[str, Any]) -> str:
            if key not in step:
                return "no value"
            return "a slice" if isinstance(step[key], slice) else "a value"

        raise ValueError(
            f"{type(self.view).__name__}.read_steps gave step {j} {given(st)} of {key!r}, "
            f"and step 0 {given(first)}: every step gives the same keys (its batch_keys), "
            "each a slice of an array in every step or a value in every step"
        )

    def read_many(self, parts: list[tuple[np.ndarray, np.ndarray]]) -> list[dict[str, Any]]:
        """``read`` of each ``(indices, positions)``; one ``read_batches`` call
        where the view has it."""
        many = getattr(self.view, "read_batches", None)
        if many is None or len(parts) < 2:
            return [self.read(i, p) for i, p in parts]
        raws = many([i for i, _ in parts], self.alloc)
        if not isinstance(raws, list) or len(raws) != len(parts):
            got = len(raws) if isinstance(raws, list) else type(raws).__name__
            raise TypeError(
                f"{type(self.view).__name__}.read_batches returned {got}, "
                f"not a list of {len(parts)} dicts"
            )
        return [
            self._finish(r, i, p, "read_batches") for r, (i, p) in zip(raws, parts, strict=True)
        ]

    def _finish(
        self, raw: Any, indices: np.ndarray, positions: np.ndarray, how: str = "read_batch"
    ) -> dict[str, Any]:
        out = self._check(raw, how)
        # One buffer for both: half the allocations of a batch's bookkeeping.
        both = self.alloc((2, len(indices)), np.int64)
        both[0] = indices
        both[1] = positions.view(np.int64)
        out["index"] = both[0]
        out["position"] = both[1]
        return out

    def _check(self, raw: Any, how: str) -> dict[str, Any]:
        """What the view's ``how`` returned, checked: a dict without the loader's keys."""
        if not isinstance(raw, dict):
            raise TypeError(
                f"{type(self.view).__name__}.{how} returned {type(raw).__name__}, not a dict"
            )
        for key in RESERVED_KEYS:
            if key in raw:
                raise ValueError(
                    f"{type(self.view).__name__}.{how} returned the key {key!r}, "
                    "which the loader sets"
                )
        return raw

    def check_rows(
        self, raw: dict[str, Any], rows: int, skip: frozenset[str] = frozenset()
    ) -> None:
        """A rowwise view's result must have ``rows`` rows in every array (but
        those of ``skip``: per-batch arrays of ``read_steps``)."""
        for k, v in raw.items():
            if k in skip:
                continue
            # (a tensor of the view's own: its rows are cut, then copied, as an array's)
            if (not isinstance(v, np.ndarray) and not is_tensor(v)) or tuple(v.shape[:1]) != (
                rows,
            ):
                got = getattr(v, "shape", type(v).__name__)
                raise ValueError(
                    f"{type(self.view).__name__} is rowwise, but read_batch gave {k!r} "
                    f"as {got} for {rows} samples (need one row per sample)"
                )
