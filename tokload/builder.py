"""From raw text to a dataset: ``tokload build`` as a function.

Inputs (JSONL, optionally gzip/bz2/xz/zstd-compressed; Parquet; or any other
file as one plain-text document) are expanded, sorted, and split into chunks
(``tokload.build_plan``). Chunk ``c`` of input ``i`` is built, by whichever
worker process, ``--part`` job or Ray task takes it, into its own dataset
``OUT/parts/iiiii-ccccc`` (shards named ``in{i:05d}-{c:05d}-*``;
``tokload.build_part``, reading it with ``tokload.build_records``), written in
a temporary directory and renamed when complete. So the same inputs always
give the same files, whatever the number of workers or machines.

This module runs a build: it checks the output directory and reuses the
chunks that are current (``tokload.build_output``), runs the others in worker
processes or Ray tasks (each tokenizer gets ``cores // workers`` threads, so
they do not oversubscribe the machine), checks how many records were skipped,
and writes the top-level manifest. That manifest is removed before any chunk
changes and written last, so it never lists a chunk that is missing or stale.
A ``tokenizer.json`` is copied into the dataset (``OUT/tokenizer.json``), so
the dataset can be decoded wherever it travels.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import hashlib
import multiprocessing as mp
import os
import signal
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tokload.arguments import is_integer, positive_integer
from tokload.build_output import (
    MARKER_TEXT,
    PARTS,
    OutputLock,
    StaleChunks,
    check_output,
    ours,
    remove_dir,
    remove_temporaries,
    stale_parts,
    up_to_date,
)
from tokload.build_part import build_chunk
from tokload.build_plan import (
    DEFAULT_CHUNK_BYTES,
    BuildOptions,
    Chunk,
    parse_part,
    plan_chunks,
    plan_record,
)
from tokload.build_records import NO_TEXT
from tokload.errors import BuildError, UsageError
from tokload.format import (
    DEFAULT_METADATA_LAYOUT,
    FORMAT_VERSION,
    MANIFEST,
    Manifest,
    read_manifest,
    write_manifest,
)
from tokload.inputs import BUILD_MARKER, Found, find_inputs
from tokload.progress import DEFAULT_EVERY as DEFAULT_PROGRESS_EVERY
from tokload.progress import Progress
from tokload.source import open_dataset
from tokload.tokenizer import (
    TOKENIZER_FILE,
    copy_tokenizer,
    dataset_copy_is_current,
    dataset_record,
    describe_tokenizer,
    load_tokenizer,
    token_dtype,
    with_special_tokens,
)
from tokload.writer import checked_block

__all__ = [
    "BUILDER_VERSION",
    "BuildError",
    "BuildOptions",
    "BuildSummary",
    "Chunk",
    "UsageError",
    "build",
    "parse_part",
    "plan_chunks",
]


BUILDER_VERSION = 4  # 4: metadata in blocks (format version 3)
"""Bumped whenever the builder would write different bytes for the same input and options."""

DEFAULT_MAX_SKIPPED = 0.1


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
    bytes: int = 0  # the shards' files
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


def _listed(value: Any) -> list[Any]:
    """A list of the paths or names given: one given alone is a list of one."""
    if isinstance(value, (str, bytes, os.PathLike)):
        return [value]
    return list(value)


def _special(what: str, value: bool | str) -> tuple[str | None, bool]:
    """``bos=``/``eos=``: the token's text (``None``: the tokenizer's own) and whether
    to add it."""
    if isinstance(value, str):
        if not value:
            raise UsageError(f"{what} must be True, False or a token's text, got ''")
        return value, True
    if not isinstance(value, bool):
        raise UsageError(f"{what} must be True, False or a token's text, got {value!r}")
    return None, value


def build(
    inputs: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
    output: str | os.PathLike[str],
    *,
    text_field: str = "text",
    keep_fields: Sequence[str] = (),
    annotations_field: str | None = None,
    tokenizer: str | os.PathLike[str] = "bytes",
    bos: bool | str = False,
    eos: bool | str = True,
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
        inputs: files, globs or directories, or one of them (see
            ``tokload.inputs``): a file
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
        bos: add the tokenizer's BOS token before each document; a string
            names the token to add instead (its text in the vocabulary).
        eos: add the tokenizer's EOS token after each document; a string
            names the token to add instead (``"<|eot_id|>"``).
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
            there from other inputs. A URL ``output`` is checked by the same
            rules, for the objects under it (``tokload.publish.check_store``).
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
    # one path or name given alone, not its characters ('a.jsonl' is not 'a', '.', ...)
    inputs = _listed(inputs)
    keep_fields, include, exclude = _listed(keep_fields), _listed(include), _listed(exclude)
    if on_error not in ("stop", "skip"):
        raise UsageError(f"on_error must be 'stop' or 'skip', got {on_error!r}")
    if not is_integer(workers) or workers < 1:
        raise UsageError(f"workers must be an integer >= 1, got {workers!r}")
    positive_integer("shard_bytes", shard_bytes, UsageError)
    positive_integer("chunk_bytes", chunk_bytes, UsageError)
    if not 0 <= max_skipped <= 1:
        raise UsageError(f"max_skipped must be a fraction from 0 to 1, got {max_skipped}")
    k, n = parse_part(part)
    say = log if log is not None else _quiet
    from tokload import remote

    url = remote.normalize(os.fspath(output)) if remote.is_url(output) else None
    if url is not None:
        if ray is not None and ray is not False:
            raise UsageError(f"{url}: --ray builds need an output every node sees, not a URL")
        if staging is None:
            digest = hashlib.sha256(url.rstrip("/").encode()).hexdigest()[:16]
            staging = Path.home() / ".cache" / "tokload" / "build" / digest
        output = staging
    elif staging is not None:  # (it was ignored: the build ran in the output)
        raise UsageError(
            f"staging={os.fspath(staging)!r} is the local build directory of a URL output "
            f"(s3://...); the output {os.fspath(output)!r} is local: it is built there"
        )
    out = Path(remote.local_path(output))
    if out.exists() and not out.is_dir():
        raise UsageError(f"{out}: the output must be a directory (or not exist yet); it is a file")
    bos_token, bos = _special("bos", bos)
    eos_token, eos = _special("eos", eos)
    # fail early on a bad tokenizer, or a token it lacks
    tok = with_special_tokens(load_tokenizer(tokenizer), bos_token, eos_token)
    for flag, token_id, name in ((bos, tok.bos_id, "BOS"), (eos, tok.eos_id, "EOS")):
        if flag and token_id is None:
            hint = "--no-eos" if name == "EOS" else "no --bos"
            raise UsageError(
                f"the tokenizer {tok.name} has no {name} token that tokload recognizes; "
                f"name one with --{name.lower()}-token, build with {hint}, or use a "
                "tokenizer that has one"
            )
    say(describe_tokenizer(tok))
    found = find_inputs(inputs, output=out, include=include, exclude=exclude)
    files = found.files
    say(found.describe())
    if not files:
        raise UsageError(f"no input files ({_nothing_found(found)})")
    check_output(out, files, force)
    if url is not None:  # what the store holds, by the same rules (another machine's build)
        from tokload.publish import check_store

        check_store(url, files, force, PARTS, storage_options)
    # one build at a time writes an output: a second refused (each removed the
    # other's chunks in progress); the check again, as the other left the output
    lock = OutputLock(out)
    try:
        check_output(out, files, force)
        plan = plan_chunks(files, chunk_bytes)
        planned = plan_record(files, chunk_bytes, len(plan), (k, n))
        mine = plan[slice(*planned["span"])]
        (out / PARTS).mkdir(parents=True, exist_ok=True)
        (out / BUILD_MARKER).write_text(MARKER_TEXT)
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
            bos_token,
            eos_token,
        )
        base = {
            "builder": BUILDER_VERSION,
            "format_version": FORMAT_VERSION,
            "tokenizer": {key: tok_record.get(key) for key in ("kind", "sha256", "bos", "eos")},
            "dtype": token_dtype(tok.vocab_size).str,
            "options": opts.record(),
        }
        todo = [c for c in mine if not up_to_date(out / PARTS / c.name, base, c)]
        for c in todo:
            d = out / PARTS / c.name
            if d.exists() and not ours(d):
                raise UsageError(
                    f"{d}: a chunk of this build goes here, but the directory was not written by "
                    "tokload build; move it away, or build into another directory"
                )
        stale = stale_parts(out / PARTS, plan, mine)
        if todo or stale or not dataset_copy_is_current(tok, out):
            # From here on the dataset changes: no manifest may list it until the end.
            (out / MANIFEST).unlink(missing_ok=True)
        copy_tokenizer(tok, out)
        for d in stale:
            remove_dir(d)
        remove_temporaries(out / PARTS, [c.name for c in todo])  # (a killed run's)
        for c in todo:
            remove_dir(out / PARTS / c.name)
        say(
            f"{len(mine)} chunks: {len(todo)} to build, {len(mine) - len(todo)} reused"
            + (f", {len(stale)} stale removed" if stale else "")
        )
        publisher = None
        if url is not None:  # upload each chunk as it completes, while the others are built
            from tokload.publish import Publisher

            publisher = Publisher(
                out,
                url,
                PARTS,
                [c.name for c in mine],
                storage_options,
                stale=StaleChunks(plan, mine),
            ).start()
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
                    bar.update(*build_chunk(c, o, out_s, b, report=bar.update))
            else:
                _run_pool(tasks, min(workers, len(todo)), bar.update)
        except BaseException:
            remove_temporaries(out / PARTS, [c.name for c in todo])
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
                _check_yield(documents, skipped, max_skipped, text_field, whole=n == 1)
            manifest = _assemble(out, opts, tok_record, tok.vocab_size, files, mine, planned)
            try:
                open_dataset(out).close()  # the manifest agrees with the files (sizes: cheap)
            except BaseException:
                (out / MANIFEST).unlink(missing_ok=True)  # a failed build leaves none
                raise
        except BaseException:
            if publisher is not None:
                publisher.finish(ok=False)
            raise
        summary.documents = manifest.num_documents
        summary.tokens = manifest.rows
        summary.shards = len(manifest.shards)
        # (the shards' files only: with --force the output may hold files of the user's)
        summary.bytes = sum(
            (out / f"{sh.name}.{ext}").stat().st_size
            for sh in manifest.shards
            for ext in manifest.files()
        )
        summary.skipped = dict(skipped)
        if publisher is not None:
            summary.published = publisher.finish()
        summary.seconds = time.perf_counter() - t0
        return summary
    finally:
        lock.release()


def _quiet(line: str) -> None:
    pass


def _nothing_found(found: Found) -> str:
    if not found.passed_over:
        return "the directories given are empty"
    return (
        "passed over "
        + "; ".join(f"{n} {reason}" for reason, n in sorted(found.passed_over.items()))
        + "; name files explicitly, or choose them with --include"
    )


def _check_yield(
    documents: int,
    skipped: Counter[str],
    max_skipped: float,
    text_field: str,
    *,
    whole: bool = True,
) -> None:
    """Fail a build that made no documents, or skipped more than ``max_skipped`` of them.

    A part of a split build (not ``whole``) may make none: its inputs may be empty
    files that the whole corpus holds beside others (the merge has every part's)."""
    bad = sum(skipped.values())
    reasons = ", ".join(f"{r}: {n}" for r, n in skipped.most_common())
    if documents == 0 and (whole or bad):
        why = f"all {bad} records were skipped ({reasons})" if bad else "the inputs are empty"
        hint = (
            f"; is the text in another field than {text_field!r}? (--text-field)"
            if skipped.get(NO_TEXT)
            else ""
        )
        raise BuildError(f"the build produced no documents: {why}{hint}")
    if bad and bad / (documents + bad) > max_skipped:
        raise BuildError(
            f"skipped {bad} of {documents + bad} records ({bad / (documents + bad) * 100:.3g}%; "
            f"{reasons}), more than the {max_skipped * 100:.3g}% allowed; fix the inputs or "
            "options, or allow more with --max-skipped (the chunks built are kept and reused)"
        )


def _assemble(
    out: Path,
    opts: BuildOptions,
    tok_record: dict[str, Any],
    vocab_size: int,
    files: list[Path],
    mine: list[Chunk],
    planned: dict[str, Any],
) -> Manifest:
    """The top-level manifest: the chunks' shards in input and chunk order."""
    tdt = token_dtype(vocab_size)
    dtype: Any = [("token", tdt.str)] if opts.metadata else tdt
    m = Manifest(dtype=np.dtype(dtype), documents=True, metadata=opts.metadata)
    if opts.metadata:  # the chunks' Writer's layout (a part without chunks has none to copy)
        m.metadata_layout = DEFAULT_METADATA_LAYOUT
        m.span_block = checked_block(None, DEFAULT_METADATA_LAYOUT)
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
        # (absolute, links as named: a merge tells parts that read one file apart)
        "input_files": [os.path.abspath(files[i]) for i in touched],
        "input_range": [touched[0], touched[-1] + 1] if touched else [0, 0],
        "chunk_range": [mine[0].input, mine[0].index, mine[-1].input, mine[-1].index + 1]
        if mine
        else [],
        "plan": planned,
    }
    write_manifest(out, m)
    return m


