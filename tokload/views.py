"""Observation views: a dataset read as a plain list, ``view[i]``, in constant time.

- ``TokenStream``: observation ``i`` is rows ``[i*stride, i*stride + window)``
  of the concatenated stream (it may span shards).
- ``Documents``: observation ``i`` is document ``i``.
- ``StreamWithMetadata``: token windows plus, per token, the position of
  its metadata record in the list of distinct records of the window (or of the
  batch), and that list.

Each view has ``len(view)``, ``view[i]`` and a bulk ``view.read(indices,
out=...)`` that fills preallocated arrays in one call into the C core, without
the GIL. Any view can be cut to a contiguous range of its observations with
``subset`` (or ``split``, Megatron's ``"969,30,1"`` style) at no cost.
"""

from __future__ import annotations

import itertools
import operator
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Self, TypeVar

import numpy as np
import numpy.typing as npt

from tokload._docindex import read_documents, split_cu_seqlens, window_boundaries
from tokload._io import FileSet
from tokload._meta import BlockSet, Scratch, compact_records
from tokload._rows import split_fields
from tokload.assembly import Alloc
from tokload.batching import ATTENTION_KEYS, Fill, Pack, Pad, attention_keys
from tokload.errors import FormatError, MissingShardError
from tokload.forksafe import ForkSafeLock
from tokload.format import (
    MANIFEST,
    METADATA_FIELD,
    Location,
    Source,
    open_dataset,
    open_dataset_at,
)

DataLike = str | os.PathLike[str] | Source
Fields = np.ndarray | dict[str, np.ndarray]
V = TypeVar("V", bound="View")


def open_source(data: DataLike, storage_options: Mapping[str, Any] | None = None) -> Source:
    """A Source from a tokload dataset directory, a Megatron prefix, a ``.npy``
    token file, or a Source.

    Each may be an object-store URL (``s3://bucket/prefix``, ``gs://``,
    ``az://``), read in place with ranged GETs; ``storage_options`` overrides
    the store's settings from the environment (see ``tokload.remote``).
    """
    if isinstance(data, Source):
        return data
    from tokload import interop, remote

    path = os.fspath(data)
    if remote.is_url(path):
        return _open_remote(path, storage_options)
    path = remote.local_path(path)
    if os.path.isdir(path) and os.path.exists(os.path.join(path, MANIFEST)):
        return open_dataset(path)
    prefix = path[:-4] if path.endswith((".idx", ".bin")) else path
    if os.path.exists(prefix + ".idx"):
        return interop.open_megatron(prefix)
    if path.endswith(".npy") and os.path.isfile(path):
        return interop.open_flat(path)
    if os.path.isdir(path):
        return open_dataset(path)  # raises: no manifest
    raise FileNotFoundError(
        2,
        "not a tokload dataset, a Megatron .bin/.idx prefix or a .npy token file "
        "(flat .bin files need tokload.interop.open_flat(path, dtype=...))",
        path,
    )


def _open_remote(url: str, options: Mapping[str, Any] | None) -> Source:
    """``open_source`` of an object-store URL: one LIST of the prefix finds a
    tokload dataset (and is the one its opening uses), else a HEAD or two."""
    from tokload import interop, remote

    url = url.rstrip("/")
    loc = Location(url, options)
    if loc.exists(loc.join(MANIFEST)):
        return open_dataset_at(loc)
    prefix = url[:-4] if url.endswith((".idx", ".bin")) else url
    if remote.exists(prefix + ".idx", options):
        return interop.open_megatron(prefix, options)
    if url.endswith(".npy") and remote.exists(url, options):
        return interop.open_flat(url, storage_options=options)
    empty = "; nothing is stored under this prefix" if loc.stores_nothing() else ""
    raise MissingShardError(
        2,
        f"no tokload dataset ({MANIFEST}), Megatron .idx or .npy token file at this URL"
        f"{empty} (flat .bin objects need tokload.open_flat(url, dtype=...))",
        url,
    )


