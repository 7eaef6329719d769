"""What a build reads and what it may touch: the user's files are never inputs by
accident, never replaced or removed unasked, and a build that made nothing fails.

Each data-loss case keeps the user's files byte for byte: a re-run into an output
inside its input directory, ``build .``, a non-empty output, a directory named
like a chunk, a dataset built from other inputs.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest
from test_build import dataset_files

import tokload
from tokload import BuildError, build
from tokload.__main__ import main
from tokload.builder import UsageError
from tokload.format import read_manifest
from tokload.inputs import BUILD_MARKER, InputError, find_inputs, is_data_file


def jsonl(path: Path, n: int = 40, field: str = "text") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({field: f"document {i} of {path.name}. " * 3, "id": i}) + "\n")
    return path


def snapshot(root: Path, skip: Path | None = None) -> dict[str, bytes]:
    """Every file under ``root`` (except under ``skip``) and its bytes."""
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and (skip is None or skip not in p.parents)
    }


def run_cli(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = main(args)
    return code, capsys.readouterr().err


# ---- outputs are never inputs ------------------------------------------------------------


def test_a_rerun_into_the_input_directory_reuses_every_chunk(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = tmp_path / "data"
    for k in range(3):
        jsonl(data / f"part-{k}.jsonl")
    (data / "README.md").write_text("# my data\n")
    mine = snapshot(data)
    args = ["build", str(data), "-o", str(data / "tok"), "--tokenizer", "bytes", "-j", "2"]
    args += ["--chunk-size", "1k"]
    code, err = run_cli(args, capsys)
    assert code == 0, err
    first = snapshot(data / "tok")
    assert "3 input files" in err and "1 files that are not data (e.g." in err
    code, err = run_cli(args, capsys)  # the same command again
    assert code == 0, err
    assert "0 to build" in err  # every finished chunk reused
    assert snapshot(data / "tok") == first
    assert snapshot(data, skip=data / "tok") == mine
    assert read_manifest(data / "tok").num_documents == 120


def test_build_dot_into_a_subdirectory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    jsonl(tmp_path / "a.jsonl")
    monkeypatch.chdir(tmp_path)
    for _ in range(2):
        code, err = run_cli(["build", ".", "-o", "corpus", "--tokenizer", "bytes"], capsys)
        assert code == 0, err
        assert "1 input files" in err
    assert read_manifest(tmp_path / "corpus").num_documents == 40


def test_other_datasets_in_a_walk_are_passed_over(tmp_path: Path) -> None:
    jsonl(tmp_path / "in" / "a.jsonl")
    build([tmp_path / "in"], tmp_path / "in" / "old-build")
    with tokload.Writer(tmp_path / "in" / "written", dtype="<u2") as w:
        w.write([1, 2, 3])
    found = find_inputs([tmp_path / "in"], output=tmp_path / "elsewhere")
    assert found.files == [tmp_path / "in" / "a.jsonl"]
    assert found.passed_over["tokload datasets"] == 2


def test_an_input_inside_the_output_is_refused(tmp_path: Path) -> None:
    out = tmp_path / "out"
    jsonl(out / "sub" / "x.jsonl")
    with pytest.raises(InputError, match=r"x\.jsonl: this input is inside the output"):
        build([out / "sub" / "x.jsonl"], out, force=True)
    with pytest.raises(InputError, match="inside the output"):
        build([out], out, force=True)


# ---- the output: never mixed, never replaced unasked ---------------------------------------


def test_a_non_empty_output_is_refused_unless_forced(tmp_path: Path) -> None:
    src = jsonl(tmp_path / "a.jsonl")
    out = tmp_path / "home"
    out.mkdir()
    (out / "thesis.tex").write_text("years of work")
    (out / "parts").mkdir()
    (out / "parts" / "00000-00000").mkdir()  # named like a chunk, but the user's
    (out / "parts" / "00000-00000" / "notes.txt").write_text("mine too")
    mine = snapshot(out)
    with pytest.raises(UsageError, match=r"home: the output directory is not empty and holds no"):
        build([src], out)
    assert snapshot(out) == mine
    # forced: the chunk that would go where the user's directory is stops the build
    with pytest.raises(UsageError, match=r"00000-00000: a chunk of this build goes here"):
        build([src], out, force=True)
    assert {k: v for k, v in snapshot(out).items() if k in mine} == mine
    os.rename(out / "parts" / "00000-00000", out / "my-notes")
    mine = snapshot(out)
    s = build([src], out, force=True)
    assert s.documents == 40
    assert {k: v for k, v in snapshot(out).items() if k in mine} == mine
    assert (out / BUILD_MARKER).is_file()
    # the summary's size is the shards' (it counted the user's files too, review37)
    shards = [p for p in (out / "parts").rglob("*") if p.suffix in (".rows", ".docs")]
    assert s.bytes == sum(p.stat().st_size for p in shards) > 0


def test_a_dataset_from_other_inputs_is_not_replaced_unasked(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    books = jsonl(tmp_path / "books.jsonl")
    wiki = jsonl(tmp_path / "wiki.jsonl", n=7)
    out = tmp_path / "corpus"
    build([books], out)
    before = dataset_files(out)
    code, err = run_cli(["build", str(wiki), "-o", str(out), "--tokenizer", "bytes"], capsys)
    assert code == 2
    assert f"{out}: holds a dataset built from other inputs ({books})" in err
    assert "--force to replace it" in err
    assert dataset_files(out) == before
    # an input added to the same ones is an update, not a replacement
    assert build([books, wiki], out).documents == 47
    # asked: replaced, and the chunks of the old inputs are removed
    s = build([wiki], out, force=True)
    assert (s.documents, s.removed) == (7, 1)


def test_a_dataset_written_by_the_writer_is_not_built_over(tmp_path: Path) -> None:
    with tokload.Writer(tmp_path / "ds", dtype="<u2") as w:
        w.write([1, 2, 3])
    before = dataset_files(tmp_path / "ds")
    with pytest.raises(UsageError, match="holds no tokload build"):
        build([jsonl(tmp_path / "a.jsonl")], tmp_path / "ds")
    assert dataset_files(tmp_path / "ds") == before
    # --force builds beside the user's files, never over the Writer's manifest
    with pytest.raises(UsageError, match=r"ds: holds manifest.json, which tokload build did not"):
        build([jsonl(tmp_path / "a.jsonl")], tmp_path / "ds", force=True)
    assert dataset_files(tmp_path / "ds") == before
    assert len(tokload.Documents(tmp_path / "ds")) == 1


def test_force_never_replaces_a_tokenizer_or_a_parts_file_of_the_users(tmp_path: Path) -> None:
    src = jsonl(tmp_path / "a.jsonl")
    model = tmp_path / "model"
    model.mkdir()
    (model / "tokenizer.json").write_text("{}")  # a model's: a byte build removes its own
    (model / "parts").write_text("not a directory")
    mine = snapshot(model)
    with pytest.raises(UsageError, match=r"model: holds tokenizer.json, parts, which tokload"):
        build([src], model, force=True)
    assert snapshot(model) == mine


# ---- inputs a user means -------------------------------------------------------------------


def hf_repo(root: Path) -> Path:
    """A Hugging Face dataset checkout: data in Parquet and JSONL beside repository files."""
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    (root / "data").mkdir(parents=True)
    (root / ".git").mkdir()
    (root / ".git" / "config").write_text("[core]\n")
    (root / ".gitattributes").write_text("*.parquet filter=lfs diff=lfs merge=lfs -text\n")
    (root / "README.md").write_text("---\nlicense: mit\n---\n# A dataset\n")
    (root / "data" / "_SUCCESS").write_text("")
    (root / "dataset_info.json").write_text('{"features": {}}')
    table = pa.table({"id": list(range(10)), "text": [f"row {i}" for i in range(10)]})
    pq.write_table(table, root / "data" / "train-00000-of-00001.parquet")
    jsonl(root / "data" / "extra.jsonl", n=5)
    return root


def test_a_directory_walk_takes_data_files_only(tmp_path: Path) -> None:
    repo = hf_repo(tmp_path / "repo")
    found = find_inputs([repo])
    assert [p.name for p in found.files] == ["extra.jsonl", "train-00000-of-00001.parquet"]
    line = found.describe()
    assert line.startswith("2 input files, ")
    assert "1 jsonl (" in line and "1 parquet (" in line
    assert "1 hidden directories (e.g." in line and "1 hidden files (e.g." in line
    assert "3 files that are not data (e.g." in line
    s = build([repo], tmp_path / "out")
    assert s.documents == 15
    doc = tokload.Documents(tmp_path / "out")[0]
    assert isinstance(doc, np.ndarray)
    first = bytes(t for t in doc.tolist() if t < 256)
    assert first.decode().startswith("document 0 of extra.jsonl")  # not "*.parquet filter=lfs ..."


def test_a_path_spelled_several_ways_is_read_once_and_a_link_is_another_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Relative and absolute, with "..", a directory and a file in it: the documents of
    one file were built once per spelling. A link is a path of its own (it upsamples a
    file), hard or symbolic, the same on every machine whatever its copy kept."""
    monkeypatch.chdir(tmp_path)
    jsonl(tmp_path / "data" / "a.jsonl", n=3)
    jsonl(tmp_path / "data" / "b.jsonl", n=2)
    os.link(tmp_path / "data" / "b.jsonl", tmp_path / "b-hard.jsonl")
    os.symlink(tmp_path / "data" / "b.jsonl", tmp_path / "b-soft.jsonl")
    names = [
        "data",
        str(tmp_path / "data" / "a.jsonl"),
        "data/../data/a.jsonl",
        "b-hard.jsonl",
        "b-soft.jsonl",
    ]
    found = find_inputs(names)
    # the spelling that sorts first stands for each path
    assert [str(p) for p in found.files] == [
        str(tmp_path / "data" / "a.jsonl"),
        "b-hard.jsonl",
        "b-soft.jsonl",
        "data/b.jsonl",
    ]
    assert found.passed_over["paths named again, spelled otherwise"] == 2
    assert "2 paths named again, spelled otherwise" in found.describe()
    # whatever the order they are named in
    assert find_inputs(names[::-1]).files == found.files
    assert build(names, tmp_path / "out").documents == 3 + 2 * 3


