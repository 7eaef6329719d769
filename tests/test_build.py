"""tokload build, the CLI and the demo."""

from __future__ import annotations

import bz2
import filecmp
import gzip
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

import tokload
from tokload import BuildError, Documents, StreamWithMetadata, UsageError, build
from tokload.__main__ import main
from tokload.inputs import BUILD_MARKER

WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "a",
    "lazy",
    "dog",
    "while",
    "ünïcode",
    "☃",
    "snowmen",
    "watch",
]


def write_corpus(root: Path, files: int = 5, docs: int = 30, seed: int = 0) -> list[Path]:
    rng = np.random.default_rng(seed)
    root.mkdir(parents=True, exist_ok=True)
    paths = []
    for f in range(files):
        p = root / f"part-{f:02d}.jsonl"
        with open(p, "w") as out:
            for d in range(docs):
                words = [WORDS[i] for i in rng.integers(0, len(WORDS), int(rng.integers(0, 40)))]
                text = " ".join(words)
                anns = []
                pos = 0
                for w in words:
                    pos = text.index(w, pos)
                    if w in ("fox", "☃", "ünïcode"):
                        anns.append({"start": pos, "end": pos + len(w), "concept": w})
                    pos += len(w)
                out.write(
                    json.dumps(
                        {"text": text, "id": f"{f}-{d}", "source": f"s{f % 2}", "spans": anns}
                    )
                    + "\n"
                )
        paths.append(p)
    return paths


def dataset_files(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


def meta_build(inputs: Any, out: Path, **kw: Any) -> tokload.builder.BuildSummary:
    return build(
        inputs, out, keep_fields=["id", "source"], annotations_field="spans", progress=False, **kw
    )


def test_same_output_with_1_and_3_workers(tmp_path: Path) -> None:
    inputs = write_corpus(tmp_path / "in")
    s1 = meta_build(inputs, tmp_path / "w1", workers=1, shard_bytes=2000)
    s3 = meta_build(inputs, tmp_path / "w3", workers=3, shard_bytes=2000)
    assert s1.documents == s3.documents == 150 and s1.tokens == s3.tokens > 0
    a, b = dataset_files(tmp_path / "w1"), dataset_files(tmp_path / "w3")
    assert a == b


def test_an_interrupted_build_resumes_to_the_same_result(tmp_path: Path) -> None:
    inputs = write_corpus(tmp_path / "in")
    meta_build(inputs, tmp_path / "full")
    out = tmp_path / "resumed"
    meta_build(inputs, out)
    # As if the build was killed: one part gone, another half-written (in the
    # temporary directory a build makes, marked as the build's first thing).
    shutil.rmtree(out / "parts" / "00002-00000")
    half = out / "parts" / "00003-00000.0badcafe.tmp"
    half.mkdir()
    (half / BUILD_MARKER).write_text("{}")
    (half / "garbage.rows").write_bytes(b"x" * 10)
    shutil.rmtree(out / "parts" / "00003-00000")
    # killed right after its mkdir, before the marker: empty, and removed too (review58)
    (out / "parts" / "00002-00000.0badc0de.tmp").mkdir()
    (out / "manifest.json").unlink()
    summary = meta_build(inputs, out, workers=2)
    assert summary.built == 2 and summary.inputs == 5
    assert not list((out / "parts").glob("*.tmp"))
    assert dataset_files(out) == dataset_files(tmp_path / "full")


def test_part_and_merge_equal_a_single_build(tmp_path: Path) -> None:
    inputs = write_corpus(tmp_path / "in", files=7)
    single = tmp_path / "single"
    meta_build(inputs, single)
    for k in range(3):
        assert (
            main(
                [
                    "build",
                    *map(str, inputs),
                    "-o",
                    str(tmp_path / f"p{k}"),
                    "--part",
                    f"{k}/3",
                    "--keep-field",
                    "id",
                    "--keep-field",
                    "source",
                    "--annotations",
                    "spans",
                    "--no-progress",
                ]
            )
            == 0
        )
    assert (
        main(["merge", str(tmp_path / "merged"), *(str(tmp_path / f"p{k}") for k in range(3))]) == 0
    )
    a, b = tokload.open_dataset(single), tokload.open_dataset(tmp_path / "merged")
    assert a.fingerprint == b.fingerprint
    da, db = Documents(a), Documents(b)
    assert len(da) == len(db) == 7 * 30
    for i in range(len(da)):
        np.testing.assert_array_equal(da[i]["token"], db[i]["token"])
    # the metadata (span tables) too: every token's record, over the whole stream
    ma, mb = (StreamWithMetadata(x, window=1) for x in (a, b))
    ra, rb = ma.read(np.arange(len(ma))), mb.read(np.arange(len(mb)))
    np.testing.assert_array_equal(ra.positions, rb.positions)
    assert list(ra.metadata) == list(rb.metadata)


def test_annotations_land_on_their_tokens_bytes(tmp_path: Path) -> None:
    inputs = write_corpus(tmp_path / "in", files=2)
    meta_build(inputs, tmp_path / "ds", bos=True)
    view = StreamWithMetadata(tmp_path / "ds", window=1, stride=1, deserialize=json.loads)
    docs = Documents(tmp_path / "ds")
    recs = [json.loads(line) for p in inputs for line in p.read_text().splitlines()]
    checked = 0
    for d, rec in enumerate(recs):
        start, length = (int(x[0]) for x in docs.extents([d]))
        batch = view.read(np.arange(start, start + length))
        tokens = batch.fields["token"][:, 0]
        assert tokens[0] == 256 and tokens[-1] == 257  # BOS ... EOS
        per_token = [None if p < 0 else batch.metadata[p] for p in batch.positions[:, 0]]
        assert all(
            m is not None and m["document"] == {"id": rec["id"], "source": rec["source"]}
            for m in per_token
        )
        for ann in rec["spans"]:
            covered = [
                t
                for t, m in zip(tokens.tolist(), per_token, strict=True)
                if m is not None
                and any(a["concept"] == ann["concept"] for a in m.get("annotations", []))
            ]
            assert bytes(covered).decode().count(ann["concept"]) >= 1
            checked += 1
        text_bytes = bytes(t for t in tokens.tolist() if t < 256)
        assert text_bytes.decode() == rec["text"]
    assert checked > 10


def test_an_empty_annotation_annotates_no_token(tmp_path: Path) -> None:
    """An empty span ``[s, s)``, an SFT record's empty response, was refused as
    "outside the text" and the record dropped (review34): it annotates no token."""
    prompt = "Q: why? A: "
    lines = [
        {"text": prompt, "spans": [{"start": len(prompt), "end": len(prompt), "role": "answer"}]},
        {"text": prompt + "ok", "spans": [{"start": len(prompt), "end": len(prompt) + 2,
                                            "role": "answer"}]},
        {"text": "", "spans": [{"start": 0, "end": 0, "role": "answer"}]},
    ]  # fmt: skip
    (tmp_path / "sft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    s = tokload.build(
        [tmp_path / "sft.jsonl"], tmp_path / "ds", annotations_field="spans", progress=False
    )
    assert s.documents == 3 and s.skipped == {}
    view = StreamWithMetadata(tmp_path / "ds", window=1, stride=1, deserialize=json.loads)
    docs = Documents(tmp_path / "ds")
    for d, want in enumerate(["", "ok", ""]):
        start, length = (int(x[0]) for x in docs.extents([d]))
        batch = view.read(np.arange(start, start + length))
        tokens = batch.fields["token"][:, 0].tolist()
        answer = [
            t
            for t, p in zip(tokens, batch.positions[:, 0].tolist(), strict=True)
            if p >= 0 and batch.metadata[p].get("annotations") == [{"role": "answer"}]
        ]
        assert bytes(answer).decode() == want


def _hf_tokenizer(path: Path, vocab_size: int | None = None) -> Path:
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, pre_tokenizers, trainers

    if vocab_size is None:
        tok = tokenizers.Tokenizer(models.BPE(unk_token="[UNK]"))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=300,
            special_tokens=["[UNK]", "<|endoftext|>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        )
        tok.train_from_iterator([" ".join(WORDS)] * 50, trainer)
    else:  # a word-level vocabulary too big for uint16
        vocab = {w: i for i, w in enumerate(WORDS)}
        vocab.update({f"filler{i}": len(WORDS) + i for i in range(vocab_size - len(WORDS) - 2)})
        vocab["[UNK]"] = len(vocab)
        vocab["</s>"] = len(vocab)
        tok = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path))
    return path


