"""The ``tokload`` command line.

Exit codes: 0 success; 1 the data is bad (a build error, ``verify`` found a
problem, a dataset or input that cannot be opened); 2 the command line is
wrong; 130 interrupted (Ctrl+C); 141 the reader of the output went away (a
closed pipe, as the shell reports SIGPIPE). Every error is one line on stderr naming the
problem; ``--debug`` (or ``TOKLOAD_DEBUG_CLI=1``) shows the traceback instead.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any, NoReturn

from tokload.errors import TokloadError, UsageError

_DEBUG_ENV = "TOKLOAD_DEBUG_CLI"


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (and the hint where to look), exit 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


class _Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults shown after each option's help (except where there is none to show);
    descriptions and examples kept as written."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        help = action.help or ""
        if (
            action.default in (None, [], argparse.SUPPRESS)
            or isinstance(action.default, bool)
            or "(default" in help
        ):
            return action.help
        return super()._get_help_string(action)


def _count(minimum: int) -> Any:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    return parse


def _positive(what: str) -> Callable[[str], float]:
    """A parser of positive finite numbers; ``what`` names them in errors."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a {what}") from None
        if not value > 0 or value == float("inf"):
            raise argparse.ArgumentTypeError(f"must be a positive {what}, got {text}")
        return value

    return parse


_seconds = _positive("number of seconds")
_rate = _positive("number")


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a fraction (e.g. 0.25)") from None
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"must be a fraction from 0 to 1, got {text}")
    return value


def _size(text: str) -> int:
    """``512M``, ``1G``, ``64k`` or a number of bytes."""
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    try:
        value = int(float(t[:-1]) * units[t[-1]]) if t and t[-1] in units else int(t)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a size (bytes, or with k/M/G/T, e.g. 512M)"
        ) from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be positive, got {text!r}")
    return value


def _part(text: str) -> str:
    from tokload.build_plan import parse_part

    try:
        parse_part(text)
    except UsageError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("part ")) from None
    return text


def _version() -> str:
    import tokload

    return f"tokload {tokload.__version__}"


