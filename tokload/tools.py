"""What the ``inspect``, ``verify``, ``plan`` and ``bench`` commands do, as functions."""

from __future__ import annotations

import json
import math
import os
import textwrap
import time
from pathlib import Path
from typing import Any

import numpy as np

from tokload.arguments import positive_integer
from tokload.errors import TokloadError, UsageError
from tokload.format import METADATA_FIELD, Manifest
from tokload.location import Location
from tokload.reading import ReadOptions
from tokload.remote.store import split_options
from tokload.source import open_dataset
from tokload.tokenizer import from_description


def _a_tokload_dataset(path: str | os.PathLike[str], what: str) -> None:
    """Refuse a local path that is a token file or a Megatron prefix, which ``what``
    (``inspect``, ``verify``: tokload datasets only) would report as a manifest
    missing at a path that is not there.

    Raises:
        UsageError: naming the path, what it is and what reads it.
    """
    from tokload import remote
    from tokload.views.base import local_kind

    text = os.fspath(path)
    if remote.is_url(text):
        return
    local = Path(remote.local_path(text))
    if local.name == "manifest.json" and local.is_file():
        raise UsageError(f"{path}: a dataset's manifest: give its directory, {local.parent}")
    if local_kind(str(local)) == "megatron" and not local.is_dir():
        kind = "Megatron-LM .bin/.idx prefix"
    elif local.is_file():
        kind = "flat token file" if local.suffix in (".npy", ".bin") else "file"
    else:
        return
    raise UsageError(
        f"{path}: a {kind}, not a tokload dataset (a directory with manifest.json): {what} "
        "reads tokload datasets; read it with the views (tokload.Documents, TokenStream, "
        "open_flat) or tokload plan and bench"
    )


def inspect(path: str | os.PathLike[str], sample: int | None = 0, tokens: int = 64) -> str:
    """A readable summary of a dataset: manifest, sizes, and one decoded sample."""
    _a_tokload_dataset(path, "inspect")
    src = open_dataset(path)
    m = src.manifest
    assert m is not None
    if sample is not None and m.num_documents and not 0 <= sample < m.num_documents:
        src.close()
        raise UsageError(
            f"{path}: there is no document {sample}: the dataset has {m.num_documents:,} "
            f"(0 to {m.num_documents - 1:,})"
        )
    lines = [
        f"dataset     {path}",
        f"dtype       {m.dtype}",
        f"shards      {len(m.shards)}",
        f"documents   {m.num_documents:,}",
        f"rows        {m.rows:,}  ({m.rows * m.dtype.itemsize / 1e6:.1f} MB of rows)",
        f"metadata    {'yes' if m.metadata else 'no'}"
        + (
            f" ({sum(s.metadata_records for s in m.shards):,} records, "
            f"{_LAYOUT_NAMES[m.metadata_layout].format(m.span_block)})"
            if m.metadata
            else ""
        ),
        f"fingerprint {m.fingerprint()[:16]}",
    ]
    tok_desc = m.user.get("tokenizer")
    if tok_desc:
        lines.append(f"tokenizer   {json.dumps(tok_desc)}")
    if sample is not None and m.num_documents:
        from tokload.views import Documents

        docs = Documents(src)
        d = docs[sample]
        fields = d if isinstance(d, dict) else {"ids": d}
        rows = len(next(iter(fields.values())))
        lines.append(f"document {sample}: {rows} rows; first {min(tokens, rows)}:")
        for name, values in fields.items():  # structured rows: every field (input_ids, ...)
            shown = "ids" if name == "token" else name
            lines.append(f"  {shown:<7s} " + " ".join(map(str, values[:tokens].tolist())))
        toks = fields.get("token", fields.get("ids"))  # None: no token field to decode
        if toks is not None and isinstance(tok_desc, dict):
            tok = _dataset_tokenizer(path, tok_desc)
            if tok is not None:
                lines.append("  text    " + repr(tok.decode([int(t) for t in toks[:tokens]])))
            else:
                lines.append(
                    f"  text    (not decoded: the tokenizer file {tok_desc.get('file')!r} is "
                    "missing from the dataset or not the one it was built with)"
                )
        if m.metadata and rows:  # an empty document has no first token
            from tokload.views import StreamWithMetadata

            starts, _ = docs.extents([sample])
            view = StreamWithMetadata(src, window=1, stride=1)
            first = view[int(starts[0])] if len(view) > int(starts[0]) else None
            if first is not None and first.metadata:
                lines.append(f"  metadata of its first token: {first.metadata[0]!r}")
    src.close()
    return "\n".join(lines)


