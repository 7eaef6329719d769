"""Writing datasets: :class:`Writer` appends documents; :func:`merge` joins datasets.

The writer keeps FORMAT.md's promise: the manifest is written last and
atomically, and lists only shards whose files are complete and fsynced, so a
crash never leaves a manifest that refers to data that is not on disk.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import IO, Any, Self

import numpy as np
import numpy.typing as npt
import xxhash

from tokload._meta import SPAN_DTYPE
from tokload.errors import FormatError
from tokload.format import (
    DEFAULT_SPAN_BLOCK,
    LAYOUTS,
    MANIFEST,
    METADATA_FIELD,
    NO_METADATA,
    Manifest,
    ShardInfo,
    check_dtype,
    fsync_dir,
    read_manifest,
    read_regular,
    write_manifest,
)

Span = tuple[int, int, bytes]
"""A metadata record attached to rows ``[start, stop)`` of a document."""

_U64 = np.dtype("<u8")


class Writer:
    """Write a tokload dataset, one document at a time.

    Args:
        path: the dataset directory (created if needed).
        dtype: the row dtype: a plain integer dtype (``"<u4"``) or a structured
            one with integer fields (``[("token", "<u4"), ("concept", "<u2")]``).
        metadata: write a stream with metadata: records in ``.mdx``/``.mdb``
            per shard, attached to rows as ``metadata_layout`` says.
        metadata_layout: ``"spans"`` (FORMAT.md version 2: a span table per
            shard, 12 bytes per run of rows with one record, nothing per row)
            or ``"per_token"`` (version 1: a ``"<u4"`` field ``metadata_id`` in
            every row, which the writer fills). None (the default) decides
            from the dtype: ``"per_token"`` when it has a ``metadata_id``
            field, else ``"spans"``.
        span_block: rows per entry of the span tables' block index (``"spans"``).
        shard_bytes: start a new shard before a document that would take the
            current one past this many bytes of rows (a single larger document
            still gets a shard of its own). Default 1 GiB.
        mode: ``"w"`` to create (refuses an existing dataset), ``"a"`` to add
            shards to one (same dtype and options required; existing shards are
            never touched).
        name_prefix: shard names are ``f"{name_prefix}-{k:05d}"``; by default a
            random prefix, so writers running in parallel never collide.
        user: free-form JSON stored in the manifest (tokenizer, source, ...).
        durable: fsync each shard and the directory before listing it.

    Use as a context manager, or call :meth:`close`: nothing is visible to
    readers until a shard is closed and the manifest rewritten.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        dtype: npt.DTypeLike = "<u4",
        *,
        metadata: bool = False,
        metadata_layout: str | None = None,
        span_block: int = DEFAULT_SPAN_BLOCK,
        shard_bytes: int = 1 << 30,
        mode: str = "w",
        name_prefix: str | None = None,
        user: Mapping[str, Any] | None = None,
        durable: bool = True,
    ) -> None:
        self.path = Path(path)
        if mode not in ("w", "a"):
            raise ValueError(f"mode must be 'w' or 'a', got {mode!r}")
        if shard_bytes < 1:
            raise ValueError(f"shard_bytes must be positive, got {shard_bytes}")
        self.dtype: np.dtype[Any] = np.dtype(dtype).newbyteorder("<")
        check_dtype(self.dtype, "Writer dtype")
        has_field = METADATA_FIELD in (self.dtype.fields or {})
        if metadata_layout is None:
            metadata_layout = "per_token" if has_field else "spans"
        if metadata_layout not in LAYOUTS:
            raise ValueError(
                f"metadata_layout must be one of {', '.join(map(repr, LAYOUTS))}, "
                f"got {metadata_layout!r}"
            )
        if metadata and metadata_layout == "spans" and has_field:
            raise ValueError(
                f"metadata_layout='spans' keeps no {METADATA_FIELD!r} in the rows; "
                f"drop the field from the dtype {self.dtype}"
            )
        if metadata and metadata_layout == "per_token" and not has_field:
            raise FormatError(
                f"Writer dtype: metadata_layout='per_token' needs a '<u4' field "
                f"{METADATA_FIELD!r} in the dtype, got {self.dtype}"
            )
        if isinstance(span_block, bool) or not isinstance(span_block, int) or span_block < 1:
            raise ValueError(f"span_block must be a positive integer, got {span_block!r}")
        self.layout = metadata_layout if metadata else "per_token"
        self.shard_bytes = shard_bytes
        self.durable = durable
        self.path.mkdir(parents=True, exist_ok=True)
        exists = (self.path / MANIFEST).exists()
        if mode == "w" and exists:
            raise FileExistsError(
                17, "a dataset already exists here; use mode='a' to append", str(self.path)
            )
        if exists:
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
        taken = {s.name for s in self.manifest.shards}
        self._seq = 0
        while self._name(self._seq) in taken:
            self._seq += 1
        self._shard: _OpenShard | None = None
        self._closed = False

    def _name(self, seq: int) -> str:
        return f"{self.prefix}-{seq:05d}"

    # ---- writing -------------------------------------------------------------

    def write(
        self,
        rows: npt.ArrayLike | Mapping[str, npt.ArrayLike],
        spans: Sequence[Span] | None = None,
    ) -> None:
        """Append one document.

        Args:
            rows: the document's rows: an array convertible to the dataset
                dtype without loss (values out of a field's range are an error,
                never wrapped), or, for a structured dtype, a mapping from field
                name to a 1-D array (missing fields are 0).
            spans: for a dataset with metadata, ``(start, stop, payload)`` per
                metadata record: rows ``[start, stop)`` of this document get
                that record (``payload`` is bytes, stored as is). Spans must not
                overlap; rows outside every span have no metadata.
        """
        if self._closed:
            raise ValueError("write to a closed Writer")
        arr = self._convert(rows)
        n = len(arr)
        payloads: list[bytes] = []
        runs: tuple[np.ndarray, np.ndarray] | None = None
        if self.metadata and self.layout == "spans":
            starts: list[int] = []
            records: list[int] = []
            end = 0
            for k, (start, stop, payload) in enumerate(sorted(spans or (), key=lambda s: s[0])):
                if not (0 <= start < stop <= n):
                    raise ValueError(
                        f"span [{start}, {stop}) is not a non-empty range within the document's "
                        f"{n} rows"
                    )
                if start < end:
                    raise ValueError(f"span [{start}, {stop}) overlaps another span")
                if start > end:
                    starts.append(end)
                    records.append(NO_METADATA)
                starts.append(start)
                records.append(k)  # renumbered to shard ids below
                end = stop
                payloads.append(bytes(payload))
            if end < n:
                starts.append(end)
                records.append(NO_METADATA)
            runs = (np.array(starts, np.uint64), np.array(records, np.uint32))
        elif self.metadata:
            ids = np.full(n, NO_METADATA, dtype=np.uint32)
            for k, (start, stop, payload) in enumerate(sorted(spans or (), key=lambda s: s[0])):
                if not (0 <= start < stop <= n):
                    raise ValueError(
                        f"span [{start}, {stop}) is not a non-empty range within the document's "
                        f"{n} rows"
                    )
                if (ids[start:stop] != NO_METADATA).any():
                    raise ValueError(f"span [{start}, {stop}) overlaps another span")
                ids[start:stop] = k  # renumbered to shard ids below
                payloads.append(bytes(payload))
        elif spans:
            raise ValueError("spans given, but the dataset was opened with metadata=False")
        nbytes = n * self.dtype.itemsize
        shard = self._shard
        if (
            shard is not None
            and shard.rows
            and (
                shard.rows * self.dtype.itemsize + nbytes > self.shard_bytes
                or shard.records + len(payloads) >= NO_METADATA
            )
        ):
            self._close_shard()
            shard = None
        if shard is None:
            shard = self._shard = _OpenShard(
                self.path, self._name(self._seq), self.manifest, self.durable
            )
            self._seq += 1
        if runs is not None:
            shard.add_runs(runs[0], runs[1], n)
        elif self.metadata:
            local = np.where(ids == NO_METADATA, ids, ids + np.uint32(shard.records))
            arr[METADATA_FIELD] = local
        shard.add(arr, payloads)

    def _convert(self, rows: npt.ArrayLike | Mapping[str, npt.ArrayLike]) -> np.ndarray:
        dt = self.dtype
        if isinstance(rows, Mapping):
            if dt.fields is None:
                raise TypeError("a mapping of fields was given, but the dtype is not structured")
            unknown = set(rows) - set(dt.fields)
            if unknown:
                raise ValueError(f"unknown fields {sorted(unknown)}; the dtype has {dt.names}")
            lengths = {len(np.asarray(v)) for v in rows.values()}
            if len(lengths) > 1:
                raise ValueError(f"fields have different lengths: {sorted(lengths)}")
            out = np.zeros(lengths.pop() if lengths else 0, dtype=dt)
            for name, values in rows.items():
                out[name] = _checked_cast(np.asarray(values), dt.fields[name][0], name)
            return out
        src = np.asarray(rows)
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
        info = shard.finish(self.durable)
        if info.rows == 0 and info.documents == 0:
            shard.remove()
            return
        self.manifest.shards.append(info)
        if self.durable:
            fsync_dir(self.path)
        write_manifest(self.path, self.manifest)

    def flush(self) -> None:
        """Close the current shard and publish it in the manifest."""
        self._close_shard()

    def close(self) -> None:
        """Publish what was written and release the files (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._close_shard()
        if not (self.path / MANIFEST).exists():
            write_manifest(self.path, self.manifest)  # an empty dataset is still a dataset

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        # Every document written so far is whole (write validates first), so
        # they are published even when the block raised.
        self.close()


def _checked_cast(values: np.ndarray, dtype: np.dtype[Any], what: str) -> np.ndarray:
    if values.dtype == dtype:
        return values
    if values.size == 0:
        return values.astype(dtype)
    if values.dtype.kind not in "iub":
        raise TypeError(f"{what} must be integers, got dtype {values.dtype}")
    info = np.iinfo(dtype)
    lo, hi = values.min(), values.max()
    if lo < info.min or hi > info.max:
        bad = lo if lo < info.min else hi
        raise ValueError(f"{what}: value {bad} does not fit in {dtype} [{info.min}, {info.max}]")
    return values.astype(dtype)


class _OpenShard:
    """The files of the shard being written, each with its running xxh3_64."""

    def __init__(self, root: Path, name: str, manifest: Manifest, durable: bool = True) -> None:
        self.name = name
        self.exts = manifest.files()
        self.block = manifest.span_block
        self.paths = [root / f"{name}.{ext}" for ext in self.exts]
        self.files: list[IO[bytes]] = [open(p, "xb", buffering=1 << 20) for p in self.paths]  # noqa: SIM115
        # The checksums are computed from the bytes as they are written: no second pass.
        self.hashes = [xxhash.xxh3_64() for _ in self.paths]
        self.rows = 0
        self.documents = 0
        self.records = 0
        self.meta_bytes = 0
        self.runs = 0
        self.blocks = 0  # block index entries written
        self.last_start = 0  # the last run's start and record
        self.last_record = 0
        first = np.zeros(1, _U64).tobytes()
        self._put(1, first)  # first document starts at row 0
        if manifest.metadata:
            self._put(2, first)

    def _put(self, k: int, data: bytes | memoryview) -> None:
        self.files[k].write(data)
        self.hashes[k].update(data)

    def add_runs(self, starts: np.ndarray, records: np.ndarray, n: int) -> None:
        """The span table entries of the next document (``n`` rows), before :meth:`add`.

        ``starts`` are local to the document, ``records`` to its spans (or none).
        """
        base = self.rows
        starts = starts + np.uint64(base)
        records = np.where(records == NO_METADATA, records, records + np.uint32(self.records))
        if self.runs and len(records) and records[0] == NO_METADATA == self.last_record:
            starts, records = starts[1:], records[1:]  # rows without metadata continue a run
        first = self.runs - 1 if self.runs else 0
        if self.runs:
            # The run before the document is a candidate for its first blocks.
            c_starts = np.concatenate([np.array([self.last_start], np.uint64), starts])
        else:
            c_starts = starts
        if len(starts):
            entries = np.empty(len(starts), SPAN_DTYPE)
            entries["start"] = starts
            entries["record"] = records
            self._put(4, entries.tobytes())
            self.runs += len(starts)
            self.last_start, self.last_record = int(starts[-1]), int(records[-1])
        # Block index entries for the blocks that begin inside the document.
        top = -(-(base + n) // self.block)
        if top > self.blocks:
            at = np.arange(self.blocks, top, dtype=np.uint64) * np.uint64(self.block)
            idx = np.searchsorted(c_starts, at, side="right").astype(np.int64) - 1
            self._put(5, (idx + first).astype(_U64).tobytes())
            self.blocks = top

    def add(self, rows: np.ndarray, payloads: list[bytes]) -> None:
        self._put(0, np.ascontiguousarray(rows).view(np.uint8).data)
        self.rows += len(rows)
        self.documents += 1
        self._put(1, np.array([self.rows], _U64).tobytes())
        if payloads:
            ends = self.meta_bytes + np.cumsum([len(p) for p in payloads], dtype=np.uint64)
            for p in payloads:
                self._put(3, p)
            self._put(2, ends.astype(_U64).tobytes())
            self.records += len(payloads)
            self.meta_bytes = int(ends[-1])

    def finish(self, durable: bool) -> ShardInfo:
        if "msx" in self.exts:
            self._put(5, np.array([self.runs], _U64).tobytes())
        for f in self.files:
            f.flush()
            if durable:
                os.fsync(f.fileno())
            f.close()
        checksums = {ext: h.hexdigest() for ext, h in zip(self.exts, self.hashes, strict=True)}
        return ShardInfo(
            self.name,
            self.rows,
            self.documents,
            self.records,
            self.meta_bytes,
            checksums,
            metadata_runs=self.runs,
        )

    def remove(self) -> None:
        for p in self.paths:
            p.unlink(missing_ok=True)


def merge(output: str | os.PathLike[str], inputs: Sequence[str | os.PathLike[str]]) -> Manifest:
    """Join datasets into one by writing a manifest only; no data is copied.

    The merged manifest lists every input's shards, in the order given, by
    their paths relative to ``output`` (FORMAT.md), so the inputs must stay
    where they are. All inputs need the same dtype and options. ``output`` may
    not already hold a dataset.

    Returns the merged manifest.
    """
    out = Path(output)
    out.mkdir(parents=True, exist_ok=True)
    if (out / MANIFEST).exists():
        raise FileExistsError(17, "a dataset already exists here", str(out))
    if not inputs:
        raise ValueError("merge needs at least one input dataset")
    manifests = [(Path(p), read_manifest(p)) for p in inputs]
    first = manifests[0][1]
    merged = Manifest(
        dtype=first.dtype,
        documents=first.documents,
        metadata=first.metadata,
        metadata_layout=first.metadata_layout,
        span_block=first.span_block,
    )

    def shape(m: Manifest) -> tuple[Any, ...]:
        layout = (m.metadata_layout, m.span_block if m.spans else None) if m.metadata else None
        return (m.dtype, m.documents, m.metadata, layout)

    for path, m in manifests:
        if shape(m) != shape(first):
            raise FormatError(
                f"{path}: dtype={m.dtype}, documents={m.documents}, metadata={m.metadata} "
                f"(layout {shape(m)[3]}) differs from {manifests[0][0]}: dtype={first.dtype}, "
                f"documents={first.documents}, metadata={first.metadata} "
                f"(layout {shape(first)[3]})"
            )
        rel = os.path.relpath(path.resolve(), out.resolve())
        for s in m.shards:
            name = os.path.normpath(os.path.join(rel, s.name))
            merged.shards.append(dataclasses.replace(s, name=name))  # checksums carried over
        merged.user.setdefault("merged_from", []).append(rel)
    write_manifest(out, merged)
    return merged


def convert(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    layout: str = "spans",
    *,
    span_block: int = DEFAULT_SPAN_BLOCK,
    durable: bool = True,
) -> Manifest:
    """Write a copy of a dataset with metadata in the other layout (FORMAT.md).

    ``layout="spans"``: the rows lose their ``metadata_id`` field (the other
    fields stay, as a structured dtype) and each shard gets a span table;
    ``"per_token"``: the rows gain a ``metadata_id`` field (a plain dtype
    becomes the field ``"tokens"``). Shards, documents and records stay as
    they are, so a :class:`~tokload.StreamWithMetadata` of the copy gives the
    same batches, bit for bit. Memory stays bounded (shards are streamed in
    chunks). ``dst`` may not hold a dataset.

    Returns the new manifest.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(map(repr, LAYOUTS))}, got {layout!r}")
    root, out = Path(src), Path(dst)
    m = read_manifest(root)
    if not m.metadata or not m.documents:
        raise FormatError(f"{root}: the dataset has no metadata (or no documents) to convert")
    if m.metadata_layout == layout:
        raise FormatError(f"{root}: the metadata already has layout {layout!r}; nothing to convert")
    old = m.dtype
    if layout == "spans":
        assert old.fields is not None
        keep = [(n, old.fields[n][0].str) for n in old.names or () if n != METADATA_FIELD]
        new: np.dtype[Any] = np.dtype(keep)
    else:
        fields = (
            [("tokens", old.str)]
            if old.fields is None
            else [(n, old.fields[n][0].str) for n in old.names or ()]
        )
        new = np.dtype([*fields, (METADATA_FIELD, "<u4")])
    out.mkdir(parents=True, exist_ok=True)
    if (out / MANIFEST).exists():
        raise FileExistsError(17, "a dataset already exists here", str(out))
    target = Manifest(
        dtype=new,
        documents=m.documents,
        metadata=True,
        user=dict(m.user),
        metadata_layout=layout,
        span_block=span_block,
    )
    names: set[str] = set()
    for k, s in enumerate(m.shards):
        name = os.path.basename(s.name)
        if name in names:
            name = f"c{k:05d}-{name}"
        names.add(name)
        target.shards.append(_convert_shard(root, s, m, out, name, target, durable))
    if durable:
        fsync_dir(out)
    write_manifest(out, target)
    return target


