"""From raw text to a dataset: ``tokload build`` as a function.

Inputs (JSONL, optionally gzip/bz2/xz/zstd-compressed; Parquet; or any other
file as one plain-text document) are expanded, sorted, and split into
**chunks** that can be built independently: an uncompressed JSONL file into
byte ranges of about ``chunk_bytes`` whose starts are moved forward to the
next line start, a Parquet file into runs of whole row groups of about
``chunk_bytes``, and a compressed file (which cannot be entered in the
middle) or a plain-text document into one chunk. Where the chunks fall
depends only on the input's bytes and ``chunk_bytes``. Chunk ``c`` of input
``i`` is built, by whichever worker process, ``--part`` job or Ray task
takes it, into its own dataset ``OUT/parts/iiiii-ccccc`` (shards named
``in{i:05d}-{c:05d}-*``), written in a temporary directory and renamed when
complete. So the same inputs always give the same files, whatever the number
of workers or machines.

Build integrity: each chunk's manifest records, under ``user["build"]``, what
it was built from: the input's identity (absolute path, size, modification
time), the chunk's range and the SHA-256 of the input bytes it covers
(computed while reading), the tokenizer's SHA-256 and every option that
changes the output. A re-run reuses a chunk only when that record equals what
this run would build, rebuilds the others, and removes chunks that are no
longer in the plan. The top-level manifest is removed before any chunk
changes and written last, so it never lists a chunk that is missing or stale.
A ``tokenizer.json`` is copied into the dataset (``OUT/tokenizer.json``), so
the dataset can be decoded wherever it travels.

Per-document metadata (fields kept from each record) and character-span
annotations become metadata records (FORMAT.md, stream with metadata): each
maximal run of tokens covered by the same annotations gets one record, the
JSON ``{"document": {kept fields}, "annotations": [annotation without start
and end, ...]}`` (empty parts omitted, keys sorted).

Speed: each worker hands the tokenizer batches of texts (Rust, GIL free;
with several workers each tokenizer gets ``cores // workers`` threads, so
they do not oversubscribe the machine), JSON is parsed with ``orjson`` where
installed, token ids and character offsets cross from the tokenizer as one
flat array per batch, and BOS/EOS insertion and annotation mapping are NumPy
operations over the batch.
"""

from __future__ import annotations

import bz2
import codecs
import contextlib
import dataclasses
import gzip
import hashlib
import io
import itertools
import json
import lzma
import multiprocessing as mp
import os
import secrets
import shutil
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import numpy as np

from tokload.errors import TokloadError
from tokload.format import (
    FORMAT_VERSION,
    MANIFEST,
    Manifest,
    open_dataset,
    read_manifest,
    write_manifest,
)
from tokload.inputs import BUILD_MARKER, Found, compressed, find_inputs
from tokload.inputs import kind as input_kind
from tokload.progress import DEFAULT_EVERY as DEFAULT_PROGRESS_EVERY
from tokload.progress import Progress
from tokload.tokenizer import (
    TOKENIZER_FILE,
    EncodedBatch,
    Tokenizer,
    copy_tokenizer,
    dataset_copy_is_current,
    dataset_record,
    describe_tokenizer,
    load_tokenizer,
    token_dtype,
)
from tokload.writer import Writer


def _json_loads() -> Callable[[bytes], Any]:
    """orjson's ``loads`` where installed (about 4x faster than json's), else json's."""
    try:
        import orjson
    except ImportError:  # pragma: no cover - depends on the environment
        return json.loads
    return orjson.loads


_fast_loads = _json_loads()

PARTS = "parts"
BUILDER_VERSION = 4  # 4: metadata in blocks (format version 3)
"""Bumped whenever the builder would write different bytes for the same input and options."""

DEFAULT_CHUNK_BYTES = 32 << 20
DEFAULT_MAX_SKIPPED = 0.1
_BATCH_DOCS = 256
_BATCH_CHARS = 4 << 20
_READ_CHUNK = 1 << 20
_REPORT_BYTES = 4 << 20
_COMPRESSED: dict[str, Callable[..., Any]] = {
    ".gz": gzip.open,
    ".bz2": bz2.open,
    ".xz": lzma.open,
}


class BuildError(TokloadError, ValueError):
    """Bad input during a build; the message names the file and line."""


class UsageError(ValueError):
    """The arguments of a build are wrong (``tokload build`` exits with 2)."""


@dataclass(frozen=True)
class BuildOptions:
    """What to extract from the inputs and how to tokenize it (see ``build``)."""

    text_field: str = "text"
    keep_fields: tuple[str, ...] = ()
    annotations_field: str | None = None
    tokenizer: str = "bytes"
    bos: bool = False
    eos: bool = True
    on_error: str = "stop"
    shard_bytes: int = 1 << 30
    chunk_bytes: int = DEFAULT_CHUNK_BYTES

    @property
    def metadata(self) -> bool:
        return bool(self.keep_fields) or self.annotations_field is not None

    def record(self) -> dict[str, Any]:
        """The options that change the output (the tokenizer is recorded by its hash)."""
        return {
            "text_field": self.text_field,
            "keep_fields": list(self.keep_fields),
            "annotations_field": self.annotations_field,
            "bos": self.bos,
            "eos": self.eos,
            "on_error": self.on_error,
            "shard_bytes": self.shard_bytes,
            "chunk_bytes": self.chunk_bytes,
        }


@dataclass(frozen=True)
class Chunk:
    """One independently built piece of one input.

    ``unit`` says what ``[start, end)`` counts: ``"bytes"`` (a JSONL byte
    range, both ends at line starts), ``"row_groups"`` (Parquet) or
    ``"file"`` (the whole file: compressed JSONL, a plain-text document).
    ``size`` is the number of input bytes it covers (for progress).
    """

    input: int
    path: str
    index: int
    count: int
    unit: str
    start: int
    end: int
    size: int
    identity: tuple[int, int]  # the input's (size, mtime_ns) when planned

    @property
    def name(self) -> str:
        return f"{self.input:05d}-{self.index:05d}"

    def record(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "count": self.count,
            "unit": self.unit,
            "start": self.start,
            "end": self.end,
        }


