"""Writing datasets: the one job of this module is ``Writer``, which appends
documents to a new dataset, shard by shard (the files of a shard being written are
``tokload.shardfiles``'s); datasets made from other datasets (``merge``,
``convert``) are ``tokload.derive``'s.

The writer keeps FORMAT.md's promise: the manifest is written last and
atomically, and lists only shards whose files are complete and fsynced, so a
crash never leaves a manifest that refers to data that is not on disk.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import operator
import os
import secrets
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import numpy as np
import numpy.typing as npt

from tokload.arguments import positive_integer
from tokload.errors import FormatError
from tokload.files import DirectoryLock, file_version, fsync_dir
from tokload.format import (
    DEFAULT_METADATA_BLOCK,
    DEFAULT_METADATA_LAYOUT,
    DEFAULT_SPAN_BLOCK,
    LAYOUTS,
    MANIFEST,
    MAX_METADATA_BLOCK,
    METADATA_FIELD,
    NO_METADATA,
    SHARD_FILES,
    Manifest,
    ShardInfo,
    check_dtype,
    read_manifest,
    write_manifest,
)
from tokload.shardfiles import CONTINUED, OpenShard

Span = tuple[int, int, bytes]
"""A metadata record attached to rows ``[start, stop)`` of a document."""

MAX_RECORD = 0xFFFFFFFF
"""The largest record a metadata block can hold (its ends are uint32)."""


class Writer:
    """Write a tokload dataset, one document at a time.

    Args:
        path: the dataset directory (created if needed).
        dtype: the row dtype: a plain integer dtype (``"<u4"``) or a structured
            one with integer fields (``[("token", "<u4"), ("concept", "<u2")]``).
        metadata: write a stream with metadata: records attached to spans
            of rows, stored as ``metadata_layout`` says.
        metadata_layout: ``"blocks"`` (FORMAT.md version 3: per shard, blocks
            of ``span_block`` rows that each hold their runs of rows with one
            record and those records' bytes, so a window reads its metadata
            in one piece; about 6 bytes per run plus the records), ``"spans"``
            (version 2: a span table per shard, 12 bytes per run, with the
            records in ``.mdx``/``.mdb``) or ``"per_token"`` (version 1: a
            ``"<u4"`` field ``metadata_id`` in every row, which the writer
            fills). None (the default): ``"per_token"`` when the dtype has
            a ``metadata_id`` field, else the dataset's when appending, else
            ``"blocks"``.
        span_block: rows per metadata block (``"blocks"``, default 4096, at
            most 65536) or per entry of the span tables' block index
            (``"spans"``, default 1024). Appending takes the dataset's; one
            given that differs is refused.
        shard_bytes: start a new shard before a document that would take the
            current one past this many bytes of rows (a single larger document
            still gets a shard of its own). Default 1 GiB.
        mode: ``"w"`` to create (refuses an existing dataset), ``"a"`` to add
            shards to one (same dtype and options required; existing shards are
            never touched).
        name_prefix: shard names are ``f"{name_prefix}-{k:05d}"``; by default a
            random prefix, so writers running in parallel never collide. ``k``
            skips the names the manifest lists and those a killed writer's
            files still use. Not empty, no ``/`` or NUL, no leading ``.``.
        user: a mapping of JSON values stored in the manifest (tokenizer,
            source, ...); one that is not JSON (a set, NaN) is refused here,
            before anything is written.
        durable: fsync each shard and the directory before listing it.

    Use as a context manager, or call ``close``: nothing is visible to
    readers until a shard is closed and the manifest rewritten.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        dtype: npt.DTypeLike = "<u4",
        *,
        metadata: bool = False,
        metadata_layout: str | None = None,
        span_block: int | None = None,
        shard_bytes: int = 1 << 30,
        mode: str = "w",
        name_prefix: str | None = None,
        user: Mapping[str, Any] | None = None,
        durable: bool = True,
    ) -> None:
        # absolute: the shards, the directory's fsync and the manifest go to the
        # directory it named when opened, whatever the working directory is later
        self.path = Path(os.path.abspath(path))
        if mode not in ("w", "a"):
            raise ValueError(f"mode must be 'w' or 'a', got {mode!r}")
        shard_bytes = positive_integer("shard_bytes", shard_bytes)
        self.dtype: np.dtype[Any] = np.dtype(dtype).newbyteorder("<")
        check_dtype(self.dtype, "Writer dtype")
        has_field = METADATA_FIELD in (self.dtype.fields or {})
        appending = mode == "a" and (self.path / MANIFEST).exists()
        if metadata_layout is None and not has_field and appending:
            there = read_manifest(self.path)
            if there.metadata:  # keep the dataset's (one without metadata is refused below)
                metadata_layout = there.metadata_layout
        if metadata_layout is None:
            metadata_layout = "per_token" if has_field else DEFAULT_METADATA_LAYOUT
        if metadata_layout not in LAYOUTS:
            raise ValueError(
                f"metadata_layout must be one of {', '.join(map(repr, LAYOUTS))}, "
                f"got {metadata_layout!r}"
            )
        if metadata and metadata_layout in ("spans", "blocks") and has_field:
            raise ValueError(
                f"metadata_layout={metadata_layout!r} keeps no {METADATA_FIELD!r} in the rows; "
                f"drop the field from the dtype {self.dtype}"
            )
        if metadata and metadata_layout == "per_token" and not has_field:
            raise FormatError(
                f"Writer dtype: metadata_layout='per_token' needs a '<u4' field "
                f"{METADATA_FIELD!r} in the dtype, got {self.dtype}"
            )
        if name_prefix is not None:
            _check_prefix(name_prefix)
        _check_user(user)
        given_block = span_block
        span_block = checked_block(span_block, metadata_layout)
        self.layout = metadata_layout if metadata else "per_token"
        self.shard_bytes = shard_bytes
        self.durable = durable
        self.path.mkdir(parents=True, exist_ok=True)
        exists = (self.path / MANIFEST).exists()
        if mode == "w" and exists:
            raise FileExistsError(
                17, "a dataset already exists here; use mode='a' to append", str(self.path)
            )
        self._user = dict(user or {})
        self._mode = mode
        self._seen: tuple[int, ...] | None = None  # the manifest as last read or written
        if exists:
            self._seen = _version(self.path / MANIFEST)
            self.manifest = read_manifest(self.path)
            m = self.manifest
            if (
                m.dtype != self.dtype
                or m.metadata != metadata
                or (metadata and m.metadata_layout != self.layout)
            ):
                raise FormatError(
                    f"{self.path}: cannot append dtype={self.dtype}, metadata={metadata} "
                    f"({self.layout}) to a dataset of dtype={m.dtype}, metadata={m.metadata} "
                    f"({m.metadata_layout})"
                )
            if (
                given_block is not None
                and self.layout != "per_token"
                and span_block != m.span_block
            ):
                raise FormatError(
                    f"{self.path}: cannot append with span_block={span_block} to a dataset "
                    f"of span_block={m.span_block} (leave it out to take the dataset's)"
                )
            span_block = m.span_block
            if not self.manifest.documents:
                raise FormatError(f"{self.path}: the dataset has no document index to append to")
            if user:
                self.manifest.user.update(user)
        else:
            self.manifest = Manifest(
                dtype=self.dtype,
                documents=True,
                metadata=metadata,
                user=dict(user or {}),
                metadata_layout=self.layout,
                span_block=span_block,
            )
            self.manifest.check(str(self.path))
        self.metadata = metadata
        self.prefix = name_prefix or f"w{secrets.token_hex(4)}"
        self._taken = {s.name for s in self.manifest.shards}
        self._seq = self._free_seq(0)
        self._shard: OpenShard | None = None
        # Where the document being written in pieces began, and its last record.
        self._doc_mark: tuple[list[int], list[Any], list[Any]] | None = None
        self._tail: bytes | None = None
        # shards finished but not in the manifest yet (its write failed: the next
        # publish, or close, lists them)
        self._pending: list[ShardInfo] = []
        self._tried = False  # whether this writer has begun a write of the manifest
        self._closed = False

    def _name(self, seq: int) -> str:
        return f"{self.prefix}-{seq:05d}"

    def _free_seq(self, seq: int) -> int:
        """The first sequence number from ``seq`` whose shard name no manifest
        shard has and no file on disk uses: a writer killed part-way (SIGKILL,
        a lost node) leaves its open shard's files, listed nowhere, and a later
        writer with the same ``name_prefix`` steps past them rather than
        failing on them or overwriting them."""
        while True:
            name = self._name(seq)
            if name not in self._taken and not any(
                (self.path / f).exists()
                for ext in SHARD_FILES
                for f in (f"{name}.{ext}", f".{name}.{ext}.tmp")
            ):
                return seq
            seq += 1

    # ---- writing -------------------------------------------------------------

    def write(
        self,
        rows: npt.ArrayLike | Mapping[str, npt.ArrayLike],
        spans: Sequence[Span] | None = None,
        *,
        end: bool = True,
    ) -> None:
        """Append one document, or a piece of one.

        A document too large to hold in memory is written in pieces: every
        piece but the last with ``end=False``, the last with ``end=True``.
        The pieces' rows follow one another in one document of one shard
        (which grows past ``shard_bytes`` if the document does); ``discard``
        drops the pieces of a document not ended yet, and so does ``close``.

        Args:
            rows: the document's rows: an array convertible to the dataset
                dtype without loss (values out of a field's range are an error,
                never wrapped), or, for a structured dtype, a mapping from field
                name to a 1-D array (missing fields are 0).
            spans: for a dataset with metadata, ``(start, stop, payload)`` per
                metadata record: rows ``[start, stop)`` of this document get
                that record (``start``, ``stop`` integers; ``payload`` bytes or
                another buffer, stored as is: a ``str`` or an ``int`` is refused). Spans must not
                overlap; rows outside every span have no metadata. For a
                piece, the spans are relative to the piece.
            end: whether these rows end the document (``False``: the next
                write goes on with the same document).
        """
        if self._closed:
            raise ValueError("write to a closed Writer")
        arr = self._convert(rows)
        n = len(arr)
        payloads: list[bytes] = []
        runs: tuple[np.ndarray, np.ndarray] | None = None
        ordered = sorted((_span(s) for s in spans or ()), key=lambda s: s[0])
        # A piece whose first record is the one the previous piece ended with goes on
        # with that record (one record, one run), not a copy of it.
        cont = bool(ordered) and ordered[0][0] == 0 and self._tail == ordered[0][2]
        if self.metadata and self.layout in ("spans", "blocks"):
            starts: list[int] = []
            records: list[int] = []
            covered = 0
            for k, (start, stop, payload) in enumerate(ordered):
                if not (0 <= start < stop <= n):
                    raise ValueError(
                        f"span [{start}, {stop}) is not a non-empty range within the document's "
                        f"{n} rows"
                    )
                if start < covered:
                    raise ValueError(f"span [{start}, {stop}) overlaps another span")
                if start > covered:
                    starts.append(covered)
                    records.append(NO_METADATA)
                starts.append(start)
                covered = stop
                if cont and k == 0:
                    records.append(CONTINUED)
                    continue
                records.append(len(payloads))  # renumbered to shard ids below
                payloads.append(payload)
                if self.layout == "blocks" and len(payloads[-1]) > MAX_RECORD:
                    raise ValueError(
                        f"span [{start}, {stop}): a record of {len(payloads[-1])} bytes; at most "
                        f"{MAX_RECORD} fit in a metadata block"
                    )
            if covered < n:
                starts.append(covered)
                records.append(NO_METADATA)
            runs = (np.array(starts, np.uint64), np.array(records, np.uint32))
        elif self.metadata:
            ids = np.full(n, NO_METADATA, dtype=np.uint32)
            for k, (start, stop, payload) in enumerate(ordered):
                if not (0 <= start < stop <= n):
                    raise ValueError(
                        f"span [{start}, {stop}) is not a non-empty range within the document's "
                        f"{n} rows"
                    )
                if (ids[start:stop] != NO_METADATA).any():
                    raise ValueError(f"span [{start}, {stop}) overlaps another span")
                if cont and k == 0:
                    ids[start:stop] = CONTINUED
                    continue
                ids[start:stop] = len(payloads)  # renumbered to shard ids below
                payloads.append(payload)
        elif spans:
            raise ValueError("spans given, but the dataset was opened with metadata=False")
        nbytes = n * self.dtype.itemsize
        shard = self._shard
        if shard is not None and self._doc_mark is not None:
            # A document goes on: never across shards (its rows are one range).
            if shard.records + len(payloads) >= NO_METADATA:
                raise ValueError(
                    f"a document of more than {NO_METADATA - 1} metadata records does not fit "
                    "in one shard"
                )
        elif (
            shard is not None
            and shard.rows
            and (
                shard.rows * self.dtype.itemsize + nbytes > self.shard_bytes
                or shard.records + len(payloads) >= NO_METADATA
            )
        ):
            self._close_shard()
            shard = None
        while shard is None:
            self._seq = self._free_seq(self._seq)
            # another writer of this prefix may take the name just now: the next one
            with contextlib.suppress(FileExistsError):
                shard = self._shard = OpenShard(
                    self.path, self._name(self._seq), self.manifest, self.durable
                )
            self._seq += 1
        # A piece goes into every file of the shard or into none: an exception
        # (Ctrl+C) part-way through takes the files back to where they were.
        mark = shard.mark()
        try:
            if runs is not None:
                shard.add_runs(runs[0], runs[1], n)
            elif self.metadata:
                arr[METADATA_FIELD] = shard.shard_ids(ids)
            shard.add(arr, payloads, end)
        except BaseException:
            shard.rewind(mark)
            raise
        if end:
            self._doc_mark = self._tail = None
            return
        if self._doc_mark is None:
            self._doc_mark = mark
        last = ordered[-1] if ordered else None
        self._tail = last[2] if last is not None and last[1] == n else None

    def discard(self) -> None:
        """Drop the pieces of the document not ended yet (written with ``end=False``)."""
        if self._doc_mark is not None and self._shard is not None:
            self._shard.rewind(self._doc_mark)
        self._doc_mark = self._tail = None

    def _convert(self, rows: npt.ArrayLike | Mapping[str, npt.ArrayLike]) -> np.ndarray:
        dt = self.dtype
        if isinstance(rows, Mapping):
            if dt.fields is None:
                raise TypeError("a mapping of fields was given, but the dtype is not structured")
            unknown = set(rows) - set(dt.fields)
            if unknown:
                raise ValueError(f"unknown fields {sorted(unknown)}; the dtype has {dt.names}")
            lengths = {len(_as_array(v)) for v in rows.values()}
            if len(lengths) > 1:
                raise ValueError(f"fields have different lengths: {sorted(lengths)}")
            out = np.zeros(lengths.pop() if lengths else 0, dtype=dt)
            for name, values in rows.items():
                out[name] = _checked_cast(_as_array(values), dt.fields[name][0], name)
            return out
        src = _as_array(rows)
        if src.ndim != 1:
            raise ValueError(f"a document must be 1-D, got shape {src.shape}")
        if dt.fields is None:
            return _checked_cast(src, dt, "rows")
        if src.dtype.fields is None:
            raise TypeError(
                f"the dataset dtype is structured ({dt}); pass a structured array "
                "or a mapping of fields"
            )
        out = np.zeros(len(src), dtype=dt)
        for name in src.dtype.names or ():
            if name not in dt.fields:
                raise ValueError(f"unknown field {name!r}; the dtype has {dt.names}")
            out[name] = _checked_cast(src[name], dt.fields[name][0], name)
        return out

    # ---- finishing -------------------------------------------------------------

    def _close_shard(self) -> None:
        shard, self._shard = self._shard, None
        if shard is None:
            return
        try:
            info = shard.finish(self.durable)
        except BaseException:  # nothing of an unfinished shard is left behind
            for f in shard.files:
                f.close()
            shard.remove()
            raise
        if info.rows == 0 and info.documents == 0:
            shard.remove()
            return
        if self.durable:
            fsync_dir(self.path)
        self._publish(info)

    def _publish(self, info: ShardInfo | None) -> None:
        """Write the manifest with shard ``info`` added, under a lock on the
        directory: writers appending to one dataset at once (each its own
        shards) add to the manifest as it is on disk, which another writer may
        have rewritten since this one last did, instead of writing over it."""
        if info is not None:
            self._pending.append(info)  # (first: whatever fails below, it stays to list)
        with DirectoryLock(self.path):
            now = _version(self.path / MANIFEST)
            if now is not None and now != self._seen:
                # a dataset appeared meanwhile, unless this writer's own write of it
                # failed after its rename (the directory's fsync): a retry finds it
                if self._seen is None and self._mode == "w" and not self._tried:
                    raise FileExistsError(
                        17, "a dataset was created here meanwhile", str(self.path)
                    )
                current = read_manifest(self.path)
                if current.shape() != self.manifest.shape():  # another writer's, or replaced
                    raise FormatError(
                        f"{self.path}: the dataset here is now {current.shape()}, not "
                        f"{self.manifest.shape()} as this writer's (another writer created or "
                        "replaced it meanwhile)"
                    )
                current.user.update(self._user)
                self.manifest = current
                there = {s.name for s in current.shards}  # (a write that failed late)
                self._pending = [s for s in self._pending if s.name not in there]
            listed = dataclasses.replace(self.manifest, shards=[*self.manifest.shards])
            listed.shards.extend(self._pending)
            self._tried = True
            write_manifest(self.path, listed)
            self.manifest, self._pending = listed, []
            self._seen = _version(self.path / MANIFEST)

    def flush(self) -> None:
        """Close the current shard and publish it in the manifest."""
        if self._doc_mark is not None:
            raise ValueError("flush in the middle of a document: end it first (end=True)")
        self._close_shard()

    def close(self) -> None:
        """Publish what was written and release the files (idempotent).

        The pieces of a document not ended are dropped (``discard``). When
        the manifest cannot be written (a full disk), ``close`` raises and
        may be called again: the shards finished are listed then.
        """
        if self._closed:
            return
        self.discard()
        try:
            self._close_shard()  # (a shard whose listing failed stays pending)
        finally:
            if not self._pending and not (self.path / MANIFEST).exists():
                self._publish(None)  # an empty dataset is still a dataset
        if self._pending:  # (listings that failed before)
            self._publish(None)
        self._closed = True

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        # Every document ended so far is whole (write validates first), so
        # they are published even when the block raised.
        self.close()


