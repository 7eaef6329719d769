"""Streams with metadata in every layout (FORMAT.md): metadata blocks per shard
(version 3), a span table per shard (version 2) and a ``metadata_id`` in every
row (version 1).

Every window is checked against a pure-Python reference built from the
documents and spans as written; the two layouts of the same data, and the
conversions between them, give the same batches bit for bit through the
DataLoader; damaged span tables raise CorruptDataError naming the file.

A ``Blend`` of streams with metadata (of the three layouts, nested too) gives each
row its sample's tokens and records, the batch's records distinct and in order of
first appearance, and through the DataLoader every position once across a resume on
another world size; streams of another window, fields or ``deserialize`` are refused.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from harness import Segment, assert_exactly_once, run_segments
from hypothesis import given, settings
from hypothesis import strategies as st

import tokload
from tokload import DataLoader, StreamWithMetadata, Writer
from tokload.derive import convert, merge
from tokload.errors import CorruptDataError, FormatError
from tokload.format import read_manifest
from tokload.views import RecordList

Doc = tuple[np.ndarray, list[tuple[int, int, bytes]]]


def make_docs(seed: int, ndocs: int = 120, maxlen: int = 300) -> list[Doc]:
    rng = np.random.default_rng(seed)
    docs: list[Doc] = []
    for k in range(ndocs):
        n = int(rng.integers(0, maxlen))
        spans: list[tuple[int, int, bytes]] = []
        pos = 0
        while pos < n:
            a = pos + int(rng.integers(0, 6))
            b = min(n, a + int(rng.integers(1, 40)))
            if a >= n:
                break
            spans.append((a, b, b"%d:%d" % (k, a) * int(rng.integers(0, 3))))  # some empty
            pos = b
        docs.append((rng.integers(0, 65535, n).astype(np.uint16), spans))
    return docs


def write(path: Path, docs: list[Doc], layout: str, **kw: Any) -> Path:
    per_token = layout == "per_token"
    dtype: Any = [("tokens", "<u2"), ("metadata_id", "<u4")] if per_token else "<u2"
    with Writer(path, dtype, metadata=True, metadata_layout=layout, **kw) as w:
        for toks, spans in docs:
            w.write({"tokens": toks} if per_token else toks, spans=spans)
    return path


def reference(docs: list[Doc]) -> tuple[np.ndarray, list[bytes | None]]:
    toks = np.concatenate([t for t, _ in docs])
    recs: list[bytes | None] = []
    for t, spans in docs:
        r: list[bytes | None] = [None] * len(t)
        for a, b, p in spans:
            r[a:b] = [p] * (b - a)
        recs += r
    return toks, recs


def check_against_reference(view: StreamWithMetadata, docs: list[Doc], idx: np.ndarray) -> None:
    toks, recs = reference(docs)
    b = view.read(idx)
    assert isinstance(b.metadata, RecordList)
    assert b.metadata.offsets[0] == 0 and len(b.metadata.data) == b.metadata.offsets[-1]
    seen: list[bytes] = []
    for k, i in enumerate(idx.tolist()):
        s = i * view.stride
        np.testing.assert_array_equal(b.fields["tokens"][k], toks[s : s + view.window])
        got = [None if p < 0 else b.metadata[p] for p in b.positions[k].tolist()]
        assert got == recs[s : s + view.window]
        seen += [b.metadata.raw(p) for p in b.positions[k].tolist() if p >= 0]
    # the records of the batch: distinct, in order of first appearance
    assert len(b.metadata) == len(dict.fromkeys(p for p in b.positions.ravel().tolist() if p >= 0))
    first = list(dict.fromkeys(p for p in b.positions.ravel().tolist() if p >= 0))
    assert first == list(range(len(b.metadata)))


@pytest.mark.parametrize("layout", ["blocks", "spans", "per_token"])
@pytest.mark.parametrize("block", [1, 7, 1024])
def test_every_window_matches_the_reference(tmp_path: Path, layout: str, block: int) -> None:
    docs = make_docs(1)
    ds = write(tmp_path / "ds", docs, layout, shard_bytes=3000, span_block=block)
    assert read_manifest(ds).version == {"blocks": 3, "spans": 2, "per_token": 1}[layout]
    for window, stride in ((97, 13), (1, 1), (700, 350)):
        view = StreamWithMetadata(ds, window=window, stride=stride)
        check_against_reference(view, docs, np.arange(len(view)))
        rng = np.random.default_rng(window)
        check_against_reference(view, docs, rng.integers(0, len(view), 40))  # repeats too


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    block=st.integers(1, 64),
    shard_bytes=st.integers(40, 2000),
    window=st.integers(1, 200),
    layout=st.sampled_from(["blocks", "spans"]),
)
def test_spans_property(
    tmp_path_factory: pytest.TempPathFactory,
    seed: int,
    block: int,
    shard_bytes: int,
    window: int,
    layout: str,
) -> None:
    docs = make_docs(seed, ndocs=20, maxlen=120)
    if sum(len(t) for t, _ in docs) < window:
        return
    ds = write(
        tmp_path_factory.mktemp("p") / "ds",
        docs,
        layout,
        shard_bytes=shard_bytes,
        span_block=block,
    )
    view = StreamWithMetadata(ds, window=window, stride=max(1, window // 3))
    check_against_reference(view, docs, np.arange(len(view)))


def loader_batches(ds: Path, **kw: Any) -> list[dict[str, Any]]:
    view = StreamWithMetadata(ds, window=61, stride=17)
    return list(DataLoader(view, 5, seed=3, epochs=2, **kw))


def assert_same_batches(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert sorted(x) == sorted(y)
        for key in x:
            if key == "metadata":
                assert list(x[key]) == list(y[key])
            else:
                assert x[key].dtype == y[key].dtype
                assert np.array_equal(x[key].numpy(), y[key].numpy()), key


def test_both_layouts_and_conversions_give_the_same_batches(tmp_path: Path) -> None:
    docs = make_docs(2)
    spans = write(tmp_path / "spans", docs, "spans", shard_bytes=4000, span_block=16)
    old = write(tmp_path / "old", docs, "per_token", shard_bytes=4000)
    blocks = write(tmp_path / "blocks", docs, "blocks", shard_bytes=4000, span_block=32)
    to_old = tmp_path / "to_old"
    to_new = tmp_path / "to_new"
    convert(spans, to_old, "per_token")
    convert(old, to_new, "spans", span_block=5)
    assert read_manifest(to_new).version == 2 and read_manifest(to_old).version == 1
    # every layout converts to every other one
    pairs = [
        (a, b) for a in ("blocks", "spans", "per_token") for b in ("blocks", "spans", "per_token")
    ]
    sources = {"blocks": blocks, "spans": spans, "per_token": old}
    converted = []
    for src_layout, dst_layout in pairs:
        if src_layout != dst_layout:
            dst = tmp_path / f"{src_layout}-to-{dst_layout}"
            convert(sources[src_layout], dst, dst_layout, span_block=7)
            assert read_manifest(dst).metadata_layout == dst_layout
            converted.append(dst)
    ref = loader_batches(spans)
    for ds in (old, blocks, to_old, to_new, *converted):
        assert_same_batches(ref, loader_batches(ds))
    assert_same_batches(ref, loader_batches(spans, num_threads=2))
    b = ref[0]
    # the records travel as tensors too, and the lazy list reads them
    offs = b["metadata_offsets"].numpy()
    data = b["metadata_bytes"].numpy()
    assert [data[offs[k] : offs[k + 1]].tobytes() for k in range(len(offs) - 1)] == list(
        b["metadata"]
    )

    # the span table is what makes the new layout small
    def size(p: Path, *exts: str) -> int:
        return sum(f.stat().st_size for f in p.iterdir() if f.suffix in exts)

    id_bytes = size(old, ".rows") - size(spans, ".rows")
    assert id_bytes == 4 * sum(len(t) for t, _ in docs)
    assert size(spans, ".mds", ".msx") < id_bytes / 2  # runs here average ~20 rows


@pytest.mark.parametrize("layout", ["blocks", "spans", "per_token"])
def test_exactly_once_across_resumes(tmp_path: Path, layout: str) -> None:
    ds = write(tmp_path / "ds", make_docs(3, ndocs=60), layout, shard_bytes=2000)
    view = StreamWithMetadata(ds, window=31, stride=31)
    n = len(view)

    def make(**kw: Any) -> DataLoader:
        return DataLoader(view, seed=5, epochs=2, **kw, read=tokload.ReadOptions(prefetch=3))

    segs = [Segment(2, 3, 4), Segment(3, 2, 5, num_threads=2), Segment(1, 4, None)]
    got = run_segments(make, segs)
    assert_exactly_once(got, n, 2 * n)
    _, recs = reference(make_docs(3, ndocs=60))
    for batch in got.batches.values():
        for k, i in enumerate(batch["index"].tolist()):
            pos = batch["metadata_positions"][k].tolist()
            assert [None if p < 0 else batch["metadata"][p] for p in pos] == recs[
                i * 31 : i * 31 + 31
            ]


def test_deserialize_runs_only_on_access(tmp_path: Path) -> None:
    ds = write(tmp_path / "ds", make_docs(4), "spans")
    calls: list[bytes] = []

    def de(b: bytes) -> Any:
        calls.append(b)
        return json.dumps(b.decode())

    view = StreamWithMetadata(ds, window=200, deserialize=de)
    b = view.read(np.arange(len(view)))
    assert len(b.metadata) > 10 and calls == []
    assert b.metadata[3] == json.dumps(b.metadata.raw(3).decode()) and len(calls) == 1
    assert b.metadata[-1] == de(b.metadata.raw(len(b.metadata) - 1))
    with pytest.raises(IndexError, match=rf"record {len(b.metadata)} is out of range"):
        b.metadata[len(b.metadata)]
    with pytest.raises(TypeError, match="record indices must be integers, not str"):
        b.metadata["x"]


def test_writer_layout_rules(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="metadata_layout='spans' keeps no 'metadata_id'"):
        Writer(
            tmp_path / "a",
            [("t", "<u2"), ("metadata_id", "<u4")],
            metadata=True,
            metadata_layout="spans",
        )
    with pytest.raises(FormatError, match="metadata_layout='per_token' needs a '<u4' field"):
        Writer(tmp_path / "b", "<u2", metadata=True, metadata_layout="per_token")
    with pytest.raises(
        ValueError, match="metadata_layout must be one of 'blocks', 'spans', 'per_token'"
    ):
        Writer(tmp_path / "c", "<u2", metadata=True, metadata_layout="dense")
    with pytest.raises(ValueError, match="span_block must be a positive integer, got 0"):
        Writer(tmp_path / "d", "<u2", metadata=True, span_block=0)
    write(tmp_path / "e", make_docs(5, 3), "spans")
    with pytest.raises(
        FormatError, match=r"cannot append .*\(per_token\) to a dataset .*\(spans\)"
    ):
        Writer(tmp_path / "e", [("tokens", "<u2"), ("metadata_id", "<u4")], metadata=True, mode="a")
    with (
        pytest.raises(ValueError, match="span \\[4, 6\\) overlaps another span"),
        Writer(tmp_path / "f", "<u2", metadata=True) as w,
    ):
        w.write(np.arange(10), spans=[(0, 5, b"x"), (4, 6, b"y")])


def test_append_and_merge_keep_the_span_table(tmp_path: Path) -> None:
    docs = make_docs(6, ndocs=40)
    a = write(tmp_path / "a", docs[:20], "spans", span_block=8)
    with Writer(a, "<u2", metadata=True, mode="a") as w:  # the block comes from the manifest
        for t, s in docs[20:30]:
            w.write(t, spans=s)
    b = write(tmp_path / "b", docs[30:], "spans", span_block=8)
    merge(tmp_path / "m", [a, b])
    view = StreamWithMetadata(tmp_path / "m", window=50, stride=7)
    check_against_reference(view, docs, np.arange(len(view)))
    c = write(tmp_path / "c", docs[:2], "spans", span_block=9)
    with pytest.raises(FormatError, match=r"\(layout \('spans', 9\)\) differs from"):
        merge(tmp_path / "m2", [a, c])


def _spans_dataset(tmp_path: Path) -> tuple[Path, Path, Path]:
    ds = write(tmp_path / "ds", make_docs(7, ndocs=30), "spans", span_block=4)
    shard = read_manifest(ds).shards[0].name
    return ds, ds / f"{shard}.mds", ds / f"{shard}.msx"


def _poke(path: Path, offset: int, value: int, size: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(value.to_bytes(size, "little"))


def read_all(ds: Path) -> None:
    view = StreamWithMetadata(ds, window=64, stride=64)
    view.read(np.arange(len(view)))


@pytest.mark.parametrize(
    ("what", "poke", "message"),
    [
        (
            "unsorted",
            lambda mds, msx: _poke(mds, 12 * 3, 0, 8),
            r"span table entry 3 starts at row 0",
        ),
        (
            "out of range",
            lambda mds, msx: _poke(mds, 12 * 2, 1 << 40, 8),
            r"span table entry 2 starts at row 1099511627776: .* below the shard's \d+ rows",
        ),
        (
            "record past the index",
            lambda mds, msx: _poke(mds, 12 * 1 + 8, 100_000, 4),
            r"span table entry 1 refers to record 100000, but the shard has \d+ metadata records",
        ),
        (
            "block index",
            lambda mds, msx: _poke(msx, 8 * 2, 1 << 50, 8),
            r"block index entry 2 = 1125899906842624 is out of order or out of range",
        ),
    ],
)
def test_damaged_span_tables_name_the_file(
    tmp_path: Path, what: str, poke: Any, message: str
) -> None:
    ds, mds, msx = _spans_dataset(tmp_path)
    poke(mds, msx)
    with pytest.raises(CorruptDataError, match=message) as e:
        read_all(ds)
    assert str(e.value).startswith(str(msx if what == "block index" else mds))


def test_a_block_index_value_too_small_is_refused(tmp_path: Path) -> None:
    """A ``.msx`` value one run too small, still in order and in range, was read
    silently: the run it named was stretched over rows of later runs, which got its
    record (review47). FORMAT.md: values that do not name the right runs raise."""
    ds, _, msx = _spans_dataset(tmp_path)
    view = StreamWithMetadata(ds, window=3, stride=1)
    want = view.read(np.arange(len(view)))
    values = np.fromfile(msx, "<u8")
    j = next(j for j in range(1, len(values) - 1) if values[j] - 1 >= values[j - 1])
    v = int(values[j])
    _poke(msx, 8 * j, v - 1, 8)
    message = (
        rf"^{msx}: a block index value names span table entry {v - 1} for row {4 * j}, but "
        rf"entry {v} starts at row \d+, at or before it \(the value is too small\)"
    )
    with pytest.raises(CorruptDataError, match=message):
        StreamWithMetadata(ds, window=3, stride=1).read(np.arange(len(view)))
    _poke(msx, 8 * j, v, 8)  # mended: the same batch
    got = StreamWithMetadata(ds, window=3, stride=1).read(np.arange(len(view)))
    np.testing.assert_array_equal(got.positions, want.positions)


def test_damaged_record_index_names_the_file(tmp_path: Path) -> None:
    ds, mds, _ = _spans_dataset(tmp_path)
    mdx = mds.with_suffix(".mdx")
    _poke(mdx, 8 * 2, 1 << 45, 8)
    with pytest.raises(CorruptDataError, match=rf"^{mdx}: metadata index entry 2 = 35184372088832"):
        read_all(ds)


@pytest.mark.parametrize("layout", ["spans", "per_token"])
def test_a_record_end_past_the_data_is_the_entry_named(tmp_path: Path, layout: str) -> None:
    """Record 0's end past the ``.mdb`` (review57): the reader named entry 0 = 0 (a
    valid value) and ``verify`` entry 2 = 10 (the valid last one) as the fault."""
    fields = [("tokens", "<u2"), ("metadata_id", "<u4")] if layout == "per_token" else "<u2"
    rows: Any = {"tokens": np.arange(10)} if layout == "per_token" else np.arange(10)
    with tokload.Writer(tmp_path / "ds", fields, metadata=True, metadata_layout=layout) as w:
        w.write(rows, spans=[(0, 5, b"hello"), (5, 10, b"world")])
    (mdx,) = (tmp_path / "ds").glob("*.mdx")
    _poke(mdx, 8, 1_000_000, 8)
    fault = rf"^{mdx}: metadata index entry 1 = 1000000 breaks 0 = first <= \.\.\. <= last = 10"
    read_fault = (
        fault if layout == "spans" else rf"^{mdx}: the metadata index: bad value 1000000 at byte 8$"
    )
    with pytest.raises(CorruptDataError, match=read_fault):
        StreamWithMetadata(tmp_path / "ds", window=4).read([0])
    (problem,) = tokload.tools.verify(tmp_path / "ds")
    assert re.match(fault, problem), problem


@pytest.mark.parametrize("layout", ["spans", "per_token"])
@pytest.mark.parametrize(
    ("entry", "value"), [(0, 1), (2, 9), (2, 4)], ids=["first", "last short", "last below"]
)
def test_a_record_index_that_does_not_span_the_data_is_refused(
    tmp_path: Path, layout: str, entry: int, value: int
) -> None:
    """review63, review66: a first entry other than 0 read record 0 from its second
    byte, and a last short of the data cut the last record (``b'worl'``), silently;
    every read refuses them, naming the entry ``verify`` names."""
    fields = [("tokens", "<u2"), ("metadata_id", "<u4")] if layout == "per_token" else "<u2"
    rows: Any = {"tokens": np.arange(10)} if layout == "per_token" else np.arange(10)
    with tokload.Writer(tmp_path / "ds", fields, metadata=True, metadata_layout=layout) as w:
        w.write(rows, spans=[(0, 5, b"hello"), (5, 10, b"world")])
    (mdx,) = (tmp_path / "ds").glob("*.mdx")
    _poke(mdx, 8 * entry, value, 8)
    (problem,) = tokload.tools.verify(tmp_path / "ds")
    assert problem.startswith(f"{mdx}: metadata index entry {entry} = {value} breaks"), problem
    read_fault = (
        rf"^{mdx}: metadata index entry {entry} = {value} breaks"
        if layout == "spans"
        else rf"^{mdx}: the metadata index: bad value {value} at byte {8 * entry}$"
    )
    for windows in ([0] if entry == 0 else [1], [0, 1]):  # the record's window, both
        with pytest.raises(CorruptDataError, match=read_fault):
            StreamWithMetadata(tmp_path / "ds", window=5).read(windows)


@pytest.mark.parametrize("layout", ["blocks", "spans", "per_token"])
def test_positions_given_to_read_are_filled_or_refused_whatever_the_layout(
    tmp_path: Path, layout: str
) -> None:
    """``read(positions=...)`` fills the caller's int32 array in every layout,
    and every layout refuses one that is not aligned to 4 bytes (the
    compiled readers store 64 bytes at a time), naming how far off it is."""
    docs = make_docs(3, ndocs=20)
    view = StreamWithMetadata(write(tmp_path / layout, docs, layout), window=33, stride=32)
    idx = np.arange(min(len(view), 6))
    want = view.read(idx)
    mine = np.full((len(idx), 33), -9, np.int32)
    got = view.read(idx, positions=mine)
    assert got.positions is mine
    np.testing.assert_array_equal(mine, want.positions)
    off = np.frombuffer(bytearray(4 * mine.size + 1), np.int32, count=mine.size, offset=1)
    with pytest.raises(
        ValueError,
        match=r"^positions must be aligned to 4 bytes \(int32\); its address is 1 past a "
        r"multiple of 4$",
    ):
        view.read(idx, positions=off.reshape(mine.shape))


@pytest.mark.parametrize("layout", ["blocks", "spans", "per_token"])
def test_read_with_nothing_given_matches_read_into_given_arrays(
    tmp_path: Path, layout: str
) -> None:
    """``read(indices)`` alone (the short path of a plain dtype: the compiled
    reader checks the indices and makes the positions) gives what a read into
    arrays the caller made gives, whatever form the indices take, and refuses
    bad indices with the same errors."""
    docs = make_docs(4, ndocs=30)
    view = StreamWithMetadata(write(tmp_path / layout, docs, layout), window=33, stride=32)
    n = len(view)
    forms: list[Any] = [
        [n - 1, 0, 3],
        np.array([2, 2, 5], np.uint8),
        np.array([[1, 4], [0, n - 1]]),
        np.int64(3),
        7,
        [],
        np.array([], np.uint64),
    ]
    for ix in forms:
        got = view.read(ix)
        b = int(np.asarray(ix).size)
        mine = view.read(ix, out=view.empty(b), positions=np.empty((b, 33), np.int32))
        assert got.positions.shape == (b, 33) and got.positions.dtype == np.int32
        assert got.positions.flags.c_contiguous and got.positions.flags.writeable
        np.testing.assert_array_equal(got.fields["tokens"], mine.fields["tokens"])
        np.testing.assert_array_equal(got.positions, mine.positions)
        assert list(got.metadata) == list(mine.metadata)
        if b:
            check_against_reference(view, docs, np.asarray(ix).reshape(-1).astype(np.int64))
    bad: list[tuple[Any, type[Exception], str]] = [
        (np.array([0.0, 1.0]), TypeError, "indices must be integers, got dtype float64"),
        ([0, n], IndexError, "out of range"),
        (np.array([0, 2**63], np.uint64), IndexError, "out of range"),
    ]
    for ix, error, message in bad:
        with pytest.raises(error, match=message):
            view.read(ix)
        with pytest.raises(error, match=message):
            view.read(ix, positions=np.empty((2, 33), np.int32))


def test_per_token_ids_far_apart_read_each_record_alone(tmp_path: Path) -> None:
    """Version 1: a window whose ids are far apart in the index reads two index
    entries per record instead of the range between them; both kinds of segment
    share one batched index read and give the records the ids name."""
    ds = write(tmp_path / "v1", [(np.arange(10, dtype=np.uint16), [(0, 10, b"r%d" % k)])
                                 for k in range(300)], "per_token")  # fmt: skip
    shard = read_manifest(ds).shards[0].name
    dt = np.dtype([("tokens", "<u2"), ("metadata_id", "<u4")])
    rows = np.memmap(ds / f"{shard}.rows", dtype=dt, mode="r+")
    assert len(rows) == 3000
    ids = np.arange(3000, dtype=np.uint32) % 300
    ids[::7] = 299 - ids[::7]  # scatter: each 64-row window names ids across the index
    ids[5::11] = 0xFFFFFFFF  # and some rows without a record
    rows["metadata_id"] = ids
    rows.flush()
    del rows
    view = StreamWithMetadata(ds, window=64, stride=50)
    b = view.read(np.arange(len(view)))
    for w in range(len(view)):
        want = ids[w * 50 : w * 50 + 64]
        got = [b.metadata[p] if p >= 0 else None for p in b.positions[w].tolist()]
        assert got == [None if i == 0xFFFFFFFF else b"r%d" % i for i in want.tolist()]


@pytest.mark.parametrize("io", ["sync", "threads", "uring"])
@pytest.mark.parametrize(
    ("suffix", "what"),
    [
        (".rows", r"rows \[64, 128\)"),
        (".msx", "the span table block index"),
        (".mds", "the span table"),
        (".mdx", "the metadata record index"),
        (".mdb", "the metadata records"),
    ],
)
def test_io_errors_in_every_round_name_the_file(
    tmp_path: Path, io: str, suffix: str, what: str
) -> None:
    """The rows and the four metadata files are read in one call, in dependent
    rounds: a file that shrank after opening fails with its own name and what
    was being read, on every I/O backend."""
    from tokload import _io
    from tokload.errors import TruncatedFileError

    if io == "uring" and not _io.uring_available():
        pytest.skip(f"io_uring is not available here: {_io.uring_error()}")
    ds, mds, _ = _spans_dataset(tmp_path)
    view = StreamWithMetadata(ds, window=64, stride=64)
    view.configure_io(io=io)
    view.read(np.arange(len(view)))  # every file read once: opened and sized
    path = mds.with_suffix(suffix)
    os.truncate(path, 0)
    message = rf"^{path}: file ended at byte \d+ while reading {what}"
    with pytest.raises(TruncatedFileError, match=message):
        view.read([1, 2])  # window 1 is the first the rows' error can name


@pytest.mark.parametrize(
    ("patch", "message"),
    [
        (
            {"metadata_layout": "dense"},
            r"'metadata_layout' must be one of 'blocks', 'spans', 'per_token'",
        ),
        ({"metadata_layout": "blocks"}, r"'metadata_layout' \"blocks\" needs version 3"),
        ({"span_block": 0}, r"span_block must be positive"),
        ({"span_block": "4"}, r"span_block must be a non-negative integer"),
        ({"dtype": [["tokens", "<u2"], ["metadata_id", "<u4"]]}, r"has no 'metadata_id' field"),
    ],
)
def test_bad_version_2_manifests(tmp_path: Path, patch: dict[str, Any], message: str) -> None:
    ds, _, _ = _spans_dataset(tmp_path)
    man = json.loads((ds / "manifest.json").read_text())
    (ds / "manifest.json").write_text(json.dumps({**man, **patch}))
    with pytest.raises(FormatError, match=message):
        StreamWithMetadata(ds, window=8)


def test_bad_run_counts_and_sizes(tmp_path: Path) -> None:
    ds, _, _ = _spans_dataset(tmp_path)
    man = json.loads((ds / "manifest.json").read_text())
    man["shards"][0]["metadata_runs"] = man["shards"][0]["rows"] + 1
    (ds / "manifest.json").write_text(json.dumps(man))
    with pytest.raises(FormatError, match=r"metadata runs for \d+ rows"):
        StreamWithMetadata(ds, window=8)
    ds2, mds2, _ = _spans_dataset(tmp_path / "two")
    os.truncate(mds2, mds2.stat().st_size - 1)
    with pytest.raises(FormatError, match=rf"{mds2}: span table is \d+ bytes but the manifest"):
        StreamWithMetadata(ds2, window=8)


def test_verify_checks_span_tables(tmp_path: Path) -> None:
    from tokload.tools import verify

    ds, mds, _msx = _spans_dataset(tmp_path)
    assert verify(ds) == []
    runs = mds.stat().st_size // 12
    _poke(mds, 12 * 3, 0, 8)  # run 3 starts at row 0: not after run 2
    assert verify(ds) == [
        f"{mds}: run 3 starts at row 0, which breaks 0 = first < ... < "
        f"{read_manifest(ds).shards[0].rows} (the shard's rows)"
    ]
    ds2, mds2, _msx2 = _spans_dataset(tmp_path / "b")
    records = read_manifest(ds2).shards[0].metadata_records
    _poke(mds2, 12 * 2 + 8, records, 4)  # a record past the shard's
    assert verify(ds2) == [
        f"{mds2}: run 2 has record {records}, but the shard has {records} records"
    ]
    ds3, _, msx3 = _spans_dataset(tmp_path / "c")
    _poke(msx3, 8 * 1, runs - 1, 8)  # block 1 points at the wrong run
    (problem,) = verify(ds3)
    assert problem.startswith(f"{msx3}: value 1 is {runs - 1}, but row 4 is in run ")


@pytest.mark.parametrize("layout", ["blocks", "spans", "per_token"])
@pytest.mark.parametrize("stop", ["before the rows", "after the rows"])
def test_a_write_stopped_part_way_leaves_the_shard_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, layout: str, stop: str
) -> None:
    """Ctrl+C inside ``Writer.write`` (between the span table entries and the rows,
    or between the rows and the document index) publishes the documents before it,
    whole, and nothing of the one it stopped: the files go back to where they were."""
    from tokload import shardfiles

    docs = make_docs(9, ndocs=12)
    real_add = shardfiles.OpenShard.add
    calls = 0

    def add(self: Any, rows: np.ndarray, payloads: list[bytes], end: bool = True) -> None:
        nonlocal calls
        calls += 1
        if calls == 8:
            if stop == "after the rows":
                self.put(0, np.ascontiguousarray(rows).view(np.uint8).data)
            raise KeyboardInterrupt
        real_add(self, rows, payloads, end)

    monkeypatch.setattr(shardfiles.OpenShard, "add", add)
    with pytest.raises(KeyboardInterrupt):
        write(tmp_path / "ds", docs, layout)
    monkeypatch.setattr(shardfiles.OpenShard, "add", real_add)
    assert read_manifest(tmp_path / "ds").num_documents == 7
    assert not list((tmp_path / "ds").glob(".*"))  # no hidden file left
    from tokload.tools import verify

    assert verify(tmp_path / "ds", deep=True) == []
    view = StreamWithMetadata(tmp_path / "ds", window=5, stride=5)
    check_against_reference(view, docs[:7], np.arange(len(view)))


def _three_layouts(tmp_path: Path, window: int = 29) -> tuple[list[StreamWithMetadata], list[Any]]:
    """Streams of the three layouts, and each one's reference (tokens, records)."""
    views, refs = [], []
    for k, layout in enumerate(["blocks", "spans", "per_token"]):
        docs = make_docs(10 + k, ndocs=40 + 20 * k, maxlen=120)
        ds = write(tmp_path / layout, docs, layout, shard_bytes=1500, span_block=5)
        views.append(StreamWithMetadata(ds, window=window, stride=window - 3 * k))
        refs.append(reference(docs))
    return views, refs


