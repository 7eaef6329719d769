"""One chunk of a build's input as records: the reading side of ``tokload build``.

The one job of this module: open a chunk's input (checked against the plan,
every byte hashed as it is read, so the chunk's content hash costs no second
pass) and give its records one by one: the lines of a JSONL file (gzip, bz2,
xz or zstd compressed, or a byte range of an uncompressed one), the rows of a
Parquet file's row groups, or a plain-text file as pieces of bounded size.
A record that cannot be used comes with a reason key (``MALFORMED_JSON`` ...)
and a message naming what is wrong; the caller stops or skips it.
JSON is parsed with ``orjson`` where installed.
"""

from __future__ import annotations

import bz2
import codecs
import contextlib
import hashlib
import io
import json
import lzma
import os
import re
import zlib
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import IO, Any

from tokload.build_plan import Chunk, row_group_range
from tokload.errors import BuildError
from tokload.inputs import kind as input_kind


def _json_loads() -> Callable[[bytes], Any]:
    """orjson's ``loads`` where installed (about 4x faster than json's), else json's."""
    try:
        import orjson
    except ImportError:  # pragma: no cover - depends on the environment
        return json.loads
    return orjson.loads


_fast_loads = _json_loads()

_READ_CHUNK = 1 << 20
_COMPRESSED: dict[str, Callable[[], Any]] = {
    ".gz": lambda: zlib.decompressobj(16 + zlib.MAX_WBITS),  # a gzip member, checked
    ".bz2": bz2.BZ2Decompressor,
    ".xz": lzma.LZMADecompressor,
}
"""A new decompressor of one stream (a gzip member, a bzip2 or xz stream, a zstd
frame), by the file's suffix (.zst: ``_zstd``)."""


class _RangeReader(io.RawIOBase):
    """A raw reader of ``limit`` bytes of ``f`` that feeds every byte it returns
    to a hash and counts them: the chunk's content hash costs no second pass."""

    def __init__(self, f: IO[bytes], limit: int | None, h: Any) -> None:
        self._f = f
        self._left = limit
        self.hash = h
        self.count = 0

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        view = memoryview(b)
        if self._left is not None:
            view = view[: self._left]
        n = int(self._f.readinto(view) or 0)  # type: ignore[attr-defined]
        if n:
            self.hash.update(view[:n])
            self.count += n
            if self._left is not None:
                self._left -= n
        return n


class ChunkInput:
    """One chunk's input opened once: checked against the plan, hashed as it is read."""

    def __init__(self, chunk: Chunk) -> None:
        self.chunk = chunk
        self.path = Path(chunk.path)
        self.hash = hashlib.sha256()
        self._raw = open(self.path, "rb", buffering=0)  # noqa: SIM115 - closed by close()
        st = os.fstat(self._raw.fileno())
        if (st.st_size, st.st_mtime_ns) != chunk.identity:
            self._raw.close()
            raise BuildError(
                f"{self.path}: changed while the build was running (size or modification "
                "time); run the build again"
            )
        self.reader: _RangeReader | None = None

    def binary(self, start: int = 0, end: int | None = None) -> IO[bytes]:
        self._raw.seek(start)
        self.reader = _RangeReader(self._raw, None if end is None else end - start, self.hash)
        return io.BufferedReader(self.reader, _READ_CHUNK)

    def consumed(self) -> int:
        return self.reader.count if self.reader is not None else 0

    def record(self) -> dict[str, Any]:
        size, mtime = self.chunk.identity
        return {"path": os.path.abspath(self.path), "size": size, "mtime_ns": mtime}

    def close(self) -> None:
        self._raw.close()


def _open_lines(inp: ChunkInput) -> IO[bytes]:
    chunk = inp.chunk
    if chunk.unit == "bytes":
        return inp.binary(chunk.start, chunk.end)
    return _decompressed(inp)


def _decompressed(inp: ChunkInput) -> IO[bytes]:
    """The whole input's bytes, decompressed by its suffix (.gz, .bz2, .xz, .zst);
    the hash still covers the bytes on disk."""
    path = inp.path
    raw = inp.binary()
    last = path.suffix.lower()
    if last in _COMPRESSED:
        return io.BufferedReader(_Streams(raw, _COMPRESSED[last]), _READ_CHUNK)
    if last == ".zst":
        return io.BufferedReader(_Streams(raw, _zstd(path)), _READ_CHUNK)
    return raw


