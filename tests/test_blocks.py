"""Metadata layout "blocks" (FORMAT.md, version 3): what this file pins.

- The encoder (``tokload._meta.encode_blocks``) writes, byte for byte, the
  blocks a pure-Python encoder written from FORMAT.md's table writes (a
  hand-computed example too), sizes every block as ``4 + 6*nruns + 4*nnew +
  bytes``, and ``decode_blocks`` gives the runs and records back.
- The reader (``BlockSet.read_windows`` through ``StreamWithMetadata``) on
  datasets written by hand from FORMAT.md, where a record repeats within a
  block, across blocks and across windows, gives what a pure-Python reference
  gives; with the block index in memory or not (``TOKLOAD_INDEX_MEMORY``), and
  from several threads at once.
- Damage names the file and the block: ``CorruptDataError`` for bad blocks
  and block index entries (``verify`` says the same), ``TruncatedFileError``
  naming the file and what was read for files that shrank, on every backend.
- The manifest rules of version 3 (checksums, appending and merging too), the
  writer's hidden files (never left, never listed) and the size of the layout
  against the span table.

The reference / property / loader / exactly-once checks on all three layouts,
and the conversions between them, live in ``tests/test_metadata.py``.
"""

from __future__ import annotations

import array
import bisect
import itertools
import json
import os
import re
import struct
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from timeouts import no_hang

import tokload
from tokload import StreamWithMetadata, Writer
from tokload._io import uring_available
from tokload._meta import SPAN_NONE, BlockSet, Scratch, decode_blocks, encode_blocks
from tokload._tables import CompressedTable, compressed_table_bytes
from tokload.checksum import verify_checksums
from tokload.derive import convert, merge
from tokload.errors import CorruptDataError, FormatError, TruncatedFileError
from tokload.format import read_manifest
from tokload.source import DEFAULT_INDEX_MEMORY
from tokload.tools import verify

NONE = SPAN_NONE
assert NONE == 0xFFFFFFFF


# ---- a shard's runs and records, and FORMAT.md's blocks in pure Python ------


class Shard:
    """One shard as a writer knows it: its tokens, its runs (first rows and
    records, shard-local) and its records' bytes."""

    def __init__(
        self,
        tokens: np.ndarray,
        starts: Sequence[int],
        records: Sequence[int],
        payloads: list[bytes],
    ) -> None:
        self.tokens = np.asarray(tokens, dtype="<u2")
        self.starts = list(starts)
        self.records = list(records)
        self.payloads = payloads

    @property
    def rows(self) -> int:
        return len(self.tokens)

    def mdx(self) -> np.ndarray:
        return np.concatenate([[0], np.cumsum([len(p) for p in self.payloads])]).astype(np.uint64)

    def mdb(self) -> bytes:
        return b"".join(self.payloads)

    def row_records(self) -> list[int]:
        """The record of every row (NONE for none)."""
        ends = [*self.starts[1:], self.rows] if self.starts else []
        out: list[int] = []
        for a, z, r in zip(self.starts, ends, self.records, strict=True):
            out += [r] * (z - a)
        return out


def block_runs(s: Shard, block: int, b: int) -> tuple[list[int], list[int]]:
    """The runs of block ``b`` as FORMAT.md lists them: block-relative starts
    (the run holding the block's first row at 0) and records."""
    base, top = b * block, min((b + 1) * block, s.rows)
    first = bisect.bisect_right(s.starts, base) - 1
    last = bisect.bisect_left(s.starts, top)
    starts = [max(a, base) - base for a in s.starts[first:last]]
    return starts, s.records[first:last]


