"""Best-fit packing (``Fill(window)``): padding, the packer's cost, throughput.

    python -m bench.bench_packing

Three parts, on documents of log-normal lengths (median 600 tokens, sigma 1) and
rows of 4,096 tokens:

- **padding**: the share of the rows' tokens that is padding with best-fit
  packing (``tokload.packing.padding_report``) for several look-aheads, with
  greedy packing and with one document per row, over 200,000 lengths in a
  shuffle's order. Goal (issue 29): best-fit pads at most a third of greedy's;
- **the packer**: nanoseconds per document of ``tokload._pack.best_fit`` for
  each look-ahead (one core, median of 5 passes over the lengths);
- **a batch**: the time to read a batch of 8 packed rows with their attention
  metadata (``the Fill policy``) against a plain ``TokenStream`` batch of 8
  windows of 4,096 from the same tokens (32M ``uint32``, page cache warm); and
  through the DataLoader flat out (1 reader thread, host batches), the time per
  batch of a token stream with ``cu_seqlens`` and ``max_seqlen``, with all the
  attention metadata, and of packed rows, over a plain token stream's (goal of
  issue 29: the metadata costs at most 10%). Each ratio is the median over 7
  rounds of the two times measured in turns within a round (the range is kept
  too): on a 2-core VM the speed drifts by a fifth within seconds.

Writes ``bench/results/bench_packing.json``.
"""

from __future__ import annotations

import itertools
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

import tokload
from bench import _results
from tokload._pack import best_fit
from tokload.packing import padding_report

WINDOW, BATCH = 4096, 8
TOKENS = 32 << 20
LOOKAHEADS = (64, 256, 1024, 4096)


