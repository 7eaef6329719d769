"""Random window reads: tokload's views against ``np.memmap`` on the same files.

    python -m pytest bench/bench_read.py -o python_files='bench_*.py'

A 64M-token uint32 dataset (256 MB, 4 shards, warm page cache) is written
once per session. Each call reads a batch of 8 random windows of 4097 tokens:
with tokload (one call, C without the GIL), with ``np.memmap`` fancy indexing
(``mm[starts[:, None] + arange(4097)]``) and with memmap slices stacked (the
plain-loader recipe). The summary prints tokens/s and ratios measured in this
run; ``test_syscalls_per_window`` counts them with strace.

    python -m bench.bench_read

measures every read kind on the same uint16 tokens, each metadata layout at
several densities, as a share of TokenStream's rate (``measure_layouts``), and
writes ``bench/results/bench_read_layouts.json``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import tokload
from bench import _results

WINDOW, BATCH = 4097, 8
TOKENS = 64 << 20
SHARD_TOKENS = 16 << 20


@pytest.fixture(scope="module")
def corpus() -> Iterator[tuple[Path, Path]]:
    tmp = Path(tempfile.mkdtemp(prefix="tokload-bench-"))
    rng = np.random.default_rng(0)
    flat = rng.integers(0, 128_000, TOKENS, dtype=np.uint32)
    flat.tofile(tmp / "flat.bin")
    with tokload.Writer(tmp / "ds", "<u4", shard_bytes=SHARD_TOKENS * 4) as w:
        for start in range(0, TOKENS, 1 << 20):  # 1M-token documents
            w.write(flat[start : start + (1 << 20)])
    meta_dt = [("token", "<u4"), ("metadata_id", "<u4")]
    with tokload.Writer(tmp / "meta", meta_dt, metadata=True, shard_bytes=SHARD_TOKENS * 8) as w:
        for start in range(0, TOKENS // 4, 1 << 16):
            doc = flat[start : start + (1 << 16)]
            spans = [
                (s, s + 300, b"concept-%d" % (start + s)) for s in range(0, len(doc) - 300, 700)
            ]
            w.write({"token": doc}, spans=spans)
    # the same tokens as documents of log-normal lengths (median 600), for boundaries
    lengths = np.maximum(1, rng.lognormal(np.log(600), 1.0, TOKENS // 300)).astype(np.int64)
    ends = np.cumsum(lengths)
    ends = ends[ends < TOKENS]
    with tokload.Writer(tmp / "docs", "<u4", shard_bytes=SHARD_TOKENS * 4) as w:
        for a, e in zip(np.concatenate(([0], ends)), np.concatenate((ends, [TOKENS])), strict=True):
            w.write(flat[a:e])
    for p in tmp.rglob("*"):  # warm the page cache
        if p.is_file():
            p.read_bytes()
    yield tmp / "ds", tmp / "flat.bin"
    shutil.rmtree(tmp)


def _batches(n: int) -> Iterator[np.ndarray]:
    """Endless precomputed random batches, so no call times the RNG."""
    pool = np.random.default_rng(0).integers(0, n, size=(4096, BATCH))
    while True:
        yield from pool


def _info(benchmark: Any, label: str, compare: list[str] | None = None) -> None:
    benchmark.group = "random windows (4097 x uint32, batch 8)"
    benchmark.extra_info.update(
        items=WINDOW * BATCH, unit="tok", label=label, compare=compare or []
    )


def test_tokload_token_stream(benchmark: Any, corpus: tuple[Path, Path]) -> None:
    view = tokload.TokenStream(corpus[0], window=WINDOW, stride=WINDOW - 1)
    out = view.empty(BATCH)
    batches = _batches(len(view))
    _info(
        benchmark,
        "tokload TokenStream.read",
        ["np.memmap fancy indexing", "np.memmap slices + np.stack"],
    )
    benchmark(lambda: view.read(next(batches), out=out))


def test_memmap_fancy_indexing(benchmark: Any, corpus: tuple[Path, Path]) -> None:
    mm = np.memmap(corpus[1], dtype=np.uint32, mode="r")
    n = (len(mm) - WINDOW) // (WINDOW - 1) + 1
    offs = np.arange(WINDOW)
    batches = _batches(n)
    _info(benchmark, "np.memmap fancy indexing")
    benchmark(lambda: mm[next(batches)[:, None] * (WINDOW - 1) + offs])


def test_memmap_slices(benchmark: Any, corpus: tuple[Path, Path]) -> None:
    mm = np.memmap(corpus[1], dtype=np.uint32, mode="r")
    n = (len(mm) - WINDOW) // (WINDOW - 1) + 1
    batches = _batches(n)
    _info(benchmark, "np.memmap slices + np.stack")

    def run() -> np.ndarray:
        return np.stack([mm[s * (WINDOW - 1) : s * (WINDOW - 1) + WINDOW] for s in next(batches)])

    benchmark(run)


def test_tokload_stream_with_metadata(benchmark: Any, corpus: tuple[Path, Path]) -> None:
    view = tokload.StreamWithMetadata(corpus[0].parent / "meta", window=WINDOW, stride=WINDOW - 1)
    batches = _batches(len(view))
    # 8-byte rows (token, metadata_id) and a span every 700 tokens: not the layouts
    # of the metadata goal, which ``python -m bench.bench_read`` measures.
    _info(benchmark, "tokload StreamWithMetadata.read ((token, metadata_id) rows)")
    benchmark(lambda: view.read(next(batches)))


BOUNDARIES: dict[str, tuple[bool | list[str], str]] = {
    "plain": (False, "TokenStream.read_batch"),
    "varlen": (["cu_seqlens", "max_seqlen"], "TokenStream.read_batch, cu_seqlens and max_seqlen"),
    "all": (True, "TokenStream.read_batch, boundaries=True"),
}


@pytest.mark.parametrize("kind", list(BOUNDARIES))
def test_token_stream_with_boundaries(benchmark: Any, corpus: tuple[Path, Path], kind: str) -> None:
    """A batch as the DataLoader reads it (``read_batch``) from documents of
    log-normal lengths (median 600 tokens): without the attention metadata, with
    only what a variable-length kernel takes, and with all of it."""
    boundaries, label = BOUNDARIES[kind]
    view = tokload.TokenStream(
        corpus[0].parent / "docs", window=WINDOW, stride=WINDOW - 1, boundaries=boundaries
    )
    batches = _batches(len(view))
    benchmark.group = "documents of ~600 tokens (4097 x uint32, batch 8)"
    benchmark.extra_info.update(items=WINDOW * BATCH, unit="tok", label=label)
    benchmark(lambda: view.read_batch(next(batches), np.empty))


def bench_goals(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The attention metadata costs at most 10% of a plain batch's time."""
    t = {r["label"]: r["median_s"] for r in rows if "median_s" in r}
    plain = t.get(BOUNDARIES["plain"][1])
    goals = []
    for kind in ("varlen", "all"):
        with_extras = t.get(BOUNDARIES[kind][1])
        if plain and with_extras:
            what = f"{BOUNDARIES[kind][1]}: time per batch over a plain batch's"
            goals.append(
                _results.make_goal(
                    what, 1.10, with_extras / plain, higher_is_better=False, fmt="{:.2f}x"
                )
            )
    return goals