@dataclass
class BuildSummary:
    """What a build (or a part of one) produced."""

    inputs: int = 0
    chunks: int = 0
    built: int = 0  # chunks built by this call (the others were reused, unchanged)
    removed: int = 0  # chunk directories no longer in the plan, removed
    documents: int = 0
    tokens: int = 0
    shards: int = 0
    bytes: int = 0
    seconds: float = 0.0
    skipped: dict[str, int] = field(default_factory=dict)
    published: Any = None  # a tokload.publish.Published, for a URL output

    def __str__(self) -> str:
        skipped = sum(self.skipped.values())
        reasons = ", ".join(f"{k}: {v}" for k, v in sorted(self.skipped.items()))
        extra = f", skipped {skipped} ({reasons})" if skipped else ""
        p = self.published
        if p is not None:
            extra += (
                f"; uploaded {p.uploaded} objects ({p.bytes / 1e6:.1f} MB), "
                f"{p.skipped} chunks already in the store"
            )
        removed = f", {self.removed} stale chunks removed" if self.removed else ""
        return (
            f"{self.documents:,} documents, {self.tokens:,} tokens in {self.shards} shards "
            f"({self.bytes / 1e6:.1f} MB) from {self.inputs} inputs in {self.chunks} chunks "
            f"({self.built} built now{removed}) in {self.seconds:.1f} s{extra}"
        )


def parse_part(part: str | tuple[int, int] | None) -> tuple[int, int]:
    """``"k/N"`` (or ``(k, N)``) as a checked pair; ``None`` is ``(0, 1)``."""
    if part is None:
        return 0, 1
    if isinstance(part, str):
        try:
            k_s, n_s = part.split("/")
            k, n = int(k_s), int(n_s)
        except ValueError:
            raise UsageError(f"part must look like 'k/N' (e.g. 3/16), got {part!r}") from None
    else:
        k, n = part
    if n < 1 or not 0 <= k < n:
        raise UsageError(f"part {k}/{n}: need 0 <= k < N (parts are numbered from 0)")
    return k, n


