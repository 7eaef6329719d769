"""Permutation throughput: tokload's batch fill against pygfc and numpy.

    python -m pytest bench/bench_permute.py -o python_files='bench_*.py'

For each n: tokload filling a range and permuting a random index array (both
one call, in C without the GIL, one core), pygfc's per-index ``p[i]`` from a
Python loop (its only API), and ``numpy.random.default_rng(s).permutation(n)``
amortized per index (it must materialize all n; skipped where n * 8 bytes does
not fit in memory).  The summary prints indices/s and ratios.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from bench._results import make_goal
from tokload import Permutation

SIZES = {"1e6": 10**6, "2.7e8": 270_000_000, "1e12": 10**12}
BATCH = 1 << 20
PYGFC_CALLS = 100_000


def _info(benchmark: Any, items: int, label: str, compare: list[str] | None = None) -> None:
    benchmark.extra_info.update(items=items, unit="idx", label=label, compare=compare or [])


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("table", ["auto", "off"])
def test_tokload_range(benchmark: Any, size: str, table: str) -> None:
    n = SIZES[size]
    p = Permutation(n, seed=7, table=None if table == "auto" else False)
    out = np.empty(min(n, BATCH), dtype=np.uint64)
    start = n // 3 if n > 2 * BATCH else 0
    p.range(start, start + len(out), out=out)  # builds the table if it is worth it
    benchmark.group = f"n={size}"
    compare = ["pygfc p[i] loop", "numpy permutation"] if table == "auto" else []
    _info(benchmark, len(out), f"tokload range (table {table})", compare)
    benchmark(p.range, start, start + len(out), out)


@pytest.mark.parametrize("size", SIZES)
def test_tokload_take(benchmark: Any, size: str) -> None:
    n = SIZES[size]
    p = Permutation(n, seed=7)
    idx = np.random.default_rng(0).integers(0, n, size=BATCH, dtype=np.uint64)
    out = np.empty_like(idx)
    p.take(idx, out=out)
    benchmark.group = f"n={size}"
    _info(benchmark, BATCH, "tokload take (random indices)", ["pygfc p[i] loop"])
    benchmark(p.take, idx, out)


@pytest.mark.parametrize("size", SIZES)
def test_pygfc_per_index(benchmark: Any, size: str) -> None:
    pygfc = pytest.importorskip("pygfc")
    n = SIZES[size]
    p = pygfc.Permutation(n, 6, 7)
    idx = range(n // 3, n // 3 + PYGFC_CALLS)

    def run() -> int:
        acc = 0
        for i in idx:
            acc ^= p[i]
        return acc

    benchmark.group = f"n={size}"
    _info(benchmark, PYGFC_CALLS, "pygfc p[i] loop")
    benchmark.pedantic(run, rounds=3, iterations=1)


@pytest.mark.parametrize("size", SIZES)
def test_numpy_permutation(benchmark: Any, size: str) -> None:
    n = SIZES[size]
    if n * 8 * 2 > 16 << 30:
        pytest.skip(f"numpy would need {n * 16 / 2**40:.0f} TiB to materialize n={n}")
    benchmark.group = f"n={size}"
    _info(benchmark, n, "numpy permutation")
    rounds = 1 if n > 10**8 else 3
    benchmark.pedantic(lambda: np.random.default_rng(7).permutation(n), rounds=rounds, iterations=1)


def bench_goals(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """tokload's range at least 20x pygfc's per-index rate where the table applies."""
    rate = {(r["group"], r["label"]): r["rate"] for r in rows if "rate" in r}
    goals = []
    for size in ("1e6", "2.7e8"):
        ours = rate.get((f"n={size}", "tokload range (table auto)"))
        theirs = rate.get((f"n={size}", "pygfc p[i] loop"))
        if ours and theirs:
            what = f"n={size}: tokload range / pygfc p[i] loop (table applies)"
            goals.append(make_goal(what, 20, ours / theirs, fmt="{:.1f}x"))
    return goals


def test_table_build(benchmark: Any) -> None:
    """What the table costs to build at n = 2.7e8 (6 * 16432 Speck evaluations)."""
    benchmark.group = "table build"
    _info(benchmark, 6 * 16432, "round outputs for n=2.7e8")
    benchmark(lambda: Permutation(270_000_000, seed=1, table=True))