_CHUNK_ROWS = 1 << 22


def _convert_shard(
    root: Path, s: ShardInfo, m: Manifest, out: Path, name: str, target: Manifest, durable: bool
) -> ShardInfo:
    shard = _OpenShard(out, name, target, durable)
    try:
        base = root / s.name
        rows = (
            np.memmap(f"{base}.rows", dtype=m.dtype, mode="r", shape=(s.rows,)) if s.rows else None
        )
        if target.spans:
            assert m.dtype.fields is not None
            names = [n for n in m.dtype.names or () if n != METADATA_FIELD]
            last = None
            starts: list[np.ndarray] = []
            for a in range(0, s.rows, _CHUNK_ROWS):
                assert rows is not None
                chunk = rows[a : a + _CHUNK_ROWS]
                packed = np.empty(len(chunk), target.dtype)
                for n in names:
                    packed[n] = chunk[n]
                shard._put(0, packed.view(np.uint8).data)
                ids = np.asarray(chunk[METADATA_FIELD])
                change = np.flatnonzero(ids[1:] != ids[:-1]) + 1
                if last is None or ids[0] != last:
                    change = np.concatenate([[0], change])
                e = np.empty(len(change), SPAN_DTYPE)
                e["start"] = change + a
                e["record"] = ids[change]
                shard._put(4, e.tobytes())
                starts.append(e["start"].copy())
                shard.runs += len(e)
                last = ids[-1]
            all_starts = np.concatenate(starts) if starts else np.zeros(0, np.uint64)
            nblocks = -(-s.rows // target.span_block)
            at = np.arange(nblocks, dtype=np.uint64) * np.uint64(target.span_block)
            idx = np.searchsorted(all_starts, at, side="right") - 1
            shard._put(5, idx.astype(_U64).tobytes())
        else:
            runs = (
                np.fromfile(f"{base}.mds", dtype=SPAN_DTYPE)
                if s.metadata_runs
                else np.zeros(0, SPAN_DTYPE)
            )
            ends = np.append(runs["start"][1:], np.uint64(s.rows))
            for a in range(0, s.rows, _CHUNK_ROWS):
                assert rows is not None
                chunk = np.asarray(rows[a : a + _CHUNK_ROWS])
                packed = np.empty(len(chunk), target.dtype)
                if m.dtype.fields is None:
                    packed["tokens"] = chunk
                else:
                    for n in m.dtype.names or ():
                        packed[n] = chunk[n]
                b = a + len(chunk)
                r0 = int(np.searchsorted(runs["start"], a, side="right")) - 1
                r1 = int(np.searchsorted(runs["start"], b, side="left"))
                lo = np.maximum(runs["start"][r0:r1], a)
                hi = np.minimum(ends[r0:r1], b)
                packed[METADATA_FIELD] = np.repeat(
                    runs["record"][r0:r1], (hi - lo).astype(np.int64)
                )
                shard._put(0, packed.view(np.uint8).data)
        # documents and records are copied as they are
        for k, ext in ((1, "docs"), (2, "mdx")):
            if ext == "docs" and not m.documents:
                continue
            data = read_regular(f"{base}.{ext}", f"shard .{ext} file")
            shard._put(k, data[8:])  # _OpenShard wrote the first 0 already
        with open(f"{base}.mdb", "rb") as mdb:
            while chunk_b := mdb.read(8 << 20):
                shard._put(3, chunk_b)
        shard.rows, shard.documents = s.rows, s.documents
        shard.records, shard.meta_bytes = s.metadata_records, s.metadata_bytes
        return shard.finish(durable)
    except BaseException:
        for f in shard.files:
            f.close()
        shard.remove()
        raise