def _dataset_tokenizer(path: str | os.PathLike[str], desc: dict[str, Any]) -> Any:
    """The tokenizer ``desc`` describes, from the dataset's copy of its file (read
    from the store for a remote dataset) when its SHA-256 is the recorded one."""
    loc = Location(path)
    if not loc.remote or not isinstance(desc.get("file"), str):
        return from_description(desc, root=None if loc.remote else path)
    import tempfile

    from tokload.remote.urls import join

    try:
        data = loc.read(join(os.fspath(path), desc["file"]), "tokenizer file")
    except (OSError, TokloadError):
        return from_description({**desc, "file": None})
    with tempfile.TemporaryDirectory(prefix="tokload-inspect-") as d:
        with open(os.path.join(d, os.path.basename(desc["file"])), "wb") as f:
            f.write(data)
        return from_description(desc, root=d)


S3_GETS_PER_PREFIX = 5500
"""GET requests a second S3 serves per partitioned prefix (its documented rate)."""


def plan(
    path: str | os.PathLike[str],
    world_size: int,
    tokens_per_s: float,
    window: int | None = 4097,
    storage_options: dict[str, Any] | None = None,
    *,
    metadata: bool = False,
    shuffle_block: int = 1,
    batch_size: int | None = None,
) -> dict[str, Any]:
    """The ranged GETs a training run will ask of a store, per prefix.

    A globally shuffled read touches every sample equally often, so each prefix
    (the directory of a data file: a build's chunk, ``parts/<chunk>/``, or the
    folder of a Megatron prefix or flat file) serves GETs in proportion to the
    samples it holds: the rows of its files, and for windows the GET more each
    file start costs the windows that run into it; its documents, for
    documents.  The run consumes ``tokens_per_s`` tokens a second on each
    of ``world_size`` ranks, as windows of ``window`` tokens (one GET per file a
    window runs across) or, with ``window=None``, as whole documents (one GET
    each, one more for its index entry when the document index is not held in
    memory).  With ``metadata``, windows read with their metadata
    (``StreamWithMetadata``, metadata layout ``"blocks"``): each window also
    reads its metadata blocks, one GET per file as for the rows, and one more
    for their index entries when the block index is not held in memory.
    Works on a local dataset too (planning an upload).  An upper bound: requests
    of one reader task that fall close together in a file are merged into one
    GET (``ReadOptions``), which on a small dataset saves many.

    With ``shuffle_block`` (the ``DataLoader``'s, ``K > 1``) and the run's
    ``batch_size`` (required then), the samples of a block are neighbours in
    the files: each rank reads ``K / world_size`` of a block's, every
    ``world_size``-th, and where the gap between two of them (``world_size - 1``
    samples' bytes) is at most the store's ``merge_gap`` they come in one GET
    (one run a block, and one more a reader task: ``steps_per_task`` steps of
    ``batch_size`` samples start inside a block). Where a rank gets one sample
    a block or fewer, or the gap is wider, blocks save no GET, and ``reading``
    says so. An estimate from the average sample, not a bound.

    Returns a dict: ``gets_per_s`` (the whole run), ``gets_per_sample``,
    ``tokens_per_sample``, ``prefixes`` (``{prefix: GETs/s}``, busiest first),
    ``busiest`` (its share of ``S3_GETS_PER_PREFIX``) and ``prefixes_needed``
    (at ``S3_GETS_PER_PREFIX`` each).
    """
    from tokload._meta import BlockSet
    from tokload.views.base import open_source

    world_size = positive_integer("world_size", world_size, UsageError)
    if (
        isinstance(tokens_per_s, bool)
        or not isinstance(tokens_per_s, (int, float, np.integer, np.floating))
        or not 0 < tokens_per_s < math.inf
    ):
        raise UsageError(f"tokens_per_s must be a positive finite number, got {tokens_per_s!r}")
    if window is not None:
        window = positive_integer("window", window, UsageError)
    if metadata and window is None:
        raise UsageError("plan: metadata is read with windows (StreamWithMetadata), not documents")
    shuffle_block = positive_integer("shuffle_block", shuffle_block, UsageError)
    if batch_size is not None:
        batch_size = positive_integer("batch_size", batch_size, UsageError)
    elif shuffle_block > 1:
        raise UsageError(
            "plan: with shuffle_block, give the batch size too: the GETs a block saves "
            "depend on how many samples a reader task holds"
        )
    src = open_source(os.fspath(path), storage_options)
    try:
        paths = list(src.rows.files.paths)
        cum = np.asarray(src.rows.cum, dtype=np.float64)
        rows = np.diff(cum)
        total = float(cum[-1])
        nonempty = max(int((rows > 0).sum()), 1)  # files with rows
        if total == 0:
            raise UsageError(f"{path}: the dataset has no rows: there is nothing to read")
        if window is None:
            if src.docs is None:
                raise UsageError(
                    f"{path}: has no document boundaries to read documents by: plan it as "
                    "windows (without --documents; window=N in Python)"
                )
            per_sample = total / max(src.num_documents, 1)
            held = _index_in_memory(src.docs)
            gets_per_sample = 1.0 if held else 2.0
            # a GET (two) per document: each file's share is its share of the documents
            counts = (
                np.asarray([s.documents for s in src.manifest.shards], dtype=np.float64)
                if src.manifest is not None and len(src.manifest.shards) == len(paths)
                else rows
            )
            share = counts / max(float(counts.sum()), 1.0) * gets_per_sample
            reading = f"documents of {per_sample:,.0f} tokens on average" + (
                "" if held else " (and an index entry each: the index is not held in memory)"
            )
        else:
            if window > total:
                raise UsageError(
                    f"{path}: a window of {window:,} tokens is longer than the dataset's "
                    f"{total:,.0f}: it has no sample to read"
                )
            per_sample = float(window)
            # a window takes one GET more for each of the nonempty - 1 boundaries
            # between files it runs across: each is crossed by the windows that
            # start in the window - 1 rows before it (files shorter than a window:
            # several a window)
            gets_per_sample = 1.0 + (window - 1) * (nonempty - 1) / total
            # each file's share: the windows that start in it, and those that run
            # into it from the files before (a file start costs the window - 1 rows
            # before it a GET more, in that file)
            later = np.cumsum(rows > 0) > 1
            share = (rows + (window - 1) * (later & (rows > 0))) / total
            reading = f"windows of {window:,} tokens"
            if metadata:
                blocks = src.spans
                if not isinstance(blocks, BlockSet):
                    raise UsageError(
                        f"{path}: plan counts the metadata reads of layout 'blocks' (what "
                        "tokload build and Writer write by default), and this dataset has "
                        + (
                            f"layout {src.manifest.metadata_layout!r}: convert it "
                            "(tokload convert SRC DST --layout blocks)"
                            if src.manifest is not None and src.manifest.metadata
                            else "no metadata"
                        )
                    )
                # the blocks sit in a file per shard as the rows do (one GET per
                # file a window runs across), their index entries in another
                held = _index_in_memory(blocks)
                gets_per_sample *= 2.0 if held else 3.0
                share *= 2.0 if held else 3.0
                reading += " with their metadata" + (
                    "" if held else " (and index entries: the block index is not held in memory)"
                )
        if shuffle_block > 1:
            assert batch_size is not None
            extra = 0.0 if window is not None or held else 1.0  # a document's index entry
            blocked, why = _in_blocks(
                shuffle_block,
                world_size,
                batch_size * ReadOptions().steps_per_task,
                per_sample,
                src.dtype.itemsize,
                split_options(storage_options)[0].merge_gap,
                (gets_per_sample - extra, extra),
                (nonempty - 1) / total,
            )
            share *= blocked / gets_per_sample
            gets_per_sample = blocked
            reading += f", shuffled in blocks of {shuffle_block:,}" + why
    finally:
        src.close()
    samples = world_size * tokens_per_s / per_sample
    gets = samples * gets_per_sample
    by_prefix: dict[str, float] = {}
    for p, part in zip(paths, share.tolist(), strict=True):
        prefix = p.rsplit("/", 1)[0] + "/" if "/" in p else "./"
        by_prefix[prefix] = by_prefix.get(prefix, 0.0) + samples * part
    ordered = dict(sorted(by_prefix.items(), key=lambda kv: -kv[1]))
    busiest = max(ordered.values(), default=0.0)
    return {
        "dataset": os.fspath(path),
        "reading": reading,
        "world_size": world_size,
        "tokens_per_s": tokens_per_s,
        "tokens_per_sample": per_sample,
        "gets_per_sample": gets_per_sample,
        "gets_per_s": gets,
        "prefixes": ordered,
        "busiest": busiest / S3_GETS_PER_PREFIX,
        # as many as the GETs need spread evenly, and more than hold them now
        # where they are not (the busiest over the limit)
        "prefixes_needed": max(
            1,
            math.ceil(gets / S3_GETS_PER_PREFIX),
            math.ceil(len(ordered) * busiest / S3_GETS_PER_PREFIX - 1e-9),
        ),
    }


