"""From raw text to a dataset: ``tokload build`` as a function.

Inputs (JSONL, optionally gzip/bz2/xz/zstd-compressed; Parquet; or any other
file as one plain-text document) are expanded and sorted, and input ``i`` is
built, by whichever worker process takes it, into its own part dataset
``OUT/parts/iiiii`` (shards named ``in{i:05d}-*``). A part is written in a
temporary directory and renamed when complete. Nothing depends on the number
of workers or on ``--part k/N`` slicing: the same inputs always give the same
files.

Build integrity: each part's manifest records, under ``user["build"]``, what
it was built from: the input's identity (absolute path, size, modification
time, and the SHA-256 of the bytes read, computed while reading), the
tokenizer's SHA-256 and every option that changes the output. A re-run
reuses a part only when that record equals what this run would build,
rebuilds the others, and removes parts whose input index is past the end of
the input list. The top-level manifest is removed before any part changes and
written last, so it never lists a part that is missing or stale. A
``tokenizer.json`` is copied into the dataset (``OUT/tokenizer.json``), so the
dataset can be decoded wherever it travels.

Per-document metadata (fields kept from each record) and character-span
annotations become metadata records (FORMAT.md, stream with metadata): each
maximal run of tokens covered by the same annotations gets one record, the
JSON ``{"document": {kept fields}, "annotations": [annotation without start
and end, ...]}`` (empty parts omitted, keys sorted).
"""

from __future__ import annotations

import bz2
import contextlib
import dataclasses
import glob
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
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import numpy as np

from tokload.errors import TokloadError
from tokload.format import (
    FORMAT_VERSION,
    MANIFEST,
    METADATA_FIELD,
    Manifest,
    open_dataset,
    read_manifest,
    write_manifest,
)
from tokload.tokenizer import (
    TOKENIZER_FILE,
    Encoded,
    Tokenizer,
    copy_tokenizer,
    dataset_copy_is_current,
    dataset_record,
    load_tokenizer,
    token_dtype,
)
from tokload.writer import Writer

PARTS = "parts"
BUILDER_VERSION = 1
"""Bumped whenever the builder would write different bytes for the same input and options."""

_BATCH_DOCS = 256
_READ_CHUNK = 1 << 20
_JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
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
    """What to extract from the inputs and how to tokenize it (see :func:`build`)."""

    text_field: str = "text"
    keep_fields: tuple[str, ...] = ()
    annotations_field: str | None = None
    tokenizer: str = "bytes"
    bos: bool = False
    eos: bool = True
    on_error: str = "stop"
    shard_bytes: int = 1 << 30

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
        }


@dataclass
class BuildSummary:
    """What a build (or a part of one) produced."""

    inputs: int = 0
    built: int = 0  # inputs built by this call (the others were reused, unchanged)
    removed: int = 0  # parts of inputs no longer in the input list, removed
    documents: int = 0
    tokens: int = 0
    shards: int = 0
    bytes: int = 0
    seconds: float = 0.0
    skipped: dict[str, int] = field(default_factory=dict)

    def __str__(self) -> str:
        skipped = sum(self.skipped.values())
        reasons = ", ".join(f"{k}: {v}" for k, v in sorted(self.skipped.items()))
        extra = f", skipped {skipped} ({reasons})" if skipped else ""
        removed = f", {self.removed} stale parts removed" if self.removed else ""
        return (
            f"{self.documents:,} documents, {self.tokens:,} tokens in {self.shards} shards "
            f"({self.bytes / 1e6:.1f} MB) from {self.inputs} inputs ({self.built} built now"
            f"{removed}) in {self.seconds:.1f} s{extra}"
        )


