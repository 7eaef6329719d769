"""``DataLoader.stats()``, the periodic log line and the I/O engine's counters.

The figures must be the true ones: batches, samples and tokens as delivered
(documents without their padding), waits that show a slow view and not a fast
one, I/O bytes and requests as the engine ran them (counted in C, process-wide),
failed reads counted, and intervals that restart at each call.
"""

from __future__ import annotations

import logging
import multiprocessing
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import tokload
from tokload import _io

W, B = 33, 8


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("stats") / "ds"
    rng = np.random.default_rng(0)
    with tokload.Writer(path, "<u2", shard_bytes=1 << 12) as w:
        for d in range(300):
            w.write(rng.integers(1, 1000, 20 + d % 37, dtype=np.uint16))
    return path


def test_counts_of_an_interval_and_the_next(corpus: Path) -> None:
    view = tokload.TokenStream(corpus, window=W)
    ld = tokload.DataLoader(view, B, seed=1, num_threads=1)
    it = iter(ld)
    for _ in range(5):
        next(it)
    s = ld.stats()
    assert (s["rank"], s["world_size"]) == (0, 1)
    assert (s["batches"], s["samples"], s["tokens"]) == (5, 5 * B, 5 * B * W)
    assert s["seconds"] > 0 and s["tokens_per_s"] == pytest.approx(s["tokens"] / s["seconds"])
    assert 0 <= s["wait_p50_s"] <= s["wait_p99_s"] <= s["wait_max_s"] <= s["wait_s"]
    assert s["tasks_built"] >= 1 and s["tokens_built"] >= 5 * B * W
    assert s["build_s"] > 0 and s["io_requests"] >= 5 * B and s["io_bytes"] >= 5 * B * W * 2
    assert 0 <= s["batches_ready"] <= s["prefetch_batches"]
    for _ in range(3):
        next(it)
    again = ld.stats()  # a new interval: only what happened since the last call
    assert (again["batches"], again["samples"], again["tokens"]) == (3, 3 * B, 3 * B * W)
    ld.close()
    closed = ld.stats()
    assert closed["batches"] == 0 and closed["batches_ready"] == closed["prefetch_batches"] == 0