def _in_blocks(
    block: int,
    world: int,
    per_task: int,
    sample_rows: float,
    itemsize: int,
    merge_gap: int,
    gets: tuple[float, float],
    crossings_per_row: float,
) -> tuple[float, str]:
    """``plan``'s GETs per sample with ``shuffle_block=block`` (see ``plan``):
    ``gets`` are a sample's without blocks (its rows, and its index entry or
    none), ``per_task`` a rank's samples in a reader task, ``crossings_per_row``
    the file starts a row of the data meets. Returns the GETs and what
    ``reading`` adds."""
    rows_gets, entry_gets = gets
    per_rank = block / world  # a rank's samples in a block
    if per_rank <= 1:
        return rows_gets + entry_gets, (
            f" (which saves no GET: a rank reads {per_rank:.2g} sample of a block; "
            "a block of many more samples than ranks does)"
        )
    gap = (world - 1) * sample_rows * itemsize
    if gap > merge_gap:
        return rows_gets + entry_gets, (
            f" (which saves no GET: the {world - 1:,} samples between two of a rank's, "
            f"{gap:,.0f} bytes, are more than merge_gap, {merge_gap:,})"
        )
    runs = 1 / per_rank + 1 / per_task  # a run a block, one more a task
    run_rows = ((per_rank - 1) * world + 1) * sample_rows  # what one run's GET spans
    per_run = 1 + (run_rows - 1) * crossings_per_row  # and the file starts it meets
    entries = runs if entry_gets else 0.0  # neighbours' index entries: one GET a run
    return min(rows_gets, runs * per_run) + min(entry_gets, entries), ""