def expand_inputs(inputs: Sequence[str | os.PathLike[str]]) -> list[Path]:
    """Files named, matched by globs, or found (recursively) in directories; sorted, unique."""
    found: set[Path] = set()
    for spec in inputs:
        s = os.fspath(spec)
        matches = sorted(glob.glob(s, recursive=True)) if glob.has_magic(s) else [s]
        if not matches:
            raise FileNotFoundError(2, "no input matches", s)
        for m in matches:
            p = Path(m)
            if p.is_dir():
                found.update(q for q in p.rglob("*") if q.is_file())
            elif p.is_file():
                found.add(p)
            elif p.exists():
                raise BuildError(f"{p}: an input must be a regular file or a directory")
            else:
                raise FileNotFoundError(2, "no such input", str(p))
    return sorted(found)


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
    shard_bytes: int = 1 << 30,
    progress: bool | None = None,
) -> BuildSummary:
    """Tokenize a corpus into a tokload dataset at ``output``.

    Args:
        inputs: files, globs or directories: ``*.jsonl`` (also ``.gz``, ``.bz2``,
            ``.xz``, ``.zst``), ``*.parquet``, anything else is one plain-text
            document (its path is available as the field ``path``).
        text_field: the field holding the text.
        keep_fields: per-document fields kept as metadata (e.g. ``["id",
            "source"]``).
        annotations_field: a field holding a list of character-span annotations
            ``{"start": s, "end": e, ...}``; the other keys are kept.
        tokenizer: ``"bytes"`` (built in) or the path of a ``tokenizer.json``,
            which is copied to ``output/tokenizer.json``.
        bos, eos: add the tokenizer's BOS / EOS token around each document.
        workers: processes building inputs in parallel.
        part: ``"k/N"``: build only the k-th of N contiguous slices of the
            inputs (``tokload merge`` joins the parts).
        on_error: ``"stop"`` raises :class:`BuildError` at the first bad
            record; ``"skip"`` skips it and counts it, per reason, in the summary.
        shard_bytes: shard size limit.
        progress: show a progress bar (default: when stderr is a terminal).

    Re-running on the same ``output`` rebuilds exactly the parts whose input
    (path, size, modification time), tokenizer or options differ from what
    they record, and removes the parts of inputs past the end of the input
    list. On any exception, ``KeyboardInterrupt`` included, the worker
    processes are stopped and the unfinished parts' temporary directories
    removed; the top-level manifest is then absent (it is written last), and
    the same call resumes.

    Raises:
        UsageError: an argument is wrong (``workers < 1``, a bad ``part``, an
            output that is a file, a tokenizer without the BOS/EOS asked for).
        BuildError: a bad record (``on_error="stop"``) or input file.
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
    k, n = parse_part(part)
    out = Path(output)
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
    files = expand_inputs(inputs)
    if not files:
        raise UsageError("no input files (the directories given are empty)")
    lo, hi = k * len(files) // n, (k + 1) * len(files) // n
    (out / PARTS).mkdir(parents=True, exist_ok=True)
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
    )
    base = {
        "builder": BUILDER_VERSION,
        "format_version": FORMAT_VERSION,
        "tokenizer": {key: tok_record.get(key) for key in ("kind", "sha256", "bos", "eos")},
        "dtype": token_dtype(tok.vocab_size).str,
        "options": opts.record(),
    }
    todo = [i for i in range(lo, hi) if not _up_to_date(out / PARTS / f"{i:05d}", base, files[i])]
    stale = _stale_parts(out / PARTS, len(files))
    if todo or stale or not dataset_copy_is_current(tok, out):
        # From here on the dataset changes: no manifest may list it until the end.
        (out / MANIFEST).unlink(missing_ok=True)
    copy_tokenizer(tok, out)
    for d in stale:
        _remove_dir(d)
    for i in todo:
        _remove_dir(out / PARTS / f"{i:05d}.tmp")
        _remove_dir(out / PARTS / f"{i:05d}")
    total_bytes = sum(files[i].stat().st_size for i in todo)
    bar = _progress(progress, total_bytes)
    summary = BuildSummary(inputs=hi - lo, built=len(todo), removed=len(stale))
    tasks = [(i, str(files[i]), opts, str(out), base) for i in todo]
    try:
        if workers == 1 or len(todo) <= 1:
            for task in tasks:
                bar.update(_build_input(*task))
        else:
            _run_pool(tasks, min(workers, len(todo)), bar.update)
    except BaseException:
        for i in todo:  # a worker stopped mid-part leaves its temporary directory
            _remove_dir(out / PARTS / f"{i:05d}.tmp")
        raise
    finally:
        bar.close()
    manifest = _assemble(out, opts, tok, tok_record, files, lo, hi)
    open_dataset(out).close()  # the manifest agrees with the files (sizes only: cheap)
    skipped: Counter[str] = Counter()
    for i in range(lo, hi):
        stats = read_manifest(out / PARTS / f"{i:05d}").user.get("stats", {})
        skipped.update(stats.get("skipped", {}))
    summary.documents = manifest.num_documents
    summary.tokens = manifest.rows
    summary.shards = len(manifest.shards)
    summary.bytes = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    summary.skipped = dict(skipped)
    summary.seconds = time.perf_counter() - t0
    return summary


def _identity(path: Path) -> dict[str, Any]:
    st = os.stat(path)
    return {"path": os.path.abspath(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _up_to_date(part: Path, base: dict[str, Any], path: Path) -> bool:
    """Whether ``part`` is complete and was built from ``path`` as it is now, with ``base``."""
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
        # A part that skipped nothing is the same whether bad records stop or are skipped.
        got["options"] = {**got["options"], "on_error": want["options"]["on_error"]}
    recorded_input = rec.get("input")
    if not isinstance(recorded_input, dict):
        return False
    same_input = {key: recorded_input.get(key) for key in ("path", "size", "mtime_ns")}
    return bool(got == want and same_input == _identity(path))


def _stale_parts(parts: Path, n_inputs: int) -> list[Path]:
    """Part directories (finished, temporary or half-removed) of inputs past ``n_inputs``."""
    stale = []
    for d in parts.iterdir():
        stem = d.name.split(".")[0]
        if stem.isdigit() and (int(stem) >= n_inputs or d.name.endswith(".old")):
            stale.append(d)
    return sorted(stale)


def _remove_dir(d: Path) -> None:
    """Remove a part directory so that no crash leaves it looking complete.

    The directory is first renamed (atomically) to ``*.old``, which no reader
    or re-run takes for a part, then deleted.
    """
    if not d.exists():
        return
    if not d.name.endswith(".old"):
        old = d.with_name(f"{d.name}.{secrets.token_hex(4)}.old")
        os.replace(d, old)
        d = old
    shutil.rmtree(d, ignore_errors=True)


def _assemble(
    out: Path,
    opts: BuildOptions,
    tok: Tokenizer,
    tok_record: dict[str, Any],
    files: list[Path],
    lo: int,
    hi: int,
) -> Manifest:
    """The top-level manifest: the parts' shards in input order."""
    tdt = token_dtype(tok.vocab_size)
    dtype: Any = [("token", tdt.str), (METADATA_FIELD, "<u4")] if opts.metadata else tdt
    m = Manifest(dtype=np.dtype(dtype), documents=True, metadata=opts.metadata)
    for i in range(lo, hi):
        p = read_manifest(out / PARTS / f"{i:05d}")
        # the part's shards, checksums and all, under their path from the top
        m.shards.extend(dataclasses.replace(s, name=f"{PARTS}/{i:05d}/{s.name}") for s in p.shards)
    m.user = {
        "built_by": "tokload build",
        "options": {**opts.record(), "tokenizer": tok_record.get("file", tok_record["kind"])},
        "tokenizer": tok_record,
        "inputs": [str(files[i]) for i in range(lo, hi)],
        "input_range": [lo, hi],
    }
    write_manifest(out, m)
    return m


