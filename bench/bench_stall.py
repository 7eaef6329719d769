"""Stalls: how long a trainer's ``next()`` blocks when the storage hiccups.

    sudo flock /tmp/tokload-bench.lock \\
        python -m pytest bench/bench_stall.py -o python_files='bench_*.py' -s

Needs root, ``/dev/fuse``, ``fusermount3`` and libfuse3's headers (``apt-get
install libfuse3-dev fuse3 pkg-config``); it says which is missing and skips
otherwise.  Every loader reads through ``bench/delayfs/delayfs.c`` (compiled
into a temporary directory), a FUSE passthrough of the corpus that adds
``BASE_US`` to every read and ``DELAY_MS`` more to a fraction ``FRACTION`` of
them, so every loader, peers included, sees the same slow storage.  The files
behind it are kept in the page cache, so the injected latency is the storage's
only latency; each measurement mounts it afresh, so the FUSE side starts cold.

The corpus is bench_cold's 2 GiB of uint32 tokens (``$TOKLOAD_COLD_DIR``) as one
``flat.bin`` and in the peers' formats (``bench_cold.peer_corpus``).  In one run:

1. the storage's throughput through the delay filesystem: the C probe
   (``bench/probe.c``) reading random 4097-token windows with 16, 64 and 128
   reads in flight; the best figure is the storage's;
2. a simulated trainer (``bench/peers/child.py``, mode ``stall``, one fresh
   process per loader) that takes batches of 8 windows of 4097 tokens and sleeps
   after each for the time a step takes at half that throughput; after
   ``WARMUP`` batches it records how long each of ``BATCHES`` ``next()`` calls
   blocks; for tokload's defaults and a few ``prefetch``/``num_threads``
   values, a stream with metadata blocks (``meta_corpus``: 512 M uint16 tokens
   of the same, one record per 100 tokens) with read-ahead on and off, a plain
   ``torch.utils.data.DataLoader`` + ``np.memmap`` (0 and 2 workers), and where
   the peers' environment exists, litdata and Megatron-core (0 and 2 workers).

``TOKLOAD_STALL_LOADERS=tokload-flat,tokload-meta,memmap,litdata,megatron`` picks loaders;
``TOKLOAD_STALL_SWEEP=2x512,8x512`` replaces the sweep of tokload's threads x prefetch.
It prints p50/p99/p99.9/max of the wait in ms and the reads each loader made
through the filesystem (and how many of them were delayed), and writes them to
``bench/results/bench_stall.json`` with issue 11's goals: with its defaults,
tokload's p99.9 wait at most 1 ms, and no peer's p99.9 lower.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from bench import _results
from bench.bench_cold import (
    BATCH,
    PEERS_PY,
    WINDOW,
    compile_probe,
    make_corpus,
    peer_corpus,
    run_child,
)

DELAY_MS = int(os.environ.get("TOKLOAD_STALL_DELAY_MS", "200"))
FRACTION = float(os.environ.get("TOKLOAD_STALL_FRACTION", "0.001"))
BASE_US = int(os.environ.get("TOKLOAD_STALL_BASE_US", "500"))
SEED = 11
BATCHES = int(os.environ.get("TOKLOAD_STALL_BATCHES", "3000"))
WARMUP = 200
PROBE_READS = 32_000
ROOT = Path(__file__).resolve().parents[1]


def _missing() -> str | None:
    """Why the delay filesystem cannot run here, or None."""
    if os.geteuid() != 0:
        return "bench_stall needs root (to mount FUSE; run it with sudo)"
    if not os.path.exists("/dev/fuse"):
        return "bench_stall needs /dev/fuse"
    if shutil.which("fusermount3") is None:
        return "bench_stall needs fusermount3 (apt-get install fuse3)"
    if subprocess.run(["pkg-config", "--exists", "fuse3"], check=False).returncode:
        return "bench_stall needs libfuse3's headers (apt-get install libfuse3-dev pkg-config)"
    return None


pytestmark = pytest.mark.skipif(_missing() is not None, reason=_missing() or "")


def compile_delayfs(exe: Path) -> Path:
    """Build ``bench/delayfs/delayfs.c`` against libfuse3 into ``exe``."""
    flags = subprocess.run(
        ["pkg-config", "--cflags", "--libs", "fuse3"], check=True, capture_output=True, text=True
    ).stdout.split()
    src = ROOT / "bench" / "delayfs" / "delayfs.c"
    subprocess.run(["cc", "-O2", "-Wall", str(src), "-o", str(exe), *flags], check=True)
    return exe


@contextmanager
def mounted(
    exe: Path,
    source: Path,
    mountpoint: Path,
    *,
    delay_ms: int,
    fraction: float,
    base_us: int,
    seed: int,
    stats: dict[str, int] | None = None,
) -> Iterator[Path]:
    """Mount ``source`` read-only at ``mountpoint`` through delayfs, for the block.

    ``stats`` (when given) receives the daemon's counts at unmount: ``reads``,
    ``delayed`` and ``bytes``.
    """
    mountpoint.mkdir(parents=True, exist_ok=True)
    opts = f"delay_ms={delay_ms},fraction={fraction},base_us={base_us},seed={seed},max_threads=256"
    proc = subprocess.Popen(
        [str(exe), str(source), str(mountpoint), "-f", "-o", opts],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 10
        while not os.path.ismount(mountpoint):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"delayfs did not mount {mountpoint}")
            time.sleep(0.02)
        yield mountpoint
    finally:
        # A reader's last requests (an io_uring worker's, say) may outlive its process by
        # a delay: retry while the mount is busy, then detach it lazily.
        deadline = time.monotonic() + 5
        while os.path.ismount(mountpoint):
            done = subprocess.run(["fusermount3", "-u", str(mountpoint)], capture_output=True)
            if done.returncode and time.monotonic() > deadline:
                subprocess.run(["fusermount3", "-u", "-z", str(mountpoint)], check=False)
                break
            time.sleep(0.1 if done.returncode else 0)
        try:
            _, err = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
        line = [ln for ln in err.splitlines() if ln.startswith("delayfs: reads")]
        if stats is not None and line:
            words = line[-1].split()
            stats.update(reads=int(words[2]), delayed=int(words[4]), bytes=int(words[6]))


def warm(paths: list[Path]) -> None:
    """Read files into the page cache (the storage behind the filesystem is fast)."""
    for p in paths:
        with open(p, "rb") as f:
            while f.read(1 << 24):
                pass


@pytest.fixture(scope="module")
def tools(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("stall-tools")
    return {"delayfs": compile_delayfs(d / "delayfs"), "probe": compile_probe(d / "probe")}


def _configs() -> list[tuple[str, str, str, int, list[str]]]:
    """(label, python, loader, workers, extra args) of every measured loader."""
    me = sys.executable
    rows: list[tuple[str, str, str, int, list[str]]] = [
        ("tokload defaults (read-ahead on)", me, "tokload-flat", -1, []),
        ("tokload, read-ahead off", me, "tokload-flat", -1, ["--readahead", "off"]),
    ]
    for pf in (128, 256, 1024):
        rows.append((f"tokload prefetch={pf}", me, "tokload-flat", -1, ["--prefetch", str(pf)]))
    # more reader threads than this 2-core machine's default of 1 (GPU nodes get 4)
    sweep = os.environ.get("TOKLOAD_STALL_SWEEP")  # e.g. "2x512,8x512": threads x prefetch
    pairs = (
        [tuple(int(v) for v in p.split("x")) for p in sweep.split(",")]
        if sweep
        else [(2, 512), (4, 512)]
    )
    for th, pf in pairs:
        label = f"tokload num_threads={th}, prefetch={pf}"
        rows.append((label, me, "tokload-flat", th, ["--prefetch", str(pf)]))
    # a stream with metadata blocks (uint16 tokens, 1 record / 100 tokens): its
    # read-ahead hints the blocks as well as the rows
    rows.append(("tokload metadata stream, defaults", me, "tokload-meta", -1, []))
    rows.append(
        ("tokload metadata stream, read-ahead off", me, "tokload-meta", -1, ["--readahead", "off"])
    )
    for w in (0, 2):
        rows.append((f"torch DataLoader + np.memmap, {w} workers", me, "memmap", w, []))
    for w in (0, 2):
        rows.append((f"litdata, {w} workers", str(PEERS_PY), "litdata", w, []))
    for w in (0, 2):
        rows.append((f"Megatron-core GPTDataset, {w} workers", str(PEERS_PY), "megatron", w, []))
    only = os.environ.get("TOKLOAD_STALL_LOADERS")  # e.g. "tokload-flat,memmap"
    return [r for r in rows if only is None or r[2] in only.split(",")]


META_TOKENS, META_DOC, META_EVERY = 512 << 20, 2048, 100


def meta_corpus(source: Path) -> Path:
    """``source/meta``: META_TOKENS uint16 tokens (the first of ``flat.bin``'s,
    modulo 65,536) in documents of META_DOC with one 8-byte record per
    META_EVERY tokens, as metadata blocks (written once, then reused)."""
    out = source / "meta"
    if (out / "manifest.json").exists():
        return out
    import tokload

    flat = np.memmap(source / "flat.bin", dtype=np.uint32, mode="r")
    spans = [(a, a + META_EVERY, b"") for a in range(0, META_DOC, META_EVERY)]
    spans[-1] = (spans[-1][0], META_DOC, b"")
    with tokload.Writer(out, "<u2", metadata=True, durable=False) as w:
        for d in range(META_TOKENS // META_DOC):
            toks = (flat[d * META_DOC : (d + 1) * META_DOC] & 0xFFFF).astype(np.uint16)
            w.write(toks, spans=[(a, e, b"%08d" % (d * META_DOC + a)) for a, e, _ in spans])
    return out


def test_stalls(tools: dict[str, Path], tmp_path: Path) -> None:
    parts = make_corpus()
    source = peer_corpus(parts)
    flat = source / "flat.bin"
    if any(r[2] == "tokload-meta" for r in _configs()):
        meta_corpus(source)
    read = (WARMUP + BATCHES + 1) * BATCH * WINDOW * 4
    assert 4 * read <= flat.stat().st_size, "the corpus must be 4x what a measurement reads"
    warm([p for p in source.rglob("*") if p.is_file()])
    mnt = tmp_path / "mnt"

    def mount(stats: dict[str, int] | None = None) -> Any:
        return mounted(
            tools["delayfs"],
            source,
            mnt,
            delay_ms=DELAY_MS,
            fraction=FRACTION,
            base_us=BASE_US,
            seed=SEED,
            stats=stats,
        )

    # 1. The storage's throughput through the delay filesystem.
    probe: dict[int, float] = {}
    for depth in (16, 64, 128):
        with mount() as m:
            out = subprocess.run(
                [
                    str(tools["probe"]),
                    "threads",
                    str(WINDOW * 4),
                    str(PROBE_READS),
                    str(depth),
                    "1",
                    str(m / "flat.bin"),
                ],
                check=True,
                capture_output=True,
                text=True,
            ).stdout.split()
        probe[depth] = PROBE_READS * WINDOW / float(out[0])
    storage = max(probe.values())
    rate = storage / 2
    step = BATCH * WINDOW / rate

    # 2. The simulated trainer on each loader.
    results: dict[str, tuple[np.ndarray, dict[str, int], float] | str] = {}
    for label, python, loader, workers, extra in _configs():
        if python == str(PEERS_PY) and not PEERS_PY.exists():
            results[label] = "skipped: no peers' environment (run python bench/peers/run.py)"
            continue
        stats: dict[str, int] = {}
        t0 = time.perf_counter()
        with mount(stats) as m:
            res: dict[str, Any] = run_child(
                python,
                loader,
                workers,
                m,
                "stall",
                "--batches",
                str(BATCHES),
                "--warmup",
                str(WARMUP),
                "--step",
                f"{step:.6f}",
                *extra,
            )
        waits = np.asarray(res["waits_ms"], dtype=np.float64)
        assert len(waits) == BATCHES, (label, len(waits))
        results[label] = (waits, stats, time.perf_counter() - t0)

    print(
        f"\nstalls: delayfs adds {BASE_US} us to every read and {DELAY_MS} ms to 1 read in "
        f"{round(1 / FRACTION) if FRACTION else 'none'}; storage through it (C probe, random "
        f"{WINDOW * 4} B reads): "
        + ", ".join(f"{d} in flight {r / 1e6:.1f}" for d, r in probe.items())
        + f" M tokens/s; the trainer takes {rate / 1e6:.1f} M tokens/s (a step of "
        f"{step * 1e3:.3f} ms per batch of {BATCH} x {WINDOW}); {BATCHES} batches timed "
        f"after {WARMUP}"
    )
    print(
        f"{'loader':<42} {'p50 ms':>8} {'p99 ms':>8} {'p99.9 ms':>9} {'max ms':>8} "
        f"{'waited s':>8} {'reads':>7} {'delayed':>7}"
    )
    for depth, got in probe.items():
        _results.record(
            "bench_stall", loader=f"C probe, {depth} reads in flight", m_tokens_per_s=got / 1e6
        )
    p999s: dict[str, float] = {}
    for label, r in results.items():
        if isinstance(r, str):
            print(f"{label:<42} {r}")
            _results.record("bench_stall", loader=label, note=r)
            continue
        waits, stats, _ = r
        p50, p99, p999 = np.percentile(waits, [50, 99, 99.9])
        p999s[label] = float(p999)
        print(
            f"{label:<42} {p50:>8.3f} {p99:>8.3f} {p999:>9.3f} {waits.max():>8.1f} "
            f"{waits.sum() / 1e3:>8.2f} {stats.get('reads', 0):>7} {stats.get('delayed', 0):>7}"
        )
        _results.record(
            "bench_stall",
            loader=label,
            p50_ms=float(p50),
            p99_ms=float(p99),
            p999_ms=float(p999),
            max_ms=float(waits.max()),
            waited_s=float(waits.sum() / 1e3),
            reads=stats.get("reads"),
            delayed=stats.get("delayed"),
        )
    _stall_goals(p999s, rate)


def _stall_goals(p999s: dict[str, float], rate: float) -> None:
    """Issue 11's goals for stalls, from the p99.9 waits of this run (ms)."""
    default = p999s.get("tokload defaults (read-ahead on)")
    if default is None:  # TOKLOAD_STALL_LOADERS left it out
        return
    _results.goal(
        "bench_stall",
        f"tokload defaults: p99.9 next() wait (ms), trainer at {rate / 1e6:.0f} M tokens/s "
        f"(half the storage's), {DELAY_MS} ms added to 1 read in {round(1 / FRACTION)}",
        1.0,
        default,
        higher_is_better=False,
        fmt="{:.2f}",
    )
    peers = {k: v for k, v in p999s.items() if not k.startswith("tokload")}
    if peers:
        best = min(peers, key=peers.__getitem__)
        _results.goal(
            "bench_stall",
            f"tokload defaults' p99.9 wait over the best peer's ({best})",
            1.0,
            default / peers[best] if peers[best] > 0 else float("inf"),
            higher_is_better=False,
            fmt="{:.2f}x",
        )
