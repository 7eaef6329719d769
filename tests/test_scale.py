"""Nothing grows with the dataset: 1.1 trillion tokens (4.4 TB) of sparse shards.

1,100 shards of 10^9 uint32 tokens each are sparse files (a few real bytes
written at known places), listed by a manifest written by hand as FORMAT.md
allows. The test asserts bounds on opening, time to first batch from cursor 0
and from the middle of epoch 3, the process's memory, and that the known bytes
come back at the right observations, both by index and through the loader.
The same for a Megatron .idx of 10^9 sequences (20 GB sparse).
"""

from __future__ import annotations

import os
import shutil
import struct
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

import tokload
from tokload.format import Manifest, ShardInfo, write_manifest

SHARDS = 1_100
ROWS = 1_000_000_000
WINDOW, STRIDE = 4097, 4096


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")  # pragma: no cover


def pwrite_u32(path: Path, row: int, values: list[int]) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.pwrite(fd, np.asarray(values, dtype="<u4").tobytes(), row * 4)
    finally:
        os.close(fd)


@pytest.fixture(scope="module")
def trillion(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, dict[int, int]]]:
    """The dataset, and observation -> the token written at its first row (removed after:
    4.4 TB apparent, and blocks of real data that pytest would keep for three runs)."""
    top = tmp_path_factory.mktemp("scale")
    try:
        yield _write_trillion(top / "ds")
    finally:
        shutil.rmtree(top, ignore_errors=True)


def _write_trillion(root: Path) -> tuple[Path, dict[int, int]]:
    root.mkdir()
    m = Manifest(dtype=np.dtype("<u4"), documents=True)
    for k in range(SHARDS):
        name = f"s{k:05d}"
        with open(root / f"{name}.rows", "wb") as f:
            f.truncate(ROWS * 4)
        np.array([0, ROWS], dtype="<u8").tofile(root / f"{name}.docs")
        m.shards.append(ShardInfo(name, ROWS, 1))
    write_manifest(root, m)
    n = (SHARDS * ROWS - WINDOW) // STRIDE + 1
    # known windows: the first, the last, one in the middle, and one across shards 506/507
    known = {0: 0xA0000001, n - 1: 0xA0000002, n // 2: 0xA0000003}
    across = (507 * ROWS - 10) // STRIDE  # starts in shard 506, ends in 507
    known[across] = 0xA0000004
    for i, value in known.items():
        row = i * STRIDE
        k, local = divmod(row, ROWS)
        pwrite_u32(root / f"s{k:05d}.rows", local, [value])
        k2, local2 = divmod(row + WINDOW - 1, ROWS)
        pwrite_u32(root / f"s{k2:05d}.rows", local2, [value + 0x100])  # the window's last row
    return root, known


@pytest.mark.slow
def test_trillion_tokens_open_fast_and_stay_small(trillion: tuple[Path, dict[int, int]]) -> None:
    root, known = trillion
    torch.empty(1)  # torch's own footprint is not the dataset's: load it before measuring
    rss0 = rss_bytes()
    t0 = time.perf_counter()
    view = tokload.TokenStream(root, window=WINDOW, stride=STRIDE)
    opened = time.perf_counter() - t0
    n = len(view)
    assert view.source.num_rows == SHARDS * ROWS == 1_100_000_000_000
    assert n == 268_554_687
    assert opened < 5.0, f"opening took {opened:.2f} s"

    for i, value in known.items():
        w = view[i]
        assert isinstance(w, np.ndarray)
        assert w[0] == value and w[-1] == value + 0x100, i
    assert len(view.source.rows.plan(min(known) + 0, 1)) == 1

    # host memory, never pinned: a CUDA context (on a GPU host) is not the dataset's memory
    loader = tokload.DataLoader(
        view, 8, seed=2026, rank=0, world_size=4, num_threads=1, pin_memory=False, device=None
    )
    t0 = time.perf_counter()
    first = next(iter(loader))
    ttfb0 = time.perf_counter() - t0
    assert first["tokens"].shape == (8, WINDOW) and ttfb0 < 5.0, ttfb0

    # A cursor in the middle of epoch 3 at the position whose sample is a known window.
    target = n // 2
    q = 3 * n + tokload.Permutation.for_epoch(n, 2026, 3).inverse(target)
    loader.cursor = q
    t0 = time.perf_counter()
    batch = next(iter(loader))
    ttfb3 = time.perf_counter() - t0
    assert ttfb3 < 5.0, ttfb3
    assert int(batch["position"][0]) == q and int(batch["index"][0]) == target
    assert int(batch["tokens"][0, 0]) == known[target]
    assert loader.state_dict()["cursor"] == q + 4 * 8
    loader.close()

    grown = rss_bytes() - rss0
    # A permutation array alone would be 2 GB, a sample index 1 GB: allow only a few MB
    # of shard tables and buffers (plus allocator noise).
    assert grown < 64 << 20, f"RSS grew by {grown / 2**20:.1f} MiB"
    print(
        f"\n1.1T tokens: open {opened * 1e3:.0f} ms, first batch {ttfb0 * 1e3:.0f} ms, "
        f"first batch in epoch 3 {ttfb3 * 1e3:.0f} ms, RSS +{grown / 2**20:.1f} MiB"
    )


@pytest.fixture
def huge_prefix(tmp_path: Path) -> Iterator[Path]:
    """Where the sparse Megatron files go (20 GB and 4 TB apparent): removed after."""
    try:
        yield tmp_path / "huge"
    finally:
        for ext in ("idx", "bin"):
            (tmp_path / f"huge.{ext}").unlink(missing_ok=True)


@pytest.mark.slow
def test_megatron_index_of_a_billion_sequences(huge_prefix: Path) -> None:
    nseq, ndoc = 1_000_000_000, 1_000_000_000
    prefix = huge_prefix
    header = struct.pack("<9sQBQQ", b"MMIDIDX\x00\x00", 1, 4, nseq, ndoc + 1)
    len_off = len(header)
    ptr_off = len_off + 4 * nseq
    doc_off = ptr_off + 8 * nseq
    with open(f"{prefix}.idx", "wb") as f:
        f.write(header)
        f.truncate(doc_off + 8 * (ndoc + 1))
    bin_rows = 10**12
    with open(f"{prefix}.bin", "wb") as f:
        f.truncate(bin_rows * 4)
    known = {0: (0, 5), 123_456_789: (4 * 10**11, 3), nseq - 1: (bin_rows - 7, 7)}
    fd = os.open(f"{prefix}.idx", os.O_WRONLY)
    for i, (start, length) in known.items():
        os.pwrite(fd, struct.pack("<i", length), len_off + 4 * i)
        os.pwrite(fd, struct.pack("<q", start * 4), ptr_off + 8 * i)
        pwrite_u32(
            Path(f"{prefix}.bin"), start, list(range(7000 + i % 1000, 7000 + i % 1000 + length))
        )
    os.close(fd)
    rss0 = rss_bytes()
    t0 = time.perf_counter()
    docs = tokload.Documents(prefix)
    opened = time.perf_counter() - t0
    assert len(docs) == nseq and opened < 2.0
    for i, (_start, length) in known.items():
        np.testing.assert_array_equal(docs[i], np.arange(7000 + i % 1000, 7000 + i % 1000 + length))
    assert len(docs[5]) == 0  # an untouched (sparse) entry: a zero-length sequence
    assert rss_bytes() - rss0 < 32 << 20