def _span(span: Any) -> Span:
    """A ``(start, stop, payload)`` of ``write`` as ints and bytes: TypeError for
    bounds that are not integers (a float was truncated) or a payload that is not
    bytes (an int ``n`` became ``n`` zero bytes)."""
    try:
        start, stop, payload = span
    except (TypeError, ValueError):
        raise TypeError(f"a span is (start, stop, payload), got {span!r}") from None
    try:
        bounds = operator.index(start), operator.index(stop)
    except TypeError:
        raise TypeError(
            f"span ({start!r}, {stop!r}, ...): start and stop must be integers"
        ) from None
    if isinstance(payload, str):
        raise TypeError(
            f"span [{bounds[0]}, {bounds[1]}): the payload is a str; records are bytes "
            "(encode it, e.g. text.encode() or json.dumps(...).encode())"
        )
    try:
        data = bytes(memoryview(payload))
    except TypeError:
        raise TypeError(
            f"span [{bounds[0]}, {bounds[1]}): the payload must be bytes (or a buffer), "
            f"got {type(payload).__name__}"
        ) from None
    return bounds[0], bounds[1], data


def _check_prefix(prefix: Any) -> None:
    """ValueError for a ``name_prefix`` that would put shards outside the
    directory, in a subdirectory, or among the writer's hidden temporaries."""
    if not isinstance(prefix, str):
        raise TypeError(f"name_prefix must be a str, got {type(prefix).__name__}")
    problem = (
        "is empty"
        if not prefix
        else "contains a NUL character"
        if "\0" in prefix
        else "contains '/': shards go in the dataset's directory itself"
        if "/" in prefix
        else "starts with '.', as the writer's temporary files do"
        if prefix.startswith(".")
        else None
    )
    if problem is not None:
        raise ValueError(f"name_prefix {prefix!r} {problem}")


