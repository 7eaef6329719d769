"""From raw text to a dataset: ``tokload build`` as a function.

Inputs (JSONL, optionally gzip/bz2/xz/zstd-compressed; Parquet; or any other
file as one plain-text document) are expanded and sorted, and input ``i`` is
built, by whichever worker process takes it, into its own part dataset
``OUT/parts/iiiii`` (shards named ``in{i:05d}-*``). A part is written in a
temporary directory and renamed when complete, so an interrupted build
resumes by rebuilding only the parts that are missing. The top-level
manifest then lists the parts' shards in input order. Nothing depends on the
number of workers or on ``--part k/N`` slicing: the same inputs always give
the same files.

Per-document metadata (fields kept from each record) and character-span
annotations become metadata records (FORMAT.md, stream with metadata): each
maximal run of tokens covered by the same annotations gets one record, the
JSON ``{"document": {kept fields}, "annotations": [annotation without start
and end, ...]}`` (empty parts omitted, keys sorted).
"""

from __future__ import annotations

import bz2
import glob
import gzip
import io
import itertools
import json
import lzma
import multiprocessing as mp
import os
import shutil
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

import numpy as np

from tokload.errors import TokloadError
from tokload.format import (
    MANIFEST,
    METADATA_FIELD,
    Manifest,
    ShardInfo,
    read_manifest,
    write_manifest,
)
from tokload.tokenizer import Encoded, Tokenizer, load_tokenizer, token_dtype
from tokload.writer import Writer

PARTS = "parts"
_BATCH_DOCS = 256
_JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
_COMPRESSED: dict[str, Callable[..., Any]] = {
    ".gz": gzip.open,
    ".bz2": bz2.open,
    ".xz": lzma.open,
}


class BuildError(TokloadError, ValueError):
    """Bad input during a build; the message names the file and line."""


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


