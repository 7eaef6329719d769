"""Plain-text inputs in bounded memory, and progress a user sees without a terminal.

A plain-text file is one document read in pieces (``build_records.text_pieces``): the pieces
join to the text, cut where a byte-level BPE pre-tokenizer splits anyway, so the
document's tokens are those of the whole text; the ``Writer`` appends the pieces
to one document; a piece cut short by an unreadable byte is taken back.
"""

from __future__ import annotations

import io
import itertools
import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_build import _hf_tokenizer

import tokload
import tokload.build_records
from tokload import BuildError, build
from tokload.build_records import FIRST, LAST, text_pieces
from tokload.format import read_manifest
from tokload.progress import Progress
from tokload.tokenizer import load_tokenizer

WORDS = [
    "alpha", "beta", " ", "  ", "\n", "\n\n", " \n", "\r\n", "x.", "é", "\t", "it's", "12345", "!!",
]  # fmt: skip


def soft_cuts(pieces: list[str]) -> bool:
    """Whether every cut is one ``text_pieces`` prefers (not a forced one)."""
    for a, b in itertools.pairwise(pieces):
        lf = a.endswith("\n") and len(a) > 1 and not a[-2].isspace() and not b[0].isspace()
        crlf = a[-1:].isalnum() and b[:2] == "\r\n"
        line_break = lf or (crlf and len(b) > 2 and not b[2].isspace())
        word = b.startswith(" ") and not a[-1].isspace() and len(b) > 1 and not b[1].isspace()
        if not (line_break or word):
            return False
    return True


LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
    r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@pytest.fixture(scope="module", params=["trained", "GPT-2 with a CRLF merge", "Llama 3's"])
def bpe(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tokload.tokenizer.Tokenizer:
    """Byte-level BPE tokenizers: one trained on ``WORDS``, and GPT-2's and Llama 3's
    pre-tokenizers with a merge of ``\r\n`` (which GPT-2's pattern splits in two
    inside a text but not at its end: a cut after one changed a token, review58)."""
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    if request.param == "trained":
        return load_tokenizer(_hf_tokenizer(path))
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab["\u010d\u010a"] = len(vocab)  # "\r\n" as GPT-2's byte-to-unicode map spells it
    vocab["<|endoftext|>"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab, [("\u010d", "\u010a")]))
    if request.param.startswith("GPT-2"):
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    tok.decoder = decoders.ByteLevel()
    tok.save(str(path))
    return load_tokenizer(path)


@settings(max_examples=300, deadline=None)
@given(words=st.lists(st.sampled_from(WORDS), max_size=300), piece=st.integers(4, 64))
def test_pieces_join_to_the_text_and_tokenize_as_it(
    bpe: tokload.tokenizer.Tokenizer, words: list[str], piece: int
) -> None:
    text = "".join(words)
    got = list(text_pieces(io.BytesIO(text.encode()), piece))
    pieces = [p for _, p in got]
    assert "".join(pieces) == text
    flags = [f for f, _ in got]
    assert flags[0] & FIRST and flags[-1] & LAST
    assert all(not f & FIRST for f in flags[1:]) and all(not f & LAST for f in flags[:-1])
    # bounded: a piece is at most a few times the piece size (in characters)
    assert all(len(p) <= 5 * piece + 4 for p in pieces)
    if soft_cuts([p for p in pieces if p]):
        whole = bpe.encode_many([text], offsets=False).ids
        parts = bpe.encode_many(pieces, offsets=False).ids
        assert whole.tolist() == parts.tolist()


def test_a_text_without_places_to_cut_is_cut_where_it_stands() -> None:
    text = "x" * 1000
    got = list(text_pieces(io.BytesIO(text.encode()), 16))
    assert "".join(p for _, p in got) == text and len(got) > 1


