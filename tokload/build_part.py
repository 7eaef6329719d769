"""One chunk of a build into its own dataset, ``OUT/parts/iiiii-ccccc``.

The one job of this module: tokenize a chunk's records (``tokload.build_records``)
and write them, via a temporary directory renamed when complete, with what the
chunk was built from in its manifest (``tokload.build_output`` decides whether
it is current). Each batch of texts goes to the tokenizer at once (Rust, GIL
free); token ids and character offsets cross as one flat array per batch, and
BOS/EOS insertion and annotation mapping are NumPy operations over the batch.

Per-document metadata (fields kept from each record) and character-span
annotations become metadata records (FORMAT.md, stream with metadata): each
maximal run of tokens covered by the same annotations gets one record, the
JSON ``{"document": {kept fields}, "annotations": [annotation without start
and end, ...]}`` (empty parts omitted, keys sorted).
"""

from __future__ import annotations

import base64
import contextlib
import datetime
import decimal
import itertools
import json
import math
import os
import secrets
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from tokload.build_output import MARKER_TEXT, PARTS, remove_temporaries
from tokload.build_plan import BuildOptions, Chunk
from tokload.build_records import (
    ANNOTATION_NO_SPAN,
    ANNOTATION_OUTSIDE,
    ANNOTATIONS_NOT_LIST,
    FIRST,
    LAST,
    NO_TEXT,
    NOT_JSON,
    TEXT_NOT_STRING,
    UNREADABLE,
    WHOLE,
    ChunkInput,
    Record,
    lines_before,
    read_errors,
    records,
)
from tokload.errors import BuildError
from tokload.files import file_version
from tokload.inputs import BUILD_MARKER
from tokload.tokenizer import (
    EncodedBatch,
    Tokenizer,
    load_tokenizer,
    token_dtype,
    with_special_tokens,
)
from tokload.writer import Writer

_BATCH_DOCS = 256
_BATCH_CHARS = 4 << 20
_REPORT_BYTES = 4 << 20
_BATCH_PIECES_CHARS = 1 << 20
"""Characters of plain-text pieces tokenized in one batch: each tokenizer thread gets a
piece or two, so the batch (which Ctrl+C waits for) takes a fraction of a second."""


_TOKENIZERS: dict[tuple[str, tuple[int, ...] | None], Tokenizer] = {}
"""Tokenizers loaded in this process (a worker builds many chunks), by name and, for
a file, its version: a build into the same output with another ``tokenizer.json``
(the output's copy has the same path) loads the new one."""


def _tokenizer(name: str) -> Tokenizer:
    key: tuple[str, tuple[int, ...] | None]
    try:
        key = (name, file_version(os.stat(name)))
    except OSError:  # "bytes", a model name
        key = (name, None)
    tok = _TOKENIZERS.get(key)
    if tok is None:
        if len(_TOKENIZERS) >= 8:  # a long-lived worker: not every version kept
            _TOKENIZERS.clear()
        tok = _TOKENIZERS[key] = load_tokenizer(name)
    return tok


