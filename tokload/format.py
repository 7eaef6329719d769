"""The on-disk dataset format (FORMAT.md): manifest, validation, opening.

The one job of this module is to turn a dataset directory (or a foreign format,
see ``interop.py``) into a ``Source``: the open files of its shards with
their row counts, document index and metadata, validated from the manifest
and file sizes alone, without reading any data.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import stat
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tokload._docindex import DocIndex, ExtentIndex
from tokload._io import FileSet
from tokload._meta import SPAN_ENTRY, BlockSet, SpanSet
from tokload._metaids import MetaSet
from tokload._rows import RowSet
from tokload._tables import compressed_table_bytes
from tokload.envvars import env_int
from tokload.errors import FormatError, MissingShardError

FORMAT_NAME = "tokload"
FORMAT_VERSION = 3
"""The newest version this tokload reads and writes (it reads every version up to it)."""
VERSIONS = (1, 2, 3)
MANIFEST = "manifest.json"
METADATA_FIELD = "metadata_id"
NO_METADATA = 0xFFFFFFFF
CHECKSUM_KEY = "xxh3_64"
"""The per-shard manifest key of the files' checksums (FORMAT.md)."""
LAYOUTS = ("blocks", "spans", "per_token")
"""How a dataset attaches metadata to rows (FORMAT.md): self-contained metadata
blocks per shard (version 3), a span table per shard (version 2), or a
``metadata_id`` field in every row (version 1's only layout)."""
DEFAULT_SPAN_BLOCK = 1024
"""Rows per entry of a span table's block index, unless the writer says otherwise."""
DEFAULT_METADATA_BLOCK = 4096
"""Rows per metadata block (layout ``"blocks"``), unless the writer says otherwise."""
MAX_METADATA_BLOCK = 65536
"""The most rows a metadata block may have (its run starts are uint16)."""
SHARD_FILES = ("rows", "docs", "mdx", "mdb", "mds", "msx", "msb", "mbx")
"""The extensions of a shard's files, in the order the writer opens them."""
MAX_COUNT = (1 << 63) - 1
"""The largest count or size a manifest may hold (a file offset is an int64)."""
_INT_KINDS = "iu"
_HEX = frozenset("0123456789abcdef")


@dataclass(frozen=True)
class ShardInfo:
    """One shard as the manifest lists it."""

    name: str
    rows: int
    documents: int = 0
    metadata_records: int = 0
    metadata_bytes: int = 0
    checksums: Mapping[str, str] | None = field(default=None, hash=False)
    """xxh3_64 of each of the shard's files, keyed by extension (``"rows"``,
    ``"docs"``, ``"mdx"``, ``"mdb"``, ``"mds"``, ``"msx"``, ``"msb"``,
    ``"mbx"``) as 16 lowercase hex digits; None when the writer recorded none."""
    metadata_runs: int = 0
    """Entries of the shard's span table (layout ``"spans"``; 0 otherwise)."""

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "name": self.name,
            "rows": self.rows,
            "documents": self.documents,
            "metadata_records": self.metadata_records,
            "metadata_bytes": self.metadata_bytes,
        }
        if self.metadata_runs:
            out["metadata_runs"] = self.metadata_runs
        if self.checksums is not None:
            out[CHECKSUM_KEY] = dict(self.checksums)
        return out

    def fingerprint_entry(self) -> list[Any]:
        """What the fingerprint takes from this shard (FORMAT.md)."""
        entry: list[Any] = [os.path.basename(self.name), self.rows, self.documents]
        if self.checksums is not None:
            entry.append(dict(sorted(self.checksums.items())))
        return entry


