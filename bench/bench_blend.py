"""Constructing a blend: tokload (nothing stored) against Megatron-style index arrays,
and a blend of 1,000 components.

    python -m pytest bench/bench_blend.py -o python_files='bench_*.py' -s
    TOKLOAD_BENCH_BLEND_N=1000000000 python -m pytest bench/bench_blend.py ...  # 10 GB

Megatron's BlendedDataset (and nanotron's) precomputes, per training sample,
a dataset index (int16) and a sample index (int64) before training starts. The
NumPy baseline builds those two arrays for N samples of a 3-source mixture
(sources drawn with the weights, sample indices by running count per
source). tokload's Blend over the same N positions stores only its segments;
the figures are time and peak traced memory of construction, plus what a
lookup of a batch costs once built.

Reading many sources: the DataLoader flat out (1 reader thread, host batches,
batches of 8) over a blend of 16 and of 256 tokload builds against the same
loader over one build of the same 32M ``uint32`` tokens (documents of log-normal
lengths, page cache warm), as token windows of 4,096, as the same windows with
every attention key (``boundaries=True``) and as ``Fill(4096)`` with every
attention key: time per batch, and the blend's speed over the single
source's (median of 5 rounds of the two in turns, the order reversed every other
round: ``bench_packing.in_rounds``).

Many components (issue 36): 1,000 tiny local tokload builds (8 ``uint16``
documents each, about 0.7 MB on disk in all, deleted after), opened as
``Documents`` and blended with ``tokload.Blend([(Documents(p), 1), ...],
length=..., block_size=...)``: the time to open the 1,000 views and the time of
the ``Blend`` constructor alone (median of 3 runs, each with views opened anew;
goal: both together under 1 s), and the Python heap the views and the blend
hold once built (tracemalloc: Python and NumPy allocations, not C's ``malloc``)
for 100 and 1,000 components, per component: linear when the two agree.
``TOKLOAD_BENCH_BLEND_COMPONENTS`` changes the 1,000.
"""

from __future__ import annotations

import itertools
import os
import shutil
import statistics
import tempfile
import time
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import tokload
from bench import _results
from bench.bench_packing import in_rounds, lognormal

N = int(os.environ.get("TOKLOAD_BENCH_BLEND_N", 100_000_000))
READ_TOKENS = 32 << 20
"""Tokens of the single source, and of each blend in all (``test_reading_many_sources``)."""
READ_COMPONENTS = (16, 256)
READ_ROUNDS, READ_ROUND_S = 5, 0.5
WINDOW, BATCH = 4096, 8
COMPONENTS = int(os.environ.get("TOKLOAD_BENCH_BLEND_COMPONENTS", 1000))
DOCS_PER_COMPONENT = 8
WEIGHTS = [0.6, 0.3, 0.1]
RESULTS: dict[str, tuple[float, int]] = {}


@pytest.fixture(scope="module")
def views() -> Iterator[list[tokload.TokenStream]]:
    tmp = Path(tempfile.mkdtemp(prefix="tokload-bench-"))
    try:
        out = []
        for c, n in enumerate([1_000_000, 300_000, 50_000]):
            with tokload.Writer(tmp / f"c{c}", "<u4") as w:
                w.write(np.arange(n * 4, dtype=np.uint32))
            out.append(tokload.TokenStream(tmp / f"c{c}", window=4))
        yield out
    finally:
        shutil.rmtree(tmp)


def _measure(fn: Callable[[], Any]) -> tuple[float, int, Any]:
    tracemalloc.start()
    t0 = time.perf_counter()
    obj = fn()
    dt = time.perf_counter() - t0
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return dt, peak, obj


def megatron_style_arrays(n: int, sizes: list[int], seed: int = 0) -> tuple[Any, Any]:
    rng = np.random.default_rng(seed)
    dataset_index = rng.choice(len(WEIGHTS), size=n, p=WEIGHTS).astype(np.int16)
    sample_index = np.empty(n, dtype=np.int64)
    for d, size in enumerate(sizes):
        where = np.flatnonzero(dataset_index == d)
        sample_index[where] = np.arange(len(where), dtype=np.int64) % size
    return dataset_index, sample_index