def test_metadata_files_in_capitals_are_passed_over(tmp_path: Path) -> None:
    jsonl(tmp_path / "in" / "a.jsonl", n=2)
    (tmp_path / "in" / "Config.JSON").write_text('{\n  "vocab_size": 3\n}\n')
    (tmp_path / "in" / "MANIFEST.JSON").write_text("{}\n")
    found = find_inputs([tmp_path / "in"])
    assert [p.name for p in found.files] == ["a.jsonl"]
    assert found.passed_over["files that are not data"] == 2


def test_extensions_in_capitals_are_read_by_their_kind(tmp_path: Path) -> None:
    """C.JSONL named on the command line was built as one plain-text document: its raw
    JSON became training text."""
    import gzip

    jsonl(tmp_path / "in" / "A.JSONL", n=3)
    (tmp_path / "in" / "B.Jsonl.GZ").write_bytes(gzip.compress(b'{"text": "zipped"}\n'))
    assert [p.name for p in find_inputs([tmp_path / "in"]).files] == ["A.JSONL", "B.Jsonl.GZ"]
    s = build([tmp_path / "in" / "A.JSONL", tmp_path / "in" / "B.Jsonl.GZ"], tmp_path / "o")
    assert s.documents == 4
    docs = tokload.Documents(tmp_path / "o")
    texts = [bytes(np.asarray(docs[d]).tolist()[:-1]).decode() for d in range(len(docs))]
    assert "zipped" in texts and not any(t.startswith("{") for t in texts)