@pytest.mark.parametrize("eol", ["\n", "\r\n"])
def test_a_text_is_cut_at_a_line_break_however_far_back(
    bpe: tokload.tokenizer.Tokenizer, eol: str
) -> None:
    """A file with Windows line ends and no spaces (a CSV export) was never cut at a
    line break (the CR counted as white space before the LF), and a table padded
    with spaces hid its last good place behind 64 bad ones: both were cut where they
    stood, mid-word, and the tokens there differed from the whole text's (review42)."""
    csv = "".join(f"{k},Paris,France,capital{eol}" for k in range(400))
    got = [p for _, p in text_pieces(io.BytesIO(csv.encode()), 256)]
    assert "".join(got) == csv and len(got) > 4 and soft_cuts(got)
    whole = bpe.encode_many([csv], offsets=False).ids
    parts = bpe.encode_many(got, offsets=False).ids
    assert whole.tolist() == parts.tolist()
    # the one good place, then 600 lines of a space alone: found, not passed by
    table = "Paris" + eol + "capital" + (" " + eol) * 600
    first = next(text_pieces(io.BytesIO(table.encode()), 256))[1]
    assert first == "Paris" + ("\n" if eol == "\n" else "")  # (before a \r\n: review58)


@pytest.mark.parametrize("piece", [3, 5, 64])
def test_a_byte_that_is_not_utf8_is_named_by_its_offset_in_the_file(piece: int) -> None:
    """The decoder's own position counts from the block it was given (byte 720,000 of
    a file was reported as position 195,712); a character cut by a read counts too."""
    head = ("é" * 7 + " word\n") * 5
    data = head.encode() + b"\xc3" + b" tail"  # a lead byte, then no continuation
    with pytest.raises(UnicodeDecodeError, match=f"not UTF-8 at byte {len(head.encode())} "):
        list(text_pieces(io.BytesIO(data), piece))


def test_a_byte_order_mark_is_not_text() -> None:
    got = list(text_pieces(io.BytesIO(b"\xef\xbb\xbfhello \xef\xbb\xbf"), 4))
    assert "".join(p for _, p in got) == "hello \ufeff"  # only the first is a mark
    # a bad byte after a mark is named by its offset in the file, the mark counted
    with pytest.raises(UnicodeDecodeError, match="not UTF-8 at byte 8 "):
        list(text_pieces(io.BytesIO(b"\xef\xbb\xbfhello\xff world"), 64))


def test_a_byte_order_mark_before_a_blank_jsonl_line_is_dropped(tmp_path: Path) -> None:
    """A JSONL file whose mark is followed by a blank line, or that holds only the
    mark, failed with "malformed JSON" at line 1 (review37): the mark is dropped
    before the line is looked at, so the line is blank, as without the mark."""
    (tmp_path / "blank.jsonl").write_bytes(b'\xef\xbb\xbf\r\n{"text": "first"}\r\n')
    (tmp_path / "only.jsonl").write_bytes(b"\xef\xbb\xbf\n")
    (tmp_path / "other.jsonl").write_bytes(b'\xef\xbb\xbf{"text": "other"}\n')
    s = build([tmp_path], tmp_path / "out", tokenizer="bytes", progress=False)
    assert s.skipped == {}
    assert _texts(tmp_path / "out") == [b"first", b"other"]


def test_a_text_field_named_path_holds_a_text_files_text(tmp_path: Path) -> None:
    """With ``--text-field path`` a plain-text input's document was its own file name
    (the record's ``path`` wrote over the text, review37)."""
    (tmp_path / "notes.txt").write_text("hello from a text file\n")
    (tmp_path / "a.jsonl").write_text('{"path": "text in the field path"}\n')
    build([tmp_path], tmp_path / "out", tokenizer="bytes", text_field="path", progress=False)
    assert _texts(tmp_path / "out") == [b"text in the field path", b"hello from a text file\n"]


def _texts(path: Path) -> list[bytes]:
    """The documents of a build with the bytes tokenizer, as bytes (EOS dropped)."""
    docs = tokload.Documents(path)
    out = []
    for i in range(len(docs)):
        tokens = docs[i]
        assert isinstance(tokens, np.ndarray)
        out.append(bytes(tokens[:-1].tolist()))
    return out


def test_a_multibyte_character_across_reads_is_whole() -> None:
    text = "é" * 100 + " word " * 10
    got = list(text_pieces(io.BytesIO(text.encode()), 7))
    assert "".join(p for _, p in got) == text