@dataclass
class Manifest:
    """The contents of ``manifest.json`` (FORMAT.md)."""

    dtype: np.dtype[Any]
    documents: bool = True
    metadata: bool = False
    shards: list[ShardInfo] = field(default_factory=list)
    user: dict[str, Any] = field(default_factory=dict)
    metadata_layout: str = "per_token"
    """``"blocks"`` (version 3), ``"spans"`` (version 2) or ``"per_token"``;
    meaningful only with ``metadata``."""
    span_block: int = DEFAULT_SPAN_BLOCK
    """Rows per block index entry of the span tables (layout ``"spans"``), or
    per metadata block (layout ``"blocks"``)."""

    @property
    def spans(self) -> bool:
        """Whether the metadata is a per-shard span table (FORMAT.md, version 2)."""
        return self.metadata and self.metadata_layout == "spans"

    @property
    def blocks(self) -> bool:
        """Whether the metadata is per-shard metadata blocks (FORMAT.md, version 3)."""
        return self.metadata and self.metadata_layout == "blocks"

    @property
    def version(self) -> int:
        """The format version the manifest is written as: 3 for metadata blocks,
        2 for a span table, else 1 (so that readers of an older version keep
        reading what they can)."""
        return 3 if self.blocks else 2 if self.spans else 1

    def files(self) -> tuple[str, ...]:
        """The extensions of each shard's files, in ``SHARD_FILES`` order."""
        has = {
            "rows": True,
            "docs": self.documents,
            "mdx": self.metadata and not self.blocks,
            "mdb": self.metadata and not self.blocks,
            "mds": self.spans,
            "msx": self.spans,
            "msb": self.blocks,
            "mbx": self.blocks,
        }
        return tuple(e for e in SHARD_FILES if has[e])

    @property
    def rows(self) -> int:
        return sum(s.rows for s in self.shards)

    @property
    def num_documents(self) -> int:
        return sum(s.documents for s in self.shards)

    def fingerprint(self) -> str:
        """SHA-256 of the dtype and per shard (base name, rows, documents[, checksums]):
        see FORMAT.md."""
        return fingerprint(self.dtype, [s.fingerprint_entry() for s in self.shards])

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "format": FORMAT_NAME,
            "version": self.version,
            "dtype": dtype_to_json(self.dtype),
            "documents": self.documents,
            "metadata": self.metadata,
        }
        if self.spans or self.blocks:
            out["metadata_layout"] = self.metadata_layout
            out["span_block"] = self.span_block
        out["shards"] = [s.to_json() for s in self.shards]
        out["user"] = self.user
        return out

    @classmethod
    def from_json(cls, data: Any, where: str) -> Manifest:
        """Parse the JSON of a manifest; ``where`` (its path) prefixes every error.

        Everything FORMAT.md forbids is refused with a ``FormatError``
        naming the offending key; ``user`` (and any key this version does not
        know) is ignored, whatever its JSON type.
        """
        if not isinstance(data, dict) or data.get("format") != FORMAT_NAME:
            raise FormatError(f'{where}: not a tokload manifest (no "format": "tokload")')
        version = data.get("version")
        if type(version) is not int or version not in VERSIONS:
            raise FormatError(
                f"{where}: unknown format version {_show(version)}; this tokload reads version "
                f"{' or '.join(map(str, VERSIONS))}"
            )
        for key in ("dtype", "documents", "metadata", "shards"):
            if key not in data:
                raise FormatError(f"{where}: malformed manifest: no {key!r}")
        dtype = dtype_from_json(data["dtype"], f"{where}: dtype")
        flags = {}
        for key in ("documents", "metadata"):
            if not isinstance(data[key], bool):
                raise FormatError(f"{where}: {key!r} must be true or false, got {_show(data[key])}")
            flags[key] = data[key]
        if not isinstance(data["shards"], list):
            raise FormatError(f"{where}: 'shards' must be a list, got {_show(data['shards'])}")
        shards = [
            _shard_from_json(s, f"{where}: shards[{k}]") for k, s in enumerate(data["shards"])
        ]
        layout, block = "per_token", DEFAULT_SPAN_BLOCK
        if version >= 2 and flags["metadata"]:
            given = data.get("metadata_layout")
            if given not in LAYOUTS:
                raise FormatError(
                    f"{where}: 'metadata_layout' must be one of {', '.join(map(repr, LAYOUTS))}, "
                    f"got {_show(given)}"
                )
            layout = str(given)
            if layout == "blocks" and version < 3:
                raise FormatError(
                    f"{where}: 'metadata_layout' \"blocks\" needs version 3, got version {version}"
                )
            if layout in ("spans", "blocks"):
                block = _count(data, "span_block", where, required=True)
                if block < 1:
                    raise FormatError(f"{where}.span_block must be positive, got 0")
        user = data.get("user")
        m = cls(
            dtype=dtype,
            documents=flags["documents"],
            metadata=flags["metadata"],
            shards=shards,
            # Readers ignore ``user`` (FORMAT.md): a value that is not an object is dropped.
            user=user if isinstance(user, dict) else {},
            metadata_layout=layout,
            span_block=block,
        )
        m.check(where)
        return m

    def check(self, where: str) -> None:
        """Consistency of the manifest with itself."""
        check_dtype(self.dtype, where)
        if self.metadata_layout not in LAYOUTS:
            raise FormatError(
                f"{where}: metadata_layout must be one of {', '.join(map(repr, LAYOUTS))}, "
                f"got {self.metadata_layout!r}"
            )
        fields: Mapping[str, Any] = self.dtype.fields or {}
        if self.spans:
            if METADATA_FIELD in fields:
                raise FormatError(
                    f"{where}: a dataset whose metadata is a span table has no "
                    f"{METADATA_FIELD!r} field in its rows, got dtype {self.dtype}"
                )
            if self.span_block < 1:
                raise FormatError(f"{where}: span_block must be positive, got {self.span_block}")
        elif self.blocks:
            if METADATA_FIELD in fields:
                raise FormatError(
                    f"{where}: a dataset whose metadata is in blocks has no "
                    f"{METADATA_FIELD!r} field in its rows, got dtype {self.dtype}"
                )
            if not 1 <= self.span_block <= MAX_METADATA_BLOCK:
                raise FormatError(
                    f"{where}: span_block must be in [1, {MAX_METADATA_BLOCK}] for metadata "
                    f"blocks, got {self.span_block}"
                )
        elif self.metadata and (
            METADATA_FIELD not in fields or fields[METADATA_FIELD][0] != np.dtype("<u4")
        ):
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
            if self.spans and not (
                (s.rows == 0 and s.metadata_runs == 0) or 1 <= s.metadata_runs <= s.rows
            ):
                raise FormatError(
                    f"{where}: shard {s.name!r} has {s.metadata_runs} metadata runs for "
                    f"{s.rows} rows (at least one run for any rows, at most one per row)"
                )
            if not self.spans and s.metadata_runs:
                raise FormatError(
                    f"{where}: shard {s.name!r} has metadata runs but the dataset has no span table"
                )
            if s.metadata_records >= NO_METADATA:
                raise FormatError(
                    f"{where}: shard {s.name!r} has {s.metadata_records} metadata records; "
                    f"at most {NO_METADATA - 1} fit in a uint32 id"
                )


