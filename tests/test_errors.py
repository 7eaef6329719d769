"""Bad input raises a tokload exception that names the file and the value."""

from __future__ import annotations

import json
import os
import re
import socket
import stat
import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from timeouts import no_hang

import tokload
from tokload import (
    Blend,
    CorruptDataError,
    Documents,
    FormatError,
    MissingShardError,
    StreamWithMetadata,
    TokenStream,
    TruncatedFileError,
    Writer,
)
from tokload._io import set_max_open_files

MEGATRON = Path(__file__).parent / "data" / "megatron"
META_DT = [("token", "<u4"), ("metadata_id", "<u4")]


def small(path: Path, metadata: bool = False) -> Path:
    with Writer(
        path,
        META_DT if metadata else "<u4",
        metadata=metadata,
        shard_bytes=160 if metadata else 80,
        name_prefix="s",
    ) as w:
        for k in range(6):
            rows = np.arange(10) + 100 * k
            if metadata:
                w.write({"token": rows}, spans=[(0, 4, b"abcd"), (4, 10, b"efghij")])
            else:
                w.write(rows)
    return path


def test_missing_shard(tmp_path: Path) -> None:
    ds = small(tmp_path / "ds")
    (ds / "s-00001.rows").unlink()
    with pytest.raises(MissingShardError, match=r"missing shard rows") as e:
        tokload.open_dataset(ds)
    assert e.value.filename == str(ds / "s-00001.rows")
    assert isinstance(e.value, FileNotFoundError)
    with pytest.raises(MissingShardError, match="no tokload manifest"):
        tokload.open_dataset(tmp_path / "nowhere")


def test_size_disagrees_with_manifest(tmp_path: Path) -> None:
    ds = small(tmp_path / "ds")
    with open(ds / "s-00002.docs", "ab") as f:
        f.write(b"\0" * 8)
    with pytest.raises(
        FormatError,
        match=r"s-00002\.docs: document index is 32 bytes but the "
        r"manifest implies 24",
    ):
        tokload.open_dataset(ds)