def test_a_merge_of_parts_keeps_their_tokenizer_and_refuses_another(tmp_path: Path) -> None:
    """``tokload merge`` of build parts dropped the tokenizer record (``inspect`` no
    longer decoded), and joined parts built with other tokenizers (review37)."""
    tj = _hf_tokenizer(tmp_path / "tok.json")
    inputs = write_corpus(tmp_path / "in", files=2)
    for k in range(2):
        build(inputs, tmp_path / f"p{k}", tokenizer=tj, part=(k, 2), progress=False)
    build(inputs, tmp_path / "single", tokenizer=tj, progress=False)
    m = tokload.merge(tmp_path / "whole", [tmp_path / "p0", tmp_path / "p1"])
    single = tokload.format.read_manifest(tmp_path / "single")
    assert m.user["tokenizer"] == single.user["tokenizer"]
    assert (tmp_path / "whole" / "tokenizer.json").read_bytes() == tj.read_bytes()
    report = tokload.tools.inspect(tmp_path / "whole", sample=1)
    assert "text    '" in report and "not decoded" not in report
    # parts of another tokenizer: refused, nothing written
    build(inputs, tmp_path / "b1", tokenizer="bytes", part=(1, 2), progress=False)
    with pytest.raises(tokload.FormatError, match=r"b1: tokenized with 'bytes', but .*p0 with"):
        tokload.merge(tmp_path / "mixed", [tmp_path / "p0", tmp_path / "b1"])
    assert not (tmp_path / "mixed" / "manifest.json").exists()
    # a tokenizer file of the user's where the copy goes is not replaced
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "tokenizer.json").write_text("{}")
    with pytest.raises(
        FileExistsError,
        match=r"holds a tokenizer file that is not the tokenizer of .*p0, which the copy",
    ):
        tokload.merge(tmp_path / "mine", [tmp_path / "p0", tmp_path / "p1"])
    assert (tmp_path / "mine" / "tokenizer.json").read_text() == "{}"


def test_a_part_of_empty_inputs_builds_and_merges(tmp_path: Path) -> None:
    """review58: ``--part 1/2`` of ``[a.jsonl, empty.jsonl]`` failed ("the build
    produced no documents: the inputs are empty"), so the split corpus could not be
    merged; a whole build of empty inputs still fails, as does a part that skipped
    every record."""
    (tmp_path / "a.jsonl").write_text('{"text": "one"}\n{"text": "two"}\n')
    (tmp_path / "empty.jsonl").write_text("")
    inputs = [tmp_path / "a.jsonl", tmp_path / "empty.jsonl"]
    for k in range(2):
        s = build(inputs, tmp_path / f"p{k}", tokenizer="bytes", part=(k, 2), progress=False)
        assert s.documents == (2 if k == 0 else 0)
    tokload.merge(tmp_path / "whole", [tmp_path / "p0", tmp_path / "p1"])
    single = build(inputs, tmp_path / "single", tokenizer="bytes", progress=False)
    a, b = Documents(tmp_path / "whole"), Documents(tmp_path / "single")
    assert len(a) == len(b) == single.documents == 2
    np.testing.assert_array_equal(a.read([0, 1]).values, b.read([0, 1]).values)
    with pytest.raises(BuildError, match="produced no documents: the inputs are empty"):
        build([tmp_path / "empty.jsonl"], tmp_path / "none", tokenizer="bytes", progress=False)
    (tmp_path / "bad.jsonl").write_text("not json\n")
    with pytest.raises(BuildError, match="produced no documents: all 1 records were skipped"):
        build([tmp_path / "a.jsonl", tmp_path / "bad.jsonl"], tmp_path / "q", tokenizer="bytes",
              part=(1, 2), on_error="skip", progress=False)  # fmt: skip


