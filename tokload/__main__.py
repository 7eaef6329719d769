"""The ``tokload`` command line.

Exit codes: 0 success; 1 the data is bad (a build error, ``verify`` found a
problem, a dataset that cannot be opened); 2 the command line is wrong.
"""

from __future__ import annotations

import argparse
import json
import sys

from tokload.errors import TokloadError


def _size(text: str) -> int:
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    if t and t[-1] in units:
        return int(float(t[:-1]) * units[t[-1]])
    return int(t)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tokload", description="Feeds tokens to LLM training.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    d = sub.add_parser(
        "demo", help="build a sample corpus, stream it, check resume (no data needed)"
    )
    d.add_argument("--seed", type=int, default=7)
    d.add_argument("--workdir", help="where to build (default: a temporary directory)")

    b = sub.add_parser("build", help="tokenize JSONL / Parquet / text files into a dataset")
    b.add_argument("inputs", nargs="+", help="files, globs or directories")
    b.add_argument("-o", "--output", required=True, help="dataset directory")
    b.add_argument("--text-field", default="text")
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
        help="field with character-span annotations {start, end, ...}",
    )
    b.add_argument("--tokenizer", default="bytes", help="'bytes' or a tokenizer.json path")
    b.add_argument("--bos", action="store_true", help="add BOS before each document")
    b.add_argument("--no-eos", dest="eos", action="store_false", help="no EOS after documents")
    b.add_argument("-j", "--workers", type=int, default=1)
    b.add_argument("--part", help="k/N: build only the k-th of N slices of the inputs")
    b.add_argument("--on-error", choices=["stop", "skip"], default="stop")
    b.add_argument(
        "--shard-size",
        type=_size,
        default=1 << 30,
        dest="shard_bytes",
        help="shard size limit, e.g. 512M or 1G (default 1G)",
    )
    b.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="progress bar (default: when stderr is a terminal)",
    )

    m = sub.add_parser("merge", help="join datasets by manifest (no data is copied)")
    m.add_argument("output")
    m.add_argument("inputs", nargs="+")

    i = sub.add_parser("inspect", help="summarize a dataset and decode a sample")
    i.add_argument("path")
    i.add_argument("--sample", type=int, default=0, help="document to show")

    v = sub.add_parser("verify", help="check every file; exit 1 naming the first problem")
    v.add_argument("path")

    s = sub.add_parser("bench", help="stream a dataset through the DataLoader")
    s.add_argument("path")
    s.add_argument("--seconds", type=float, default=5.0)
    s.add_argument("--window", type=int, default=4097)
    s.add_argument("--batch-size", type=int, default=8)
    s.add_argument("--threads", type=int, default=None)
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return _run(args)
    except (TokloadError, FileNotFoundError) as e:
        print(f"tokload {args.command}: {e}", file=sys.stderr)
        return 1


def _run(args: argparse.Namespace) -> int:
    if args.command == "demo":
        from tokload import _demo

        return _demo.run(seed=args.seed, workdir=args.workdir)
    if args.command == "build":
        from tokload.builder import build

        summary = build(
            args.inputs,
            args.output,
            text_field=args.text_field,
            keep_fields=args.keep_fields,
            annotations_field=args.annotations_field,
            tokenizer=args.tokenizer,
            bos=args.bos,
            eos=args.eos,
            workers=args.workers,
            part=args.part,
            on_error=args.on_error,
            shard_bytes=args.shard_bytes,
            progress=args.progress,
        )
        print(f"tokload build: {summary}")
        return 0
    if args.command == "merge":
        from tokload.writer import merge

        m = merge(args.output, args.inputs)
        print(
            f"tokload merge: {len(m.shards)} shards, {m.num_documents:,} documents, "
            f"{m.rows:,} rows -> {args.output}"
        )
        return 0
    if args.command == "inspect":
        from tokload.tools import inspect

        print(inspect(args.path, sample=args.sample))
        return 0
    if args.command == "verify":
        from tokload.tools import verify

        problems = verify(args.path)
        for p in problems:
            print(f"tokload verify: {p}", file=sys.stderr)
        if not problems:
            print(f"tokload verify: {args.path}: ok")
        return 1 if problems else 0
    if args.command == "bench":
        from tokload.tools import bench

        print(
            json.dumps(
                bench(args.path, args.seconds, args.window, args.batch_size, args.threads), indent=1
            )
        )
        return 0
    raise AssertionError(args.command)  # pragma: no cover - argparse rejects others


if __name__ == "__main__":
    sys.exit(main())