def _check_blend_rows(blend: tokload.Blend, refs: list[Any], idx: np.ndarray, b: Any) -> None:
    """Each row of ``b`` (a batch of blend positions ``idx``) is its sample's window
    and records, and the batch's records are distinct, in order of first appearance."""
    comp, index = blend.locate(idx)
    for k, (c, i) in enumerate(zip(comp.tolist(), index.tolist(), strict=True)):
        view: Any = blend.views[c]
        refs_here = refs
        while isinstance(view, tokload.Blend):  # nested: down to a stream
            cc, ii = view.locate([i])
            refs_here = refs_here[c]
            c, i, view = int(cc[0]), int(ii[0]), view.views[int(cc[0])]
        toks, recs = refs_here[c]
        s = i * view.stride
        np.testing.assert_array_equal(b.fields["tokens"][k], toks[s : s + view.window])
        got = [None if p < 0 else b.metadata[p] for p in b.positions[k].tolist()]
        assert got == recs[s : s + view.window]
    used = [p for p in b.positions.ravel().tolist() if p >= 0]
    assert list(dict.fromkeys(used)) == list(range(len(b.metadata)))
    assert b.metadata.offsets[0] == 0 and len(b.metadata.data) == b.metadata.offsets[-1]


@settings(max_examples=20, deadline=None)
@given(
    weights=st.lists(st.floats(0.1, 5.0), min_size=3, max_size=3),
    seed=st.integers(0, 1000),
    nested=st.booleans(),
    positions=st.lists(st.integers(0, 10**6), max_size=16),
)
def test_a_blend_of_streams_with_metadata_gives_each_row_its_records(
    tmp_path_factory: pytest.TempPathFactory,
    weights: list[float],
    seed: int,
    nested: bool,
    positions: list[int],
) -> None:
    views, refs = _three_layouts(tmp_path_factory.mktemp("m"))
    comps: list[tuple[Any, float]] = list(zip(views, weights, strict=True))
    refs_of: list[Any] = list(refs)
    if nested:  # the first two as a blend of their own
        comps = [(tokload.Blend(comps[:2], seed=seed + 1, block_size=8, length=300), 1.0), comps[2]]
        refs_of = [refs[:2], refs[2]]
    blend = tokload.Blend(comps, seed=seed, block_size=16, length=1000)
    idx = np.array([p % len(blend) for p in positions], dtype=np.int64)
    _check_blend_rows(blend, refs_of, idx, blend.read(idx))
    raw = blend.read_batch(idx, np.empty)
    assert sorted(raw) == [
        "metadata",
        "metadata_bytes",
        "metadata_offsets",
        "metadata_positions",
        "tokens",
    ]
    if len(idx):
        one = blend[int(idx[0])]
        np.testing.assert_array_equal(one.fields["tokens"], raw["tokens"][0])