def test_a_merge_refuses_parts_of_other_options_or_chunk_plans(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``tokload merge`` joined parts built with another chunk size (the two plans'
    slices overlap: about half the documents twice) or another ``bos``, exit 0
    (review43); a part given twice, or an output holding an unfinished build, too."""
    inputs = write_corpus(tmp_path / "in", files=2)
    opts: dict[str, Any] = {"progress": False, "chunk_bytes": 512}
    build(inputs, tmp_path / "p0", part=(0, 2), **opts)
    build(inputs, tmp_path / "p1", part=(1, 2), **opts)
    build(inputs, tmp_path / "big", part=(0, 2), progress=False)
    build(inputs, tmp_path / "bos", part=(1, 2), bos=True, **opts)
    with pytest.raises(
        tokload.FormatError,
        match=r"big and .*p0 both read .*, cut into chunks of 33554432 and 512 bytes",
    ):
        tokload.merge(tmp_path / "m", [tmp_path / "p0", tmp_path / "big"])
    with pytest.raises(
        tokload.FormatError, match=r"bos: built with bos=True, but .*p0 with bos=False"
    ):
        tokload.merge(tmp_path / "m", [tmp_path / "p0", tmp_path / "bos"])
    with pytest.raises(UsageError, match=r"p0: given twice; merged, its documents would come"):
        tokload.merge(tmp_path / "m", [tmp_path / "p0", tmp_path / "p1", tmp_path / "p0"])
    assert not (tmp_path / "m").exists()  # a refused merge leaves no directory behind
    # parts of two splits of one plan, or a part beside its whole build: chunks twice
    # (review46); a part that read the same file spelled another way is the same file
    build(inputs, tmp_path / "third", part=(1, 3), **opts)
    with pytest.raises(tokload.FormatError, match=r"third and .*p0 both hold chunks? \d"):
        tokload.merge(tmp_path / "m", [tmp_path / "p0", tmp_path / "third"])
    build(inputs, tmp_path / "whole", **opts)
    with pytest.raises(tokload.FormatError, match=r"p1 and .*whole both hold"):
        tokload.merge(tmp_path / "m", [tmp_path / "whole", tmp_path / "p1"])
    monkeypatch.chdir(tmp_path)
    relative = [p.relative_to(tmp_path) for p in inputs]
    build(relative, tmp_path / "rel", part=(0, 2), progress=False)
    with pytest.raises(tokload.FormatError, match=r"rel and .*p0 both read .*, cut into chunks"):
        tokload.merge(tmp_path / "m", [tmp_path / "p0", tmp_path / "rel"])
    # what a bad record does is not what the documents are: a part re-run with
    # --on-error skip joins parts built with stop (review46)
    build(inputs, tmp_path / "skip1", part=(1, 2), on_error="skip", **opts)
    tokload.merge(tmp_path / "mskip", [tmp_path / "p0", tmp_path / "skip1"])
    # parts of one plan: the single build's documents, each once
    tokload.merge(tmp_path / "m", [tmp_path / "p0", tmp_path / "p1"])
    assert _tokens(tmp_path / "m") == _tokens(tmp_path / "whole")
    # an unfinished build's directory: its next run would replace the merged manifest
    (tmp_path / "in" / "empty.jsonl").write_text("")
    with pytest.raises(BuildError):
        build([tmp_path / "in" / "empty.jsonl"], tmp_path / "unfinished", progress=False)
    with pytest.raises(FileExistsError, match="holds a tokload build"):
        tokload.merge(tmp_path / "unfinished", [tmp_path / "p0", tmp_path / "p1"])
    with pytest.raises(UsageError, match=r"the output must be a directory .*; it is a file"):
        tokload.merge(tmp_path / "in" / "empty.jsonl", [tmp_path / "p0", tmp_path / "p1"])
    # another EOS of the same tokenizer file: the refusal says how they differ
    tj = _word_level(tmp_path / "t.json", {"[UNK]": 0, "a": 1, "</s>": 2, "<|eot|>": 3})
    build(inputs, tmp_path / "e0", tokenizer=tj, part=(0, 2), **opts)
    build(inputs, tmp_path / "e1", tokenizer=tj, part=(1, 2), eos="<|eot|>", **opts)
    with pytest.raises(tokload.FormatError, match=r"BOS None, EOS 3, but .* BOS None, EOS 2"):
        tokload.merge(tmp_path / "m2", [tmp_path / "e0", tmp_path / "e1"])


def test_a_merge_refuses_a_split_with_a_part_left_out(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``tokload merge`` of parts 0/3 and 2/3 wrote a dataset without part 1's
    documents, exit 0: a forgotten part lost a third of the corpus silently.
    Refused unless ``--partial`` (``partial=True``), naming the part missing."""
    inputs = write_corpus(tmp_path / "in", files=2)
    opts: dict[str, Any] = {"progress": False, "chunk_bytes": 512}
    for k in range(3):
        build(inputs, tmp_path / f"p{k}", part=(k, 3), **opts)
    plan = tokload.format.read_manifest(tmp_path / "p1").user["plan"]
    total = plan["chunks"]
    assert plan["part"] == [1, 3] and plan["span"] == [total // 3, 2 * total // 3]
    gone = f"chunks {total // 3} to {2 * total // 3 - 1}"
    with pytest.raises(
        UsageError,
        match=rf"p0, .*p2: parts of one build of {total} chunks, which leave out "
        rf"{2 * total // 3 - total // 3} of them \({gone}\) \(--part 1/3 not given\)",
    ):
        tokload.merge(tmp_path / "m", [tmp_path / "p0", tmp_path / "p2"])
    assert not (tmp_path / "m").exists()
    assert main(["merge", str(tmp_path / "m"), str(tmp_path / "p2"), str(tmp_path / "p1")]) == 2
    assert "--part 0/3 not given" in capsys.readouterr().err
    # the parts built so far, knowingly; every part, in any order of the arguments
    part = tokload.merge(tmp_path / "m", [tmp_path / "p0", tmp_path / "p2"], partial=True)
    assert main(["merge", str(tmp_path / "m1"), str(tmp_path / "p0"), "--partial"]) == 0
    whole = tokload.merge(tmp_path / "all", [tmp_path / f"p{k}" for k in (2, 0, 1)])
    assert 0 < part.num_documents < whole.num_documents
    build(inputs, tmp_path / "single", **opts)
    assert sorted(_tokens(tmp_path / "all")) == sorted(_tokens(tmp_path / "single"))
    # the inputs mounted at another path on the machine of part 1: one plan still
    (tmp_path / "mnt").symlink_to(tmp_path / "in")
    moved = [tmp_path / "mnt" / p.name for p in inputs]
    build(moved, tmp_path / "q1", part=(1, 3), **opts)
    tokload.merge(tmp_path / "mounts", [tmp_path / "p0", tmp_path / "q1", tmp_path / "p2"])
    # parts of two splits that hold no chunk twice, but leave some out: chunks named
    build(inputs, tmp_path / "h1", part=(1, 2), **opts)
    gap = rf"\(chunks {total // 3} to {total // 2 - 1}\): merged"
    with pytest.raises(UsageError, match=gap):
        tokload.merge(tmp_path / "m3", [tmp_path / "p0", tmp_path / "h1"])
    # an input that grew between two parts' builds: the plans differ
    with open(inputs[1], "a") as f:
        f.write(json.dumps({"id": 999, "text": "more " * 400}) + "\n")
    build(inputs, tmp_path / "late", part=(2, 3), **opts)
    late = tokload.format.read_manifest(tmp_path / "late").user["plan"]
    assert late["id"] == plan["id"] and late["chunks"] > total
    with pytest.raises(tokload.FormatError, match=r"late and .*p0: built from inputs of the same"):
        tokload.merge(tmp_path / "m2", [tmp_path / "p0", tmp_path / "p1", tmp_path / "late"])


def test_a_converted_dataset_keeps_its_tokenizer(tmp_path: Path) -> None:
    """``tokload convert`` left the tokenizer file out of the copy, whose manifest
    still named it: ``inspect`` of the copy no longer decoded (review43)."""
    tj = _hf_tokenizer(tmp_path / "tok.json")
    inputs = write_corpus(tmp_path / "in", files=1)
    meta_build(inputs, tmp_path / "src", tokenizer=tj)
    tokload.convert(tmp_path / "src", tmp_path / "dst", layout="spans")
    assert (tmp_path / "dst" / "tokenizer.json").read_bytes() == tj.read_bytes()
    report = tokload.tools.inspect(tmp_path / "dst", sample=0)
    assert "text    '" in report and "not decoded" not in report
    # a file of that name in the way is not replaced
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "tokenizer.json").write_text("{}")
    with pytest.raises(
        FileExistsError,
        match=r"holds a tokenizer file that is not the tokenizer of .*src, which the copy",
    ):
        tokload.convert(tmp_path / "src", tmp_path / "mine", layout="spans")
    assert (tmp_path / "mine" / "tokenizer.json").read_text() == "{}"


def test_tokenizer_json_offsets_and_dtype(tmp_path: Path) -> None:
    tj = _hf_tokenizer(tmp_path / "tokenizer.json")
    inputs = write_corpus(tmp_path / "in", files=2)
    s = meta_build(inputs, tmp_path / "ds", tokenizer=tj)
    src = tokload.open_dataset(tmp_path / "ds")
    assert src.dtype["token"] == np.dtype("<u2")
    tok = tokload.tokenizer.HFTokenizer(tj)
    view = StreamWithMetadata(src, window=1, stride=1, deserialize=json.loads)
    docs = Documents(src)
    recs = [json.loads(line) for p in inputs for line in p.read_text().splitlines()]
    for d, rec in enumerate(recs):
        start, length = (int(x[0]) for x in docs.extents([d]))
        batch = view.read(np.arange(start, start + length))
        ids = batch.fields["token"][:, 0].tolist()
        assert ids[-1] == tok.eos_id
        assert tok.decode(ids[:-1]) == rec["text"]
        for ann in rec["spans"]:
            cov = [
                t
                for t, p in zip(ids, batch.positions[:, 0].tolist(), strict=True)
                if p >= 0
                and any(
                    a["concept"] == ann["concept"] for a in batch.metadata[p].get("annotations", [])
                )
            ]
            assert ann["concept"] in tok.decode(cov)
    assert s.tokens == src.num_rows
    big = _hf_tokenizer(tmp_path / "big.json", vocab_size=70_000)
    build(inputs, tmp_path / "big", tokenizer=big, progress=False)
    assert tokload.open_dataset(tmp_path / "big").dtype == np.dtype("<u4")
    loader = tokload.DataLoader(tokload.TokenStream(tmp_path / "big", window=8), 4, seed=1)
    assert next(iter(loader))["tokens"].shape == (4, 8)


def _word_level(path: Path, vocab: dict[str, int]) -> Path:
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers

    tok = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path))
    return path


