"""tokload build splits every input into chunks: where they fall, that any split gives
the same tokens and the same files, per-chunk integrity, line numbers past the first
chunk, progress within a chunk, --part across one file."""

from __future__ import annotations

import hashlib
import itertools
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_build import dataset_files, write_corpus

import tokload
from tokload import BuildError, Documents, build
from tokload.__main__ import main
from tokload.build_part import build_chunk
from tokload.build_plan import BuildOptions, Chunk, _line_bounds, plan_chunks
from tokload.format import read_manifest


def one_file(tmp_path: Path, docs: int = 400) -> Path:
    """One JSONL file (~40 KB) made of the test corpus's records."""
    parts = write_corpus(tmp_path / "src", files=4, docs=docs // 4)
    big = tmp_path / "big.jsonl"
    big.write_bytes(b"".join(p.read_bytes() for p in parts))
    return big


def tokens_of(path: Path) -> list[list[int]]:
    docs = Documents(path)
    return [np.asarray(docs[i]["token"]).tolist() for i in range(len(docs))]


@settings(max_examples=200, deadline=None)
@given(
    lines=st.lists(st.binary(max_size=40).map(lambda b: b.replace(b"\n", b"")), max_size=30),
    trailing_newline=st.booleans(),
    chunk=st.integers(1, 120),
)
def test_chunk_bounds_are_line_starts_covering_the_file(
    tmp_path_factory: pytest.TempPathFactory, lines: list[bytes], trailing_newline: bool, chunk: int
) -> None:
    data = b"\n".join(lines) + (b"\n" if trailing_newline and lines else b"")
    p = tmp_path_factory.mktemp("b") / "x.jsonl"
    p.write_bytes(data)
    bounds = _line_bounds(p, len(data), chunk)
    assert bounds[0] == 0 and bounds[-1] == len(data)
    assert all(a < b for a, b in itertools.pairwise(bounds)) or data == b""
    # exactly the first line start at or after each nominal boundary k * chunk
    starts = [i + 1 for i, c in enumerate(data) if c == 0x0A and i + 1 < len(data)]
    moved = {
        min(s for s in starts if s >= nom)
        for nom in range(chunk, len(data), chunk)
        if any(s >= nom for s in starts)
    }
    assert bounds == [0, *sorted(moved), len(data)]
    # the chunks' lines, in order, are the file's lines
    pieces = [data[a:b] for a, b in itertools.pairwise(bounds)]
    assert b"".join(pieces) == data


def test_any_chunk_size_gives_the_same_tokens_and_workers_the_same_files(tmp_path: Path) -> None:
    big = one_file(tmp_path)
    size = big.stat().st_size
    ref = tmp_path / "whole"
    s = build([big], ref, keep_fields=["id"], annotations_field="spans", progress=False)
    assert s.chunks == 1
    want = tokens_of(ref)
    for chunk_bytes, workers in ((size // 7, 1), (size // 7, 2), (997, 2)):
        out = tmp_path / f"c{chunk_bytes}-{workers}"
        s = build(
            [big],
            out,
            keep_fields=["id"],
            annotations_field="spans",
            chunk_bytes=chunk_bytes,
            workers=workers,
            progress=False,
        )
        assert s.chunks == len(list((out / "parts").iterdir())) > 1
        assert s.documents == 400
        assert tokens_of(out) == want
        view = tokload.StreamWithMetadata(out, window=64, deserialize=json.loads)
        ref_view = tokload.StreamWithMetadata(ref, window=64, deserialize=json.loads)
        for i in range(0, len(view), 37):
            assert repr(view[i]) == repr(ref_view[i])
    assert dataset_files(tmp_path / f"c{size // 7}-1") == dataset_files(
        tmp_path / f"c{size // 7}-2"
    )


def test_each_chunk_records_its_range_and_the_hash_of_its_bytes(tmp_path: Path) -> None:
    big = one_file(tmp_path)
    out = tmp_path / "ds"
    s = build([big], out, chunk_bytes=10_000, progress=False)
    data = big.read_bytes()
    ends = []
    for c in range(s.chunks):
        rec = read_manifest(out / "parts" / f"00000-{c:05d}").user["build"]
        ch = rec["chunk"]
        assert (ch["index"], ch["count"], ch["unit"]) == (c, s.chunks, "bytes")
        assert ch["sha256"] == hashlib.sha256(data[ch["start"] : ch["end"]]).hexdigest()
        assert ch["start"] == 0 or data[ch["start"] - 1] == ord("\n")
        assert rec["options"]["chunk_bytes"] == 10_000
        ends.append((ch["start"], ch["end"]))
    assert ends[0][0] == 0 and ends[-1][1] == len(data)
    assert all(a[1] == b[0] for a, b in itertools.pairwise(ends))
    # another chunk size is another layout: every chunk rebuilt, the old ones removed
    s2 = build([big], out, chunk_bytes=20_000, progress=False)
    assert s2.built == s2.chunks < s.chunks and s2.removed == s.chunks - s2.chunks
    assert sorted(p.name for p in (out / "parts").iterdir()) == [
        f"00000-{c:05d}" for c in range(s2.chunks)
    ]


def test_an_edit_in_one_chunk_rebuilds_that_input_only(tmp_path: Path) -> None:
    big = one_file(tmp_path)
    other = write_corpus(tmp_path / "o", files=1)[0]
    out = tmp_path / "ds"
    s = build([big, other], out, chunk_bytes=10_000, progress=False)
    with open(big, "a") as f:
        f.write(json.dumps({"text": "appended"}) + "\n")
    s2 = build([big, other], out, chunk_bytes=10_000, progress=False)
    # the input's identity changed: all its chunks, and only its, are rebuilt
    assert s2.built == len(plan_chunks([big], 10_000)) < s2.chunks
    assert s2.documents == s.documents + 1
    fresh = tmp_path / "fresh"
    build([big, other], fresh, chunk_bytes=10_000, progress=False)
    assert dataset_files(out) == dataset_files(fresh)


@pytest.mark.parametrize("damage", ["deleted", "cut short"])
def test_a_chunk_whose_shard_file_is_damaged_is_rebuilt(tmp_path: Path, damage: str) -> None:
    """A chunk whose shard file was deleted (or cut short) since was reused by its
    record; the build then failed and left a top-level manifest listing the file
    (review37). It is rebuilt, and the dataset equals a fresh build."""
    inputs = write_corpus(tmp_path / "in", files=3)
    out = tmp_path / "ds"
    build(inputs, out, progress=False)
    (rows,) = sorted((out / "parts").glob("00001-*/*.rows"))
    if damage == "deleted":
        rows.unlink()
    else:
        rows.write_bytes(rows.read_bytes()[:-2])
    s = build(inputs, out, progress=False)
    assert s.built == 1 and s.chunks == 3
    fresh = tmp_path / "fresh"
    build(inputs, fresh, progress=False)
    assert dataset_files(out) == dataset_files(fresh)


def test_a_build_whose_final_check_fails_leaves_no_manifest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The build writes the top-level manifest, then opens the dataset as a reader
    would (sizes checked); when that fails, the manifest it wrote is removed: a
    failed build leaves none."""
    import tokload.builder

    inputs = write_corpus(tmp_path / "in", files=2)

    def damaged(path: Any) -> Any:
        raise tokload.FormatError(f"{path}: damaged")

    monkeypatch.setattr(tokload.builder, "open_dataset", damaged)
    with pytest.raises(tokload.FormatError, match="damaged"):
        build(inputs, tmp_path / "ds", progress=False)
    assert not (tmp_path / "ds" / "manifest.json").exists()
    assert len(list((tmp_path / "ds" / "parts").iterdir())) == 2  # kept for a re-run


def test_a_bad_line_in_a_later_chunk_is_named_by_its_line_in_the_file(tmp_path: Path) -> None:
    big = one_file(tmp_path)
    lines = big.read_text().splitlines(keepends=True)
    lines.insert(350, "{broken\n")
    big.write_text("".join(lines))
    with pytest.raises(BuildError, match=r"big\.jsonl:351: malformed JSON"):
        build([big], tmp_path / "ds", chunk_bytes=5_000, progress=False)
    s = build([big], tmp_path / "ds", chunk_bytes=5_000, on_error="skip", progress=False)
    assert s.skipped == {"malformed JSON": 1} and s.documents == 400


def test_parquet_row_groups_are_chunks(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    recs = [{"text": f"row {i} " * (i % 13 + 1), "id": i} for i in range(1000)]
    p = tmp_path / "t.parquet"
    pq.write_table(pa.Table.from_pylist(recs), p, row_group_size=100)
    whole = build([p], tmp_path / "whole", keep_fields=["id"], progress=False)
    assert whole.chunks == 1
    s = build([p], tmp_path / "rg", keep_fields=["id"], chunk_bytes=1, workers=2, progress=False)
    assert s.chunks == 10 and s.documents == 1000
    assert tokens_of(tmp_path / "rg") == tokens_of(tmp_path / "whole")
    rec = read_manifest(tmp_path / "rg" / "parts" / "00000-00003").user["build"]["chunk"]
    assert (rec["unit"], rec["start"], rec["end"]) == ("row_groups", 3, 4)
    meta = pq.ParquetFile(p).metadata.row_group(3)
    cols = [meta.column(j) for j in range(meta.num_columns)]
    a = min(c.dictionary_page_offset or c.data_page_offset for c in cols)
    b = max(
        (c.dictionary_page_offset or c.data_page_offset) + c.total_compressed_size for c in cols
    )
    assert rec["sha256"] == hashlib.sha256(p.read_bytes()[a:b]).hexdigest()
    # a bad row is named by its row in the file, not in the chunk
    recs[642]["text"] = None
    pq.write_table(pa.Table.from_pylist(recs), p, row_group_size=100)
    with pytest.raises(BuildError, match=r"t\.parquet:643: field 'text' is null, not a string"):
        build([p], tmp_path / "bad", chunk_bytes=1, progress=False)


def test_compressed_and_text_inputs_are_one_chunk(tmp_path: Path) -> None:
    import gzip

    lines = "".join(json.dumps({"text": f"doc {i}"}) + "\n" for i in range(2000))
    with gzip.open(tmp_path / "a.jsonl.gz", "wt") as f:
        f.write(lines)
    (tmp_path / "b.txt").write_text("x\n" * 5000)
    plan = plan_chunks([tmp_path / "a.jsonl.gz", tmp_path / "b.txt"], 100)
    assert [(c.input, c.unit, c.count) for c in plan] == [(0, "file", 1), (1, "file", 1)]


def test_progress_moves_within_a_chunk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    p = tmp_path / "one.jsonl"
    text = "the quick brown fox " * 500
    with open(p, "w") as f:
        for i in range(1500):  # ~15 MB: more than 3 reports of 4 MB
            f.write(json.dumps({"text": text, "id": i}) + "\n")
    (chunk,) = plan_chunks([p], 1 << 30)
    (tmp_path / "ds" / "parts").mkdir(parents=True)
    reports: list[tuple[int, int, int]] = []
    rest = build_chunk(
        chunk, BuildOptions(), str(tmp_path / "ds"), {}, report=lambda *c: reports.append(c)
    )
    assert len(reports) >= 3
    # bytes, documents and tokens: the reports and the rest add up to the chunk's
    assert sum(r[0] for r in reports) + rest[0] == chunk.size == p.stat().st_size
    assert sum(r[1] for r in reports) + rest[1] == 1500
    rows = read_manifest(tmp_path / "ds" / "parts" / chunk.name).rows
    assert sum(r[2] for r in reports) + rest[2] == rows
    assert all(r[1] > 0 and r[2] > 0 for r in reports)

    # through the worker pool too: the parent's progress gets more updates than chunks
    updates: list[tuple[int, int, int]] = []

    class Bar:
        def __init__(self, *args: object) -> None:
            pass

        def update(self, n: int, docs: int = 0, tokens: int = 0) -> None:
            updates.append((n, docs, tokens))

        def close(self) -> None:
            pass

    monkeypatch.setattr(tokload.builder, "Progress", Bar)
    q = tmp_path / "two.jsonl"
    q.write_bytes(p.read_bytes())
    s = build([p, q], tmp_path / "pool", workers=2, progress=True)
    assert s.chunks == 2 and len(updates) > 2
    assert sum(u[0] for u in updates) == 2 * p.stat().st_size
    assert sum(u[1] for u in updates) == s.documents == 3000
    assert sum(u[2] for u in updates) == s.tokens


def test_an_input_changed_after_planning_is_refused(tmp_path: Path) -> None:
    big = one_file(tmp_path)
    (chunk,) = plan_chunks([big], 1 << 20)
    with open(big, "a") as f:
        f.write("\n")
    (tmp_path / "ds" / "parts").mkdir(parents=True)
    with pytest.raises(BuildError, match=r"big\.jsonl: changed while the build was running"):
        build_chunk(chunk, BuildOptions(), str(tmp_path / "ds"), {})
    assert not list((tmp_path / "ds" / "parts").iterdir())


def test_part_slices_the_chunks_of_one_file(tmp_path: Path) -> None:
    big = one_file(tmp_path)
    single = tmp_path / "single"
    s = build([big], single, keep_fields=["id"], chunk_bytes=4_000, progress=False)
    assert s.chunks >= 6
    for k in range(3):
        args = ["build", str(big), "-o", str(tmp_path / f"p{k}"), "--part", f"{k}/3"]
        assert main([*args, "--keep-field", "id", "--chunk-size", "4000", "--no-progress"]) == 0
        names = sorted(p.name for p in (tmp_path / f"p{k}" / "parts").iterdir())
        lo, hi = k * s.chunks // 3, (k + 1) * s.chunks // 3
        assert names == [f"00000-{c:05d}" for c in range(lo, hi)]
    parts = [str(tmp_path / f"p{k}") for k in range(3)]
    assert main(["merge", str(tmp_path / "merged"), *parts]) == 0
    a, b = tokload.open_dataset(single), tokload.open_dataset(tmp_path / "merged")
    assert a.fingerprint == b.fingerprint
    # the chunks' files are the very same bytes as the single build's
    for k in range(3):
        for name, data in dataset_files(tmp_path / f"p{k}" / "parts").items():
            assert (single / "parts" / name).read_bytes() == data, name
    # more parts than chunks: the parts without a chunk are empty datasets with the
    # build's metadata layout (they failed on a 'per_token' layout without its field)
    n = s.chunks + 2
    many = [tmp_path / f"q{k}" for k in range(n)]
    for k, out in enumerate(many):
        args = ["build", str(big), "-o", str(out), "--part", f"{k}/{n}", "--keep-field", "id"]
        assert main([*args, "--chunk-size", "4000", "--no-progress"]) == 0
    assert main(["merge", str(tmp_path / "merged-many"), *map(str, many)]) == 0
    assert tokload.open_dataset(tmp_path / "merged-many").fingerprint == a.fingerprint


def test_chunk_names_and_records(tmp_path: Path) -> None:
    c = Chunk(3, "x", 12, 40, "bytes", 5, 9, 4, (9, 1))
    assert c.name == "00003-00012"
    assert c.record() == {"index": 12, "count": 40, "unit": "bytes", "start": 5, "end": 9}
    with pytest.raises(Exception, match="chunk_bytes must be a positive integer, got 0"):
        build([write_corpus(tmp_path, files=1)[0]], tmp_path / "o", chunk_bytes=0)
    bad: Any
    for name, bad, message in (
        ("chunk_bytes", 1.5, r"chunk_bytes must be a positive integer, got 1\.5"),
        ("shard_bytes", True, r"shard_bytes must be a positive integer, got True"),
        ("workers", 1.5, r"workers must be an integer >= 1, got 1\.5"),  # was 'at least 1'
    ):
        with pytest.raises(tokload.UsageError, match=message):
            build([write_corpus(tmp_path, files=1)[0]], tmp_path / "o", **{name: bad})
    assert not (tmp_path / "o").exists()


def test_offsets_are_asked_for_annotated_texts_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    inputs = write_corpus(tmp_path / "in", files=2)
    annotated = sum(
        bool(json.loads(line)["spans"]) for p in inputs for line in p.read_text().splitlines()
    )
    assert 0 < annotated < 60
    calls: list[tuple[int, bool]] = []
    real = tokload.tokenizer.ByteTokenizer.encode_many

    def spy(self: Any, texts: list[str], offsets: bool = True) -> Any:
        calls.append((len(texts), offsets))
        return real(self, texts, offsets)

    ref = tmp_path / "ref"
    build(inputs, ref, annotations_field="spans", keep_fields=["id"], progress=False)
    monkeypatch.setattr(tokload.tokenizer.ByteTokenizer, "encode_many", spy)
    out = tmp_path / "ds"
    build(inputs, out, annotations_field="spans", keep_fields=["id"], progress=False)
    assert sum(n for n, o in calls if o) == annotated
    assert sum(n for n, o in calls if not o) == 60 - annotated
    assert dataset_files(out) == dataset_files(ref)