class View:
    """What every view shares: a Source and a contiguous range of observations."""

    _total: int

    def __init__(self, data: DataLike, storage_options: Mapping[str, Any] | None = None) -> None:
        self.source = open_source(data, storage_options)
        self._lo = 0
        self._hi = -1  # set by subclasses once _total is known

    def _init_range(self) -> None:
        self._hi = self._total

    def __len__(self) -> int:
        return self._hi - self._lo

    @property
    def fingerprint(self) -> str:
        """Identifies the data and the view's configuration (for resume checks)."""
        kind = type(self).__name__
        return f"{self.source.fingerprint}:{kind}:{self._config()}:{self._lo}:{self._hi}"

    def _config(self) -> str:
        return ""

    def subset(self, start: int, stop: int) -> Self:
        """The observations ``[start, stop)`` of this view, as a view of the same kind."""
        n = len(self)
        if not 0 <= start <= stop <= n:
            raise IndexError(f"subset [{start}, {stop}) is not within [0, {n}]")
        other = object.__new__(type(self))
        other.__dict__.update(self.__dict__)
        other._lo, other._hi = self._lo + start, self._lo + stop
        return other

    def _global(self, indices: npt.ArrayLike) -> np.ndarray:
        """Validate observation indices and map them to the underlying numbering."""
        a = np.asarray(indices)
        if a.dtype.kind not in "iu":
            if a.size == 0:
                a = a.astype(np.int64)
            else:
                raise TypeError(f"indices must be integers, got dtype {a.dtype}")
        a = a.reshape(-1)
        n = len(self)
        if a.size:
            lo, hi = a.min(), a.max()
            if lo < 0 or hi >= n:
                bad = lo if lo < 0 else hi
                raise IndexError(
                    f"observation {bad} is out of range for a view of {n} (valid: 0 <= i < {n})"
                )
        return a.astype(np.uint64) + np.uint64(self._lo)

    def _index(self, i: int) -> np.ndarray:
        n = len(self)
        try:
            j = int(np.asarray(i).item()) if not isinstance(i, int) else i
        except (TypeError, ValueError):
            raise TypeError(f"view indices must be integers, not {type(i).__name__}") from None
        if j < 0:
            j += n
        if not 0 <= j < n:
            raise IndexError(f"observation {i} is out of range for a view of {n}")
        return np.array([j], dtype=np.int64)

    def close(self) -> None:
        """Close the dataset's files (shared by every subset of this view)."""
        self.source.close()

    def configure_io(self, io: str | None = None, queue_depth: int | None = None) -> None:
        """Choose how the dataset's files are read (shared by every view of the source).

        ``io``: ``"auto"`` (io_uring where the kernel allows it, else a pool of C
        threads), ``"uring"``, ``"threads"`` or ``"sync"``; ``queue_depth``: reads
        kept in flight per read call. None leaves a setting as it is (initially
        ``TOKLOAD_IO`` / ``TOKLOAD_IO_DEPTH``, else the defaults).
        """
        for f in self.source._closers:
            if isinstance(f, FileSet):
                f.configure(io=io, queue_depth=queue_depth)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.source.description!r}, {self._config()} n={len(self)})"


def split(view: V, weights: str | Sequence[float]) -> list[V]:
    """Cut a view into consecutive, non-overlapping parts by weight.

    ``split(view, "969,30,1")`` gives train/validation/test views like
    Megatron's ``split`` argument: part ``k`` gets observations
    ``[round(n*c_k), round(n*c_{k+1}))`` where ``c`` are the normalized
    cumulative weights. The parts cover the view exactly.
    """
    w = [float(x) for x in weights.split(",")] if isinstance(weights, str) else list(weights)
    if not w or any(x < 0 for x in w) or sum(w) <= 0:
        raise ValueError(f"split weights must be non-negative with a positive sum, got {weights!r}")
    n = len(view)
    total = sum(w)
    bounds = [0]
    acc = 0.0
    for x in w:
        acc += x
        bounds.append(min(n, round(n * acc / total)))
    bounds[-1] = n
    return [view.subset(a, b) for a, b in itertools.pairwise(bounds)]


def _field_layout(
    dtype: np.dtype[Any], skip: str | None = None
) -> list[tuple[str, np.dtype[Any], int]]:
    assert dtype.fields is not None
    return [(name, ft, off) for name, (ft, off, *_r) in dtype.fields.items() if name != skip]


def _check_out(arr: Any, shape: tuple[int, ...], dtype: np.dtype[Any], what: str) -> np.ndarray:
    if not isinstance(arr, np.ndarray):
        raise TypeError(f"{what} must be a numpy array, got {type(arr).__name__}")
    if arr.dtype != dtype:
        raise TypeError(f"{what} must have dtype {dtype}, got {arr.dtype}")
    if arr.shape != shape:
        raise ValueError(f"{what} has shape {arr.shape}, expected {shape}")
    if not arr.flags.c_contiguous or not arr.flags.writeable:
        raise ValueError(f"{what} must be a writeable C-contiguous array")
    return arr