def test_one_input_or_field_given_alone_is_not_read_as_its_characters(tmp_path: Path) -> None:
    """build("a.jsonl", ...) looked for inputs named "a", ".", "j", ...; keep_fields="id"
    kept the fields "i" and "d"."""
    p = tmp_path / "a.jsonl"
    p.write_text('{"text": "x", "id": "one", "i": 1, "d": 2}\n')
    s = build(str(p), tmp_path / "o", keep_fields="id", progress=False)
    assert s.documents == 1
    doc = tokload.StreamWithMetadata(tmp_path / "o", window=1, deserialize=json.loads)[0]
    assert list(doc.metadata) == [{"document": {"id": "one"}}]
    assert build(p, tmp_path / "o2", progress=False).documents == 1  # a Path alone


def test_include_and_exclude_globs(tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "pkg").mkdir(parents=True)
    (src / "pkg" / "a.py").write_text("print('a')\n")
    (src / "pkg" / "test_a.py").write_text("assert True\n")
    (src / "b.txt").write_text("plain text\n")
    assert [p.name for p in find_inputs([src]).files] == ["b.txt"]
    found = find_inputs([src], include=["*.py"], exclude=["test_*"])
    assert [p.name for p in found.files] == ["a.py"]
    assert found.passed_over["files matching --exclude"] == 1
    # a pattern may name the path under the directory walked
    assert [p.name for p in find_inputs([src], include=["pkg/*"]).files] == ["a.py", "test_a.py"]
    # a file named explicitly is read whatever its name
    assert find_inputs([src / "pkg" / "a.py"]).files == [src / "pkg" / "a.py"]
    with pytest.raises(UsageError, match=r"no input files .*--include"):
        build([src / "pkg"], tmp_path / "out")
    # --include replaces the extensions, not the passing over of metadata files
    repo = hf_repo(tmp_path / "repo")
    (repo / "data" / "part.json").write_text('{"text": "real training text"}\n')
    (repo / "config.json").write_text("{}")
    found = find_inputs([repo], include=["*.json"])
    assert [p.name for p in found.files] == ["part.json"]
    assert found.passed_over["files that are not data"] == 2  # dataset_info, config