def _tokens(path: Path) -> list[int]:
    view = tokload.TokenStream(path, window=1)
    tokens = view.read(np.arange(len(view)))
    assert isinstance(tokens, np.ndarray)
    return tokens.ravel().tolist()


def test_the_dtype_holds_the_largest_id_not_the_number_of_ids(tmp_path: Path) -> None:
    """A vocabulary with gaps (reserved ranges, added tokens placed high): 4 entries,
    one of them 70,000, was stored as uint16, and 70,000 wrapped to 4,464."""
    tj = _word_level(tmp_path / "t.json", {"[UNK]": 0, "a": 1, "<|endoftext|>": 5, "b": 70_000})
    (tmp_path / "in.jsonl").write_text('{"text": "a b a"}\n')
    build([tmp_path / "in.jsonl"], tmp_path / "ds", tokenizer=tj, progress=False)
    assert tokload.open_dataset(tmp_path / "ds").dtype == np.dtype("<u4")
    assert _tokens(tmp_path / "ds") == [1, 70_000, 1, 5]
    # an end of text placed high decides too
    tj = _word_level(tmp_path / "e.json", {"[UNK]": 0, "a": 1, "</s>": 65_536})
    build([tmp_path / "in.jsonl"], tmp_path / "eos", tokenizer=tj, progress=False)
    assert _tokens(tmp_path / "eos") == [1, 0, 1, 65_536]


def test_named_bos_and_eos_tokens_end_documents_and_travel_with_the_dataset(
    tmp_path: Path,
) -> None:
    """No option chose the end-of-document token: a Llama 3 SFT build could not end
    its documents with ``<|eot_id|>`` (the tokenizer's first usual name won)."""
    for k, text in enumerate(("a b", "b a a")):
        (tmp_path / f"in{k}.jsonl").write_text(json.dumps({"text": text}) + "\n")
    inputs = sorted(tmp_path.glob("in*.jsonl"))
    vocab = {"[UNK]": 0, "a": 1, "b": 2, "</s>": 3, "<|eot_id|>": 4, "<|start|>": 5}
    tj = _word_level(tmp_path / "t.json", vocab)
    # in -j workers too: each loads the tokenizer and names the tokens itself
    s = build(inputs, tmp_path / "ds", tokenizer=tj, eos="<|eot_id|>", workers=2, progress=False)
    assert _tokens(tmp_path / "ds") == [1, 2, 4, 2, 1, 1, 4] and s.built == 2
    record = tokload.format.read_manifest(tmp_path / "ds").user["tokenizer"]
    assert (record["bos"], record["eos"]) == (None, 4)
    assert "text    'b a a <|eot_id|>'" in tokload.tools.inspect(tmp_path / "ds", sample=1)
    s = build(inputs, tmp_path / "ds", tokenizer=tj, eos="<|eot_id|>", progress=False)
    assert s.built == 0  # the same tokens: reused
    # another token: every chunk rebuilt with it; a named BOS is added
    s = build(inputs, tmp_path / "ds", tokenizer=tj, bos="<|start|>", progress=False)
    assert _tokens(tmp_path / "ds") == [5, 1, 2, 3, 5, 2, 1, 1, 3] and s.built == 2
    with pytest.raises(
        UsageError,
        match=re.escape(f"the tokenizer {tj} has no token '<|eot|>' (asked for as EOS)"),
    ):
        build(inputs, tmp_path / "x", tokenizer=tj, eos="<|eot|>", progress=False)
    with pytest.raises(UsageError, match="the byte tokenizer's BOS and EOS are fixed"):
        build(inputs, tmp_path / "x", eos="</s>", progress=False)
    for bad in ("", 1, None):
        with pytest.raises(UsageError, match="eos must be True, False or a token's text"):
            build(inputs, tmp_path / "x", tokenizer=tj, eos=bad, progress=False)  # type: ignore[arg-type]
    assert not (tmp_path / "x").exists()


def test_a_rebuild_in_one_process_with_another_tokenizer_uses_it(tmp_path: Path) -> None:
    """The output's copy of tokenizer.json has one path whatever the tokenizer: a
    process's cache keyed by it tokenized a second build with the first tokenizer."""
    (tmp_path / "in.jsonl").write_text('{"text": "a b"}\n')
    one = _word_level(tmp_path / "one.json", {"[UNK]": 0, "a": 1, "b": 2, "</s>": 3})
    two = _word_level(tmp_path / "two.json", {"[UNK]": 0, "a": 7, "b": 8, "</s>": 9})
    build([tmp_path / "in.jsonl"], tmp_path / "ds", tokenizer=one, progress=False, workers=1)
    assert _tokens(tmp_path / "ds") == [1, 2, 3]
    build([tmp_path / "in.jsonl"], tmp_path / "ds", tokenizer=two, progress=False, workers=1)
    assert _tokens(tmp_path / "ds") == [7, 8, 9]


def test_compressed_parquet_and_text_inputs(tmp_path: Path) -> None:
    recs = [{"text": f"doc {i} " * (i + 1), "id": i} for i in range(20)]
    lines = "".join(json.dumps(r) + "\n" for r in recs)
    (tmp_path / "in").mkdir()
    with gzip.open(tmp_path / "in" / "a.jsonl.gz", "wt") as f:
        f.write(lines)
    with bz2.open(tmp_path / "in" / "b.jsonl.bz2", "wt") as f:
        f.write(lines)
    zstd = pytest.importorskip("zstandard")
    (tmp_path / "in" / "c.jsonl.zst").write_bytes(zstd.ZstdCompressor().compress(lines.encode()))
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(recs), tmp_path / "in" / "d.parquet")
    (tmp_path / "in" / "e.txt").write_text("plain text file")
    s = build([tmp_path / "in"], tmp_path / "ds", keep_fields=["id"], progress=False)
    assert s.inputs == 5 and s.documents == 4 * 20 + 1
    docs = Documents(tmp_path / "ds")
    assert bytes(docs[20 * 3]["token"][:-1].tolist()).decode() == recs[0]["text"]
    assert bytes(docs[80]["token"][:-1].tolist()).decode() == "plain text file"


