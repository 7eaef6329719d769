"""Build one synthetic corpus into every system's own format (run in the peers venv).

    python bench/peers/corpus.py OUT_DIR [--tokens 200000000] [--formats flat,tokload,...]
    python bench/peers/corpus.py OUT_DIR --from-flat PART... [--formats megatron,litdata]

Deterministic: documents with log-normal lengths (median 600 tokens, sigma
1.0, so a long tail), tokens uniform in [0, 128000); or, with ``--from-flat``,
the tokens of existing uint32 files (concatenated in the order given; the cold
benchmarks use this to put every format on their own corpus) cut into documents
of the same length distribution. Written as (``--formats``: a comma-separated
subset, default all; ``flat`` is always written, the others are built from it):

- ``flat.bin``: the concatenated stream, uint32 (the plain memmap recipe);
- ``tokload/``: a tokload dataset (Writer, 256 MB shards);
- ``megatron.bin/.idx``: megatron-core's IndexedDatasetBuilder, int32 (Megatron
  has no uint32);
- ``mds/``: MosaicML MDS shards of consecutive 4097-token windows (the
  llm-foundry ``--concat_tokens`` layout), ``tokens`` as raw int32 bytes;
- ``litdata/``: litdata ``optimize(..., item_loader=TokensLoader())``, 64 MB chunks.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

WINDOW = 4097


def documents(tokens: int, seed: int = 2026) -> tuple[np.ndarray, np.ndarray]:
    """(stream uint32, document boundaries int64 with 0 and len)."""
    rng = np.random.default_rng(seed)
    bounds = boundaries(tokens, rng)
    stream = rng.integers(0, 128_000, tokens, dtype=np.uint32)
    return stream, bounds


def boundaries(tokens: int, rng: np.random.Generator) -> np.ndarray:
    """Document boundaries (int64, 0 first, ``tokens`` last) of log-normal lengths."""
    lengths = []
    total = 0
    while total < tokens:
        chunk = np.maximum(1, rng.lognormal(np.log(600), 1.0, 100_000).astype(np.int64))
        lengths.append(chunk)
        total += int(chunk.sum())
    lens = np.concatenate(lengths)
    bounds = np.concatenate([[0], np.cumsum(lens)])
    bounds = bounds[bounds <= tokens]
    if bounds[-1] != tokens:
        bounds = np.append(bounds, tokens)
    return bounds


FORMATS = ("flat", "tokload", "megatron", "mds", "litdata")


def from_flat(paths: list[Path], seed: int = 2026) -> tuple[np.ndarray, np.ndarray]:
    """(the files' uint32 tokens concatenated, document boundaries as documents() cuts)."""
    stream = np.concatenate([np.fromfile(p, dtype=np.uint32) for p in paths])
    return stream, boundaries(len(stream), np.random.default_rng(seed))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--tokens", type=int, default=200_000_000)
    ap.add_argument("--from-flat", nargs="+", type=Path, help="uint32 files to take tokens from")
    ap.add_argument("--formats", default=",".join(FORMATS))
    args = ap.parse_args()
    formats = set(args.formats.split(","))
    if formats - set(FORMATS):
        raise SystemExit(f"unknown formats {sorted(formats - set(FORMATS))}; known: {FORMATS}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    timings: dict[str, float] = {}
    t = time.perf_counter()
    stream, bounds = from_flat(args.from_flat) if args.from_flat else documents(args.tokens)
    timings["generate"] = time.perf_counter() - t

    t = time.perf_counter()
    stream.tofile(out / "flat.bin")
    np.save(out / "bounds.npy", bounds)
    timings["flat"] = time.perf_counter() - t

    if "tokload" in formats:
        import tokload

        t = time.perf_counter()
        with tokload.Writer(
            out / "tokload", "<u4", shard_bytes=256 << 20, name_prefix="corpus"
        ) as w:
            for a, b in zip(bounds[:-1].tolist(), bounds[1:].tolist(), strict=True):
                w.write(stream[a:b])
        timings["tokload"] = time.perf_counter() - t

    if "megatron" in formats:
        _megatron(stream, bounds, out, timings)
    if "mds" in formats:
        _mds(stream, out, timings)
    if "litdata" in formats:
        _litdata(bounds, out, timings)
    (out / "corpus.json").write_text(
        json.dumps(
            {
                "tokens": len(stream),
                "documents": int(len(bounds) - 1),
                "median_document": float(np.median(np.diff(bounds))),
                "formats": sorted(formats | {"flat"}),
                "from_flat": [str(p) for p in args.from_flat or []],
                "seconds": timings,
            },
            indent=1,
        )
    )
    print(json.dumps(timings))


def _megatron(stream: np.ndarray, bounds: np.ndarray, out: Path, timings: dict[str, float]) -> None:
    t = time.perf_counter()
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    as_i32 = stream.view(np.int32)  # values < 2^31: the same numbers
    builder = IndexedDatasetBuilder(str(out / "megatron.bin"), dtype=np.int32)
    # 10,000 documents per call: each one a Megatron sequence (what GPTDataset reads as
    # a document); one add_item per document would take minutes at 200M tokens.
    step = 10_000
    for k in range(0, len(bounds) - 1, step):
        sub = bounds[k : k + step + 1]
        builder.add_document(torch.from_numpy(as_i32[sub[0] : sub[-1]]), np.diff(sub).tolist())
    builder.finalize(str(out / "megatron.idx"))
    timings["megatron"] = time.perf_counter() - t


def _mds(stream: np.ndarray, out: Path, timings: dict[str, float]) -> None:
    t = time.perf_counter()
    as_i32 = stream.view(np.int32)
    sys.path.insert(0, str(Path(__file__).parent))
    import torchvision_stub

    torchvision_stub.install()
    from streaming import MDSWriter

    with MDSWriter(out=str(out / "mds"), columns={"tokens": "bytes"}, size_limit="64mb") as mds:
        for s in range(0, len(stream) - WINDOW + 1, WINDOW):
            mds.write({"tokens": as_i32[s : s + WINDOW].tobytes()})
    timings["mds"] = time.perf_counter() - t


def _litdata(bounds: np.ndarray, out: Path, timings: dict[str, float]) -> None:
    t = time.perf_counter()
    from litdata import TokensLoader, optimize

    optimize(
        fn=_litdata_docs,
        inputs=[(str(out / "flat.bin"), int(a), int(b)) for a, b in _groups(bounds, 256)],
        output_dir=str(out / "litdata"),
        chunk_bytes="64MB",
        item_loader=TokensLoader(),
        num_workers=1,
        mode="overwrite",
    )
    timings["litdata"] = time.perf_counter() - t


def _groups(bounds: np.ndarray, k: int) -> list[tuple[int, int]]:
    """k groups of whole documents: (first document, last document + 1)."""
    n = len(bounds) - 1
    cuts = np.linspace(0, n, k + 1).astype(np.int64)
    return [(int(a), int(b)) for a, b in itertools.pairwise(cuts) if b > a]


def _litdata_docs(item: tuple[str, int, int]) -> Iterator[Any]:
    """The documents [first, last) of the flat stream, as litdata wants them: tensors."""
    import torch

    path, first, last = item
    bounds = np.load(Path(path).with_name("bounds.npy"))
    mm = np.memmap(path, dtype=np.int32, mode="r")
    for d in range(first, last):
        yield torch.from_numpy(np.array(mm[bounds[d] : bounds[d + 1]]))


if __name__ == "__main__":
    main()
