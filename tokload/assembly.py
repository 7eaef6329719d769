"""The loader's assembly stage and the view protocol it reads through.

The one job of this module is to turn the sample indices of one or several
steps into raw arrays, by asking the view, and to say what a view must offer
for the DataLoader to load it. The loader never looks at a view's type: every
view, tokload's own and a user's, is read through ``BatchView``.

The view protocol
-----------------
A view is any object with

- ``len(view)``: the number of observations ``n``; the loader's positions map to
  indices in ``[0, n)``;
- ``view.fingerprint``: a string that identifies the data and the view's
  configuration; the loader's checkpoint records it and a resume on a view with
  another fingerprint is refused;
- ``view.read_batch(indices, alloc) -> dict``: the observations ``indices`` (an
  int64 array) as a dict of arrays. Each array that should become a tensor is
  allocated with ``alloc(shape, dtype)`` and filled in place (the loader passes
  an allocator of pinned memory on GPU hosts: the bytes go from the file into
  the final buffer once). Arrays made otherwise are copied into such a buffer;
  values that are not arrays (a list of records) are passed through as they are.
  The keys ``"index"`` and ``"position"`` are the loader's.

and, optionally,

- ``view.rowwise = True``: every array ``read_batch`` returns has one row per
  index, in order, and reading a concatenation of index arrays gives the
  concatenation of the results. The loader then reads the samples of several
  steps with one call and gives each step its rows (a token stream's fast path);
- ``view.read_steps(indices, cuts, alloc) -> (dict, list[dict])`` with
  ``view.batch_keys`` (a tuple of keys, not empty): for a rowwise view whose
  batches also hold values of the whole batch (a token stream's
  ``cu_seqlens`` and ``max_seqlen``), the read of several steps at once that
  the loader uses instead of ``read_batch``: ``cuts`` gives each step's
  rows ``(a, e)`` of ``indices``; the dict holds the rows' arrays and arrays of
  any shape; the list, for each step, its per-batch values: a ``slice`` of one
  of those arrays, or a value as it is. The loader gives each step its rows of
  the rowwise arrays and those values;
- ``view.read_batches(list_of_indices, alloc) -> list[dict]``: ``read_batch``
  of each index array, in one call, for views that are not rowwise but can read
  several batches in one round of I/O (a stream with metadata blocks); the
  loader uses it for the steps of one task;
- ``view.hint(indices)``: start reading observations ``indices`` in the
  background and return at once (tokload's windowed views advise the kernel with
  ``POSIX_FADV_WILLNEED``); the loader's read-ahead (``tokload.readahead``)
  calls it for the tasks ahead of those being built. With
  ``view.storage_paths() -> list[str]`` too, the loader turns read-ahead on by
  itself where those files are on a network or FUSE filesystem;
- ``view.packing``: a ``tokload.packing.Packing`` (or None): the view's
  observations are documents the loader packs into rows of ``packing.window``
  tokens (``tokload.packing``); it then needs ``view.extents(indices) ->
  (first_rows, lengths)`` for the packer and reads each step with
  ``view.read_rows(rows, alloc)`` (``rows``: a ``PackedRows``), whose arrays
  have one row per packed row or per document; the loader sets ``"index"`` to
  the documents' indices and ``"position"`` to the rows' positions;
- ``view.fingerprint_upto(stop) -> str``: what observations ``[0, stop)``
  depend on (a blend, whose later stages may be added during a run). The loader
  records and compares it instead of ``fingerprint``, for ``stop`` the first
  observation not yet read in order (``n`` once a shuffled run has started).

``read_batch`` runs on the loader's reader threads, several at once: it must be
thread-safe, and should spend its time in calls that release the GIL (NumPy on
large arrays, tokload's reads), not in per-sample Python.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import numpy as np

Alloc = Callable[[tuple[int, ...], Any], np.ndarray]
"""Allocates an uninitialized C-contiguous array: ``alloc(shape, dtype)``. The
loader passes one that returns NumPy views of (pinned) torch tensors."""


@runtime_checkable
class BatchView(Protocol):
    """What the DataLoader needs from a view (see the module docstring)."""

    def __len__(self) -> int: ...

    @property
    def fingerprint(self) -> str: ...

    def read_batch(self, indices: np.ndarray, alloc: Alloc) -> dict[str, Any]: ...


RESERVED_KEYS = ("index", "position")


def check_view(view: object) -> None:
    """Raise TypeError naming what ``view`` lacks of the protocol."""
    missing = [
        name
        for name, ok in (
            ("__len__", callable(getattr(type(view), "__len__", None))),
            ("fingerprint", hasattr(view, "fingerprint")),
            ("read_batch", callable(getattr(view, "read_batch", None))),
        )
        if not ok
    ]
    if getattr(view, "packing", None) is not None:
        missing += [m for m in ("extents", "read_rows") if not callable(getattr(view, m, None))]
    if missing:
        raise TypeError(
            f"{type(view).__name__} is not a view: it lacks {', '.join(missing)} "
            "(a view needs len(), .fingerprint and .read_batch(indices, alloc); "
            "see tokload.assembly)"
        )


def fingerprint_upto(view: Any, stop: int) -> str:
    """What observations ``[0, stop)`` depend on (the whole fingerprint by default)."""
    upto = getattr(view, "fingerprint_upto", None)
    return str(upto(stop) if upto is not None else view.fingerprint)


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
        return self._finish(raw, indices, positions, "read_steps"), steps

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

    def read_rows(self, rows: Any) -> dict[str, Any]:
        """The raw batch of packed ``rows`` (a ``tokload.packing.PackedRows``)."""
        raw = self._check(self.view.read_rows(rows, self.alloc), "read_rows")
        index = self.alloc((len(rows.ids),), np.int64)
        index[:] = rows.ids
        position = self.alloc((len(rows.positions),), np.int64)
        position[:] = rows.positions.view(np.int64)
        raw["index"], raw["position"] = index, position
        return raw

    def check_rows(
        self, raw: dict[str, Any], rows: int, skip: frozenset[str] = frozenset()
    ) -> None:
        """A rowwise view's result must have ``rows`` rows in every array (but
        those of ``skip``: per-batch arrays of ``read_steps``)."""
        for k, v in raw.items():
            if k in skip:
                continue
            if not isinstance(v, np.ndarray) or v.shape[:1] != (rows,):
                got = getattr(v, "shape", type(v).__name__)
                raise ValueError(
                    f"{type(self.view).__name__} is rowwise, but read_batch gave {k!r} "
                    f"as {got} for {rows} samples (need one row per sample)"
                )