def lognormal(n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.maximum(1, rng.lognormal(np.log(600), 1.0, n)).astype(np.int64)


def padding_rows() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    lengths = lognormal(200_000)
    rows, goals = [], []
    for k in LOOKAHEADS:
        rep = padding_report(lengths, WINDOW, k)
        rows.append(
            {
                "part": "padding",
                "lookahead": k,
                "best_fit": rep["best_fit"],
                "greedy": rep["greedy"],
                "pad": rep["pad"],
                "best_fit_over_greedy": rep["best_fit"] / rep["greedy"],
            }
        )
        print(f"lookahead {k:5d}: best-fit {rep['best_fit']:.4%}, greedy {rep['greedy']:.4%}, "
              f"one per row {rep['pad']:.4%}")  # fmt: skip
        if k == tokload.packing.DEFAULT_LOOKAHEAD:
            goals.append(
                _results.make_goal(
                    f"best-fit padding over greedy padding (W = {WINDOW}, median 600, "
                    f"lookahead {k})",
                    1 / 3,
                    rep["best_fit"] / rep["greedy"],
                    higher_is_better=False,
                    fmt="{:.3f}",
                )
            )
    return rows, goals


def packer_rows() -> list[dict[str, Any]]:
    lengths = lognormal(200_000, seed=1).astype(np.uint64)
    rows = []
    for k in LOOKAHEADS:
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            for g in range(0, len(lengths), k):
                best_fit(lengths[g : g + k], WINDOW)
            times.append(time.perf_counter() - t0)
        ns = statistics.median(times) / len(lengths) * 1e9
        rows.append({"part": "packer", "lookahead": k, "ns_per_document": ns})
        print(f"best_fit, lookahead {k}: {ns:.0f} ns per document")
    return rows


def corpus(tmp: Path) -> Path:
    rng = np.random.default_rng(2)
    flat = rng.integers(0, 128_000, TOKENS, dtype=np.uint32)
    ends = np.cumsum(lognormal(TOKENS // 300, seed=3))
    ends = ends[ends < TOKENS]
    bounds = np.concatenate(([0], ends, [TOKENS]))
    with tokload.Writer(tmp / "docs", "<u4", shard_bytes=64 << 20, durable=False) as w:
        for a, e in itertools.pairwise(bounds):
            w.write(flat[a:e])
    for p in (tmp / "docs").rglob("*"):
        if p.is_file():
            p.read_bytes()  # warm the page cache
    return tmp / "docs"


def timed(fn: Any, seconds: float) -> float:
    """Median seconds per call over ``seconds`` (after 20 warm-up calls)."""
    for _ in range(20):
        fn()
    times = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


ROUNDS = 7
"""Rounds of every measurement of a ratio, in turns (this VM's speed drifts by a
fifth within seconds: a ratio is taken within each round, and the median kept)."""


def in_rounds(measure: dict[str, Any], rounds: int = ROUNDS) -> dict[str, list[float]]:
    """``measure[label]()`` (a time) for every label, in turns, ``rounds`` times,
    the order reversed every other round: the times by label, round by round."""
    got: dict[str, list[float]] = {label: [] for label in measure}
    for k in range(rounds):
        for label in list(measure)[:: 1 if k % 2 == 0 else -1]:
            got[label].append(measure[label]())
    return got


def ratio(times: dict[str, list[float]], label: str, base: str) -> tuple[float, float, float]:
    """The median over rounds of ``label``'s time over ``base``'s in the same round,
    and the lowest and highest of those ratios."""
    r = [a / b for a, b in zip(times[label], times[base], strict=True)]
    return statistics.median(r), min(r), max(r)


def batch_rows(path: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    stream = tokload.TokenStream(path, window=WINDOW)
    stream_bounds = tokload.TokenStream(path, window=WINDOW, boundaries=True)
    docs = tokload.Documents(path)
    fill_all, fill_none = tokload.Fill(WINDOW), tokload.Fill(WINDOW, attention=False)
    sched = fill_all.schedule(docs, BATCH, seed=1)
    steps = [[sp] for sp in sched.spans(0, 400)]
    real = statistics.mean(int(sched.rows(*sp).lengths.sum()) for (sp,) in steps)
    fill = fill_all.reader(docs, sched, np.empty)
    fill_plain = fill_none.reader(docs, sched, np.empty)
    rng = np.random.default_rng(0)
    pool = [rng.integers(0, len(stream), BATCH) for _ in range(400)]
    it = {"k": 0}

    def nxt(seq: list[Any]) -> Any:
        it["k"] = (it["k"] + 1) % len(seq)
        return seq[it["k"]]

    plain = "TokenStream.read_batch"
    fill_base = "Fill(attention=False), one step"
    calls: dict[str, tuple[Any, float]] = {
        plain: (lambda: stream.read_batch(nxt(pool), np.empty), BATCH * WINDOW),
        "TokenStream.read_batch, boundaries=True": (
            lambda: stream_bounds.read_batch(nxt(pool), np.empty),
            BATCH * WINDOW,
        ),
        fill_base: (lambda: fill_plain.read(nxt(steps), None), real),
        "Fill (all attention keys), one step": (lambda: fill.read(nxt(steps), None), real),
    }
    times = in_rounds({label: (lambda fn=fn: timed(fn, 0.3)) for label, (fn, _) in calls.items()})
    rows = []
    for label, (_, tokens) in calls.items():
        t = statistics.median(times[label])
        over, lo, hi = ratio(times, label, plain)
        rows.append(
            {
                "part": "batch",
                "label": label,
                "median_s": t,
                "real_tokens_per_batch": tokens,
                "over_plain": over,
                "over_plain_range": [lo, hi],
            }
        )
        print(
            f"{label}: {t * 1e6:.0f} us per batch, {over:.2f}x a plain batch "
            f"({lo:.2f}-{hi:.2f} over {ROUNDS} rounds)"
        )
    over, lo, hi = ratio(times, "Fill (all attention keys), one step", fill_base)
    print(f"packed rows, metadata over none: {over:.2f}x ({lo:.2f}-{hi:.2f})")
    goals = [
        _results.make_goal(
            "packed rows: a batch with all the attention metadata over the same rows "
            f"without it (one step's read, time; median of {ROUNDS} rounds, {lo:.2f}-{hi:.2f})",
            1.10,
            over,
            higher_is_better=False,
            fmt="{:.2f}x",
        )
    ]
    return rows, goals


def loader_rows(path: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Each view through the DataLoader flat out (1 reader thread, host batches):
    time per batch, in turns with a plain TokenStream's, rounds of 1 s."""
    views: dict[str, tuple[Any, Any]] = {
        "TokenStream": (tokload.TokenStream(path, window=WINDOW), None),
        "TokenStream, cu_seqlens and max_seqlen": (
            tokload.TokenStream(path, window=WINDOW, boundaries=["cu_seqlens", "max_seqlen"]),
            None,
        ),
        "TokenStream, boundaries=True": (
            tokload.TokenStream(path, window=WINDOW, boundaries=True),
            None,
        ),
        "Documents, Fill (all attention keys)": (tokload.Documents(path), tokload.Fill(WINDOW)),
    }
    rates: dict[str, list[tuple[float, float]]] = {label: [] for label in views}

    def measure(label: str) -> float:
        view, how = views[label]
        loader = tokload.DataLoader(view, BATCH, batching=how, seed=1, num_threads=1, device=None)
        it = iter(loader)
        for _ in range(50):
            next(it)
        batches = real = rows_tokens = 0
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < 1.0:
            b = next(it)
            batches += 1
            rows_tokens += b["tokens"].numel()
            real += int(b["lengths"].sum()) if "lengths" in b else b["tokens"].numel()
        dt = time.perf_counter() - t0
        loader.close()
        rates[label].append((real / dt, rows_tokens / dt))
        return dt / batches

    times = in_rounds({label: (lambda label=label: measure(label)) for label in views})
    rows, goals = [], []
    for label in views:
        per_batch = statistics.median(times[label])
        over, lo, hi = ratio(times, label, "TokenStream")
        real_rate = statistics.median(r for r, _ in rates[label])
        row_rate = statistics.median(r for _, r in rates[label])
        rows.append(
            {
                "part": "loader",
                "label": label,
                "batch_s": per_batch,
                "over_plain": over,
                "over_plain_range": [lo, hi],
                "real_tokens_per_s": real_rate,
                "row_tokens_per_s": row_rate,
            }
        )
        print(
            f"DataLoader {label}: {per_batch * 1e6:.1f} us per batch ({over:.2f}x plain, "
            f"{lo:.2f}-{hi:.2f} over {ROUNDS} rounds), {real_rate / 1e6:.0f} M real tokens/s"
        )
        if label.startswith("TokenStream,"):
            goals.append(
                _results.make_goal(
                    f"DataLoader (1 thread, flat out), {label}: time per batch over a plain "
                    f"TokenStream's (median of {ROUNDS} rounds, {lo:.2f}-{hi:.2f})",
                    1.10,
                    over,
                    higher_is_better=False,
                    fmt="{:.2f}x",
                )
            )
    return rows, goals


def main() -> None:
    results, goals = padding_rows()
    results += packer_rows()
    tmp = Path(tempfile.mkdtemp(prefix="tokload-packing-"))
    try:
        path = corpus(tmp)
        rows, more = batch_rows(path)
        results += rows
        goals += more
        rows, more = loader_rows(path)
        results += rows
        goals += more
    finally:
        shutil.rmtree(tmp)
    _results.write("bench_packing", results, goals)


if __name__ == "__main__":
    main()
