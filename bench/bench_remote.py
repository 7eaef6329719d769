"""Shuffled windows from an object store: tokload against the server's own limit and the peers.

    python -m pytest bench/bench_remote.py -o python_files='bench_*.py' -s

A local S3 server (moto, 127.0.0.1; in a child process, so that its Python
threads do not take the GIL of the process measured) behind a proxy that adds
a fixed latency to every request (20 ms and 100 ms: an object store across a
region) holds one corpus (``bench/peers/corpus.py``: uint32 tokens, log-normal
documents of median 600 tokens) in tokload's format. Measured in the same run,
per latency:

- the probe: the server's limit for this read pattern, ranged GETs of one
  window's bytes (4097 tokens) at random offsets, N in flight from one client
  (obstore, asyncio), N in 16, 64, 256; its best tokens/s;
- tokload: a shuffled ``TokenStream(url, 4097)`` through the ``DataLoader``
  (batch 8): tokens/s flat out, the time from ``open`` to the first batch,
  and the trainer's ``next()`` waits once the prefetch is full while it
  consumes at 80% of that rate; and the bytes this process wrote to local
  disk while reading (``/proc/self/io``);
- at 20 ms, the peers reading the same corpus in their own formats from the
  same server (``bench/peers/remote.py``: MosaicML streaming and litdata, their
  recommended settings, an empty cache first): tokens/s, first batch and the
  local cache they filled. They download whole shards and shuffle within
  them; tokload reads only each window's bytes, in a global order.

Environment: TOKLOAD_BENCH_REMOTE_TOKENS (corpus size, default 200000000),
TOKLOAD_BENCH_REMOTE_SECONDS (per measurement, default 6),
TOKLOAD_BENCH_REMOTE_PEERS=0 to skip the peers.
"""

from __future__ import annotations

import asyncio
import os
import random
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch  # noqa: F401 - imported before any timing: a trainer has it loaded already

pytest.importorskip("obstore")
pytest.importorskip("moto")

import tokload
from bench import _results
from bench.s3local import LocalS3Process

WINDOW = 4097
BATCH = 8
TOKENS = int(os.environ.get("TOKLOAD_BENCH_REMOTE_TOKENS", 200_000_000))
PEERS = os.environ.get("TOKLOAD_BENCH_REMOTE_PEERS", "1") != "0"
SECONDS = float(os.environ.get("TOKLOAD_BENCH_REMOTE_SECONDS", 6))
BUCKET = "bench"
NAME = "bench_remote"


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[LocalS3Process, str]]:
    from bench.peers.corpus import documents

    tmp = Path(tempfile.mkdtemp(prefix="tokload-bench-remote-"))
    stream, bounds = documents(TOKENS)  # the peers' corpus, token for token
    # 8 MB shards: moto reads a whole object for every ranged GET (a 256 MB shard
    # serves about 20 GETs/s), which S3 does not; small objects keep the server's
    # limit on requests, not on moto's copies
    with tokload.Writer(tmp / "ds", "<u4", shard_bytes=8 << 20) as w:
        for a, b in zip(bounds[:-1].tolist(), bounds[1:].tolist(), strict=True):
            w.write(stream[a:b])
    del stream, bounds
    srv = LocalS3Process()
    try:
        srv.create_bucket(BUCKET)
        srv.upload_dir(str(tmp / "ds"), BUCKET, "ds")
        os.environ.update(srv.env())
        yield srv, f"s3://{BUCKET}/ds"
    finally:
        srv.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def _write_bytes() -> int:
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("write_bytes:"):
                return int(line.split()[1])
    return 0


def _probe(url: str, inflight: int, seconds: float) -> float:
    """Tokens/s of ranged GETs of one window's bytes at random offsets, ``inflight`` at once."""
    import obstore as obs

    from tokload import remote

    objs = [o for u, o in remote.listing(url).items() if u.endswith(".rows")]
    nbytes = WINDOW * 4
    done = 0

    async def worker(deadline: float, rnd: random.Random) -> None:
        nonlocal done
        while time.perf_counter() < deadline:
            o = objs[rnd.randrange(len(objs))]
            start = rnd.randrange(0, max(1, o.size - nbytes)) & ~3
            await obs.get_range_async(o.store.store, o.key, start=start, length=nbytes)
            done += 1

    async def run() -> float:
        t0 = time.perf_counter()
        await asyncio.gather(*[worker(t0 + seconds, random.Random(k)) for k in range(inflight)])
        return time.perf_counter() - t0

    elapsed = asyncio.run(run())
    return done * WINDOW / elapsed