class _Windows(View):
    """Shared by the two windowed views: windows of a row stream."""

    def __init__(
        self,
        data: DataLike,
        window: int,
        stride: int | None,
        storage_options: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__(data, storage_options)
        stride = window if stride is None else stride
        if not isinstance(window, int) or window < 1:
            raise ValueError(f"window must be a positive integer, got {window!r}")
        if not isinstance(stride, int) or stride < 1:
            raise ValueError(f"stride must be a positive integer, got {stride!r}")
        self.window, self.stride = window, stride
        rows = self.source.num_rows
        self._total = 0 if rows < window else (rows - window) // stride + 1
        self._init_range()

    def _config(self) -> str:
        return f"window={self.window}, stride={self.stride},"

    def _read_windows(self, indices: np.ndarray, dst: np.ndarray) -> None:
        """Windows of observations ``indices`` (checked in C) back to back into dst."""
        self.source.rows.read_windows(indices, self._lo, len(self), self.stride, self.window, dst)

    def read_rows_at(self, indices: np.ndarray, rows: np.ndarray, out: np.ndarray) -> None:
        """Windows of observations ``indices`` into rows ``rows`` of ``out`` (a
        plain dtype's ``[B, window]`` array): one compiled read, no temporary
        (a ``Blend`` reads each component's windows this way)."""
        g = self._global(indices)
        st = np.uint64(self.stride)
        w = np.uint64(self.window)
        starts = g * st
        lengths = np.full(len(g), w, dtype=np.uint64)
        dst = np.asarray(rows, dtype=np.uint64) * (w * np.uint64(out.dtype.itemsize))
        self.source.rows.read(starts, lengths, dst, out)

    def storage_paths(self) -> list[str]:
        """The files a read of this view touches (the loader's read-ahead looks
        at the filesystem they are on)."""
        return list(self.source.rows.files.paths)

    def hint(self, indices: npt.ArrayLike) -> None:
        """The view protocol's read-ahead (``tokload.assembly``): the kernel
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


class TokenStream(_Windows):
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
        self.boundary_keys = _boundary_keys(boundaries)
        self.with_boundaries = bool(self.boundary_keys)
        # the values of a whole batch, not of its rows: the loader reads tasks with read_steps
        self.batch_keys = tuple(k for k in self.boundary_keys if k in BATCH_KEYS)
        if self.with_boundaries:
            docs = self.source.docs
            if docs is None or docs.total == 0:
                raise ValueError(
                    f"{self.source.description}: boundaries=True needs document boundaries, "
                    "and this source has none (flat files: open them with "
                    "tokload.open_flat(..., eos=...) or doc_index=)"
                )
            first, _ = docs.extents([0])
            if int(first[0]) != 0:
                raise FormatError(
                    f"{self.source.description}: its first document starts at row "
                    f"{int(first[0])}, not 0; boundaries=True needs documents that cover "
                    "the stream in order"
                )

    def read_batch(self, indices: np.ndarray, alloc: Alloc) -> dict[str, Any]:
        """The view protocol (``tokload.assembly``): ``"tokens"`` ``[B, window]``
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
        """The view protocol's read of several steps at once (``tokload.assembly``).

        ``cuts`` says which rows of ``indices`` each step has (consecutive
        ``(a, e)``). The windows and their per-token arrays are read and
        computed for all steps in one call each; ``"cu_seqlens"`` is each step's
        own (over its flattened ``[rows, window]`` tokens), the steps' arrays
        back to back in one array, and each step gets a ``slice`` of it and its
        ``"max_seqlen"``: the same values as ``read_batch`` of each step.
        """
        got = self.read(indices, out=self.empty(len(indices), alloc=alloc))
        raw: dict[str, Any] = got if isinstance(got, dict) else {"tokens": got}
        steps: list[dict[str, Any]] = [{} for _ in cuts]
        keys = self.boundary_keys
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
        self, indices: npt.ArrayLike, alloc: Alloc, keys: Sequence[str]
    ) -> tuple[dict[str, np.ndarray], np.ndarray, int]:
        docs = self.source.docs
        if docs is None:
            raise ValueError(f"{self.source.description} has no document boundaries")
        arrays, cu, longest = window_boundaries(
            docs,
            self._indices(indices),
            self._lo,
            len(self),
            self.stride,
            self.window,
            self.source.num_rows,
            alloc,
            keys,
        )
        return arrays, cu, longest

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
        arrays, cu, longest = self._window_boundaries(indices, alloc, keys)
        if "cu_seqlens" in keys:
            arrays["cu_seqlens"] = cu
        out: dict[str, Any] = dict(arrays)
        if "max_seqlen" in keys:
            out["max_seqlen"] = longest
        return out

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
        if dt.fields is None:
            dst = _check_out(out, (b, self.window), dt, "out")
            self._read_windows(idx, dst)
            return dst
        if not isinstance(out, dict):
            raise TypeError("out must be a dict of per-field arrays for a structured dtype")
        layout = _field_layout(dt)
        outs = [
            _check_out(out.get(name), (b, self.window), ft, f"out[{name!r}]")
            for name, ft, _ in layout
        ]
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


@dataclass
class DocumentBatch:
    """Documents read back to back.

    ``values`` holds the rows of all documents concatenated (an array, or a
    dict of arrays for a structured dtype); document ``k`` is
    ``values[offsets[k]:offsets[k+1]]``; ``lengths = diff(offsets)``.
    """

    values: Fields
    lengths: np.ndarray
    offsets: np.ndarray


_RETIRED_DOCUMENTS_ARGS = ("batch", "pad_to", "pad_value", "window", "lookahead", "boundaries")