@pytest.mark.parametrize(
    ("line", "reason", "message"),
    [
        ("{not json", "malformed JSON", r"bad\.jsonl:2: malformed JSON"),
        ("[" * 100_000, "malformed JSON", r"bad\.jsonl:2: malformed JSON \("),
        # a raw tab in a string (json's own message ends in "at": said once)
        (
            '{"text": "a\tb"}',
            "malformed JSON",
            r"bad\.jsonl:2: malformed JSON \(Invalid control character at column 12\)",
        ),
        ("[1]", "not a JSON object", r"bad\.jsonl:2: a JSON list, not an object"),
        ('{"body": "x"}', "missing text field", r"bad\.jsonl:2: no text field 'text'"),
        ('{"text": 5}', "text field not a string", r"bad\.jsonl:2: field 'text' is a int"),
        # valid JSON, not Unicode: half of a surrogate pair escaped alone (web crawls)
        (
            '{"text": "a\\ud800b"}',
            "lone surrogate in a string",
            r"bad\.jsonl:2: a string holds a lone surrogate \(\\ud800\): not Unicode text",
        ),
        ('{"text": "ok", "id": "\\udfff"}', "lone surrogate in a string", r"lone surrogate"),
        # present but null: not 'no text field' (with the field listed beside it)
        ('{"text": null}', "text field not a string", r"bad\.jsonl:2: field 'text' is null, not"),
        (
            '{"text": "abc", "spans": 3}',
            "annotations not a list",
            r"bad\.jsonl:2: field 'spans' is not a list of annotations",
        ),
        (
            '{"text": "abc", "spans": [{"start": "1", "end": 2}]}',
            "annotation without integer start/end",
            r"bad\.jsonl:2: an annotation without integer start/end: \{'start': '1'",
        ),
        (
            '{"text": "abc", "spans": [{"start": 1, "end": 9}]}',
            "annotation outside the text",
            r"bad\.jsonl:2: annotation \[1, 9\) is outside the text \(3 characters\)",
        ),
        (
            '{"text": "abc", "spans": [{"start": 2, "end": 1}]}',
            "annotation outside the text",
            r"bad\.jsonl:2: annotation \[2, 1\) ends before it starts \(3 characters\)",
        ),
        # JSON's true is not 1 (review34: it was taken as 1, silently)
        (
            '{"text": "abc", "spans": [{"start": true, "end": 2}]}',
            "annotation without integer start/end",
            r"bad\.jsonl:2: an annotation without integer start/end: \{'start': True",
        ),
    ],
)
def test_bad_records_stop_or_are_skipped_and_counted(
    tmp_path: Path, line: str, reason: str, message: str
) -> None:
    p = tmp_path / "bad.jsonl"
    p.write_text('{"text": "good one"}\n' + line + '\n{"text": "good two"}\n')
    with pytest.raises(BuildError, match=message):
        build([p], tmp_path / "stop", annotations_field="spans", progress=False)
    s = build([p], tmp_path / "skip", annotations_field="spans", on_error="skip", max_skipped=0.5)
    assert s.documents == 2 and s.skipped == {reason: 1}
    assert f"skipped 1 ({reason}: 1)" in str(s)


def test_json_that_only_json_reads_is_built(tmp_path: Path) -> None:
    """orjson refuses NaN and lone surrogates; json reads both: NaN is kept, and an
    escaped surrogate pair is one character."""
    p = tmp_path / "ok.jsonl"
    p.write_text('{"text": "smile \\ud83d\\ude00", "score": NaN}\n')
    build([p], tmp_path / "o", tokenizer="bytes", progress=False)
    doc = np.asarray(Documents(tmp_path / "o")[0]).tolist()
    assert bytes(doc[:-1]).decode() == "smile \U0001f600"


@pytest.mark.parametrize("orjson", [True, False])
def test_a_lone_surrogate_is_a_bad_record_with_or_without_orjson(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, orjson: bool
) -> None:
    """Without orjson (an extra), json.loads took a lone surrogate, and the byte
    tokenizer stored it as invalid UTF-8."""
    import tokload.build_records as records

    if not orjson:
        monkeypatch.setattr(records, "_fast_loads", json.loads)
    elif records._fast_loads is json.loads:
        pytest.skip("orjson is not installed")
    p = tmp_path / "in.jsonl"
    p.write_text('{"text": "fine \\ud83d\\ude00"}\n{"text": "a\\ud800b"}\n')
    with pytest.raises(BuildError, match=r"in\.jsonl:2: a string holds a lone surrogate"):
        build([p], tmp_path / "stop", tokenizer="bytes", progress=False)
    s = build([p], tmp_path / "o", tokenizer="bytes", on_error="skip", max_skipped=0.5)
    assert s.documents == 1 and s.skipped == {"lone surrogate in a string": 1}


def test_a_record_with_any_key_is_not_taken_for_a_piece_of_text(tmp_path: Path) -> None:
    """A plain-text piece's context travels beside its record, not in it: a JSONL key
    of the same name as an inner one made the build tokenize after it, or crash."""
    p = tmp_path / "in.jsonl"
    p.write_text(json.dumps({"text": "hello", "\x00tokload:context": 5}) + "\n")
    build([p], tmp_path / "o", tokenizer="bytes", progress=False)
    doc = np.asarray(Documents(tmp_path / "o")[0]).tolist()
    assert bytes(doc[:-1]).decode() == "hello"


def test_unreadable_input(tmp_path: Path) -> None:
    p = tmp_path / "x.jsonl.gz"
    p.write_bytes(b"this is not gzip")
    with pytest.raises(BuildError, match=r"x\.jsonl\.gz: unreadable"):
        build([p], tmp_path / "o1", progress=False)
    # skipped, it leaves no document: an error, not an empty dataset
    with pytest.raises(
        BuildError,
        match=r"produced no documents: all 1 records were skipped \(unreadable input: 1\)",
    ):
        build([p], tmp_path / "o2", on_error="skip")
    assert not (tmp_path / "o2" / "manifest.json").exists()
    with pytest.raises(FileNotFoundError, match="no such input"):
        build([tmp_path / "missing.jsonl"], tmp_path / "o3", progress=False)


def test_kept_parquet_columns_of_types_json_lacks(tmp_path: Path) -> None:
    """Timestamps, dates, decimals and bytes are kept in a JSON form (the build
    crashed with 'Object of type datetime is not JSON serializable')."""
    import base64
    import datetime
    import decimal

    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    when = datetime.datetime(2020, 1, 1, 12, 0)
    table = pa.table(
        {
            "text": ["first document"],
            "ts": [when],
            "day": [when.date()],
            "price": pa.array([decimal.Decimal("1.25")], pa.decimal128(5, 2)),
            "blob": [b"\x00\xff"],
        }
    )
    pq.write_table(table, tmp_path / "data.parquet")
    keep = ["ts", "day", "price", "blob"]
    build([tmp_path / "data.parquet"], tmp_path / "out", keep_fields=keep, progress=False)
    stream = tokload.StreamWithMetadata(tmp_path / "out", window=4, deserialize=json.loads)
    (record,) = list(stream[0].metadata)
    assert record == {
        "document": {
            "ts": "2020-01-01T12:00:00",
            "day": "2020-01-01",
            "price": "1.25",
            "blob": base64.b64encode(b"\x00\xff").decode(),
        }
    }