def build(
    inputs: Sequence[str | os.PathLike[str]],
    output: str | os.PathLike[str],
    *,
    text_field: str = "text",
    keep_fields: Sequence[str] = (),
    annotations_field: str | None = None,
    tokenizer: str | os.PathLike[str] = "bytes",
    bos: bool = False,
    eos: bool = True,
    workers: int = 1,
    part: str | tuple[int, int] | None = None,
    on_error: str = "stop",
    max_skipped: float = DEFAULT_MAX_SKIPPED,
    shard_bytes: int = 1 << 30,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    include: Sequence[str] = (),
    exclude: Sequence[str] = (),
    force: bool = False,
    ray: bool | str | None = None,
    progress: bool | None = None,
    progress_every: float = DEFAULT_PROGRESS_EVERY,
    log: Callable[[str], None] | None = None,
    staging: str | os.PathLike[str] | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> BuildSummary:
    """Tokenize a corpus into a tokload dataset at ``output``.

    ``output`` may be an object-store URL (``s3://bucket/prefix``): the build
    runs in the local directory ``staging`` (default
    ``~/.cache/tokload/build/<hash of the URL>``; it needs the dataset's size
    and may be removed afterwards); ``tokload.publish`` uploads each chunk
    as soon as it is complete (its shards before its manifest) while the
    others are built, and the top-level manifest last, so a reader never sees
    half a dataset. A re-run rebuilds nothing that is
    current and uploads only the chunks the store lacks.

    Args:
        inputs: files, globs or directories (see ``tokload.inputs``): a file
            named is always read; a directory gives its data files only
            (``*.jsonl``, also ``.gz``, ``.bz2``, ``.xz``, ``.zst``;
            ``*.parquet``; ``*.txt``), never hidden files, the usual metadata
            files, a tokload dataset, or anything inside ``output``. A file
            that is not JSONL or Parquet is one plain-text document (its path
            is available as the field ``path``), read in pieces, so its size
            is not bounded by memory.
        text_field: the field holding the text.
        keep_fields: per-document fields kept as metadata (e.g. ``["id",
            "source"]``).
        annotations_field: a field holding a list of character-span annotations
            ``{"start": s, "end": e, ...}``; the other keys are kept.
        tokenizer: ``"bytes"`` (built in), the path of a ``tokenizer.json``
            or of a directory holding one, or a Hugging Face name (``"gpt2"``,
            ``"org/model"``: looked up in the local Hugging Face cache, then
            downloaded where a network is there). A ``tokenizer.json`` is
            copied to ``output/tokenizer.json``.
        bos: add the tokenizer's BOS token before each document.
        eos: add the tokenizer's EOS token after each document.
        workers: processes building chunks in parallel (ignored with ``ray``).
        part: ``"k/N"``: build only the k-th of N contiguous slices of the
            chunks of all inputs (``tokload merge`` joins the parts).
        on_error: ``"stop"`` raises ``BuildError`` at the first bad
            record; ``"skip"`` skips it and counts it, per reason, in the summary.
        max_skipped: the largest fraction of records ``on_error="skip"`` may
            skip; past it (or when no document is left at all) the build
            fails with a ``BuildError`` saying why, and writes no top-level
            manifest. Default 0.1.
        shard_bytes: shard size limit.
        chunk_bytes: the size of the chunks uncompressed JSONL and Parquet
            inputs are split into (compressed inputs are one chunk each).
        include: globs: a directory walk takes the files matching one of them
            instead of the data extensions (``["*.py"]``).
        exclude: globs: files of a directory walk or a glob that match one are
            not inputs.
        force: build into a non-empty directory that holds no tokload build
            (its files are left as they are), or replace a dataset built
            there from other inputs.
        ray: run the chunks as Ray tasks: ``True`` for ``ray.init()`` (an
            existing instance, ``RAY_ADDRESS``, or a new local one), or a
            cluster address. Inputs and ``output`` must be on a filesystem
            every node sees.
        progress: report progress: a bar when stderr is a terminal, else a
            line to ``log`` every ``progress_every`` seconds (documents,
            tokens, bytes, rate, ETA). Default: on; ``False``: off.
        progress_every: seconds between progress lines (not on a terminal).
        log: where the build's report lines go (what inputs it found, which
            tokenizer, progress without a terminal); ``None``: nowhere. The
            command line prints them on stderr.
        staging: with a URL ``output``, the local build directory.
        storage_options: with a URL ``output``, the object store's options
            (see ``tokload.remote``; the environment's by default).

    The output files depend only on the inputs and the options, never on
    ``workers``, ``part`` or ``ray``. Re-running on the same ``output``
    rebuilds exactly the chunks whose input (path, size, modification time),
    tokenizer or options differ from what they record, and removes chunks
    no longer in the plan. It only ever removes what a build wrote (chunk
    directories it marked or that record their build), never files it did
    not write. On any exception, ``KeyboardInterrupt``
    included, the workers are stopped and the unfinished chunks' temporary
    directories removed; the top-level manifest is then absent (it is written
    last), and the same call resumes from the finished chunks.

    Raises:
        UsageError: an argument is wrong (``workers < 1``, a bad ``part``, an
            output that is a file, a tokenizer without the BOS/EOS asked for),
            or the output holds what the build must not touch (see ``force``).
        InputError: an input lies inside the output.
        BuildError: a bad record (``on_error="stop"``) or input file, no
            documents, or more than ``max_skipped`` skipped.
        FormatError: the tokenizer file is not a ``tokenizer.json``.
        FileNotFoundError: an input or the tokenizer is missing.
    """
    t0 = time.perf_counter()
    if on_error not in ("stop", "skip"):
        raise UsageError(f"on_error must be 'stop' or 'skip', got {on_error!r}")
    if workers < 1:
        raise UsageError(f"workers must be at least 1, got {workers}")
    if shard_bytes < 1:
        raise UsageError(f"shard_bytes must be positive, got {shard_bytes}")
    if chunk_bytes < 1:
        raise UsageError(f"chunk_bytes must be positive, got {chunk_bytes}")
    if not 0 <= max_skipped <= 1:
        raise UsageError(f"max_skipped must be a fraction from 0 to 1, got {max_skipped}")
    k, n = parse_part(part)
    say = log if log is not None else _quiet
    from tokload import remote

    url = os.fspath(output) if remote.is_url(output) else None
    if url is not None:
        if ray is not None and ray is not False:
            raise UsageError(f"{url}: --ray builds need an output every node sees, not a URL")
        if staging is None:
            digest = hashlib.sha256(url.rstrip("/").encode()).hexdigest()[:16]
            staging = Path.home() / ".cache" / "tokload" / "build" / digest
        output = staging
    out = Path(remote.local_path(output))
    if out.exists() and not out.is_dir():
        raise UsageError(f"{out}: the output must be a directory (or not exist yet); it is a file")
    tok = load_tokenizer(tokenizer)  # fail early on a bad tokenizer
    for flag, token_id, name in ((bos, tok.bos_id, "BOS"), (eos, tok.eos_id, "EOS")):
        if flag and token_id is None:
            hint = "--no-eos" if name == "EOS" else "no --bos"
            raise UsageError(
                f"the tokenizer {tok.name} has no {name} token that tokload recognizes; "
                f"build with {hint}, or use a tokenizer that has one"
            )
    say(describe_tokenizer(tok))
    found = find_inputs(inputs, output=out, include=include, exclude=exclude)
    files = found.files
    say(found.describe())
    if not files:
        raise UsageError(f"no input files ({_nothing_found(found)})")
    _check_output(out, files, force)
    plan = plan_chunks(files, chunk_bytes)
    lo, hi = k * len(plan) // n, (k + 1) * len(plan) // n
    mine = plan[lo:hi]
    (out / PARTS).mkdir(parents=True, exist_ok=True)
    (out / BUILD_MARKER).write_text(_MARKER_TEXT)
    tok_record = dataset_record(tok)
    opts = BuildOptions(
        text_field,
        tuple(keep_fields),
        annotations_field,
        str(out / TOKENIZER_FILE) if tok_record["kind"] != "bytes" else "bytes",
        bos,
        eos,
        on_error,
        shard_bytes,
        chunk_bytes,
    )
    base = {
        "builder": BUILDER_VERSION,
        "format_version": FORMAT_VERSION,
        "tokenizer": {key: tok_record.get(key) for key in ("kind", "sha256", "bos", "eos")},
        "dtype": token_dtype(tok.vocab_size).str,
        "options": opts.record(),
    }
    todo = [c for c in mine if not _up_to_date(out / PARTS / c.name, base, c)]
    for c in todo:
        d = out / PARTS / c.name
        if d.exists() and not _ours(d):
            raise UsageError(
                f"{d}: a chunk of this build goes here, but the directory was not written by "
                "tokload build; move it away, or build into another directory"
            )
    stale = _stale_parts(out / PARTS, plan, mine)
    if todo or stale or not dataset_copy_is_current(tok, out):
        # From here on the dataset changes: no manifest may list it until the end.
        (out / MANIFEST).unlink(missing_ok=True)
    copy_tokenizer(tok, out)
    for d in stale:
        _remove_dir(d)
    for c in todo:
        for d in _temporaries(out / PARTS, c.name):
            _remove_dir(d)
        _remove_dir(out / PARTS / c.name)
    say(
        f"{len(mine)} chunks: {len(todo)} to build, {len(mine) - len(todo)} reused"
        + (f", {len(stale)} stale removed" if stale else "")
    )
    publisher = None
    if url is not None:  # upload each chunk as it completes, while the others are built
        from tokload.publish import Publisher

        publisher = Publisher(out, url, PARTS, [c.name for c in mine], storage_options).start(
            changing=bool(todo or stale)
        )
    bar = Progress(progress, sum(c.size for c in todo), log, progress_every)
    touched = sorted({c.input for c in mine})
    summary = BuildSummary(inputs=len(touched), chunks=len(mine), built=len(todo))
    summary.removed = len(stale)
    # Biggest first, so that no big chunk starts last and leaves the other workers idle.
    tasks = [(c, opts, str(out), base) for c in sorted(todo, key=lambda c: -c.size)]
    try:
        if ray is not None and ray is not False and todo:
            _run_ray(tasks, None if ray is True else str(ray), bar.update)
        elif workers == 1 or len(todo) <= 1:
            for c, o, out_s, b in tasks:
                bar.update(*_build_chunk(c, o, out_s, b, report=bar.update))
        else:
            _run_pool(tasks, min(workers, len(todo)), bar.update)
    except BaseException:
        _remove_temporaries(out / PARTS, [c.name for c in todo])
        if publisher is not None:
            publisher.finish(ok=False)
        raise
    finally:
        bar.close()
    skipped: Counter[str] = Counter()
    documents = 0
    for c in mine:
        stats = read_manifest(out / PARTS / c.name).user.get("stats", {})
        skipped.update(stats.get("skipped", {}))
        documents += int(stats.get("documents", 0))
    try:
        if mine:
            _check_yield(documents, skipped, max_skipped, text_field)
        manifest = _assemble(out, opts, tok_record, tok.vocab_size, files, mine)
        open_dataset(out).close()  # the manifest agrees with the files (sizes only: cheap)
    except BaseException:
        if publisher is not None:
            publisher.finish(ok=False)
        raise
    summary.documents = manifest.num_documents
    summary.tokens = manifest.rows
    summary.shards = len(manifest.shards)
    summary.bytes = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    summary.skipped = dict(skipped)
    if publisher is not None:
        summary.published = publisher.finish()
    summary.seconds = time.perf_counter() - t0
    return summary


def _quiet(line: str) -> None:
    pass


_MARKER_TEXT = (
    '{"written_by": "tokload build", "note": "this directory holds a tokload build; '
    'a re-run of the build updates it"}\n'
)


def _nothing_found(found: Found) -> str:
    if not found.passed_over:
        return "the directories given are empty"
    return (
        "passed over "
        + "; ".join(f"{n} {reason}" for reason, n in sorted(found.passed_over.items()))
        + "; name files explicitly, or choose them with --include"
    )


def _ours(d: Path) -> bool:
    """Whether the directory ``d`` was written by tokload build: it holds the build's
    marker (every chunk directory gets one first) or a manifest recording a build."""
    if (d / BUILD_MARKER).is_file():
        return True
    try:
        user = read_manifest(d).user
    except (TokloadError, OSError, ValueError):
        return False
    # "build": what a chunk was built from; "input" and "chunk" are there since chunks were
    return isinstance(user.get("build"), dict) or {"input", "chunk"} <= user.keys()


def _check_output(out: Path, files: Sequence[Path], force: bool) -> None:
    """Refuse an output whose files the build would mix with or replace unasked.

    A directory that is empty, or holds a build (its marker, or a manifest
    written by ``tokload build``), is fine; any other non-empty directory
    needs ``force`` (and its files stay untouched). A build from inputs of
    which none is among ``files`` needs ``force`` to be replaced.
    """
    if not out.is_dir():
        return
    entries = sorted(p.name for p in out.iterdir())
    if not entries:
        return
    built = (out / BUILD_MARKER).is_file()
    if not built:
        with contextlib.suppress(TokloadError, OSError, ValueError):
            built = read_manifest(out).user.get("built_by") == "tokload build"
    if not built:
        if force:
            return
        shown = ", ".join(entries[:5]) + (", ..." if len(entries) > 5 else "")
        raise UsageError(
            f"{out}: the output directory is not empty and holds no tokload build "
            f"({shown}); build into a new or empty directory, or pass --force to build "
            "beside these files (none of them is changed or removed)"
        )
    recorded = _recorded_inputs(out)
    if recorded and not force and not recorded & {os.path.abspath(f) for f in files}:
        shown = ", ".join(sorted(recorded)[:3]) + (", ..." if len(recorded) > 3 else "")
        raise UsageError(
            f"{out}: holds a dataset built from other inputs ({shown}), none of which is an "
            "input of this build; build into another directory, or pass --force to replace it"
        )


def _recorded_inputs(out: Path) -> set[str]:
    """The absolute paths of the inputs the chunks under ``out`` record."""
    parts = out / PARTS
    found: set[str] = set()
    if not parts.is_dir():
        return found
    for d in parts.iterdir():
        try:
            rec = read_manifest(d).user.get("build")
        except (TokloadError, OSError, ValueError):
            continue
        if isinstance(rec, dict) and isinstance(rec.get("input"), dict):
            path = rec["input"].get("path")
            if isinstance(path, str):
                found.add(path)
    return found


def _check_yield(
    documents: int, skipped: Counter[str], max_skipped: float, text_field: str
) -> None:
    """Fail a build that made no documents, or skipped more than ``max_skipped`` of them."""
    bad = sum(skipped.values())
    reasons = ", ".join(f"{r}: {n}" for r, n in skipped.most_common())
    if documents == 0:
        why = f"all {bad} records were skipped ({reasons})" if bad else "the inputs are empty"
        hint = (
            f"; is the text in another field than {text_field!r}? (--text-field)"
            if skipped.get(NO_TEXT)
            else ""
        )
        raise BuildError(f"the build produced no documents: {why}{hint}")
    if bad and bad / (documents + bad) > max_skipped:
        raise BuildError(
            f"skipped {bad} of {documents + bad} records ({bad / (documents + bad):.1%}; "
            f"{reasons}), more than the {max_skipped:.0%} allowed; fix the inputs or options, "
            "or allow more with --max-skipped (the chunks built are kept and reused)"
        )


# ---- planning: inputs into chunks -------------------------------------------------------


def plan_chunks(files: Sequence[Path], chunk_bytes: int) -> list[Chunk]:
    """Every input's chunks, in input order; a pure function of the inputs' bytes.

    Reads a few bytes at each nominal boundary of an uncompressed JSONL input
    (to find the next line start) and a Parquet input's footer; nothing else.
    """
    plan: list[Chunk] = []
    for i, path in enumerate(files):
        try:
            st = os.stat(path)
            ident = (st.st_size, st.st_mtime_ns)
            kind = input_kind(path)
            if kind == "jsonl" and not compressed(path):
                bounds = _line_bounds(path, st.st_size, chunk_bytes)
                spans = [("bytes", a, b, b - a) for a, b in itertools.pairwise(bounds)]
            elif kind == "parquet":
                spans = _row_group_spans(path, chunk_bytes)
            else:
                spans = [("file", 0, st.st_size, st.st_size)]
        except OSError as e:
            raise BuildError(f"{path}: cannot read the input: {e.strerror or e}") from None
        for c, (unit, a, b, size) in enumerate(spans):
            plan.append(Chunk(i, str(path), c, len(spans), unit, a, b, size, ident))
    return plan


def _line_bounds(path: Path, size: int, chunk_bytes: int) -> list[int]:
    """``[0, b1, ..., size]``: each nominal boundary ``k * chunk_bytes`` moved
    forward to the next line start (a line longer than a chunk merges chunks)."""
    bounds = [0]
    with open(path, "rb") as f:
        for nominal in range(chunk_bytes, size, chunk_bytes):
            if nominal <= bounds[-1]:
                continue
            pos = nominal - 1  # a line starts at `nominal` if the byte before it ends one
            f.seek(pos)
            while True:
                block = f.read(1 << 16)
                if not block:
                    pos = size
                    break
                j = block.find(b"\n")
                if j >= 0:
                    pos += j + 1
                    break
                pos += len(block)
            if pos >= size:
                break
            bounds.append(pos)
    if size > 0 or len(bounds) == 1:
        bounds.append(size)
    return bounds


def _row_group_spans(path: Path, chunk_bytes: int) -> list[tuple[str, int, int, int]]:
    """Runs of consecutive row groups of about ``chunk_bytes`` (compressed) each."""
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise BuildError(f"{path}: reading Parquet needs the 'pyarrow' package") from None
    try:
        meta = pq.ParquetFile(str(path)).metadata
    except pa.ArrowException as e:
        raise BuildError(f"{path}: unreadable Parquet: {e}") from None
    sizes = [_row_group_range(meta, g) for g in range(meta.num_row_groups)]
    spans: list[tuple[str, int, int, int]] = []
    g0, acc = 0, 0
    for g, (a, b) in enumerate(sizes):
        acc += b - a
        if acc >= chunk_bytes or g == len(sizes) - 1:
            spans.append(("row_groups", g0, g + 1, acc))
            g0, acc = g + 1, 0
    return spans or [("row_groups", 0, 0, 0)]


def _row_group_range(meta: Any, g: int) -> tuple[int, int]:
    """The byte range ``[a, b)`` of the file holding row group ``g``'s column chunks."""
    rg = meta.row_group(g)
    lo, hi = None, 0
    for j in range(rg.num_columns):
        col = rg.column(j)
        start = col.data_page_offset
        if col.has_dictionary_page and col.dictionary_page_offset is not None:
            start = min(start, col.dictionary_page_offset)
        lo = start if lo is None else min(lo, start)
        hi = max(hi, start + col.total_compressed_size)
    return (lo or 0, hi)


# ---- integrity: what is up to date, what is stale ---------------------------------------


def _up_to_date(part: Path, base: dict[str, Any], chunk: Chunk) -> bool:
    """Whether ``part`` is complete and was built from ``chunk`` as it is now, with ``base``."""
    try:
        m = read_manifest(part)
    except (TokloadError, OSError, ValueError):
        return False
    rec = m.user.get("build")
    if not isinstance(rec, dict):
        return False  # built by a tokload that recorded nothing: rebuild
    got: dict[str, Any] = {key: rec.get(key) for key in base}
    want = dict(base)
    stats = m.user.get("stats")
    skipped_none = isinstance(stats, dict) and not stats.get("skipped")
    if skipped_none and isinstance(got.get("options"), dict):
        # A chunk that skipped nothing is the same whether bad records stop or are skipped.
        got["options"] = {**got["options"], "on_error": want["options"]["on_error"]}
    recorded_input, recorded_chunk = rec.get("input"), rec.get("chunk")
    if not isinstance(recorded_input, dict) or not isinstance(recorded_chunk, dict):
        return False
    same_input = [recorded_input.get(key) for key in ("path", "size", "mtime_ns")]
    same_chunk = {key: recorded_chunk.get(key) for key in chunk.record()}
    return bool(
        got == want
        and same_input == [os.path.abspath(chunk.path), *chunk.identity]
        and same_chunk == chunk.record()
    )


def _stale_parts(parts: Path, plan: list[Chunk], mine: list[Chunk]) -> list[Path]:
    """Directories under ``parts`` that no longer belong: chunks (finished, temporary
    or half-removed) of inputs past the end of the input list, chunks of the inputs
    this build touches that are not in their plan, and parts of the old one-per-input
    layout. Chunks of inputs this build does not touch (other ``--part`` slices) stay."""
    planned = {c.name for c in plan}
    touched = {c.input for c in mine}
    n_inputs = plan[-1].input + 1 if plan else 0
    stale = []
    for d in parts.iterdir():
        stem = d.name.split(".")[0]
        fields = stem.split("-")
        if not all(f.isdigit() for f in fields) or len(fields) > 2 or not _ours(d):
            continue  # never remove what tokload build did not write
        i = int(fields[0])
        if (
            d.name.endswith(".old")
            or i >= n_inputs
            or (i in touched and (len(fields) == 1 or stem not in planned))
            or (d.name.endswith(".tmp") and i in touched)
        ):
            stale.append(d)
    return sorted(stale)


def _temporaries(parts: Path, name: str) -> list[Path]:
    """The temporary directories of chunk ``name`` under ``parts`` (``_ours`` or not)."""
    return sorted(parts.glob(f"{name}.*.tmp")) + [p for p in [parts / f"{name}.tmp"] if p.exists()]


def _remove_temporaries(parts: Path, names: list[str]) -> None:
    """Remove the temporary directories of chunks ``names``, which this build was
    writing when it stopped. A worker stopped between creating one and writing
    the build's marker into it leaves it empty and unmarked: an empty directory
    of such a name is removed too (``os.rmdir`` removes only an empty one)."""
    for name in names:
        for d in _temporaries(parts, name):
            if d.is_dir() and not d.is_symlink() and not _ours(d):
                with contextlib.suppress(OSError):  # not empty: not ours, kept
                    os.rmdir(d)
                continue
            _remove_dir(d)


def _remove_dir(d: Path) -> None:
    """Remove a chunk directory so that no crash leaves it looking complete.

    The directory is first renamed (atomically) to ``*.old``, which no reader
    or re-run takes for a chunk, then deleted, the build's marker last, so a
    crash part-way leaves a directory that a re-run still knows to remove.
    Nothing that tokload build did not write (``_ours``) is ever removed.
    """
    if not d.is_dir() or d.is_symlink() or not _ours(d):
        return
    marker = d / BUILD_MARKER
    if not marker.exists():  # a chunk of an older build, known by its manifest
        marker.write_text(_MARKER_TEXT)
    if not d.name.endswith(".old"):
        old = d.with_name(f"{d.name}.{secrets.token_hex(4)}.old")
        os.replace(d, old)
        d = old
    for child in d.iterdir():
        if child.name == BUILD_MARKER:
            continue
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child, ignore_errors=True)
        else:
            child.unlink(missing_ok=True)
    shutil.rmtree(d, ignore_errors=True)


