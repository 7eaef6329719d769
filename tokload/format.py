"""The on-disk dataset format (FORMAT.md): the manifest, read, checked and written.

The one job of this module: a dataset's ``manifest.json`` as a ``Manifest``
(its shards, their files' sizes and checksums, the row dtype, the metadata
layout), checked against what FORMAT.md allows with messages that name the
manifest and the key, and written atomically. Opening the files it lists is
``tokload.source``'s job; where they are, ``tokload.location``'s.
"""

from __future__ import annotations

import hashlib
import json
import os
import posixpath
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tokload.errors import FormatError, MissingShardError
from tokload.files import create_unique, fsync_dir
from tokload.location import Location

FORMAT_NAME = "tokload"
FORMAT_VERSION = 3
"""The newest version this tokload reads and writes (it reads every version up to it)."""
VERSIONS = (1, 2, 3)
MANIFEST = "manifest.json"
METADATA_FIELD = "metadata_id"
NO_METADATA = 0xFFFFFFFF
U64 = np.dtype("<u8")
"""The integers of a shard's index files (``.docs``, ``.mdx``, ``.mbx``, a span
table's block index and count): little-endian uint64 (FORMAT.md)."""
CHECKSUM_KEY = "xxh3_64"
"""The per-shard manifest key of the files' checksums (FORMAT.md)."""
LAYOUTS = ("blocks", "spans", "per_token")
"""How a dataset attaches metadata to rows (FORMAT.md): self-contained metadata
blocks per shard (version 3), a span table per shard (version 2), or a
``metadata_id`` field in every row (version 1's only layout)."""
DEFAULT_METADATA_LAYOUT = "blocks"
"""The layout a metadata ``Writer`` picks when its dtype has no ``metadata_id``
field (so does ``tokload build --metadata``)."""
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
    user_other: Any = None
    """A ``user`` value that is not an object (FORMAT.md allows any JSON): kept as
    it is, and written back while ``user`` stays empty."""
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

    def shape(self) -> tuple[Any, ...]:
        """What datasets must share for one manifest to list their shards (a merge,
        writers appending at once): ``(dtype, documents, metadata, layout)``,
        the layout ``(metadata_layout, span_block)`` (the block only for span
        tables and blocks) or None without metadata."""
        layout = (
            (self.metadata_layout, self.span_block if self.spans or self.blocks else None)
            if self.metadata
            else None
        )
        return (self.dtype, self.documents, self.metadata, layout)

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
        out["user"] = self.user if self.user or self.user_other is None else self.user_other
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
        given = data.get("metadata_layout")
        # (meaningless without metadata, but one FORMAT.md forbids is refused)
        forbidden = given not in LAYOUTS or (given == "blocks" and version < 3)
        if version >= 2 and "metadata_layout" in data and not flags["metadata"] and forbidden:
            raise FormatError(
                f"{where}: 'metadata_layout' must be one of {', '.join(map(repr, LAYOUTS))}"
                f' ("blocks" in version 3), got {_show(given)} in version {version}'
            )
        if version >= 2 and flags["metadata"]:
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
                    raise FormatError(f"{where}: span_block must be positive, got 0")
        user = data.get("user")
        m = cls(
            dtype=dtype,
            documents=flags["documents"],
            metadata=flags["metadata"],
            shards=shards,
            # Readers ignore ``user`` (FORMAT.md); one that is not an object is kept apart
            user=user if isinstance(user, dict) else {},
            user_other=None if isinstance(user, dict) else user,
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
        names: dict[str, str] = {}  # each name as the files it names: normalized
        for s in self.shards:
            check_shard_name(s.name, f"{where}: shard")
            key = posixpath.normpath(s.name)
            if key in names:
                other = names[key]
                same = (
                    "is listed twice" if other == s.name else f"and {other!r} name the same files"
                )
                raise FormatError(f"{where}: shard {s.name!r} {same}")
            names[key] = s.name
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
            if not self.metadata and (s.metadata_records or s.metadata_bytes):
                raise FormatError(
                    f"{where}: shard {s.name!r} has {s.metadata_records} metadata records "
                    f"and {s.metadata_bytes} bytes, but the dataset has no metadata"
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
    at = 0
    for name in dtype.names or ():
        ft, offset, *_rest = dtype.fields[name]
        if offset != at:  # packed, but out of order (or overlapping)
            raise FormatError(
                f"{where}: fields must be in the order of their offsets, back to back: "
                f"field {name!r} is at byte {offset}, not {at}"
            )
        at += ft.itemsize


def fingerprint(dtype: np.dtype[Any], shards: Sequence[Sequence[Any]]) -> str:
    """SHA-256 of the canonical JSON of the dtype and one entry (a sequence) per shard."""
    canon = json.dumps(
        {"dtype": dtype_to_json(dtype), "shards": [list(s) for s in shards]},
        sort_keys=True,
        separators=(",", ":"),
    )
    return hashlib.sha256(canon.encode()).hexdigest()


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


def write_manifest(path: str | os.PathLike[str], manifest: Manifest) -> None:
    """Write ``path/manifest.json`` atomically: temp file, fsync, rename, fsync dir.

    The file's mode follows the umask, like the shards' files.
    """
    manifest.check(str(path))
    directory = Path(path)
    text = json.dumps(manifest.to_json(), indent=1, allow_nan=False) + "\n"  # (JSON only)
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