def _sentencepiece_like(path: Path, kind: str, text: str) -> Path:
    """A BPE tokenizer.json that treats the start of its input apart, as Hugging Face's
    conversions of SentencePiece models do: a Metaspace pre-tokenizer that prepends its
    "▁" to the first word (Mistral, Llama 2 lately), or a Prepend("▁") normalizer
    (Llama 2's first conversions). Its merges stay within words and lines, as theirs."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, normalizers, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE(unk_token="<unk>"))
    lines = pre_tokenizers.Split("\n", "isolated")
    if kind == "metaspace":
        first = pre_tokenizers.Metaspace("\u2581", prepend_scheme="first")
        tok.pre_tokenizer = pre_tokenizers.Sequence([lines, first])
    else:
        tok.normalizer = normalizers.Sequence(
            [normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")]
        )
        words = pre_tokenizers.Split("\u2581", "merged_with_next")
        tok.pre_tokenizer = pre_tokenizers.Sequence([lines, words])
    trainer = trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "<s>", "</s>"])
    tok.train_from_iterator([text], trainer)
    tok.save(str(path))
    return path


@pytest.mark.parametrize(
    ("kind", "bos"), [("bpe", False), ("bytes", True), ("metaspace", False), ("prepend", True)]
)
def test_a_text_file_in_pieces_is_one_document_with_the_whole_texts_tokens(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str, bos: bool
) -> None:
    """Tokenizers that treat the start of their input apart put a "▁" of their own at
    the start of every piece, until each was tokenized after the end of the one before."""
    lines = [f"line {i}: the {'quick' if i % 3 else 'lazy'} brown fox" for i in range(3000)]
    text = "\n".join(lines) + "\n"
    tj: Path | str = "bytes"
    if kind == "bpe":
        tj = _hf_tokenizer(tmp_path / "tokenizer.json")
    elif kind != "bytes":
        tj = _sentencepiece_like(tmp_path / "tokenizer.json", kind, text)
    tok = load_tokenizer(tj)
    (tmp_path / "big.txt").write_text(text)
    (tmp_path / "small.txt").write_text("a small one")
    monkeypatch.setattr(tokload.build_records, "_TEXT_PIECE", 1024)  # about 100 pieces
    inputs = [tmp_path / "big.txt", tmp_path / "small.txt"]
    s = build(
        inputs, tmp_path / "ds", tokenizer=tj, bos=bos, keep_fields=["path"], shard_bytes=4096
    )
    assert s.documents == 2
    docs = tokload.Documents(tmp_path / "ds")
    want = tok.encode_many([text, "a small one"], offsets=False)
    for d, (a, b) in enumerate(zip(want.bounds, want.bounds[1:], strict=False)):
        expect = want.ids[a:b].tolist()
        expect = ([tok.bos_id] if bos else []) + expect + [tok.eos_id]
        got = docs[d]
        assert isinstance(got, dict)
        assert got["token"].tolist() == expect
    # one document of one shard, however large (the shard grows past shard_bytes)
    m = read_manifest(tmp_path / "ds")
    assert [sh.documents for sh in m.shards] == [1, 1]
    # every token of the big document carries its document's record
    stream = tokload.StreamWithMetadata(tmp_path / "ds", window=64, deserialize=json.loads)
    records = list(stream[10].metadata)  # a window inside the big document
    assert records == [{"document": {"path": str(tmp_path / "big.txt")}}]


@pytest.mark.parametrize("suffix", [".gz", ".bz2", ".xz", ".zst"])
def test_a_compressed_text_file_is_read_decompressed(tmp_path: Path, suffix: str) -> None:
    """``book.txt.gz`` is listed as compressed text: it was read raw (its first byte is
    no UTF-8, so the build failed, or skipped it with ``on_error='skip'``)."""
    import bz2
    import gzip
    import lzma

    text = "".join(f"line {i} of a book\n" for i in range(2000)).encode()
    if suffix == ".zst":
        zstandard = pytest.importorskip("zstandard")
        packed = zstandard.ZstdCompressor().compress(text)
    else:
        packed = {".gz": gzip, ".bz2": bz2, ".xz": lzma}[suffix].compress(text)
    (tmp_path / f"book.txt{suffix}").write_bytes(packed)
    (tmp_path / "plain.txt").write_bytes(text)
    build([tmp_path / f"book.txt{suffix}"], tmp_path / "z", progress=False)
    build([tmp_path / "plain.txt"], tmp_path / "p", progress=False)
    z, p = tokload.Documents(tmp_path / "z"), tokload.Documents(tmp_path / "p")
    assert len(z) == len(p) == 1
    np.testing.assert_array_equal(np.asarray(z[0]), np.asarray(p[0]))


def test_an_unreadable_text_file_leaves_no_part_of_its_document(tmp_path: Path) -> None:
    good = b"first line\nsecond line\n" * 200
    (tmp_path / "bad.txt").write_bytes(good + b"\xff\xfe not utf-8" + good)
    (tmp_path / "ok.txt").write_text("fine")
    with pytest.raises(
        BuildError, match=rf"bad\.txt: unreadable: not UTF-8 at byte {len(good):,} \(0xff: invalid"
    ):
        build([tmp_path / "bad.txt"], tmp_path / "o1")
    s = build(
        [tmp_path / "bad.txt", tmp_path / "ok.txt"],
        tmp_path / "o2",
        on_error="skip",
        max_skipped=0.5,
    )
    assert (s.documents, s.skipped) == (1, {"unreadable input": 1})
    assert s.tokens == len("fine") + 1  # nothing of bad.txt's pieces before the bad byte


# ---- the Writer's pieces -----------------------------------------------------------------


@pytest.mark.parametrize("layout", ["blocks", "spans", None])
def test_writer_pieces_make_one_document(tmp_path: Path, layout: str | None) -> None:
    meta = layout is not None
    dtype = [("token", "<u2")] if meta else "<u2"
    with tokload.Writer(
        tmp_path / "ds", dtype=dtype, shard_bytes=8, metadata=meta, metadata_layout=layout
    ) as w:
        w.write({"token": [9, 9]} if meta else [9, 9], spans=[(0, 2, b"d0")] if meta else None)
        for k in range(5):
            piece = np.arange(k * 3, k * 3 + 3)
            rows = {"token": piece} if meta else piece
            w.write(rows, spans=[(0, 3, b"doc")] if meta else None, end=k == 4)
        w.write({"token": [1]} if meta else [1], end=False)
        w.discard()  # taken back
        w.write({"token": [7]} if meta else [7])
        w.write({"token": [8]} if meta else [8], end=False)  # never ended: dropped at close
    docs = tokload.Documents(tmp_path / "ds")
    got = []
    for i in range(len(docs)):
        d = docs[i]
        got.append(d["token"].tolist() if isinstance(d, dict) else d.tolist())
    assert got == [[9, 9], list(range(15)), [7]]
    if meta:
        stream = tokload.StreamWithMetadata(tmp_path / "ds", window=3, stride=3)
        assert [bytes(r) for r in stream[2].metadata] == [b"doc"]


def test_writer_refuses_a_flush_inside_a_document(tmp_path: Path) -> None:
    with tokload.Writer(tmp_path / "ds", dtype="<u2") as w:
        w.write([1, 2], end=False)
        with pytest.raises(ValueError, match="flush in the middle of a document"):
            w.flush()
        w.write([3])
    assert tokload.Documents(tmp_path / "ds")[0].tolist() == [1, 2, 3]  # type: ignore[union-attr]


# ---- progress without a terminal ---------------------------------------------------------


def test_progress_lines_every_interval_with_rate_and_eta() -> None:
    now = [100.0]
    lines: list[str] = []
    p = Progress(None, 4_000_000_000, lines.append, every=30, clock=lambda: now[0])
    p.update(1_000_000, 10, 500)
    assert lines == []  # not yet 30 s
    now[0] += 40
    p.update(999_000_000, 990, 99_500)
    assert lines == [
        "25.0% of 4.00 GB, 1,000 documents, 100,000 tokens, 25.0 MB/s, 2 min 00 s left"
    ]
    now[0] += 10
    p.update(1, 0, 0)
    assert len(lines) == 1
    p.close()
    Progress(False, 10, lines.append, every=0).update(5)  # off: no line
    assert len(lines) == 1


def test_a_build_without_a_terminal_logs_progress(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tokload.__main__ import main

    with open(tmp_path / "a.jsonl", "w") as f:
        for _ in range(3000):
            f.write(json.dumps({"text": "some words here " * 100}) + "\n")
    args = ["build", str(tmp_path / "a.jsonl"), "-o", str(tmp_path / "o"), "--tokenizer", "bytes"]
    assert main([*args, "--progress-every", "0.000001"]) == 0
    err = capsys.readouterr().err
    progress = [line for line in err.splitlines() if " documents, " in line and "/s" in line]
    assert progress, err
    assert progress[0].startswith("tokload build: ") and "% of " in progress[0]
