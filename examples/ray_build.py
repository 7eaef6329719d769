"""Build a tokload dataset on a Ray cluster: every chunk of the inputs is one Ray task.

Needs ``pip install 'tokload[ray]'`` on every node, and the inputs and the output on a
filesystem every node sees. Start the cluster, then run this on any of its nodes:

    ray start --head                                # on the head node
    ray start --address HEAD_IP:6379                # on each other node
    python examples/ray_build.py /shared/data -o /shared/corpus \\
        --tokenizer /shared/tokenizer.json --address auto

The same from the command line: ``tokload build /shared/data -o /shared/corpus
--tokenizer /shared/tokenizer.json --ray auto``. Without ``--address`` the build uses
``RAY_ADDRESS``'s cluster, or starts a local Ray instance on this machine.

The dataset is the same bytes as a local ``tokload build`` of the same inputs. If a
task or the driver fails, running the same command again rebuilds only the chunks
that are not finished.
"""

from __future__ import annotations

import argparse

import tokload


def main() -> None:
    p = argparse.ArgumentParser(description="Build a tokload dataset with Ray tasks.")
    p.add_argument("inputs", nargs="+", help="JSONL / Parquet / text files, globs, directories")
    p.add_argument("-o", "--output", required=True, help="the dataset directory")
    p.add_argument("--tokenizer", default="bytes", help="'bytes' or a tokenizer.json path")
    p.add_argument("--address", help="the Ray cluster ('auto': the one this node is in)")
    p.add_argument("--keep-field", action="append", default=[], help="metadata field (repeat)")
    p.add_argument("--chunk-size", type=int, default=32 << 20, help="bytes per JSONL chunk")
    args = p.parse_args()

    summary = tokload.build(
        args.inputs,
        args.output,
        tokenizer=args.tokenizer,
        keep_fields=args.keep_field,
        chunk_bytes=args.chunk_size,
        # True: ray.init() (RAY_ADDRESS, or a new local instance); a string: that cluster.
        ray=args.address or True,
        progress=False,
    )
    print(f"built {args.output}: {summary}")


if __name__ == "__main__":
    main()