# ---- worker processes ------------------------------------------------------------------


def _run_pool(tasks: list[tuple[Any, ...]], workers: int, update: Callable[[int], None]) -> None:
    """Run ``_build_input`` over ``tasks`` in ``workers`` processes; stop them all on any error.

    The workers are started with SIGINT ignored (an ignored signal stays ignored
    across ``exec``, and Python then installs no handler of its own), so a
    Ctrl+C sent to the whole process group reaches only this process, which
    terminates them: no worker prints a traceback, none outlives the build.
    SIGINT is blocked meanwhile, so one that arrives while they start stays
    pending here (Linux keeps a blocked signal pending even while ignored)
    and is raised as soon as they have started.
    """
    ctx = mp.get_context("spawn")
    main_thread = threading.current_thread() is threading.main_thread()
    if main_thread:
        # Start multiprocessing's resource tracker first: starting it unblocks SIGINT.
        from multiprocessing import resource_tracker

        resource_tracker.ensure_running()
        old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        old_handler = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        pool = ctx.Pool(workers, initializer=_init_worker)
    finally:
        if main_thread:
            signal.signal(signal.SIGINT, old_handler)
            signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
    try:
        results = pool.imap_unordered(_build_task, tasks)
        while True:
            try:
                update(results.next(timeout=0.2))
            except mp.TimeoutError:
                continue
            except StopIteration:
                break
    except BaseException:
        pool.terminate()
        pool.join()
        raise
    pool.close()
    pool.join()


