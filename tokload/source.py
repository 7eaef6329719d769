"""Opened datasets: a tokload dataset directory (or URL prefix) as a ``Source``.

The one job of this module is to turn a dataset (FORMAT.md; a foreign format
is opened by ``tokload.interop``) into a ``Source``: the open files of its
shards with their row counts, document index and metadata, validated from the
manifest and file sizes alone, without reading any data.
"""

from __future__ import annotations

import functools
import inspect
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

from tokload._docindex import DocIndex, ExtentIndex
from tokload._meta import SPAN_ENTRY, BlockSet, SpanSet
from tokload._metaids import MetaSet
from tokload._rows import RowSet
from tokload._tables import compressed_table_bytes
from tokload.envvars import env_int
from tokload.errors import FormatError, MissingShardError, StateError
from tokload.format import Manifest, manifest_at
from tokload.location import Location
from tokload.remote.urls import absolute_local


@dataclass
class Source:
    """An opened dataset, whatever its format: what the views read from.

    Attributes:
        rows: the token stream (all shards' rows in order).
        dtype: the row dtype.
        docs: document extents, or None when the source has no documents.
        meta: the metadata of a stream with metadata whose rows carry a
            ``metadata_id`` (layout ``"per_token"``), or None.
        spans: the metadata of one whose shards have span tables or metadata
            blocks, or None.
        fingerprint: identifies the contents, for resume checks.
        description: where it came from, for messages.
    """

    rows: RowSet
    dtype: np.dtype[Any]
    docs: ExtentIndex | None
    meta: MetaSet | None
    fingerprint: str
    description: str
    manifest: Manifest | None = None
    user: dict[str, Any] = field(default_factory=dict)
    spans: SpanSet | BlockSet | None = None
    """The span tables (layout ``"spans"``) or metadata blocks (``"blocks"``) of
    a stream with metadata (then ``meta`` is None), or None."""
    _closers: list[Any] = field(default_factory=list, repr=False)
    opener: tuple[Callable[..., Source], tuple[Any, ...], dict[str, Any]] | None = field(
        default=None, repr=False, compare=False
    )
    """How it was opened (``reopenable``): the function and its arguments, which
    pickling the source records instead of its open files; None for a source
    built by hand, which cannot be pickled."""

    def __reduce__(self) -> tuple[Any, ...]:
        """A pickled source is opened again where it is unpickled (another
        process: ``spawn``, Ray, ``copy.deepcopy``), by the call that opened it,
        and must find the same data (``fingerprint``): else ``StateError``."""
        if self.opener is None:
            raise TypeError(
                f"{self.description}: this Source was not made by tokload's open functions "
                "(open_dataset, open_megatron, open_flat, a view's path), so it cannot be "
                "pickled: pickle the path it was opened from, or a view opened from it"
            )
        return (_reopen, (self.opener, self.fingerprint, self.description))

    @property
    def num_rows(self) -> int:
        return int(self.rows.total)

    @property
    def num_documents(self) -> int:
        if self.docs is None:
            raise FormatError(f"{self.description} has no document index")
        return int(self.docs.total)

    def close(self) -> None:
        """Close every file (idempotent)."""
        for c in self._closers:
            c.close()


OpenFn = TypeVar("OpenFn", bound=Callable[..., Source])


PATH_PARAMETERS = ("doc_index",)
"""Parameters of an opening function besides its first that name files."""


def reopenable(open_fn: OpenFn) -> OpenFn:
    """Decorate a function that opens a Source so that the Source records the
    call (``Source.opener``; the innermost decorated call wins) and can be
    pickled as it. The function's first parameter is the data's path, and
    those of ``PATH_PARAMETERS`` it has name files too: a relative local one
    is recorded made absolute (``absolute_local``)."""

    signature = inspect.signature(open_fn)
    first = next(iter(signature.parameters))  # the data's path
    paths = {first, *(p for p in PATH_PARAMETERS if p in signature.parameters)}

    @functools.wraps(open_fn)
    def opener(*args: Any, **kwargs: Any) -> Source:
        src = open_fn(*args, **kwargs)
        if src.opener is None:
            # the paths as opened here, whatever directory unpickles it
            bound = signature.bind_partial(*args, **kwargs)
            for name in paths & bound.arguments.keys():
                bound.arguments[name] = absolute_local(bound.arguments[name])
            src.opener = (opener, bound.args, bound.kwargs)
        return src

    return opener  # type: ignore[return-value]