def test_parquet_nanosecond_times_and_unused_columns(tmp_path: Path) -> None:
    """A Parquet file with a nanosecond timestamp column (as pandas writes them)
    stopped the build with "not safely convertible to microseconds", kept or not,
    in an error naming no file (review37): only the columns the build uses are
    read, and nanosecond times are kept as ISO 8601 text with nine digits."""
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    ns = 1704164645123456789
    table = pa.table(
        {
            "text": ["first document", "second"],
            "crawled": pa.array([ns, None], pa.timestamp("ns")),
            "utc": pa.array([ns, ns], pa.timestamp("ns", tz="UTC")),
            "at": pa.array([3723123456789, 0], pa.time64("ns")),
            "took": pa.array([1_500_000_001, 200 * 86_400 * 10**9], pa.duration("ns")),
            "ny": pa.array([ns, ns], pa.timestamp("ns", tz="America/New_York")),
            "unused": pa.array([{"t": ns}] * 2, pa.struct([("t", pa.timestamp("ns"))])),
        }
    )
    pq.write_table(table, tmp_path / "x.parquet")
    keep = ["crawled", "utc", "at", "took", "ny"]
    build([tmp_path / "x.parquet"], tmp_path / "out", keep_fields=keep, progress=False)
    view = tokload.StreamWithMetadata(tmp_path / "out", window=1, stride=1, deserialize=json.loads)
    docs = Documents(tmp_path / "out")
    got = [view.read(docs.extents([d])[0][:1].astype(np.int64)).metadata[0] for d in (0, 1)]
    assert got == [
        {
            "document": {
                "crawled": "2024-01-02T03:04:05.123456789",
                "utc": "2024-01-02T03:04:05.123456789+00:00",  # as isoformat() writes it
                "at": "01:02:03.123456789",
                "took": 1.500000001,
                "ny": "2024-01-01T22:04:05.123456789-05:00",
            }
        },
        {
            "document": {
                "crawled": None,
                "utc": "2024-01-02T03:04:05.123456789+00:00",
                "at": "00:00:00.000000000",
                "took": 200 * 86_400.0,  # past 2**53 ns
                "ny": "2024-01-01T22:04:05.123456789-05:00",
            }
        },
    ]
    # inside a struct, kept: refused, naming the column
    with pytest.raises(tokload.BuildError, match=r"column 'unused', rows 1 to 2: .*microseconds"):
        build([tmp_path / "x.parquet"], tmp_path / "nested", keep_fields=["unused"], progress=False)
    # not kept, not read (the struct column too): a build without metadata takes the file
    build([tmp_path / "x.parquet"], tmp_path / "plain", progress=False)
    assert len(Documents(tmp_path / "plain")) == 2


def test_a_parquet_string_that_is_not_utf8_is_a_bad_record(tmp_path: Path) -> None:
    """review58: bytes that are not UTF-8 in a Parquet string column (writers that do
    not check leave them) stopped the build blaming nanosecond times, naming a
    batch of rows, and ``on_error='skip'`` could not skip them: the row is a bad
    record now, named, and skipped like a JSONL line that is not Unicode."""
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    offsets = pa.py_buffer(np.array([0, 2, 6, 11], dtype=np.int32).tobytes())
    text = pa.Array.from_buffers(pa.string(), 3, [None, offsets, pa.py_buffer(b"okbad\xffthird")])
    pq.write_table(pa.table({"text": text, "id": [1, 2, 3]}), tmp_path / "x.parquet")
    _builds_skipping_bad_utf8(
        tmp_path, "0xff", 1, [{"text": "ok", "id": 1}, {"text": "third", "id": 3}]
    )


def _builds_skipping_bad_utf8(
    tmp_path: Path, byte: str, skipped: int, want: list[dict[str, Any]]
) -> None:
    """``x.parquet`` (row 2 not UTF-8 at byte 3 of its text) stops a build, naming the
    row; skipping, the rows ``want`` (text and one kept field each) are built."""
    with pytest.raises(
        BuildError,
        match=rf"x\.parquet:2: column 'text' is not UTF-8 at byte 3 of its string "
        rf"\({byte}: invalid start byte\)",
    ):
        build([tmp_path / "x.parquet"], tmp_path / "stop", tokenizer="bytes", progress=False)
    field = [k for k in want[0] if k != "text"]
    s = build([tmp_path / "x.parquet"], tmp_path / "o", tokenizer="bytes", on_error="skip",
              max_skipped=0.9, keep_fields=field, progress=False)  # fmt: skip
    assert (s.documents, s.skipped) == (len(want), {"string not UTF-8": skipped})
    docs = Documents(tmp_path / "o")
    view = tokload.StreamWithMetadata(tmp_path / "o", window=1, stride=1, deserialize=json.loads)
    for d, row in enumerate(want):
        start, length = (int(a[0]) for a in docs.extents([d]))
        tokens = view.read(np.arange(start, start + length - 1)).fields["token"][:, 0]
        assert bytes(tokens.tolist()).decode() == row["text"]
        assert view.read([start]).metadata[0] == {"document": {field[0]: row[field[0]]}}


def test_a_dictionary_encoded_string_that_is_not_utf8_is_a_bad_record(tmp_path: Path) -> None:
    """review61: a dictionary-encoded string column (pandas categoricals) with words
    that are not UTF-8 stopped the build, blaming a struct or list: each row whose
    word is not UTF-8 is a bad record, named, whether the column is the text or a
    kept field, and the rows with good words (nulls included) are kept."""
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    words = pa.array([b"good", b"bad\xfe", b"fine"]).view(pa.string())
    text = pa.DictionaryArray.from_arrays(pa.array([0, 1, 2, 1, 0], pa.int32()), words)
    tags = pa.DictionaryArray.from_arrays(pa.array([0, 0, None, 2, 1], pa.int32()), words)
    pq.write_table(pa.table({"text": text, "tag": tags}), tmp_path / "x.parquet")
    assert pa.types.is_dictionary(pq.read_schema(tmp_path / "x.parquet").field("text").type)
    # rows 2 and 4 (the text) and 5 (the tag) skipped
    want: list[dict[str, Any]] = [{"text": "good", "tag": "good"}, {"text": "fine", "tag": None}]
    _builds_skipping_bad_utf8(tmp_path, "0xfe", 3, want)


def test_nan_and_infinities_are_kept_as_null(tmp_path: Path) -> None:
    """A float column's missing values (NaN) and infinities, from Parquet or JSONL,
    were written as bare ``NaN``/``Infinity``, which strict JSON parsers (orjson,
    JavaScript, serde) refuse (review36): they are ``null``, as pandas writes them."""
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    nan, inf = float("nan"), float("inf")
    pq.write_table(
        pa.table({"text": ["a b", "c d", "e f"], "score": [nan, -inf, 0.5]}), tmp_path / "x.parquet"
    )
    (tmp_path / "y.jsonl").write_text(
        '{"text": "g h", "score": NaN, "spans": [{"start": 0, "end": 1, "w": [1.0, Infinity]}]}\n'
    )
    build(
        [tmp_path / "x.parquet", tmp_path / "y.jsonl"],
        tmp_path / "out",
        keep_fields=["score"],
        annotations_field="spans",
        progress=False,
    )

    def strict(raw: bytes) -> Any:
        return json.loads(raw, parse_constant=lambda c: pytest.fail(f"{c} in {raw!r}"))

    view = tokload.StreamWithMetadata(tmp_path / "out", window=1, stride=1, deserialize=strict)
    docs = Documents(tmp_path / "out")
    got = []
    for d in range(4):
        start = int(docs.extents([d])[0][0])
        got.append(view.read(np.array([start])).metadata[0])
    assert got == [
        {"document": {"score": None}},
        {"document": {"score": None}},
        {"document": {"score": 0.5}},
        {"document": {"score": None}, "annotations": [{"w": [1.0, None]}]},
    ]