def test_construction(views: list[tokload.TokenStream]) -> None:
    sizes = [len(v) for v in views]
    t_blend, m_blend, blend = _measure(
        lambda: tokload.Blend(
            list(zip(views, WEIGHTS, strict=True)), seed=0, length=N, block_size=1000
        )
    )
    t_np, m_np, arrays = _measure(lambda: megatron_style_arrays(N, sizes))
    RESULTS["tokload Blend"] = (t_blend, m_blend)
    RESULTS["NumPy Megatron-style arrays"] = (t_np, m_np)
    idx = np.random.default_rng(0).integers(0, N, 4096)
    t0 = time.perf_counter()
    blend.locate(idx)
    t_lookup = time.perf_counter() - t0
    del arrays
    for label, (seconds, peak) in RESULTS.items():
        _results.record(
            "bench_blend",
            label=label,
            positions=N,
            construction_s=seconds,
            peak_traced_bytes=peak,
        )
    _results.record(
        "bench_blend",
        label="tokload Blend.locate, 4096 random positions",
        positions=N,
        lookup_s=t_lookup,
    )
    print(f"\nblend of 3 components over N = {N:,} positions:")
    print(f"  tokload Blend:               {t_blend * 1e3:10.2f} ms, {m_blend / 1e3:12.1f} KB")
    print(f"  NumPy Megatron-style arrays: {t_np * 1e3:10.2f} ms, {m_np / 1e6:12.1f} MB")
    print(
        f"  ratio: {t_np / t_blend:,.0f}x the time, {m_np / max(m_blend, 1):,.0f}x the memory; "
        f"a lookup of 4096 random positions then takes {t_lookup * 1e3:.1f} ms"
    )


@pytest.fixture(scope="module")
def many() -> Iterator[list[Path]]:
    """``COMPONENTS`` tiny tokload builds (``DOCS_PER_COMPONENT`` documents of 16 to 23
    ``uint16`` tokens each), removed after."""
    tmp = Path(tempfile.mkdtemp(prefix="tokload-bench-many-"))
    try:
        paths = []
        for c in range(COMPONENTS):
            paths.append(tmp / f"c{c:04d}")
            with tokload.Writer(paths[-1], np.uint16, durable=False) as w:
                for d in range(DOCS_PER_COMPONENT):
                    w.write(np.full(16 + d, c % 60_000 + 1, dtype=np.uint16))
        disk = sum(p.stat().st_size for p in tmp.rglob("*") if p.is_file())
        print(f"\n{COMPONENTS:,} tokload builds: {disk / 1e6:.2f} MB on disk")
        yield paths
    finally:
        shutil.rmtree(tmp)


def _open_and_blend(paths: list[Path]) -> tuple[list[tokload.Documents], tokload.Blend, float]:
    """The views of ``paths`` and their blend; the time of the Blend constructor alone."""
    views = [tokload.Documents(p) for p in paths]
    t0 = time.perf_counter()
    blend = tokload.Blend(
        [(v, 1) for v in views], length=DOCS_PER_COMPONENT * len(paths), block_size=len(paths)
    )
    return views, blend, time.perf_counter() - t0


def test_many_components(many: list[Path]) -> None:
    n = len(many)
    opens, blends, totals = [], [], []
    for _ in range(3):  # each run opens every view anew
        t0 = time.perf_counter()
        views, blend, t_blend = _open_and_blend(many)
        total = time.perf_counter() - t0
        assert len(blend) == DOCS_PER_COMPONENT * n and len(blend.views) == n
        opens.append(total - t_blend)
        blends.append(t_blend)
        totals.append(total)
        del views, blend
    t_open, t_blend, t_total = (statistics.median(x) for x in (opens, blends, totals))
    _results.record(
        "bench_blend",
        label=f"Blend of {n:,} local tokload builds",
        components=n,
        documents_per_component=DOCS_PER_COMPONENT,
        open_views_s=t_open,
        blend_constructor_s=t_blend,
        total_s=t_total,
        total_s_runs=totals,
    )
    _results.goal(
        "bench_blend",
        f"a Blend of {n:,} local components opens: {n:,} Documents opened plus the Blend "
        "constructor (seconds, median of 3; issue 36)",
        1.0,
        t_total,
        higher_is_better=False,
        fmt="{:.3f} s",
    )
    print(f"blend of {n:,} components: open the views {t_open * 1e3:.1f} ms, Blend "
          f"{t_blend * 1e3:.2f} ms, together {t_total * 1e3:.1f} ms "
          f"(runs: {', '.join(f'{t * 1e3:.1f}' for t in totals)} ms)")  # fmt: skip
    for k in sorted({min(100, n), n}):
        tracemalloc.start()
        before, _ = tracemalloc.get_traced_memory()
        views, blend, _ = _open_and_blend(many[:k])
        after, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        assert len(blend.views) == k
        del views, blend
        held, peak = after - before, peak - before
        _results.record(
            "bench_blend",
            label=f"Blend of {k:,} components: Python heap held (tracemalloc)",
            components=k,
            heap_bytes=held,
            heap_peak_bytes=peak,
            bytes_per_component=held / k,
        )
        print(f"  {k:5,} components: {held / 1e6:.2f} MB held ({held / k:,.0f} B per "
              f"component), peak {peak / 1e6:.2f} MB")  # fmt: skip