def _show(value: Any, limit: int = 60) -> str:
    """``repr`` of a value from a file, cut short (a JSON number may have 4,000 digits)."""
    try:
        text = repr(value)
    except ValueError:  # an int too long for repr
        return f"<an integer of more than {limit} digits>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _count(s: dict[str, Any], key: str, where: str, required: bool = False) -> int:
    if key not in s:
        if required:
            raise FormatError(f"{where}: malformed manifest: no {key!r}")
        return 0
    v = s[key]
    if type(v) is not int or v < 0:
        raise FormatError(f"{where}.{key} must be a non-negative integer, got {_show(v)}")
    if v > MAX_COUNT:
        raise FormatError(f"{where}.{key} is out of range: {_show(v)} is not below 2**63")
    return v


def check_shard_name(name: Any, where: str) -> str:
    """A shard name as FORMAT.md allows it: a non-empty relative path ('/' and '..'
    inside are fine) that names a file, without NUL or unpaired surrogates."""
    if not isinstance(name, str):
        raise FormatError(f"{where}.name must be a string, got {_show(name)}")
    problem = None
    if not name:
        problem = "is empty"
    elif "\0" in name:
        problem = "contains a NUL character"
    elif name.startswith("/"):
        problem = "is an absolute path; shard names are relative to the dataset"
    elif name.rsplit("/", 1)[-1] in ("", ".", ".."):
        problem = "does not end in a file name"
    else:
        try:
            name.encode("utf-8")
        except UnicodeEncodeError:
            problem = "contains an unpaired surrogate (not valid Unicode)"
    if problem is not None:
        raise FormatError(f"{where}.name {_show(name)} {problem}")
    return name