def _assemble(
    out: Path,
    opts: BuildOptions,
    tok_record: dict[str, Any],
    vocab_size: int,
    files: list[Path],
    mine: list[Chunk],
) -> Manifest:
    """The top-level manifest: the chunks' shards in input and chunk order."""
    tdt = token_dtype(vocab_size)
    dtype: Any = [("token", tdt.str)] if opts.metadata else tdt
    m = Manifest(dtype=np.dtype(dtype), documents=True, metadata=opts.metadata)
    for c in mine:
        p = read_manifest(out / PARTS / c.name)
        m.metadata_layout, m.span_block = p.metadata_layout, p.span_block  # the writer's
        # the chunk's shards, checksums and all, under their path from the top
        m.shards.extend(dataclasses.replace(s, name=f"{PARTS}/{c.name}/{s.name}") for s in p.shards)
    touched = sorted({c.input for c in mine})
    m.user = {
        "built_by": "tokload build",
        "options": {**opts.record(), "tokenizer": tok_record.get("file", tok_record["kind"])},
        "tokenizer": tok_record,
        "inputs": [str(files[i]) for i in touched],
        "input_range": [touched[0], touched[-1] + 1] if touched else [0, 0],
        "chunk_range": [mine[0].input, mine[0].index, mine[-1].input, mine[-1].index + 1]
        if mine
        else [],
    }
    write_manifest(out, m)
    return m