def _retired_documents_args(given: Mapping[str, Any]) -> str:
    """The message for ``Documents(batch=..., ...)``: batching moved to the DataLoader."""
    unknown = sorted(k for k in given if k not in _RETIRED_DOCUMENTS_ARGS)
    if unknown:
        return f"Documents() got unexpected keyword arguments: {', '.join(unknown)}"
    batch = given.get("batch", "pad")
    if batch == "fill":
        args = [f"window={given.get('window')!r}"]
        if "lookahead" in given:
            args.append(f"lookahead={given['lookahead']!r}")
        if "pad_value" in given:
            args.append(f"value={given['pad_value']!r}")
        if "boundaries" in given:
            args.append(f"attention={given['boundaries']!r}")
        new = f"{Fill.__name__}({', '.join(args)})"
    elif batch == "pack":
        new = f"{Pack.__name__}()"
    else:
        args = []
        if given.get("pad_to") is not None:
            args.append(f"to={given['pad_to']!r}")
        if "pad_value" in given:
            args.append(f"value={given['pad_value']!r}")
        new = f"{Pad.__name__}({', '.join(args)})"
    return (
        f"Documents(data, {', '.join(f'{k}={v!r}' for k, v in given.items())}) was retired "
        "in tokload 0.2: "
        "batching is the DataLoader's policy now. Write "
        f"DataLoader(Documents(data), batch_size, batching=tokload.{new})"
    )


