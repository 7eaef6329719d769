"""``StreamWithMetadata``: token windows whose rows carry metadata records."""

from __future__ import annotations

import operator
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from tokload._meta import BlockSet, Scratch, compact_records
from tokload._rows import split_fields
from tokload.errors import FormatError
from tokload.forksafe import ForkSafeLock
from tokload.format import (
    METADATA_FIELD,
)
from tokload.views.base import DataLike, _check_out, _field_layout
from tokload.views.contract import Alloc, refuse_field_names
from tokload.views.windows import _Windows

METADATA_KEYS = ("metadata_positions", "metadata_bytes", "metadata_offsets", "metadata")
"""The keys a stream with metadata adds to each batch beside its fields."""


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

    def raw(self) -> dict[str, Any]:
        """The batch as the view protocol's dict (``StreamWithMetadata.read_batch``)."""
        raw: dict[str, Any] = dict(self.fields)
        raw["metadata_positions"] = self.positions
        raw["metadata_bytes"] = self.metadata.data
        raw["metadata_offsets"] = self.metadata.offsets
        raw["metadata"] = self.metadata
        return raw


def gather_batches(
    parts: Sequence[tuple[np.ndarray, MetadataBatch]],
    b: int,
    window: int,
    fields: Sequence[tuple[str, np.dtype[Any]]],
    alloc: Alloc,
    deserialize: Callable[[bytes], Any],
) -> MetadataBatch:
    """Batches of several streams as one batch of ``b`` rows (a ``Blend``'s): each
    part gives the rows it fills (an int64 array) and a batch of as many rows.
    The fields and positions are placed row by row; the records are renumbered in
    order of first appearance over the whole batch, row-major, as a read of one
    stream gives them (a record of two parts is two records). The arrays are made
    with ``alloc``."""
    out = {name: alloc((b, window), dt) for name, dt in fields}
    positions = alloc((b, window), np.int32)
    datas: list[np.ndarray] = []
    starts: list[np.ndarray] = []
    nrec = nbytes = 0
    for rows, got in parts:
        for name, _ in fields:
            out[name][rows] = got.fields[name]
        pos = got.positions
        positions[rows] = np.where(pos >= 0, pos + nrec, -1)
        datas.append(np.asarray(got.metadata.data))
        offsets = np.asarray(got.metadata.offsets, dtype=np.int64)
        starts.append(offsets[:-1] + nbytes)
        nrec += len(offsets) - 1
        nbytes += int(offsets[-1])
    flat = positions.reshape(-1)
    used = flat[flat >= 0]
    old, first = np.unique(used, return_index=True)
    order = old[np.argsort(first, kind="stable")]  # old numbers, by first appearance
    renumber = np.full(max(nrec, 1), -1, dtype=np.int32)
    renumber[order] = np.arange(len(order), dtype=np.int32)
    at = flat >= 0
    flat[at] = renumber[flat[at]]
    every = np.concatenate([*starts, np.array([nbytes], dtype=np.int64)])  # record k: k, k+1
    begin, lengths = every[:-1][order], np.diff(every)[order]
    offsets = alloc((len(order) + 1,), np.int64)
    offsets[0] = 0
    np.cumsum(lengths, out=offsets[1:])
    data = alloc((int(offsets[-1]),), np.uint8)
    whole = np.concatenate(datas) if datas else np.empty(0, dtype=np.uint8)
    take = np.repeat(begin - offsets[:-1], lengths) + np.arange(len(data), dtype=np.int64)
    data[:] = whole[take]
    return MetadataBatch(out, positions, RecordList(data, offsets, deserialize))


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
        if deserialize is not None and not callable(deserialize):  # (it failed at a record)
            raise TypeError(
                f"deserialize must be a function of a record's bytes, got {deserialize!r}"
            )
        super().__init__(data, window, stride, storage_options)
        if self.source.meta is None and self.source.spans is None:
            raise FormatError(f"{self.source.description} has no metadata")
        refuse_field_names(
            self.source.description, self.source.dtype.names or (), METADATA_KEYS, "the view"
        )
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
        """The view protocol (``tokload.views.contract``): the fields (all but
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
        return res.raw()

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