# ---- local worker processes -------------------------------------------------------------


def _run_pool(tasks: list[tuple[Any, ...]], workers: int, update: Callable[..., None]) -> None:
    """Run ``_build_chunk`` over ``tasks`` in ``workers`` processes; stop them all on any error.

    The workers are started with SIGINT ignored (an ignored signal stays ignored
    across ``exec``, and Python then installs no handler of its own), so a
    Ctrl+C sent to the whole process group reaches only this process, which
    terminates them: no worker prints a traceback, none outlives the build.
    SIGINT is blocked meanwhile, so one that arrives while they start stays
    pending here (Linux keeps a blocked signal pending even while ignored)
    and is raised as soon as they have started. Workers report the bytes
    they have read through a queue, so the progress bar moves within chunks.
    """
    ctx = mp.get_context("spawn")
    threads = max(1, (os.cpu_count() or 1) // workers)
    progress = ctx.SimpleQueue()
    main_thread = threading.current_thread() is threading.main_thread()
    if main_thread:
        # Start multiprocessing's resource tracker first: starting it unblocks SIGINT.
        from multiprocessing import resource_tracker

        resource_tracker.ensure_running()
        old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        old_handler = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        pool = ctx.Pool(workers, initializer=_init_worker, initargs=(progress, threads))
    finally:
        if main_thread:
            signal.signal(signal.SIGINT, old_handler)
            signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)

    def drain() -> None:
        while not progress.empty():
            update(*progress.get())

    # Ctrl+C while this thread waits inside the queue's or the pool's locks can
    # leave a lock half released ("release unlocked lock" instead of the
    # KeyboardInterrupt), so the signal only sets a flag here, and the loop
    # raises KeyboardInterrupt at a safe point (it wakes every 0.2 s).
    interrupted = threading.Event()
    old_sigint = None
    if main_thread:
        old_sigint = signal.signal(signal.SIGINT, lambda signum, frame: interrupted.set())
    try:
        results = pool.imap_unordered(_build_task, tasks)
        while True:
            if interrupted.is_set():
                raise KeyboardInterrupt
            drain()
            try:
                update(*results.next(timeout=0.2))
            except mp.TimeoutError:
                continue
            except StopIteration:
                break
        drain()
        if interrupted.is_set():
            raise KeyboardInterrupt
    except BaseException:
        pool.terminate()
        pool.join()
        raise
    finally:
        if main_thread:
            signal.signal(signal.SIGINT, old_sigint)
    pool.close()
    pool.join()


