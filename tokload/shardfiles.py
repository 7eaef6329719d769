"""The files of one shard being written: the one job of this module is
``OpenShard``, which appends a shard's rows, document ends and metadata to its
files (FORMAT.md's extensions), checksums them as they are written, and closes
and fsyncs them when the shard is finished. ``tokload.writer.Writer`` and
``tokload.derive`` (``merge``, ``convert``) write every shard through it."""

from __future__ import annotations

import os
from pathlib import Path
from typing import IO, Any

import numpy as np
import xxhash

from tokload._meta import SPAN_DTYPE, encode_blocks
from tokload.format import NO_METADATA, U64, Manifest, ShardInfo

CONTINUED = NO_METADATA - 1
"""A piece's local record id for "the record the previous piece ended with"."""


class OpenShard:
    """The files of the shard being written (``Manifest.files()``'s extensions, in
    that order), each with its running xxh3_64; ``finish`` closes and fsyncs them
    and gives the shard's ``ShardInfo`` (``tokload.derive.convert`` writes a
    shard's files through it too)."""

    def __init__(self, root: Path, name: str, manifest: Manifest, durable: bool = True) -> None:
        self.name = name
        self.exts = manifest.files()
        self.block = manifest.span_block
        self.root = root
        # Layout "blocks": the runs and records go to hidden files in the form
        # of layout "spans" (which no manifest lists), encoded as blocks when
        # the shard is finished.
        self.to_blocks = manifest.blocks
        self.work = ("rows", "docs", "mdx", "mdb", "mds") if self.to_blocks else self.exts
        self.paths = [
            root / (f".{name}.{ext}.tmp" if ext not in self.exts else f"{name}.{ext}")
            for ext in self.work
        ]
        self.files: list[IO[bytes]] = []
        try:
            for p in self.paths:
                self.files.append(open(p, "xb", buffering=1 << 20))  # noqa: SIM115
        except BaseException:
            for f in self.files:
                f.close()
            for p in self.paths[: len(self.files)]:
                p.unlink(missing_ok=True)
            raise
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
        first = np.zeros(1, U64).tobytes()
        self.put(1, first)  # first document starts at row 0
        if manifest.metadata:
            self.put(2, first)

    _STATE = (
        "rows",
        "documents",
        "records",
        "meta_bytes",
        "runs",
        "blocks",
        "last_start",
        "last_record",
    )

    def mark(self) -> tuple[list[int], list[Any], list[Any]]:
        """Where every file, checksum and count stands now, for ``rewind``."""
        return (
            [f.tell() for f in self.files],
            [h.copy() for h in self.hashes],
            [getattr(self, a) for a in self._STATE],
        )

    def rewind(self, mark: tuple[list[int], list[Any], list[Any]]) -> None:
        """Take the files, checksums and counts back to ``mark``."""
        sizes, hashes, state = mark
        for f, size in zip(self.files, sizes, strict=True):
            f.flush()
            f.truncate(size)
            f.seek(size)
        self.hashes = hashes
        for a, v in zip(self._STATE, state, strict=True):
            setattr(self, a, v)

    def put(self, k: int, data: bytes | memoryview) -> None:
        """Append ``data`` to file ``k`` (an index into ``Manifest.files()``)."""
        self.files[k].write(data)
        self.hashes[k].update(data)

    def add_runs(self, starts: np.ndarray, records: np.ndarray, n: int) -> None:
        """The span table entries of the next document (``n`` rows), before ``add``.

        ``starts`` are local to the document, ``records`` to its spans (or none).
        """
        base = self.rows
        starts = starts + np.uint64(base)
        records = self.shard_ids(records)
        if self.runs and len(records) and records[0] == self.last_record:
            # rows without metadata after rows without, or a record that goes on: one run
            starts, records = starts[1:], records[1:]
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
            self.put(4, entries.tobytes())
            self.runs += len(starts)
            self.last_start, self.last_record = int(starts[-1]), int(records[-1])
        if self.to_blocks:
            return  # the blocks are encoded when the shard is finished
        # Block index entries for the blocks that begin inside the document.
        top = -(-(base + n) // self.block)
        if top > self.blocks:
            at = np.arange(self.blocks, top, dtype=np.uint64) * np.uint64(self.block)
            idx = np.searchsorted(c_starts, at, side="right").astype(np.int64) - 1
            self.put(5, (idx + first).astype(U64).tobytes())
            self.blocks = top

    def shard_ids(self, local: np.ndarray) -> np.ndarray:
        """Record ids local to a piece (``CONTINUED``: the shard's last) as the shard's."""
        ids = np.where(local == NO_METADATA, local, local + np.uint32(self.records))
        if self.records:  # (a piece goes on with a record only after one)
            ids = np.where(local == CONTINUED, np.uint32(self.records - 1), ids)
        return ids

    def add(self, rows: np.ndarray, payloads: list[bytes], end: bool = True) -> None:
        """The next rows (and their records); ``end``: they end a document."""
        self.put(0, np.ascontiguousarray(rows).view(np.uint8).data)
        self.rows += len(rows)
        if end:
            self.documents += 1
            self.put(1, np.array([self.rows], U64).tobytes())
        if payloads:
            ends = self.meta_bytes + np.cumsum([len(p) for p in payloads], dtype=np.uint64)
            for p in payloads:
                self.put(3, p)
            self.put(2, ends.astype(U64).tobytes())
            self.records += len(payloads)
            self.meta_bytes = int(ends[-1])

    def finish(self, durable: bool) -> ShardInfo:
        if "msx" in self.exts:
            self.put(5, np.array([self.runs], U64).tobytes())
        for f, ext in zip(self.files, self.work, strict=True):
            f.flush()
            if durable and ext in self.exts:
                os.fsync(f.fileno())
            f.close()
        checksums = {
            ext: h.hexdigest()
            for ext, h in zip(self.work, self.hashes, strict=True)
            if ext in self.exts
        }
        meta_bytes = self.meta_bytes
        if self.to_blocks:
            meta_bytes = self._encode_blocks(durable, checksums)
        return ShardInfo(
            self.name,
            self.rows,
            self.documents,
            self.records,
            meta_bytes,
            checksums,
            metadata_runs=self.runs if "mds" in self.exts else 0,
        )

    def _encode_blocks(self, durable: bool, checksums: dict[str, str]) -> int:
        """Layout "blocks": the ``.msb`` and ``.mbx`` from the hidden files,
        which are then removed.  Returns the ``.msb``'s size.

        The shard's runs and records are loaded whole (about 12 bytes per run
        and the records: 130 MB for a 1 GiB shard of ``uint16`` tokens at one
        record per 100)."""
        mdx_p, mdb_p, mds_p = self.paths[2:5]
        runs = np.fromfile(mds_p, SPAN_DTYPE)
        mdx = np.fromfile(mdx_p, U64)
        mdb = np.fromfile(mdb_p, np.uint8)
        out = [self.root / f"{self.name}.msb", self.root / f"{self.name}.mbx"]
        self.paths += out
        hashes = [xxhash.xxh3_64(), xxhash.xxh3_64()]
        with open(out[0], "xb", buffering=1 << 20) as f:

            def put(piece: np.ndarray) -> None:
                f.write(piece.data)
                hashes[0].update(piece.data)

            index = encode_blocks(
                self.block, self.rows, runs["start"], runs["record"], mdx, mdb, put
            )
            f.flush()
            if durable:
                os.fsync(f.fileno())
        with open(out[1], "xb") as f:
            data = index.astype(U64).tobytes()
            f.write(data)
            hashes[1].update(data)
            f.flush()
            if durable:
                os.fsync(f.fileno())
        for p in (mdx_p, mdb_p, mds_p):
            p.unlink()
        checksums["msb"], checksums["mbx"] = hashes[0].hexdigest(), hashes[1].hexdigest()
        return int(index[-1])

    def remove(self) -> None:
        for p in self.paths:
            p.unlink(missing_ok=True)