def test_a_path_that_exists_is_never_a_glob(tmp_path: Path) -> None:
    """``data[1].jsonl`` was taken as a glob: alone it matched nothing ("no input
    matches"), and beside ``data1.jsonl`` that other file was read in its place
    (review37). A path that exists is itself; one that does not is a glob."""
    (tmp_path / "data[1].jsonl").write_text('{"text": "named"}\n')
    (tmp_path / "data1.jsonl").write_text('{"text": "other"}\n')
    (tmp_path / "crawl[2024]").mkdir()
    (tmp_path / "crawl[2024]" / "a.jsonl").write_text('{"text": "in the directory"}\n')
    assert find_inputs([tmp_path / "data[1].jsonl"]).files == [tmp_path / "data[1].jsonl"]
    assert find_inputs([tmp_path / "crawl[2024]"]).files == [tmp_path / "crawl[2024]" / "a.jsonl"]
    with pytest.raises(FileNotFoundError, match="no input matches"):  # a glob: [2] is "2"
        find_inputs([tmp_path / "data[2].jsonl"])
    (tmp_path / "data2.jsonl").write_text('{"text": "two"}\n')
    assert find_inputs([tmp_path / "data[2].jsonl"]).files == [tmp_path / "data2.jsonl"]
    # a glob under a directory that exists: the directory as spelled (review39)
    (tmp_path / "crawl2").mkdir()
    (tmp_path / "crawl2" / "other.jsonl").write_text('{"text": "other"}\n')
    found = find_inputs([str(tmp_path / "crawl[2024]" / "*.jsonl")])
    assert found.files == [tmp_path / "crawl[2024]" / "a.jsonl"]
    build([tmp_path / "data[1].jsonl"], tmp_path / "out", tokenizer="bytes", progress=False)
    docs = tokload.Documents(tmp_path / "out")
    tokens = docs[0]
    assert len(docs) == 1 and isinstance(tokens, np.ndarray)
    assert bytes(tokens[:-1].tolist()) == b"named"


def test_the_report_passes_over_no_file_it_reads_and_counts_each_once(tmp_path: Path) -> None:
    """``'data/**'`` matched the directories too, whose walks passed over the
    ``.py`` files the glob then took: the report said it passed over 3 files that
    are not data (``c.py`` twice) and read both (review37)."""
    (tmp_path / "data" / "sub").mkdir(parents=True)
    (tmp_path / "data" / "a.jsonl").write_text('{"text": "a"}\n')
    (tmp_path / "data" / "d.py").write_text("print(1)\n")
    (tmp_path / "data" / "sub" / "c.py").write_text("print(2)\n")
    (tmp_path / "data" / "sub" / "e.py").write_text("print(3)\n")
    found = find_inputs([tmp_path / "data", tmp_path / "data" / "sub"])
    assert [p.name for p in found.files] == ["a.jsonl"]
    assert found.passed_over == {"files that are not data": 3}  # each walked twice: once
    found = find_inputs([str(tmp_path / "data" / "**")])
    assert [p.name for p in found.files] == ["a.jsonl", "d.py", "c.py", "e.py"]
    assert "not data" not in found.describe()
    # passed over by a walk and by a glob, for two reasons: counted once
    found = find_inputs([tmp_path / "data", str(tmp_path / "data" / "*.py")], exclude=["d.py"])
    assert sum(found.passed_over.values()) == 3  # d.py, c.py, e.py


