"""Bad input raises a tokload exception that names the file and the value."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import tokload
from tokload import (
    CorruptDataError,
    Documents,
    FormatError,
    MissingShardError,
    StreamWithMetadata,
    TokenStream,
    TruncatedFileError,
    Writer,
)

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


def test_document_offsets_decreasing_or_past_the_end(tmp_path: Path) -> None:
    ds = small(tmp_path / "ds")
    docs = Documents(ds)
    idx = np.fromfile(ds / "s-00000.docs", "<u8")
    np.array([0, 11, 5], "<u8").tofile(ds / "s-00000.docs")  # 11 > 5: decreasing
    with pytest.raises(
        CorruptDataError,
        match=r"s-00000\.docs: the document index entry of "
        r"document 1: bad value 11 at byte 8",
    ):
        docs.read([1])
    np.array([0, 10, 21], "<u8").tofile(ds / "s-00000.docs")  # past the shard's 20 rows
    with pytest.raises(CorruptDataError, match=r"bad value 21"):
        docs.read([1])
    idx.tofile(ds / "s-00000.docs")
    np.testing.assert_array_equal(docs[1], np.arange(10) + 100)


def test_metadata_offsets_and_ids(tmp_path: Path) -> None:
    ds = small(tmp_path / "ds", metadata=True)
    view = StreamWithMetadata(ds, window=10)
    good = np.fromfile(ds / "s-00000.mdx", "<u8")
    assert good.tolist() == [0, 4, 10, 14, 20]
    np.array([0, 4, 3, 14, 20], "<u8").tofile(ds / "s-00000.mdx")
    with pytest.raises(
        CorruptDataError,
        match=r"s-00000\.mdx: the metadata index: bad value 3 "
        r"at byte 16",
    ):
        view.read([0])
    np.array([0, 4, 10, 14, 99], "<u8").tofile(ds / "s-00000.mdx")
    with pytest.raises(CorruptDataError, match=r"bad value 99 at byte 32"):
        view.read([1])
    good.tofile(ds / "s-00000.mdx")
    assert view[1].metadata == [b"abcd", b"efghij"]
    rows = np.fromfile(ds / "s-00001.rows", np.dtype(META_DT))
    rows["metadata_id"][3] = 7  # the shard has 4 records
    rows.tofile(ds / "s-00001.rows")
    with pytest.raises(
        CorruptDataError,
        match=r"s-00001\.rows: row 3 has metadata id 7, but the "
        r"shard has 4 metadata records",
    ):
        view.read([2])


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
    with pytest.raises(TypeError, match=r"out must have dtype uint32, got int64"):
        stream.read([0], out=np.empty((1, 7), np.int64))
    with pytest.raises(ValueError, match=r"out has shape \(2, 7\), expected \(1, 7\)"):
        stream.read([0], out=np.empty((2, 7), np.uint32))
    with pytest.raises(ValueError, match=r"window must be a positive integer, got 0"):
        TokenStream(ds, window=0)
    with pytest.raises(FormatError, match="has no metadata"):
        StreamWithMetadata(ds, window=3)
    stream.close()
    with pytest.raises(ValueError, match="closed dataset"):
        stream.read([0])


def test_writer_rejects_bad_spans_and_modes(tmp_path: Path) -> None:
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
        Writer(tmp_path / "n", "<u4", metadata=True)
    padded = np.dtype(
        {"names": ["a", "b"], "formats": ["<u4", "<u2"], "offsets": [0, 4], "itemsize": 8}
    )
    with pytest.raises(
        FormatError,
        match=r"packed without padding: 6 bytes of fields in a "
        r"row of 8 bytes",
    ):
        Writer(tmp_path / "pad", padded)
    with pytest.raises(FormatError, match=r"differs from"):
        tokload.merge(tmp_path / "mm", [tmp_path / "m", tmp_path / "p"])


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
    bad = bytearray(idx)
    bad[34 + 4 * 53 : 34 + 4 * 53 + 8] = (10**9).to_bytes(8, "little")  # pointer 0 past the .bin
    (tmp_path / "t.idx").write_bytes(bad)
    docs = Documents(tmp_path / "t")
    with pytest.raises(
        CorruptDataError,
        match=r"t\.idx: the pointer of sequence 0: bad value "
        r"1000000000",
    ):
        docs.read([0])
    np.testing.assert_array_equal(docs[1], Documents(MEGATRON / "tiny_uint16")[1])
    (tmp_path / "t.bin").unlink()
    with pytest.raises(MissingShardError, match="missing Megatron data"):
        tokload.open_megatron(tmp_path / "t")