class Documents(View):
    """Observation ``i`` is document ``i``.

    Args:
        data: a tokload dataset (with documents), a Megatron prefix (a
            document is a Megatron *sequence*, as ``IndexedDataset[i]``), or a
            flat token file opened with a document index; local or an
            object-store URL.
        storage_options: for an object-store URL, what overrides the
            environment's settings (endpoint, credentials, retries; see
            ``tokload.remote``).

    How the DataLoader batches documents is its ``batching=`` policy
    (``tokload.batching``): ``Pad()`` by default (``[B, L]`` plus
    ``lengths``), ``Pack()`` (back to back plus ``cu_seqlens``) or
    ``Fill(window)`` (rows filled best-fit, with the attention keys). The view
    implements the document contract those policies read through:
    ``extents``, ``fields`` and ``read_extents``.

    ``view[i]`` is the document's rows (an array, or a dict of per-field
    arrays); ``read(indices)`` packs a batch into one ``DocumentBatch``;
    ``read_padded(indices, length)`` gives ``[B, length]`` arrays plus the
    lengths (longer documents are truncated). Each document costs one read of
    its index entries and one ``preadv`` of its rows.
    """

    batching = Pad()
    """The DataLoader's default policy for this view (``tokload.batching``)."""

    rowwise = False
    """Documents vary in length: ``read_batch`` is not one row per sample."""

    def __init__(
        self,
        data: DataLike,
        *,
        storage_options: Mapping[str, Any] | None = None,
        **retired: Any,
    ) -> None:
        if retired:
            raise TypeError(_retired_documents_args(retired))
        super().__init__(data, storage_options)
        if self.source.docs is None:
            raise FormatError(f"{self.source.description} has no document index")
        self._total = self.source.num_documents
        self._init_range()

    @property
    def fields(self) -> dict[str, np.dtype[Any]]:
        """The document contract (``tokload.batching``): ``{"tokens": dtype}``, or
        one entry per field of a structured dtype."""
        dt = self.source.dtype
        if dt.fields is None:
            return {"tokens": dt}
        return {name: ft for name, ft, _ in _field_layout(dt)}

    def read_batch(self, indices: np.ndarray, alloc: Alloc) -> dict[str, Any]:
        """The view protocol (``tokload.assembly``): ``"tokens"`` ``[B, L]``
        padded with 0 to the batch's longest document (one array per field of a
        structured dtype) and ``"lengths"`` (int64): what ``Pad()`` gives."""
        values, lengths = self.read_padded(indices, None, 0, alloc)
        raw: dict[str, Any] = dict(values) if isinstance(values, dict) else {"tokens": values}
        raw["lengths"] = lengths
        return raw

    def read_extents(
        self,
        indices: np.ndarray,
        starts: np.ndarray,
        lengths: np.ndarray,
        dst: np.ndarray,
        out: Mapping[str, np.ndarray],
    ) -> None:
        """The document contract (``tokload.batching``): the first ``lengths[k]``
        rows of the document that starts at row ``starts[k]`` (as ``extents``
        gave it) into rows ``[dst[k], dst[k] + lengths[k])`` of each flat array
        of ``out`` (one per field of ``fields``); other rows are left as they
        are. A plain dtype is one compiled read without the GIL, straight into
        ``out["tokens"]``."""
        dt = self.source.dtype
        lengths = np.ascontiguousarray(lengths, dtype=np.uint64)
        dst = np.ascontiguousarray(dst, dtype=np.uint64)
        if dt.fields is None:
            tokens = out["tokens"]
            _check_out(tokens, tokens.shape, dt, "out['tokens']")
            self.source.rows.read(starts, lengths, dst * np.uint64(dt.itemsize), tokens)
            return
        # A structured dtype: the rows back to back into scratch, split into fields,
        # then each field's rows scattered to their places (NumPy, no loop per document).
        total = int(lengths.sum())
        packed = np.zeros(len(lengths) + 1, dtype=np.uint64)
        np.cumsum(lengths, out=packed[1:])
        fields = self._read_fields(starts, lengths, packed[:-1], total)
        where = np.repeat(dst - packed[:-1], lengths.astype(np.int64)) + np.arange(
            total, dtype=np.uint64
        )
        for name, values in fields.items():
            out[name][where] = values

    def __getitem__(self, i: int) -> Fields:
        return self.read(self._index(i)).values

    def extents(self, indices: npt.ArrayLike) -> tuple[np.ndarray, np.ndarray]:
        """First global row and length (uint64) of each document."""
        assert self.source.docs is not None
        starts, lengths = self.source.docs.extents(self._global(indices))
        return starts, lengths

    def read(self, indices: npt.ArrayLike, alloc: Alloc = np.empty) -> DocumentBatch:
        """The documents back to back (see ``DocumentBatch``)."""
        docs = self.source.docs
        assert docs is not None
        if self.source.dtype.fields is None:
            values, lengths, offsets = read_documents(
                docs, self.source.rows, indices, self._lo, len(self), self.source.dtype,
                pack=True, length=None, pad=b"", alloc=alloc,
            )  # fmt: skip
            return DocumentBatch(values, lengths, offsets)
        starts, lengths = self.extents(indices)
        offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        fields = self._read_fields(
            starts, lengths, offsets[:-1].astype(np.uint64), int(offsets[-1]), alloc=alloc
        )
        return DocumentBatch(fields, lengths.astype(np.int64), offsets)

    def read_padded(
        self,
        indices: npt.ArrayLike,
        length: int | None = None,
        pad: int = 0,
        alloc: Alloc = np.empty,
    ) -> tuple[Fields, np.ndarray]:
        """Documents as ``[B, length]`` rows padded with ``pad``.

        ``length=None`` pads to the longest document of the batch (at least 1);
        longer documents are truncated to ``length``. Returns ``(values,
        lengths)`` where ``lengths`` (int64) are the numbers of real rows.
        For a plain dtype this is one compiled call: the index entries, then
        the padding and the rows' reads, without the GIL.
        """
        if length is not None and length < 1:
            raise ValueError(f"length must be positive, got {length}")
        dt = self.source.dtype
        docs = self.source.docs
        assert docs is not None
        if dt.fields is None:
            values, lens = read_documents(
                docs, self.source.rows, indices, self._lo, len(self), dt,
                pack=False, length=length, pad=self._pad_row(pad), alloc=alloc,
            )  # fmt: skip
            return values, lens
        starts, lengths = self.extents(indices)
        if length is None:
            length = max(1, int(lengths.max())) if len(lengths) else 1
        lengths = np.minimum(lengths, np.uint64(length))
        b = len(lengths)
        dst_offsets = np.arange(b, dtype=np.uint64) * np.uint64(length)
        fields = self._read_fields(starts, lengths, dst_offsets, b * length, pad, alloc)
        shaped = {k: v.reshape(b, length) for k, v in fields.items()}
        return shaped, lengths.astype(np.int64)

    def _pad_row(self, pad: int) -> bytes:
        """One row of ``pad`` in the dataset's dtype (OverflowError if it does not fit)."""
        return np.array(pad, dtype=self.source.dtype).tobytes()

    def _read_fields(
        self,
        starts: np.ndarray,
        lengths: np.ndarray,
        dst_rows: np.ndarray,
        total: int,
        pad: int | None = None,
        alloc: Alloc = np.empty,
    ) -> dict[str, np.ndarray]:
        """A structured dtype's documents: rows into scratch, then one array per field."""
        dt = self.source.dtype
        scratch = np.zeros(total, dtype=dt)
        self.source.rows.read(starts, lengths, dst_rows * np.uint64(dt.itemsize), scratch)
        layout = _field_layout(dt)
        outs = {name: alloc((total,), ft) for name, ft, _ in layout}
        split_fields(
            scratch,
            total,
            dt.itemsize,
            [o for _, _, o in layout],
            [ft.itemsize for _, ft, _ in layout],
            list(outs.values()),
        )
        if pad is not None:
            # Rows past each document's length were zero-filled: set them to pad.
            mask = np.ones(total, dtype=bool)
            for s, n in zip(dst_rows.tolist(), lengths.tolist(), strict=True):
                mask[s : s + n] = False
            for v in outs.values():
                v[mask] = pad
        return outs