def test_a_directory_walk_follows_links_and_reads_no_file_twice(tmp_path: Path) -> None:
    """A linked directory's files are inputs (they were passed over without a word);
    a directory reached again, through a second link or a loop, is passed over."""
    store = tmp_path / "store" / "cc"
    store.mkdir(parents=True)
    (store / "part0.jsonl").write_text('{"text": "from the linked directory"}\n')
    data = tmp_path / "data"
    data.mkdir()
    (data / "own.jsonl").write_text('{"text": "from the directory itself"}\n')
    (data / "cc").symlink_to(store, target_is_directory=True)
    (data / "cc-again").symlink_to(store, target_is_directory=True)
    (store / "loop").symlink_to(data, target_is_directory=True)  # back up: a loop
    found = find_inputs([data])
    assert sorted(p.name for p in found.files) == ["own.jsonl", "part0.jsonl"]
    assert found.passed_over["directories reached again through a link"] == 2
    s = build([data], tmp_path / "out")
    assert s.documents == 2


def test_a_file_reached_again_through_a_link_from_another_input_is_read_once(
    tmp_path: Path,
) -> None:
    """review58: inputs ``d1 d2`` with ``d2/link -> d1`` read d1's file twice (each
    input's walk had its own record of the directories reached), as did ``'d/*'``
    with a link in ``d/sub`` back to ``d``; the spelling that sorts first stands,
    whatever the inputs' order. A link to a file is still a file of its own."""
    (tmp_path / "d1").mkdir()
    (tmp_path / "d2").mkdir()
    (tmp_path / "d1" / "a.jsonl").write_text('{"text": "A"}\n')
    (tmp_path / "d2" / "b.jsonl").write_text('{"text": "B"}\n')
    (tmp_path / "d2" / "link").symlink_to(tmp_path / "d1", target_is_directory=True)
    (tmp_path / "d2" / "again.jsonl").symlink_to(tmp_path / "d2" / "b.jsonl")  # upsampled
    want = [
        tmp_path / "d1" / "a.jsonl",
        tmp_path / "d2" / "again.jsonl",
        tmp_path / "d2" / "b.jsonl",
    ]
    for order in ([tmp_path / "d1", tmp_path / "d2"], [tmp_path / "d2", tmp_path / "d1"]):
        found = find_inputs(order)
        assert found.files == want
        assert found.passed_over["files reached again through a link to a directory"] == 1
        assert "e.g. " + str(tmp_path / "d2" / "link" / "a.jsonl") in found.describe()
    d = tmp_path / "d"
    (d / "sub").mkdir(parents=True)
    (d / "top.jsonl").write_text('{"text": "T"}\n')
    (d / "sub" / "loop").symlink_to(d, target_is_directory=True)
    assert find_inputs([str(d / "*")]).files == [d / "top.jsonl"]
    # inside one walk too: a link met before the directory it leads to (review61)
    e = tmp_path / "e"
    (e / "z").mkdir(parents=True)
    (e / "z" / "f.jsonl").write_text('{"text": "F"}\n')
    (e / "a_link").symlink_to(e / "z", target_is_directory=True)
    for inputs in ([e], [e, e / "z"], [e / "z", e]):
        assert find_inputs(inputs).files == [e / "z" / "f.jsonl"]
    s = build([tmp_path / "d2", tmp_path / "d1"], tmp_path / "out")
    assert s.documents == 3


@pytest.mark.parametrize(
    ("name", "data"),
    [
        ("x.jsonl", True),
        ("x.json.gz", True),
        ("x.ndjson.zst", True),
        ("x.parquet", True),
        ("x.txt", True),
        ("README.md", False),
        ("_SUCCESS", False),
        (".gitattributes", False),
        ("dataset_info.json", False),
        ("tokenizer.json", False),
        ("x.tar.gz", False),
        ("x.rows", False),
    ],
)
def test_which_names_are_data(name: str, data: bool) -> None:
    assert is_data_file(name) is data


# ---- errors, not empty datasets ------------------------------------------------------------