@dataclass
class BuildSummary:
    """What a build (or a part of one) produced."""

    inputs: int = 0
    built: int = 0  # inputs built by this call (the others were already complete)
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
        return (
            f"{self.documents:,} documents, {self.tokens:,} tokens in {self.shards} shards "
            f"({self.bytes / 1e6:.1f} MB) from {self.inputs} inputs ({self.built} built now) "
            f"in {self.seconds:.1f} s{extra}"
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
            elif p.exists():
                found.add(p)
            else:
                raise FileNotFoundError(2, "no such input", str(p))
    return sorted(found)


def _parse_part(part: str | tuple[int, int] | None) -> tuple[int, int]:
    if part is None:
        return 0, 1
    if isinstance(part, str):
        try:
            k_s, n_s = part.split("/")
            k, n = int(k_s), int(n_s)
        except ValueError:
            raise ValueError(f"part must look like 'k/N', got {part!r}") from None
    else:
        k, n = part
    if n < 1 or not 0 <= k < n:
        raise ValueError(f"part {k}/{n}: need 0 <= k < N")
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
        tokenizer: ``"bytes"`` (built in) or the path of a ``tokenizer.json``.
        bos, eos: add the tokenizer's BOS / EOS token around each document.
        workers: processes building inputs in parallel.
        part: ``"k/N"``: build only the k-th of N contiguous slices of the
            inputs (``tokload merge`` joins the parts).
        on_error: ``"stop"`` raises :class:`BuildError` at the first bad
            record; ``"skip"`` skips it and counts it in the summary.
        shard_bytes: shard size limit.
        progress: show a progress bar (default: when stderr is a terminal).
    """
    t0 = time.perf_counter()
    if on_error not in ("stop", "skip"):
        raise ValueError(f"on_error must be 'stop' or 'skip', got {on_error!r}")
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    opts = BuildOptions(
        text_field,
        tuple(keep_fields),
        annotations_field,
        str(tokenizer),
        bos,
        eos,
        on_error,
        shard_bytes,
    )
    tok = load_tokenizer(opts.tokenizer)  # fail early on a bad tokenizer
    if (bos and tok.bos_id is None) or (eos and tok.eos_id is None):
        raise ValueError(f"the tokenizer {tok.name} has no {'BOS' if bos else 'EOS'} token")
    files = expand_inputs(inputs)
    if not files:
        raise ValueError("no input files")
    k, n = _parse_part(part)
    lo, hi = k * len(files) // n, (k + 1) * len(files) // n
    out = Path(output)
    (out / PARTS).mkdir(parents=True, exist_ok=True)
    todo = []
    for i in range(lo, hi):
        final = out / PARTS / f"{i:05d}"
        if not (final / MANIFEST).exists():
            shutil.rmtree(out / PARTS / f"{i:05d}.tmp", ignore_errors=True)
            todo.append(i)
    total_bytes = sum(files[i].stat().st_size for i in todo)
    bar = _progress(progress, total_bytes)
    summary = BuildSummary(inputs=hi - lo, built=len(todo))
    try:
        if workers == 1 or len(todo) <= 1:
            for i in todo:
                _build_input(i, str(files[i]), opts, str(out), bar.update)
        else:
            ctx = mp.get_context("spawn")
            queue = ctx.Queue()
            with ProcessPoolExecutor(
                max_workers=min(workers, len(todo)),
                mp_context=ctx,
                initializer=_init_worker,
                initargs=(queue,),
            ) as pool:
                futures = [
                    pool.submit(_build_input, i, str(files[i]), opts, str(out), None) for i in todo
                ]
                while not all(f.done() for f in futures):
                    _drain(queue, bar.update, 0.1)
                _drain(queue, bar.update, 0)
                for f in futures:
                    f.result()  # re-raises a worker's BuildError
    finally:
        bar.close()
    manifest = _assemble(out, opts, tok, files, lo, hi)
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


def _assemble(
    out: Path, opts: BuildOptions, tok: Tokenizer, files: list[Path], lo: int, hi: int
) -> Manifest:
    """The top-level manifest: the parts' shards in input order."""
    parts = [read_manifest(out / PARTS / f"{i:05d}") for i in range(lo, hi)]
    first = parts[0]
    m = Manifest(dtype=first.dtype, documents=True, metadata=first.metadata)
    for i, p in zip(range(lo, hi), parts, strict=True):
        for s in p.shards:
            m.shards.append(
                ShardInfo(
                    f"{PARTS}/{i:05d}/{s.name}",
                    s.rows,
                    s.documents,
                    s.metadata_records,
                    s.metadata_bytes,
                )
            )
    m.user = {
        "built_by": "tokload build",
        "options": {k: v for k, v in asdict(opts).items() if k != "on_error"},
        "tokenizer": tok.describe(),
        "inputs": [str(files[i]) for i in range(lo, hi)],
        "input_range": [lo, hi],
    }
    write_manifest(out, m)
    return m


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


_QUEUE: Any = None


def _init_worker(queue: Any) -> None:
    global _QUEUE
    _QUEUE = queue


def _drain(queue: Any, update: Callable[[int], None], timeout: float) -> None:
    import queue as q

    try:
        while True:
            update(queue.get(timeout=timeout))
            timeout = 0
    except q.Empty:
        pass


# ---- reading inputs ---------------------------------------------------------------------


def _open_text(path: Path) -> IO[str]:
    suffix = path.suffix
    if suffix in _COMPRESSED:
        return io.TextIOWrapper(_COMPRESSED[suffix](path, "rb"), encoding="utf-8")
    if suffix == ".zst":
        try:
            import zstandard
        except ImportError:
            raise BuildError(f"{path}: reading .zst needs the 'zstandard' package") from None
        return io.TextIOWrapper(
            zstandard.ZstdDecompressor().stream_reader(open(path, "rb")), encoding="utf-8"
        )
    return open(path, encoding="utf-8")


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


Record = tuple[int, dict[str, Any] | None, str | None]  # (line, record, error reason)


def _records(path: Path, text_field: str) -> Iterator[Record]:
    kind = _kind(path)
    if kind == "jsonl":
        with _open_text(path) as f:
            for line_no, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as e:
                    yield line_no, None, f"malformed JSON ({e.msg} at column {e.colno})"
                    continue
                if not isinstance(rec, dict):
                    yield line_no, None, f"a JSON {type(rec).__name__}, not an object"
                    continue
                yield line_no, rec, None
    elif kind == "parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise BuildError(f"{path}: reading Parquet needs the 'pyarrow' package") from None
        row = 0
        for batch in pq.ParquetFile(path).iter_batches(batch_size=1024):
            for rec in batch.to_pylist():
                row += 1
                yield row, rec, None
    else:
        with open(path, encoding="utf-8", errors="strict") as f:
            text = f.read()
        yield 1, {text_field: text, "path": str(path)}, None


# ---- building one input ------------------------------------------------------------------


_TOKENIZERS: dict[str, Tokenizer] = {}


def _build_input(
    i: int, path_s: str, opts: BuildOptions, out_s: str, report: Callable[[int], None] | None
) -> None:
    """Build input i into OUT/parts/iiiii (via a temporary directory)."""
    path, out = Path(path_s), Path(out_s)
    tok = _TOKENIZERS.get(opts.tokenizer)
    if tok is None:
        tok = _TOKENIZERS[opts.tokenizer] = load_tokenizer(opts.tokenizer)
    if report is None:
        queue = _QUEUE
        report = (lambda n: queue.put(n)) if queue is not None else (lambda n: None)
    tdt = token_dtype(tok.vocab_size)
    dtype: Any = [("token", tdt.str), (METADATA_FIELD, "<u4")] if opts.metadata else tdt
    tmp = out / PARTS / f"{i:05d}.tmp"
    final = out / PARTS / f"{i:05d}"
    skipped: Counter[str] = Counter()
    docs = tokens = 0
    size = path.stat().st_size

    def fail(where: str, reason: str) -> None:
        if opts.on_error == "stop":
            raise BuildError(f"{where}: {reason} (on_error='skip' skips such records)")
        skipped[reason.split(" (")[0].split(":")[0]] += 1

    with Writer(
        tmp,
        dtype,
        metadata=opts.metadata,
        shard_bytes=opts.shard_bytes,
        name_prefix=f"in{i:05d}",
        user={"input": str(path)},
    ) as w:
        pending: list[tuple[int, str, dict[str, Any]]] = []

        def flush() -> None:
            nonlocal docs, tokens
            if not pending:
                return
            encs = tok.encode_batch([t for _, t, _ in pending])
            for (line, text, rec), enc in zip(pending, encs, strict=True):
                rows, spans, err = _document(enc, text, rec, opts, tok)
                if err is not None:
                    fail(f"{path}:{line}", err)
                    continue
                w.write(rows, spans=spans)
                docs += 1
                tokens += len(rows)
            pending.clear()

        try:
            for line, rec, err in _records(path, opts.text_field):
                if err is not None:
                    fail(f"{path}:{line}", err)
                    continue
                assert rec is not None
                text = rec.get(opts.text_field)
                if not isinstance(text, str):
                    fail(
                        f"{path}:{line}",
                        f"no text field {opts.text_field!r}"
                        if text is None
                        else f"field {opts.text_field!r} is a {type(text).__name__}, not a string",
                    )
                    continue
                pending.append((line, text, rec))
                if len(pending) >= _BATCH_DOCS:
                    flush()
            flush()
        except (OSError, UnicodeDecodeError, EOFError, lzma.LZMAError) as e:
            if isinstance(e, BuildError):
                raise
            fail(str(path), f"unreadable: {e}")
        w.manifest.user["stats"] = {
            "documents": docs,
            "tokens": tokens,
            "skipped": dict(sorted(skipped.items())),
        }
    os.replace(tmp, final)  # the part is complete: publish it
    report(size)  # progress counts whole inputs


def _document(
    enc: Encoded, text: str, rec: dict[str, Any], opts: BuildOptions, tok: Tokenizer
) -> tuple[Any, list[tuple[int, int, bytes]] | None, str | None]:
    """The rows and metadata spans of one document, or an error reason."""
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
        return None, None, f"field {opts.annotations_field!r} is not a list of annotations"
    for a in raw or []:
        if (
            not isinstance(a, dict)
            or not isinstance(a.get("start"), int)
            or not isinstance(a.get("end"), int)
        ):
            return None, None, f"an annotation without integer start/end: {a!r}"
        s, e = a["start"], a["end"]
        if not 0 <= s < e <= n_text:
            return None, None, (f"annotation [{s}, {e}) is outside the text ({n_text} characters)")
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
    return {"token": ids}, spans, None
