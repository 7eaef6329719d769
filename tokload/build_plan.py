"""Where a build's chunks fall: ``tokload build``'s plan and the options it records.

Inputs are split into **chunks** that can be built independently: an
uncompressed JSONL file into byte ranges of about ``chunk_bytes`` whose starts
are moved forward to the next line start, a Parquet file into runs of whole
row groups of about ``chunk_bytes``, and a compressed file (which cannot be
entered in the middle) or a plain-text document into one chunk. Where the
chunks fall depends only on the input's bytes and ``chunk_bytes``, so the same
inputs always give the same chunks, whatever the number of workers or machines.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokload.errors import BuildError, UsageError
from tokload.inputs import compressed
from tokload.inputs import kind as input_kind

DEFAULT_CHUNK_BYTES = 32 << 20


@dataclass(frozen=True)
class BuildOptions:
    """What to extract from the inputs and how to tokenize it (see ``build``)."""

    text_field: str = "text"
    keep_fields: tuple[str, ...] = ()
    annotations_field: str | None = None
    tokenizer: str = "bytes"
    bos: bool = False
    eos: bool = True
    on_error: str = "stop"
    shard_bytes: int = 1 << 30
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    # The tokens' text when not the tokenizer's own BOS/EOS (their ids are in
    # the tokenizer's record, which a chunk's reuse check compares)
    bos_token: str | None = None
    eos_token: str | None = None

    @property
    def metadata(self) -> bool:
        return bool(self.keep_fields) or self.annotations_field is not None

    def fields_read(self) -> tuple[str, ...]:
        """The fields of a record the build uses (a Parquet file's other columns
        are not read)."""
        extra = () if self.annotations_field is None else (self.annotations_field,)
        return (self.text_field, *self.keep_fields, *extra)

    def record(self) -> dict[str, Any]:
        """The options that change the output (the tokenizer is recorded by its hash)."""
        return {
            "text_field": self.text_field,
            "keep_fields": list(self.keep_fields),
            "annotations_field": self.annotations_field,
            "bos": self.bos,
            "eos": self.eos,
            "on_error": self.on_error,
            "shard_bytes": self.shard_bytes,
            "chunk_bytes": self.chunk_bytes,
        }


@dataclass(frozen=True)
class Chunk:
    """One independently built piece of one input.

    ``unit`` says what ``[start, end)`` counts: ``"bytes"`` (a JSONL byte
    range, both ends at line starts), ``"row_groups"`` (Parquet) or
    ``"file"`` (the whole file: compressed JSONL, a plain-text document).
    ``size`` is the number of input bytes it covers (for progress).
    """

    input: int
    path: str
    index: int
    count: int
    unit: str
    start: int
    end: int
    size: int
    identity: tuple[int, int]  # the input's (size, mtime_ns) when planned

    @property
    def name(self) -> str:
        return f"{self.input:05d}-{self.index:05d}"

    def record(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "count": self.count,
            "unit": self.unit,
            "start": self.start,
            "end": self.end,
        }


def parse_part(part: str | tuple[int, int] | None) -> tuple[int, int]:
    """``"k/N"`` (or ``(k, N)``) as a checked pair; ``None`` is ``(0, 1)``."""
    if part is None:
        return 0, 1
    if isinstance(part, str):
        try:
            k_s, n_s = part.split("/")
            k, n = int(k_s), int(n_s)
        except ValueError:
            raise UsageError(f"part must look like 'k/N' (e.g. 3/16), got {part!r}") from None
    else:
        k, n = part
    if n < 1 or not 0 <= k < n:
        raise UsageError(f"part {k}/{n}: need 0 <= k < N (parts are numbered from 0)")
    return k, n


def plan_record(
    files: Sequence[Path], chunk_bytes: int, chunks: int, part: tuple[int, int]
) -> dict[str, Any]:
    """What a build's manifest records of the plan it took its chunks from: the
    plan's ``id`` (a hash of the inputs' file names, in order, and the chunk size:
    the same for every part of one ``--part k/N`` split, wherever each machine
    mounts the inputs; an input that changed between two parts' builds is told
    by their numbers of chunks), its number of ``chunks``, the ``part`` ``[k, N]``
    and its ``span``, the plan's chunks ``[lo, hi)`` it holds. ``tokload merge``
    finds a part left out by it."""
    k, n = part
    key = json.dumps([[Path(f).name for f in files], chunk_bytes])
    return {
        "id": hashlib.sha256(key.encode()).hexdigest()[:16],
        "chunks": chunks,
        "part": [k, n],
        "span": [k * chunks // n, (k + 1) * chunks // n],
    }


def plan_chunks(files: Sequence[Path], chunk_bytes: int) -> list[Chunk]:
    """Every input's chunks, in input order; a pure function of the inputs' bytes.

    Reads a few bytes at each nominal boundary of an uncompressed JSONL input
    (to find the next line start) and a Parquet input's footer; nothing else.
    """
    plan: list[Chunk] = []
    for i, path in enumerate(files):
        try:
            st = os.stat(path)
            ident = (st.st_size, st.st_mtime_ns)
            kind = input_kind(path)
            if kind == "jsonl" and not compressed(path):
                bounds = _line_bounds(path, st.st_size, chunk_bytes)
                spans = [("bytes", a, b, b - a) for a, b in itertools.pairwise(bounds)]
            elif kind == "parquet":
                spans = _row_group_spans(path, chunk_bytes)
            else:
                spans = [("file", 0, st.st_size, st.st_size)]
        except OSError as e:
            raise BuildError(f"{path}: cannot read the input: {e.strerror or e}") from None
        for c, (unit, a, b, size) in enumerate(spans):
            plan.append(Chunk(i, str(path), c, len(spans), unit, a, b, size, ident))
    return plan


def _line_bounds(path: Path, size: int, chunk_bytes: int) -> list[int]:
    """``[0, b1, ..., size]``: each nominal boundary ``k * chunk_bytes`` moved
    forward to the next line start (a line longer than a chunk merges chunks)."""
    bounds = [0]
    with open(path, "rb") as f:
        for nominal in range(chunk_bytes, size, chunk_bytes):
            if nominal <= bounds[-1]:
                continue
            pos = nominal - 1  # a line starts at `nominal` if the byte before it ends one
            f.seek(pos)
            while True:
                block = f.read(1 << 16)
                if not block:
                    pos = size
                    break
                j = block.find(b"\n")
                if j >= 0:
                    pos += j + 1
                    break
                pos += len(block)
            if pos >= size:
                break
            bounds.append(pos)
    if size > 0 or len(bounds) == 1:
        bounds.append(size)
    return bounds


def _row_group_spans(path: Path, chunk_bytes: int) -> list[tuple[str, int, int, int]]:
    """Runs of consecutive row groups of about ``chunk_bytes`` (compressed) each."""
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise BuildError(f"{path}: reading Parquet needs the 'pyarrow' package") from None
    try:
        meta = pq.ParquetFile(str(path)).metadata
    except pa.ArrowException as e:
        raise BuildError(f"{path}: unreadable Parquet: {e}") from None
    sizes = [row_group_range(meta, g) for g in range(meta.num_row_groups)]
    spans: list[tuple[str, int, int, int]] = []
    g0, acc = 0, 0
    for g, (a, b) in enumerate(sizes):
        acc += b - a
        if acc >= chunk_bytes or g == len(sizes) - 1:
            spans.append(("row_groups", g0, g + 1, acc))
            g0, acc = g + 1, 0
    return spans or [("row_groups", 0, 0, 0)]


def row_group_range(meta: Any, g: int) -> tuple[int, int]:
    """The byte range ``[a, b)`` of the file holding row group ``g``'s column chunks."""
    rg = meta.row_group(g)
    lo, hi = None, 0
    for j in range(rg.num_columns):
        col = rg.column(j)
        start = col.data_page_offset
        if col.has_dictionary_page and col.dictionary_page_offset is not None:
            start = min(start, col.dictionary_page_offset)
        lo = start if lo is None else min(lo, start)
        hi = max(hi, start + col.total_compressed_size)
    return (lo or 0, hi)