_REPORT: Callable[[int, int, int], None] | None = None


def _set_threads(threads: int) -> None:
    """Size the tokenizer's thread pool (read once, at its first parallel batch)."""
    os.environ.setdefault("RAYON_NUM_THREADS", str(threads))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true" if threads > 1 else "false")


def _init_worker(progress: Any, threads: int) -> None:
    global _REPORT
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _set_threads(threads)
    _REPORT = lambda *counts: progress.put(counts)  # noqa: E731


def _build_task(task: tuple[Chunk, BuildOptions, str, dict[str, Any]]) -> tuple[int, int, int]:
    chunk, opts, out_s, base = task
    return _build_chunk(chunk, opts, out_s, base, report=_REPORT)


# ---- Ray --------------------------------------------------------------------------------


def _run_ray(
    tasks: list[tuple[Any, ...]], address: str | None, update: Callable[..., None]
) -> None:
    """Run the chunks as Ray tasks (one CPU each), on the cluster at ``address``.

    An instance this process already started (``ray.init`` before the build)
    is used as it is. Progress moves as chunks finish. On any error the
    remaining tasks are cancelled and the error of the chunk re-raised as it
    was (a ``BuildError`` naming the file and line, not Ray's wrapper).
    """
    try:
        import ray
    except ImportError:
        raise UsageError("--ray needs the 'ray' package: pip install 'tokload[ray]'") from None
    if not ray.is_initialized():
        ray.init(address=address, log_to_driver=False, configure_logging=False)
    remote = ray.remote(num_cpus=1)(_ray_task)
    pending = {remote.remote(*task): task[0].name for task in tasks}
    try:
        while pending:
            done, _ = ray.wait(list(pending), num_returns=1, timeout=0.5)
            for ref in done:
                pending.pop(ref)  # finished: never cancelled below (see there)
                try:
                    counts = ray.get(ref)
                except ray.exceptions.RayTaskError as e:
                    cause = getattr(e, "cause", None)
                    if isinstance(cause, BaseException):
                        raise cause from None
                    raise
                update(*counts)
    except BaseException:
        # Only tasks not finished yet: cancelling the one that just failed made Ray's
        # core abort the driver ("Tried to complete task that was not pending",
        # task_manager.cc, Ray 2.60) in about one failed build in eight.
        for ref in pending:
            ray.cancel(ref, force=True)
        with contextlib.suppress(Exception):
            ray.wait(list(pending), num_returns=len(pending), timeout=5)
        raise