def _index_in_memory(docs: Any) -> bool:
    if hasattr(docs, "in_memory"):  # a Megatron prefix's sequence extents
        return bool(docs.in_memory)
    tables = getattr(docs, "tables", None)  # a tokload build's document index
    return bool(getattr(tables, "enabled", False))


def plan_table(result: dict[str, Any], show: int = 8) -> str:
    """``plan``'s result as the command prints it."""
    r = result
    pre = r["prefixes"]
    lines = [
        f"dataset       {r['dataset']}",
        f"reading       {r['reading']}",
        f"rate          {r['world_size']} ranks x {r['tokens_per_s']:,.0f} tokens/s = "
        f"{r['world_size'] * r['tokens_per_s']:,.0f} tokens/s",
        f"GETs          {r['gets_per_s']:,.0f}/s ({r['gets_per_sample']:.2f} per sample)",
        f"prefixes      {len(pre)} hold the data; the busiest serves "
        f"{max(pre.values(), default=0):,.0f} GETs/s = {r['busiest']:.0%} of S3's "
        f"{S3_GETS_PER_PREFIX:,}/s per prefix",
    ]
    for k, (prefix, g) in enumerate(pre.items()):
        if k == show:
            lines.append(f"  ... {len(pre) - show} more")
            break
        lines.append(f"  {g:>10,.0f}/s  {prefix}")
    if r["busiest"] > 1:
        advice = (
            f"the data needs {r['prefixes_needed']} prefixes or more at "
            f"{S3_GETS_PER_PREFIX:,} GETs/s each, spread evenly: a build published with "
            "'tokload build -o s3://...' puts each chunk under its own prefix "
            "(parts/<chunk>/), so build it in that many chunks or more (--chunk-size); "
            "S3 answers what is over with 503 SlowDown, which tokload retries"
        )
        wrapped = textwrap.wrap(advice, 88 - 14)
        lines.append("too many      " + wrapped[0])
        lines.extend(" " * 14 + w for w in wrapped[1:])
    else:
        lines.append(f"ok            within S3's {S3_GETS_PER_PREFIX:,} GETs/s per prefix")
    return "\n".join(lines)


