"""Streams with metadata read cold: every layout, the page cache dropped first.

    sudo python -m bench.bench_read_cold            # prints a table
    sudo python -m pytest bench/bench_read_cold.py -o python_files='bench_*.py' -s

Needs root (it writes ``/proc/sys/vm/drop_caches``; it says so and skips
otherwise). The same 64 M random ``uint16`` tokens (documents of 2,048, one
8-byte record per 100 tokens) are written once per layout under
``$TOKLOAD_COLD_DIR/meta`` (default ``/tmp/tokload-cold/meta``, reused): tokens
only, metadata blocks (format version 3), a span table (version 2) and an id per
token (version 1). For each, the page cache is dropped, the dataset opened, and
``BATCHES`` batches of 8 random windows of 4,097 tokens read after a first one:

- ``read``: one batch after the other in this thread (``view.read``), so each
  batch waits for its dependent rounds of reads one after the other;
- ``loader``: ``tokload.DataLoader`` with its defaults (reader threads,
  prefetch), as a trainer runs it.

Each figure is the median of ``REPEATS`` runs, all in one run of this file,
printed as M tokens/s and as a share of TokenStream's, and written to
``bench/results/bench_read_cold.json``. Warm-cache figures are
``bench/bench_read.py``'s.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import tokload
from bench import _results

WINDOW, BATCH = 4097, 8
BATCHES = int(os.environ.get("TOKLOAD_COLD_BATCHES", "200"))
REPEATS = int(os.environ.get("TOKLOAD_COLD_REPEATS", "3"))
TOKENS, DOC, EVERY = 64 << 20, 2048, 100
DROP = Path("/proc/sys/vm/drop_caches")
LAYOUTS = ("tokens", "blocks", "spans", "per_token")


def can_drop_caches() -> bool:
    return os.geteuid() == 0 and os.access(DROP, os.W_OK)


def drop_caches() -> None:
    os.sync()
    DROP.write_text("1\n")


def corpus() -> dict[str, Path]:
    """The four builds of the same tokens (written once, then reused)."""
    root = Path(os.environ.get("TOKLOAD_COLD_DIR", "/tmp/tokload-cold")) / "meta"
    out = {name: root / name for name in LAYOUTS}
    if all((p / "manifest.json").exists() for p in out.values()):
        return out
    rng = np.random.default_rng(0)
    toks = rng.integers(0, 65535, TOKENS).astype(np.uint16)
    for name, path in out.items():
        if (path / "manifest.json").exists():
            continue
        kw: dict[str, Any] = {}
        dtype: Any = "<u2"
        if name == "per_token":
            dtype = [("tokens", "<u2"), ("metadata_id", "<u4")]
        if name != "tokens":
            kw = {"metadata": True, "metadata_layout": name}
        with tokload.Writer(path, dtype, durable=False, **kw) as w:
            for d in range(TOKENS // DOC):
                t = toks[d * DOC : (d + 1) * DOC]
                spans = None
                if name != "tokens":
                    spans = [
                        (a, min(DOC, a + EVERY), b"%08d" % (d * DOC + a))
                        for a in range(0, DOC, EVERY)
                    ]
                w.write({"tokens": t} if name == "per_token" else t, spans=spans)
    return out


def view(path: Path, name: str) -> Any:
    if name == "tokens":
        return tokload.TokenStream(path, window=WINDOW)
    return tokload.StreamWithMetadata(path, window=WINDOW)


def _median(measure: Callable[[int], float]) -> float:
    return statistics.median(measure(rep) for rep in range(REPEATS))


def read_rate(path: Path, name: str) -> float:
    """Tokens/s of ``view.read`` in this thread, cold."""

    def run(rep: int) -> float:
        drop_caches()
        v = view(path, name)
        rng = np.random.default_rng(rep)
        batches = [rng.integers(0, len(v), BATCH) for _ in range(BATCHES + 1)]
        v.read(batches[0])
        t0 = time.perf_counter()
        for b in batches[1:]:
            v.read(b)
        return BATCHES * BATCH * WINDOW / (time.perf_counter() - t0)

    return _median(run)


def loader_rate(path: Path, name: str) -> float:
    """Tokens/s of a DataLoader with its defaults, cold."""

    def run(rep: int) -> float:
        drop_caches()
        loader = tokload.DataLoader(view(path, name), batch_size=BATCH, seed=rep)
        it = iter(loader)
        try:
            next(it)
            t0 = time.perf_counter()
            for _ in range(BATCHES):
                next(it)
            return BATCHES * BATCH * WINDOW / (time.perf_counter() - t0)
        finally:
            loader.close()

    return _median(run)


def measure() -> dict[str, dict[str, float]]:
    builds = corpus()
    return {
        how: {name: rate(builds[name], name) for name in LAYOUTS}
        for how, rate in (("read", read_rate), ("loader", loader_rate))
    }


def result_rows(res: dict[str, dict[str, float]]) -> list[dict[str, Any]]:
    """One row per way of reading and layout: M tokens/s and the share of TokenStream's."""
    return [
        {
            "how": how,
            "layout": name,
            "m_tokens_per_s": r / 1e6,
            "of_token_stream": r / rates["tokens"],
        }
        for how, rates in res.items()
        for name, r in rates.items()
    ]


def table(res: dict[str, dict[str, float]]) -> str:
    lines = [f"{'cold, 1 record / 100 tokens':28s} {'M tokens/s':>12s} {'vs TokenStream':>15s}"]
    for how, rates in res.items():
        for name, r in rates.items():
            lines.append(
                f"{how + ' ' + name:28s} {r / 1e6:12.1f} {100 * r / rates['tokens']:14.1f}%"
            )
    return "\n".join(lines)


@pytest.mark.skipif(not can_drop_caches(), reason="needs root to drop the page cache")
def test_cold_reads_of_every_layout() -> None:
    res = measure()
    for row in result_rows(res):
        _results.record("bench_read_cold", **row)
    print("\n" + table(res))


if __name__ == "__main__":
    if not can_drop_caches():
        raise SystemExit("bench_read_cold needs root to write /proc/sys/vm/drop_caches")
    measured = measure()
    print(table(measured))
    _results.write("bench_read_cold", result_rows(measured))