def _ray_task(
    chunk: Chunk, opts: BuildOptions, out_s: str, base: dict[str, Any]
) -> tuple[int, int, int]:
    _set_threads(1)  # Ray gives this task one CPU
    return _build_chunk(chunk, opts, out_s, base)


# ---- reading a chunk ---------------------------------------------------------------------


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


class _Input:
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


def _open_lines(inp: _Input) -> IO[bytes]:
    path, chunk = inp.path, inp.chunk
    if chunk.unit == "bytes":
        return inp.binary(chunk.start, chunk.end)
    raw = inp.binary()
    if path.suffix in _COMPRESSED:
        return io.BufferedReader(_COMPRESSED[path.suffix](raw, "rb"), _READ_CHUNK)
    if path.suffix == ".zst":
        try:
            import zstandard
        except ImportError:
            raise BuildError(f"{path}: reading .zst needs the 'zstandard' package") from None
        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(raw), _READ_CHUNK)
    return raw


def _lines_before(path: Path, offset: int) -> int:
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

Record = tuple[int, dict[str, Any] | None, tuple[str, str] | None, int]
"""(line, record, (reason key, message), FIRST/LAST flags) of one input record; lines count
from the chunk's first (1) and rows from the file's first; a plain-text document comes
in pieces (see ``_text_pieces``)."""


def _parse_line(line: bytes) -> Any:
    try:
        return _fast_loads(line)
    except ValueError:
        # orjson is stricter (NaN, lone surrogates) and words errors its own way:
        # json decides, and words the error.
        return json.loads(line)


def _records(inp: _Input, text_field: str) -> Iterator[Record]:
    path, chunk = inp.path, inp.chunk
    kind = input_kind(path)
    if kind == "jsonl":
        with _open_lines(inp) as f:
            for line_no, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    rec = _parse_line(line)
                except (ValueError, RecursionError) as e:
                    detail = (
                        f"{e.msg} at column {e.colno}"
                        if isinstance(e, json.JSONDecodeError)
                        else str(e).split(";")[0] or type(e).__name__
                    )
                    yield line_no, None, (MALFORMED_JSON, f"malformed JSON ({detail})"), WHOLE
                    continue
                if not isinstance(rec, dict):
                    yield (
                        line_no,
                        None,
                        (NOT_AN_OBJECT, f"a JSON {type(rec).__name__}, not an object"),
                        WHOLE,
                    )
                    continue
                yield line_no, rec, None, WHOLE
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
                a, b = _row_group_range(meta, g)
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
            for batch in pf.iter_batches(batch_size=1024, row_groups=list(groups)):
                for rec in batch.to_pylist():
                    row += 1
                    yield row, rec, None, WHOLE
    else:
        with inp.binary() as f:
            for flags, piece in _text_pieces(f):
                yield 1, {text_field: piece, "path": str(path)}, None, flags


_TEXT_PIECE = 256 << 10
"""Bytes of a plain-text input read (and tokenized) at a time."""
_BATCH_PIECES_CHARS = 1 << 20
"""Characters of plain-text pieces tokenized in one batch: each tokenizer thread gets a
piece or two, so the batch (which Ctrl+C waits for) takes a fraction of a second."""

FIRST, LAST = 1, 2
WHOLE = FIRST | LAST
"""Where a record's text stands in its document: its first piece, its last, or all of it."""