def test_a_wrong_text_field_fails_instead_of_building_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = jsonl(tmp_path / "a.jsonl", n=1000, field="content")
    out = tmp_path / "out"
    code, err = run_cli(
        ["build", str(src), "-o", str(out), "--tokenizer", "bytes", "--on-error", "skip"], capsys
    )
    assert code == 1
    assert (
        "the build produced no documents: all 1000 records were skipped (missing text field: "
        "1000); is the text in another field than 'text'? (--text-field)"
    ) in err
    assert not (out / "manifest.json").exists()
    with pytest.raises(
        BuildError, match=r"a\.jsonl:1: no text field 'text' \(the record's fields: "
    ):
        build([src], out)
    with pytest.raises(BuildError, match="content, id; --text-field names another"):
        build([src], out)


def test_an_empty_input_fails(tmp_path: Path) -> None:
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(BuildError, match="the build produced no documents: the inputs are empty"):
        build([tmp_path / "empty.jsonl"], tmp_path / "out")


def test_skipping_past_the_threshold_fails_and_keeps_the_chunks(tmp_path: Path) -> None:
    p = tmp_path / "a.jsonl"
    p.write_text("".join('{"text": "ok"}\n' if i % 4 else "{broken\n" for i in range(100)))
    out = tmp_path / "out"
    with pytest.raises(
        BuildError,
        match=r"skipped 25 of 100 records \(25%; malformed JSON: 25\), more than the 10%",
    ):
        build([p], out, on_error="skip")
    assert not (out / "manifest.json").exists()
    s = build([p], out, on_error="skip", max_skipped=0.25)
    assert (s.documents, s.built) == (75, 0)  # the chunk built above, reused
    with pytest.raises(UsageError, match="max_skipped must be a fraction from 0 to 1, got 2"):
        build([p], out, max_skipped=2)