def _zstd(path: Path) -> Callable[[], Any]:
    try:
        import zstandard
    except ImportError:
        raise BuildError(f"{path}: reading .zst needs the 'zstandard' package") from None
    return lambda: zstandard.ZstdDecompressor().decompressobj()


class _Streams(io.RawIOBase):
    """The decompressed bytes of every stream of a compressed file, one after the
    other (``cat a.gz b.gz``, pbzip2's and pzstd's files), from decompressor objects
    (``new()`` makes one a stream): zero bytes between streams are padding. A file
    that ends inside a stream (a copy cut short), holds no stream (an empty file)
    or holds anything else after a stream raises, where the standard readers stop
    quietly: zstandard's at a cut at a block's end, bz2's and lzma's at a damaged
    later stream (taken for trailing garbage), gzip's and zstandard's on an empty
    file; each stops the build or is one skipped record (``read_errors``).

    Each read returns what one read of the file decompresses to (at most 64 KiB
    or the buffer's size: zstandard's output has no bound, its input is fed a
    little at a time), so the lines before a damaged part are read and built
    before its error is raised."""

    _IN = 1 << 16
    _ZSTD_IN = 1 << 10  # (zstandard bounds no output: 1 KiB of a crafted file make 32 MiB)

    def __init__(self, raw: IO[bytes], new: Callable[[], Any]) -> None:
        self.raw, self.new = raw, new
        self.d: Any = None  # the stream being read; None between streams
        self.data: bytes | memoryview = b""  # input not yet given to a decompressor
        self.out = b""  # output, returned up to ``at``
        self.at = 0
        self.streams = 0
        self.ended = False  # the file is read

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        want = len(b)
        while self.at >= len(self.out):
            if self.d is None and not self._next_stream():
                return 0
            # (64 KiB at least: small reads would copy the input over and over)
            self.out, self.at = self._decompress(max(want, self._IN)), 0
            if self.d.eof:
                self.data, self.d = self.d.unused_data + self.data, None
        n = min(want, len(self.out) - self.at)
        b[:n] = memoryview(self.out)[self.at : self.at + n]  # (no copy of the rest)
        self.at += n
        return n

    def _fill(self) -> bool:
        """More input if ``data`` is empty; False at the file's end."""
        if not self.data and not self.ended:
            self.data = self.raw.read(self._IN)
            self.ended = not self.data
        return bool(self.data)

    def _next_stream(self) -> bool:
        """Start the next stream; False at the file's end, after one stream at least."""
        while self._fill():
            self.data = bytes(self.data).lstrip(b"\0")  # padding between streams
            if self.data:
                self.d, self.streams = self.new(), self.streams + 1
                return True
        if not self.streams:
            raise EOFError("no compressed stream in the file (an empty file)")
        return False

    def _decompress(self, want: int) -> bytes:
        """Some output of the stream being read: b"" where it took input and gave
        nothing yet, or at its end."""
        d = self.d
        if isinstance(d, (bz2.BZ2Decompressor, lzma.LZMADecompressor)):
            # (these hold the input they are given: more only when they need it)
            if not d.needs_input:
                return bytes(d.decompress(b"", want))
            if not self._fill():
                raise EOFError(_CUT_SHORT)
            data, self.data = self.data, b""
            return bytes(d.decompress(data, want))
        self._fill()
        if isinstance(d, _ZLIB):
            # (at the file's end too: output held back by ``want`` comes without input)
            out = d.decompress(self.data, want)
            # (at the stream's end, what follows is in unused_data, and also in
            # unconsumed_tail when there is some)
            self.data = b"" if d.eof else d.unconsumed_tail
            if not out and not d.eof and not self.data and self.ended:
                raise EOFError(_CUT_SHORT)
            return bytes(out)
        if not self.data:  # (zstandard gives all it can of what it is given)
            raise EOFError(_CUT_SHORT)
        data = memoryview(self.data)  # (slices of the input, not copies of its rest)
        self.data = data[self._ZSTD_IN :]
        return bytes(d.decompress(data[: self._ZSTD_IN]))