def _shard_from_json(s: Any, where: str) -> ShardInfo:
    if not isinstance(s, dict):
        raise FormatError(f"{where} must be an object, got {_show(s)}")
    if "name" not in s:
        raise FormatError(f"{where}: malformed manifest: no 'name'")
    name = check_shard_name(s["name"], where)
    where = f"{where} ({name!r})"
    checksums = None
    if CHECKSUM_KEY in s:
        raw = s[CHECKSUM_KEY]
        if not isinstance(raw, dict):
            raise FormatError(f"{where}.{CHECKSUM_KEY} must be an object, got {_show(raw)}")
        checksums = {}
        for ext in SHARD_FILES:
            if ext in raw:
                v = raw[ext]
                if not (isinstance(v, str) and len(v) == 16 and set(v) <= _HEX):
                    raise FormatError(
                        f"{where}.{CHECKSUM_KEY}.{ext} must be 16 lowercase hex digits, "
                        f"got {_show(v)}"
                    )
                checksums[ext] = v
    return ShardInfo(
        name=name,
        rows=_count(s, "rows", where, required=True),
        documents=_count(s, "documents", where),
        metadata_records=_count(s, "metadata_records", where),
        metadata_bytes=_count(s, "metadata_bytes", where),
        checksums=checksums,
        metadata_runs=_count(s, "metadata_runs", where),
    )


def dtype_to_json(dtype: np.dtype[Any]) -> Any:
    """The manifest form of a dtype: ``dtype.descr`` (a string when plain)."""
    if dtype.fields is None:
        return dtype.str
    return [list(item) for item in dtype.descr]


def dtype_from_json(value: Any, where: str = "dtype") -> np.dtype[Any]:
    """The dtype of a manifest's ``dtype`` value: a string for a plain dtype, a
    list of ``[name, format]`` pairs (both strings) for a structured one."""
    if isinstance(value, str):
        items = None
    elif isinstance(value, list) and value:
        items = []
        for k, item in enumerate(value):
            if not (
                isinstance(item, list)
                and len(item) == 2
                and all(isinstance(x, str) for x in item)
                and item[0]
            ):
                raise FormatError(
                    f"{where}[{k}] must be a [name, format] pair of strings, got {_show(item)}"
                )
            items.append((item[0], item[1]))
    else:
        raise FormatError(
            f"{where} must be a string or a list of [name, format] pairs, got {_show(value)}"
        )
    try:
        dtype = np.dtype(value if items is None else items)
    except Exception as e:  # numpy raises TypeError, ValueError, KeyError, ... for bad strings
        raise FormatError(f"{where}: unsupported dtype {_show(value)}: {e}") from None
    if items is None and dtype.fields is not None:
        raise FormatError(
            f"{where}: {_show(value)} is a structured dtype; write it as a list of "
            "[name, format] pairs"
        )
    check_dtype(dtype, where)
    return dtype


def check_dtype(dtype: np.dtype[Any], where: str = "dtype") -> None:
    """Only little-endian integer rows (plain or structured with integer fields)."""
    if dtype.fields is None:
        if dtype.kind not in _INT_KINDS:
            raise FormatError(f"{where}: rows must be integers, got dtype {dtype}")
        if dtype != dtype.newbyteorder("<"):
            raise FormatError(f"{where}: rows must be little-endian, got dtype {dtype.str}")
        return
    for name, (ft, *_rest) in dtype.fields.items():
        if ft.kind not in _INT_KINDS or ft.shape:
            raise FormatError(f"{where}: field {name!r} must be an integer scalar, got {ft}")
        if ft != ft.newbyteorder("<"):
            raise FormatError(f"{where}: field {name!r} must be little-endian, got {ft.str}")
    packed = sum(ft.itemsize for ft, *_rest in dtype.fields.values())
    if dtype.itemsize == 0 or packed != dtype.itemsize:
        raise FormatError(
            f"{where}: fields must be packed without padding: {packed} bytes of fields in "
            f"a row of {dtype.itemsize} bytes"
        )


def fingerprint(dtype: np.dtype[Any], shards: Sequence[Sequence[Any]]) -> str:
    """SHA-256 of the canonical JSON of the dtype and one entry (a sequence) per shard."""
    canon = json.dumps(
        {"dtype": dtype_to_json(dtype), "shards": [list(s) for s in shards]},
        sort_keys=True,
        separators=(",", ":"),
    )
    return hashlib.sha256(canon.encode()).hexdigest()


def file_kind(mode: int) -> str:
    """What a ``st_mode`` describes, for messages."""
    for test, kind in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return kind
    return "not a regular file"