# ---- local worker processes -------------------------------------------------------------


def _run_pool(tasks: list[tuple[Any, ...]], workers: int, update: Callable[..., None]) -> None:
    """Run ``build_chunk`` over ``tasks`` in ``workers`` processes; stop them all on any error.

    The workers are started with SIGINT ignored (an ignored signal stays ignored
    across ``exec``, and Python then installs no handler of its own), so a
    Ctrl+C sent to the whole process group reaches only this process, which
    terminates them: no worker prints a traceback, none outlives the build.
    SIGINT is blocked meanwhile, so one that arrives while they start stays
    pending here (Linux keeps a blocked signal pending even while ignored)
    and is raised as soon as they have started. A SIGINT this process ignores
    (as inherited) is left ignored. Workers report the bytes they have read
    through a queue, so the progress bar moves within chunks.
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
        pool = ctx.Pool(
            workers, initializer=_init_worker, initargs=(progress, threads, os.getpid())
        )
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
    # A SIGINT ignored on entry (a job started with `&` by a shell without job
    # control, which ignores SIGINT for it) stays ignored, as in a one-process build.
    interrupted = threading.Event()
    old_sigint = None
    catch = main_thread and signal.getsignal(signal.SIGINT) is not signal.SIG_IGN
    if catch:
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
        if catch:
            signal.signal(signal.SIGINT, old_sigint)
    pool.close()
    pool.join()


_REPORT: Callable[[int, int, int], None] | None = None


def _set_threads(threads: int) -> None:
    """Size the tokenizer's thread pool (read once, at its first parallel batch)."""
    os.environ.setdefault("RAYON_NUM_THREADS", str(threads))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true" if threads > 1 else "false")


def _init_worker(progress: Any, threads: int, parent: int) -> None:
    global _REPORT
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with(parent)
    _set_threads(threads)
    _REPORT = lambda *counts: progress.put(counts)  # noqa: E731


_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _die_with(parent: int) -> None:
    """On Linux, have the kernel kill this worker when the build process dies (a
    ``kill -9`` included, which leaves it no time to stop its pool): an orphan
    would finish its chunk and rename it into the output outside the build's
    lock. Elsewhere nothing changes (a killed build's workers finish their chunk)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return
    prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # it died before the call
        os._exit(1)


def _build_task(task: tuple[Chunk, BuildOptions, str, dict[str, Any]]) -> tuple[int, int, int]:
    chunk, opts, out_s, base = task
    return build_chunk(chunk, opts, out_s, base, report=_REPORT)


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
    return build_chunk(chunk, opts, out_s, base)