def test_a_file_replaced_after_open_is_not_read_as_the_datasets(tmp_path: Path) -> None:
    """A file is opened by path when a read first needs it (and again after the
    bound on descriptors closed it): a rebuild that renamed other data of the same
    size into its place was read as the dataset's, without a word."""
    ds = small(tmp_path / "ds")
    view = TokenStream(ds, window=10)
    np.testing.assert_array_equal(view[0], np.arange(10))  # shard 0 opened
    other = tmp_path / "other.rows"
    np.full(os.path.getsize(ds / "s-00001.rows") // 4, 77, np.uint32).tofile(other)
    os.replace(other, ds / "s-00001.rows")  # the same size, other tokens
    with pytest.raises(
        MissingShardError, match=r"not the one the dataset was opened with .*open the dataset again"
    ) as e:
        view.read([2])
    assert e.value.filename == str(ds / "s-00001.rows")
    np.testing.assert_array_equal(view[0], np.arange(10))  # the others still read
    assert int(np.asarray(TokenStream(ds, window=10)[2])[0]) == 77  # a new open: the new file
    # closed for room and opened again: checked again
    view = TokenStream(ds, window=10)
    view.read([0, 2])
    set_max_open_files(1)
    try:
        view.read([4])  # another shard: the others' descriptors closed
        os.utime(ds / "s-00000.rows", ns=(1, 1))  # the same bytes, written again
        with pytest.raises(MissingShardError, match="not the one the dataset was opened with"):
            view.read([0])
    finally:
        set_max_open_files(None)


def test_file_truncated_after_open(tmp_path: Path) -> None:
    ds = small(tmp_path / "ds")
    view = TokenStream(ds, window=10)
    os.truncate(ds / "s-00001.rows", 12)
    with pytest.raises(
        TruncatedFileError,
        match=r"s-00001\.rows: file ended at byte 12 while "
        r"reading rows \[20, 30\)",
    ):
        view.read([2])
    np.testing.assert_array_equal(view[0], np.arange(10))  # other shards still read
    with pytest.raises(FormatError, match="rows is 12 bytes"):
        tokload.open_dataset(ds)  # and the next open refuses the dataset
    # a read that starts past the new end names the file's size, not the read's start
    flat = tmp_path / "t.bin"
    np.arange(1000, dtype=np.uint16).tofile(flat)
    last = TokenStream(tokload.open_flat(flat, np.uint16), window=10)
    os.truncate(flat, 500)
    with pytest.raises(
        TruncatedFileError,
        match=r"t\.bin: file ended at byte 500 while reading rows \[990, 1000\) \(20 bytes at "
        r"offset 1980\)",
    ):
        last.read([99])
    flat.unlink()  # the size cannot be known now
    with pytest.raises(TruncatedFileError, match=r"t\.bin: file ended at or before byte 1980 "):
        last.read([99])


@pytest.mark.parametrize("held", [True, False], ids=["held", "per-read"])
def test_document_offsets_decreasing_or_past_the_end(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, held: bool
) -> None:
    """Entries read per document are held to FORMAT.md's rules for the entries a
    read uses: a shard's first must be 0 and its last its rows (review63: a first
    of 2 read document 0 from row 2, a last short of the rows cut the last
    document and left rows to no document, silently), and none may decrease or
    pass the rows. A table held in memory is checked whole (test_index_memory)."""
    if not held:
        monkeypatch.setenv("TOKLOAD_INDEX_MEMORY", "0")
    ds = small(tmp_path / "ds")  # two documents of 10 rows
    idx = np.fromfile(ds / "s-00000.docs", "<u8")
    # each rewrite opened afresh: an opened dataset refuses a file written after it opened
    cases = [  # (entries, document read, the entry blamed (value, byte), as verify names it)
        ([0, 11, 5], 1, ("5", 16)),  # decreasing: the second of the two
        ([0, 10, 5], 1, ("5", 16)),  # the last below the one before (review66)
        ([0, 25, 20], 1, ("25", 8)),  # past the shard's 20 rows, read as a first
        ([0, 10, 21], 1, ("21", 16)),  # past the shard's 20 rows
        ([2, 10, 20], 0, ("2", 0)),  # the first is not 0
        ([0, 10, 18], 1, ("18", 16)),  # the last is short of the rows
    ]
    for entries, doc, (value, at) in cases:
        np.array(entries, "<u8").tofile(ds / "s-00000.docs")
        (problem,) = tokload.tools.verify(ds)
        assert f"document index entry {at // 8} = {value} breaks" in problem
        what = "the document index" if held else f"the document index entry of document {doc}"
        with pytest.raises(
            CorruptDataError, match=rf"s-00000\.docs: {what}: bad value {value} at byte {at}$"
        ):
            Documents(ds).read([doc])
    np.array([0, 10, 18], "<u8").tofile(ds / "s-00000.docs")
    if not held:  # (the entries a read uses are checked: document 0's are right)
        np.testing.assert_array_equal(Documents(ds)[0], np.arange(10))
    idx.tofile(ds / "s-00000.docs")
    np.testing.assert_array_equal(Documents(ds)[1], np.arange(10) + 100)


def test_metadata_offsets_and_ids(tmp_path: Path) -> None:
    ds = small(tmp_path / "ds", metadata=True)

    def view() -> StreamWithMetadata:  # opened after each rewrite (it refuses a file
        return StreamWithMetadata(ds, window=10)  # written after it opened)

    good = np.fromfile(ds / "s-00000.mdx", "<u8")
    assert good.tolist() == [0, 4, 10, 14, 20]
    np.array([0, 4, 3, 14, 20], "<u8").tofile(ds / "s-00000.mdx")
    with pytest.raises(
        CorruptDataError,
        match=r"s-00000\.mdx: the metadata index: bad value 3 "
        r"at byte 16",
    ):
        view().read([0])
    np.array([0, 4, 10, 14, 99], "<u8").tofile(ds / "s-00000.mdx")
    with pytest.raises(CorruptDataError, match=r"bad value 99 at byte 32"):
        view().read([1])
    # review63: a first entry of 1 read record 0 from its second byte, silently (and
    # 128 named the next entry); a last short of the data cut the last record
    for entries, window, value, at in (([1, 4, 10, 14, 20], 0, 1, 0),
                                       ([128, 4, 10, 14, 20], 0, 128, 0),
                                       ([0, 4, 10, 14, 19], 1, 19, 32)):  # fmt: skip
        np.array(entries, "<u8").tofile(ds / "s-00000.mdx")
        with pytest.raises(
            CorruptDataError,
            match=rf"s-00000\.mdx: the metadata index: bad value {value} at "
            rf"byte {at}$",
        ):
            view().read([window])
    good.tofile(ds / "s-00000.mdx")
    assert view()[1].metadata == [b"abcd", b"efghij"]
    rows = np.fromfile(ds / "s-00001.rows", np.dtype(META_DT))
    rows["metadata_id"][3] = 7  # the shard has 4 records
    rows.tofile(ds / "s-00001.rows")
    with pytest.raises(
        CorruptDataError,
        match=r"s-00001\.rows: row 3 has metadata id 7, but the "
        r"shard has 4 metadata records",
    ):
        view().read([2])


def test_unknown_version_and_malformed_manifests(tmp_path: Path) -> None:
    ds = small(tmp_path / "ds")
    manifest = json.loads((ds / "manifest.json").read_text())
    cases: list[tuple[dict[str, Any], str]] = [
        ({"version": 9}, r"unknown format version 9; this tokload reads version 1"),
        ({"format": "other"}, r"not a tokload manifest"),
        ({"dtype": "<f4"}, r"rows must be integers, got dtype float32"),
        ({"metadata": True}, r"needs a '<u4' field 'metadata_id'"),
        ({"shards": [{"name": "x", "rows": -1}]}, r"rows must be a non-negative integer, got -1"),
        ({"shards": [{"rows": 1}]}, r"malformed manifest"),
    ]
    for patch, message in cases:
        (ds / "manifest.json").write_text(json.dumps({**manifest, **patch}))
        with pytest.raises(FormatError, match=message):
            tokload.open_dataset(ds)
    (ds / "manifest.json").write_text("{")
    with pytest.raises(FormatError, match=r"manifest\.json: not valid JSON"):
        tokload.open_dataset(ds)


def test_indices_out_of_range(tmp_path: Path) -> None:
    ds = small(tmp_path / "ds")
    stream = TokenStream(ds, window=7, stride=5)
    n = len(stream)
    with pytest.raises(
        IndexError,
        match=rf"observation {n} is out of range for a view of {n} "
        rf"\(valid: 0 <= i < {n}\)",
    ):
        stream.read([0, n])
    with pytest.raises(IndexError, match=r"observation -1 is out of range"):
        stream.read([-1])
    with pytest.raises(IndexError, match=rf"observation {n} is out of range"):
        stream[n]
    with pytest.raises(TypeError, match=r"indices must be integers, got dtype float64"):
        stream.read([1.0])
    # view[i] takes what read takes: a float was truncated (view[1.9] was window 1)
    md = small(tmp_path / "md", metadata=True)
    views = (
        stream,
        Documents(ds),
        StreamWithMetadata(md, window=3),
        Blend([(stream, 1.0), (stream, 1.0)], length=20),
    )
    bads: list[Any] = [1.9, 1.0, np.float64(1), True, np.True_, "1", np.array([1])]
    goods: list[Any] = [1, np.int64(1), np.uint8(1), np.array(1)]
    for view in views:
        for bad in bads:
            with pytest.raises(TypeError, match=r"view indices must be integers, not "):
                view[bad]
        for good in goods:
            np.testing.assert_equal(_values(view[good]), _values(view[1]))
    with pytest.raises(TypeError, match=r"out must have dtype uint32, got int64"):
        stream.read([0], out=np.empty((1, 7), np.int64))
    with pytest.raises(ValueError, match=r"out has shape \(2, 7\), expected \(1, 7\)"):
        stream.read([0], out=np.empty((2, 7), np.uint32))
    with pytest.raises(ValueError, match=r"window must be a positive integer, got 0"):
        TokenStream(ds, window=0)
    with pytest.raises(ValueError, match=r"window must be a positive integer, got True"):
        TokenStream(ds, window=True)
    with pytest.raises(ValueError, match=r"stride must be a positive integer, got 2\.5"):
        TokenStream(ds, window=7, stride=2.5)  # type: ignore[arg-type]
    # (a stride the reads take as 64 bits: read, it raised OverflowError; review30)
    with pytest.raises(ValueError, match=r"^stride must be below 2\*\*64, got 1844674407370955"):
        TokenStream(ds, window=7, stride=1 << 64)
    seven: Any = np.int64(7)
    assert TokenStream(ds, window=seven, stride=5).fingerprint == stream.fingerprint
    with pytest.raises(FormatError, match="has no metadata"):
        StreamWithMetadata(ds, window=3)
    stream.close()
    with pytest.raises(ValueError, match="closed dataset"):
        stream.read([0])


def _values(sample: Any) -> Any:
    """A sample's arrays, whatever the view returns one as."""
    if hasattr(sample, "positions"):  # a MetadataBatch: its rows and their records
        return sample.fields, sample.positions, list(sample.metadata)
    return sample.values if hasattr(sample, "values") else sample


def test_writer_rejects_bad_spans_and_modes(tmp_path: Path) -> None:
    for bad in ("4k", 0, 1.5, True):
        with pytest.raises(ValueError, match=r"shard_bytes must be a positive integer, got "):
            Writer(tmp_path / "sb", "<u4", shard_bytes=bad)  # type: ignore[arg-type]
    assert not (tmp_path / "sb").exists()  # refused before anything is made
    with Writer(tmp_path / "m", META_DT, metadata=True) as w:
        with pytest.raises(
            ValueError,
            match=r"span \[3, 12\) is not a non-empty range within "
            r"the document's 10 rows",
        ):
            w.write({"token": np.arange(10)}, spans=[(3, 12, b"x")])
        with pytest.raises(ValueError, match=r"span \[4, 6\) overlaps another span"):
            w.write({"token": np.arange(10)}, spans=[(0, 5, b"x"), (4, 6, b"y")])
        with pytest.raises(ValueError, match=r"unknown fields \['tokn'\]"):
            w.write({"tokn": np.arange(3)})
    with pytest.raises(FileExistsError, match="use mode='a'"):
        Writer(tmp_path / "m", META_DT, metadata=True)
    with pytest.raises(FormatError, match=r"cannot append dtype=uint32, metadata=False"):
        Writer(tmp_path / "m", "<u4", mode="a")
    with Writer(tmp_path / "p", "<u4") as w, pytest.raises(ValueError, match="metadata=False"):
        w.write([1], spans=[(0, 1, b"x")])
    with pytest.raises(FormatError, match=r"rows must be integers, got dtype float32"):
        Writer(tmp_path / "f", "<f4")
    with pytest.raises(FormatError, match=r"needs a '<u4' field 'metadata_id'"):
        Writer(tmp_path / "n", "<u4", metadata=True, metadata_layout="per_token")
    padded = np.dtype(
        {"names": ["a", "b"], "formats": ["<u4", "<u2"], "offsets": [0, 4], "itemsize": 8}
    )
    with pytest.raises(
        FormatError,
        match=r"packed without padding: 6 bytes of fields in a "
        r"row of 8 bytes",
    ):
        Writer(tmp_path / "pad", padded)
    swapped = np.dtype({"names": ["a", "b"], "formats": ["<u2", "<u2"], "offsets": [2, 0]})
    with pytest.raises(FormatError, match=r"in the order of their offsets.*'a' is at byte 2"):
        Writer(tmp_path / "swapped", swapped)  # (NumPy's own error was "dtype.descr ...")
    with pytest.raises(FormatError, match=r"differs from"):
        tokload.merge(tmp_path / "mm", [tmp_path / "m", tmp_path / "p"])
    with pytest.raises(FileExistsError, match=r"a dataset already exists here: '.*/m'$"):
        tokload.merge(tmp_path / "m", [tmp_path / "p"])
    with pytest.raises(FileExistsError, match=r"a dataset already exists here: '.*/p'$"):
        tokload.convert(tmp_path / "m", tmp_path / "p", "blocks")
    with pytest.raises(ValueError, match=r"merge needs at least one input dataset"):
        tokload.merge(tmp_path / "none", [])
    assert not (tmp_path / "none").exists()  # refused before anything is made


def test_writer_refuses_what_it_would_store_wrong_before_writing(tmp_path: Path) -> None:
    """review50: an int payload became that many zero bytes, float span bounds were
    truncated, a ``user`` that is not JSON failed only when the first shard was
    published (leaving it listed nowhere) and NaN was written as bare ``NaN`` (not
    JSON); a ``name_prefix`` with '/' wrote shards outside the dataset."""
    for layout in ("per_token", "spans", "blocks"):
        dt: Any = META_DT if layout == "per_token" else "<u4"
        with Writer(tmp_path / layout, dt, metadata=True, metadata_layout=layout) as w:
            doc: Any = {"token": np.arange(10)} if layout == "per_token" else np.arange(10)
            write: Any = w.write  # (spans of the wrong types, on purpose)
            with pytest.raises(TypeError, match=r"span \[0, 10\): the payload must be bytes"):
                write(doc, spans=[(0, 10, 12345)])
            with pytest.raises(TypeError, match=r"the payload is a str; records are bytes"):
                write(doc, spans=[(0, 10, "text")])
            with pytest.raises(TypeError, match=r"span \(1.5, 3, ...\): start and stop must"):
                write(doc, spans=[(1.5, 3, b"x")])
            with pytest.raises(TypeError, match=r"a span is \(start, stop, payload\), got"):
                write(doc, spans=[(0, 3)])
            write(doc, spans=[(np.int64(0), np.uint8(4), np.frombuffer(b"ab", np.uint8))])
        got = tokload.StreamWithMetadata(tmp_path / layout, window=10)[0]
        assert [got.metadata[k] for k in range(len(got.metadata))] == [b"ab"]
        assert got.positions.tolist() == [0] * 4 + [-1] * 6
    bad_users: list[tuple[Any, type[Exception], str]] = [
        ({"ids": {1, 2}}, TypeError, r"user is not JSON the manifest can hold: .*set"),
        ({"loss": float("nan")}, ValueError, r"user is not JSON .*Out of range float"),
        ([1, 2], TypeError, r"user must be a mapping \(a JSON object\), got list"),
    ]
    for user, error, message in bad_users:
        with pytest.raises(error, match=message):
            Writer(tmp_path / "u", "<u2", user=user)
        assert not (tmp_path / "u").exists()
    deep: dict[str, Any] = {}
    for _ in range(5000):
        deep = {"k": deep}
    with pytest.raises(ValueError, match=r"user is nested too deeply"):
        Writer(tmp_path / "u", "<u2", user=deep)
    for prefix, message in [
        ("../x", r"contains '/': shards go in the dataset's directory itself"),
        ("", r"is empty"),
        (".x", r"starts with '.', as the writer's temporary files do"),
        ("a\0b", r"contains a NUL character"),
    ]:
        with pytest.raises(ValueError, match=rf"name_prefix {re.escape(repr(prefix))} {message}"):
            Writer(tmp_path / "px", "<u2", name_prefix=prefix)
        assert not (tmp_path / "px").exists()
    # metadata appended to a dataset without: the dataset is named, not the dtype
    with Writer(tmp_path / "plain", "<u2") as w:
        w.write(np.arange(3, dtype=np.uint16))
    with pytest.raises(FormatError, match=r"cannot append .*metadata=True .*metadata=False"):
        Writer(tmp_path / "plain", "<u2", mode="a", metadata=True)


def test_a_writer_whose_manifest_write_failed_lists_its_shards_on_the_next_close(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """review50: ``close`` marked the writer closed before the manifest was written;
    when that failed (a full disk), a second ``close`` returned at once and the
    last shard stayed unlisted: its documents lost. A write failure at a shard
    change is retried by the next publish the same way."""
    real = tokload.format.write_manifest
    fail = {"n": 0}

    def full_disk(path: Any, manifest: Any) -> None:
        if fail["n"]:
            fail["n"] -= 1
            raise OSError(28, "No space left on device")
        real(path, manifest)

    monkeypatch.setattr("tokload.writer.write_manifest", full_disk)
    w = Writer(tmp_path / "ds", "<u2", shard_bytes=2000, durable=False)
    w.write(np.full(600, 0, np.uint16))
    fail["n"] = 1  # the first shard's listing, at the second document's shard change
    with pytest.raises(OSError, match="No space left"):
        w.write(np.full(600, 1, np.uint16))
    for i in (2, 3):
        w.write(np.full(600, i, np.uint16))
    fail["n"] = 1
    with pytest.raises(OSError, match="No space left"):
        w.close()
    with pytest.raises(OSError, match="No space left"):
        fail["n"] = 1
        w.close()
    w.close()  # space freed
    w.close()  # (idempotent once it succeeded)
    docs: Any = Documents(tmp_path / "ds")
    assert [int(docs[k][0]) for k in range(len(docs))] == [0, 2, 3]
    with pytest.raises(ValueError, match="write to a closed Writer"):
        w.write([1])
    # a write that failed after its rename (the directory's fsync: EIO), in either
    # mode: the retry found its own manifest "created meanwhile", or listed the
    # shard twice (review55)
    late = {"n": 0}

    def fails_late(path: Any, manifest: Any) -> None:
        real(path, manifest)
        if late["n"]:
            late["n"] -= 1
            raise OSError(5, "Input/output error")

    monkeypatch.setattr("tokload.writer.write_manifest", fails_late)
    for mode, want in (("w", [7]), ("a", [7, 8])):
        w = Writer(tmp_path / "late", "<u2", mode=mode, durable=False)
        w.write(np.full(5, 7 if mode == "w" else 8, np.uint16))
        late["n"] = 1
        with pytest.raises(OSError, match="Input/output error"):
            w.close()
        w.close()
        docs = Documents(tmp_path / "late")
        assert [int(docs[k][0]) for k in range(len(docs))] == want


def test_a_field_named_as_a_key_the_view_adds_is_refused(tmp_path: Path) -> None:
    """review50: a field named ``metadata_positions`` (or ``position_ids`` under
    ``boundaries=``) was replaced by the batch's own array, silently."""
    m = tmp_path / "m"
    with Writer(m, [("token", "<u4"), ("metadata_positions", "<u4")], metadata=True) as w:
        w.write({"token": np.arange(8), "metadata_positions": np.full(8, 77)}, [(0, 8, b"r")])
    with pytest.raises(
        ValueError,
        match=r"m: a field named 'metadata_positions', a key the view adds to each batch: "
        r"its values would be replaced by the batch's own \(rename the field\)",
    ):
        tokload.StreamWithMetadata(m, window=4)
    tokload.Documents(m)  # (other views read the field as it is)
    p = tmp_path / "p"
    with Writer(p, [("token", "<u4"), ("position_ids", "<u4")]) as w:
        for d in range(3):
            w.write({"token": np.full(3, d), "position_ids": np.full(3, 99)})
    with pytest.raises(
        ValueError,
        match=r"a field named 'position_ids', a key boundaries= adds to each batch: .*"
        r"\(rename the field, or leave it out of boundaries=\[...\]\)",
    ):
        tokload.TokenStream(p, window=4, boundaries=True)
    kept = tokload.TokenStream(p, window=4, boundaries=["cu_seqlens"])
    read: Any = kept.read([0])
    assert read["position_ids"].tolist() == [[99, 99, 99, 99]]
    tokload.TokenStream(p, window=4)


def test_a_megatron_index_out_of_bin_order_is_refused_for_boundaries(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """review52: an .idx whose sequences start at rows 0, 6, 8, 2 (Megatron's reader and
    Documents read each one) gave windows with boundaries= whose position_ids missed
    the document at row 2, silently; a search that came across the disorder raised
    an error naming no file."""
    import struct

    np.arange(16, dtype=np.uint16).tofile(tmp_path / "m.bin")
    lens = np.full(4, 4, np.int32)
    ptrs = np.array([0, 12, 16, 4], np.int64)  # byte pointers: rows 0, 6, 8, 2
    with open(tmp_path / "m.idx", "wb") as f:
        f.write(struct.pack("<9sQBQQ", b"MMIDIDX\x00\x00", 1, 8, 4, 5))
        f.write(lens.tobytes() + ptrs.tobytes() + np.arange(5, dtype=np.int64).tobytes())
    docs: Any = Documents(tmp_path / "m")
    assert docs[3].tolist() == [2, 3, 4, 5]
    with pytest.raises(
        CorruptDataError,
        match=r"m\.idx: sequence 3 starts at row 2, before sequence 2 \(row 8\): windows "
        r"with boundaries= need the sequences in the order of the \.bin",
    ):
        tokload.TokenStream(tmp_path / "m", window=8, boundaries=True)
    # an index not held in memory: what a search comes across names the source
    ptrs[:] = [0, 16, 8, 24]  # rows 0, 8, 4, 12
    with open(tmp_path / "m.idx", "r+b") as f:
        f.seek(34 + 16)
        f.write(ptrs.tobytes())
    monkeypatch.setenv("TOKLOAD_INDEX_MEMORY", "0")
    view = tokload.TokenStream(tmp_path / "m", window=16, boundaries=True)
    with pytest.raises(CorruptDataError, match=r"m: the document index is not sorted by row"):
        view.read_batch(np.arange(1), np.empty)


def test_a_megatron_prefix_that_ends_in_bin(tmp_path: Path) -> None:
    """review52: ``open_megatron("corpus.bin")`` read the pair corpus.bin.bin and
    corpus.bin.idx, but ``Documents("corpus.bin")`` took ``.bin`` for the data file's
    suffix and found no dataset there."""
    for ext in (".bin", ".idx"):
        (tmp_path / f"corpus.bin{ext}").write_bytes((MEGATRON / f"tiny_uint16{ext}").read_bytes())
    want = len(Documents(MEGATRON / "tiny_uint16"))
    for name in ("corpus.bin", "corpus.bin.idx", "corpus.bin.bin"):
        assert len(Documents(tmp_path / name)) == want


def test_bad_megatron_files(tmp_path: Path) -> None:
    for ext in (".bin", ".idx"):
        (tmp_path / f"t{ext}").write_bytes((MEGATRON / f"tiny_uint16{ext}").read_bytes())
    idx = bytearray((tmp_path / "t.idx").read_bytes())
    (tmp_path / "t.idx").write_bytes(b"NOTMEGA\0\0" + idx[9:])
    with pytest.raises(FormatError, match=r"t\.idx: bad magic"):
        tokload.open_megatron(tmp_path / "t")
    (tmp_path / "t.idx").write_bytes(idx[:100])
    with pytest.raises(
        FormatError,
        match=r"t\.idx: 100 bytes, but 53 sequences and 38 document "
        r"indices need 974",
    ):
        tokload.open_megatron(tmp_path / "t")
    size = (tmp_path / "t.bin").stat().st_size
    rows = size // 2
    first = int.from_bytes(idx[34 : 34 + 4], "little")  # sequence 0's length
    for pointer, message in [
        (3, rf"the pointer of sequence 0: bad value 3 at byte 246 \(not a multiple of 2 "
            rf"within the \.bin's {size} bytes\)"),
        (10**9, rf"sequence 0 \({first} rows from byte 1000000000\) ends at byte "
                rf"{10**9 + 2 * first} of the \.bin, which holds {size} bytes \({rows} rows\): "
                r"the \.bin is shorter than the \.idx says \(a copy cut short\?\), or the "
                r"\.idx entry at byte 246 is damaged"),
    ]:  # fmt: skip
        bad = bytearray(idx)
        bad[34 + 4 * 53 : 34 + 4 * 53 + 8] = pointer.to_bytes(8, "little")  # sequence 0's
        (tmp_path / "t.idx").write_bytes(bad)
        docs = Documents(tmp_path / "t")
        with pytest.raises(CorruptDataError, match=r"t\.idx: " + message):
            docs.read([0])
    np.testing.assert_array_equal(docs[1], Documents(MEGATRON / "tiny_uint16")[1])
    # a bad length is named as the length, at its own byte (it was 'the pointer')
    bad = bytearray(idx)
    bad[34 + 4 : 34 + 8] = (-1).to_bytes(4, "little", signed=True)  # sequence 1's
    (tmp_path / "t.idx").write_bytes(bad)
    with pytest.raises(
        CorruptDataError, match=r"t\.idx: the length of sequence 1: bad value -1 at byte 38$"
    ):
        Documents(tmp_path / "t").read([1])
    bad[34 + 4 : 34 + 8] = (rows + 1).to_bytes(4, "little", signed=True)
    (tmp_path / "t.idx").write_bytes(bad)
    with pytest.raises(
        CorruptDataError, match=rf"t\.idx: sequence 1 \({rows + 1} rows from byte \d+\) ends "
        rf"at byte \d+ of the \.bin, which holds {size} bytes .* entry at byte 38 is damaged"
    ):  # fmt: skip
        Documents(tmp_path / "t").read([1])
    # a .bin cut short by whole rows (an interrupted copy): said so, not a bad pointer
    (tmp_path / "t.idx").write_bytes(idx)
    (tmp_path / "t.bin").write_bytes((MEGATRON / "tiny_uint16.bin").read_bytes()[: size // 2])
    with pytest.raises(CorruptDataError, match=r"the \.bin is shorter than the \.idx says"):
        Documents(tmp_path / "t").read([52])
    (tmp_path / "t.bin").unlink()
    with pytest.raises(MissingShardError, match="missing Megatron data"):
        tokload.open_megatron(tmp_path / "t")


# ---- manifests: every malformation is a FormatError naming the manifest and the key --------


def _manifest_cases() -> list[tuple[str, Any, str]]:
    """(what, how to change the manifest, expected message after the manifest path)."""

    def shard(**kw: Any) -> Any:
        return lambda m: m["shards"][0].update(kw)

    return [
        ("version 1.0", {"version": 1.0}, r"unknown format version 1\.0"),
        ("version true", {"version": True}, r"unknown format version True"),
        ("documents yes", {"documents": "yes"}, r"'documents' must be true or false, got 'yes'"),
        ("metadata 0", {"metadata": 0}, r"'metadata' must be true or false, got 0"),
        ("no dtype", lambda m: m.pop("dtype"), r"malformed manifest: no 'dtype'"),
        ("big-endian", {"dtype": ">u4"}, r"dtype: rows must be little-endian, got dtype >u4"),
        (
            "big-endian field",
            {"dtype": [["token", ">u4"]]},
            r"field 'token' must be little-endian, got >u4",
        ),
        ("dtype number", {"dtype": 5}, r"dtype must be a string or a list of \[name, format\]"),
        ("dtype unknown", {"dtype": "u4x"}, r"dtype: unsupported dtype 'u4x'"),
        ("dtype as string", {"dtype": "u4,u2"}, r"'u4,u2' is a structured dtype"),
        ("dtype pair", {"dtype": [["token"]]}, r"dtype\[0\] must be a \[name, format\] pair"),
        ("bool dtype", {"dtype": "|b1"}, r"rows must be integers, got dtype bool"),
        ("shards object", {"shards": {}}, r"'shards' must be a list, got \{\}"),
        ("shard string", {"shards": ["x"]}, r"shards\[0\] must be an object, got 'x'"),
        ("rows true", shard(rows=True), r"shards\[0\] \('s-00000'\)\.rows must be a non-negative"),
        ("rows float", shard(rows=2.0), r"\.rows must be a non-negative integer, got 2\.0"),
        ("rows huge", shard(rows=2**70), r"\.rows is out of range: 1180591620717411303424"),
        ("documents list", shard(documents=[1]), r"\.documents must be a non-negative"),
        ("empty name", shard(name=""), r"shards\[0\]\.name '' is empty"),
        ("NUL", shard(name="s-0\x000000"), r"\.name 's-0\\x000000' contains a NUL character"),
        ("surrogate", shard(name="s\ud800"), r"contains an unpaired surrogate"),
        ("absolute", shard(name="/etc/passwd"), r"is an absolute path"),
        ("dir name", shard(name="sub/.."), r"'sub/\.\.' does not end in a file name"),
        ("name number", shard(name=7), r"shards\[0\]\.name must be a string, got 7"),
        ("checksums", shard(xxh3_64={"rows": "XYZ"}), r"\.xxh3_64\.rows must be 16 lowercase"),
        ("checksums list", shard(xxh3_64=[]), r"\.xxh3_64 must be an object, got \[\]"),
    ]


def test_a_shard_listed_under_two_spellings_of_its_name_is_refused(tmp_path: Path) -> None:
    """``x`` and ``./x`` passed the "listed twice" check (exact strings), and the
    shard's documents were read twice."""
    with Writer(tmp_path / "ds", "<u2") as w:
        w.write(np.arange(10, dtype=np.uint16))
    path = tmp_path / "ds" / "manifest.json"
    m = json.loads(path.read_text())
    shard = m["shards"][0]
    for other in ("./" + shard["name"], "sub/../" + shard["name"], shard["name"]):
        m["shards"] = [shard, dict(shard, name=other)]
        path.write_text(json.dumps(m))
        same = "is listed twice" if other == shard["name"] else "name the same files"
        with pytest.raises(FormatError, match=same):
            tokload.Documents(tmp_path / "ds")


def test_a_merge_refuses_a_part_whose_path_is_not_unicode(tmp_path: Path) -> None:
    """A part directory whose name is not UTF-8 (its bytes kept by Python as
    surrogate escapes) was merged into a manifest that no open could read."""
    part = os.fsdecode(os.fsencode(str(tmp_path)) + b"/part-\xe9")
    with Writer(part, "<u2") as w:
        w.write(np.arange(10, dtype=np.uint16))
    with pytest.raises(FormatError, match=r"unpaired surrogate"):
        tokload.merge(tmp_path / "merged", [part])
    assert not (tmp_path / "merged" / "manifest.json").exists()


def test_a_writer_opened_by_a_relative_path_survives_a_chdir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The shards, the directory's fsync and the manifest went to the name relative
    to the working directory of the moment: after a ``chdir`` the dataset was left
    without a manifest (or the manifest went to another dataset's place)."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    monkeypatch.chdir(tmp_path / "a")
    with Writer("corpus", "<u2", shard_bytes=64) as w:
        w.write(np.arange(20, dtype=np.uint16))
        monkeypatch.chdir(tmp_path / "b")
        w.write(np.arange(40, dtype=np.uint16))
    assert len(tokload.Documents(tmp_path / "a" / "corpus")) == 2
    assert not (tmp_path / "b" / "corpus").exists()


@pytest.mark.parametrize(("what", "change", "message"), _manifest_cases())
def test_malformed_manifest_names_the_manifest_and_key(
    tmp_path: Path, what: str, change: Any, message: str
) -> None:
    ds = small(tmp_path / "ds")
    m = json.loads((ds / "manifest.json").read_text())
    if callable(change):
        change(m)
    else:
        m.update(change)
    (ds / "manifest.json").write_text(json.dumps(m))
    mpath = re.escape(str(ds / "manifest.json"))
    with pytest.raises(FormatError, match=rf"^{mpath}: .*{message}"):
        tokload.open_dataset(ds)


def test_unreadable_manifest_text(tmp_path: Path) -> None:
    ds = small(tmp_path / "ds")
    mfile = ds / "manifest.json"
    text = mfile.read_bytes()
    mpath = re.escape(str(mfile))
    cases = [
        (text.replace(b'"<u4"', b'"<u4\xff"'), rf"^{mpath}: not UTF-8 text \(byte \d+: invalid"),
        (b"[" * 100_000 + b"]" * 100_000, rf"^{mpath}: JSON nested too deeply"),
        (
            text.replace(b'"user": {}', b'"user": {"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"),
            rf"^{mpath}: JSON nested too deeply",
        ),
        (text.replace(b'"rows": 20', b'"rows": 2' + b"0" * 5000), rf"^{mpath}: not valid JSON"),
        (b"[1, 2]", rf"^{mpath}: not a tokload manifest"),
        (b"", rf"^{mpath}: not valid JSON"),
    ]
    for raw, message in cases:
        assert raw != text
        mfile.write_bytes(raw)
        with pytest.raises(FormatError, match=message):
            tokload.open_dataset(ds)


@pytest.mark.parametrize("user", [5, "notes", [1, 2], None, {"k": [1, {"x": None}]}, True])
def test_user_field_of_any_json_type_is_ignored(tmp_path: Path, user: Any) -> None:
    ds = small(tmp_path / "ds")
    m = json.loads((ds / "manifest.json").read_text())
    m["user"] = user
    (ds / "manifest.json").write_text(json.dumps(m))
    np.testing.assert_array_equal(Documents(ds)[5], np.arange(10) + 500)
    # FORMAT.md: free-form JSON of any type for the writer's own notes. One that was
    # not an object became {} when tokload rewrote the manifest (review47)
    with Writer(ds, "<u4", mode="a", name_prefix="t") as w:
        w.write(np.arange(3, dtype=np.uint32))
    kept = json.loads((ds / "manifest.json").read_text())["user"]
    assert kept == (user if user is not None else {})


def test_shard_names_with_slashes_and_dotdot_work(tmp_path: Path) -> None:
    """FORMAT.md allows '/' and '..' inside names (merged datasets use both)."""
    ds = small(tmp_path / "ds")
    (ds / "sub").mkdir()
    (tmp_path / "side").mkdir()
    m = json.loads((ds / "manifest.json").read_text())
    moved = {"s-00000": "sub/a", "s-00001": "../side/b"}
    for s in m["shards"]:
        if s["name"] in moved:
            for ext in ("rows", "docs"):
                (ds / f"{s['name']}.{ext}").rename(ds / f"{moved[s['name']]}.{ext}")
            s["name"] = moved[s["name"]]
    (ds / "manifest.json").write_text(json.dumps(m))
    docs = Documents(ds)
    for k in range(6):
        np.testing.assert_array_equal(docs[k], np.arange(10) + 100 * k)


# ---- special files are refused before they are opened, never waited on ----------------------


def _special(path: Path, kind: str) -> None:
    path.unlink(missing_ok=True)
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "device":
        path.symlink_to("/dev/zero")
    elif kind == "directory":
        path.mkdir()
    else:
        sock = socket.socket(socket.AF_UNIX)
        sock.bind(str(path))
        sock.close()


SPECIAL = {
    "fifo": "a FIFO",
    "device": "a character device",
    "directory": "a directory",
    "socket": "a socket",
}


@pytest.mark.parametrize("kind", sorted(SPECIAL))
@pytest.mark.parametrize("victim", ["manifest.json", "s-00001.rows", "s-00002.docs", "s-00000.mdx"])
def test_special_file_in_a_dataset_is_refused_without_blocking(
    tmp_path: Path, kind: str, victim: str
) -> None:
    ds = small(tmp_path / "ds", metadata=True)
    _special(ds / victim, kind)
    with no_hang(10), pytest.raises(FormatError) as e:
        StreamWithMetadata(ds, window=4)
    assert str(e.value).startswith(f"{ds / victim}: ")
    assert f"is {SPECIAL[kind]}, not a regular file" in str(e.value)


@pytest.mark.parametrize("kind", sorted(SPECIAL))
def test_special_file_in_foreign_formats_is_refused_without_blocking(
    tmp_path: Path, kind: str
) -> None:
    for ext in (".bin", ".idx"):
        (tmp_path / f"t{ext}").write_bytes((MEGATRON / f"tiny_uint16{ext}").read_bytes())
    np.arange(20, dtype=np.uint16).tofile(tmp_path / "flat.bin")
    np.save(tmp_path / "flat.npy", np.arange(20, dtype=np.uint16))
    opens: list[tuple[str, Callable[[], tokload.Source]]] = [
        ("t.idx", lambda: tokload.open_megatron(tmp_path / "t")),
        ("t.bin", lambda: tokload.open_megatron(tmp_path / "t")),
        ("flat.bin", lambda: tokload.open_flat(tmp_path / "flat.bin", np.uint16)),
        ("flat.npy", lambda: tokload.open_flat(tmp_path / "flat.npy")),
        (
            "i.npy",
            lambda: tokload.open_flat(
                tmp_path / "flat.bin", np.uint16, doc_index=tmp_path / "i.npy"
            ),
        ),
    ]
    for victim, opener in opens:
        saved = (tmp_path / victim).read_bytes() if (tmp_path / victim).is_file() else None
        _special(tmp_path / victim, kind)
        with no_hang(10), pytest.raises(FormatError, match=f"is {SPECIAL[kind]}, not a regular"):
            opener()
        _remove(tmp_path / victim)
        if saved is not None:
            (tmp_path / victim).write_bytes(saved)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        path.rmdir()
    else:
        path.unlink()


# ---- modes, exports ------------------------------------------------------------------------


@pytest.mark.parametrize("umask", [0o022, 0o027, 0o077])
def test_manifest_mode_follows_the_umask_like_the_shards(tmp_path: Path, umask: int) -> None:
    old = os.umask(umask)
    try:
        ds = small(tmp_path / "ds")
        merged = tokload.merge(tmp_path / "merged", [ds])
    finally:
        os.umask(old)
    assert merged.shards
    want = 0o666 & ~umask
    assert stat.S_IMODE(os.stat(ds / "s-00000.rows").st_mode) == want
    assert stat.S_IMODE(os.stat(ds / "manifest.json").st_mode) == want
    assert stat.S_IMODE(os.stat(tmp_path / "merged" / "manifest.json").st_mode) == want


def test_every_public_exception_is_exported_at_the_top_level() -> None:
    assert tokload.StateError is tokload.errors.StateError
    assert tokload.__all__ == sorted(tokload.__all__)
    modules = [m for name, m in vars(tokload).items() if isinstance(m, types.ModuleType)]
    modules += [sys.modules[n] for n in list(sys.modules) if n.startswith("tokload.")]
    found = {
        name
        for mod in modules
        for name, obj in vars(mod).items()
        if isinstance(obj, type)
        and issubclass(obj, tokload.TokloadError)
        and not name.startswith("_")
        and obj.__module__.startswith("tokload")
    }
    assert "StateError" in found
    missing = sorted(found - set(tokload.__all__))
    assert not missing, f"not exported at the top level: {missing}"
    # and from tokload.errors, for `from tokload.errors import *`
    defined = {n for n in found if getattr(tokload, n).__module__ == "tokload.errors"}
    assert sorted(defined - set(tokload.errors.__all__)) == []
    for name in found:
        assert getattr(tokload, name).__name__ == name


@pytest.mark.parametrize("raw", ["lots", "-1", "1.5", "0x10", str(1 << 63)])
def test_an_integer_setting_that_is_not_one_names_the_variable(
    raw: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``tokload.envvars.env_int`` (TOKLOAD_INDEX_MEMORY, TOKLOAD_HOST_CACHE_MB,
    TOKLOAD_MAX_OPEN_FILES): unset or empty gives the default, an integer at or
    above the bound is taken, anything else names the variable and its value."""
    from tokload.envvars import env_int

    monkeypatch.delenv("TOKLOAD_TEST_SETTING", raising=False)
    assert env_int("TOKLOAD_TEST_SETTING", 7, 0, "x") == 7
    monkeypatch.setenv("TOKLOAD_TEST_SETTING", "")
    assert env_int("TOKLOAD_TEST_SETTING", 7, 0, "x") == 7
    monkeypatch.setenv("TOKLOAD_TEST_SETTING", " 12 ")
    assert env_int("TOKLOAD_TEST_SETTING", 7, 0, "x") == 12
    monkeypatch.setenv("TOKLOAD_TEST_SETTING", raw)
    want = f"TOKLOAD_TEST_SETTING={raw!r}: expected a count (>= 0)"
    with pytest.raises(ValueError, match=re.escape(want)):
        env_int("TOKLOAD_TEST_SETTING", 7, 0, "a count (>= 0)")


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ({"version": 2, "metadata_layout": "blocks"}, r"'metadata_layout' must be one of"),
        ({"version": 2, "metadata_layout": "bogus"}, r"got 'bogus' in version 2"),
        ({"shard0": {"metadata_records": 3}}, r"has 3 metadata records and 0 bytes, but the"),
        ({"shard0": {"metadata_bytes": 3}}, r"has 0 metadata records and 3 bytes, but the"),
    ],
)
def test_what_format_md_forbids_without_metadata_is_refused(
    tmp_path: Path, edit: dict[str, Any], message: str
) -> None:
    """Without metadata, a layout FORMAT.md forbids and metadata counts other than 0
    ("all but name and rows 0 when unused") were taken (review47)."""
    ds = small(tmp_path / "ds")
    m = json.loads((ds / "manifest.json").read_text())
    m["shards"][0].update(edit.pop("shard0", {}))
    m.update(edit)
    (ds / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(FormatError, match=message):
        tokload.open_dataset(ds)