def build_chunk(
    chunk: Chunk,
    opts: BuildOptions,
    out_s: str,
    base: dict[str, Any],
    report: Callable[[int, int, int], None] | None = None,
) -> tuple[int, int, int]:
    """Build ``chunk`` into OUT/parts/iiiii-ccccc (via a temporary directory).

    Calls ``report(bytes, documents, tokens)`` with the input bytes read and
    the documents and tokens written since its last call, every few MB;
    returns the rest of the chunk's size and the documents and tokens not
    reported yet, so the reports and the return value add up to the chunk's.
    """
    path, out = Path(chunk.path), Path(out_s)
    tok = with_special_tokens(_tokenizer(opts.tokenizer), opts.bos_token, opts.eos_token)
    tdt = token_dtype(tok.vocab_size)
    # With metadata, the Writer attaches it as a span table (FORMAT.md, version 2).
    dtype: Any = [("token", tdt.str)] if opts.metadata else tdt
    final = out / PARTS / chunk.name
    remove_temporaries(out / PARTS, [chunk.name])  # left by a task that died (a Ray retry)
    # A name of its own: a directory in the way, whoever made it, is never touched.
    tmp = out / PARTS / f"{chunk.name}.{secrets.token_hex(4)}.tmp"
    skipped: Counter[str] = Counter()
    docs = tokens = reported = reported_docs = reported_tokens = 0
    open_tokens = 0  # tokens of the pieces of a document not ended yet
    first_line = 0

    def where(line: int) -> str:
        nonlocal first_line
        if chunk.unit != "bytes":
            return f"{path}:{line}"
        if chunk.start and not first_line:
            first_line = lines_before(path, chunk.start)
        return f"{path}:{first_line + line}"

    def fail(line: int | None, reason: str, message: str) -> None:
        if opts.on_error == "stop":
            at = str(path) if line is None else where(line)
            raise BuildError(
                f"{at}: {message} (--on-error skip, on_error='skip' in Python, skips such records)"
            )
        skipped[reason] += 1

    try:
        inp = ChunkInput(chunk)
    except OSError as e:
        raise BuildError(f"{path}: cannot open the input: {e.strerror or e}") from None
    try:
        tmp.mkdir()
        (tmp / BUILD_MARKER).write_text(MARKER_TEXT)  # first: whatever follows is the build's
    except BaseException:
        inp.close()
        raise
    with (
        contextlib.closing(inp),
        Writer(
            tmp,
            dtype,
            metadata=opts.metadata,
            shard_bytes=opts.shard_bytes,
            name_prefix=f"in{chunk.name}",
            user={"input": str(path), "chunk": chunk.index},
        ) as w,
    ):
        pending: list[tuple[int, str, dict[str, Any]]] = []
        places: list[int] = []  # each pending text's FIRST/LAST flags
        contexts: list[str] = []  # and what it is tokenized after (a plain text's pieces)
        pending_chars = 0

        def flush() -> None:
            nonlocal docs, tokens, pending_chars, reported, reported_docs, reported_tokens
            nonlocal open_tokens
            if not pending:
                return
            texts = [t for _, t, _ in pending]
            if any(contexts):  # pieces of a plain text (which has no annotations)
                batch = _encode_pieces(tok, texts, contexts)
            else:
                batch = _encode(tok, texts, pending, opts.annotations_field)
            ids, bounds = _with_bos_eos(batch, opts, tok, tdt, np.array(places, np.int8))
            offsets = batch.offsets
            for d, (line, text, rec) in enumerate(pending):
                doc = ids[bounds[d] : bounds[d + 1]]
                spans = None
                if opts.metadata:
                    span_offsets = (
                        None if offsets is None else offsets[batch.bounds[d] : batch.bounds[d + 1]]
                    )
                    spans, err = _spans(len(doc), span_offsets, text, rec, opts)
                    if err is not None:
                        fail(line, *err)
                        continue
                end = bool(places[d] & LAST)
                w.write({"token": doc} if opts.metadata else doc, spans=spans, end=end)
                tokens += len(doc)
                open_tokens = 0 if end else open_tokens + len(doc)
                docs += end
            pending.clear()
            places.clear()
            contexts.clear()
            pending_chars = 0
            if report is not None and inp.consumed() - reported >= _REPORT_BYTES:
                n = min(inp.consumed(), chunk.size) - reported
                report(n, docs - reported_docs, tokens - reported_tokens)
                reported += n
                reported_docs, reported_tokens = docs, tokens

        damage: list[BaseException] = []

        def up_to_damage() -> Iterator[Record]:
            """The records, ending at a damaged part of the input (kept in ``damage``):
            only reading is guarded, a failure to tokenize or write is raised."""
            try:
                yield from records(inp, opts.text_field, opts.fields_read())
            except read_errors() as e:
                if isinstance(e, BuildError):
                    raise
                damage.append(e)

        for line, rec, err, place, context in up_to_damage():
            if err is not None:
                fail(line, *err)
                continue
            assert rec is not None
            text = rec.get(opts.text_field)
            if not isinstance(text, str):
                if opts.text_field not in rec:
                    fields = ", ".join(map(str, list(rec)[:8])) or "none"
                    fail(
                        line,
                        NO_TEXT,
                        f"no text field {opts.text_field!r} (the record's fields: {fields}; "
                        "--text-field names another)",
                    )
                else:
                    fail(
                        line,
                        TEXT_NOT_STRING,
                        f"field {opts.text_field!r} is "
                        + ("null" if text is None else f"a {type(text).__name__}")
                        + ", not a string",
                    )
                continue
            pending.append((line, text, rec))
            places.append(place)
            contexts.append(context)
            pending_chars += len(text)
            limit = _BATCH_CHARS if place == WHOLE else _BATCH_PIECES_CHARS
            if len(pending) >= _BATCH_DOCS or pending_chars >= limit:
                flush()
        flush()  # the records read before any damage are built
        if damage:
            w.discard()  # the pieces of a plain-text document cut short
            tokens -= open_tokens
            fail(None, UNREADABLE, f"unreadable: {damage[0]}")
        w.manifest.user["stats"] = {
            "documents": docs,
            "tokens": tokens,
            "skipped": dict(sorted(skipped.items())),
        }
        w.manifest.user["build"] = {
            **base,
            "input": inp.record(),
            "chunk": {**chunk.record(), "sha256": inp.hash.hexdigest()},
        }
    os.replace(tmp, final)  # the chunk is complete: publish it
    return chunk.size - reported, docs - reported_docs, tokens - reported_tokens