def _check_user(user: Any) -> None:
    """TypeError or ValueError, before anything is written, for a ``user`` that
    the manifest cannot hold: not a mapping, or not JSON (a set, NaN)."""
    if user is None:
        return
    if not isinstance(user, Mapping):
        raise TypeError(f"user must be a mapping (a JSON object), got {type(user).__name__}")
    try:
        json.dumps(dict(user), allow_nan=False)
    except RecursionError:
        raise ValueError("user is nested too deeply for the manifest's JSON") from None
    except (TypeError, ValueError) as e:  # (a set, NaN or an infinity: not JSON)
        raise type(e)(f"user is not JSON the manifest can hold: {e}") from None


def _version(path: Path) -> tuple[int, ...] | None:
    """``files.file_version`` of a file, None if there is none: a manifest
    rewritten (renamed into place) has another inode."""
    try:
        return file_version(os.stat(path))
    except FileNotFoundError:
        return None


def checked_block(span_block: Any, layout: str, error: type[ValueError] = ValueError) -> int:
    """``span_block`` checked for ``layout``, or its default there; ``error``
    is raised for a bad one (the CLI's ``UsageError``)."""
    if span_block is None:
        return DEFAULT_METADATA_BLOCK if layout == "blocks" else DEFAULT_SPAN_BLOCK
    block = positive_integer("span_block", span_block, error)
    if layout == "blocks" and block > MAX_METADATA_BLOCK:
        raise error(
            f"span_block must be at most {MAX_METADATA_BLOCK} for metadata blocks, got {block}"
        )
    return block