@pytest.fixture(scope="module")
def sources() -> Iterator[dict[int, list[Path]]]:
    """``READ_TOKENS`` ``uint32`` tokens in documents of log-normal lengths (median
    600, sigma 1: ``bench_packing.lognormal``) as one tokload build, and as ``C``
    builds of a ``C``-th each for each ``C`` in ``READ_COMPONENTS``; the page
    cache warm; removed after."""
    tmp = Path(tempfile.mkdtemp(prefix="tokload-bench-read-"))
    try:
        out: dict[int, list[Path]] = {}
        for c in (1, *READ_COMPONENTS):
            rng = np.random.default_rng(c)
            per = READ_TOKENS // c
            out[c] = []
            for k in range(c):
                out[c].append(tmp / f"{c}-{k:03d}")
                tokens = rng.integers(1, 128_000, per, dtype=np.uint32)
                ends = np.cumsum(lognormal(per // 300, seed=1000 * c + k))
                bounds = [0, *ends[ends < per].tolist(), per]
                with tokload.Writer(out[c][-1], "<u4", shard_bytes=64 << 20, durable=False) as w:
                    for a, e in itertools.pairwise(bounds):
                        w.write(tokens[a:e])
        for p in tmp.rglob("*"):
            if p.is_file():
                p.read_bytes()  # warm the page cache
        yield out
    finally:
        shutil.rmtree(tmp)


def _per_batch(view: Any, batching: Any) -> float:
    """Seconds per batch of the DataLoader flat out (1 reader thread, host batches)
    over ``READ_ROUND_S``, after 50 batches."""
    loader = tokload.DataLoader(view, BATCH, batching=batching, seed=1, num_threads=1, device=None)
    try:
        it = iter(loader)
        for _ in range(50):
            next(it)
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < READ_ROUND_S:
            next(it)
            n += 1
        return (time.perf_counter() - t0) / n
    finally:
        loader.close()


def test_reading_many_sources(sources: dict[int, list[Path]]) -> None:
    """A blend's batches against a single source's of the same tokens: windows of
    ``WINDOW`` (``Stack``), without and with their documents' attention keys, and
    ``Fill(WINDOW)`` with every attention key, for a
    blend of each ``READ_COMPONENTS`` (weights: their sizes). Rounds of the two in
    turns; the ratio is the median of the rounds' (the VM drifts)."""
    kinds: dict[str, tuple[Callable[[Path], Any], Any]] = {
        "token windows": (lambda p: tokload.TokenStream(p, window=WINDOW), None),
        "token windows with boundaries=True": (
            lambda p: tokload.TokenStream(p, window=WINDOW, boundaries=True),
            None,
        ),
        "Fill(4096), every attention key": (tokload.Documents, tokload.Fill(WINDOW)),
    }
    print()
    for kind, (make, batching) in kinds.items():
        single = make(sources[1][0])
        for c in READ_COMPONENTS:
            views = [make(p) for p in sources[c]]
            blend = tokload.Blend([(v, len(v)) for v in views], length=sum(map(len, views)))
            times = in_rounds(
                {
                    "one": lambda v=single, b=batching: _per_batch(v, b),
                    "many": lambda v=blend, b=batching: _per_batch(v, b),
                },
                READ_ROUNDS,
            )
            one, many = times["one"], times["many"]
            speed = statistics.median(a / b for a, b in zip(one, many, strict=True))
            _results.record(
                "bench_blend",
                label=f"{kind}, blend of {c} sources",
                policy=kind,
                components=c,
                batch_s=statistics.median(many),
                single_batch_s=statistics.median(one),
                speed_over_single=speed,
                speed_over_single_runs=[a / b for a, b in zip(one, many, strict=True)],
            )
            print(f"{kind}: blend of {c} sources {statistics.median(many) * 1e6:.1f} us per "
                  f"batch, a single source {statistics.median(one) * 1e6:.1f} us: {speed:.2f} "
                  "of its speed")  # fmt: skip