_LAYOUT_NAMES = {
    "blocks": "metadata blocks of {} rows",
    "spans": "span table",
    "per_token": "an id per row",
}


def verify(
    path: str | os.PathLike[str], chunk_rows: int = 1 << 22, *, deep: bool = False
) -> list[str]:
    """Check every file of a dataset; returns the problems found (empty: sound).

    Checks, reading the files: sizes against the manifest; each shard's rows can
    be read; each document index starts at 0, never decreases and ends at the
    shard's rows; each
    metadata index starts at 0, never decreases and ends at the data size;
    every row's metadata id is a record of its shard (or none). With
    ``deep=True``, first recomputes every file's checksum against the one the
    manifest records (``tokload.checksum.verify_checksums``), which reads
    all the data and names the first damaged file.

    Raises:
        UsageError: ``path`` is a token file or a Megatron prefix, not a
            tokload dataset.
    """
    _a_tokload_dataset(path, "verify")
    if deep:
        from tokload.checksum import verify_checksums

        try:
            damaged = verify_checksums(path)
        except (TokloadError, OSError) as e:
            return [error_message(e)]
        if damaged:
            return damaged
    problems: list[str] = []
    try:
        src = open_dataset(path)
    except (TokloadError, OSError) as e:
        return [error_message(e)]
    m = src.manifest
    assert m is not None
    try:
        problems = _verify_shards(Location(path), m, chunk_rows)
    except (TokloadError, OSError) as e:  # (a file that cannot be read: the problem)
        problems = [error_message(e)]
    src.close()
    return problems


def _verify_shards(loc: Location, m: Manifest, chunk_rows: int) -> list[str]:
    """``verify``'s checks of the shards' files: the first problem found, or none;
    a file that cannot be read raises."""
    problems: list[str] = []
    for s in m.shards:
        base = loc.join(s.name)
        if s.rows:  # (readable: the rows themselves are not read but by --deep)
            loc.read(base + ".rows", "shard rows", 0, m.dtype.itemsize)
        if m.documents:
            p = base + ".docs"
            bad = _first_bad_offset(_array(loc, p, "<u8", "document index"), s.rows)
            if bad is not None:
                problems.append(
                    f"{p}: document index entry {bad[0]} = {bad[1]} breaks "
                    f"0 = first <= ... <= last = {s.rows} (the shard's rows)"
                )
        if m.blocks:
            problem = _check_blocks(loc, base, s.rows, s.metadata_records, m.span_block)
            if problem is not None:
                problems.append(problem)
                break
            continue
        if m.metadata:
            p = base + ".mdx"
            bad = _first_bad_offset(_array(loc, p, "<u8", "metadata index"), s.metadata_bytes)
            if bad is not None:
                problems.append(
                    f"{p}: metadata index entry {bad[0]} = {bad[1]} breaks 0 = "
                    f"first <= ... <= last = {s.metadata_bytes} (the data size)"
                )
            if m.spans:
                problem = _check_spans(
                    loc, base, s.rows, s.metadata_records, m.span_block, chunk_rows
                )
                if problem is not None:
                    problems.append(problem)
                    break
                continue
            rows_path = base + ".rows"
            for start in range(0, s.rows, chunk_rows):
                stop = min(s.rows, start + chunk_rows)
                item = m.dtype.itemsize
                rows = np.frombuffer(
                    loc.read(rows_path, "shard rows", start * item, stop * item), m.dtype
                )
                ids = rows[METADATA_FIELD]
                bad_rows = np.flatnonzero((ids != 0xFFFFFFFF) & (ids >= s.metadata_records))
                if len(bad_rows):
                    r = int(bad_rows[0])
                    problems.append(
                        f"{rows_path}: row {r + start} has metadata id {int(ids[r])}"
                        f", but the shard has {s.metadata_records} records"
                    )
                    break
        if problems:
            break  # the first problem is what a user needs; verify again after fixing it
    return problems