def _reopen(
    opener: tuple[Callable[..., Source], tuple[Any, ...], dict[str, Any]],
    fingerprint: str,
    description: str,
) -> Source:
    """A pickled Source, opened again: StateError unless it holds the same data."""
    fn, args, kwargs = opener
    src = fn(*args, **kwargs)
    refuse_changed(src, fingerprint, "source", description)
    return src


def refuse_changed(opened: Any, fingerprint: str, what: str, name: str) -> None:
    """StateError (``opened`` closed first) unless ``opened``, a Source or a view
    made again from its pickle, has the ``fingerprint`` it was pickled with."""
    now = opened.fingerprint
    if now != fingerprint:
        opened.close()
        raise StateError(
            f"{name}: the data changed since this {what} was pickled (fingerprint "
            f"{fingerprint} when pickled, {now} now): open it again to read what is there now"
        )


def _expect_size(loc: Location, path: str, what: str, expected: int) -> None:
    size = loc.size(path, what)
    if size != expected:
        raise FormatError(f"{path}: {what} is {size} bytes but the manifest implies {expected}")


DEFAULT_INDEX_MEMORY = 1 << 30
"""Bytes of each kind of index a dataset may hold in memory (``TOKLOAD_INDEX_MEMORY``)."""


def index_memory() -> int:
    """The most bytes of each kind of per-shard index (the document index, the
    metadata block index) an opened dataset holds in memory:
    ``TOKLOAD_INDEX_MEMORY`` (an integer number of bytes, 0 to never hold one),
    else ``DEFAULT_INDEX_MEMORY``. An index that takes more is read entry
    by entry instead, a round of small reads per batch before the rows; one
    that fits is read whole, a shard at a time, when a batch first needs it,
    and kept (in this process) until the opened dataset is garbage-collected.
    A document index is weighed at its files' size (8 bytes a document; once
    loaded, each shard's table carries a directory of at most a quarter more,
    ``_tables.ShardTables``); a metadata
    block index is held compressed and weighed at about 2.1 bytes a block
    (``tokload._tables.compressed_table_bytes``; a group of 64 blocks that
    holds one of 64 KiB or more takes 512 bytes more once loaded), so a 4 TB
    corpus of ``uint16`` tokens holds its block index in about 1.04 GB."""
    return env_int("TOKLOAD_INDEX_MEMORY", DEFAULT_INDEX_MEMORY, 0, "a number of bytes (>= 0)")


@reopenable
def open_dataset(
    path: str | os.PathLike[str], storage_options: Mapping[str, Any] | None = None
) -> Source:
    """Open a tokload dataset: a directory, or an object-store URL prefix
    (``s3://bucket/prefix``, ``gs://``, ``az://``; see ``tokload.remote``).

    Reads the manifest and ``stat``s each file (lists the prefix once, for a
    URL). No data is read; the time taken depends on the number of shards only.

    Args:
        path: the dataset.
        storage_options: the object store's options (URLs only): endpoint,
            credentials, retries; the environment's by default.

    Raises:
        MissingShardError: the manifest or a file it lists is missing.
        FormatError: unknown version, bad dtype, a file whose size disagrees.
    """
    return open_dataset_at(Location(path, storage_options))


