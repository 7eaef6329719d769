"""Random window reads: tokload's views against ``np.memmap`` on the same files.

    python -m pytest bench/bench_read.py -o python_files='bench_*.py'

A 64M-token uint32 dataset (256 MB, 4 shards, warm page cache) is written
once per session. Each call reads a batch of 8 random windows of 4097 tokens:
with tokload (one call, C without the GIL), with ``np.memmap`` fancy indexing
(``mm[starts[:, None] + arange(4097)]``) and with memmap slices stacked (the
plain-loader recipe). The summary prints tokens/s and ratios measured in this
run; ``test_syscalls_per_window`` counts them with strace.
"""

from __future__ import annotations

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
    _info(benchmark, "tokload StreamWithMetadata.read")
    benchmark(lambda: view.read(next(batches)))


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