@dataclass
class MetadataBatch:
    """Token windows with their metadata.

    ``fields``: the rows' fields other than ``metadata_id``, each ``[B, T]``
    (``"tokens"`` for a plain dtype); ``positions``: ``[B, T]`` int32, the
    index into ``metadata`` of each row's record, or -1; ``metadata``: the
    distinct records of the batch in order of first appearance, a
    ``RecordList`` that passes record ``k`` through the view's
    ``deserialize`` when ``metadata[k]`` is read.
    """

    fields: dict[str, np.ndarray]
    positions: np.ndarray
    metadata: RecordList


class StreamWithMetadata(_Windows):
    """Token windows whose rows carry metadata records.

    Args:
        data: a tokload dataset written with ``metadata=True``, in any layout
            (FORMAT.md): metadata blocks per shard (version 3), a span table
            per shard (version 2) or a ``metadata_id`` field in every row
            (version 1); local or an object-store URL.
        window: rows per window, as for ``TokenStream``.
        stride: rows between the starts of windows ``i`` and ``i + 1`` (default:
            ``window``), as for ``TokenStream``.
        deserialize: turns a record's bytes into what ``metadata[k]`` gives
            (default: the ``bytes`` themselves). Called only when a record is
            accessed, never per token, never per batch.
        storage_options: as for ``TokenStream``.

    A batch costs a fixed number of Python calls whatever its number of records:
    the rows, the per-row positions, the records' bytes and their offsets come
    from one compiled call without the GIL. With metadata blocks it reads the
    rows and the blocks the windows touch in one round (the block index is
    held in memory when it fits ``TOKLOAD_INDEX_MEMORY``; otherwise its entries
    go with the rows and the blocks follow); with a span table, in four
    dependent rounds (the rows with the block index entries, then the span
    table slices, the records' index entries, their bytes), each one batched
    read coalesced per window; with per-row ids, the rows and then two rounds.
    """

    def __init__(
        self,
        data: DataLike,
        window: int,
        stride: int | None = None,
        deserialize: Callable[[bytes], Any] | None = None,
        *,
        storage_options: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__(data, window, stride, storage_options)
        if self.source.meta is None and self.source.spans is None:
            raise FormatError(f"{self.source.description} has no metadata")
        self.deserialize = deserialize or bytes
        self._local = threading.local()  # per reader thread: the span reader's scratch
        self._hint_lock = ForkSafeLock()  # a forked child never finds it held
        # (lo, hi, windows) whose blocks the next hint advises (subset() copies it: lo, hi
        # tell a view's own windows apart)
        self._hint_prev: tuple[int, int, np.ndarray] | None = None
        self._lay = self._layout()  # (name, dtype, offset) per field, fixed for the view
        # the token dtype of a plain dtype (read's short path), else None
        self._plain = self.source.dtype if self.source.dtype.fields is None else None
        # where each field lies in a row and its bytes, for split_fields (made once)
        self._split_at = [o for _, _, o in self._lay]
        self._split_size = [ft.itemsize for _, ft, _ in self._lay]

    def read_batch(self, indices: np.ndarray, alloc: Alloc) -> dict[str, Any]:
        """The view protocol (``tokload.assembly``): the fields (all but
        ``metadata_id``) ``[B, window]``, ``"metadata_positions"`` ``[B, window]``
        int32 (index into the batch's records, or -1), the records' bytes back to
        back (``"metadata_bytes"``, uint8) and their ``"metadata_offsets"``
        (int64, one more than the records), and ``"metadata"``, a
        ``RecordList`` over those two that deserializes a record when read."""
        b = len(indices)
        res = self.read(
            indices,
            out=self.empty(b, alloc=alloc),
            positions=alloc((b, self.window), np.int32),
            alloc=alloc,
        )
        raw: dict[str, Any] = dict(res.fields)
        raw["metadata_positions"] = res.positions
        raw["metadata_bytes"] = res.metadata.data
        raw["metadata_offsets"] = res.metadata.offsets
        raw["metadata"] = res.metadata
        return raw

    def read_batches(self, batches: list[np.ndarray], alloc: Alloc) -> list[dict[str, Any]]:
        """``read_batch`` of each index array of ``batches`` (the view
        protocol's several-batches call). With metadata blocks, the windows
        and blocks of all of them are one round of reads (on cold storage, one
        wait instead of one per batch); each batch's positions count its own
        records, as ``read_batch``'s do, and its fields and positions are rows
        of arrays shared by the batches of the call (a structured dtype's rows
        are read into one scratch array and split into fields once). Other
        layouts read one batch after the other."""
        spans = self.source.spans
        flat = [self._indices(ix) for ix in batches]
        sizes = [len(ix) for ix in flat]
        if not isinstance(spans, BlockSet) or len(batches) < 2 or 0 in sizes:
            return [self.read_batch(ix, alloc) for ix in flat]
        idx = np.concatenate(flat)
        cuts = np.cumsum(sizes)
        n, t = len(idx), self.window
        dt = self.source.dtype
        layout = self._lay
        fields = {name: alloc((n, t), ft) for name, ft, _ in layout}
        rows = next(iter(fields.values())) if dt.fields is None else np.empty((n, t), dtype=dt)
        positions = alloc((n, t), np.int32)
        records = spans.read_window_batches(
            idx,
            self._lo,
            self._hi - self._lo,
            self.stride,
            t,
            rows,
            positions,
            alloc,
            self._scratch(),
            cuts,
        )
        if dt.fields is not None:
            split_fields(
                rows, n * t, dt.itemsize, self._split_at, self._split_size, list(fields.values())
            )
        out = []
        named = list(fields.items())
        for a, e, (data, offsets) in zip([0, *cuts[:-1]], cuts, records, strict=True):
            batch: dict[str, Any] = {}
            for name, f in named:  # a loop, not a comprehension: no call per batch
                batch[name] = f[a:e]
            batch["metadata_positions"] = positions[a:e]
            batch["metadata_bytes"] = data
            batch["metadata_offsets"] = offsets
            batch["metadata"] = RecordList(data, offsets, self.deserialize)
            out.append(batch)
        return out

    def hint(self, indices: npt.ArrayLike) -> None:
        """The view protocol's read-ahead: the rows of observations ``indices``
        (as ``TokenStream.hint``) and, with metadata blocks, their blocks
        where the shard's block index table is in memory, so the read that
        follows waits on neither. Where it is not (an index too large for
        ``TOKLOAD_INDEX_MEMORY``, or a shard no read has loaded the table of
        yet), a hint advises the windows' index entries, and the next hint
        call reads the entries advised by this one (by then usually in the
        page cache: it waits for them otherwise) and advises their blocks: the
        read-ahead keeps those blocks one task less ahead than the rows
        instead of not at all. (A read that loads a table still waits for it:
        advising a whole table can hold up the hint itself on a FUSE
        filesystem, whose queue of background reads is short.)"""
        super().hint(indices)
        spans = self.source.spans
        if isinstance(spans, BlockSet):
            idx = self._indices(indices)
            sc = self._scratch()
            spans.hint_windows(idx, self._lo, len(self), self.stride, self.window, sc)
            with self._hint_lock:  # each call's windows get their blocks hinted once
                prev, self._hint_prev = self._hint_prev, (self._lo, self._hi, idx)
            if prev is not None and prev[:2] == (self._lo, self._hi):  # not a subset's
                spans.hint_blocks_after_index(
                    prev[2], self._lo, len(self), self.stride, self.window, sc
                )

    def _scratch(self) -> Scratch:
        """This thread's scratch memory of the span reader."""
        try:
            sc: Scratch = self._local.scratch
        except AttributeError:
            sc = self._local.scratch = Scratch()
        return sc

    def _layout(self) -> list[tuple[str, np.dtype[Any], int]]:
        dt = self.source.dtype
        if dt.fields is None:
            return [("tokens", dt, 0)]
        return _field_layout(dt, skip=METADATA_FIELD)

    def empty(self, batch: int, alloc: Alloc = np.empty) -> dict[str, np.ndarray]:
        """Per-field arrays (all fields but ``metadata_id``) ``read`` can fill."""
        return {name: alloc((batch, self.window), ft) for name, ft, _ in self._lay}

    def __getitem__(self, i: int) -> MetadataBatch:
        b = self.read(self._index(i))
        return MetadataBatch({k: v[0] for k, v in b.fields.items()}, b.positions[0], b.metadata)

    def read(
        self,
        indices: npt.ArrayLike,
        out: dict[str, np.ndarray] | None = None,
        positions: np.ndarray | None = None,
        alloc: Alloc = np.empty,
    ) -> MetadataBatch:
        """Observations ``indices``; ``out`` and ``positions`` may be preallocated
        (``positions``: ``[B, window]`` int32, C-contiguous, writable and
        aligned to 4 bytes, as ``np.empty`` makes it; ValueError otherwise),
        the records' buffer and offsets are made with ``alloc``. Given
        neither (for a plain dtype), the compiled reader makes the positions
        and checks the indices, a few Python calls fewer a batch."""
        spans = self.source.spans
        if out is None and positions is None and spans is not None and self._plain is not None:
            # the usual call, kept short: the compiled reader checks the indices and
            # makes the positions
            ix = np.asarray(indices)
            tokens = np.empty((ix.size, self.window), self._plain)
            positions, data, offsets = spans.read_windows(
                ix,
                self._lo,
                self._hi - self._lo,
                self.stride,
                self.window,
                tokens,
                None,
                alloc,
                self._scratch(),
            )
            return MetadataBatch(
                {"tokens": tokens}, positions, RecordList(data, offsets, self.deserialize)
            )
        idx = self._indices(indices)
        b, t = len(idx), self.window
        dt = self.source.dtype
        layout = self._lay
        if out is None:  # made here: nothing to check
            if len(layout) == 1:  # plain tokens: no comprehension on the common path
                outs = [np.empty((b, t), layout[0][1])]
                out = {layout[0][0]: outs[0]}
            else:
                out = {name: np.empty((b, t), ft) for name, ft, _ in layout}
                outs = list(out.values())
        else:
            outs = [
                _check_out(out.get(name), (b, t), ft, f"out[{name!r}]") for name, ft, _ in layout
            ]
        if positions is None:
            positions = np.empty((b, t), dtype=np.int32)
        else:
            _check_out(positions, (b, t), np.dtype(np.int32), "positions")
            if not positions.flags.aligned:  # every layout refuses it, not only the compiled ones
                raise ValueError(
                    "positions must be aligned to 4 bytes (int32); its address is "
                    f"{positions.ctypes.data % 4} past a multiple of 4"
                )
        if spans is not None:
            sc = self._scratch()
            if dt.fields is None:
                _, data, offsets = spans.read_windows(
                    idx,
                    self._lo,
                    self._hi - self._lo,
                    self.stride,
                    t,
                    outs[0],
                    positions,
                    alloc,
                    sc,
                )
            else:
                scratch = np.empty((b, t), dtype=dt)
                _, data, offsets = spans.read_windows(
                    idx,
                    self._lo,
                    self._hi - self._lo,
                    self.stride,
                    t,
                    scratch,
                    positions,
                    alloc,
                    sc,
                )
                split_fields(scratch, b * t, dt.itemsize, self._split_at, self._split_size, outs)
            return MetadataBatch(out, positions, RecordList(data, offsets, self.deserialize))
        return self._read_per_token(idx, out, outs, positions, alloc)

    def _read_per_token(
        self,
        idx: np.ndarray,
        out: dict[str, np.ndarray],
        outs: list[np.ndarray],
        positions: np.ndarray,
        alloc: Alloc,
    ) -> MetadataBatch:
        """Version 1's layout: a ``metadata_id`` in every row."""
        meta = self.source.meta
        assert meta is not None
        b, t = len(idx), self.window
        dt = self.source.dtype
        ids = np.empty((b, t), dtype=np.uint32)
        assert dt.fields is not None
        scratch = np.empty((b, t), dtype=dt)
        self._read_windows(idx, scratch)
        starts = (idx.astype(np.uint64) + np.uint64(self._lo)) * np.uint64(self.stride)
        id_off = dt.fields[METADATA_FIELD][1]
        split_fields(
            scratch,
            b * t,
            dt.itemsize,
            [*self._split_at, id_off],
            [*self._split_size, 4],
            [*outs, ids],
        )
        items, spans, blob_bytes = meta.gather(starts, t, ids, positions)
        blob = np.empty(int(blob_bytes), dtype=np.uint8)
        meta.read(spans, blob)
        data, offsets = compact_records(blob, items["blob"], items["length"], alloc)
        return MetadataBatch(out, positions, RecordList(data, offsets, self.deserialize))


class RecordList(Sequence[Any]):
    """The records of a batch: one byte buffer and offsets, deserialized on access.

    ``data`` (uint8) holds the records back to back; record ``k`` is
    ``data[offsets[k]:offsets[k + 1]]`` (``offsets``: int64, ``len + 1``
    values). ``records[k]`` passes those bytes through ``deserialize`` each
    time it is read (O(size of the record)); ``len(records)`` and building the
    list cost nothing per record. In the DataLoader's batches, ``data`` and
    ``offsets`` are the batch's ``"metadata_bytes"``/``"metadata_offsets"``
    tensors' memory.
    """

    __slots__ = ("data", "deserialize", "offsets")

    def __init__(
        self,
        data: np.ndarray,
        offsets: np.ndarray,
        deserialize: Callable[[bytes], Any] = bytes,
    ) -> None:
        self.data = data
        self.offsets = offsets
        self.deserialize = deserialize

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def raw(self, k: int) -> bytes:
        """Record ``k``'s bytes, not deserialized."""
        n = len(self)
        try:
            i = operator.index(k)  # ints, NumPy integers, 0-d integer tensors
        except TypeError:
            raise TypeError(f"record indices must be integers, not {type(k).__name__}") from None
        j = i + n if i < 0 else i
        if not 0 <= j < n:
            raise IndexError(f"record {k} is out of range for a batch of {n} records")
        return self.data[int(self.offsets[j]) : int(self.offsets[j + 1])].tobytes()

    def __getitem__(self, k: Any) -> Any:
        if isinstance(k, slice):
            return [self.deserialize(self.raw(j)) for j in range(*k.indices(len(self)))]
        return self.deserialize(self.raw(k))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (RecordList, list, tuple)):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other, strict=True))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"RecordList({len(self)} records, {len(self.data)} bytes)"
