"""``Documents``: observation ``i`` is document ``i``."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from tokload._docindex import read_documents
from tokload._rows import read_ranges, split_fields
from tokload.arguments import check_fits, is_integer, positive_integer
from tokload.errors import FormatError
from tokload.views.base import (
    DataLike,
    Fields,
    ReadPart,
    View,
    _check_out,
    _field_layout,
    dtype_fields,
)
from tokload.views.contract import Alloc


def plain_target(
    dtype: np.dtype[Any], dst: npt.ArrayLike, out: Mapping[str, np.ndarray]
) -> tuple[np.ndarray, np.ndarray]:
    """Where documents of a plain ``dtype`` are read: ``out["tokens"]`` (checked
    against the dtype) and the documents' destinations (rows) in bytes, as a
    read part (``ReadPart``) takes them."""
    tokens = out["tokens"]
    _check_out(tokens, tokens.shape, dtype, "out['tokens']")
    return tokens, np.asarray(dst, dtype=np.uint64) * np.uint64(dtype.itemsize)


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
    # (window and lookahead meant something only to "fill": review68 found them dropped)
    batch = given.get("batch", "fill" if {"window", "lookahead"} & set(given) else "pad")
    if batch not in ("fill", "pack", "pad"):
        return (
            f"Documents(data, batch={batch!r}) was retired in tokload 0.2 (and {batch!r} was "
            "never a batch): batching is the DataLoader's policy now, "
            "DataLoader(Documents(data), batch_size, batching=tokload.Pad(), Pack() or Fill(W))"
        )
    if batch == "fill":
        window = given.get("window")
        args = ["W" if window is None else f"window={window!r}"]
        if "lookahead" in given:
            args.append(f"lookahead={given['lookahead']!r}")
        if "pad_value" in given:
            args.append(f"value={given['pad_value']!r}")
        if "boundaries" in given:
            args.append(f"attention={given['boundaries']!r}")
        new = f"Fill({', '.join(args)})"
    elif batch == "pack":
        new = "Pack()"
    else:
        args = []
        if given.get("pad_to") is not None:
            args.append(f"to={given['pad_to']!r}")
        if "pad_value" in given:
            args.append(f"value={given['pad_value']!r}")
        new = f"Pad({', '.join(args)})"
    return (
        f"Documents(data, {', '.join(f'{k}={v!r}' for k, v in given.items())}) was retired "
        "in tokload 0.2: "
        "batching is the DataLoader's policy now. Write "
        f"DataLoader(Documents(data), batch_size, batching=tokload.{new})"
        + (" (W: the tokens of a row)" if new.startswith("Fill(W") else "")
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

    @property
    def batching(self) -> Any:
        """The DataLoader's default policy for this view: ``Pad()`` (``tokload.batching``)."""
        from tokload.batching import Pad  # the policies read views: imported when asked

        return Pad()

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
    def read_rows(self) -> Any:
        """Retired in 0.2: AttributeError naming what to write."""
        raise AttributeError(
            "Documents.read_rows was retired in tokload 0.2: rows filled with documents "
            "come from DataLoader(docs, B, batching=tokload.Fill(window)) (or "
            "tokload.Fill(window).reader(...) for one step)"
        )

    @property
    def packing(self) -> Any:
        """Retired in 0.2: AttributeError naming what to write."""
        raise AttributeError(
            "Documents.packing was retired in tokload 0.2: packing is the loader's policy, "
            "DataLoader(docs, B, batching=tokload.Fill(window)) or tokload.Pack()"
        )

    @property
    def fields(self) -> dict[str, np.dtype[Any]]:
        """The document contract (``tokload.batching``): ``{"tokens": dtype}``, or
        one entry per field of a structured dtype."""
        return dtype_fields(self.source.dtype)

    def read_batch(self, indices: np.ndarray, alloc: Alloc) -> dict[str, Any]:
        """The view protocol (``tokload.views.contract``): ``"tokens"`` ``[B, L]``
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
        part = self._extent_reads(starts, lengths, dst, out)
        if part is not None:
            read_ranges([part])
            return
        lengths = np.ascontiguousarray(lengths, dtype=np.uint64)
        dst = np.ascontiguousarray(dst, dtype=np.uint64)
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

    def _extent_reads(
        self,
        starts: np.ndarray,
        lengths: np.ndarray,
        dst: np.ndarray,
        out: Mapping[str, np.ndarray],
    ) -> ReadPart | None:
        """``read_extents``'s reads as a part for ``tokload._rows.read_ranges``
        (a ``Blend`` reads every component's in one engine call); None for a
        structured dtype, whose rows are split into fields after the read."""
        dt = self.source.dtype
        if dt.fields is not None:
            return None
        tokens, byte_dst = plain_target(dt, dst, out)
        return (self.source.rows, starts, lengths, byte_dst, tokens)

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
        if length is not None:
            length = positive_integer("length", length)  # (2.5 was 2, True 1)
        if not is_integer(pad):  # (1.5 and True padded with 1; fields too)
            raise TypeError(f"pad must be an integer token, got {pad!r}")
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
        dt = self.source.dtype
        return np.array(check_fits(pad, dt, "the padding value"), dtype=dt).tobytes()

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