def test_a_parquet_file_without_the_text_column_lists_its_columns(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    path = tmp_path / "t.parquet"
    pq.write_table(pa.table({"id": [1, 2], "content": ["a", "b"], "url": ["u", "v"]}), path)
    with pytest.raises(
        BuildError,
        match=r"t\.parquet: no column 'text'; its columns are id, content, url; "
        r"use --text-field content",
    ):
        build([path], tmp_path / "out", on_error="skip")


# ---- the tokenizer a user names ------------------------------------------------------------


def fake_hub_cache(root: Path, repo: str, tokenizer: Path) -> Path:
    """A Hugging Face cache holding ``repo``'s tokenizer.json, laid out as the hub client does."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    folder = root / ("models--" + repo.replace("/", "--"))
    (folder / "refs").mkdir(parents=True)
    (folder / "refs" / "main").write_text(commit)
    snap = folder / "snapshots" / commit
    snap.mkdir(parents=True)
    (snap / "tokenizer.json").write_bytes(tokenizer.read_bytes())
    return root


def test_a_hugging_face_name_from_the_local_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from huggingface_hub import constants
    from test_build import _hf_tokenizer

    tj = _hf_tokenizer(tmp_path / "tokenizer.json")
    cache = fake_hub_cache(tmp_path / "hub", "acme/tiny-bpe", tj)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    src = jsonl(tmp_path / "a.jsonl")
    code, err = run_cli(
        ["build", str(src), "-o", str(tmp_path / "out"), "--tokenizer", "acme/tiny-bpe"], capsys
    )
    assert code == 0, err
    first = err.splitlines()[0]
    assert first.startswith("tokload build: tokenizer acme/tiny-bpe (")
    assert "vocabulary 300, tokens stored as uint16" in first
    m = read_manifest(tmp_path / "out")
    assert m.user["tokenizer"]["hub_name"] == "acme/tiny-bpe"
    assert (tmp_path / "out" / "tokenizer.json").read_bytes() == tj.read_bytes()
    # a directory holding a tokenizer.json (a model checkout) works too
    assert build([src], tmp_path / "out2", tokenizer=tmp_path).documents == 40
    # a name that is nowhere: what was tried
    code, err = run_cli(
        ["build", str(src), "-o", str(tmp_path / "o3"), "--tokenizer", "acme/missing"], capsys
    )
    assert code == 1
    assert (
        f"no tokenizer: tried no file or directory 'acme/missing'; the Hugging Face cache "
        f"{cache} (no acme/missing/tokenizer.json); no download (HF_HUB_OFFLINE is set)"
    ) in err


def test_no_tokenizer_given_says_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, err = run_cli(
        ["build", str(jsonl(tmp_path / "a.jsonl")), "-o", str(tmp_path / "o")], capsys
    )
    assert code == 0
    lines = err.splitlines()
    assert lines[0].startswith("tokload build: no --tokenizer given: the built-in byte tokenizer")
    assert lines[1] == (
        "tokload build: tokenizer bytes (built in), vocabulary 258, tokens stored as uint16, "
        "BOS 256, EOS 257"
    )


def test_a_stopped_build_removes_its_temporaries_even_unmarked_ones(tmp_path: Path) -> None:
    """A worker stopped between creating its chunk's temporary directory and writing
    the build's marker into it leaves it empty and unmarked: a stopped build removes
    it too, as it removes its marked ones. An unmarked one with anything in it is not
    the build's, and stays."""
    from tokload.build_output import MARKER_TEXT, remove_temporaries

    parts = tmp_path / "parts"
    parts.mkdir()
    bare = parts / "00000-00000.0badc0de.tmp"  # killed right after its mkdir
    bare.mkdir()
    marked = parts / "00001-00000.12345678.tmp"  # killed while writing
    marked.mkdir()
    (marked / BUILD_MARKER).write_text(MARKER_TEXT)
    (marked / "shard.tmp").write_bytes(b"half")
    foreign = parts / "00002-00000.abcdef01.tmp"  # not the build's: has a file, no marker
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    other = parts / "00003-00000.aaaaaaaa.tmp"  # a chunk this build was not writing
    other.mkdir()
    remove_temporaries(parts, ["00000-00000", "00001-00000", "00002-00000"])
    assert sorted(p.name for p in parts.iterdir()) == [foreign.name, other.name]
    assert (foreign / "notes.txt").read_text() == "mine"


def test_a_second_build_into_the_same_output_is_refused_while_one_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Two builds into one output at once each removed the other's chunks in
    progress as stale, and both failed ("No such file or directory"), leaving no
    dataset. The output is held by one build at a time: a second is refused at
    once (exit 2), and builds again once the first has ended."""
    from tokload.build_output import OutputLock

    src, out = jsonl(tmp_path / "in.jsonl"), tmp_path / "out"
    held = OutputLock(out)  # a build running (another process, as far as flock goes)
    try:
        with pytest.raises(UsageError, match="another tokload build is writing this directory"):
            build([src], out, progress=False)
        assert main(["build", str(src), "-o", str(out)]) == 2
        assert "another tokload build is writing" in capsys.readouterr().err
        assert list(out.iterdir()) == []  # nothing touched
    finally:
        held.release()
    assert build([src], out, progress=False).built >= 1
    assert build([src], out, progress=False).built == 0  # the lock was let go at the end


def test_a_directory_lock_is_not_kept_by_a_forked_child(tmp_path: Path) -> None:
    """A flock belongs to the open file, which a forked child shares: a child
    forked while the lock was held kept it after the parent let it go, and the
    parent's next manifest update waited for the child to end."""
    from tokload.files import DirectoryLock

    lock = DirectoryLock(tmp_path / "d")
    ready, tell = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child (its at-fork hooks have run): lives on, as a worker would
        os.write(tell, b"x")
        time.sleep(3)
        os._exit(0)
    try:
        assert os.read(ready, 1) == b"x"
        lock.release()
        DirectoryLock(tmp_path / "d", wait=False).release()  # free: not the child's
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        os.close(ready)
        os.close(tell)


def test_a_directory_lock_takes_a_lock_file_where_directories_cannot_be_locked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NFS emulates flock with POSIX locks, which need a file open for writing: a
    directory's lock failed (EBADF) and neither builds nor writers were kept apart."""
    import errno
    import fcntl
    import stat

    from tokload import files

    real = fcntl.flock

    def nfs_like(fd: int, how: int) -> None:
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            raise OSError(errno.EBADF, "Bad file descriptor")
        real(fd, how)

    monkeypatch.setattr(fcntl, "flock", nfs_like)
    src, out = jsonl(tmp_path / "in.jsonl"), tmp_path / "out"
    held = files.DirectoryLock(out)
    try:
        assert (out / files.LOCK_FILE).is_file()
        with pytest.raises(UsageError, match="another tokload build is writing"):
            build([src], out, progress=False)
    finally:
        held.release()
    assert build([src], out, progress=False).built >= 1
