"""tokload build: a re-run rebuilds exactly the stale parts, and never lies.

Each stale case the issue lists (tokenizer changed, annotations added, input
list changed, input file modified) used to "build 0 parts" and write a
manifest over the old bytes; each test here compares the re-run's files with
a fresh build from the same arguments, byte for byte.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
from test_build import _hf_tokenizer, dataset_files, write_corpus

import tokload
from tokload import BuildError, build
from tokload.__main__ import main
from tokload.builder import BUILDER_VERSION
from tokload.format import read_manifest
from tokload.inputs import BUILD_MARKER


def run(inputs: Any, out: Path, **kw: Any) -> tokload.builder.BuildSummary:
    return build(inputs, out, progress=False, **kw)


def fresh_equals(inputs: Any, out: Path, tmp: Path, **kw: Any) -> None:
    """``out`` holds exactly the files a build from scratch writes."""
    ref = tmp / f"fresh-{len(list(tmp.iterdir()))}"
    run(inputs, ref, **kw)
    assert dataset_files(out) == dataset_files(ref)


def test_nothing_changed_rebuilds_nothing(tmp_path: Path) -> None:
    inputs = write_corpus(tmp_path / "in", files=3)
    out = tmp_path / "ds"
    assert run(inputs, out).built == 3
    before = dataset_files(out)
    s = run(inputs, out, workers=2)
    assert (s.built, s.removed, s.inputs) == (0, 0, 3)
    assert dataset_files(out) == before


def test_tokenizer_changed_rebuilds_every_part(tmp_path: Path) -> None:
    inputs = write_corpus(tmp_path / "in", files=3)
    tj = _hf_tokenizer(tmp_path / "tok.json")
    out = tmp_path / "ds"
    run(inputs, out)  # bytes
    s = run(inputs, out, tokenizer=tj)
    assert s.built == 3
    fresh_equals(inputs, out, tmp_path, tokenizer=tj)
    m = read_manifest(out)
    assert m.user["tokenizer"]["sha256"] == hashlib.sha256(tj.read_bytes()).hexdigest()
    # the same tokenizer under another name is the same tokenizer: nothing to rebuild
    shutil.copy(tj, tmp_path / "renamed.json")
    assert run(inputs, out, tokenizer=tmp_path / "renamed.json").built == 0
    # and back to bytes: rebuilt again
    assert run(inputs, out).built == 3
    assert read_manifest(out).user["tokenizer"]["kind"] == "bytes"
    assert not (out / "tokenizer.json").exists()
    fresh_equals(inputs, out, tmp_path)


def test_annotations_added_rebuild_with_metadata(tmp_path: Path) -> None:
    inputs = write_corpus(tmp_path / "in", files=2)
    out = tmp_path / "ds"
    run(inputs, out)
    assert not read_manifest(out).metadata
    s = run(inputs, out, annotations_field="spans", keep_fields=["id"])
    assert s.built == 2
    assert read_manifest(out).metadata
    fresh_equals(inputs, out, tmp_path, annotations_field="spans", keep_fields=["id"])


@pytest.mark.parametrize(
    ("option", "value"),
    [("bos", True), ("eos", False), ("text_field", "id"), ("shard_bytes", 999)],
)
def test_every_option_that_changes_the_output_rebuilds(
    tmp_path: Path, option: str, value: Any
) -> None:
    inputs = write_corpus(tmp_path / "in", files=2)
    out = tmp_path / "ds"
    run(inputs, out)
    assert run(inputs, out, **{option: value}).built == 2
    fresh_equals(inputs, out, tmp_path, **{option: value})


def test_input_list_changed(tmp_path: Path) -> None:
    a, b, c, d = write_corpus(tmp_path / "in", files=4)
    out = tmp_path / "ds"
    run([a, b, c], out)
    # b dropped: part 1 now comes from c (rebuilt), part 2 is gone
    s = run([a, c], out)
    assert (s.built, s.removed) == (1, 1)
    assert "1 stale chunks removed" in str(s)
    assert sorted(p.name for p in (out / "parts").iterdir()) == ["00000-00000", "00001-00000"]
    fresh_equals([a, c], out, tmp_path)
    assert read_manifest(out).user["inputs"] == [str(a), str(c)]
    # an input sorting after the others: only its part is built
    s = run([a, c, d], out)
    assert (s.built, s.removed) == (1, 0)
    fresh_equals([a, c, d], out, tmp_path)


def test_input_file_modified(tmp_path: Path) -> None:
    inputs = write_corpus(tmp_path / "in", files=3)
    out = tmp_path / "ds"
    run(inputs, out)
    # same size, other bytes, other mtime
    text = inputs[1].read_bytes()
    inputs[1].write_bytes(text.replace(b"fox", b"cat"))
    st = inputs[1].stat()
    os.utime(inputs[1], ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert inputs[1].stat().st_size == len(text)
    s = run(inputs, out)
    assert s.built == 1
    fresh_equals(inputs, out, tmp_path)
    # grown
    with open(inputs[2], "a") as f:
        f.write(json.dumps({"text": "one more"}) + "\n")
    assert run(inputs, out).built == 1
    fresh_equals(inputs, out, tmp_path)


def test_the_part_records_what_it_was_built_from(tmp_path: Path) -> None:
    pytest.importorskip("pyarrow")
    import pyarrow as pa
    import pyarrow.parquet as pq

    src = tmp_path / "in"
    src.mkdir()
    lines = "".join(json.dumps({"text": f"doc {i}"}) + "\n" for i in range(50))
    with gzip.open(src / "a.jsonl.gz", "wt") as f:
        f.write(lines)
    (src / "b.jsonl").write_text(lines)
    pq.write_table(pa.Table.from_pylist([{"text": "p"}] * 9), src / "c.parquet")
    (src / "d.txt").write_text("plain")
    out = tmp_path / "ds"
    run([src], out, keep_fields=["text"])
    for i, name in enumerate(["a.jsonl.gz", "b.jsonl", "c.parquet", "d.txt"]):
        rec = read_manifest(out / "parts" / f"{i:05d}-00000").user["build"]
        p = src / name
        st = p.stat()
        data = p.read_bytes()
        assert rec["input"] == {
            "path": str(p.resolve()),
            "size": st.st_size,
            "mtime_ns": st.st_mtime_ns,
        }
        if name.endswith(".parquet"):
            # one row group: everything between the magic "PAR1" and the footer
            footer = int.from_bytes(data[-8:-4], "little")
            covered, unit, end = data[4 : len(data) - 8 - footer], "row_groups", 1
        else:
            covered, unit, end = data, ("bytes" if name == "b.jsonl" else "file"), len(data)
        assert rec["chunk"] == {
            "index": 0,
            "count": 1,
            "unit": unit,
            "start": 0,
            "end": end,
            "sha256": hashlib.sha256(covered).hexdigest(),  # of the bytes on disk
        }
        assert rec["options"]["keep_fields"] == ["text"]
        assert rec["tokenizer"]["kind"] == "bytes"
        assert rec["format_version"] == tokload.format.FORMAT_VERSION
        assert rec["dtype"] == "<u2" and rec["builder"] == BUILDER_VERSION == 4


def test_part_token_counts_with_metadata(tmp_path: Path) -> None:
    inputs = write_corpus(tmp_path / "in", files=2)
    out = tmp_path / "ds"
    s = run(inputs, out, keep_fields=["id"], annotations_field="spans")
    total = 0
    for i in range(2):
        part = out / "parts" / f"{i:05d}-00000"
        stats = read_manifest(part).user["stats"]
        rows = tokload.open_dataset(part).num_rows
        assert stats == {"documents": 30, "tokens": rows, "skipped": {}}
        assert rows > 30  # not the document count
        total += rows
    assert s.tokens == total


def test_a_failed_rebuild_leaves_no_manifest_over_stale_parts(tmp_path: Path) -> None:
    inputs = write_corpus(tmp_path / "in", files=3)
    out = tmp_path / "ds"
    run(inputs, out)
    with open(inputs[1], "a") as f:
        f.write("{broken\n")
    with pytest.raises(BuildError, match=r"part-01\.jsonl:31: malformed JSON"):
        run(inputs, out)
    # the old part 1 is gone, its temporary directory too, and no manifest lists anything
    assert not (out / "manifest.json").exists()
    assert sorted(p.name for p in (out / "parts").iterdir()) == ["00000-00000", "00002-00000"]
    with pytest.raises(tokload.MissingShardError, match="no tokload manifest here"):
        tokload.open_dataset(out)
    # skip: built now, and a switch back to "stop" rebuilds (and fails) that part only
    s = run(inputs, out, on_error="skip")
    assert (s.built, s.skipped) == (1, {"malformed JSON": 1})
    with pytest.raises(BuildError, match=r"part-01\.jsonl:31"):
        run(inputs, out)
    # parts that skipped nothing are the same under both settings: reused
    inputs[1].write_text(inputs[1].read_text().replace("{broken\n", ""))
    s = run(inputs, out, on_error="skip")
    assert s.built == 1
    assert run(inputs, out).built == 0


def test_leftovers_of_a_crash_are_removed_and_unrecorded_parts_rebuilt(tmp_path: Path) -> None:
    inputs = write_corpus(tmp_path / "in", files=2)
    out = tmp_path / "ds"
    run(inputs, out)
    # a crash while removing a stale part, a part from before build records, a stray temp
    (out / "parts" / "00001-00000.1234abcd.old").mkdir()
    (out / "parts" / "00001-00000.1234abcd.old" / "junk.rows").write_bytes(b"x")
    (out / "parts" / "00001-00000.1234abcd.old" / BUILD_MARKER).write_text("{}")  # removed last
    m = read_manifest(out / "parts" / "00000-00000")
    del m.user["build"]
    tokload.format.write_manifest(out / "parts" / "00000-00000", m)
    (out / "parts" / "00007-00000.0badcafe.tmp").mkdir()
    (out / "parts" / "00007-00000.0badcafe.tmp" / BUILD_MARKER).write_text("{}")
    # a directory the build did not write, though named like a chunk: never touched
    (out / "parts" / "00009-00000").mkdir()
    (out / "parts" / "00009-00000" / "notes.txt").write_text("mine")
    s = run(inputs, out)
    assert (s.built, s.removed) == (1, 2)
    assert sorted(p.name for p in (out / "parts").iterdir()) == [
        "00000-00000",
        "00001-00000",
        "00009-00000",
    ]
    assert (out / "parts" / "00009-00000" / "notes.txt").read_text() == "mine"
    shutil.rmtree(out / "parts" / "00009-00000")
    fresh_equals(inputs, out, tmp_path)


def test_tokenizer_travels_with_the_dataset(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    inputs = write_corpus(tmp_path / "in", files=1)
    (tmp_path / "tok").mkdir()
    tj = _hf_tokenizer(tmp_path / "tok" / "my-tokenizer.json")
    out = tmp_path / "ds"
    run(inputs, out, tokenizer=tj)
    assert (out / "tokenizer.json").read_bytes() == tj.read_bytes()
    desc = read_manifest(out).user["tokenizer"]
    assert desc["file"] == "tokenizer.json"
    assert desc["sha256"] == hashlib.sha256(tj.read_bytes()).hexdigest()
    # the original tokenizer gone, the dataset moved, read from another directory
    shutil.rmtree(tmp_path / "tok")
    moved = tmp_path / "elsewhere" / "ds"
    shutil.move(out, moved)
    monkeypatch.chdir(tmp_path / "in")
    assert main(["inspect", os.path.relpath(moved)]) == 0
    text = json.loads((tmp_path / "in" / "part-00.jsonl").read_text().splitlines()[0])["text"]
    shown = capsys.readouterr().out
    assert f"text    {text[:8]!r}"[:-1] in shown
    # a tampered copy is not used: the text is not decoded, and inspect says why
    (moved / "tokenizer.json").write_text("{}")
    assert main(["inspect", str(moved)]) == 0
    assert "not decoded: the tokenizer file 'tokenizer.json'" in capsys.readouterr().out


def test_skip_counts_group_by_reason(tmp_path: Path) -> None:
    p = tmp_path / "bad.jsonl"
    p.write_text(
        "\n".join(
            [
                '{"text": "ok"}',
                "[1, 2]",
                '"a string"',
                "{oops",
                '{"text": "abc", "spans": [{"start": 1, "end": 9}]}',
                '{"text": "abcdef", "spans": [{"start": 4, "end": 90}]}',
                '{"text": 3}',
                '{"text": [3]}',
            ]
        )
        + "\n"
    )
    s = run([p], tmp_path / "ds", annotations_field="spans", on_error="skip", max_skipped=1)
    assert s.skipped == {
        "not a JSON object": 2,
        "malformed JSON": 1,
        "annotation outside the text": 2,
        "text field not a string": 2,
    }
    assert s.documents == 1