_ZLIB = type(zlib.decompressobj())
_CUT_SHORT = "the compressed file ends inside a stream (a file cut short)"


def lines_before(path: Path, offset: int) -> int:
    """Newlines in the first ``offset`` bytes (only to name a bad line: never on the hot path)."""
    n = 0
    with open(path, "rb") as f:
        while offset > 0:
            block = f.read(min(offset, _READ_CHUNK))
            if not block:
                break
            n += block.count(b"\n")
            offset -= len(block)
    return n


# Why a record is skipped: one key per reason, whatever the details of the message.
MALFORMED_JSON = "malformed JSON"
NOT_AN_OBJECT = "not a JSON object"
NO_TEXT = "missing text field"
TEXT_NOT_STRING = "text field not a string"
ANNOTATIONS_NOT_LIST = "annotations not a list"
ANNOTATION_NO_SPAN = "annotation without integer start/end"
ANNOTATION_OUTSIDE = "annotation outside the text"
UNREADABLE = "unreadable input"
NOT_JSON = "field without a JSON form"
NOT_UNICODE = "lone surrogate in a string"
NOT_UTF8 = "string not UTF-8"

Record = tuple[int, dict[str, Any] | None, tuple[str, str] | None, int, str]
"""(line, record, (reason key, message), FIRST/LAST flags, context) of one input record;
lines count from the chunk's first (1) and rows from the file's first; a plain-text
document comes in pieces (see ``text_pieces``), each after the end of the one before
(its context: "" for the others), which its tokens are taken after."""


class _NotUnicode(ValueError):
    """A JSON string escapes half of a surrogate pair alone (``"\\ud800"``): valid
    JSON, but not Unicode text that a tokenizer (or UTF-8) can take."""


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
"""A JSON escape of half a surrogate pair (alone or not: the check tells them apart)."""


def _parse_line(line: bytes) -> Any:
    try:
        rec = _fast_loads(line)
    except ValueError:
        # orjson is stricter (NaN, lone surrogates) and words errors its own way:
        # json decides, and words the error.
        rec = json.loads(line)
        _check_unicode(rec)
        return rec
    if _fast_loads is json.loads and _SURROGATE_ESCAPE.search(line):  # no orjson
        _check_unicode(rec)
    return rec


