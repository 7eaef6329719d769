"""``TokenStream``: windows of the concatenated token stream (and what windowed views share)."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from tokload._docindex import boundary_arrays, split_cu_seqlens, window_cuts
from tokload._rows import split_fields
from tokload.arguments import positive_integer
from tokload.errors import CorruptDataError, FormatError
from tokload.views.base import DataLike, Fields, ReadPart, View, _check_rows_out, _field_layout
from tokload.views.contract import (
    ATTENTION_KEYS,
    Alloc,
    attention_keys,
    check_step_tokens,
    refuse_field_names,
)


def window_part(
    target: Any, g: np.ndarray, stride: Any, window: int, rows: npt.ArrayLike, out: np.ndarray
) -> ReadPart:
    """The read of the windows of global observations ``g`` (uint64; ``stride``
    rows apart, a scalar or one per window) into rows ``rows`` of ``out`` (a
    plain dtype's ``[B, window]`` array), from ``target`` (a ``RowSet``, or
    ``RowSets.at(...)`` for a blend's), as a part for ``tokload._rows.read_ranges``."""
    w = np.uint64(window)
    lengths = np.full(len(g), w, dtype=np.uint64)
    dst = np.asarray(rows, dtype=np.uint64) * (w * np.uint64(out.dtype.itemsize))
    return (target, g * stride, lengths, dst, out)


class _Windows(View):
    """Shared by the two windowed views: windows of a row stream."""

    def __init__(
        self,
        data: DataLike,
        window: int,
        stride: int | None,
        storage_options: Mapping[str, Any] | None = None,
    ) -> None:
        window = positive_integer("window", window)
        stride = window if stride is None else positive_integer("stride", stride)
        for name, value in (("window", window), ("stride", stride)):
            if value >= 1 << 64:  # (read as a 64-bit row count)
                raise ValueError(f"{name} must be below 2**64, got {value}")
        super().__init__(data, storage_options)
        self.window, self.stride = window, stride
        rows = self.source.num_rows
        self._total = 0 if rows < window else (rows - window) // stride + 1
        self._init_range()

    def _config(self) -> str:
        return f"window={self.window}, stride={self.stride},"

    def _read_windows(self, indices: np.ndarray, dst: np.ndarray) -> None:
        """Windows of observations ``indices`` (checked in C) back to back into dst."""
        self.source.rows.read_windows(indices, self._lo, len(self), self.stride, self.window, dst)

    def _window_reads(self, indices: np.ndarray, rows: np.ndarray, out: np.ndarray) -> ReadPart:
        """The read of windows of observations ``indices`` into rows ``rows`` of
        ``out`` (a plain dtype's ``[B, window]`` array), as a part for
        ``tokload._rows.read_ranges``: a ``Blend`` reads every component's
        windows in one engine call, straight into the batch."""
        return window_part(
            self.source.rows, self._global(indices), np.uint64(self.stride), self.window, rows, out
        )

    def storage_paths(self) -> list[str]:
        """The files a read of this view touches (the loader's read-ahead looks
        at the filesystem they are on)."""
        return list(self.source.rows.files.paths)

    def hint(self, indices: npt.ArrayLike) -> None:
        """The view protocol's read-ahead (``tokload.views.contract``): the kernel
        starts reading the rows of observations ``indices`` into the page cache
        in the background; this returns at once."""
        self.source.rows.hint_windows(indices, self._lo, len(self), self.stride, self.window)

    @staticmethod
    def _indices(indices: npt.ArrayLike) -> np.ndarray:
        a = np.asarray(indices)
        if a.dtype.kind not in "iu" and a.size:
            raise TypeError(f"indices must be integers, got dtype {a.dtype}")
        return a.reshape(-1)


BOUNDARY_KEYS = ATTENTION_KEYS
"""What ``TokenStream(..., boundaries=True)`` adds to a batch."""

BATCH_KEYS = ("cu_seqlens", "max_seqlen")
"""Those of ``BOUNDARY_KEYS`` that belong to a batch, not to its rows."""


def _boundary_keys(boundaries: object) -> tuple[str, ...]:
    """The keys ``boundaries=`` asks for, in ``BOUNDARY_KEYS`` order."""
    return attention_keys(boundaries, "boundaries")


class WindowBoundaries:
    """What a view of windows with the documents' boundaries reads (a
    ``TokenStream(..., boundaries=...)``, and a ``Blend`` of them): the tokens
    (``read``) and the attention keys ``boundary_keys`` names, for one batch
    (``read_batch``) or several steps at once (``read_steps``). The view says
    where documents start inside its windows (``_window_cuts``); the arrays of
    a whole batch are then made in one compiled call (``boundary_arrays``)."""

    window: int
    boundary_keys: tuple[str, ...] = ()
    """The attention keys the batches carry (none: tokens only)."""
    with_boundaries: bool = False
    batch_keys: tuple[str, ...] = ()
    """Those of ``boundary_keys`` that belong to a batch, not to its rows: the loader
    reads tasks through ``read_steps``."""

    def _set_boundary_keys(self, keys: tuple[str, ...]) -> None:
        self.boundary_keys = keys
        self.with_boundaries = bool(keys)
        self.batch_keys = tuple(k for k in keys if k in BATCH_KEYS)

    read: Callable[..., Fields]  # the view's own: its tokens
    empty: Callable[..., Fields]

    def _window_cuts(self, indices: npt.ArrayLike) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``tokload._docindex.window_cuts`` of windows ``indices``."""
        raise NotImplementedError

    def read_batch(self, indices: np.ndarray, alloc: Alloc) -> dict[str, Any]:
        """The view protocol (``tokload.views.contract``): ``"tokens"`` ``[B, window]``
        (or one such array per field of a structured dtype), and with
        ``boundaries`` the arrays ``boundaries`` gives."""
        got = self.read(indices, out=self.empty(len(indices), alloc=alloc))
        out: dict[str, Any] = got if isinstance(got, dict) else {"tokens": got}
        if self.with_boundaries:
            out.update(self.boundaries(indices, alloc))
        return out

    def read_steps(
        self, indices: np.ndarray, cuts: Sequence[tuple[int, int]], alloc: Alloc
    ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """The view protocol's read of several steps at once (``tokload.views.contract``).

        ``cuts`` says which rows of ``indices`` each step has (consecutive
        ``(a, e)``). The windows and their per-token arrays are read and
        computed for all steps in one call each; ``"cu_seqlens"`` is each step's
        own (over its flattened ``[rows, window]`` tokens), the steps' arrays
        back to back in one array, and each step gets a ``slice`` of it and its
        ``"max_seqlen"``: the same values as ``read_batch`` of each step.
        """
        keys = self.boundary_keys
        if cuts and ("cu_seqlens" in keys or "max_seqlen" in keys):  # before any read
            check_step_tokens(max(e - a for a, e in cuts), self.window)
        got = self.read(indices, out=self.empty(len(indices), alloc=alloc))
        raw: dict[str, Any] = got if isinstance(got, dict) else {"tokens": got}
        steps: list[dict[str, Any]] = [{} for _ in cuts]
        if not keys:
            return raw, steps
        arrays, cu, _ = self._window_boundaries(indices, alloc, keys)
        raw.update(arrays)
        if "cu_seqlens" not in keys and "max_seqlen" not in keys:
            return raw, steps
        joined, offsets, longest = split_cu_seqlens(cu, cuts, self.window)
        off, top = offsets.tolist(), longest.tolist()
        if "max_seqlen" not in keys:
            steps = [{"cu_seqlens": slice(a, e)} for a, e in itertools.pairwise(off)]
        elif "cu_seqlens" not in keys:
            steps = [{"max_seqlen": m} for m in top]
        else:
            steps = [
                {"cu_seqlens": slice(a, e), "max_seqlen": m}
                for a, e, m in zip(off, off[1:], top, strict=False)
            ]
        if "cu_seqlens" in keys:
            raw["cu_seqlens"] = joined
        return raw, steps

    def _window_boundaries(
        self, indices: npt.ArrayLike, alloc: Alloc, keys: Sequence[str], whole: bool = False
    ) -> tuple[dict[str, np.ndarray], np.ndarray, int]:
        """``boundary_arrays`` of windows ``indices``; ``whole``: they are one step, whose
        ``cu_seqlens`` (int32) must number its tokens (checked before any is allocated)."""
        starts, ncuts, cuts = self._window_cuts(indices)
        if whole and "cu_seqlens" in keys:
            check_step_tokens(len(starts), self.window)
        try:
            got: tuple[dict[str, np.ndarray], np.ndarray, int] = boundary_arrays(
                starts, self.window, ncuts, cuts, alloc, keys
            )
        except CorruptDataError as e:  # (an index out of order: say whose, where one is)
            source = getattr(self, "source", None)
            if source is None:
                raise
            raise CorruptDataError(f"{source.description}: {e}") from None
        return got

    def boundaries(self, indices: npt.ArrayLike, alloc: Alloc = np.empty) -> dict[str, Any]:
        """Where documents start inside windows ``indices``, as attention metadata.

        ``"position_ids"`` (int64), ``"segment_ids"`` (int32) and ``"loss_mask"``
        (bool), each ``[B, window]`` (allocated with ``alloc``); ``"cu_seqlens"``
        (int32, ``segments + 1`` offsets over the flattened batch) and
        ``"max_seqlen"`` (int, the longest segment): the keys the view's
        ``boundaries`` names (all of them for a view without). Pure functions of the
        windows' rows and the document index, computed in C without the GIL.
        The documents inside a window are found in each shard's document
        table a window spans, where a tokload dataset holds them in memory
        (``TOKLOAD_INDEX_MEMORY``), through the table's directory (buckets of
        rows, about 4 documents each: a search of a few entries); otherwise (a Megatron index,
        an index read entry by entry) by a batched search of the index: a few
        rounds of index reads per batch, at most ``2 log2(documents)``.
        """
        keys = self.boundary_keys or BOUNDARY_KEYS
        arrays, cu, longest = self._window_boundaries(indices, alloc, keys, whole=True)
        if "cu_seqlens" in keys:
            arrays["cu_seqlens"] = cu.astype(np.int32)
        out: dict[str, Any] = dict(arrays)
        if "max_seqlen" in keys:
            out["max_seqlen"] = longest
        return out


class TokenStream(WindowBoundaries, _Windows):
    """Windows of the concatenated token stream.

    Args:
        data: a tokload dataset directory, a Megatron ``.bin/.idx`` prefix, a
            ``.npy`` token file, or a ``Source``; any of them may be an
            object-store URL (``s3://bucket/prefix``, ``gs://``, ``az://``).
        window: rows per observation (e.g. 4097 for 4096-token training with
            the next-token target).
        stride: rows between the starts of consecutive observations (default
            ``window``: non-overlapping). ``len(view)`` is
            ``(rows - window) // stride + 1``.
        boundaries: add, to each batch the DataLoader reads, where the
            documents inside each window start (``boundaries(indices)``): per
            token ``"position_ids"`` (int64, 0 at the start of each document
            and of the window), ``"segment_ids"`` (int32, the document's number
            in the window) and ``"loss_mask"`` (bool, False where a token starts
            the window or a document: as a next-token target it would be
            predicted across a boundary); per batch ``"cu_seqlens"`` (int32,
            the segments' starts over the flattened ``[B * window]`` batch, then
            ``B * window``) and ``"max_seqlen"`` (int). Needs a source with
            documents (a tokload dataset, a Megatron prefix, flat files opened
            with ``eos=`` or ``doc_index=``). The tokens are the same as without,
            and so is the fingerprint (a checkpoint resumes either way). A list
            of those keys computes only them: ``["cu_seqlens", "max_seqlen"]``
            for a variable-length attention kernel writes nothing per token.
        storage_options: for an object-store URL, what overrides the
            environment's settings (endpoint, credentials, retries, requests
            merged; see ``tokload.remote``).

    ``view[i]`` and ``view.read(indices)`` give, for a plain dtype, arrays of
    shape ``[window]`` / ``[B, window]``; for a structured dtype a dict with
    one such array per field. Reads cost one binary search and one ``preadv``
    per shard a window spans, whatever ``i`` is.
    """

    rowwise = True
    """Each observation is one row of every array: the loader reads many steps at once
    (with ``boundaries``, through ``read_steps``: ``cu_seqlens`` and ``max_seqlen``
    belong to a batch, not to its rows)."""

    def __init__(
        self,
        data: DataLike,
        window: int,
        stride: int | None = None,
        *,
        boundaries: bool | Sequence[str] = False,
        storage_options: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__(data, window, stride, storage_options)
        self._set_boundary_keys(_boundary_keys(boundaries))
        refuse_field_names(
            self.source.description,
            self.source.dtype.names or (),
            self.boundary_keys,
            "boundaries=",
            ", or leave it out of boundaries=[...]",
        )
        if self.with_boundaries:
            docs = self.source.docs
            if docs is None or docs.total == 0:
                raise ValueError(
                    f"{self.source.description}: boundaries=True needs document boundaries, "
                    "and this source has none (flat files: open them with "
                    "tokload.open_flat(..., eos=...) or doc_index=)"
                )
            check_sorted = getattr(docs, "check_sorted", None)  # (a Megatron index's)
            if check_sorted is not None:
                check_sorted()
            first, _ = docs.extents([0])
            if int(first[0]) != 0:
                raise FormatError(
                    f"{self.source.description}: its first document starts at row "
                    f"{int(first[0])}, not 0; boundaries=True needs documents that cover "
                    "the stream in order"
                )

    def _window_cuts(self, indices: npt.ArrayLike) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        docs = self.source.docs
        if docs is None:
            raise ValueError(f"{self.source.description} has no document boundaries")
        try:
            got: tuple[np.ndarray, np.ndarray, np.ndarray] = window_cuts(
                docs,
                self._indices(indices),
                self._lo,
                len(self),
                self.stride,
                self.window,
                self.source.num_rows,
            )
        except CorruptDataError as e:  # (an index out of order: say whose)
            raise CorruptDataError(f"{self.source.description}: {e}") from None
        return got

    def __getitem__(self, i: int) -> Fields:
        out = self.read(self._index(i))
        if isinstance(out, dict):
            return {k: v[0] for k, v in out.items()}
        first: np.ndarray = out[0]
        return first

    def empty(self, batch: int, alloc: Alloc = np.empty) -> Fields:
        """Arrays ``read`` can fill for ``batch`` observations."""
        dt = self.source.dtype
        if dt.fields is None:
            return alloc((batch, self.window), dt)
        return {name: alloc((batch, self.window), ft) for name, ft, _ in _field_layout(dt)}

    def read(self, indices: npt.ArrayLike, out: Fields | None = None) -> Fields:
        """Observations ``indices`` into ``out`` (new arrays when None).

        ``out`` must match ``empty`` (dtype, shape ``[B, window]``,
        C-contiguous): the loader passes pinned buffers here.
        """
        idx = self._indices(indices)
        b = len(idx)
        dt = self.source.dtype
        if out is None:
            out = self.empty(b)
        outs = _check_rows_out(out, (b, self.window), dt)
        if dt.fields is None:
            self._read_windows(idx, outs[0])
            return outs[0]
        layout = _field_layout(dt)
        scratch = np.empty((b, self.window), dtype=dt)
        self._read_windows(idx, scratch)
        split_fields(
            scratch,
            b * self.window,
            dt.itemsize,
            [o for _, _, o in layout],
            [ft.itemsize for _, ft, _ in layout],
            outs,
        )
        return out