def test_a_blend_of_streams_with_metadata_through_the_loader(tmp_path: Path) -> None:
    views, refs = _three_layouts(tmp_path)
    blend = tokload.Blend(list(zip(views, (2.0, 1.0, 1.0), strict=True)), seed=3, length=240)

    def make(**kw: Any) -> DataLoader:
        return DataLoader(blend, seed=5, epochs=1, **kw)

    got = run_segments(make, [Segment(2, 3, 5), Segment(3, 2, None)])
    assert_exactly_once(got, len(blend), len(blend))
    for batch in got.batches.values():
        idx = batch["index"].numpy()
        comp, index = blend.locate(idx)
        assert batch["component"].tolist() == comp.tolist()
        assert batch["component_index"].tolist() == index.tolist()
        b = tokload.views.MetadataBatch(
            {"tokens": batch["tokens"].numpy()},
            batch["metadata_positions"].numpy(),
            batch["metadata"],
        )
        _check_blend_rows(blend, refs, idx, b)


def test_a_blend_of_streams_with_metadata_reads_a_task_in_one_call_per_component(
    tmp_path: Path,
) -> None:
    """``read_batches`` (the loader's call for a task's steps) gives what ``read_batch``
    of each batch gives, with one ``read_batches`` of each component for all of them."""
    views, _ = _three_layouts(tmp_path)
    blend = tokload.Blend([(v, 1.0) for v in views], seed=0, length=300, block_size=6)
    batches = [np.arange(k * 5, k * 5 + 5) for k in range(4)] + [np.array([], np.int64)]
    calls = [0, 0, 0]

    def counting(k: int, real: Any) -> Any:
        def call(*args: Any) -> Any:
            calls[k] += 1
            return real(*args)

        return call

    for k, v in enumerate(views):
        v.read_batches = counting(k, v.read_batches)  # type: ignore[method-assign]
    many = blend.read_batches(batches, np.empty)
    assert calls == [1, 1, 1]
    for ix, got in zip(batches, many, strict=True):
        one = blend.read_batch(ix, np.empty)
        assert sorted(got) == sorted(one)
        for key in ("tokens", "metadata_positions", "metadata_bytes", "metadata_offsets"):
            np.testing.assert_array_equal(got[key], one[key], err_msg=key)
        assert list(got["metadata"]) == list(one["metadata"])
    calls[:] = [0, 0, 0]
    loader = DataLoader(
        blend, 4, epochs=1, num_threads=1, device=None, read=tokload.ReadOptions(steps_per_task=4)
    )
    steps = sum(1 for _ in loader)
    tasks = 1 + -(-(steps - 1) // 4)  # the first task is one step
    assert steps == 75 and max(calls) <= tasks


def test_a_blend_of_streams_with_metadata_counts_each_component(tmp_path: Path) -> None:
    """``stats()`` gives each component's samples and tokens, as the batches say."""
    views, _ = _three_layouts(tmp_path)
    blend = tokload.Blend(list(zip(views, (1.0, 3.0, 2.0), strict=True)), seed=1, length=600)
    loader = DataLoader(blend, 4, seed=2, device=None, read=tokload.ReadOptions(steps_per_task=3))
    seen = np.zeros(3, dtype=np.int64)
    for _, batch in zip(range(25), loader, strict=False):  # range first: no 26th batch
        seen += np.bincount(batch["component"].numpy(), minlength=3)
    got = loader.stats()
    loader.close()
    assert got["component_samples"] == seen.tolist() and seen.sum() == 100
    assert got["component_tokens"] == (seen * 29).tolist()


def test_a_blend_of_streams_with_metadata_refuses_other_streams(tmp_path: Path) -> None:
    views, _ = _three_layouts(tmp_path)
    other = StreamWithMetadata(views[0].source, window=30)
    with pytest.raises(ValueError, match=r"component 1 has window 30 and fields tokens: uint16; "):
        tokload.Blend([(views[0], 1.0), (other, 1.0)], length=10)
    odd = StreamWithMetadata(views[1].source, window=29, deserialize=json.loads)
    with pytest.raises(ValueError, match=r"component 1 deserializes its records with <function"):
        tokload.Blend([(views[0], 1.0), (odd, 1.0)], length=10)
    plain = tokload.TokenStream(views[0].source, window=29)
    with pytest.raises(
        TypeError, match=r"component 1 is a view of windows, component 0 of metadata"
    ):
        tokload.Blend([(views[0], 1.0), (plain, 1.0)], length=10)
    blend = tokload.Blend([(views[0], 1.0)], length=10)
    with pytest.raises(TypeError, match=r"reads into arrays of its own"):
        blend.read([0], out={"tokens": np.empty((1, 29), np.uint16)})
