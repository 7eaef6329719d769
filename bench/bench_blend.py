"""Constructing a blend: tokload (nothing stored) against Megatron-style index arrays.

    python -m pytest bench/bench_blend.py -o python_files='bench_*.py' -s
    TOKLOAD_BENCH_BLEND_N=1000000000 python -m pytest bench/bench_blend.py ...  # 10 GB

Megatron's BlendedDataset (and nanotron's) precomputes, per training sample,
a dataset index (int16) and a sample index (int64) before training starts. The
NumPy baseline builds those two arrays for N samples of a 3-source mixture
(sources drawn with the weights, sample indices by running count per
source). tokload's Blend over the same N positions stores only its segments;
the figures are time and peak traced memory of construction, plus what a
lookup of a batch costs once built.
"""

from __future__ import annotations

import os
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

N = int(os.environ.get("TOKLOAD_BENCH_BLEND_N", 100_000_000))
WEIGHTS = [0.6, 0.3, 0.1]
RESULTS: dict[str, tuple[float, int]] = {}


@pytest.fixture(scope="module")
def views() -> Iterator[list[tokload.TokenStream]]:
    tmp = Path(tempfile.mkdtemp(prefix="tokload-bench-"))
    out = []
    for c, n in enumerate([1_000_000, 300_000, 50_000]):
        with tokload.Writer(tmp / f"c{c}", "<u4") as w:
            w.write(np.arange(n * 4, dtype=np.uint32))
        out.append(tokload.TokenStream(tmp / f"c{c}", window=4))
    yield out


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