def _encode(
    tok: Tokenizer,
    texts: list[str],
    pending: list[tuple[int, str, dict[str, Any]]],
    annotations_field: str | None,
) -> EncodedBatch:
    """Encode a batch, asking for character offsets (which cost the tokenizer time and
    cross into Python as a tuple per token) only for the texts that have annotations;
    the others get zero offsets, which nothing reads."""
    need = [bool(rec.get(annotations_field)) for _, _, rec in pending] if annotations_field else []
    if not any(need) or all(need):
        return tok.encode_many(texts, offsets=any(need))
    picks = [[d for d, x in enumerate(need) if x is want] for want in (True, False)]
    parts = [
        tok.encode_many([texts[d] for d in pick], offsets=o)
        for pick, o in zip(picks, (True, False), strict=True)
    ]
    lengths = np.zeros(len(texts), dtype=np.int64)
    for pick, part in zip(picks, parts, strict=True):
        lengths[pick] = np.diff(part.bounds)
    bounds = np.zeros(len(texts) + 1, dtype=np.int64)
    np.cumsum(lengths, out=bounds[1:])
    ids = np.empty(int(bounds[-1]), dtype=np.int64)
    offsets = np.zeros((len(ids), 2), dtype=np.int64)
    for pick, part in zip(picks, parts, strict=True):
        for k, d in enumerate(pick):
            a, b = part.bounds[k], part.bounds[k + 1]
            ids[bounds[d] : bounds[d + 1]] = part.ids[a:b]
            if part.offsets is not None:
                offsets[bounds[d] : bounds[d + 1]] = part.offsets[a:b]
    return EncodedBatch(ids, bounds, offsets)


def _encode_pieces(tok: Tokenizer, texts: list[str], contexts: list[str]) -> EncodedBatch:
    """Pieces of plain texts, each tokenized after ``contexts[i]``, the end of the
    piece before it ("" for a document's first), as it stands in the whole text.

    A tokenizer that treats the start of its input apart (SentencePiece's
    Metaspace with ``prepend_scheme="first"``, a ``Prepend("▁")`` normalizer:
    Llama 2, Mistral) would start each piece as a new text, with a "▁" of its
    own. The piece's tokens are those of ``context + piece`` after the
    context's own; where the context's tokens are not where they begin (the
    cut is inside a token for this tokenizer), the piece's own tokens.
    """
    n = len(texts)
    after = [k for k in range(n) if contexts[k]]
    joined = [contexts[k] + t for k, t in enumerate(texts)]
    got = tok.encode_many(joined + [contexts[k] for k in after], offsets=False)
    ids, b = got.ids, got.bounds
    parts = [ids[b[k] : b[k + 1]] for k in range(n)]
    alone = []
    for j, k in enumerate(after):
        context = ids[b[n + j] : b[n + j + 1]]
        if np.array_equal(parts[k][: len(context)], context):
            parts[k] = parts[k][len(context) :]
        else:
            alone.append(k)
    if alone:
        own = tok.encode_many([texts[k] for k in alone], offsets=False)
        for j, k in enumerate(alone):
            parts[k] = own.ids[own.bounds[j] : own.bounds[j + 1]]
    bounds = np.zeros(n + 1, dtype=np.int64)
    np.cumsum([len(p) for p in parts], out=bounds[1:])
    return EncodedBatch(np.concatenate(parts) if parts else ids[:0], bounds, None)


def _with_bos_eos(
    batch: EncodedBatch,
    opts: BuildOptions,
    tok: Tokenizer,
    dtype: np.dtype[Any],
    places: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """The batch's ids with BOS/EOS around each text, as ``dtype``, and the new bounds.

    ``places`` (``FIRST``/``LAST`` flags per text, ``WHOLE`` for a whole document):
    BOS goes only before a document's first piece, EOS only after its last.
    """
    lengths = np.diff(batch.bounds)
    has_bos = (places & FIRST).astype(bool) & opts.bos
    has_eos = (places & LAST).astype(bool) & opts.eos
    bounds = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths + has_bos + has_eos, out=bounds[1:])
    if not (has_bos.any() or has_eos.any()):
        return batch.ids.astype(dtype), bounds
    out = np.empty(int(bounds[-1]), dtype=dtype)
    body = np.ones(len(out), dtype=bool)
    if has_bos.any():
        at = bounds[:-1][has_bos]
        out[at] = tok.bos_id
        body[at] = False
    if has_eos.any():
        at = bounds[1:][has_eos] - 1
        out[at] = tok.eos_id
        body[at] = False
    out[body] = batch.ids  # ids < vocab_size: the cast cannot overflow
    return out, bounds


