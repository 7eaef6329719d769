"""What a ``Blend`` reads, by the kind of its components.

A blend (``tokload.views.blend``) turns its positions into ``(component, index
in component)`` pairs (``Blend.locate``); what it reads for them depends on
what its components are. One class per kind:

- ``WindowMix``: windows of ``TokenStream``s, and where documents start in
  them (the attention keys of ``boundaries=``);
- ``RecordMix``: windows of ``StreamWithMetadata``s with their records;
- ``DocumentMix``: documents (``Documents`` of any source, or a user's view
  with the document contract of ``tokload.views.contract``), for the batching
  policies.

Each checks at construction that the components agree (window, dtype,
attention keys, fields), and reads located samples: every component's reads
go straight into the batch's arrays, in one engine call where the components
give their reads as parts (``tokload._rows.read_ranges``). A component that is
itself a blend is read through its own mix, after its own ``locate``.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from tokload._docindex import ExtentIndex, extents_many
from tokload._rows import RowSets, read_ranges
from tokload.views.base import Fields, ReadPart, dtype_fields
from tokload.views.contract import Alloc, document_extents
from tokload.views.documents import Documents, plain_target
from tokload.views.metadata import MetadataBatch, gather_batches
from tokload.views.windows import TokenStream, window_part

Located = tuple[np.ndarray, np.ndarray]
"""``(component, index in component)``, int64 arrays (``Blend.locate``)."""


class WindowMix:
    """A blend of windows: ``TokenStream``s (or blends of them) with one window,
    dtype and ``boundaries``.

    ``plain`` is set when every component is a plain ``TokenStream`` of a plain
    dtype: their windows are then one read part for all of them."""

    kind = "windows"

    def __init__(self, views: Sequence[Any], nested: Sequence[bool]) -> None:
        self.views, self.nested = list(views), list(nested)
        first = views[0]
        self.window: int = first.window
        self.dtype = self._dtype_of(0)
        for c, v in enumerate(views):
            if v.window != self.window or self._dtype_of(c) != self.dtype:
                raise ValueError(
                    f"component {c} has window {v.window} and dtype {self._dtype_of(c)}; "
                    f"component 0 has {self.window} and {self.dtype}"
                    + _token_field_hint(dtype_fields(self._dtype_of(c)), dtype_fields(self.dtype))
                )
        self.keys: tuple[str, ...] = tuple(getattr(first, "boundary_keys", ()))
        for c, v in enumerate(views):
            theirs = tuple(getattr(v, "boundary_keys", ()))
            if theirs != self.keys:
                raise ValueError(
                    f"component {c} has boundaries={list(theirs) or False}, component 0 "
                    f"boundaries={list(self.keys) or False}: the windows of a blend carry "
                    "the same attention keys"
                )
        self.plain = _plain_windows(views)

    def _dtype_of(self, c: int) -> Any:
        v = self.views[c]
        return v._mix.dtype if self.nested[c] else v.source.dtype

    def read_rows(
        self,
        comp: np.ndarray,
        index: np.ndarray,
        rows: np.ndarray,
        out: Fields,
        parts: list[ReadPart],
    ) -> None:
        """Samples ``(comp, index)`` into rows ``rows`` of ``out``: a plain
        dtype's reads are added to ``parts`` (one engine call for every
        component; one part for all where every component is a plain
        ``TokenStream``), a structured one's are read here and placed."""
        plain = self.plain
        if plain is not None and isinstance(out, np.ndarray):
            # windows of observations lo + index, as TokenStream._window_reads
            # makes them, without a part per component (locate's indices are
            # within their components)
            g = plain.lo[comp] + index.astype(np.uint64)
            target = plain.rows.at(comp)
            parts.append(window_part(target, g, plain.stride[comp], self.window, rows, out))
            return
        for c, sel in groups(comp):
            v = self.views[c]
            if self.nested[c]:
                v._mix.read_rows(*v.locate(index[sel]), rows[sel], out, parts)
            elif isinstance(out, np.ndarray):
                parts.append(v._window_reads(index[sel], rows[sel], out))
            else:
                got = v.read(index[sel])
                assert isinstance(got, dict)
                at = rows[sel].astype(np.int64)
                for name, arr in out.items():
                    arr[at] = got[name]

    def window_cuts(
        self, comp: np.ndarray, index: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Where documents start inside the windows of samples ``(comp, index)``
        (``tokload._docindex.window_cuts``): each component's for its windows,
        gathered row by row, so that the batch's arrays are made in one call."""
        b = len(comp)
        rows: list[np.ndarray] = []
        got: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        for c, sel in groups(comp):  # nothing per component but its own call
            rows.append(sel)
            got.append(self.views[c]._window_cuts(index[sel]))
        if not got:
            empty = np.empty(0, dtype=np.uint64)
            return empty, empty.copy(), empty.copy()
        # the rows component by component (``order``), then put back in row order
        order = np.concatenate(rows)
        n_grouped = np.concatenate([n for _, n, _ in got]).astype(np.int64)
        starts = np.empty(b, dtype=np.uint64)
        ncuts = np.empty(b, dtype=np.uint64)
        first = np.empty(b, dtype=np.int64)  # where each row's cuts begin in `grouped`
        starts[order] = np.concatenate([s for s, _, _ in got])
        ncuts[order] = n_grouped
        first[order] = np.cumsum(n_grouped) - n_grouped
        grouped = np.concatenate([cuts for _, _, cuts in got])
        # row r's cuts are grouped[first[r] : first[r] + n[r]]: taken in row order
        n = ncuts.astype(np.int64)
        ahead = np.cumsum(n) - n
        take = np.arange(len(grouped), dtype=np.int64) + np.repeat(first - ahead, n)
        return starts, ncuts, grouped[take]


class RecordMix:
    """A blend of streams with metadata (or blends of them) with one window,
    record fields and ``deserialize``."""

    kind = "metadata"

    def __init__(self, views: Sequence[Any], nested: Sequence[bool]) -> None:
        self.views, self.nested = list(views), list(nested)
        first = views[0]
        self.window: int = first.window
        self.fields = self._fields_of(0)
        self.deserialize = first.deserialize
        for c, v in enumerate(views):
            if v.window != self.window or self._fields_of(c) != self.fields:
                raise ValueError(
                    f"component {c} has window {v.window} and fields "
                    f"{names(dict(self._fields_of(c)))}; component 0 has {self.window} "
                    f"and {names(dict(self.fields))}"
                )
            if v.deserialize is not self.deserialize:
                raise ValueError(
                    f"component {c} deserializes its records with {v.deserialize!r}, "
                    f"component 0 with {self.deserialize!r}: the records of a blend "
                    "have one schema (give every stream the same deserialize)"
                )

    def _fields_of(self, c: int) -> list[tuple[str, np.dtype[Any]]]:
        """The fields (but ``metadata_id``) of component ``c``'s windows."""
        v = self.views[c]
        if self.nested[c]:
            fields: list[tuple[str, np.dtype[Any]]] = v._mix.fields
            return fields
        return [(name, dt) for name, dt, _ in v._lay]

    def read_batches(
        self, comp: np.ndarray, index: np.ndarray, sizes: Sequence[int], alloc: Alloc
    ) -> list[MetadataBatch]:
        """Windows with their records, batch by batch: samples ``(comp, index)``
        are the batches' back to back (``sizes`` each). Each component's samples
        of all the batches are read in one call of its own (nested blends too),
        then each batch is gathered row by row with its records renumbered over
        the batch (``gather_batches``)."""
        ends = np.cumsum(sizes, dtype=np.int64)
        row_of = np.arange(len(comp)) - np.repeat(ends - sizes, sizes)
        parts: list[list[tuple[np.ndarray, MetadataBatch]]] = [[] for _ in sizes]
        for c, sel in groups(comp):
            v = self.views[c]
            # sel is in position order: its samples of batch j are one run of it
            bounds = np.searchsorted(sel, ends).tolist()
            runs = [(j, sel[a:e]) for j, (a, e) in enumerate(itertools.pairwise([0, *bounds]))]
            asked = [(j, rows) for j, rows in runs if len(rows)]
            ix = [index[rows] for _, rows in asked]
            got: list[MetadataBatch]
            if self.nested[c]:
                located = v.locate(np.concatenate(ix))
                got = v._mix.read_batches(*located, [len(i) for i in ix], np.empty)
            else:
                got = [as_metadata_batch(r, self.fields) for r in v.read_batches(ix, np.empty)]
            for (j, rows), g in zip(asked, got, strict=True):
                parts[j].append((row_of[rows], g))
        return [
            gather_batches(p, n, self.window, self.fields, alloc, self.deserialize)
            for p, n in zip(parts, sizes, strict=True)
        ]


class DocumentMix:
    """A blend of views of documents (or blends of them) with the same fields.

    ``plain`` is set when every component is a plain ``Documents`` with a
    document index of its own and one dtype: their extents are then one
    compiled call, and their reads one part."""

    kind = "documents"

    def __init__(self, views: Sequence[Any], nested: Sequence[bool]) -> None:
        self.views, self.nested = list(views), list(nested)
        self.fields: dict[str, Any] = dict(views[0].fields)
        for c, v in enumerate(views):
            if dict(v.fields) != self.fields:
                raise ValueError(
                    f"component {c} has the fields {names(v.fields)}; "
                    f"component 0 has {names(self.fields)}"
                    + _token_field_hint(dict(v.fields), self.fields)
                )
        self.plain = _plain_documents(views)

    def extents(self, comp: np.ndarray, index: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Each sample's ``extents`` in its component: one compiled call over
        every component's document index where all are plain ``Documents``
        (``tokload._docindex.extents_many``), else a call per component."""
        plain = self.plain
        if plain is not None:
            return extents_many(plain.indexes, plain.offsets, comp, index)
        starts = np.empty(len(comp), dtype=np.uint64)
        lengths = np.empty(len(comp), dtype=np.uint64)
        for c, sel in groups(comp):
            starts[sel], lengths[sel] = document_extents(self.views[c], index[sel])
        return starts, lengths

    def extent_parts(
        self,
        comp: np.ndarray,
        index: np.ndarray,
        starts: np.ndarray,
        lengths: np.ndarray,
        dst: np.ndarray,
        out: Mapping[str, np.ndarray],
        parts: list[ReadPart],
    ) -> None:
        """Add the reads of the samples' documents to ``parts`` (nested blends'
        too); a component that cannot give its reads as a part (a structured
        dtype, a user's view) reads its documents here."""
        starts, lengths, dst = (np.asarray(a, dtype=np.uint64) for a in (starts, lengths, dst))
        plain = self.plain
        if plain is not None and plain.dtype.fields is None:
            # every component a plain Documents of one plain dtype: one part for
            # all of them, each document read from its component's rows (no
            # grouping, and no check or plan per component)
            tokens, byte_dst = plain_target(plain.dtype, dst, out)
            parts.append((plain.rows.at(comp), starts, lengths, byte_dst, tokens))
            return
        for c, sel in groups(comp):
            v = self.views[c]
            args = (starts[sel], lengths[sel], dst[sel], out)
            if self.nested[c]:
                v._mix.extent_parts(*v.locate(index[sel]), *args, parts)
                continue
            reads = getattr(v, "_extent_reads", None)
            part = reads(*args) if reads is not None else None
            if part is None:
                v.read_extents(index[sel], *args)
            else:
                parts.append(part)

    def read_padded(self, comp: np.ndarray, index: np.ndarray, alloc: Alloc) -> dict[str, Any]:
        """The samples' documents padded with zeros to the longest, and their
        ``"lengths"`` (as the ``Pad()`` policy gives them): one engine call."""
        starts, lengths = self.extents(comp, index)
        width = max(1, int(lengths.max())) if len(lengths) else 1
        b = len(comp)
        out = {k: alloc((b * width,), dt) for k, dt in self.fields.items()}
        for a in out.values():
            a[...] = 0
        if b:
            parts: list[ReadPart] = []
            dst = np.arange(b, dtype=np.uint64) * np.uint64(width)
            self.extent_parts(comp, index, starts, lengths, dst, out, parts)
            read_ranges(parts)
        raw: dict[str, Any] = {k: v.reshape(b, width) for k, v in out.items()}
        raw["lengths"] = lengths.astype(np.int64)
        return raw


def as_metadata_batch(
    raw: dict[str, Any], fields: list[tuple[str, np.dtype[Any]]]
) -> MetadataBatch:
    """A stream's ``read_batch`` dict as the ``MetadataBatch`` it was made from."""
    return MetadataBatch(
        {name: raw[name] for name, _ in fields}, raw["metadata_positions"], raw["metadata"]
    )


@dataclass(frozen=True)
class PlainDocuments:
    """What a blend whose components are all plain ``Documents`` reads them with,
    without a call per component: their document indexes and first documents
    (``Documents._lo``) for ``extents_many``, their rows as one ``RowSets``, and
    their dtype."""

    indexes: tuple[ExtentIndex, ...]
    offsets: np.ndarray
    rows: RowSets
    dtype: np.dtype[Any]


def _plain_documents(views: Sequence[Any]) -> PlainDocuments | None:
    """None unless every component is a plain ``Documents`` with a document
    index of its own (a user's view, a subclass or a nested blend has its own
    ``extents`` and reads)."""
    if not all(type(v) is Documents for v in views):
        return None
    indexes = tuple(v.source.docs for v in views)
    dtypes = {v.source.dtype for v in views}
    if not all(isinstance(i, ExtentIndex) for i in indexes) or len(dtypes) != 1:
        return None
    return PlainDocuments(
        indexes,
        np.array([v._lo for v in views], dtype=np.uint64),
        RowSets(v.source.rows for v in views),
        dtypes.pop(),
    )


@dataclass(frozen=True)
class PlainWindows:
    """What a blend whose components are all plain ``TokenStream``s reads their
    windows with, without a part per component: their rows as one ``RowSets``,
    and each one's first observation (``_lo``) and stride (uint64)."""

    rows: RowSets
    lo: np.ndarray
    stride: np.ndarray


def _plain_windows(views: Sequence[Any]) -> PlainWindows | None:
    """None unless every component is a plain ``TokenStream`` of a plain dtype
    (a subclass, a user's view or a nested blend reads its own way)."""
    if not all(type(v) is TokenStream and v.source.dtype.fields is None for v in views):
        return None
    return PlainWindows(
        RowSets(v.source.rows for v in views),
        np.array([v._lo for v in views], dtype=np.uint64),
        np.array([v.stride for v in views], dtype=np.uint64),
    )


def groups(comp: np.ndarray) -> list[tuple[int, np.ndarray]]:
    """``(component, the positions of comp that hold it)`` for each component
    present: one stable sort, not a scan per component (a blend may have 1,000)."""
    if len(comp) == 0:
        return []
    order = np.argsort(comp, kind="stable")
    sorted_comp = comp[order]
    cuts = np.flatnonzero(np.diff(sorted_comp)) + 1
    return [
        (int(sorted_comp[a]), order[a:e])
        for a, e in zip([0, *cuts.tolist()], [*cuts.tolist(), len(comp)], strict=True)
    ]


def _token_field_hint(a: Mapping[str, Any], b: Mapping[str, Any]) -> str:
    """What to do when one component's one field is ``token`` (a build with metadata)
    and the other's ``tokens`` (a plain source): "" otherwise."""
    if {tuple(a), tuple(b)} != {("token",), ("tokens",)}:
        return ""
    return (
        " (a tokload build with metadata, --keep-field or --annotations, stores its tokens "
        "as the field 'token', and a plain source, a Megatron prefix, a flat file or a "
        "build without metadata, as 'tokens': a blend of both needs the tokload "
        "sources built without metadata)"
    )


def names(fields: Mapping[str, Any]) -> str:
    """``"tokens: uint32, ..."``: fields for an error message."""
    return ", ".join(f"{k}: {np.dtype(v)}" for k, v in fields.items())
