"""What every view shares: opening a source, a range of observations, ``split``."""

from __future__ import annotations

import itertools
import math
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any, Self, TypeVar

import numpy as np
import numpy.typing as npt

from tokload._io import FileSet, checked_io_settings
from tokload.arguments import is_integer
from tokload.errors import MissingShardError
from tokload.format import MANIFEST
from tokload.location import Location
from tokload.remote.urls import absolute_local
from tokload.source import Source, open_dataset, open_dataset_at, refuse_changed, reopenable

DataLike = str | os.PathLike[str] | Source
Fields = np.ndarray | dict[str, np.ndarray]
ReadPart = tuple[Any, np.ndarray, np.ndarray, np.ndarray, np.ndarray]
"""``(rowset, starts, lengths, byte offsets, out)``: one view's reads, for
``tokload._rows.read_ranges`` (several views' reads in one engine call); the
rowset may be ``RowSets(...).at(which)``, each range from a set of its own."""
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
    return _open_path(data, storage_options)


@reopenable
def _open_path(data: str | os.PathLike[str], storage_options: Mapping[str, Any] | None) -> Source:
    """``open_source`` of a path or URL (the call a pickled Source makes again)."""
    from tokload import interop, remote

    path = os.fspath(data)
    if remote.is_url(path):
        return _open_remote(path, storage_options)
    path = remote.local_path(path)
    kind = local_kind(path)
    if kind == "dataset":
        return open_dataset(path)
    if kind == "megatron":
        prefix = _megatron_prefix(path)
        assert prefix is not None
        return interop.open_megatron(prefix)
    if kind == "npy":
        return interop.open_flat(path)
    if os.path.isdir(path):
        return open_dataset(path)  # raises: no manifest
    raise FileNotFoundError(
        2,
        "not a tokload dataset, a Megatron .bin/.idx prefix or a .npy token file "
        "(flat .bin files need tokload.interop.open_flat(path, dtype=...))",
        path,
    )


def local_kind(path: str) -> str | None:
    """What a local path holds, as ``open_source`` reads it: ``"dataset"`` (a
    directory with a manifest), ``"megatron"`` (a ``.bin``/``.idx`` prefix, or
    either file), ``"npy"`` (a ``.npy`` token file), or None."""
    if os.path.isdir(path) and os.path.exists(os.path.join(path, MANIFEST)):
        return "dataset"
    if _megatron_prefix(path) is not None:
        return "megatron"
    if path.endswith(".npy") and os.path.isfile(path):
        return "npy"
    return None


def _megatron_prefix(path: str) -> str | None:
    """The Megatron prefix ``path`` names: itself where ``path.idx`` exists (a prefix
    may end in ``.bin``), else ``path`` less its ``.bin``/``.idx`` (a file of the
    pair); None where neither has an ``.idx``."""
    if os.path.exists(path + ".idx"):
        return path
    if path.endswith((".idx", ".bin")) and os.path.exists(path[:-4] + ".idx"):
        return path[:-4]
    return None