def _init_worker() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _build_task(task: tuple[Any, ...]) -> int:
    return _build_input(*task)


# ---- progress -------------------------------------------------------------------------


class _NoBar:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def _progress(enabled: bool | None, total: int) -> Any:
    if enabled is None:
        enabled = sys.stderr.isatty()
    if not enabled:
        return _NoBar()
    from tqdm import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, desc="tokload build", smoothing=0.1)


# ---- reading inputs ---------------------------------------------------------------------


class _HashingReader(io.RawIOBase):
    """A raw reader that feeds every byte it returns to a hash: the input's
    content hash costs no second pass over the file."""

    def __init__(self, f: IO[bytes], h: Any) -> None:
        self._f = f
        self.hash = h

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        n = self._f.readinto(b)  # type: ignore[attr-defined]
        if n:
            self.hash.update(memoryview(b)[:n])
        return int(n or 0)

    def close(self) -> None:
        self._f.close()
        super().close()


class _Input:
    """One input file opened once: its identity and the hash of the bytes read from it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.hash = hashlib.sha256()
        self._raw = open(path, "rb", buffering=0)  # noqa: SIM115 - closed by close()
        st = os.fstat(self._raw.fileno())
        self.identity: dict[str, Any] = {
            "path": os.path.abspath(path),
            "size": st.st_size,
            "mtime_ns": st.st_mtime_ns,
        }

    def binary(self) -> IO[bytes]:
        return io.BufferedReader(_HashingReader(self._raw, self.hash), _READ_CHUNK)

    def record(self) -> dict[str, Any]:
        return {**self.identity, "sha256": self.hash.hexdigest()}

    def close(self) -> None:
        self._raw.close()


def _open_text(inp: _Input) -> IO[str]:
    path = inp.path
    suffix = path.suffix
    raw = inp.binary()
    if suffix in _COMPRESSED:
        return io.TextIOWrapper(_COMPRESSED[suffix](raw, "rb"), encoding="utf-8")
    if suffix == ".zst":
        try:
            import zstandard
        except ImportError:
            raise BuildError(f"{path}: reading .zst needs the 'zstandard' package") from None
        return io.TextIOWrapper(zstandard.ZstdDecompressor().stream_reader(raw), encoding="utf-8")
    return io.TextIOWrapper(raw, encoding="utf-8")


def _kind(path: Path) -> str:
    suffixes = path.suffixes
    base = (
        suffixes[-2]
        if len(suffixes) >= 2 and suffixes[-1] in (*_COMPRESSED, ".zst")
        else path.suffix
    )
    if base in _JSONL_SUFFIXES:
        return "jsonl"
    if path.suffix == ".parquet":
        return "parquet"
    return "text"


# Why a record is skipped: one key per reason, whatever the details of the message.
MALFORMED_JSON = "malformed JSON"
NOT_AN_OBJECT = "not a JSON object"
NO_TEXT = "missing text field"
TEXT_NOT_STRING = "text field not a string"
ANNOTATIONS_NOT_LIST = "annotations not a list"
ANNOTATION_NO_SPAN = "annotation without integer start/end"
ANNOTATION_OUTSIDE = "annotation outside the text"
UNREADABLE = "unreadable input"

Record = tuple[int, dict[str, Any] | None, tuple[str, str] | None]
"""(line, record, (reason key, message)) of one input record."""


def _records(inp: _Input, text_field: str) -> Iterator[Record]:
    path = inp.path
    kind = _kind(path)
    if kind == "jsonl":
        with _open_text(inp) as f:
            for line_no, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except (ValueError, RecursionError) as e:
                    detail = (
                        f"{e.msg} at column {e.colno}"
                        if isinstance(e, json.JSONDecodeError)
                        else str(e).split(";")[0] or type(e).__name__
                    )
                    yield line_no, None, (MALFORMED_JSON, f"malformed JSON ({detail})")
                    continue
                if not isinstance(rec, dict):
                    yield (
                        line_no,
                        None,
                        (NOT_AN_OBJECT, f"a JSON {type(rec).__name__}, not an object"),
                    )
                    continue
                yield line_no, rec, None
    elif kind == "parquet":
        try:
            import pyarrow as pa
            import pyarrow.parquet as pq
        except ImportError:
            raise BuildError(f"{path}: reading Parquet needs the 'pyarrow' package") from None
        # One pass over the disk: hash the mapped file, then Parquet reads the cached pages.
        with pa.memory_map(str(path)) as mf:
            while chunk := mf.read_buffer(_READ_CHUNK * 16):
                if not chunk.size:
                    break
                inp.hash.update(memoryview(chunk))
            mf.seek(0)
            row = 0
            for batch in pq.ParquetFile(mf).iter_batches(batch_size=1024):
                for rec in batch.to_pylist():
                    row += 1
                    yield row, rec, None
    else:
        with inp.binary() as f:
            text = f.read().decode("utf-8", errors="strict")
        yield 1, {text_field: text, "path": str(path)}, None


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


# ---- building one input ------------------------------------------------------------------


_TOKENIZERS: dict[str, Tokenizer] = {}


def _build_input(i: int, path_s: str, opts: BuildOptions, out_s: str, base: dict[str, Any]) -> int:
    """Build input i into OUT/parts/iiiii (via a temporary directory); returns its size."""
    path, out = Path(path_s), Path(out_s)
    tok = _TOKENIZERS.get(opts.tokenizer)
    if tok is None:
        tok = _TOKENIZERS[opts.tokenizer] = load_tokenizer(opts.tokenizer)
    tdt = token_dtype(tok.vocab_size)
    dtype: Any = [("token", tdt.str), (METADATA_FIELD, "<u4")] if opts.metadata else tdt
    tmp = out / PARTS / f"{i:05d}.tmp"
    final = out / PARTS / f"{i:05d}"
    skipped: Counter[str] = Counter()
    docs = tokens = 0

    def fail(where: str, reason: str, message: str) -> None:
        if opts.on_error == "stop":
            raise BuildError(f"{where}: {message} (on_error='skip' skips such records)")
        skipped[reason] += 1

    try:
        inp = _Input(path)
    except OSError as e:
        raise BuildError(f"{path}: cannot open the input: {e.strerror or e}") from None
    with (
        contextlib.closing(inp),
        Writer(
            tmp,
            dtype,
            metadata=opts.metadata,
            shard_bytes=opts.shard_bytes,
            name_prefix=f"in{i:05d}",
            user={"input": str(path)},
        ) as w,
    ):
        pending: list[tuple[int, str, dict[str, Any]]] = []

        def flush() -> None:
            nonlocal docs, tokens
            if not pending:
                return
            encs = tok.encode_batch([t for _, t, _ in pending])
            for (line, text, rec), enc in zip(pending, encs, strict=True):
                ids, spans, err = _document(enc, text, rec, opts, tok)
                if err is not None:
                    fail(f"{path}:{line}", *err)
                    continue
                w.write({"token": ids} if opts.metadata else ids, spans=spans)
                docs += 1
                tokens += len(ids)
            pending.clear()

        try:
            for line, rec, err in _records(inp, opts.text_field):
                if err is not None:
                    fail(f"{path}:{line}", *err)
                    continue
                assert rec is not None
                text = rec.get(opts.text_field)
                if not isinstance(text, str):
                    if text is None:
                        fail(f"{path}:{line}", NO_TEXT, f"no text field {opts.text_field!r}")
                    else:
                        fail(
                            f"{path}:{line}",
                            TEXT_NOT_STRING,
                            f"field {opts.text_field!r} is a {type(text).__name__}, not a string",
                        )
                    continue
                pending.append((line, text, rec))
                if len(pending) >= _BATCH_DOCS:
                    flush()
            flush()
        except _read_errors() as e:
            if isinstance(e, BuildError):
                raise
            fail(str(path), UNREADABLE, f"unreadable: {e}")
        w.manifest.user["stats"] = {
            "documents": docs,
            "tokens": tokens,
            "skipped": dict(sorted(skipped.items())),
        }
        w.manifest.user["build"] = {**base, "input": inp.record()}
    os.replace(tmp, final)  # the part is complete: publish it
    return int(inp.identity["size"])  # progress counts whole inputs


def _document(
    enc: Encoded, text: str, rec: dict[str, Any], opts: BuildOptions, tok: Tokenizer
) -> tuple[Any, list[tuple[int, int, bytes]] | None, tuple[str, str] | None]:
    """The token ids and metadata spans of one document, or (reason, message)."""
    ids, offsets = enc.ids, enc.offsets
    n_text = len(text)
    if opts.bos:
        ids = np.concatenate([[tok.bos_id], ids])
        offsets = np.concatenate([[[0, 0]], offsets])
    if opts.eos:
        ids = np.concatenate([ids, [tok.eos_id]])
        offsets = np.concatenate([offsets, [[n_text, n_text]]])
    if not opts.metadata:
        return ids, None, None
    doc_meta = {f: rec.get(f) for f in opts.keep_fields}
    anns: list[tuple[int, int, dict[str, Any]]] = []
    raw = rec.get(opts.annotations_field) if opts.annotations_field else None
    if raw is not None and not isinstance(raw, list):
        return (
            None,
            None,
            (
                ANNOTATIONS_NOT_LIST,
                f"field {opts.annotations_field!r} is not a list of annotations",
            ),
        )
    for a in raw or []:
        if (
            not isinstance(a, dict)
            or not isinstance(a.get("start"), int)
            or not isinstance(a.get("end"), int)
        ):
            return (
                None,
                None,
                (ANNOTATION_NO_SPAN, f"an annotation without integer start/end: {a!r}"),
            )
        s, e = a["start"], a["end"]
        if not 0 <= s < e <= n_text:
            return (
                None,
                None,
                (
                    ANNOTATION_OUTSIDE,
                    f"annotation [{s}, {e}) is outside the text ({n_text} characters)",
                ),
            )
        lo = int(np.searchsorted(offsets[:, 1], s, side="right"))
        hi = int(np.searchsorted(offsets[:, 0], e, side="left"))
        if lo < hi:
            anns.append((lo, hi, {k: v for k, v in a.items() if k not in ("start", "end")}))
    t = len(ids)
    bounds = sorted({0, t, *(b for lo, hi, _ in anns for b in (lo, hi))})
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
    return ids, spans, None