def regular_size(path: str | os.PathLike[str], what: str) -> int:
    """The size of ``path``, which must be a regular file (symlinks followed).

    Only ``stat``s, so a FIFO or device in a file's place is refused without
    the open that would block on it.

    Raises:
        MissingShardError: nothing is there.
        FormatError: something other than a regular file is there.
    """
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise MissingShardError(2, f"missing {what}", os.fspath(path)) from None
    if not stat.S_ISREG(st.st_mode):
        raise FormatError(
            f"{os.fspath(path)}: {what} is {file_kind(st.st_mode)}, not a regular file"
        )
    return st.st_size


def open_regular(path: str | os.PathLike[str], what: str) -> int:
    """A read-only descriptor of a regular file, never blocking on a FIFO or device.

    ``stat`` first, then ``O_NONBLOCK`` (no effect on regular files) and
    ``fstat`` again, in case the file was replaced in between.
    """
    regular_size(path, what)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise MissingShardError(2, f"missing {what}", os.fspath(path)) from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise FormatError(f"{os.fspath(path)}: {what} is {file_kind(mode)}, not a regular file")
    return fd


def read_regular(path: str | os.PathLike[str], what: str) -> bytes:
    """All bytes of a regular file (see ``open_regular``)."""
    fd = open_regular(path, what)
    with os.fdopen(fd, "rb") as f:
        return f.read()


def sample_digest(path: str | os.PathLike[str], what: str, block: int = 4096) -> str:
    """SHA-256 of a file's size, first ``block`` bytes and last ``block`` bytes.

    A cheap identity for files that carry no checksum (two ``pread``s, whatever
    the size): it tells apart files of the same size whose headers or ends
    differ, without a pass over the data.
    """
    fd = open_regular(path, what)
    try:
        return _digest(os.fstat(fd).st_size, lambda a, b: os.pread(fd, b - a, a), block)
    finally:
        os.close(fd)


def _digest(size: int, read: Callable[[int, int], bytes], block: int) -> str:
    """``sample_digest`` of ``size`` bytes that ``read(start, end)`` returns."""
    h = hashlib.sha256(size.to_bytes(8, "little"))
    h.update(read(0, min(block, size)))
    if size > block:
        h.update(read(max(block, size - block), size))
    return h.hexdigest()


def read_manifest(
    path: str | os.PathLike[str], storage_options: Mapping[str, Any] | None = None
) -> Manifest:
    """Read and check ``path/manifest.json`` (``path`` a directory or an
    object-store URL prefix).

    Raises:
        MissingShardError: there is no manifest.
        FormatError: it is not a regular file, not UTF-8, not JSON, or not what
            FORMAT.md allows; the message names the manifest and the key.
    """
    return manifest_at(Location(path, storage_options))


def manifest_at(loc: Location) -> Manifest:
    """``read_manifest`` of a Location."""
    mpath = loc.join(MANIFEST)
    try:
        raw = loc.read(mpath, "tokload manifest")
    except MissingShardError as e:
        from tokload import remote

        if remote.missing_bucket(e):
            raise  # "no such bucket": not the same mistake as a wrong prefix
        if loc.stores_nothing():
            raise MissingShardError(
                2, "no tokload manifest here: nothing is stored under this prefix", str(mpath)
            ) from None
        raise MissingShardError(2, "no tokload manifest here", str(mpath)) from None
    return parse_manifest(raw, str(mpath))