def test_an_empty_annotation_inside_a_token_annotates_nothing(tmp_path: Path) -> None:
    """An empty span ``[s, s)`` strictly inside a token of a trained tokenizer (an
    SFT record's empty response in the middle of a word) annotated that token
    (review36): it overlaps none of its characters."""
    tj = _hf_tokenizer(tmp_path / "tokenizer.json")
    tok = tokload.tokenizer.HFTokenizer(tj)
    text = "the quick brown fox"
    (enc,) = tok.encode_batch([text])
    # within a token of several characters, not between two
    inside = next(int(a) + 1 for a, e in enc.offsets if e - a >= 2)
    (tmp_path / "sft.jsonl").write_text(
        json.dumps({"text": text, "spans": [{"start": inside, "end": inside, "role": "x"}]}) + "\n"
    )
    s = build([tmp_path / "sft.jsonl"], tmp_path / "ds", tokenizer=tj, annotations_field="spans",
              progress=False)  # fmt: skip
    assert s.documents == 1 and s.skipped == {}
    view = StreamWithMetadata(tmp_path / "ds", window=1, stride=1, deserialize=json.loads)
    batch = view.read(np.arange(len(view)))
    assert all(p < 0 or "annotations" not in batch.metadata[p] for p in batch.positions[:, 0])