def open_dataset_at(loc: Location) -> Source:
    """``open_dataset`` of a Location (a remote one reuses its listing)."""
    m = manifest_at(loc)
    item = m.dtype.itemsize
    rows_paths, docs_paths, mdx_paths, mdb_paths, mds_paths, msx_paths = [], [], [], [], [], []
    msb_paths, mbx_paths = [], []
    block = m.span_block
    index_bytes = 0
    for s in m.shards:
        rp = loc.join(s.name + ".rows")
        _expect_size(loc, rp, "shard rows", s.rows * item)
        rows_paths.append(rp)
        if m.documents:
            dp = loc.join(s.name + ".docs")
            _expect_size(loc, dp, "document index", (s.documents + 1) * 8)
            docs_paths.append(dp)
        if m.blocks:
            bp = loc.join(s.name + ".msb")
            kp = loc.join(s.name + ".mbx")
            _expect_size(loc, bp, "metadata blocks", s.metadata_bytes)
            entries = -(-s.rows // block) + 1
            _expect_size(loc, kp, "metadata block index", entries * 8)
            index_bytes += compressed_table_bytes(entries)  # as held (ctab.h)
            msb_paths.append(bp)
            mbx_paths.append(kp)
        elif m.metadata:
            xp = loc.join(s.name + ".mdx")
            bp = loc.join(s.name + ".mdb")
            _expect_size(loc, xp, "metadata index", (s.metadata_records + 1) * 8)
            _expect_size(loc, bp, "metadata records", s.metadata_bytes)
            mdx_paths.append(xp)
            mdb_paths.append(bp)
        if m.spans:
            sp = loc.join(s.name + ".mds")
            kp = loc.join(s.name + ".msx")
            _expect_size(loc, sp, "span table", s.metadata_runs * SPAN_ENTRY)
            _expect_size(loc, kp, "span block index", (-(-s.rows // block) + 1) * 8)
            mds_paths.append(sp)
            msx_paths.append(kp)
    closers: list[Any] = []
    try:
        files = loc.fileset(rows_paths)
        closers.append(files)
        rows = RowSet(files, [s.rows for s in m.shards], item)
        docs = None
        if m.documents:
            dfiles = loc.fileset(docs_paths)
            closers.append(dfiles)
            docs_bytes = sum((s.documents + 1) * 8 for s in m.shards)
            docs = DocIndex(
                dfiles, [s.documents for s in m.shards], rows, docs_bytes <= index_memory()
            )
        meta = None
        spans: SpanSet | BlockSet | None = None
        if m.blocks:
            kfiles, bfiles = loc.fileset(mbx_paths), loc.fileset(msb_paths)
            closers += [kfiles, bfiles]
            spans = BlockSet(
                rows,
                kfiles,
                bfiles,
                [s.metadata_records for s in m.shards],
                [s.metadata_bytes for s in m.shards],
                block,
                index_bytes <= index_memory(),
            )
        elif m.spans:
            xfiles, bfiles = loc.fileset(mdx_paths), loc.fileset(mdb_paths)
            sfiles, kfiles = loc.fileset(mds_paths), loc.fileset(msx_paths)
            closers += [xfiles, bfiles, sfiles, kfiles]
            spans = SpanSet(
                rows,
                kfiles,
                sfiles,
                xfiles,
                bfiles,
                [s.metadata_runs for s in m.shards],
                [s.metadata_records for s in m.shards],
                [s.metadata_bytes for s in m.shards],
                block,
            )
        elif m.metadata:
            xfiles, bfiles = loc.fileset(mdx_paths), loc.fileset(mdb_paths)
            closers += [xfiles, bfiles]
            meta = MetaSet(
                xfiles,
                bfiles,
                [s.metadata_records for s in m.shards],
                [s.metadata_bytes for s in m.shards],
                rows,
            )
    except FileNotFoundError as e:
        for c in closers:
            c.close()
        raise MissingShardError(2, "a shard file disappeared while opening", e.filename) from None
    except BaseException:
        for c in closers:
            c.close()
        raise
    return Source(
        rows=rows,
        dtype=m.dtype,
        docs=docs,
        meta=meta,
        fingerprint=m.fingerprint(),
        description=loc.root,
        manifest=m,
        spans=spans,
        _closers=closers,
    )