def parse_manifest(raw: bytes, mpath: str) -> Manifest:
    """Check the bytes of a manifest read from ``mpath`` (named in errors)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise FormatError(f"{mpath}: not UTF-8 text (byte {e.start}: {e.reason})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise FormatError(f"{mpath}: not valid JSON: {e}") from None
    except RecursionError:
        raise FormatError(f"{mpath}: JSON nested too deeply to read") from None
    except ValueError as e:  # e.g. an integer of more than sys.get_int_max_str_digits() digits
        raise FormatError(f"{mpath}: not valid JSON: {e}") from None
    return Manifest.from_json(data, mpath)


class Location:
    """Where a dataset's files are: a local directory, or an object-store URL
    prefix (``s3://bucket/prefix``; see ``tokload.remote``).  One interface
    for both, so opening code has one path: names joined, sizes checked,
    small files read, FileSets made.  A remote location lists its prefix once
    (sizes and ETags) and reads files through the remote backend.

    Args:
        root: the directory or URL prefix (``file://`` is local).
        storage_options: the object store's options (remote only).
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        storage_options: Mapping[str, Any] | None = None,
        *,
        listed: bool = True,
    ) -> None:
        from tokload import remote

        self.remote = remote.is_url(root)
        self.options = storage_options
        self.listed = listed  # remote: one LIST of the prefix (else a HEAD per object)
        self._heads: dict[str, Any] = {}
        self.root: str = (
            os.fspath(root).rstrip("/") if self.remote else str(Path(remote.local_path(root)))
        )
        self._objects: dict[str, Any] | None = None

    def join(self, name: str) -> str:
        return self.root + "/" + name if self.remote else os.path.join(self.root, name)

    def stores_nothing(self) -> bool:
        """Whether a remote root's listing (when one was made) holds no object at all."""
        return self.remote and self._objects is not None and not self._objects

    def _object(self, path: str, what: str) -> Any:
        from tokload import remote

        if not self.listed or not path.startswith(self.root + "/"):
            if path not in self._heads:
                self._heads[path] = remote.head(path, what, self.options)
            return self._heads[path]
        if self._objects is None:
            self._objects = remote.listing(self.root, self.options)
        obj = self._objects.get(path)
        if obj is None:
            raise MissingShardError(2, f"missing {what}", path)
        return obj

    def size(self, path: str, what: str) -> int:
        """The size of a regular file or object (MissingShardError when absent)."""
        if self.remote:
            return int(self._object(path, what).size)
        return regular_size(path, what)

    def exists(self, path: str) -> bool:
        if not self.remote:
            return os.path.isfile(path)
        try:
            self._object(path, "object")
        except MissingShardError as e:
            from tokload import remote

            if remote.missing_bucket(e):
                raise
            return False
        return True

    def read(self, path: str, what: str, start: int = 0, end: int | None = None) -> bytes:
        """Bytes ``[start, end)`` of a file or object (all of it by default)."""
        if self.remote:
            from tokload import remote

            return remote.read_object(self._object(path, what), what, start, end)
        if start == 0 and end is None:
            return read_regular(path, what)
        fd = open_regular(path, what)
        try:
            size = os.fstat(fd).st_size
            end = size if end is None else end
            data = os.pread(fd, end - start, start)
        finally:
            os.close(fd)
        if len(data) != end - start:
            raise FormatError(f"{path}: {what}: {size} bytes, not the {end} it needs")
        return data

    def sample_digest(self, path: str, what: str, block: int = 4096) -> str:
        """``sample_digest`` of a file or object: SHA-256 of its size, first and
        last ``block`` bytes (the same value for a local copy and a remote one)."""
        if not self.remote:
            return sample_digest(path, what, block)
        return _digest(self.size(path, what), lambda a, b: self.read(path, what, a, b), block)

    def fileset(self, paths: Sequence[str], bases: Sequence[int] | None = None) -> FileSet:
        """A FileSet of ``paths`` (objects keep the ETag they were listed with)."""
        if self.remote:
            objs = [self._object(p, "file") for p in paths]
            return FileSet(paths, bases, remote=objs)
        return FileSet(paths, bases)


def create_unique(directory: str | os.PathLike[str], prefix: str) -> tuple[int, str]:
    """Create a new file with a unique name in ``directory``, mode 0666 less the umask.

    (``tempfile.mkstemp`` would make it 0600, so a dataset renamed from it
    could not be read by another account, unlike its shards.)
    """
    for _ in range(100):
        tmp = os.path.join(directory, f"{prefix}{os.getpid()}-{secrets.token_hex(6)}.tmp")
        try:
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666), tmp
        except FileExistsError:
            continue
    raise FileExistsError(17, "could not find an unused temporary name", os.fspath(directory))


def write_manifest(path: str | os.PathLike[str], manifest: Manifest) -> None:
    """Write ``path/manifest.json`` atomically: temp file, fsync, rename, fsync dir.

    The file's mode follows the umask, like the shards' files.
    """
    manifest.check(str(path))
    directory = Path(path)
    text = json.dumps(manifest.to_json(), indent=1) + "\n"
    fd, tmp = create_unique(directory, ".manifest-")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
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
