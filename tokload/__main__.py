"""The ``tokload`` command line."""

from __future__ import annotations

import argparse
import sys

from tokload import _demo


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tokload", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="run the built-in end-to-end example")
    demo.add_argument("--seed", type=int, default=7, help="run seed (default: 7)")
    args = parser.parse_args(argv)
    if args.command == "demo":
        return _demo.run(seed=args.seed)
    parser.error(f"unknown command {args.command}")  # pragma: no cover
    return 2


if __name__ == "__main__":
    sys.exit(main())