def _spans(
    n_tokens: int,
    offsets: np.ndarray | None,
    text: str,
    rec: dict[str, Any],
    opts: BuildOptions,
) -> tuple[list[tuple[int, int, bytes]] | None, tuple[str, str] | None]:
    """The metadata spans of one document (``n_tokens`` with BOS/EOS), or (reason, message).

    ``offsets`` are the character spans of the text's own tokens (without
    BOS/EOS); an annotation ``[s, e)`` covers the tokens that end after ``s``
    and start before ``e``, found for all annotations of the document in
    two ``searchsorted`` calls.
    """
    n_text = len(text)
    anns: list[tuple[int, int, dict[str, Any]]] = []
    raw = rec.get(opts.annotations_field) if opts.annotations_field else None
    if raw is not None and not isinstance(raw, list):
        return None, (
            ANNOTATIONS_NOT_LIST,
            f"field {opts.annotations_field!r} is not a list of annotations",
        )
    if raw:
        for a in raw:
            if not isinstance(a, dict) or not _an_int(a.get("start")) or not _an_int(a.get("end")):
                return None, (
                    ANNOTATION_NO_SPAN,
                    f"an annotation without integer start/end: {a!r}",
                )
            s, e = a["start"], a["end"]
            # (an empty one, [s, s) within the text: an empty response, annotates no token)
            if not 0 <= s <= e <= n_text:
                what = "ends before it starts" if e < s else "is outside the text"
                return None, (
                    ANNOTATION_OUTSIDE,
                    f"annotation [{s}, {e}) {what} ({n_text} characters)",
                )
        assert offsets is not None
        starts = np.fromiter((a["start"] for a in raw), np.int64, len(raw))
        ends = np.fromiter((a["end"] for a in raw), np.int64, len(raw))
        shift = int(opts.bos)  # a BOS token spans [0, 0): it precedes every annotation
        los = np.searchsorted(offsets[:, 1], starts, side="right") + shift
        his = np.searchsorted(offsets[:, 0], ends, side="left") + shift
        for a, lo, hi, wide in zip(raw, los.tolist(), his.tolist(), ends > starts, strict=True):
            if lo < hi and wide:  # (an empty span within a token overlaps no character of it)
                anns.append((lo, hi, {k: v for k, v in a.items() if k not in ("start", "end")}))
    doc_meta = {f: rec.get(f) for f in opts.keep_fields}
    bounds = sorted({0, n_tokens, *(b for lo, hi, _ in anns for b in (lo, hi))})
    spans = []
    for a, b in itertools.pairwise(bounds):
        covering = [payload for lo, hi, payload in anns if lo <= a and hi >= b]
        record: dict[str, Any] = {}
        if opts.keep_fields:
            record["document"] = doc_meta
        if covering:
            record["annotations"] = covering
        if record and b > a:
            try:
                payload = _json_text(record)
            except (TypeError, ValueError) as e:
                return None, (NOT_JSON, f"a kept field or annotation has {e}")
            spans.append((a, b, payload.encode()))
    return spans, None


def _an_int(v: Any) -> bool:
    """Whether ``v`` is an integer of JSON (not ``true``/``false``, which Python's
    ``int`` takes in)."""
    return isinstance(v, int) and not isinstance(v, bool)


def _json_text(record: dict[str, Any]) -> str:
    """``record`` as compact JSON text (keys sorted). NaN and the infinities (a
    Parquet float column's missing values), which JSON lacks, are written as
    null, as orjson and pandas write them: ``json.dumps`` would write ``NaN``,
    which strict parsers refuse."""
    try:
        return json.dumps(
            record, sort_keys=True, separators=(",", ":"), default=_json_value, allow_nan=False
        )
    except ValueError:  # (a float out of JSON's range; anything else fails again below)
        return json.dumps(
            _finite(record),
            sort_keys=True,
            separators=(",", ":"),
            default=_json_value,
            allow_nan=False,
        )


def _finite(v: Any) -> Any:
    """``v`` with every float that is NaN or infinite, at any depth, made None."""
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if isinstance(v, dict):
        return {k: _finite(x) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return [_finite(x) for x in v]
    return v


def _json_value(v: Any) -> Any:
    """A JSON form of the values Parquet columns hold that JSON lacks: dates and times
    as ISO 8601 text, decimals as their text, bytes as base64; TypeError otherwise."""
    if isinstance(v, datetime.date | datetime.time):  # datetime is a date
        return v.isoformat()
    if isinstance(v, datetime.timedelta):
        return v.total_seconds()
    if isinstance(v, decimal.Decimal):
        return str(v)
    if isinstance(v, bytes | bytearray | memoryview):
        return base64.b64encode(bytes(v)).decode("ascii")
    raise TypeError(f"a {type(v).__name__} value ({v!r:.40}), which has no JSON form")