def _parser() -> argparse.ArgumentParser:
    common = _Parser(add_help=False)
    common.add_argument(
        "--debug",
        action="store_true",
        default=argparse.SUPPRESS,
        help=f"show the traceback of an error, and what tokload decided on the way (where an "
        f"object store's credentials come from); also: {_DEBUG_ENV}=1",
    )
    p = _Parser(
        prog="tokload",
        description="Feeds tokens to LLM training: build, check and stream token datasets.",
        epilog="Exit codes: 0 ok, 1 bad data, 2 bad command line, 130 interrupted, 141 the "
        "reader of the output went away.\n"
        "Start with 'tokload demo', or 'tokload COMMAND --help'.",
        formatter_class=_Formatter,
        parents=[common],
    )
    p.add_argument("--version", action="version", version=_version())
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, help: str, description: str, example: str) -> argparse.ArgumentParser:
        return sub.add_parser(
            name,
            help=help,
            description=description,
            epilog="example:\n  " + example.replace("\n", "\n  "),
            formatter_class=_Formatter,
            parents=[common],
        )

    d = command(
        "demo",
        "build a sample corpus, stream it, check resume (no data needed)",
        "Build the top-level modules of Python's standard library into a dataset with "
        "metadata,\nverify it, stream it on 2 ranks, stop, resume on 3 ranks, and check "
        "every sample.",
        "tokload demo --workdir /tmp/tokload-demo",
    )
    d.add_argument("--seed", type=int, default=7, help="the shuffle's seed")
    d.add_argument("--workdir", help="where to build (default: a temporary directory, removed)")

    b = command(
        "build",
        "tokenize JSONL / Parquet / text files into a dataset",
        "Tokenize JSONL (.jsonl/.json/.ndjson, optionally .gz/.bz2/.xz/.zst), Parquet, or\n"
        "plain-text files into a tokload dataset. Every input is split into chunks built\n"
        "independently (OUTPUT/parts/IIIII-CCCCC): uncompressed JSONL into byte ranges of\n"
        "about --chunk-size that start at line starts, Parquet into runs of whole row\n"
        "groups; a compressed file (.gz, .bz2, .xz, .zst cannot be entered in the middle)\n"
        "and a plain-text file are one chunk each. The output is the same bytes whatever\n"
        "-j, --part or --ray.\n\n"
        "Re-running on the same OUTPUT rebuilds exactly the chunks whose input (path, size,\n"
        "modification time), tokenizer or options changed, reuses the others, and removes\n"
        "the chunks of inputs past the end of the input list. A tokenizer.json is copied\n"
        "into OUTPUT. Ctrl+C stops the build (exit 130) leaving no half-written chunk or\n"
        "manifest; the same command resumes from the finished chunks, also within one\n"
        "large file.",
        "tokload build data/*.jsonl.gz -o corpus --tokenizer tokenizer.json -j 8 \\\n"
        "    --keep-field id --annotations concepts --on-error skip\n"
        "# on a Ray cluster (inputs and OUTPUT on a shared filesystem):\n"
        "tokload build /shared/data -o /shared/corpus --tokenizer tokenizer.json --ray auto\n"
        "# in a Slurm array of 16 jobs, then joined by manifest:\n"
        "tokload build data -o part-$SLURM_ARRAY_TASK_ID --part $SLURM_ARRAY_TASK_ID/16\n"
        "tokload merge corpus part-{0..15}",
    )
    b.add_argument("inputs", nargs="+", help="files, globs or directories")
    b.add_argument(
        "-o",
        "--output",
        required=True,
        help="the dataset directory, or an object-store URL (s3://bucket/prefix: built in "
        "--staging, then uploaded, the manifest last)",
    )
    b.add_argument(
        "--staging",
        help="with a URL --output, the local build directory "
        "(default ~/.cache/tokload/build/<hash of the URL>)",
    )
    b.add_argument("--text-field", default="text", help="the field holding the text")
    b.add_argument(
        "--keep-field",
        action="append",
        default=[],
        dest="keep_fields",
        help="a per-document field kept as metadata (repeatable)",
    )
    b.add_argument(
        "--annotations",
        dest="annotations_field",
        help="a field with character-span annotations {start, end, ...}, kept as metadata",
    )
    b.add_argument(
        "--tokenizer",
        help="a tokenizer.json, a directory holding one, a Hugging Face name (gpt2, org/model: "
        "from the local Hugging Face cache, else downloaded), or 'bytes' (built in; the "
        "default, with a notice)",
    )
    b.add_argument("--bos", action="store_true", help="add BOS before each document")
    b.add_argument("--no-eos", dest="eos", action="store_false", help="no EOS after each document")
    b.add_argument(
        "--bos-token",
        metavar="TOKEN",
        help="add this token (its text in the vocabulary) before each document, in place of "
        "the tokenizer's BOS (implies --bos)",
    )
    b.add_argument(
        "--eos-token",
        metavar="TOKEN",
        help="end each document with this token (its text in the vocabulary, e.g. "
        "'<|eot_id|>') in place of the tokenizer's EOS",
    )
    b.add_argument(
        "-j",
        "--workers",
        type=_count(1),
        default=1,
        help="processes building chunks in parallel (each tokenizer gets cores/j threads)",
    )
    b.add_argument(
        "--part",
        type=_part,
        help="k/N: build only the k-th of N slices of all inputs' chunks (k from 0); "
        "'tokload merge' joins the parts",
    )
    b.add_argument(
        "--ray",
        nargs="?",
        const=True,
        default=None,
        metavar="ADDRESS",
        help="run the chunks as Ray tasks (pip install 'tokload[ray]'): on the cluster at "
        "ADDRESS ('auto': the one this machine belongs to), or, without ADDRESS, on "
        "RAY_ADDRESS's or a new local instance; inputs and OUTPUT on a shared filesystem",
    )
    b.add_argument(
        "--chunk-size",
        type=_size,
        default=32 << 20,
        dest="chunk_bytes",
        metavar="SIZE",
        help="split uncompressed JSONL and Parquet inputs into chunks of about this size "
        "(default: 32M)",
    )
    b.add_argument(
        "--on-error",
        choices=["stop", "skip"],
        default="stop",
        help="at a bad record: stop with its file:line, or skip it and count it per reason",
    )
    b.add_argument(
        "--max-skipped",
        type=_fraction,
        default=0.1,
        metavar="FRACTION",
        help="with --on-error skip: fail the build when more than this fraction of the records "
        "is skipped (default: 0.1); a build with no document always fails",
    )
    b.add_argument(
        "--include",
        action="append",
        default=[],
        metavar="GLOB",
        help="in directories, take the files matching GLOB (repeatable) instead of the data "
        "extensions (.jsonl/.json/.ndjson, compressed too, .parquet, .txt)",
    )
    b.add_argument(
        "--exclude",
        action="append",
        default=[],
        metavar="GLOB",
        help="leave out the files of directories and globs matching GLOB (repeatable)",
    )
    b.add_argument(
        "--force",
        action="store_true",
        help="build into a non-empty directory (or s3:// prefix) that holds no tokload build "
        "(its files stay as they are), or replace a dataset built there from other inputs",
    )
    b.add_argument(
        "--shard-size",
        type=_size,
        default=1 << 30,
        dest="shard_bytes",
        metavar="SIZE",
        help="shard size limit in bytes, or with k/M/G, e.g. 512M (default: 1G)",
    )
    b.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="progress: a bar when stderr is a terminal, else a line every "
        "--progress-every seconds (default: on)",
    )
    b.add_argument(
        "--progress-every",
        type=_seconds,
        default=30.0,
        metavar="SECONDS",
        help="seconds between progress lines when stderr is not a terminal (default: 30)",
    )

    m = command(
        "merge",
        "join datasets by manifest (no data is copied)",
        "Write OUTPUT/manifest.json listing the shards of every INPUT dataset, in order;\n"
        "no data is copied, so the inputs must stay where they are.",
        "tokload merge corpus part-0 part-1 part-2",
    )
    m.add_argument("output", help="the merged dataset's directory (must not hold a dataset)")
    m.add_argument("inputs", nargs="+", help="the datasets to join")
    m.add_argument(
        "--partial",
        action="store_true",
        help="merge parts of a --part k/N build although some are left out (the merged "
        "dataset lacks their documents); without it, such a merge is refused",
    )

    c = command(
        "convert",
        "copy a stream with metadata into another metadata layout",
        "Write DST, a copy of the dataset SRC whose metadata is in blocks of rows that\n"
        "hold their runs and records (--layout blocks, format version 3: one read per\n"
        "window, about 6 bytes per run of tokens plus the records), a span table per\n"
        "shard (--layout spans, version 2) or a metadata_id next to every token\n"
        "(--layout per_token, version 1). Tokens, documents and records are unchanged:\n"
        "every layout gives the same batches, bit for bit.",
        "tokload convert old-corpus corpus --layout blocks",
    )
    c.add_argument("src", help="the dataset to convert (it has metadata)")
    c.add_argument("dst", help="the new dataset's directory (must not hold a dataset)")
    c.add_argument(
        "--layout",
        choices=("blocks", "spans", "per_token"),
        default="blocks",
        help="the metadata layout",
    )
    c.add_argument(
        "--span-block",
        type=_count(1),
        default=None,
        metavar="ROWS",
        help="rows per metadata block (--layout blocks, default 4096, at most 65536) or "
        "per span-table index entry (--layout spans, default 1024)",
    )

    i = command(
        "inspect",
        "summarize a dataset and decode a sample",
        "Print a dataset's manifest summary (dtype, shards, documents, rows, metadata,\n"
        "fingerprint, tokenizer) and one document: its ids, decoded text and metadata.",
        "tokload inspect corpus --sample 12",
    )
    i.add_argument("path", help="the dataset directory")
    i.add_argument("--sample", type=_count(0), default=0, help="the document to show")

    v = command(
        "verify",
        "check every file; exit 1 naming the first problem",
        "Check a dataset's structure: every file's size against the manifest, every\n"
        "document and metadata index, every row's metadata id. With --deep, also\n"
        "recompute every file's checksum (reads all the data) and name the first damaged "
        "file.",
        "tokload verify corpus --deep",
    )
    v.add_argument("path", help="the dataset directory")
    v.add_argument("--deep", action="store_true", help="also recompute the checksums of every file")

    q = command(
        "plan",
        "the GETs/s a training run asks of an object store, per prefix",
        "Say, for a dataset (local, or s3://...), a number of ranks and the tokens each\n"
        "trains on per second, how many ranged GETs a second the run will send, how they\n"
        "spread over the prefixes that hold the data, and how many prefixes keep each\n"
        "under S3's 5,500 GETs/s.",
        "tokload plan s3://bucket/web --world-size 256 --tokens-per-s 20000",
    )
    q.add_argument("path", help="the dataset (directory, Megatron prefix, .npy file or URL)")
    q.add_argument(
        "--world-size", type=_count(1), required=True, help="ranks (GPUs) reading it at once"
    )
    q.add_argument(
        "--tokens-per-s",
        type=_rate,
        required=True,
        help="tokens each rank trains on per second",
    )
    q.add_argument(
        "--window", type=_count(2), default=None, help="tokens per sample window (default: 4097)"
    )
    q.add_argument(
        "--documents",
        action="store_true",
        help="samples are whole documents (Documents), not windows",
    )
    q.add_argument(
        "--metadata",
        action="store_true",
        help="windows read with their metadata (StreamWithMetadata; metadata layout blocks)",
    )
    q.add_argument(
        "--shuffle-block",
        type=_count(1),
        default=1,
        help="the DataLoader's shuffle_block (default 1: every sample shuffled on its own); "
        "needs --batch-size",
    )
    q.add_argument("--batch-size", type=_count(1), default=None, help="samples per rank and step")
    q.add_argument("--json", action="store_true", help="print JSON instead of a table")

    s = command(
        "bench",
        "stream a dataset through the DataLoader",
        "Stream a dataset's token stream through the DataLoader and report the start-up\n"
        "time (Python and imports), the time to open the dataset and to the first batch,\n"
        "and the steady rate in tokens/s.",
        "tokload bench corpus --seconds 10 --batch-size 16 --json",
    )
    s.add_argument("path", help="the dataset directory")
    s.add_argument("--seconds", type=_seconds, default=5.0, help="how long to stream")
    s.add_argument("--window", type=_count(2), default=4097, help="tokens per sample")
    s.add_argument("--batch-size", type=_count(1), default=8, help="samples per batch")
    s.add_argument(
        "--threads", type=_count(1), default=None, help="reader threads (default: the loader's)"
    )
    s.add_argument("--json", action="store_true", help="print JSON instead of a table")
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit code."""
    started = time.perf_counter()
    parser = _parser()
    args = parser.parse_args(argv)
    debug = getattr(args, "debug", False) or os.environ.get(_DEBUG_ENV) == "1"
    with _debug_log(debug):
        return _main(args, started, debug)


@contextlib.contextmanager
def _debug_log(debug: bool) -> Iterator[None]:
    """With ``--debug``: what tokload decided on the way (e.g. where an object store's
    credentials come from), as ``tokload debug: ...`` lines on stderr."""
    if not debug:
        yield
        return
    import logging

    logger = logging.getLogger("tokload")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("tokload debug: %(name)s: %(message)s"))
    old = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old)


def _main(args: argparse.Namespace, started: float, debug: bool) -> int:
    where = f"tokload {args.command}"
    try:
        return _run(args, started)
    except KeyboardInterrupt:
        what = (
            "; nothing half-written was kept, the same command resumes"
            if args.command == "build"
            else ""
        )
        print(f"{where}: interrupted{what}", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader of our output went away (`tokload inspect ds | head`): stop quietly,
        # and keep Python from reporting the same error when it flushes stdout at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except Exception as e:
        if debug:
            raise
        code, message = _describe(e)
        print(f"{where}: {message}", file=sys.stderr)
        return code


def _describe(e: Exception) -> tuple[int, str]:
    """(exit code, one line) for an error."""
    from tokload.tools import error_message

    if isinstance(e, UsageError):
        return 2, f"error: {e}"
    if isinstance(e, TokloadError | OSError):
        return 1, error_message(e)
    first = (str(e).strip().splitlines() or [""])[0]
    return 1, (
        f"unexpected {type(e).__name__}: {first} (a bug in tokload: rerun with --debug "
        "for the traceback and report it)"
    )


def _run(args: argparse.Namespace, started: float) -> int:
    if args.command == "demo":
        from tokload import _demo

        return _demo.run(seed=args.seed, workdir=args.workdir)
    if args.command == "build":
        from tokload.builder import build

        def log(line: str) -> None:
            print(f"tokload build: {line}", file=sys.stderr, flush=True)

        if not args.eos and args.eos_token is not None:
            raise UsageError("--no-eos and --eos-token contradict each other: give one")
        for flag, token in (("--bos-token", args.bos_token), ("--eos-token", args.eos_token)):
            if token == "":
                raise UsageError(f"{flag} needs a token's text, e.g. '<|eot_id|>'")
        if args.tokenizer is None:
            log(
                "no --tokenizer given: the built-in byte tokenizer is used (258 tokens); name "
                "one with --tokenizer (a tokenizer.json, a model directory or a Hugging Face "
                "name such as gpt2), or --tokenizer bytes to say this is meant"
            )
        summary = build(
            args.inputs,
            args.output,
            text_field=args.text_field,
            keep_fields=args.keep_fields,
            annotations_field=args.annotations_field,
            tokenizer=args.tokenizer or "bytes",
            include=args.include,
            exclude=args.exclude,
            force=args.force,
            max_skipped=args.max_skipped,
            progress_every=args.progress_every,
            log=log,
            bos=args.bos_token if args.bos_token is not None else args.bos,
            eos=args.eos_token if args.eos_token is not None else args.eos,
            workers=args.workers,
            part=args.part,
            on_error=args.on_error,
            shard_bytes=args.shard_bytes,
            chunk_bytes=args.chunk_bytes,
            ray=args.ray,
            progress=args.progress,
            staging=args.staging,
        )
        print(f"tokload build: {summary}")
        return 0
    if args.command == "merge":
        from tokload.derive import merge

        m = merge(args.output, args.inputs, partial=args.partial)
        print(
            f"tokload merge: {len(m.shards)} shards, {m.num_documents:,} documents, "
            f"{m.rows:,} rows -> {args.output}"
        )
        return 0
    if args.command == "convert":
        from tokload.derive import convert
        from tokload.writer import checked_block

        if args.layout == "per_token" and args.span_block is not None:
            raise UsageError("--span-block is for --layout blocks or spans, not per_token")
        checked_block(args.span_block, args.layout, UsageError)  # exit 2, as argparse's
        m = convert(args.src, args.dst, args.layout, span_block=args.span_block)
        print(
            f"tokload convert: {len(m.shards)} shards, {m.num_documents:,} documents, "
            f"{m.rows:,} rows, metadata as {args.layout} -> {args.dst}"
        )
        return 0
    if args.command == "inspect":
        from tokload.tools import inspect

        print(inspect(args.path, sample=args.sample))
        return 0
    if args.command == "verify":
        from tokload.tools import verify

        problems = verify(args.path, deep=args.deep)
        for p in problems:
            print(f"tokload verify: {p}", file=sys.stderr)
        if not problems:
            checked = "every file's checksum and structure" if args.deep else "structure"
            print(f"tokload verify: {args.path}: ok ({checked})")
        return 1 if problems else 0
    if args.command == "plan":
        from tokload.tools import plan, plan_table

        if args.documents and args.window is not None:
            raise UsageError("--window and --documents contradict each other: give one")
        window = None if args.documents else (args.window or 4097)
        result = plan(
            args.path,
            args.world_size,
            args.tokens_per_s,
            window,
            metadata=args.metadata,
            shuffle_block=args.shuffle_block,
            batch_size=args.batch_size,
        )
        print(json.dumps(result, indent=1) if args.json else plan_table(result))
        return 0
    if args.command == "bench":
        from tokload.tools import bench, bench_table, process_age

        result = {
            "startup_s": process_age(started),
            **bench(args.path, args.seconds, args.window, args.batch_size, args.threads),
        }
        print(json.dumps(result, indent=1) if args.json else bench_table(args.path, result))
        return 0
    raise AssertionError(args.command)  # pragma: no cover - argparse rejects others


if __name__ == "__main__":
    sys.exit(main())