def reference_encode(s: Shard, block: int) -> tuple[list[int], bytes]:
    """The ``.mbx`` values and ``.msb`` bytes of FORMAT.md's table, in Python."""
    index, out = [0], bytearray()
    for b in range(-(-s.rows // block)):
        starts, records = block_runs(s, block, b)
        distinct = list(dict.fromkeys(r for r in records if r != NONE))
        ends = list(itertools.accumulate(len(s.payloads[r]) for r in distinct))
        n, m = len(starts), len(distinct)
        out += struct.pack(f"<I{n}H{n}I{m}I", n, *starts, *records, *ends)
        out += b"".join(s.payloads[r] for r in distinct)
        index.append(len(out))
    return index, bytes(out)


def formula_sizes(s: Shard, block: int) -> list[int]:
    """Each block's size by FORMAT.md's formula ``4 + 6 nruns + 4 nnew + bytes``."""
    sizes = []
    for b in range(-(-s.rows // block)):
        starts, records = block_runs(s, block, b)
        distinct = set(records) - {NONE}
        sizes.append(
            4 + 6 * len(starts) + 4 * len(distinct) + sum(len(s.payloads[r]) for r in distinct)
        )
    return sizes


def merged(starts: Sequence[int], records: Sequence[int]) -> list[tuple[int, int]]:
    """Runs with consecutive runs of one record joined (how a run that goes on
    across a block boundary comes back from the blocks)."""
    out: list[tuple[int, int]] = []
    for a, r in zip(starts, records, strict=True):
        if not out or out[-1][1] != r:
            out.append((int(a), int(r)))
    return out


def c_encode(s: Shard, block: int) -> tuple[np.ndarray, bytes, list[np.ndarray]]:
    """``encode_blocks``: the index, the ``.msb`` and the pieces given to write."""
    pieces: list[np.ndarray] = []
    index = encode_blocks(
        block,
        s.rows,
        np.array(s.starts, np.uint64),
        np.array(s.records, np.uint32),
        s.mdx(),
        s.mdb(),
        pieces.append,
    )
    return index, b"".join(p.tobytes() for p in pieces), pieces


# ---- 1. the encoder and the decoder -----------------------------------------


@st.composite
def shards(draw: st.DrawFn) -> tuple[Shard, int]:
    rows = draw(st.integers(1, 300))
    block = draw(st.integers(1, 70))
    nrec = draw(st.integers(0, 7))
    payloads = draw(st.lists(st.binary(max_size=12), min_size=nrec, max_size=nrec))
    cuts = draw(st.sets(st.integers(1, rows - 1), max_size=80)) if rows > 1 else set()
    starts = [0, *sorted(cuts)]
    rec = st.one_of(st.integers(0, nrec - 1), st.just(NONE)) if nrec else st.just(NONE)
    records = draw(st.lists(rec, min_size=len(starts), max_size=len(starts)))
    return Shard(np.zeros(rows), starts, records, payloads), block


@settings(max_examples=300, deadline=None)
@given(case=shards())
def test_encoder_matches_format_md_and_decoder_inverts_it(case: tuple[Shard, int]) -> None:
    s, block = case
    index, msb, pieces = c_encode(s, block)
    assert all(p.dtype == np.uint8 for p in pieces)
    # the index: 0, never decreasing, the .msb's size last; one value per block + 1
    assert index.dtype == np.uint64 and len(index) == -(-s.rows // block) + 1
    assert index[0] == 0 and bool(np.all(np.diff(index.astype(np.int64)) >= 0))
    assert int(index[-1]) == len(msb)
    assert np.diff(index).tolist() == formula_sizes(s, block)
    # byte for byte what FORMAT.md's table says
    ref_index, ref_msb = reference_encode(s, block)
    assert index.tolist() == ref_index
    assert msb == ref_msb
    # and back
    starts, records, mdx, mdb = decode_blocks(
        block, s.rows, len(s.payloads), index, np.frombuffer(msb, np.uint8), "x.mbx", "x.msb"
    )
    assert merged(starts.tolist(), records.tolist()) == merged(s.starts, s.records)
    assert len(mdx) == len(s.payloads) + 1 and mdx[0] == 0 and int(mdx[-1]) == len(mdb)
    used = set(s.records) - {NONE}
    for r, payload in enumerate(s.payloads):
        got = mdb[int(mdx[r]) : int(mdx[r + 1])].tobytes()
        assert got == (payload if r in used else b""), r  # an unused record keeps no bytes


def test_hand_computed_example() -> None:
    """rows 5, block 4, runs [0, 2, 3] with records [7, none, 7], record 7 = b"ab"."""
    s = Shard(np.zeros(5), [0, 2, 3], [7, NONE, 7], [b""] * 7 + [b"ab"])
    block0 = (
        (3).to_bytes(4, "little")  # nruns
        + b"".join(a.to_bytes(2, "little") for a in (0, 2, 3))  # start[]
        + b"".join(r.to_bytes(4, "little") for r in (7, NONE, 7))  # record[]
        + (2).to_bytes(4, "little")  # end[]: one distinct record, 2 bytes
        + b"ab"
    )
    block1 = (  # row 4 only: the run of record 7 goes on from row 3
        (1).to_bytes(4, "little")
        + (0).to_bytes(2, "little")
        + (7).to_bytes(4, "little")
        + (2).to_bytes(4, "little")
        + b"ab"
    )
    assert len(block0) == 4 + 6 * 3 + 4 * 1 + 2 == 28 and len(block1) == 16
    index, msb, _ = c_encode(s, 4)
    assert index.tolist() == [0, 28, 44]
    assert msb == block0 + block1
    starts, records, mdx, mdb = decode_blocks(4, 5, 8, index, msb, "i", "m")
    assert starts.tolist() == [0, 2, 3] and records.tolist() == [7, NONE, 7]
    assert mdx.tolist() == [0] * 8 + [2] and mdb.tobytes() == b"ab"


def test_encoder_in_several_pieces_and_at_the_largest_block() -> None:
    """Block 1 over 10,000 rows is encoded a few thousand blocks a call (the run
    cursor carries over); block 65,536 puts a run at start 65,535 (uint16's top)."""
    rng = np.random.default_rng(0)
    cuts = np.unique(rng.integers(1, 10_000, 3000)).tolist()
    records = rng.integers(0, 5, len(cuts) + 1).tolist()
    s = Shard(np.zeros(10_000), [0, *cuts], records, [b"a", b"bb", b"", b"dddd", b"e"])
    index, msb, pieces = c_encode(s, 1)
    assert len(pieces) == 3
    assert (index.tolist(), msb) == reference_encode(s, 1)
    big = Shard(np.zeros(70_000), [0, 65_535, 65_536, 69_999], [0, 1, 1, 0], [b"x", b"yz"])
    index, msb, _ = c_encode(big, 65_536)
    assert (index.tolist(), msb) == reference_encode(big, 65_536)
    assert struct.unpack_from("<I2H", msb) == (2, 0, 65_535)
    starts, records, _, mdb = decode_blocks(65_536, 70_000, 2, index, msb, "i", "m")
    assert merged(starts.tolist(), records.tolist()) == [(0, 0), (65_535, 1), (69_999, 0)]
    assert mdb.tobytes() == b"xyz"


def test_empty_shard_encodes_to_no_blocks() -> None:
    calls: list[np.ndarray] = []
    index = encode_blocks(
        8, 0, np.zeros(0, np.uint64), np.zeros(0, np.uint32), [0], b"", calls.append
    )
    assert index.tolist() == [0] and sum(len(c) for c in calls) == 0
    starts, records, mdx, mdb = decode_blocks(8, 0, 0, index, b"", "i", "m")
    assert len(starts) == len(records) == len(mdb) == 0 and mdx.tolist() == [0]


@pytest.mark.parametrize(
    ("starts", "records", "mdx", "message"),
    [
        ([1, 3], [0, 0], [0, 1], r"metadata run 0: 1 is out of order or range \(limit 0\)"),
        ([0, 3, 3], [0, 0, 0], [0, 1], r"metadata run 2: 3 is out of order or range \(limit 3\)"),
        ([0, 3], [0, 1], [0, 1], r"metadata run 1: 1 is out of order or range \(limit 1\)"),
        ([0], [0], [0, 5], r"metadata record 0: 5 is out of order or range \(limit 1\)"),
        ([0], [1], [0, 1, 0], r"metadata record 1: 0 is out of order or range \(limit 1\)"),
    ],
)
def test_encoder_refuses_bad_runs_and_records(
    starts: list[int], records: list[int], mdx: list[int], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        encode_blocks(
            4, 8, np.array(starts, np.uint64), np.array(records, np.uint32), mdx, b"x", print
        )
    with pytest.raises(ValueError, match=r"block must be in \[1, 65536\], got 65537"):
        encode_blocks(65_537, 8, [0], np.array([0], np.uint32), [0, 1], b"x", print)


@pytest.mark.parametrize(
    ("starts", "records"),
    [([0, 8], [0, 0]), ([0, 20, 9], [0, 0, 0]), ([0, 9], [0, 5]), ([0, 4, 1], [0, 0, 0])],
)
def test_encoder_refuses_runs_out_of_order_or_past_the_shard(
    starts: list[int], records: list[int]
) -> None:
    with pytest.raises(ValueError, match=r"metadata (run|record) \d+"):
        encode_blocks(
            4, 8, np.array(starts, np.uint64), np.array(records, np.uint32), [0, 1], b"x", print
        )
    with pytest.raises(ValueError, match=r"metadata run 0: 0 is out of order or range"):
        encode_blocks(4, 0, np.array([0], np.uint64), np.array([0], np.uint32), [0, 1], b"x", print)


# ---- datasets written by hand from FORMAT.md --------------------------------


def write_by_hand(root: Path, shards_: Sequence[Shard], block: int) -> Path:
    """A version 3 dataset (no documents) whose blocks come from
    :func:`reference_encode`: the reader is checked against FORMAT.md, not
    against tokload's own encoder."""
    root.mkdir(parents=True)
    entries = []
    for k, s in enumerate(shards_):
        name = f"s{k:02d}"
        s.tokens.tofile(root / f"{name}.rows")
        index, msb = reference_encode(s, block)
        (root / f"{name}.msb").write_bytes(msb)
        np.array(index, "<u8").tofile(root / f"{name}.mbx")
        entries.append(
            {
                "name": name,
                "rows": s.rows,
                "metadata_records": len(s.payloads),
                "metadata_bytes": len(msb),
            }
        )
    manifest = {
        "format": "tokload",
        "version": 3,
        "dtype": "<u2",
        "documents": False,
        "metadata": True,
        "metadata_layout": "blocks",
        "span_block": block,
        "shards": entries,
        "user": {},
    }
    (root / "manifest.json").write_text(json.dumps(manifest))
    return root


def random_shard(rng: np.random.Generator, rows: int, nrec: int, maxrun: int = 12) -> Shard:
    """Short runs over a few records: each record repeats within blocks,
    across blocks and across windows; a fifth of the runs have none."""
    starts, at = [], 0
    while at < rows:
        starts.append(at)
        at += int(rng.integers(1, maxrun + 1))
    records = [NONE if rng.random() < 0.2 else int(rng.integers(0, nrec)) for _ in starts]
    payloads = [
        bytes(rng.integers(0, 256, int(rng.integers(0, 9)), dtype=np.uint8)) for _ in range(nrec)
    ]
    payloads[0] = b""  # an empty record is still a record
    return Shard(rng.integers(0, 65_535, rows), starts, records, payloads)


def sample_shards(seed: int = 0) -> list[Shard]:
    rng = np.random.default_rng(seed)
    sizes = [300, 0, 17, 250, 1, 128, 90]  # an empty shard, a shard of one row
    return [random_shard(rng, n, nrec=5) for n in sizes]


def reference_batch(
    shards_: Sequence[Shard], window: int, stride: int, idx: Sequence[int]
) -> tuple[np.ndarray, np.ndarray, list[bytes]]:
    """Tokens, positions and the batch's distinct records (a record is a
    (shard, id) pair; in order of first appearance), row by row in Python."""
    toks = np.concatenate([s.tokens for s in shards_])
    keys: list[tuple[int, int] | None] = []
    for k, s in enumerate(shards_):
        keys += [None if r == NONE else (k, r) for r in s.row_records()]
    order: dict[tuple[int, int], int] = {}
    positions = np.full((len(idx), window), -1, np.int32)
    for w, i in enumerate(idx):
        for j, key in enumerate(keys[i * stride : i * stride + window]):
            if key is not None:
                positions[w, j] = order.setdefault(key, len(order))
    tokens = np.stack([toks[i * stride : i * stride + window] for i in idx])
    return tokens, positions, [shards_[k].payloads[r] for k, r in order]


def assert_batch(view: StreamWithMetadata, shards_: Sequence[Shard], idx: Sequence[int]) -> None:
    b = view.read(np.asarray(idx, dtype=np.int64))
    tokens, positions, records = reference_batch(shards_, view.window, view.stride, idx)
    np.testing.assert_array_equal(b.fields["tokens"], tokens)
    np.testing.assert_array_equal(b.positions, positions)
    assert [b.metadata.raw(k) for k in range(len(b.metadata))] == records


def block_set(view: StreamWithMetadata) -> BlockSet:
    spans = view.source.spans
    assert isinstance(spans, BlockSet)
    return spans


def _memory(monkeypatch: pytest.MonkeyPatch, memory: bool) -> None:
    """The block index held in memory (the default) or read per batch."""
    if memory:
        monkeypatch.delenv("TOKLOAD_INDEX_MEMORY", raising=False)
    else:
        monkeypatch.setenv("TOKLOAD_INDEX_MEMORY", "0")


# ---- 2. the reader against the reference ------------------------------------


@pytest.mark.parametrize("block", [1, 5, 16, 4096])
@pytest.mark.parametrize(("window", "stride"), [(37, 11), (1, 1), (200, 150), (8, 8)])
def test_reader_matches_the_reference(tmp_path: Path, block: int, window: int, stride: int) -> None:
    shards_ = sample_shards()
    ds = write_by_hand(tmp_path / "ds", shards_, block)
    view = StreamWithMetadata(ds, window=window, stride=stride)
    assert block_set(view).block == block
    n = len(view)
    assert_batch(view, shards_, list(range(n)))
    rng = np.random.default_rng(block + window)
    for _ in range(5):
        assert_batch(view, shards_, rng.integers(0, n, 9).tolist())  # repeats, any order


def test_reader_repeats_within_and_across_blocks(tmp_path: Path) -> None:
    """Record 3 in several runs of one block, in the next block, and in the
    next shard (another record there, though the id is the same)."""
    a = Shard(
        np.arange(24),
        [0, 2, 3, 5, 6, 9, 12, 20],
        [3, 1, 3, NONE, 3, 1, 3, 0],
        [b"zero", b"one", b"", b"three"],
    )
    b = Shard(np.arange(24, 40), [0, 4], [3, 3], [b"", b"", b"", b"other three"])
    ds = write_by_hand(tmp_path / "ds", [a, b], block=8)
    view = StreamWithMetadata(ds, window=30, stride=5)
    got = view.read([0])
    assert [got.metadata.raw(k) for k in range(len(got.metadata))] == [
        b"three",
        b"one",
        b"zero",
        b"other three",
    ]
    assert (
        got.positions[0].tolist()
        == [0, 0, 1, 0, 0, -1, 0, 0, 0, 1, 1, 1] + [0] * 8 + [2] * 4 + [3] * 6
    )
    for idx in ([0], [1, 0, 1], list(range(len(view))), [2, 2]):
        assert_batch(view, [a, b], idx)


def test_a_block_that_begins_with_two_runs_without_a_record(tmp_path: Path) -> None:
    """Block 0 of 8 rows: two runs without a record, then records 0 and 1 in
    order. Its first record is run 2's: two overlapping windows within it
    share record 0, and a batch of both lists it once."""
    shard = Shard(
        np.arange(16), [0, 1, 2, 5, 9, 12], [NONE, NONE, 0, 1, 2, NONE], [b"a", b"b", b"c"]
    )
    ds = write_by_hand(tmp_path / "ds", [shard], block=8)
    view = StreamWithMetadata(ds, window=6, stride=1)
    for idx in ([0, 1], [1, 2, 0], [0], list(range(len(view)))):
        assert_batch(view, [shard], idx)


@pytest.mark.parametrize("order", ["in order", "dense", "out of order"])
def test_runs_of_every_length_fill_exactly_their_rows(tmp_path: Path, order: str) -> None:
    """Runs of 1 to 70 rows, each cut by windows at every offset: the reader
    fills positions with 64- and 16-byte stores, the last one of a run
    overlapping the one before, and element by element below 4 rows; from 32
    rows the stores between the first and the last are 64-byte aligned; no
    store may reach past its run. In order, the blocks' records are counted,
    except in the blocks next to the two runs without a record, whose ids
    (5 and 40) no run uses; dense, every block's records are first .. last,
    each once, numbered by subtraction from the run that holds a window's
    first row on (a window read alone takes the resolver's lean loop). Out of
    order, they go through the block-local set instead."""
    lengths = list(range(1, 71)) + list(range(70, 0, -1))
    starts = [0, *itertools.accumulate(lengths)][:-1]
    rows = sum(lengths)
    nrec = len(lengths)
    if order == "in order":
        records = list(range(nrec))
    elif order == "dense":  # the ids go on over the runs without a record
        ids = itertools.count()
        records = [0 if i in (5, 40) else next(ids) for i in range(nrec)]
    else:  # 7 i mod 140, 20 records that come back every 20 runs
        records = [(7 * i) % nrec for i in range(nrec)]
    records[5] = records[40] = NONE
    payloads = [b"r%d" % i for i in range(nrec)]
    shard = Shard(np.arange(rows) % 65_535, starts, records, payloads)
    ds = write_by_hand(tmp_path / "ds", [shard], block=512)
    for window, stride in ((rows, 1), (97, 13), (33, 1)):
        view = StreamWithMetadata(ds, window=window, stride=stride)
        assert_batch(view, [shard], list(range(len(view))))
    # window by window into memory fenced by sentinels: a store past the last
    # row (or before the first) of a window shows there. Windows of 75 hold
    # whole runs of 32 rows and more (aligned 64-byte stores between the
    # first and the last), starting at every address modulo 64.
    for window in (37, 75):
        view = StreamWithMetadata(ds, window=window, stride=1)
        backing = np.empty(window + 32, np.int32)
        _, expected, _ = reference_batch([shard], window, 1, list(range(len(view))))
        for i in range(len(view)):
            backing[:] = -7
            view.read([i], positions=backing[16:-16].reshape(1, window))
            assert (backing[:16] == -7).all() and (backing[-16:] == -7).all(), (window, i)
            seen: dict[int, int] = {}  # read alone, a window numbers its records from 0
            renumbered = [-1 if v < 0 else seen.setdefault(v, len(seen)) for v in expected[i]]
            assert backing[16:-16].tolist() == renumbered, (window, i)


def test_reader_at_the_largest_block(tmp_path: Path) -> None:
    """Block 65,536: a run starting at 65,535, the last start a uint16 holds."""
    big = Shard(
        np.arange(70_000) % 65_535, [0, 65_535, 65_536, 69_990], [0, 1, 1, NONE], [b"x", b"yz"]
    )
    small = random_shard(np.random.default_rng(1), 50, nrec=3)
    ds = write_by_hand(tmp_path / "ds", [big, small], block=65_536)
    view = StreamWithMetadata(ds, window=10, stride=3)
    near = [(65_535 - 9) // 3 + k for k in range(-2, 6)]
    assert_batch(view, [big, small], [0, *near, len(view) - 1, 23_330])


# ---- 2b. several batches in one round (read_batches, the loader's tasks) ---


def assert_batches(
    view: StreamWithMetadata, shards_: Sequence[Shard], batches: Sequence[Sequence[int]]
) -> None:
    """read_batches equals read_batch of each batch and the row-by-row reference."""
    idx = [np.asarray(b, dtype=np.int64) for b in batches]
    got = view.read_batches(idx, np.empty)
    assert len(got) == len(idx)
    for raw, ix in zip(got, idx, strict=True):
        one = view.read_batch(ix, np.empty)
        assert sorted(raw) == sorted(one)
        for key in ("tokens", "metadata_positions", "metadata_bytes", "metadata_offsets"):
            np.testing.assert_array_equal(raw[key], one[key], key)
        assert raw["tokens"].shape == (len(ix), view.window)
        if not len(ix):
            assert len(raw["metadata"]) == 0
            continue
        tokens, positions, records = reference_batch(shards_, view.window, view.stride, ix.tolist())
        np.testing.assert_array_equal(raw["tokens"], tokens)
        np.testing.assert_array_equal(raw["metadata_positions"], positions)
        assert [raw["metadata"].raw(k) for k in range(len(raw["metadata"]))] == records


@pytest.mark.parametrize("memory", [True, False], ids=["in-memory", "read"])
@pytest.mark.parametrize("block", [1, 5, 16])
def test_several_batches_in_one_round_number_their_own_records(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, memory: bool, block: int
) -> None:
    _memory(monkeypatch, memory)
    shards_ = sample_shards(3)
    ds = write_by_hand(tmp_path / "ds", shards_, block)
    view = StreamWithMetadata(ds, window=37, stride=11)
    n = len(view)
    rng = np.random.default_rng(block)
    # the same windows in several batches, batches of one, a batch of all
    assert_batches(view, shards_, [[0, 1], [1, 0], [0]])
    assert_batches(view, shards_, [[k] for k in range(n)])
    assert_batches(view, shards_, [list(range(n)), [n - 1, 0]])
    for _ in range(10):
        sizes = rng.integers(1, 6, int(rng.integers(2, 9)))
        assert_batches(view, shards_, [rng.integers(0, n, k).tolist() for k in sizes])


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_read_batches_property(tmp_path_factory: pytest.TempPathFactory, data: Any) -> None:
    seed = data.draw(st.integers(0, 2**16))
    block = data.draw(st.sampled_from([1, 3, 8, 64]))
    window = data.draw(st.integers(1, 60))
    stride = data.draw(st.integers(1, window))
    shards_ = sample_shards(seed)
    ds = write_by_hand(tmp_path_factory.mktemp("rb") / "ds", shards_, block)
    view = StreamWithMetadata(ds, window=window, stride=stride)
    n = len(view)
    batches = data.draw(
        st.lists(st.lists(st.integers(0, n - 1), min_size=1, max_size=6), min_size=2, max_size=6)
    )
    assert_batches(view, shards_, batches)


def test_structured_rows_read_several_batches_in_one_round(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A dtype with a per-token field next to the tokens: read_batches reads
    the rows of all its batches in one call (read_batch is never used) and
    splits them into fields once; every batch equals read_batch's and the
    rows written."""
    rng = np.random.default_rng(3)
    dt = [("tokens", "<u2"), ("concept", "<u2")]
    tokens, concepts = [], []
    with Writer(tmp_path / "ds", dt, metadata=True, span_block=8) as w:
        for d in range(6):
            n = 40 + d
            t, c = rng.integers(0, 65_535, n), rng.integers(0, 9, n)
            tokens.append(t)
            concepts.append(c)
            w.write(
                {"tokens": t, "concept": c},
                spans=[(a, min(n, a + 7), b"d%d-%d" % (d, a)) for a in range(0, n, 9)],
            )
    all_t, all_c = np.concatenate(tokens), np.concatenate(concepts)
    view = StreamWithMetadata(tmp_path / "ds", window=13, stride=5)
    batches = [rng.integers(0, len(view), k) for k in (3, 1, 4, 2)]
    expected = [view.read_batch(ix, np.empty) for ix in batches]

    def no_read_batch(*args: Any) -> Any:
        raise AssertionError("read_batches fell back to one read per batch")

    monkeypatch.setattr(view, "read_batch", no_read_batch)
    got = view.read_batches(batches, np.empty)
    for raw, one, ix in zip(got, expected, batches, strict=True):
        assert list(raw) == list(one)  # the same keys in the same order
        for key in (
            "tokens",
            "concept",
            "metadata_positions",
            "metadata_bytes",
            "metadata_offsets",
        ):
            np.testing.assert_array_equal(raw[key], one[key], key)
        assert list(raw["metadata"]) == list(one["metadata"])
        for k, i in enumerate(ix.tolist()):
            np.testing.assert_array_equal(raw["tokens"][k], all_t[i * 5 : i * 5 + 13])
            np.testing.assert_array_equal(raw["concept"][k], all_c[i * 5 : i * 5 + 13])


def test_several_batches_fall_back_where_one_round_cannot_serve(tmp_path: Path) -> None:
    shards_ = sample_shards(4)
    view = StreamWithMetadata(write_by_hand(tmp_path / "ds", shards_, 8), window=9, stride=4)
    assert_batches(view, shards_, [[3], [], [1, 2]])  # an empty batch: one call per batch
    assert view.read_batches([], np.empty) == []
    bs = block_set(view)
    args = (0, len(view), 4, 9, None, np.empty((3, 9), np.int32), np.empty, Scratch())
    with pytest.raises(ValueError, match=r"cuts must rise from above 0 to 3, got \[2, 2, 3\]"):
        bs.read_window_batches(np.arange(3), *args, [2, 2, 3])
    with pytest.raises(ValueError, match=r"cuts must rise from above 0 to 3, got \[1, 2\]"):
        bs.read_window_batches(np.arange(3), *args, [1, 2])
    # indices of any shape are read flat, as read_windows always read them
    pos2, pos1 = np.empty((4, 9), np.int32), np.empty((4, 9), np.int32)
    rows = (0, len(view), 4, 9, None)
    flat = bs.read_windows(np.arange(4), *rows, pos1, np.empty, Scratch())
    square = bs.read_windows(np.arange(4).reshape(2, 2), *rows, pos2, np.empty, Scratch())
    assert flat[0] is pos1 and square[0] is pos2  # the positions given come back
    np.testing.assert_array_equal(pos2, pos1)
    np.testing.assert_array_equal(square[1], flat[1])
    np.testing.assert_array_equal(square[2], flat[2])


@pytest.mark.parametrize(
    ("out", "positions", "error", "message"),
    [
        (None, np.empty((2, 9), np.uint32), ValueError, "positions must be int32, got uint32"),
        (None, np.empty((2, 8), np.int32), ValueError, "positions holds 64 bytes, need 72"),
        (
            None,
            np.frombuffer(bytearray(74), np.int32, count=18, offset=2).reshape(2, 9),
            ValueError,
            "positions must be aligned to 4 bytes (int32); its address is 2 past a multiple of 4",
        ),
        (None, np.empty((2, 10), np.int32), ValueError, "positions holds 80 bytes, need 72"),
        (
            None,
            np.empty((2, 18), np.int32)[:, ::2],
            ValueError,
            "positions must be a writable C-contiguous buffer: ",
        ),
        (
            None,
            np.frombuffer(bytes(72), np.int32),
            ValueError,
            "positions must be a writable C-contiguous buffer: ",
        ),
        (
            None,
            [0] * 18,
            TypeError,
            "positions must be a writable buffer such as a NumPy array, got list",
        ),
        (
            np.empty((2, 8), np.uint16),
            np.empty((2, 9), np.int32),
            ValueError,
            "out holds 32 bytes, need 36",
        ),
        (
            np.empty((2, 18), np.uint16)[:, ::2],
            np.empty((2, 9), np.int32),
            ValueError,
            "out must be a writable C-contiguous buffer: ",
        ),
    ],
    ids=[
        "dtype",
        "short",
        "unaligned",
        "long",
        "strided",
        "read-only",
        "list",
        "out short",
        "out strided",
    ],
)
def test_read_windows_refuses_buffers_it_cannot_fill(
    tmp_path: Path, out: Any, positions: Any, error: type[Exception], message: str
) -> None:
    """The reader writes through the buffers' addresses: each must be a
    writable C-contiguous buffer of the batch's size (positions int32, exactly,
    aligned to 4 bytes), or the call fails before anything is read, naming the argument."""
    shards_ = sample_shards(4)
    view = StreamWithMetadata(write_by_hand(tmp_path / "ds", shards_, 8), window=9, stride=4)
    bs = block_set(view)
    with pytest.raises(error, match=re.escape(message)):
        bs.read_windows(np.arange(2), 0, len(view), 4, 9, out, positions, np.empty, Scratch())
    big = np.zeros((3, 9), np.uint16)  # a larger out is fine: its first rows are filled
    pos = np.empty((2, 9), np.int32)
    bs.read_windows(np.arange(2), 0, len(view), 4, 9, big, pos, np.empty, Scratch())
    tokens, positions_, _ = reference_batch(shards_, 9, 4, [0, 1])
    np.testing.assert_array_equal(big[:2], tokens)
    np.testing.assert_array_equal(pos, positions_)


@pytest.mark.parametrize("layout", ["blocks", "spans"])
def test_read_windows_makes_the_positions_when_given_none(tmp_path: Path, layout: str) -> None:
    """``positions=None``: the compiled reader makes them with ``alloc`` (NumPy's
    C call for ``np.empty``, the allocator's own call otherwise) and returns
    them first, filled as a given array would be; a batch too large to address
    is refused before anything is made."""
    toks = np.arange(400, dtype=np.uint16)
    spans = [(a, a + 7, b"r%d" % a) for a in range(0, 400, 10)]
    with Writer(tmp_path / "ds", "<u2", metadata=True, metadata_layout=layout) as w:
        w.write(toks, spans=spans)
    view = StreamWithMetadata(tmp_path / "ds", window=9, stride=4)
    rs: Any = view.source.spans
    idx = np.array([0, 5, 90, 5])
    mine = np.empty((4, 9), np.int32)
    want = rs.read_windows(idx, 0, len(view), 4, 9, None, mine, np.empty, Scratch())
    assert want[0] is mine
    made: list[tuple[tuple[int, ...], Any]] = []

    def alloc(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
        made.append((shape, np.dtype(dtype)))
        return np.full(shape, 7, dtype)

    for a in (np.empty, alloc):
        got = rs.read_windows(idx, 0, len(view), 4, 9, None, None, a, Scratch())
        pos = got[0]
        assert isinstance(pos, np.ndarray) and pos.dtype == np.int32 and pos.shape == (4, 9)
        assert pos.flags.c_contiguous and pos.flags.aligned and pos.flags.writeable
        np.testing.assert_array_equal(pos, mine)
        np.testing.assert_array_equal(got[1], want[1])
        np.testing.assert_array_equal(got[2], want[2])
    assert made[0] == ((4, 9), np.dtype(np.int32))  # the positions first, then the records
    assert [d for _, d in made[1:]] == [np.dtype(np.int64), np.dtype(np.uint8)]
    made.clear()
    with pytest.raises(ValueError, match=r"^2 windows of 2305843009213693952 rows is too large"):
        rs.read_windows(np.arange(2), 0, len(view), 4, 1 << 61, None, None, alloc, Scratch())
    assert made == []


def test_read_windows_gives_back_the_buffers_it_holds(tmp_path: Path) -> None:
    """The reader holds ``out``, ``positions`` and the records' buffer (buffer
    exports) while C writes into them without the GIL, and gives them back
    after a read, an error in the arguments and a damaged block: an object
    held by a forgotten export could never be resized again."""
    shards_ = [DAMAGE_SHARD]
    ds, msb, _, index = damage_dataset(tmp_path / "ds")
    view = StreamWithMetadata(ds, window=8, stride=8)
    bs = block_set(view)
    out: Any = bytearray(2 * 8 * 2)  # any writable buffer, not only an array
    pos: Any = array.array("i", bytes(2 * 8 * 4))
    made: list[bytearray] = []

    def alloc(shape: tuple[int, ...], dtype: Any) -> Any:  # the records' bytes in a bytearray
        if np.dtype(dtype) != np.uint8:
            return np.empty(shape, dtype)
        made.append(bytearray(shape[0]))
        return made[-1]

    def read(indices: Any, positions: Any = pos) -> Any:
        return bs.read_windows(
            np.asarray(indices), 0, len(view), 8, 8, out, positions, alloc, Scratch()
        )

    def resizable(*objs: Any) -> None:  # each resize raises BufferError while an export lives
        for o in objs:
            o.extend(o[:1])
            del o[-1:]

    got, data, _ = read([0, 2])
    tokens, positions, records = reference_batch(shards_, 8, 8, [0, 2])
    assert got is pos
    assert bytes(out) == tokens.astype("<u2").tobytes()
    assert list(pos) == positions.reshape(-1).tolist()
    assert data is made[-1] and bytes(data) == b"".join(records)
    resizable(out, pos, made[-1])
    with pytest.raises(IndexError):
        read([0, len(view)])
    with pytest.raises(ValueError, match="positions holds"):
        read([0, 2], array.array("i", bytes(4)))
    resizable(out, pos)
    _poke(msb, index[1], 0, 4)  # block 1: no runs
    with pytest.raises(CorruptDataError, match="metadata block 1"):
        read([0, 1])
    resizable(out, pos)


@pytest.mark.parametrize("memory", [True, False], ids=["in-memory", "read"])
def test_a_damaged_block_fails_the_task_that_reads_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, memory: bool
) -> None:
    _memory(monkeypatch, memory)
    ds, msb, _, index = damage_dataset(tmp_path / "ds")
    _poke(msb, index[1] + DAMAGE[0][1], DAMAGE[0][2], DAMAGE[0][3])
    view = StreamWithMetadata(ds, window=8, stride=8)
    full = rf"^{re.escape(str(msb))}: metadata block 1{DAMAGE[0][4]}$"
    with pytest.raises(CorruptDataError, match=full):
        view.read_batches([np.array([0]), np.array([2]), np.array([1, 3])], np.empty)
    assert_batches(view, [DAMAGE_SHARD], [[0], [2, 3], [3]])  # the others still read


def test_the_loader_reads_a_task_in_one_call(tmp_path: Path) -> None:
    """The loader's tasks of several steps go through read_batches, and give the
    batches that tasks of one step give."""
    from tokload import DataLoader

    shards_ = sample_shards(5)
    view = StreamWithMetadata(write_by_hand(tmp_path / "ds", shards_, 8), window=9, stride=4)
    calls: list[int] = []
    many = view.read_batches

    def spy(batches: list[np.ndarray], alloc: Any) -> list[dict[str, Any]]:
        calls.append(len(batches))
        return many(batches, alloc)

    view.read_batches = spy  # type: ignore[method-assign]

    def run(steps: int) -> list[Any]:
        ld = DataLoader(
            view, 3, seed=7, epochs=2, num_threads=2, read=tokload.ReadOptions(steps_per_task=steps)
        )
        out = list(ld)
        ld.close()
        return out

    grouped, calls_grouped = run(5), list(calls)
    calls.clear()
    single = run(1)
    assert calls == [] and max(calls_grouped) == 5
    assert len(grouped) == len(single) == -(-2 * len(view) // 3)
    for a, b in zip(grouped, single, strict=True):
        assert sorted(a) == sorted(b)
        for k in a:
            if k == "metadata":
                assert a[k] == b[k]
            else:
                np.testing.assert_array_equal(a[k].numpy(), b[k].numpy(), k)


@pytest.mark.parametrize("memory", [True, False], ids=["in-memory", "read"])
def test_hint_covers_each_windows_blocks_or_their_index_entries(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, memory: bool
) -> None:
    """One WILLNEED per window per shard it touches: on its blocks where the
    shard's block index table is in memory, else on its index entries (a hint
    loads no table). Bad indices are refused as a read refuses them."""
    _memory(monkeypatch, memory)
    shards_ = sample_shards(6)
    view = StreamWithMetadata(write_by_hand(tmp_path / "ds", shards_, 16), window=40, stride=13)
    bs = block_set(view)
    n = len(view)
    pieces = sum(
        len([k for k in touched(shards_, 40, 13, [i]) if shards_[k].rows]) for i in range(n)
    )
    assert bs.hint_windows(np.arange(n), view._lo, n, 13, 40, Scratch()) == pieces
    assert bs.tables.loaded() == []  # the entries were hinted: nothing read
    view.read(np.arange(n))  # loads the tables (when they are held)
    assert bs.hint_windows(np.arange(n), view._lo, n, 13, 40, Scratch()) == pieces
    assert bs.hint_windows(np.array([], np.int64), view._lo, n, 13, 40, Scratch()) == 0
    assert bs.hint_windows(np.arange(4).reshape(2, 2), view._lo, n, 13, 40, Scratch()) == sum(
        len([k for k in touched(shards_, 40, 13, [i]) if shards_[k].rows]) for i in range(4)
    )
    view.hint([0, n - 1])  # the rows and the metadata
    with pytest.raises(IndexError, match="out of range"):
        view.hint([n])
    assert_batch(view, shards_, [0, n - 1])


def test_hint_on_a_damaged_block_index_gives_no_hint_and_the_read_says_why(
    tmp_path: Path,
) -> None:
    ds, _, mbx, index = damage_dataset(tmp_path / "ds")
    _poke(mbx, 8 * 2, index[1] - 1, 8)
    view = StreamWithMetadata(ds, window=8, stride=8)
    bs = block_set(view)
    assert bs.tables.enabled
    view.read([0])  # loads the table; window 0 needs entries 0 and 1, which check
    assert bs.hint_windows(np.arange(4), view._lo, len(view), 8, 8, Scratch()) == 0
    view.hint([0, 1, 2, 3])  # advice: no error
    with pytest.raises(CorruptDataError, match="block index entry 2"):
        view.read([0, 1, 2, 3])


def test_where_the_index_is_not_held_the_next_hint_covers_the_blocks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The read-ahead's second step (index not held): the windows' blocks,
    one WILLNEED per window per shard it touches, the same ranges as a hint
    with the index held; nothing for shards whose table is held; no hint
    and no error on entries that do not check; a subset's first hint does
    not take its parent's windows for its own."""
    shards_ = sample_shards(6)
    ds = write_by_hand(tmp_path / "ds", shards_, 16)
    held = StreamWithMetadata(ds, window=40, stride=13)
    n = len(held)
    held.read(np.arange(n))  # loads the tables
    expected = block_set(held).hint_windows(np.arange(n), 0, n, 13, 40, Scratch())
    assert expected == sum(
        len([k for k in touched(shards_, 40, 13, [i]) if shards_[k].rows]) for i in range(n)
    )
    assert block_set(held).hint_blocks_after_index(np.arange(n), 0, n, 13, 40, Scratch()) == 0
    _memory(monkeypatch, False)
    view = StreamWithMetadata(ds, window=40, stride=13)
    bs = block_set(view)
    assert not bs.index_in_memory
    assert bs.hint_blocks_after_index(np.arange(n), 0, n, 13, 40, Scratch()) == expected
    assert bs.hint_blocks_after_index(np.array([], np.int64), 0, n, 13, 40, Scratch()) == 0
    with pytest.raises(IndexError, match="out of range"):
        bs.hint_blocks_after_index(np.array([n]), 0, n, 13, 40, Scratch())
    view.hint([n - 1])
    sub = view.subset(0, 2)
    sub.hint([0])  # the parent's window n - 1 is not one of the subset's: skipped
    sub.hint([1])
    view.hint([0])
    assert_batch(view, shards_, [0, n - 1])
    # damaged entries: no hint, no error; the read says why
    ds2, _, mbx, index = damage_dataset(tmp_path / "ds2")
    _poke(mbx, 8 * 2, index[1] - 1, 8)
    bad = StreamWithMetadata(ds2, window=8, stride=8)
    assert block_set(bad).hint_blocks_after_index(np.arange(4), 0, 4, 8, 8, Scratch()) == 0
    bad.hint([0, 1, 2, 3])
    bad.hint([0, 1, 2, 3])
    with pytest.raises(CorruptDataError, match="block index entry 2"):
        bad.read([0, 1, 2, 3])


# ---- 3. the block index in memory or not ------------------------------------


def assert_same_batch(a: StreamWithMetadata, b: StreamWithMetadata, idx: np.ndarray) -> None:
    x, y = a.read(idx), b.read(idx)
    np.testing.assert_array_equal(x.fields["tokens"], y.fields["tokens"])
    np.testing.assert_array_equal(x.positions, y.positions)
    np.testing.assert_array_equal(x.metadata.data, y.metadata.data)
    np.testing.assert_array_equal(x.metadata.offsets, y.metadata.offsets)


def test_index_in_memory_or_not_gives_the_same_batches(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    shards_ = sample_shards(2)
    ds = write_by_hand(tmp_path / "ds", shards_, block=16)
    # held compressed (ctab.h): 8 bytes per group of 64 entries, 2 per entry, a header
    index_bytes = sum(compressed_table_bytes(-(-s.rows // 16) + 1) for s in shards_)
    monkeypatch.delenv("TOKLOAD_INDEX_MEMORY", raising=False)
    held = StreamWithMetadata(ds, window=40, stride=13)
    monkeypatch.setenv("TOKLOAD_INDEX_MEMORY", "0")
    read = StreamWithMetadata(ds, window=40, stride=13)
    assert block_set(held).index_in_memory and not block_set(read).index_in_memory
    # the bound is on the whole dataset's index, inclusive
    monkeypatch.setenv("TOKLOAD_INDEX_MEMORY", str(index_bytes))
    assert block_set(StreamWithMetadata(ds, window=40)).index_in_memory
    monkeypatch.setenv("TOKLOAD_INDEX_MEMORY", str(index_bytes - 1))
    assert not block_set(StreamWithMetadata(ds, window=40)).index_in_memory
    monkeypatch.setenv("TOKLOAD_INDEX_MEMORY", "")  # empty: the default
    assert block_set(StreamWithMetadata(ds, window=40)).index_in_memory

    rng = np.random.default_rng(0)
    for idx in [np.arange(len(held)), *(rng.integers(0, len(held), 7) for _ in range(5))]:
        assert_same_batch(held, read, idx)
        assert_batch(read, shards_, idx.tolist())
    assert block_set(read).tables.loaded() == []  # nothing held, even after reading
    tables = block_set(held).tables  # each table held takes what the budget weighed
    held_bytes = [compressed_table_bytes(-(-shards_[k].rows // 16) + 1) for k in tables.loaded()]
    assert tables.held_bytes() == sum(held_bytes) and len(held_bytes) >= 2


def touched(shards_: Sequence[Shard], window: int, stride: int, idx: Sequence[int]) -> set[int]:
    cum = np.concatenate([[0], np.cumsum([s.rows for s in shards_])]).tolist()
    return {
        k
        for i in idx
        for k in range(len(shards_))
        if cum[k] < i * stride + window and cum[k + 1] > i * stride
    }


def test_tables_are_loaded_for_the_shards_read_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("TOKLOAD_INDEX_MEMORY", raising=False)
    shards_ = sample_shards(3)  # rows 300, 0, 17, 250, 1, 128, 90
    ds = write_by_hand(tmp_path / "ds", shards_, block=16)
    view = StreamWithMetadata(ds, window=20, stride=20)
    tables = block_set(view).tables
    assert tables.loaded() == []  # opening reads nothing
    seen: set[int] = set()
    for idx in ([0], [3], [15], [16, 14], [25, 15], list(range(len(view)))):
        view.read(idx)
        seen |= touched(shards_, 20, 20, idx)
        assert tables.loaded() == sorted(seen), idx
    assert seen == {0, 2, 3, 4, 5, 6}  # all but the empty shard


# entries of a block index as tests meet them: block sizes under 64 KiB, sizes of
# 64 KiB and more, and anything a damaged file may hold (decreasing, past 2**63)
ENTRY_STEPS = st.one_of(
    st.integers(0, 0xFFFF),
    st.sampled_from([0x7FFF, 0x8000, 0xFFFE, 0xFFFF, 0x10000]),  # around the edges
    st.integers(0x10000, 2**40),
    st.integers(-(2**20), -1),
)


# any uint64, the top bit set as often as not (a group's first entry must not be
# taken for the mark of a group kept as it is)
ANY_U64 = st.one_of(st.integers(0, 2**40), st.integers(2**63, 2**64 - 1))
# anywhere, a group's first entry often
AT = st.one_of(st.integers(0, 299), st.sampled_from([0, 64, 128, 192, 256]))


@settings(max_examples=300, deadline=None)
@given(
    steps=st.lists(ENTRY_STEPS, max_size=300),
    first=ANY_U64,
    wild=st.lists(st.tuples(AT, ANY_U64), max_size=3),
    cuts=st.lists(st.tuples(st.integers(0, 320), st.integers(0, 140)), max_size=20),
)
def test_a_compressed_table_decodes_to_its_entries(
    steps: list[int],
    first: int,
    wild: list[tuple[int, int]],
    cuts: list[tuple[int, int]],
) -> None:
    """What ShardTables(compress=True) holds per shard (ctab.h) gives back every
    entry exactly, damage included, in any range; it takes 2 bytes an entry and
    8 per group of 64, and 512 bytes more for each group kept as it is (a step
    over 65535, modulo 2**64, or a first entry with the top bit set)."""
    entries = np.array([first, *steps], dtype=object).cumsum() % 2**64
    for at, v in wild:  # any value anywhere
        if at < len(entries):
            entries[at] = v
    e = entries.astype(np.uint64)
    t = CompressedTable(e)
    n = len(e)
    np.testing.assert_array_equal(t.decode(0, n), e)
    np.testing.assert_array_equal([t.decode(j, 1)[0] for j in range(n)], e)  # each alone
    for a, m in cuts:
        if a + m <= n:
            np.testing.assert_array_equal(t.decode(a, m), e[a : a + m])
        else:
            with pytest.raises(IndexError, match=rf"entries \[{a}, {a + m}\) of a table of {n}"):
                t.decode(a, m)
    ints = [int(x) for x in e]
    full = sum(
        1
        for g in range(0, n, 64)
        if ints[g] >= 2**63
        or any((ints[j] - ints[j - 1]) % 2**64 > 0xFFFF for j in range(g + 1, min(g + 64, n)))
    )
    assert t.full_groups == full
    assert t.nbytes == compressed_table_bytes(n) + 512 * full
    assert compressed_table_bytes(n) == 40 + 8 * -(-n // 64) + 2 * n


def test_a_block_index_of_4tb_is_held_in_about_1gb() -> None:
    """The arithmetic the budget uses, on the corpus tokload is built for:
    4 TB of uint16 tokens in 2,000 shards of 10^9 rows, 4,096 rows a block."""
    per_shard = -(-(10**9) // 4096) + 1
    held = 2000 * compressed_table_bytes(per_shard)
    assert 2000 * per_shard * 8 > 3.9e9  # the .mbx files
    assert held < DEFAULT_INDEX_MEMORY  # fits the default budget
    assert abs(held / (2000 * per_shard) - 2.125) < 0.001


def test_blocks_of_64_kib_and_more_read_the_same_held_or_not(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Records big enough that blocks pass 64 KiB: their groups of the held
    table keep their entries as they are, and batches are the same as with
    the entries read from the file."""
    rng = np.random.default_rng(5)
    docs: list[Doc] = []
    for i in range(30):
        tokens = rng.integers(0, 60000, int(rng.integers(20, 200))).astype(np.uint16)
        size = 70_000 if i % 4 == 0 else int(rng.integers(1, 40))
        spans = [(0, len(tokens) // 2, bytes([i % 251]) * size)]
        docs.append((tokens, spans))
    ds = write_docs(tmp_path / "ds", docs=docs, block=16)
    monkeypatch.delenv("TOKLOAD_INDEX_MEMORY", raising=False)
    held = StreamWithMetadata(ds, window=40, stride=7)
    monkeypatch.setenv("TOKLOAD_INDEX_MEMORY", "0")
    read = StreamWithMetadata(ds, window=40, stride=7)
    assert block_set(held).index_in_memory and not block_set(read).index_in_memory
    for idx in [np.arange(len(held)), *(rng.integers(0, len(held), 5) for _ in range(10))]:
        assert_same_batch(held, read, idx)
    tables = block_set(held).tables
    entries = [len(np.fromfile(p, "<u8")) for p in sorted(ds.glob("*.mbx"))]
    least = sum(compressed_table_bytes(entries[k]) for k in tables.loaded())
    assert tables.held_bytes() >= least + 512  # a group at least kept as it is
    for k in tables.loaded():
        mbx = sorted(ds.glob("*.mbx"))[k]
        e = np.fromfile(mbx, "<u8")
        np.testing.assert_array_equal(CompressedTable(e).decode(0, len(e)), e)


@pytest.mark.parametrize("value", ["abc", "-1", "1.5"])
def test_bad_index_memory_setting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    ds = write_by_hand(tmp_path / "ds", sample_shards()[:1], block=16)
    monkeypatch.setenv("TOKLOAD_INDEX_MEMORY", value)
    message = f"TOKLOAD_INDEX_MEMORY={value!r}: expected a number of bytes (>= 0)"
    with pytest.raises(ValueError, match=re.escape(message)):
        StreamWithMetadata(ds, window=4)


# ---- 4. threads -------------------------------------------------------------


Batch = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]


def _as_tuple(view: StreamWithMetadata, idx: np.ndarray) -> Batch:
    b = view.read(idx)
    return b.fields["tokens"], b.positions, b.metadata.data, b.metadata.offsets


def read_in_threads(view: StreamWithMetadata, plans: list[list[np.ndarray]]) -> list[list[Batch]]:
    """Thread ``k`` reads the batches of ``plans[k]``, all threads at once."""
    start = threading.Barrier(len(plans))
    got: list[list[Batch]] = [[] for _ in plans]
    errors: list[BaseException] = []

    def reader(k: int) -> None:
        try:
            start.wait()
            got[k] += [_as_tuple(view, idx) for idx in plans[k]]
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=reader, args=(k,)) for k in range(len(plans))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    return got


@pytest.mark.parametrize("memory", [True, False], ids=["in-memory", "read"])
def test_threads_read_the_same_batches(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, memory: bool
) -> None:
    """Four threads read random batches of one fresh view at once (the shards'
    tables load concurrently, each thread with its own Scratch); every batch
    equals the one a single thread reads."""
    rng = np.random.default_rng(4)
    shards_ = [random_shard(rng, int(rng.integers(40, 400)), nrec=6) for _ in range(24)]
    ds = write_by_hand(tmp_path / "ds", shards_, block=8)
    _memory(monkeypatch, memory)
    single = StreamWithMetadata(ds, window=33, stride=19)
    n = len(single)
    plans = [[rng.integers(0, n, 16) for _ in range(25)] for _ in range(4)]
    want = [[_as_tuple(single, idx) for idx in plan] for plan in plans]
    everything = np.concatenate([i for plan in plans for i in plan]).tolist()
    for _ in range(3):  # fresh tables each round
        view = StreamWithMetadata(ds, window=33, stride=19)
        assert block_set(view).index_in_memory == memory
        got = read_in_threads(view, plans)
        for k in range(4):
            assert len(got[k]) == len(plans[k])
            for w, g in zip(want[k], got[k], strict=True):
                for x, y in zip(w, g, strict=True):
                    np.testing.assert_array_equal(x, y)
        loaded = sorted(touched(shards_, 33, 19, everything)) if memory else []
        assert block_set(view).tables.loaded() == loaded


# ---- 5. damaged blocks and block indexes ------------------------------------

# One shard of 32 rows in blocks of 8; block 1 (rows 8-15) has runs at 0, 2, 5
# with records 1, 2, 0: three distinct records, 3 + 5 + 4 bytes.
DAMAGE_SHARD = Shard(
    np.arange(32),
    [0, 3, 5, 8, 10, 13, 20, 27],
    [0, NONE, 1, 1, 2, 0, NONE, 2],
    [b"rec", b"one!!", b"2two"],
)
# the same layout byte for byte, but block 1's records in order (1, 2, 3): the
# reader's quick check, not the full one, meets its damage first
DAMAGE_SHARD_IN_ORDER = Shard(
    np.arange(32),
    [0, 3, 5, 8, 10, 13, 20, 27],
    [0, NONE, 1, 1, 2, 3, NONE, 2],
    [b"rec", b"one!!", b"2two", b"thr"],
)


def damage_dataset(root: Path, shard: Shard = DAMAGE_SHARD) -> tuple[Path, Path, Path, list[int]]:
    ds = write_by_hand(root, [shard], block=8)
    msb, mbx = ds / "s00.msb", ds / "s00.mbx"
    index = np.fromfile(mbx, "<u8").tolist()
    at = index[1]
    third = 0 if shard is DAMAGE_SHARD else 3
    assert struct.unpack_from("<I3H3I3I", msb.read_bytes(), at) == (
        (3, 0, 2, 5, 1, 2, third, 5, 9, 12)
    )
    return ds, msb, mbx, index


def _poke(path: Path, offset: int, value: int, size: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(value.to_bytes(size, "little"))


COUNTS = "its counts and its size disagree"
STARTS = "starts must be 0, then increase, and stay below the block's 8 rows"
# (what, byte offset in block 1, new value, its size, the message after the
# block's name); block 1 holds nruns at +0, start[3] at +4, record[3] at +10,
# end[3] at +22 and its 12 bytes of data at +34 (46 bytes). NREC: the shard's
# number of records.
NREC = -1
DAMAGE = [
    ("nruns 0", 0, 0, 4, rf": {COUNTS} \(0 against 8\)"),
    ("nruns past the rows", 0, 9, 4, rf": {COUNTS} \(9 against 8\)"),
    ("nruns past the size", 0, 8, 4, rf": {COUNTS} \(8 against 8\)"),
    ("start[0] not 0", 4, 1, 2, f" has a run starting at row 1: {STARTS}"),
    ("start repeats", 6, 0, 2, f" has a run starting at row 0: {STARTS}"),
    ("start decreases", 8, 1, 2, f" has a run starting at row 1: {STARTS}"),
    ("start past the block", 8, 8, 2, f" has a run starting at row 8: {STARTS}"),
    (
        "record past the shard's",
        18,
        NREC,
        4,
        " refers to record {nrec}, but the shard has {nrec} metadata records",
    ),
    ("ends decrease", 22, 10, 4, ": a record ends at byte 9, before the previous one's end 10"),
    ("data past the ends", 30, 11, 4, rf": {COUNTS} \(46 against 45\)"),
    ("ends past the data", 30, 13, 4, rf": {COUNTS} \(46 against 47\)"),
]
# blocks of 38 (runs 0, 3, 5; 8 bytes), 46, 23 (runs 13, 20; 3 bytes) and 24 bytes
BREAKS = r"breaks 0 = first <= \.\.\. <= last = 131 \(the \.msb size\)"
# (what, block index entry, its new value from the sound index)
INDEX_DAMAGE: list[tuple[str, int, Callable[[list[int]], int]]] = [
    ("entry out of order", 2, lambda ix: ix[1] - 1),
    ("first entry not 0", 0, lambda ix: 1),
    ("entry past the end", 1, lambda ix: 10**6),
    ("last entry short of the end", 4, lambda ix: ix[4] - 1),
    ("entry past 2**63", 2, lambda ix: 2**63 + ix[2]),  # held: its group kept as it is
]


@pytest.mark.parametrize("shard", [DAMAGE_SHARD, DAMAGE_SHARD_IN_ORDER], ids=["unsorted", "sorted"])
@pytest.mark.parametrize("memory", [True, False], ids=["in-memory", "read"])
@pytest.mark.parametrize(
    ("what", "at", "value", "size", "message"), DAMAGE, ids=[d[0] for d in DAMAGE]
)
def test_damaged_blocks_name_the_file_and_block(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    shard: Shard,
    memory: bool,
    what: str,
    at: int,
    value: int,
    size: int,
    message: str,
) -> None:
    """Each damage of block 1, whose records are out of order (the full check
    meets it) or in order (the quick check must refuse it first)."""
    _memory(monkeypatch, memory)
    ds, msb, _, index = damage_dataset(tmp_path / "ds", shard)
    assert verify(ds) == []
    nrec = len(shard.payloads)
    _poke(msb, index[1] + at, nrec if value == NREC else value, size)
    message = message.replace("{nrec}", str(nrec))
    view = StreamWithMetadata(ds, window=8, stride=8)
    assert block_set(view).index_in_memory == memory
    full = rf"^{re.escape(str(msb))}: metadata block 1{message}$"
    for idx in ([0, 1, 2, 3], [1], [3, 1]):
        with pytest.raises(CorruptDataError, match=full) as e:
            view.read(idx)
    # a block stands alone: the others still read
    assert_batch(view, [shard], [0, 2, 3])
    assert verify(ds) == [str(e.value)]  # verify decodes the blocks: the same message


@pytest.mark.parametrize("memory", [True, False], ids=["in-memory", "read"])
@pytest.mark.parametrize(("what", "entry", "value"), INDEX_DAMAGE, ids=[d[0] for d in INDEX_DAMAGE])
def test_damaged_block_index_names_the_file_and_entry(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    memory: bool,
    what: str,
    entry: int,
    value: Callable[[list[int]], int],
) -> None:
    _memory(monkeypatch, memory)
    ds, msb, mbx, index = damage_dataset(tmp_path / "ds")
    assert index == [0, 38, 84, 107, 131] and msb.stat().st_size == 131
    v = value(index)
    _poke(mbx, 8 * entry, v, 8)
    view = StreamWithMetadata(ds, window=8, stride=8)
    message = rf"^{re.escape(str(mbx))}: block index entry {entry} = {v} {BREAKS}$"
    with pytest.raises(CorruptDataError, match=message) as e:
        view.read([0, 1, 2, 3])
    assert verify(ds) == [str(e.value)]


def test_verify_passes_a_sound_dataset(tmp_path: Path) -> None:
    assert verify(write_by_hand(tmp_path / "hand", sample_shards(), block=5)) == []
    assert verify(write_docs(tmp_path / "writer", n=6, shard_bytes=5000)) == []


# ---- 6. I/O errors ----------------------------------------------------------

IO = ["sync", "threads", "uring"]


def _io_view(ds: Path, io: str) -> StreamWithMetadata:
    if io == "uring" and not uring_available():
        pytest.skip("io_uring is not available here")
    view = StreamWithMetadata(ds, window=64, stride=64)
    view.configure_io(io=io)
    return view


def io_dataset(root: Path) -> tuple[Path, list[Shard]]:
    shards_ = [random_shard(np.random.default_rng(5), 640, nrec=9)]
    return write_by_hand(root, shards_, block=32), shards_


@pytest.mark.parametrize("io", IO)
@pytest.mark.parametrize("memory", [True, False], ids=["in-memory", "read"])
@pytest.mark.parametrize(
    ("suffix", "what"),
    [
        (".rows", r"rows \[64, 128\) \(128 bytes at offset 128\)"),
        # windows 1 and 2 are blocks 2 to 5: the first read is window 1's blocks
        (".msb", r"the metadata blocks \({blocks} bytes at offset {at}\)"),
        # and without the index in memory, window 1's entries 2 to 4
        (".mbx", r"the metadata block index \(24 bytes at offset 16\)"),
    ],
    ids=["rows", "msb", "mbx"],
)
def test_io_errors_name_the_file_and_what_was_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, io: str, memory: bool, suffix: str, what: str
) -> None:
    _memory(monkeypatch, memory)
    ds, shards_ = io_dataset(tmp_path / "ds")
    index = np.fromfile(ds / "s00.mbx", "<u8").tolist()
    what = what.format(blocks=index[4] - index[2], at=index[2])
    view = _io_view(ds, io)
    assert block_set(view).index_in_memory == memory
    assert_batch(view, shards_, list(range(len(view))))  # every file opened and read once
    path = ds / f"s00{suffix}"
    os.truncate(path, 0)
    if suffix == ".mbx" and memory:
        # by design: the table is in memory once loaded, the file is not read again
        assert_batch(view, shards_, [1, 2])
        return
    message = rf"^{re.escape(str(path))}: file ended at byte \d+ while reading {what}; was it"
    with pytest.raises(TruncatedFileError, match=message):
        view.read([1, 2])  # window 1 is the first the rows' error can name


@pytest.mark.parametrize("io", IO)
def test_block_index_that_shrank_before_its_table_loads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, io: str
) -> None:
    _memory(monkeypatch, True)
    ds, _ = io_dataset(tmp_path / "ds")
    view = _io_view(ds, io)  # opened (sizes checked), never read
    mbx = ds / "s00.mbx"
    os.truncate(mbx, 0)
    what = r"the metadata block index \(168 bytes at offset 0\)"  # the whole table: 21 values
    message = rf"^{re.escape(str(mbx))}: file ended at byte 0 while reading {what}; was it"
    for _ in range(2):  # a failed load publishes nothing: the next read tries again
        with pytest.raises(TruncatedFileError, match=message):
            view.read([1, 2])
        assert block_set(view).tables.loaded() == []


# ---- 7. manifest rules ------------------------------------------------------


Doc = tuple[np.ndarray, list[tuple[int, int, bytes]]]


def make_docs(n: int, seed: int = 0) -> list[Doc]:
    """Documents of 1 to 299 tokens, most rows in spans of their own records."""
    rng = np.random.default_rng(seed)
    docs: list[Doc] = []
    for k in range(n):
        size = int(rng.integers(1, 300))
        cuts = sorted(set(rng.integers(0, size, 6).tolist()) | {0, size})
        spans = [
            (a, z, b"d%d:%d" % (k, a)) for a, z in itertools.pairwise(cuts) if rng.random() < 0.7
        ]
        docs.append((rng.integers(0, 65_535, size), spans))
    return docs


def write_docs(
    path: Path, n: int = 40, block: int | None = None, docs: list[Doc] | None = None, **kw: Any
) -> Path:
    with Writer(path, "<u2", metadata=True, metadata_layout="blocks", span_block=block, **kw) as w:
        for tokens, spans in make_docs(n) if docs is None else docs:
            w.write(tokens, spans=spans)
    return path


def _patch_manifest(ds: Path, patch: dict[str, Any]) -> None:
    man = json.loads((ds / "manifest.json").read_text())
    (ds / "manifest.json").write_text(json.dumps({**man, **patch}))


@pytest.mark.parametrize(
    ("patch", "message"),
    [
        ({"version": 2}, r"'metadata_layout' \"blocks\" needs version 3, got version 2"),
        ({"version": 1, "metadata_layout": "blocks"}, r"needs a '<u4' field 'metadata_id'"),
        ({"span_block": 0}, r"span_block must be positive, got 0"),
        (
            {"span_block": 65_537},
            r"span_block must be in \[1, 65536\] for metadata blocks, got 65537",
        ),
        ({"span_block": None}, r"span_block must be a non-negative integer, got None"),
        (
            {"dtype": [["tokens", "<u2"], ["metadata_id", "<u4"]]},
            r"a dataset whose metadata is in blocks has no 'metadata_id' field",
        ),
    ],
)
def test_bad_version_3_manifests(tmp_path: Path, patch: dict[str, Any], message: str) -> None:
    ds = write_docs(tmp_path / "ds", n=4)
    _patch_manifest(ds, patch)
    with pytest.raises(FormatError, match=rf"^{re.escape(str(ds / 'manifest.json'))}.*{message}"):
        StreamWithMetadata(ds, window=8)


@pytest.mark.parametrize(
    ("suffix", "what", "delta"),
    [
        (".msb", "metadata blocks", -1),
        (".msb", "metadata blocks", 1),
        (".mbx", "metadata block index", -8),
        (".mbx", "metadata block index", 8),
    ],
)
def test_wrong_file_sizes_are_refused_at_open(
    tmp_path: Path, suffix: str, what: str, delta: int
) -> None:
    ds = write_docs(tmp_path / "ds", n=4)
    path = ds / (read_manifest(ds).shards[0].name + suffix)
    size = path.stat().st_size
    os.truncate(path, size + delta)
    message = f"{path}: {what} is {size + delta} bytes but the manifest implies {size}"
    with pytest.raises(FormatError, match=f"^{re.escape(message)}$"):
        StreamWithMetadata(ds, window=8)


def test_writer_refuses_too_large_a_block(tmp_path: Path) -> None:
    with pytest.raises(
        ValueError, match=r"span_block must be at most 65536 for metadata blocks, got 65537"
    ):
        Writer(tmp_path / "a", "<u2", metadata=True, metadata_layout="blocks", span_block=65_537)
    assert not (tmp_path / "a" / "manifest.json").exists()
    # the largest block is fine
    ds = write_docs(tmp_path / "b", n=3, block=65_536)
    assert read_manifest(ds).span_block == 65_536


def test_manifest_is_version_3_with_checksums_of_the_blocks(tmp_path: Path) -> None:
    ds = write_docs(tmp_path / "ds", n=40, shard_bytes=6000)
    man = json.loads((ds / "manifest.json").read_text())
    assert man["version"] == 3 and man["metadata_layout"] == "blocks" and man["span_block"] == 4096
    assert len(man["shards"]) > 1
    for s in man["shards"]:
        assert sorted(s["xxh3_64"]) == ["docs", "mbx", "msb", "rows"]
        assert s["metadata_bytes"] == (ds / f"{s['name']}.msb").stat().st_size
        assert "metadata_runs" not in s or s["metadata_runs"] == 0
        for ext in ("mdx", "mdb", "mds", "msx"):
            assert not (ds / f"{s['name']}.{ext}").exists()
    assert verify_checksums(ds) == []
    msb = ds / f"{man['shards'][1]['name']}.msb"
    data = bytearray(msb.read_bytes())
    data[len(data) // 2] ^= 0x40
    msb.write_bytes(bytes(data))
    (problem,) = verify_checksums(ds)
    assert problem.startswith(f"{msb}: damaged: its xxh3_64 is ")
    assert problem.endswith(f"the manifest records {man['shards'][1]['xxh3_64']['msb']}")


def test_append_and_merge_keep_the_blocks(tmp_path: Path) -> None:
    """Appending takes the block from the manifest; merged blocks datasets read
    as the same data written in one go (every span is a record of its own,
    so the shards do not change the batches)."""
    docs = make_docs(60, seed=1)
    whole = write_docs(tmp_path / "whole", docs=docs, block=16, shard_bytes=4000)
    a = write_docs(tmp_path / "a", docs=docs[:20], block=16, shard_bytes=3000)
    with Writer(a, "<u2", metadata=True, mode="a") as w:  # layout and block from the manifest
        for tokens, spans in docs[20:35]:
            w.write(tokens, spans=spans)
    b = write_docs(tmp_path / "b", docs=docs[35:], block=16)
    m = read_manifest(a)
    assert (m.version, m.metadata_layout, m.span_block) == (3, "blocks", 16)
    merged_ = tmp_path / "m"
    merge(merged_, [a, b])
    assert verify(merged_) == [] and verify_checksums(merged_) == []
    x = StreamWithMetadata(whole, window=70, stride=23)
    y = StreamWithMetadata(merged_, window=70, stride=23)
    idx = np.arange(len(x))
    assert len(y) == len(x)
    bx, by = x.read(idx), y.read(idx)
    np.testing.assert_array_equal(bx.fields["tokens"], by.fields["tokens"])
    np.testing.assert_array_equal(bx.positions, by.positions)
    np.testing.assert_array_equal(bx.metadata.data, by.metadata.data)
    np.testing.assert_array_equal(bx.metadata.offsets, by.metadata.offsets)
    # a block given that is not the dataset's is refused, not silently replaced
    with pytest.raises(FormatError, match=r"cannot append with span_block=8 to a dataset of span_"):
        Writer(a, "<u2", metadata=True, mode="a", span_block=8)
    Writer(a, "<u2", metadata=True, mode="a", span_block=16).close()  # the same: taken
    assert read_manifest(a).span_block == 16 and verify(a) == []
    c = write_docs(tmp_path / "c", docs=docs[:2], block=9)
    with pytest.raises(
        FormatError, match=r"\(layout \('blocks', 9\)\) differs from .*\(layout \('blocks', 16\)\)"
    ):
        merge(tmp_path / "m2", [a, c])


# ---- 8. the writer's hidden files -------------------------------------------


def hidden(ds: Path) -> list[str]:
    return sorted(
        p.name for p in ds.iterdir() if p.name.startswith(".") and p.name.endswith(".tmp")
    )


def test_no_hidden_files_after_close(tmp_path: Path) -> None:
    ds = write_docs(tmp_path / "ds", n=40, shard_bytes=3000, block=64)
    assert len(read_manifest(ds).shards) > 3
    assert hidden(ds) == []


def test_no_hidden_files_after_an_error_in_the_block(tmp_path: Path) -> None:
    ds = tmp_path / "ds"
    with (
        pytest.raises(RuntimeError, match="stop"),
        Writer(
            ds, "<u2", metadata=True, metadata_layout="blocks", span_block=8, shard_bytes=500
        ) as w,
    ):
        for k in range(10):
            w.write(np.arange(100), spans=[(k, k + 5, b"r%d" % k)])
        assert hidden(ds) != []  # the open shard's runs and records
        raise RuntimeError("stop")
    assert hidden(ds) == []
    view = StreamWithMetadata(ds, window=100, stride=100)
    assert len(view) == 10  # what was written is published
    b = view.read([9])
    assert b.metadata.raw(0) == b"r9" and b.positions[0].tolist() == [-1] * 9 + [0] * 5 + [-1] * 86
    # the writer's own error, mid-way, too
    ds2 = tmp_path / "ds2"
    with (
        pytest.raises(ValueError, match="overlaps another span"),
        Writer(ds2, "<u2", metadata=True, metadata_layout="blocks", span_block=8) as w,
    ):
        w.write(np.arange(10), spans=[(0, 5, b"x")])
        w.write(np.arange(10), spans=[(0, 5, b"x"), (4, 6, b"y")])
    assert hidden(ds2) == []
    assert len(StreamWithMetadata(ds2, window=10)) == 1


def test_manifest_never_lists_the_hidden_files(tmp_path: Path) -> None:
    """A crash while a shard is open (simulated by looking while the writer is
    open) leaves a manifest that lists whole shards only, no hidden file."""
    ds = tmp_path / "ds"
    w = Writer(ds, "<u2", metadata=True, metadata_layout="blocks", span_block=8, name_prefix="p")
    try:
        w.write(np.arange(50), spans=[(0, 10, b"first")])
        w.flush()  # shard p-00000 published
        w.write(np.arange(70), spans=[(5, 30, b"second")])  # shard p-00001 open
        # the runs and records wait in hidden files; the rows and documents do not
        assert hidden(ds) == [f".p-00001.{ext}.tmp" for ext in ("mdb", "mds", "mdx")]
        assert sorted(p.name for p in ds.iterdir() if not p.name.startswith(".")) == [
            "manifest.json",
            *(f"p-00000.{e}" for e in ("docs", "mbx", "msb", "rows")),
            "p-00001.docs",
            "p-00001.rows",
        ]
        text = (ds / "manifest.json").read_text()
        assert ".tmp" not in text and "p-00001" not in text
        man = json.loads(text)
        assert [s["name"] for s in man["shards"]] == ["p-00000"]
        assert sorted(man["shards"][0]["xxh3_64"]) == ["docs", "mbx", "msb", "rows"]
        assert verify(ds) == [] and verify_checksums(ds) == []
        view = StreamWithMetadata(ds, window=50)
        assert len(view) == 1 and view.read([0]).metadata.raw(0) == b"first"
    finally:
        w.close()
    assert hidden(ds) == []
    assert [s.name for s in read_manifest(ds).shards] == ["p-00000", "p-00001"]


# ---- 9. storage -------------------------------------------------------------


def test_blocks_cost_under_a_tenth_of_the_tokens_and_less_than_a_span_table(tmp_path: Path) -> None:
    """One 8-byte record per 100 uint16 tokens, documents of 2048 tokens, every
    token in a span: the blocks cost at most 10% of the rows' bytes (FORMAT.md
    says about 9.4%) and less than the span table layout's four files."""
    rng = np.random.default_rng(9)
    sizes: dict[str, dict[str, int]] = {}
    for layout in ("blocks", "spans"):
        ds = tmp_path / layout
        with Writer(ds, "<u2", metadata=True, metadata_layout=layout) as w:
            for k in range(64):
                spans = [
                    (a, min(a + 100, 2048), b"%08d" % (k * 100 + a // 100))
                    for a in range(0, 2048, 100)
                ]
                w.write(rng.integers(0, 65_535, 2048), spans=spans)
        sizes[layout] = {}
        for p in ds.iterdir():
            sizes[layout][p.suffix] = sizes[layout].get(p.suffix, 0) + p.stat().st_size
    b, s = sizes["blocks"], sizes["spans"]
    assert b[".rows"] == s[".rows"] == 64 * 2048 * 2
    meta_blocks = b[".msb"] + b[".mbx"]
    meta_spans = s[".mds"] + s[".msx"] + s[".mdx"] + s[".mdb"]
    assert meta_blocks <= 0.10 * b[".rows"]
    assert meta_blocks < meta_spans
    assert 0.09 * b[".rows"] < meta_blocks  # the bound is not empty: ~9.4% here


def test_verify_names_a_record_whose_copies_differ(tmp_path: Path) -> None:
    """FORMAT.md: a record's bytes are the same in every block where it appears.
    A reader takes the first copy it meets; ``tokload verify`` compares them."""
    ds = tmp_path / "ds"
    with Writer(ds, "<u2", metadata=True, span_block=4) as w:
        w.write(np.arange(12), spans=[(2, 9, b"PAYLOAD!"), (10, 12, b"other")])
    shard = read_manifest(ds).shards[0].name
    msb = ds / f"{shard}.msb"
    data = bytearray(msb.read_bytes())
    assert data.count(b"PAYLOAD!") == 3  # in blocks 0, 1 and 2
    second = data.index(b"PAYLOAD!", data.index(b"PAYLOAD!") + 1)
    assert verify(ds) == []
    data[second] ^= 1
    msb.write_bytes(bytes(data))
    assert verify(ds) == [
        f"{msb}: metadata block 1: record 0 has other bytes than where it appears first"
    ]


def test_verify_needs_memory_for_the_records_used_not_the_manifests_count(
    tmp_path: Path,
) -> None:
    """In layout "blocks" no file's size follows ``metadata_records``: a damaged
    count must not make ``verify`` allocate for it."""
    ds = tmp_path / "ds"
    with Writer(ds, "<u2", metadata=True, span_block=8) as w:
        w.write(np.arange(20), spans=[(0, 5, b"a"), (5, 20, b"b")])
    man = json.loads((ds / "manifest.json").read_text())
    man["shards"][0]["metadata_records"] = 4_000_000_000  # 32 GB of tables, were they sized by it
    (ds / "manifest.json").write_text(json.dumps(man))
    assert verify(ds) == []
    view = StreamWithMetadata(ds, window=20)
    assert list(view[0].metadata) == [b"a", b"b"]


def test_a_shard_that_fails_to_encode_leaves_nothing_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tokload import shardfiles

    def broken(*args: Any) -> Any:
        raise ValueError("the encoder failed")

    ds = tmp_path / "ds"
    monkeypatch.setattr(shardfiles, "encode_blocks", broken)
    with (
        pytest.raises(ValueError, match="the encoder failed"),
        Writer(ds, "<u2", metadata=True) as w,
    ):
        w.write(np.arange(10), spans=[(0, 10, b"x")])
    assert sorted(p.name for p in ds.iterdir()) == ["manifest.json"]  # an empty dataset
    assert read_manifest(ds).shards == []


def test_convert_re_blocks(tmp_path: Path) -> None:
    src = tmp_path / "src"
    with Writer(src, "<u2", metadata=True, span_block=16) as w:
        for k in range(20):
            w.write(np.arange(37) + k, spans=[(0, 10, b"a%d" % k), (12, 37, b"b%d" % k)])
    with pytest.raises(
        FormatError, match="already has layout 'blocks' with span_block 16; nothing to convert"
    ):
        convert(src, tmp_path / "same", "blocks", span_block=16)
    convert(src, tmp_path / "dst", "blocks", span_block=5)
    assert read_manifest(tmp_path / "dst").span_block == 5
    a = StreamWithMetadata(src, window=29, stride=11)
    b = StreamWithMetadata(tmp_path / "dst", window=29, stride=11)
    x, y = a.read(np.arange(len(a))), b.read(np.arange(len(b)))
    np.testing.assert_array_equal(x.positions, y.positions)
    assert list(x.metadata) == list(y.metadata)


def test_a_convert_that_fails_leaves_nothing_in_the_way_of_a_retry(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The shards a failed convert had finished stayed in ``dst`` (no manifest), and the
    retry failed on them with FileExistsError."""
    from tokload import derive

    src, dst = tmp_path / "src", tmp_path / "dst"
    with Writer(src, "<u2", metadata=True, shard_bytes=100) as w:
        for k in range(3):  # three shards
            w.write(np.arange(50, dtype=np.uint16), spans=[(0, 5, b"r%d" % k)])
    assert len(read_manifest(src).shards) == 3
    real, calls = derive._convert_shard, []

    def third_fails(*args: Any) -> Any:
        calls.append(1)
        if len(calls) == 3:
            raise OSError(28, "No space left on device")
        return real(*args)

    monkeypatch.setattr(derive, "_convert_shard", third_fails)
    with pytest.raises(OSError, match="No space left"):
        convert(src, dst, "spans")
    assert list(dst.iterdir()) == []
    monkeypatch.setattr(derive, "_convert_shard", real)
    convert(src, dst, "spans")  # the retry
    a, b = (StreamWithMetadata(p, window=7) for p in (src, dst))
    assert list(a.read(np.arange(len(a))).metadata) == list(b.read(np.arange(len(b))).metadata)


def test_convert_refuses_a_special_file_in_the_source_before_reading(tmp_path: Path) -> None:
    """A FIFO in a source file's place blocked convert forever (it read the files
    with plain ``np.fromfile``, without the checks every reader makes)."""
    src = tmp_path / "src"
    with Writer(src, "<u2", metadata=True, shard_bytes=100) as w:
        for k in range(2):
            w.write(np.arange(50, dtype=np.uint16), spans=[(0, 5, b"r%d" % k)])
    mbx = sorted(src.glob("*.mbx"))[1]
    mbx.unlink()
    os.mkfifo(mbx)
    with no_hang(20), pytest.raises(FormatError, match=r"\.mbx: .*is a FIFO, not a regular file"):
        convert(src, tmp_path / "dst", "spans")
    assert not (tmp_path / "dst").exists()