def _check_unicode(rec: Any) -> None:
    """The one strictness of orjson kept whatever parsed ``rec``: its strings are
    Unicode text (``_NotUnicode`` for a lone surrogate)."""
    try:
        json.dumps(rec, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as e:
        bad = e.object[e.start : e.end]
        raise _NotUnicode(
            f"a string holds a lone surrogate ({bad.encode('unicode_escape').decode()}): "
            "not Unicode text"
        ) from None
    except (TypeError, ValueError, RecursionError):  # json's business, not ours
        pass


def records(
    inp: ChunkInput, text_field: str, columns: Sequence[str] | None = None
) -> Iterator[Record]:
    """The records of a chunk of an input. ``columns``: the fields the build uses
    (None: all); a Parquet file's other columns are not read."""
    path, chunk = inp.path, inp.chunk
    kind = input_kind(path)
    if kind == "jsonl":
        with _open_lines(inp) as f:
            for line_no, line in enumerate(f, 1):
                if line_no == 1 and (chunk.unit != "bytes" or chunk.start == 0):
                    line = line.removeprefix(codecs.BOM_UTF8)  # not text, even before a blank
                if not line.strip():
                    continue
                try:
                    rec = _parse_line(line)
                except _NotUnicode as e:
                    yield line_no, None, (NOT_UNICODE, str(e)), WHOLE, ""
                    continue
                except (ValueError, RecursionError) as e:
                    detail = (
                        # (some of json's messages end in "at": "Invalid control character at")
                        f"{e.msg.removesuffix(' at')} at column {e.colno}"
                        if isinstance(e, json.JSONDecodeError)
                        else str(e).split(";")[0] or type(e).__name__
                    )
                    yield line_no, None, (MALFORMED_JSON, f"malformed JSON ({detail})"), WHOLE, ""
                    continue
                if not isinstance(rec, dict):
                    yield (
                        line_no,
                        None,
                        (NOT_AN_OBJECT, f"a JSON {type(rec).__name__}, not an object"),
                        WHOLE,
                        "",
                    )
                    continue
                yield line_no, rec, None, WHOLE, ""
    elif kind == "parquet":
        try:
            import pyarrow as pa
            import pyarrow.parquet as pq
        except ImportError:
            raise BuildError(f"{path}: reading Parquet needs the 'pyarrow' package") from None
        # One pass over the disk: hash the chunk's row groups, then Parquet reads cached pages.
        with pa.memory_map(str(path)) as mf:
            pf = pq.ParquetFile(mf)
            meta = pf.metadata
            _check_column(path, pf.schema_arrow, text_field)
            groups = range(chunk.start, chunk.end)
            for g in groups:
                a, b = row_group_range(meta, g)
                mf.seek(a)
                while a < b:
                    buf = mf.read_buffer(min(b - a, _READ_CHUNK * 16))
                    if not buf.size:
                        break
                    inp.hash.update(memoryview(buf))
                    a += buf.size
            row = sum(meta.row_group(g).num_rows for g in range(chunk.start))
            if not groups:
                return
            used = None if columns is None else set(columns)
            wanted = None if used is None else [c for c in pf.schema_arrow.names if c in used]
            for batch in pf.iter_batches(batch_size=1024, row_groups=list(groups), columns=wanted):
                for rec in _parquet_rows(batch, path, row):
                    row += 1
                    if isinstance(rec, str):  # a string that is not UTF-8
                        yield row, None, (NOT_UTF8, rec), WHOLE, ""
                    else:
                        yield row, rec, None, WHOLE, ""
    else:
        with _decompressed(inp) as f:
            before = ""  # the end of the piece before (Record's context)
            for flags, piece in text_pieces(f):
                # (the text wins when the text field is called "path")
                yield 1, {"path": str(path), text_field: piece}, None, flags, before
                before = piece[-_CONTEXT_CHARS:]


_TEXT_PIECE = 256 << 10
"""Bytes of a plain-text input read (and tokenized) at a time."""

_CONTEXT_CHARS = 256
"""Characters of a plain-text piece's end that the next piece is tokenized after
(``build_part._encode_pieces``)."""

FIRST, LAST = 1, 2
WHOLE = FIRST | LAST
"""Where a record's text stands in its document: its first piece, its last, or all of it."""


class NotUTF8(UnicodeDecodeError):
    """A text file's byte that is not UTF-8, named by its offset in the file (the
    decoder's own position counts from the block it was given)."""

    def __init__(self, e: UnicodeDecodeError, offset: int) -> None:
        super().__init__(e.encoding, e.object, e.start, e.end, e.reason)
        self.offset = offset

    def __str__(self) -> str:
        return f"not UTF-8 at byte {self.offset:,} (0x{self.object[self.start]:02x}: {self.reason})"


def text_pieces(f: IO[bytes], piece: int | None = None) -> Iterator[tuple[int, str]]:
    """A plain-text file as pieces of about ``piece`` bytes, each with its place
    (``FIRST``/``LAST`` flags): memory stays bounded whatever the file's size.

    A piece ends at a line break between two characters that are not white space
    (after a ``\\n``, before a ``\\r\\n`` that follows a letter or digit), else
    before a space between two words: a byte-level BPE
    pre-tokenizer (GPT-2's and Llama 3's patterns, most tokenizer.json files)
    splits the text there anyway, so the pieces' tokens are the whole text's.
    (A tokenizer that treats the start of its input apart, as SentencePiece's
    do, tokenizes each piece after the end of the one before: ``Record``.)
    Only a text with neither in 4 pieces' length is cut where it stands (the
    tokens next to that cut may then differ from the whole text's).
    A UTF-8 byte order mark at the start is dropped. Raises ``NotUTF8`` (a
    ``UnicodeDecodeError``) at the first byte that is not UTF-8.
    """
    size = piece or _TEXT_PIECE
    # utf-8-sig: a byte order mark at the start is not text (records drops it from JSONL too)
    decoder = codecs.getincrementaldecoder("utf-8-sig")("strict")
    carry = ""
    first = True
    read = 0  # bytes read before this block
    while True:
        block = f.read(size)
        held = len(decoder.getstate()[0])  # bytes of a character the last block cut
        try:
            text = carry + decoder.decode(block, final=not block)
        except UnicodeDecodeError as e:
            # (utf-8-sig counts from after a byte order mark it takes off the first block)
            mark = len(codecs.BOM_UTF8) if not read and block.startswith(codecs.BOM_UTF8) else 0
            raise NotUTF8(e, read - held + mark + e.start) from None
        read += len(block)
        if not block:
            yield (FIRST if first else 0) | LAST, text
            return
        cut = _cut(text) if len(text) >= size else -1
        if cut < 0 and len(text) >= 4 * size:
            cut = len(text)
        if cut <= 0:
            carry = text
            continue
        yield (FIRST if first else 0), text[:cut]
        first = False
        carry = text[cut:]


_LINE_BREAK = re.compile(r"(?<=\S)\n(?=\S)|(?<=[^\W_])(?=\r\n\S)")
"""Where a line break lets a text be cut: after a ``\n`` between two characters
that are not white space, or before a ``\r\n`` after a letter or digit and before
one that is not white space. (After a ``\r\n``, GPT-2's pattern would take it
whole at a piece's end, where inside a text it splits ``\r`` from ``\n``; before
one after punctuation, Llama 3's would split ``.\r\n``, which it takes whole.)"""
_WORD_SPACE = re.compile(r"(?<=\S) (?=\S)")
"""A space between two words."""


def _cut(text: str) -> int:
    """Where ``text`` may be cut (see ``text_pieces``), or -1: at the last line
    break ``_LINE_BREAK`` finds, else before
    the last space between two words. The whole text is searched (the tail first):
    a table padded with spaces may hold its last such place far from its end."""
    for pattern, end in ((_LINE_BREAK, True), (_WORD_SPACE, False)):
        for tail in (1 << 16, len(text)):  # (most texts have one near the end)
            last = None
            for m in pattern.finditer(text, max(0, len(text) - tail)):
                last = m
            if last is not None:
                return last.end() if end else last.start()
            if tail >= len(text):
                break
    return -1


def _parquet_rows(batch: Any, path: Path, before: int) -> list[dict[str, Any] | str]:
    """The rows of a Parquet record batch as dicts (``before``: rows before it, for
    errors), and in place of a row with a string column that is not UTF-8 (which
    writers that do not check leave), what is wrong with it. Nanosecond times, which
    Python's lack (pandas writes them), are ISO 8601 text with nine digits
    (``2024-01-02T03:04:05.123456789``, a zone as ``+00:00``, as microsecond ones
    are), nanosecond durations seconds. Inside a struct or list column they are
    refused, naming the column, as are strings there that are not UTF-8."""
    import pyarrow as pa
    import pyarrow.compute as pc

    bad = _not_utf8(batch)
    if bad:
        batch = batch.take([i for i in range(batch.num_rows) if i not in bad])
    cols = []
    try:
        for col in batch.columns:
            t = col.type
            if pa.types.is_timestamp(t) and t.unit == "ns":
                col = pc.replace_substring(col.cast(pa.string()), " ", "T", max_replacements=1)
                if t.tz is not None:  # Arrow writes "Z" and "-0500"; isoformat "+00:00", "-05:00"
                    col = pc.replace_substring_regex(col, "Z$", "+00:00")
                    col = pc.replace_substring_regex(col, r"([+-]\d\d)(\d\d)$", r"\1:\2")
            elif pa.types.is_time64(t) and t.unit == "ns":
                col = col.cast(pa.string())
            elif pa.types.is_duration(t) and t.unit == "ns":  # (past 2**53 ns: rounded)
                col = pc.divide(col.cast(pa.int64()).cast(pa.float64(), safe=False), 1e9)
            cols.append(col)
        rows: list[dict[str, Any]] = pa.RecordBatch.from_arrays(
            cols, names=batch.schema.names
        ).to_pylist()
    except (ValueError, pa.ArrowException) as e:
        column = next((n for n, c in zip(batch.schema.names, cols, strict=False) if _fails(c)), "")
        rows_ = f"rows {before + 1} to {before + batch.num_rows + len(bad)}"
        if not column:
            raise BuildError(f"{path}: {rows_}: {e}") from None
        if isinstance(e, UnicodeDecodeError):
            raise BuildError(
                f"{path}: column {column!r}, {rows_}: a string inside a struct or list is "
                f"not UTF-8 ({e}): do not keep the column, or mend the file"
            ) from None
        raise BuildError(
            f"{path}: column {column!r}, {rows_}: a value Python cannot hold (nanosecond "
            "times inside a struct or list are not read): cast them to microseconds, or do "
            "not keep the column"
        ) from None
    if not bad:
        return list(rows)
    out: list[dict[str, Any] | str] = []
    kept = iter(rows)
    for i in range(batch.num_rows + len(bad)):
        out.append(bad[i] if i in bad else next(kept))
    return out


def _not_utf8(batch: Any) -> dict[int, str]:
    """The rows of a record batch whose string column holds bytes that are not
    UTF-8, each with what is wrong (a full check of each string column: the
    conversion to Python raises for a batch, naming no row)."""
    import pyarrow as pa

    bad: dict[int, str] = {}
    for name, col in zip(batch.schema.names, batch.columns, strict=True):
        if pa.types.is_dictionary(col.type):  # (pandas categoricals): check the words once
            wrong = _wrong_strings(col.dictionary, name)
            for i, w in enumerate(col.indices.to_pylist() if wrong else ()):
                if w in wrong and i not in bad:
                    bad[i] = wrong[w]
        else:
            for i, why in _wrong_strings(col, name).items():
                bad.setdefault(i, why)
    return bad


def _wrong_strings(col: Any, name: str) -> dict[int, str]:
    """The positions of an Arrow string array's values that are not UTF-8, each with
    what is wrong (none for an array of another type)."""
    import pyarrow as pa

    binary = _BINARY_OF.get(str(col.type))
    if binary is None:
        return {}
    try:
        col.validate(full=True)
        return {}
    except pa.ArrowInvalid:
        pass
    wrong: dict[int, str] = {}
    for i, v in enumerate(col.view(binary).to_pylist()):
        if v is None:
            continue
        try:
            v.decode("utf-8")
        except UnicodeDecodeError as e:
            wrong[i] = (
                f"column {name!r} is not UTF-8 at byte {e.start:,} of its string "
                f"({v[e.start]:#04x}: {e.reason})"
            )
    return wrong


_BINARY_OF = {"string": "binary", "large_string": "large_binary", "string_view": "binary_view"}
"""The binary type of each Arrow string type (the same bytes, not checked)."""


def _fails(col: Any) -> bool:
    """Whether a column's values cannot be made Python values (for the error)."""
    try:
        col.to_pylist()
    except Exception:
        return True
    return False


def _check_column(path: Path, schema: Any, field: str) -> None:
    """A Parquet file must have the text column: name the columns it has, and the likely one."""
    names = list(schema.names)
    if field in names:
        return
    strings = [f.name for f in schema if str(f.type) in ("string", "large_string")]
    usual = [n for n in ("text", "content", "body", "raw_content", "document") if n in strings]
    pick = (usual or strings or [None])[0]
    hint = f"; use --text-field {pick}" if pick else ""
    raise BuildError(
        f"{path}: no column {field!r}; its columns are {', '.join(names) or '(none)'}{hint}"
    )


def read_errors() -> tuple[type[BaseException], ...]:
    """What reading a damaged input raises (beyond ``OSError``)."""
    errors: list[type[BaseException]] = [
        OSError,
        UnicodeDecodeError,
        EOFError,
        lzma.LZMAError,
        zlib.error,
    ]
    with contextlib.suppress(ImportError):
        import zstandard

        errors.append(zstandard.ZstdError)
    with contextlib.suppress(ImportError):
        import pyarrow as pa

        errors.append(pa.ArrowException)
    return tuple(errors)