def _as_array(values: Any) -> np.ndarray:
    """``values`` as an array, without loss: a list of Python ints that NumPy would
    make float64 or object (one above ``2**63 - 1`` beside small ones, or one
    above ``2**64 - 1``) is kept as ints (object), for ``_checked_cast``."""
    if isinstance(values, np.ndarray):
        return values
    a = np.asarray(values)
    if a.dtype.kind in "fO" and a.size and isinstance(values, (list, tuple)):
        o = np.asarray(values, dtype=object)
        if all(isinstance(v, (int, np.integer)) for v in o.flat):
            return o
    return a


def _checked_cast(values: np.ndarray, dtype: np.dtype[Any], what: str) -> np.ndarray:
    if values.dtype == dtype:
        return values
    if values.size == 0:
        return values.astype(dtype)
    ints = values.dtype.kind == "O" and all(isinstance(v, (int, np.integer)) for v in values.flat)
    if values.dtype.kind not in "iub" and not ints:
        raise TypeError(f"{what} must be integers, got dtype {values.dtype}")
    info = np.iinfo(dtype)
    lo, hi = int(values.min()), int(values.max())  # (as ints: a bool or uint64 compares)
    if lo < info.min or hi > info.max:
        bad = lo if lo < info.min else hi
        raise ValueError(f"{what}: value {bad} does not fit in {dtype} [{info.min}, {info.max}]")
    return values.astype(dtype)