def test_syscalls_per_window(corpus: tuple[Path, Path]) -> None:
    """Count syscalls of 1000 batches of 8 random windows with strace -c."""
    if shutil.which("strace") is None:
        pytest.skip("strace is not installed")
    code = f"""
import numpy as np, tokload
v = tokload.TokenStream({str(corpus[0])!r}, window={WINDOW}, stride={WINDOW - 1})
m = tokload.StreamWithMetadata({str(corpus[0].parent / "meta")!r}, window={WINDOW},
                               stride={WINDOW - 1})
out = v.empty({BATCH}); rng = np.random.default_rng(0)
import os; os.write(2, b"START\\n")
for _ in range(1000):
    v.read(rng.integers(0, len(v), {BATCH}), out=out)
for _ in range(1000):
    m.read(rng.integers(0, len(m), {BATCH}))
"""
    res = subprocess.run(
        ["strace", "-f", "-e", "trace=preadv,pread64,read,mmap,openat", sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        # the synchronous path issues one preadv per read, which is what this counts
        # (io_uring would batch them inside io_uring_enter)
        env={**os.environ, "TOKLOAD_IO": "sync"},
    )
    after = res.stderr.split("START", 1)[1]
    lines = after.splitlines()
    half = [ln for ln in lines if ln.startswith(("preadv", "[pid"))]
    preadv = [ln for ln in half if "preadv(" in ln]
    tokens_reads = [ln for ln in preadv if f", {WINDOW * 4}}}" in ln or "}], 1, " in ln]
    per_window = len(preadv) / (2000 * BATCH)
    print(
        f"\npreadv calls: {len(preadv)} for 2000 batches of {BATCH} windows "
        f"(TokenStream then StreamWithMetadata): {per_window:.2f} per window on average; "
        f"other syscalls in the read loop: {len(lines) - len(half)}"
    )
    assert tokens_reads
    _results.record(
        "bench_read",
        group="syscalls (strace, TOKLOAD_IO=sync)",
        label="preadv calls per window (TokenStream and StreamWithMetadata)",
        value=per_window,
        other_syscalls=len(lines) - len(half),
    )


# ---- issue 13: one run, the same tokens, every read kind and every layout ------------


LAYOUT_BUILDS = (
    (10, "blocks"),
    (100, "blocks"),
    (1000, "blocks"),
    (10, "spans"),
    (100, "spans"),
    (1000, "spans"),
    (100, "per_token"),
)
"""(one record per so many tokens, layout) of each build with metadata."""


def measure_layouts(
    root: Path, tokens: int = 8 << 20, doc: int = 2048, seconds: float = 3.0, rounds: int = 30
) -> dict[str, Any]:
    """Tokens/s of random windows of 4097 in batches of 8 (warm cache) for
    TokenStream, StreamWithMetadata (metadata blocks and span table at 1
    record per 10, 100 and 1,000 tokens; per-token ids at 1 per 100),
    Documents padded and packed (batches of 8 documents of ``doc`` tokens),
    metadata blocks and documents again with their indexes read entry by
    entry (``TOKLOAD_INDEX_MEMORY=0``), and the on-disk size of each build of
    the same uint16 tokens. Each rate is the median of ``rounds`` slices of
    ``seconds / rounds``, the read kinds taking turns; each ratio to
    TokenStream is the median of the ratios of slices of the same round (a
    pair measured within a fraction of a second of each other)."""
    import time

    rng = np.random.default_rng(0)
    toks = rng.integers(0, 65535, tokens).astype(np.uint16)
    ndocs = tokens // doc
    builds: dict[str, Path] = {}
    with tokload.Writer(root / "tokens", "<u2") as w:
        for d in range(ndocs):
            w.write(toks[d * doc : (d + 1) * doc])
    builds["tokens only"] = root / "tokens"
    for every, layout in LAYOUT_BUILDS:
        name = f"{layout} 1/{every}"
        dt: Any = "<u2" if layout != "per_token" else [("tokens", "<u2"), ("metadata_id", "<u4")]
        with tokload.Writer(
            root / name.replace("/", "-").replace(" ", "_"),
            dt,
            metadata=True,
            metadata_layout=layout,
        ) as w:
            for d in range(ndocs):
                t = toks[d * doc : (d + 1) * doc]
                spans = [
                    (a, min(doc, a + every), b"%08d" % (d * doc + a)) for a in range(0, doc, every)
                ]
                w.write(t if layout != "per_token" else {"tokens": t}, spans=spans)
        builds[name] = root / name.replace("/", "-").replace(" ", "_")

    # Every read kind is timed in turns, ``rounds`` slices of ``seconds / rounds``
    # each, and its median slice kept: a slow moment of the machine then costs
    # every kind alike instead of whichever ran then.
    readers: dict[str, tuple[Any, Any]] = {}
    ts = tokload.TokenStream(builds["tokens only"], window=WINDOW)
    readers["TokenStream"] = (ts, lambda b: (ts.read(b), len(b) * WINDOW)[1])
    for name in (f"{layout} 1/{every}" for every, layout in LAYOUT_BUILDS):
        v = tokload.StreamWithMetadata(builds[name], window=WINDOW)
        readers[f"StreamWithMetadata {name}"] = (v, lambda b, v=v: v.read(b).positions.size)
    dp = tokload.Documents(builds["tokens only"])
    readers["Documents padded"] = (dp, lambda b: int(dp.read_padded(b)[1].sum()))
    readers["Documents packed"] = (dp, lambda b: int(dp.read(b).offsets[-1]))
    # the same with every index read entry by entry (an index too big to hold in memory)
    os.environ["TOKLOAD_INDEX_MEMORY"] = "0"
    try:
        vb = tokload.StreamWithMetadata(builds["blocks 1/100"], window=WINDOW)
        dq = tokload.Documents(builds["tokens only"])
    finally:
        del os.environ["TOKLOAD_INDEX_MEMORY"]
    readers["StreamWithMetadata blocks 1/100, index not held"] = (
        vb,
        lambda b: vb.read(b).positions.size,
    )
    readers["Documents packed, index not held"] = (dq, lambda b: int(dq.read(b).offsets[-1]))

    batches = {k: [rng.integers(0, len(v), 8) for _ in range(64)] for k, (v, _) in readers.items()}
    for k, (_, read) in readers.items():
        for b in batches[k][:8]:
            read(b)  # warm
    slices: dict[str, list[float]] = {k: [] for k in readers}
    for _ in range(rounds):
        for k, (_, read) in readers.items():
            done = 0
            t0 = time.perf_counter()
            while time.perf_counter() - t0 < seconds / rounds:
                for b in batches[k]:
                    done += read(b)
            slices[k].append(done / (time.perf_counter() - t0))
    base = np.array(slices["TokenStream"])
    res: dict[str, Any] = {
        "rates": {k: float(np.median(v)) for k, v in slices.items()},
        "ratios": {k: float(np.median(np.array(v) / base)) for k, v in slices.items()},
        "sizes": {},
    }
    for name, p in builds.items():
        res["sizes"][name] = sum(f.stat().st_size for f in p.iterdir() if f.name != "manifest.json")
    return res


def layout_results(out: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Rows and goal of :func:`measure_layouts`'s figures, for ``bench/results``."""
    rows: list[dict[str, Any]] = [
        {
            "group": "read kinds (warm cache, windows of 4097, batch 8)",
            "label": k,
            "tokens_per_s": v,
            "share_of_token_stream": out["ratios"][k],
        }
        for k, v in out["rates"].items()
    ]
    tok = out["sizes"]["tokens only"]
    rows += [
        {"group": "size on disk", "label": k, "bytes": v, "over_tokens_only": (v - tok) / tok}
        for k, v in out["sizes"].items()
    ]
    goal = _results.make_goal(
        "StreamWithMetadata (metadata blocks, 1 record / 100 tokens) over TokenStream",
        0.5,
        out["ratios"]["StreamWithMetadata blocks 1/100"],
        fmt="{:.1%}",
    )
    return rows, [goal]


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        out = measure_layouts(Path(d))
    for k, v in out["rates"].items():
        print(f"{k:40s} {v / 1e6:9.1f} M tokens/s  {100 * out['ratios'][k]:6.1f}%")
    tok = out["sizes"]["tokens only"]
    for k, v in out["sizes"].items():
        print(f"{k:40s} {v / 1e6:9.2f} MB  +{100 * (v - tok) / tok:6.1f}%")
    rows, goals = layout_results(out)
    _results.write("bench_read_layouts", rows, goals)