def _text_pieces(f: IO[bytes], piece: int | None = None) -> Iterator[tuple[int, str]]:
    """A plain-text file as pieces of about ``piece`` bytes, each with its place
    (``FIRST``/``LAST`` flags): memory stays bounded whatever the file's size.

    A piece ends at a line break between two characters that are not white
    space, else before a space between two words: a byte-level BPE
    pre-tokenizer (GPT-2's and Llama 3's patterns, most tokenizer.json files)
    splits the text there anyway, so the pieces' tokens are the whole text's.
    Only a text with neither in 4 pieces' length is cut where it stands (the
    tokens next to that cut may then differ from the whole text's).
    Raises ``UnicodeDecodeError`` at the first byte that is not UTF-8.
    """
    size = piece or _TEXT_PIECE
    decoder = codecs.getincrementaldecoder("utf-8")("strict")
    carry = ""
    first = True
    while True:
        block = f.read(size)
        text = carry + decoder.decode(block, final=not block)
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


def _cut(text: str) -> int:
    """Where ``text`` may be cut (see ``_text_pieces``), or -1: the last line break
    with no white space on either side, else the last space between two words."""
    for sep, after in (("\n", 1), (" ", 0)):
        pos = text.rfind(sep, 1, len(text) - 1)
        tries = 0
        while pos > 0 and tries < 64:
            if not text[pos - 1].isspace() and not text[pos + 1].isspace():
                return pos + after
            pos = text.rfind(sep, 1, pos)
            tries += 1
    return -1


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


def _read_errors() -> tuple[type[BaseException], ...]:
    """What reading a damaged input raises (beyond ``OSError``)."""
    errors: list[type[BaseException]] = [OSError, UnicodeDecodeError, EOFError, lzma.LZMAError]
    with contextlib.suppress(ImportError):
        import zstandard

        errors.append(zstandard.ZstdError)
    with contextlib.suppress(ImportError):
        import pyarrow as pa

        errors.append(pa.ArrowException)
    return tuple(errors)


# ---- building one chunk ------------------------------------------------------------------


_TOKENIZERS: dict[str, Tokenizer] = {}


def _build_chunk(
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
    tok = _TOKENIZERS.get(opts.tokenizer)
    if tok is None:
        tok = _TOKENIZERS[opts.tokenizer] = load_tokenizer(opts.tokenizer)
    tdt = token_dtype(tok.vocab_size)
    # With metadata, the Writer attaches it as a span table (FORMAT.md, version 2).
    dtype: Any = [("token", tdt.str)] if opts.metadata else tdt
    final = out / PARTS / chunk.name
    for d in _temporaries(out / PARTS, chunk.name):
        _remove_dir(d)  # left by a task that died (a Ray retry)
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
            first_line = _lines_before(path, chunk.start)
        return f"{path}:{first_line + line}"

    def fail(line: int | None, reason: str, message: str) -> None:
        if opts.on_error == "stop":
            at = str(path) if line is None else where(line)
            raise BuildError(f"{at}: {message} (on_error='skip' skips such records)")
        skipped[reason] += 1

    try:
        inp = _Input(chunk)
    except OSError as e:
        raise BuildError(f"{path}: cannot open the input: {e.strerror or e}") from None
    try:
        tmp.mkdir()
        (tmp / BUILD_MARKER).write_text(_MARKER_TEXT)  # first: whatever follows is the build's
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
        pending_chars = 0

        def flush() -> None:
            nonlocal docs, tokens, pending_chars, reported, reported_docs, reported_tokens
            nonlocal open_tokens
            if not pending:
                return
            texts = [t for _, t, _ in pending]
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
            pending_chars = 0
            if report is not None and inp.consumed() - reported >= _REPORT_BYTES:
                n = min(inp.consumed(), chunk.size) - reported
                report(n, docs - reported_docs, tokens - reported_tokens)
                reported += n
                reported_docs, reported_tokens = docs, tokens

        try:
            for line, rec, err, place in _records(inp, opts.text_field):
                if err is not None:
                    fail(line, *err)
                    continue
                assert rec is not None
                text = rec.get(opts.text_field)
                if not isinstance(text, str):
                    if text is None:
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
                            f"field {opts.text_field!r} is a {type(text).__name__}, not a string",
                        )
                    continue
                pending.append((line, text, rec))
                places.append(place)
                pending_chars += len(text)
                limit = _BATCH_CHARS if place == WHOLE else _BATCH_PIECES_CHARS
                if len(pending) >= _BATCH_DOCS or pending_chars >= limit:
                    flush()
            flush()
        except _read_errors() as e:
            if isinstance(e, BuildError):
                raise
            w.discard()  # the pieces of a plain-text document cut short
            tokens -= open_tokens
            fail(None, UNREADABLE, f"unreadable: {e}")
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
            if (
                not isinstance(a, dict)
                or not isinstance(a.get("start"), int)
                or not isinstance(a.get("end"), int)
            ):
                return None, (
                    ANNOTATION_NO_SPAN,
                    f"an annotation without integer start/end: {a!r}",
                )
            s, e = a["start"], a["end"]
            if not 0 <= s < e <= n_text:
                return None, (
                    ANNOTATION_OUTSIDE,
                    f"annotation [{s}, {e}) is outside the text ({n_text} characters)",
                )
        assert offsets is not None
        starts = np.fromiter((a["start"] for a in raw), np.int64, len(raw))
        ends = np.fromiter((a["end"] for a in raw), np.int64, len(raw))
        shift = int(opts.bos)  # a BOS token spans [0, 0): it precedes every annotation
        los = np.searchsorted(offsets[:, 1], starts, side="right") + shift
        his = np.searchsorted(offsets[:, 0], ends, side="left") + shift
        for a, lo, hi in zip(raw, los.tolist(), his.tolist(), strict=True):
            if lo < hi:
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
            spans.append((a, b, json.dumps(record, sort_keys=True, separators=(",", ":")).encode()))
    return spans, None