def _open_remote(url: str, options: Mapping[str, Any] | None) -> Source:
    """``open_source`` of an object-store URL: one LIST of the prefix finds a
    tokload dataset (and is the one its opening uses), else a HEAD or two."""
    from tokload import interop, remote

    url = url.rstrip("/")
    loc = Location(url, options)
    if loc.exists(loc.join(MANIFEST)):
        return open_dataset_at(loc)
    # (a bucket itself names no object: "s3://data" + ".idx" would be another bucket)
    if remote.split_url(url)[2]:
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
    """What every view shares: a Source and a contiguous range of observations.

    A view pickles as the call that made it and its range (not its open files):
    unpickled (in a process started with ``spawn``, by Ray, by ``copy.deepcopy``),
    it opens its data again and must find the same (``fingerprint``), else
    ``StateError``. The I/O settings of ``configure_io`` stay in the process
    that made them.
    """

    _total: int
    _made_with: tuple[tuple[Any, ...], dict[str, Any]]

    def __new__(cls, *args: Any, **kwargs: Any) -> Self:
        self = super().__new__(cls)
        self._made_with = (args, kwargs)  # what pickling records (__reduce__)
        return self

    def __reduce__(self) -> tuple[Any, ...]:
        args, kwargs = self._made_with
        return (_reopen_view, (type(self), args, kwargs, self._lo, self._hi, self.fingerprint))

    def __init__(self, data: DataLike, storage_options: Mapping[str, Any] | None = None) -> None:
        self.source = open_source(data, storage_options)
        args, kwargs = self._made_with
        # pickled, the view opens its data again, maybe in another directory
        if args and args[0] is data:
            self._made_with = ((absolute_local(data), *args[1:]), kwargs)
        elif kwargs.get("data") is data:
            self._made_with = (args, {**kwargs, "data": absolute_local(data)})
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
        scalar = isinstance(i, np.ndarray) and i.ndim == 0 and i.dtype.kind in "iu"
        if is_integer(i) or scalar:
            j = int(i)
        else:  # a float would be truncated, a bool taken as 0 or 1
            raise TypeError(f"view indices must be integers, not {type(i).__name__} {i!r}")
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
        ``TOKLOAD_IO`` / ``TOKLOAD_IO_DEPTH``, else the defaults). A refused
        setting changes no file.
        """
        checked_io_settings(io, queue_depth)  # (before the first file set changes)
        for f in self.source._closers:
            if isinstance(f, FileSet):
                f.configure(io=io, queue_depth=queue_depth)

    def __repr__(self) -> str:
        config = self._config() + self._shown_boundaries()  # (_config: the fingerprint's)
        return (
            f"{type(self).__name__}({self.source.description!r}, "
            f"{config + ' ' if config else ''}n={len(self)}{self._shown_part()})"
        )

    def _shown_boundaries(self) -> str:
        """For a repr: the boundaries a view gives (``" boundaries=[...],"``), or ""."""
        keys = getattr(self, "boundary_keys", ())
        return f" boundaries={list(keys)}," if keys else ""

    def _shown_part(self) -> str:
        """For a repr: the part of its data a view is (``" of [lo, hi)"``), or ""."""
        return "" if (self._lo, self._hi) == (0, self._total) else f" of [{self._lo}, {self._hi})"


def _reopen_view(
    cls: type[V],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    lo: int,
    hi: int,
    fingerprint: str,
) -> V:
    """A pickled view, made again: ``cls(*args, **kwargs)``, its range
    ``[lo, hi)``, and StateError unless it reads the same data as it did."""
    view = cls(*args, **kwargs)
    if (lo, hi) != (view._lo, view._hi):
        view = view.subset(lo - view._lo, hi - view._lo)
    refuse_changed(view, fingerprint, "view", repr(view))
    return view


def split(view: V, weights: str | Sequence[float]) -> list[V]:
    """Cut a view into consecutive, non-overlapping parts by weight.

    ``split(view, "969,30,1")`` gives train/validation/test views as
    megatron-core cuts its datasets by ``--split``: each part's size is its
    share of the ``n`` observations rounded (``round(n * w_k / sum(w))``), and
    every cut is then moved by what the sizes add up to over ``n``, so the parts
    cover the view exactly (a cut that would fall before 0 stays at 0). A
    string takes Megatron's spellings (``"969,30,1"``, ``"98/2/0"``, ``"98 2 0"``) and gives
    three parts when it names fewer (``"99,1"``: an empty test part), as
    Megatron does; a sequence of weights gives one part per weight.

    Raises:
        ValueError: weights that are not finite non-negative numbers with a
            positive sum, or a string that is not numbers separated by ``,``,
            ``/`` or spaces.
    """
    if isinstance(weights, str):
        pieces = re.split(r"\s*[,/]\s*|\s+", weights.strip())
        try:
            w = [float(x) for x in pieces]
        except ValueError:
            raise ValueError(
                f"split weights must be numbers separated by ',', '/' or spaces (Megatron's "
                f"--split: '969,30,1'), got {weights!r}"
            ) from None
        w += [0.0] * (3 - len(w))
    else:
        w = list(weights)
    if not w or not all(0 <= x < math.inf for x in w) or sum(w) <= 0:  # NaN fails too
        raise ValueError(
            f"split weights must be finite and non-negative with a positive sum, got {weights!r}"
        )
    n = len(view)
    total = sum(w)
    bounds = [0]
    for x in w:
        bounds.append(bounds[-1] + round(x / total * float(n)))
    excess = bounds[-1] - n  # megatron-core's _get_split_indices
    bounds = [0] + [min(n, max(0, b - excess)) for b in bounds[1:]]
    return [view.subset(a, b) for a, b in itertools.pairwise(bounds)]


def dtype_fields(dtype: np.dtype[Any]) -> dict[str, np.dtype[Any]]:
    """A dtype's fields as the views name them: ``{"tokens": dtype}`` for a plain
    one, else one entry per field of a structured one."""
    if dtype.fields is None:
        return {"tokens": dtype}
    return {name: ft for name, ft, _ in _field_layout(dtype)}


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


def _check_rows_out(out: Any, shape: tuple[int, ...], dtype: np.dtype[Any]) -> list[np.ndarray]:
    """``out`` checked against rows of ``dtype`` (as ``empty`` makes them): the one
    array of a plain dtype, or a dict with an array per field of a structured one,
    returned in ``_field_layout`` order."""
    if dtype.fields is None:
        return [_check_out(out, shape, dtype, "out")]
    if not isinstance(out, dict):
        raise TypeError("out must be a dict of per-field arrays for a structured dtype")
    return [
        _check_out(out.get(name), shape, ft, f"out[{name!r}]")
        for name, ft, _ in _field_layout(dtype)
    ]
