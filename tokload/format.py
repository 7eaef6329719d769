"""The on-disk dataset format (FORMAT.md): manifest, validation, opening.

The one job of this module is to turn a dataset directory (or a foreign format,
see ``interop.py``) into a :class:`Source`: the open files of its shards with
their row counts, document index and metadata, validated from the manifest
and file sizes alone, without reading any data.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tokload._io import DocIndex, FileSet, MegatronIndex, MetaSet, RowSet
from tokload.errors import FormatError, MissingShardError

FORMAT_NAME = "tokload"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
METADATA_FIELD = "metadata_id"
NO_METADATA = 0xFFFFFFFF
_INT_KINDS = "iu"


@dataclass(frozen=True)
class ShardInfo:
    """One shard as the manifest lists it."""

    name: str
    rows: int
    documents: int = 0
    metadata_records: int = 0
    metadata_bytes: int = 0

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "rows": self.rows,
            "documents": self.documents,
            "metadata_records": self.metadata_records,
            "metadata_bytes": self.metadata_bytes,
        }


@dataclass
class Manifest:
    """The contents of ``manifest.json`` (FORMAT.md)."""

    dtype: np.dtype[Any]
    documents: bool = True
    metadata: bool = False
    shards: list[ShardInfo] = field(default_factory=list)
    user: dict[str, Any] = field(default_factory=dict)

    @property
    def rows(self) -> int:
        return sum(s.rows for s in self.shards)

    @property
    def num_documents(self) -> int:
        return sum(s.documents for s in self.shards)

    def fingerprint(self) -> str:
        """SHA-256 of the dtype and per shard (base name, rows, documents): see FORMAT.md."""
        return fingerprint(
            self.dtype,
            [(os.path.basename(s.name), s.rows, s.documents) for s in self.shards],
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT_NAME,
            "version": FORMAT_VERSION,
            "dtype": dtype_to_json(self.dtype),
            "documents": self.documents,
            "metadata": self.metadata,
            "shards": [s.to_json() for s in self.shards],
            "user": self.user,
        }

    @classmethod
    def from_json(cls, data: Any, where: str) -> Manifest:
        if not isinstance(data, dict) or data.get("format") != FORMAT_NAME:
            raise FormatError(f'{where}: not a tokload manifest (no "format": "tokload")')
        version = data.get("version")
        if version != FORMAT_VERSION:
            raise FormatError(
                f"{where}: unknown format version {version!r}; this tokload reads version "
                f"{FORMAT_VERSION}"
            )
        try:
            dtype = dtype_from_json(data["dtype"])
            shards = [
                ShardInfo(
                    name=str(s["name"]),
                    rows=_count(s, "rows"),
                    documents=_count(s, "documents"),
                    metadata_records=_count(s, "metadata_records"),
                    metadata_bytes=_count(s, "metadata_bytes"),
                )
                for s in data["shards"]
            ]
            m = cls(
                dtype=dtype,
                documents=bool(data["documents"]),
                metadata=bool(data["metadata"]),
                shards=shards,
                user=dict(data.get("user") or {}),
            )
        except (KeyError, TypeError, ValueError) as e:
            if isinstance(e, FormatError):
                raise
            raise FormatError(f"{where}: malformed manifest: {e!r}") from None
        m.check(where)
        return m

    def check(self, where: str) -> None:
        """Consistency of the manifest with itself."""
        check_dtype(self.dtype, where)
        if self.metadata:
            fields: Mapping[str, Any] = self.dtype.fields or {}
            if METADATA_FIELD not in fields or fields[METADATA_FIELD][0] != np.dtype("<u4"):
                raise FormatError(
                    f"{where}: a dataset with metadata needs a '<u4' field {METADATA_FIELD!r} "
                    f"in its dtype, got {self.dtype}"
                )
        names = set()
        for s in self.shards:
            if s.name in names:
                raise FormatError(f"{where}: shard {s.name!r} is listed twice")
            names.add(s.name)
            if not self.documents and s.documents:
                raise FormatError(
                    f"{where}: shard {s.name!r} has documents but the dataset has none"
                )
            if self.documents and s.documents == 0 and s.rows:
                raise FormatError(f"{where}: shard {s.name!r} has rows but no documents")
            if s.metadata_records >= NO_METADATA:
                raise FormatError(
                    f"{where}: shard {s.name!r} has {s.metadata_records} metadata records; "
                    f"at most {NO_METADATA - 1} fit in a uint32 id"
                )


def _count(s: dict[str, Any], key: str) -> int:
    v = s.get(key, 0)
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise FormatError(
            f"shard {s.get('name')!r}: {key} must be a non-negative integer, got {v!r}"
        )
    return v


def dtype_to_json(dtype: np.dtype[Any]) -> Any:
    """The manifest form of a dtype: ``dtype.descr`` (a string when plain)."""
    if dtype.fields is None:
        return dtype.str
    return [list(item) for item in dtype.descr]


def dtype_from_json(value: Any) -> np.dtype[Any]:
    try:
        if isinstance(value, str):
            return np.dtype(value)
        return np.dtype([tuple(item) for item in value])
    except (TypeError, ValueError) as e:
        raise FormatError(f"unsupported dtype {value!r}: {e}") from None


def check_dtype(dtype: np.dtype[Any], where: str = "dtype") -> None:
    """Only integer rows (plain or structured with integer fields) are allowed."""
    if dtype.fields is None:
        if dtype.kind not in _INT_KINDS:
            raise FormatError(f"{where}: rows must be integers, got dtype {dtype}")
        return
    for name, (ft, *_rest) in dtype.fields.items():
        if ft.kind not in _INT_KINDS or ft.shape:
            raise FormatError(f"{where}: field {name!r} must be an integer scalar, got {ft}")
    packed = sum(ft.itemsize for ft, *_rest in dtype.fields.values())
    if dtype.itemsize == 0 or packed != dtype.itemsize:
        raise FormatError(
            f"{where}: fields must be packed without padding: {packed} bytes of fields in "
            f"a row of {dtype.itemsize} bytes"
        )


def fingerprint(dtype: np.dtype[Any], shards: list[tuple[Any, ...]]) -> str:
    """SHA-256 of the canonical JSON of the dtype and one tuple per shard."""
    canon = json.dumps(
        {"dtype": dtype_to_json(dtype), "shards": [list(s) for s in shards]},
        sort_keys=True,
        separators=(",", ":"),
    )
    return hashlib.sha256(canon.encode()).hexdigest()


def read_manifest(path: str | os.PathLike[str]) -> Manifest:
    """Read and check ``path/manifest.json``."""
    mpath = Path(path) / MANIFEST
    try:
        text = mpath.read_text()
    except FileNotFoundError:
        raise MissingShardError(2, "no tokload manifest here", str(mpath)) from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise FormatError(f"{mpath}: not valid JSON: {e}") from None
    return Manifest.from_json(data, str(mpath))


def write_manifest(path: str | os.PathLike[str], manifest: Manifest) -> None:
    """Write ``path/manifest.json`` atomically: temp file, fsync, rename, fsync dir."""
    manifest.check(str(path))
    directory = Path(path)
    text = json.dumps(manifest.to_json(), indent=1) + "\n"
    fd, tmp = tempfile.mkstemp(prefix=".manifest-", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, directory / MANIFEST)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(directory)


def fsync_dir(directory: str | os.PathLike[str]) -> None:
    dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


# ---- opened datasets ----------------------------------------------------------


@dataclass
class Source:
    """An opened dataset, whatever its format: what the views read from.

    Attributes:
        rows: the token stream (all shards' rows in order).
        dtype: the row dtype.
        docs: document extents, or None when the source has no documents.
        meta: the metadata of a stream with metadata, or None.
        fingerprint: identifies the contents, for resume checks.
        description: where it came from, for messages.
    """

    rows: RowSet
    dtype: np.dtype[Any]
    docs: DocIndex | MegatronIndex | None
    meta: MetaSet | None
    fingerprint: str
    description: str
    manifest: Manifest | None = None
    user: dict[str, Any] = field(default_factory=dict)
    _closers: list[Any] = field(default_factory=list, repr=False)

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


def _stat_size(path: Path, what: str) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        raise MissingShardError(2, f"missing {what}", str(path)) from None


def _expect_size(path: Path, what: str, expected: int) -> None:
    size = _stat_size(path, what)
    if size != expected:
        raise FormatError(f"{path}: {what} is {size} bytes but the manifest implies {expected}")


def open_dataset(path: str | os.PathLike[str]) -> Source:
    """Open a tokload dataset directory: reads the manifest and ``stat``s each file.

    No data is read; the time taken depends on the number of shards only.

    Raises:
        MissingShardError: the manifest or a file it lists is missing.
        FormatError: unknown version, bad dtype, a file whose size disagrees.
    """
    root = Path(path)
    m = read_manifest(root)
    item = m.dtype.itemsize
    rows_paths, docs_paths, mdx_paths, mdb_paths = [], [], [], []
    for s in m.shards:
        base = root / s.name
        rp = base.with_name(base.name + ".rows")
        _expect_size(rp, "shard rows", s.rows * item)
        rows_paths.append(rp)
        if m.documents:
            dp = base.with_name(base.name + ".docs")
            _expect_size(dp, "document index", (s.documents + 1) * 8)
            docs_paths.append(dp)
        if m.metadata:
            xp = base.with_name(base.name + ".mdx")
            bp = base.with_name(base.name + ".mdb")
            _expect_size(xp, "metadata index", (s.metadata_records + 1) * 8)
            _expect_size(bp, "metadata records", s.metadata_bytes)
            mdx_paths.append(xp)
            mdb_paths.append(bp)
    closers: list[Any] = []
    try:
        files = FileSet(rows_paths)
        closers.append(files)
        rows = RowSet(files, [s.rows for s in m.shards], item)
        docs = None
        if m.documents:
            dfiles = FileSet(docs_paths)
            closers.append(dfiles)
            docs = DocIndex(dfiles, [s.documents for s in m.shards], rows)
        meta = None
        if m.metadata:
            xfiles, bfiles = FileSet(mdx_paths), FileSet(mdb_paths)
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
        description=str(root),
        manifest=m,
        _closers=closers,
    )