@pytest.mark.parametrize("suffix", [".gz", ".bz2", ".xz"])
def test_a_truncated_compressed_input_keeps_the_records_before_the_damage(
    tmp_path: Path, suffix: str
) -> None:
    """An interrupted download: with on_error='skip', the records before the cut are
    built and the cut one is skipped (a read of 1 MiB lost every record of a file
    that decompressed to less, yet counted one record skipped)."""
    import bz2
    import gzip
    import lzma
    import zlib

    n = 8000 if suffix == ".bz2" else 2000  # bz2 decodes blocks of 900 kB: several
    lines = [json.dumps({"text": f"web page {i} " * 30}) + "\n" for i in range(n)]
    packed = {".gz": gzip, ".bz2": bz2, ".xz": lzma}[suffix].compress("".join(lines).encode())
    p = tmp_path / f"part.jsonl{suffix}"
    p.write_bytes(packed[: len(packed) * 2 // 3])
    with pytest.raises(BuildError, match=rf"part\.jsonl\{suffix}: unreadable"):
        build([p], tmp_path / "stop", tokenizer="bytes", progress=False)
    s = build([p], tmp_path / "o", tokenizer="bytes", on_error="skip", max_skipped=0.5)
    assert s.skipped == {"unreadable input": 1}
    docs = tokload.Documents(tmp_path / "o")
    # every whole line the cut stream still decompresses to (records waiting for the
    # tokenizer, up to 256, were once lost with the cut one)
    decompressor: Any = {
        ".gz": lambda: zlib.decompressobj(wbits=31),
        ".bz2": bz2.BZ2Decompressor,
        ".xz": lzma.LZMADecompressor,
    }[suffix]()
    readable = decompressor.decompress(packed[: len(packed) * 2 // 3])
    assert n // 4 < readable.count(b"\n") < n
    assert len(docs) == readable.count(b"\n")
    for i in (0, len(docs) - 1):  # each one whole: the text of line i, then eos
        doc = np.asarray(docs[i]).tolist()
        assert bytes(doc[:-1]).decode() == json.loads(lines[i])["text"]


def _packed(suffix: str, data: bytes) -> bytes:
    import bz2
    import gzip
    import lzma

    import zstandard

    if suffix == ".zst":
        return zstandard.ZstdCompressor().compress(data)
    packer: Any = {".gz": gzip, ".bz2": bz2, ".xz": lzma}[suffix]
    return bytes(packer.compress(data))


def _zstd_cut_at_a_block_end(data: bytes) -> bytes:
    """A zstd frame written a third at a time (as a streaming writer flushes), cut
    after its first third: what is left decompresses whole, to a block's end."""
    import io

    import zstandard

    buf = io.BytesIO()
    w = zstandard.ZstdCompressor().stream_writer(buf, closefd=False)
    third = len(data) // 3
    w.write(data[:third])
    w.flush(zstandard.FLUSH_BLOCK)
    cut = buf.tell()
    w.write(data[third:])
    w.close()  # type: ignore[no-untyped-call]
    return buf.getvalue()[:cut]


@pytest.mark.parametrize(
    ("suffix", "damage"),
    [
        *[(suffix, "later stream") for suffix in (".gz", ".bz2", ".xz", ".zst")],
        *[(suffix, "empty") for suffix in (".gz", ".bz2", ".xz", ".zst")],
        (".zst", "cut at a block end"),
        (".gz", "deflate"),
    ],
)
def test_a_compressed_input_damaged_anywhere_is_unreadable(
    tmp_path: Path, suffix: str, damage: str
) -> None:
    """review58: a damaged stream after the first (.bz2, .xz: taken for trailing
    garbage), a zstd frame cut at a block's end, an empty .gz or .zst (a failed
    download) were read as if the file ended there: records lost, nothing skipped,
    exit 0; damaged deflate data was "a bug in tokload" (zlib.error). Each is one
    unreadable input now; the records before the damage are built."""
    lines = [json.dumps({"text": f"page {i} " * 20}) + "\n" for i in range(400)]
    first, second = "".join(lines[:200]).encode(), "".join(lines[200:]).encode()
    before = 0
    if damage == "later stream":  # the second of two streams, its header damaged
        later = bytearray(_packed(suffix, second))
        later[1] ^= 0xFF
        data, before = _packed(suffix, first) + bytes(later), 200
    elif damage == "empty":
        data = b""
    elif damage == "deflate":
        whole = bytearray(_packed(suffix, first))
        whole[12] ^= 0xFF  # (zlib.error: "invalid code lengths set")
        data = bytes(whole)
    else:
        data = _zstd_cut_at_a_block_end(first)
    p = tmp_path / f"x.jsonl{suffix}"
    p.write_bytes(data)
    good = tmp_path / "good.jsonl"
    good.write_text(lines[0])
    with pytest.raises(BuildError, match=rf"x\.jsonl\{suffix}: unreadable"):
        build([p, good], tmp_path / "stop", tokenizer="bytes", progress=False)
    s = build([p, good], tmp_path / "o", tokenizer="bytes", on_error="skip", max_skipped=1.0,
              progress=False)  # fmt: skip
    assert s.skipped == {"unreadable input": 1}
    if damage == "later stream":  # the first stream's records, every one
        assert s.documents == before + 1
    elif damage == "empty":
        assert s.documents == 1


@settings(max_examples=60, deadline=None)
@example(suffix=".gz", parts=[(b"", 150_000, 0), (b"", 10, 0)], buffer=7, cut=0.5)
@given(
    suffix=st.sampled_from([".gz", ".bz2", ".xz", ".zst"]),
    parts=st.lists(
        # (runs past 64 KiB: a read's output is cut there, and the stream ends in the next)
        st.tuples(
            st.binary(max_size=3000), st.sampled_from([0, 10, 70_000, 150_000]), st.integers(0, 3)
        ),
        min_size=1,
        max_size=3,
    ),
    buffer=st.sampled_from([7, 4096, 1 << 20]),
    cut=st.floats(0.0, 1.0, exclude_max=True),
)
def test_the_streams_of_a_compressed_file_read_whole_or_raise(
    suffix: str, parts: list[tuple[bytes, int, int]], buffer: int, cut: float
) -> None:
    """``build_records._Streams`` against the data it was made from: the streams
    (random bytes and a long run, then 0 to 3 zero bytes of padding) read back
    whole through reads of any size; cut anywhere, the file raises, or ends
    quietly only where a stream ends (a gzip member that ended inside a read was
    once read twice: zlib keeps what follows in unused_data and unconsumed_tail)."""
    import io
    import lzma
    import zlib

    import zstandard

    from tokload.build_records import _COMPRESSED, _Streams, _zstd

    datas = [head + b"a" * run for head, run, _ in parts]
    blob = b"".join(
        _packed(suffix, d) + bytes(pad) for d, (_, _, pad) in zip(datas, parts, strict=True)
    )
    new = _zstd(Path("x.zst")) if suffix == ".zst" else _COMPRESSED[suffix]

    def read(data: bytes) -> bytes:
        r = io.BufferedReader(_Streams(io.BufferedReader(io.BytesIO(data)), new), buffer)
        got = bytearray()
        while block := r.read(100 if len(got) % 2 else 65536):
            got += block
        return bytes(got)

    assert read(blob) == b"".join(datas)
    if suffix == ".zst" and len(datas) == 1 and parts[0][1] == 150_000:
        # a read hands out its part of what 1 KiB decompressed to (32 MiB at most)
        # without copying the rest (review61: 256 MiB of zeros took 8 s, .gz 0.5 s)
        r = _Streams(io.BufferedReader(io.BytesIO(blob)), new)
        r.readinto(bytearray(10))
        assert r.at == 10 and len(r.out) > 10
    try:
        quiet = read(blob[: max(1, int(cut * len(blob)))])
    except (EOFError, OSError, lzma.LZMAError, zlib.error, zstandard.ZstdError):
        return
    assert quiet in [b"".join(datas[:k]) for k in range(1, len(datas) + 1)]


def test_a_zstd_frame_of_zeros_is_decompressed_in_bounded_pieces() -> None:
    """zstandard's decompressor bounds no output, and a block of 128 KiB of one byte
    is 4 bytes: 4 KiB of input made 128 MiB at once (a crafted file, or a sparse
    one, in each build worker). Its input is fed 1 KiB at a time: 32 MiB at most,
    and the whole file is read back."""
    import io

    zstandard = pytest.importorskip("zstandard")
    from tokload.build_records import _Streams, _zstd

    frame = zstandard.ZstdCompressor(level=3).compress(bytes(96 << 20))
    assert len(frame) < 4096  # (the old feed took it in one piece)
    r = _Streams(io.BufferedReader(io.BytesIO(frame)), _zstd(Path("x.zst")))
    buf, total, largest = bytearray(1 << 20), 0, 0
    while n := r.readinto(buf):
        total += n
        largest = max(largest, len(r.out))
    assert total == 96 << 20 and 0 < largest <= 32 << 20


@pytest.mark.parametrize("suffix", [".gz", ".bz2", ".xz", ".zst"])
def test_streams_one_after_another_and_zero_padding_are_read(tmp_path: Path, suffix: str) -> None:
    """Several streams in one file (``cat a.gz b.gz``, pbzip2) are all read, and
    zero bytes between and after them are padding (as gzip and xz allow)."""
    lines = [json.dumps({"text": f"page {i}"}) + "\n" for i in range(30)]
    parts = [_packed(suffix, "".join(lines[k : k + 10]).encode()) for k in (0, 10, 20)]
    p = tmp_path / f"x.jsonl{suffix}"
    p.write_bytes(parts[0] + parts[1] + bytes(8) + parts[2] + bytes(4))
    s = build([p], tmp_path / "o", tokenizer="bytes", progress=False)
    assert (s.documents, s.skipped) == (30, {})
    docs = tokload.Documents(tmp_path / "o")
    assert bytes(np.asarray(docs[29]).tolist()[:-1]).decode() == "page 29"


def test_a_failure_to_write_is_raised_not_skipped_as_unreadable_input(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only reading an input is guarded: a full disk while writing its records was
    counted as one unreadable input and skipped, with on_error='skip'."""
    import errno

    p = tmp_path / "in.jsonl"
    p.write_text("".join(json.dumps({"text": f"doc {i}"}) + "\n" for i in range(10)))

    def full(self: Any, *args: Any, **kwargs: Any) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(tokload.writer.Writer, "write", full)
    with pytest.raises(OSError, match="No space left") as e:
        build([p], tmp_path / "o", tokenizer="bytes", on_error="skip", progress=False, workers=1)
    assert not isinstance(e.value, BuildError)


def test_cli_exit_codes_and_tools(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    inputs = write_corpus(tmp_path / "in", files=2)
    out = tmp_path / "ds"
    assert (
        main(
            [
                "build",
                *map(str, inputs),
                "-o",
                str(out),
                "--keep-field",
                "id",
                "--annotations",
                "spans",
                "--shard-size",
                "1k",
                "-j",
                "2",
            ]
        )
        == 0
    )
    assert "60 documents" in capsys.readouterr().out
    assert main(["inspect", str(out)]) == 0
    shown = capsys.readouterr().out
    assert "documents   60" in shown and "text    " in shown and "metadata of its first" in shown
    assert main(["verify", str(out)]) == 0
    assert capsys.readouterr().out.endswith(": ok (structure)\n")
    assert main(["bench", str(out), "--seconds", "0.2", "--window", "33", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["tokens_per_s"] > 0
    # corrupt a document index: verify names it and fails
    m = tokload.open_dataset(out).manifest
    assert m is not None
    docs = out / (m.shards[0].name + ".docs")
    d = np.fromfile(docs, "<u8")
    d[-1] += 5  # past the shard's rows
    d.tofile(docs)
    assert main(["verify", str(out)]) == 1
    assert f"document index entry {len(d) - 1} = {d[-1]} breaks" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{oops\n")
    assert main(["build", str(bad), "-o", str(tmp_path / "b")]) == 1
    assert "bad.jsonl:1: malformed JSON" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["build"])
    assert e.value.code == 2
    assert main(["inspect", str(tmp_path / "nothing")]) == 1
    assert os.path.exists(out / "manifest.json")


def test_demo_runs(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo"]) == 0
    out = capsys.readouterr().out
    assert "verify --deep: every file's checksum, every index checks out" in out
    assert "every sample (tokens and metadata) bitwise equal" in out
    assert "demo passed" in out
    assert filecmp  # (imported for dataset comparisons above)