def _tokload(url: str, seconds: float) -> dict[str, Any]:
    w0 = _write_bytes()
    t0 = time.perf_counter()
    view = tokload.TokenStream(url, WINDOW)
    t_open = time.perf_counter()
    loader = tokload.DataLoader(view, BATCH, seed=1, num_threads=4, prefetch=64)
    try:
        it = iter(loader)
        next(it)
        t_first = time.perf_counter()
        n = 0
        while time.perf_counter() - t_first < seconds:
            next(it)
            n += 1
        rate = n * BATCH * WINDOW / (time.perf_counter() - t_first)
        # a trainer at 80% of that rate: its waits once the prefetch is full
        step = BATCH * WINDOW / (0.8 * rate)
        time.sleep(min(5.0, 64 * step))  # let the prefetch fill
        waits = []
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            t = time.perf_counter()
            next(it)
            waits.append(time.perf_counter() - t)
            spare = step - (time.perf_counter() - t)
            if spare > 0:
                time.sleep(spare)
    finally:
        loader.close()
    return {
        "open_s": t_open - t0,
        "first_batch_s": t_first - t_open,
        "open_to_first_batch_s": t_first - t0,
        "tokens_per_s": rate,
        "wait_p50_ms": float(np.percentile(waits, 50) * 1e3),
        "wait_p999_ms": float(np.percentile(waits, 99.9) * 1e3),
        "wait_max_ms": float(np.max(waits) * 1e3),
        "waits": len(waits),
        "local_bytes_written": _write_bytes() - w0,
    }


@pytest.mark.parametrize("latency_ms", [20, 100])
def test_shuffled_windows_from_s3(server: tuple[LocalS3Process, str], latency_ms: int) -> None:
    srv, url = server
    srv.set_latency(latency_ms)
    probes = {n: _probe(url, n, SECONDS / 2) for n in (16, 64, 256)}
    best_n = max(probes, key=lambda n: probes[n])
    got = _tokload(url, SECONDS)
    srv.set_latency(0)
    for n, rate in probes.items():
        _results.record(
            NAME, label=f"probe: {n} GETs in flight", latency_ms=latency_ms, tokens_per_s=rate
        )
    _results.record(NAME, label="tokload DataLoader", latency_ms=latency_ms, tokens=TOKENS, **got)
    peers: list[dict[str, Any]] = []
    if PEERS and latency_ms == 20:
        from bench.peers.remote import measure_remote_peers

        srv.set_latency(latency_ms)
        peers = measure_remote_peers(srv.endpoint, srv.env(), SECONDS, TOKENS)
        srv.set_latency(0)
        for row in peers:
            _results.record(NAME, latency_ms=latency_ms, **row)
            print(f"  {row['label']}: {row.get('tokens_per_s', row.get('error'))}")
    share = got["tokens_per_s"] / probes[best_n]
    print(
        f"\n{latency_ms} ms per request: probe best {probes[best_n] / 1e6:.2f} M tokens/s "
        f"({best_n} in flight); tokload {got['tokens_per_s'] / 1e6:.2f} M tokens/s = "
        f"{100 * share:.0f}% of it; open {got['open_s']:.2f} s, first batch after "
        f"{got['first_batch_s']:.2f} s; next() p99.9 {got['wait_p999_ms']:.1f} ms; "
        f"local bytes written {got['local_bytes_written']}"
    )
    _results.goal(
        NAME,
        f"tokload / probe's best, {latency_ms} ms per request",
        0.70,
        share,
    )
    if latency_ms == 100:
        _results.goal(
            NAME,
            "open to first batch, 100 ms per request (s)",
            1.0,
            got["open_to_first_batch_s"],
            higher_is_better=False,
        )
    if latency_ms == 20:
        _results.goal(
            NAME,
            "next() p99.9 wait once the prefetch is full, 20 ms per request (ms)",
            5.0,
            got["wait_p999_ms"],
            higher_is_better=False,
            fmt="{:.1f}",
        )
    rates = [float(r["tokens_per_s"]) for r in peers if r.get("tokens_per_s")]
    if rates:
        _results.goal(
            NAME,
            "tokload / the best peer, 20 ms per request",
            5.0,
            got["tokens_per_s"] / max(rates),
        )
    _results.goal(
        NAME,
        f"local disk written while reading, {latency_ms} ms (bytes)",
        0,
        got["local_bytes_written"],
        higher_is_better=False,
        fmt="{:.0f}",
    )