def test_batches_ready_near_the_end_of_a_run_are_those_left(corpus: Path) -> None:
    """Each ready task counted as steps_per_task batches: near the end of a finite run
    the queue said 513 ready with 86 left (review35)."""
    view = tokload.TokenStream(corpus, window=W)
    read = tokload.ReadOptions(steps_per_task=16, prefetch=512)
    ld = tokload.DataLoader(view, B, seed=1, num_threads=1, epochs=1, read=read)
    total = -(-len(view) // B)
    it = iter(ld)
    for _ in range(total - 20):
        next(it)
    deadline = time.monotonic() + 30
    while ld.stats()["batches_ready"] < 20 and time.monotonic() < deadline:
        time.sleep(0.01)  # the readers finish the run
    assert ld.stats()["batches_ready"] == 20
    assert len(list(it)) == 20
    ld.close()


def test_io_figures_are_the_reads_of_the_batches() -> None:
    """In a process of its own (the engine's totals are process-wide): with no
    reader threads, each batch is one engine call of one read per window."""
    code = """
import numpy as np, tokload
from tokload import _io
assert _io.io_counters() == {"calls": 0, "requests": 0, "bytes": 0, "failed": 0, "seconds": 0.0}
with tokload.Writer("ds", "<u4") as w:
    w.write(np.arange(100_000, dtype=np.uint32))
ld = tokload.DataLoader(tokload.TokenStream("ds", window=1000), 4, seed=3, num_threads=0)
it = iter(ld)
for _ in range(7):
    next(it)
s = ld.stats()
assert (s["io_calls"], s["io_requests"], s["io_bytes"]) == (7, 28, 28 * 1000 * 4), s
assert s["io_failed"] == 0 and 0 < s["io_s"] and s["tasks_built"] == 7
assert s["wait_s"] == s["build_s"] or abs(s["wait_s"] - s["build_s"]) < 0.5 * s["wait_s"], s
print("ok")
"""
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=_tmp()
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def _tmp() -> str:
    import tempfile

    return tempfile.mkdtemp(prefix="tokload-stats-")


def test_documents_count_their_tokens_not_the_padding(corpus: Path) -> None:
    docs = tokload.Documents(corpus)  # padded to the longest of each batch
    ld = tokload.DataLoader(docs, 4, seed=2, num_threads=1, device=None)
    real = 0
    for _, batch in zip(range(6), ld, strict=False):
        assert batch["tokens"].numel() >= int(batch["lengths"].sum())
        real += int(batch["lengths"].sum())
    s = ld.stats()
    assert s["tokens"] == real and s["samples"] == 24
    ld.close()
    packed = tokload.DataLoader(docs, 4, batching=tokload.Pack(), num_threads=0)
    b = next(iter(packed))
    assert packed.stats()["tokens"] == b["tokens"].numel() == int(b["lengths"].sum())


class Slow:
    """A view whose batches take ``delay`` seconds each to read."""

    rowwise = True
    fingerprint = "slow"

    def __init__(self, delay: float) -> None:
        self.delay = delay

    def __len__(self) -> int:
        return 10_000

    def read_batch(self, indices: np.ndarray, alloc: Any) -> dict[str, np.ndarray]:
        time.sleep(self.delay)
        out = alloc((len(indices), 4), np.dtype(np.int32))
        out[:] = indices[:, None]
        return {"tokens": out}


def test_a_slow_view_shows_as_waits_and_a_fast_one_does_not() -> None:
    slow = tokload.DataLoader(
        Slow(0.03), 2, num_threads=1, read=tokload.ReadOptions(prefetch=1, steps_per_task=1)
    )
    it = iter(slow)
    for _ in range(8):
        next(it)
    s = slow.stats()
    slow.close()
    assert s["wait_p50_s"] > 0.01 and s["wait_max_s"] >= s["wait_p99_s"] >= s["wait_p50_s"]
    assert s["wait_fraction"] > 0.5 and s["build_s"] > 8 * 0.03 * 0.9
    fast = tokload.DataLoader(
        Slow(0.0), 2, num_threads=1, read=tokload.ReadOptions(prefetch=64, steps_per_task=16)
    )
    it = iter(fast)
    next(it)
    time.sleep(0.3)  # the prefetch fills
    fast.stats()
    for _ in range(30):
        next(it)
    f = fast.stats()
    fast.close()
    assert f["batches"] == 30 and f["wait_p50_s"] == 0.0  # ready batches wait nothing
    assert f["batches_ready"] > 0


@settings(max_examples=25, deadline=None)
@given(
    batch=st.integers(1, 9),
    world=st.integers(1, 4),
    epochs=st.integers(1, 2),
    drop_last=st.booleans(),
    window=st.sampled_from([5, 33, 200]),
)
def test_ranks_count_their_own_samples(
    corpus: Path, batch: int, world: int, epochs: int, drop_last: bool, window: int
) -> None:
    """Over whole runs, each rank's samples and tokens are what it delivered, and the
    ranks together deliver every sample of every epoch (all of them without drop_last)."""
    view = tokload.TokenStream(corpus, window=window)
    n = len(view)
    assume(not drop_last or batch * world <= n)
    total = 0
    for rank in range(world):
        ld = tokload.DataLoader(
            view, batch, rank=rank, world_size=world, epochs=epochs, drop_last=drop_last,
            num_threads=0,
        )  # fmt: skip
        delivered = steps = 0
        for b in ld:
            delivered += len(b["index"])
            steps += 1
        s = ld.stats()
        assert (s["rank"], s["world_size"], s["batches"]) == (rank, world, steps)
        assert s["samples"] == delivered and s["tokens"] == delivered * window
        total += delivered
    if drop_last:
        assert total == epochs * (n // (batch * world)) * batch * world
    else:
        assert total == epochs * n


def test_the_log_line_keeps_its_own_interval(
    corpus: Path, caplog: pytest.LogCaptureFixture
) -> None:
    view = tokload.TokenStream(corpus, window=W)
    ld = tokload.DataLoader(view, B, seed=1, num_threads=1, log_every=0.05)
    caplog.set_level(logging.INFO, logger="tokload")
    it = iter(ld)
    for _ in range(4):
        next(it)
    time.sleep(0.06)
    next(it)  # logs: 5 batches since the loader was built
    lines = [r.getMessage() for r in caplog.records if r.name == "tokload"]
    assert len(lines) == 1 and lines[0].startswith("tokload rank 0/1: 5 batches, 1,320 tokens")
    assert "waited" in lines[0] and "batches ready" in lines[0]
    assert ld.stats()["batches"] == 5  # the log did not reset stats()' interval
    ld.close()


@pytest.mark.parametrize("bad", [0, -1.0, "10", True])
def test_log_every_must_be_positive_seconds(corpus: Path, bad: object) -> None:
    view = tokload.TokenStream(corpus, window=W)
    with pytest.raises(ValueError, match=r"log_every must be a positive number of seconds or None"):
        tokload.DataLoader(view, B, log_every=bad)  # type: ignore[arg-type]


def test_failed_reads_are_counted(tmp_path: Path) -> None:
    with tokload.Writer(tmp_path / "ds", "<u4", shard_bytes=1 << 16) as w:
        for d in range(10):
            w.write(np.arange(d * 10_000, (d + 1) * 10_000, dtype=np.uint32))
    view = tokload.TokenStream(tmp_path / "ds", window=1000)
    shards = sorted((tmp_path / "ds").glob("*.rows"))
    assert len(shards) > 1
    last = shards[-1]
    view.read([0])  # opens the dataset
    before = _io.io_counters()
    with open(last, "r+b") as f:  # the last shard loses its tail after opening
        f.truncate(100)
    with pytest.raises(tokload.TokloadError):
        view.read([len(view) - 1])
    after = _io.io_counters()
    assert after["failed"] == before["failed"] + 1
    assert after["bytes"] == before["bytes"]  # a failed call adds no bytes


def _child_counters(q: Any) -> None:
    q.put(_io.io_counters())


def test_a_forked_child_counts_from_zero(corpus: Path) -> None:
    tokload.TokenStream(corpus, window=W).read([0, 1, 2])
    assert _io.io_counters()["requests"] > 0
    ctx = multiprocessing.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_child_counters, args=(q,))
    p.start()
    got = q.get(timeout=60)
    p.join(60)
    assert got == {"calls": 0, "requests": 0, "bytes": 0, "failed": 0, "seconds": 0.0}