def _array(loc: Location, path: str, dtype: Any, what: str) -> np.ndarray:
    """A whole file (or object) as an array."""
    return np.frombuffer(loc.read(path, what), dtype)


def _check_blocks(loc: Location, base: str, rows: int, records: int, block: int) -> str | None:
    """The first problem of a shard's metadata blocks (FORMAT.md, version 3), or
    None: the block index, and every block's counts, run starts, records and
    record ends, checked by decoding the shard's blocks."""
    from tokload._meta import decode_blocks

    index = base + ".mbx"
    msb = base + ".msb"
    try:
        decode_blocks(
            block,
            rows,
            records,
            _array(loc, index, "<u8", "metadata block index"),
            _array(loc, msb, np.uint8, "metadata blocks"),
            str(index),
            str(msb),
            records=False,
        )
    except TokloadError as e:
        return str(e)
    return None


_RUN = np.dtype([("start", "<u8"), ("record", "<u4")])  # one .mds entry, 12 bytes packed


def _check_spans(
    loc: Location, base: str, rows: int, records: int, block: int, chunk_rows: int
) -> str | None:
    """The first problem of a shard's span table (FORMAT.md, version 2), or None.

    ``.mds``: starts begin at 0, strictly increase, stay below ``rows``; records
    are below ``records`` or none. ``.msx``: value ``b`` is the run holding row
    ``b * block``, the last value is the number of runs. Read in chunks.
    """
    mds = base + ".mds"
    if loc.remote:
        runs = _array(loc, mds, _RUN, "span table")
    else:
        runs = np.memmap(mds, dtype=_RUN, mode="r") if os.path.getsize(mds) else np.zeros(0, _RUN)
    n = len(runs)
    if rows and (n == 0 or int(runs[0]["start"]) != 0):
        return f"{mds}: the first run must start at row 0 (the shard has {rows} rows)"
    prev = -1
    for at in range(0, n, chunk_rows):
        part = runs[at : at + chunk_rows]
        starts = np.asarray(part["start"]).astype(np.int64)
        recs = np.asarray(part["record"])
        steps = np.diff(starts, prepend=prev)
        bad = np.flatnonzero((steps <= 0) | (starts >= rows))
        if len(bad):
            k = int(bad[0])
            return (
                f"{mds}: run {at + k} starts at row {int(starts[k])}, which breaks "
                f"0 = first < ... < {rows} (the shard's rows)"
            )
        bad = np.flatnonzero((recs != 0xFFFFFFFF) & (recs >= records))
        if len(bad):
            k = int(bad[0])
            return (
                f"{mds}: run {at + k} has record {int(recs[k])}, but the shard has "
                f"{records} records"
            )
        prev = int(starts[-1])
    msx = base + ".msx"
    index = _array(loc, msx, "<u8", "span block index")
    want = -(-rows // block)
    if len(index) != want + 1 or (len(index) and int(index[-1]) != n):
        return f"{msx}: {len(index)} values, need {want + 1} ending with the {n} runs"
    if n:
        all_starts = np.asarray(runs["start"]).astype(np.int64)
        holds = np.searchsorted(all_starts, np.arange(want, dtype=np.int64) * block, "right") - 1
        bad = np.flatnonzero(index[:-1].astype(np.int64) != holds)
        if len(bad):
            b = int(bad[0])
            got, run = int(index[b]), int(holds[b])
            return f"{msx}: value {b} is {got}, but row {b * block} is in run {run}"
    return None


def error_message(e: BaseException) -> str:
    """An error as one line that starts with the file it names, when it names one."""
    if isinstance(e, OSError) and e.filename is not None and e.strerror:
        return f"{e.filename}: {e.strerror}"
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def _first_bad_offset(offsets: np.ndarray, last: int) -> tuple[int, int] | None:
    """The first (entry, value) of an offset index that is not 0, non-decreasing, ``last``."""
    if offsets[0] != 0:
        return 0, int(offsets[0])
    # an entry past the end is at fault, not the entry after it that goes down
    bad = np.flatnonzero((offsets[1:] < offsets[:-1]) | (offsets[1:] > last))
    if len(bad):
        return int(bad[0]) + 1, int(offsets[bad[0] + 1])
    if offsets[-1] != last:
        return len(offsets) - 1, int(offsets[-1])
    return None


def bench(
    path: str | os.PathLike[str],
    seconds: float = 5.0,
    window: int = 4097,
    batch_size: int = 8,
    num_threads: int | None = None,
) -> dict[str, Any]:
    """Stream a dataset's token stream through the DataLoader for ``seconds``.

    Returns the time to open the dataset (``open_s``), from then to the first
    batch (``first_batch_s``: loader start-up and the first reads), and the
    steady rate after it (``tokens_per_s``, over ``batches`` batches). The
    time to import the loader and torch (``import_s``; 0 when already imported)
    is measured apart: it is not tokload's own.
    """
    t_import = time.perf_counter()
    import torch  # noqa: F401 - imported here so that no timing below includes it

    from tokload.loader import DataLoader
    from tokload.views import TokenStream

    t0 = time.perf_counter()
    # (windows of window - 1 targets: each starts at the last token of the one before)
    view = TokenStream(path, window=window, stride=max(window - 1, 1))
    t_open = time.perf_counter()
    if not len(view):
        rows = view.source.num_rows
        view.close()
        if not rows:
            raise UsageError(f"{path}: the dataset has no rows: there is nothing to read")
        raise UsageError(
            f"{path}: holds {rows:,} tokens, no window of {window:,}: give a smaller --window"
        )
    # this process alone, whatever a launcher (torchrun) says of the others
    loader = DataLoader(view, batch_size, seed=0, num_threads=num_threads, rank=0, world_size=1)
    try:
        it = iter(loader)
        next(it)
        t_first = time.perf_counter()
        n = 0
        while time.perf_counter() - t_first < seconds:
            next(it)
            n += 1
        elapsed = time.perf_counter() - t_first
    finally:
        loader.close()
    return {
        "import_s": t0 - t_import,
        "open_s": t_open - t0,
        "first_batch_s": t_first - t_open,
        "time_to_first_batch_s": t_first - t0,
        "batches": n,
        "tokens_per_s": n * batch_size * window / elapsed,
        "window": window,
        "batch_size": batch_size,
        "threads": loader.num_threads,
    }


def process_age(at: float | None = None) -> float | None:
    """Seconds from this process's start to ``at`` (a ``time.perf_counter()`` value;
    default now): Python's start-up and the imports before ``at``. ``None`` where
    ``/proc`` cannot tell (resolution: one clock tick, usually 10 ms)."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        age = uptime - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None
    if at is not None:
        age -= time.perf_counter() - at
    return max(age, 0.0)


def bench_table(path: str | os.PathLike[str], r: dict[str, Any]) -> str:
    """The result of ``bench`` (and ``startup_s``, if there) as a readable table."""

    def ms(seconds: float) -> str:
        return f"{seconds * 1e3:10.1f} ms"

    rows = [
        f"tokload bench {path}: window {r['window']}, batch {r['batch_size']}, "
        f"{r['threads']} reader thread{'' if r['threads'] == 1 else 's'}",
    ]
    if r.get("startup_s") is not None:
        rows.append(
            f"  start-up (Python, tokload)  {ms(r['startup_s'])}   imports, not tokload's work"
        )
    rows += [
        f"  import torch and the loader {ms(r['import_s'])}   imports, not tokload's work",
        f"  open the dataset            {ms(r['open_s'])}",
        f"  first batch                 {ms(r['first_batch_s'])}",
        f"  steady rate                 {r['tokens_per_s'] / 1e6:10.1f} M tokens/s "
        f"({r['batches']:,} batches)",
    ]
    return "\n".join(rows)


__all__ = [
    "bench",
    "bench_table",
    "error_message",
    "inspect",
    "plan",
    "plan_table",
    "process_age",
    "verify",
]
