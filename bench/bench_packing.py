"""Best-fit packing (``Fill(window)``): padding, the packer's cost, throughput.

    python -m bench.bench_packing

Four parts, on documents of log-normal lengths (median 600 tokens, sigma 1) and
rows of 4,096 tokens:

- **padding**: the share of the rows' tokens that is padding with best-fit
  packing (``tokload.packing.padding_report``) for several look-aheads, with
  greedy packing and with one document per row, over 200,000 lengths in a
  shuffle's order. Goal (issue 29): best-fit pads at most a third of greedy's;
- **the packer**: nanoseconds per document of ``tokload._pack.best_fit`` for
  each look-ahead (one core, median of 5 passes over the lengths);
- **a batch**: the time of one step's read of 8 packed rows by the ``Fill``
  policy's reader (``tokload.Fill(4096).reader(...).read``), with all the
  attention keys and without, and of the reads of that step's documents alone
  (``Documents.read_extents``: a read per document, what bounds the ``Fill``
  goal below), against a plain ``TokenStream`` batch of 8 windows of 4,096
  from the same tokens (32M ``uint32``, page cache warm);
- **the loader**: through the DataLoader flat out (1 reader thread, host
  batches, ``device=None``), the time per batch of a token stream with
  ``cu_seqlens`` and ``max_seqlen``, with all the attention metadata, of
  ``DataLoader(Documents(p), 8, batching=tokload.Fill(4096))`` and of the same
  over a ``tokload.Blend`` of 16 sources of three formats (6 tokload builds, 5
  Megatron ``.bin/.idx`` prefixes, 5 flat ``.npy`` files opened with
  ``tokload.open_flat(path, eos=0)``; 32M ``int32`` tokens in all, the same
  log-normal lengths), over a plain token stream's. Goals (issue 29: the
  stream's metadata costs at most 10%; issue 36: a ``Fill`` batch at most 2x a
  plain one, a blend's ``Fill`` batch at least 0.8 of a single source's speed).
  And the I/O engine calls per reader task (``stats()["io_calls"]`` over
  ``stats()["tasks_built"]``, summed over the timed rounds; issue 36's target
  is one call per task).

Each ratio is the median over 7 rounds of the two times measured in turns within
a round (the range is kept too): on a 2-core VM the speed drifts by a fifth
within seconds.

The blend's tokens are ``int32``: a Blend needs one dtype, and Megatron's
``.idx`` has no ``uint32`` code; ``int32`` (its code for vocabularies over
65,536) keeps 4 bytes per token, as the single source's ``uint32``.

``TOKLOAD_BENCH_PACKING_SMOKE=1`` runs every part on 2M tokens, 1 round of
0.1 s (a check of the code, not a measurement), and writes its JSON under
``$TMPDIR/tokload-bench-smoke/``.

Writes ``bench/results/bench_packing.json``.
"""

from __future__ import annotations

import itertools
import os
import shutil
import statistics
import struct
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

import tokload
from bench import _results
from tokload._pack import best_fit, row_offsets
from tokload.packing import padding_report

SMOKE = os.environ.get("TOKLOAD_BENCH_PACKING_SMOKE", "") not in ("", "0")
WINDOW, BATCH = 4096, 8
TOKENS = (2 << 20) if SMOKE else (32 << 20)
ROUND_S = 0.1 if SMOKE else 1.0
"""Seconds of one loader measurement (a round of ``loader_rows``)."""
SMOKE_DIR = Path(tempfile.gettempdir()) / "tokload-bench-smoke"
BLEND_FORMATS = (("tokload builds", 6), ("Megatron prefixes", 5), ("flat .npy files", 5))
BLEND_DTYPE = np.dtype("<i4")
MEGATRON_INT32 = 4  # megatron.core.datasets.indexed_dataset.DType.int32
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


def write_megatron(prefix: Path, tokens: np.ndarray, bounds: np.ndarray) -> None:
    """A Megatron ``.bin/.idx`` pair (one sequence per document, ``int32`` rows):
    ``tokens[bounds[k]:bounds[k + 1]]`` is document ``k``."""
    lengths = np.diff(bounds)
    n = len(lengths)
    with open(f"{prefix}.idx", "wb") as f:
        f.write(struct.pack("<9sQBQQ", b"MMIDIDX\x00\x00", 1, MEGATRON_INT32, n, n + 1))
        f.write(lengths.astype(np.int32).tobytes())
        f.write((bounds[:-1].astype(np.int64) * BLEND_DTYPE.itemsize).tobytes())
        f.write(np.arange(n + 1, dtype=np.int64).tobytes())
    tokens.astype(BLEND_DTYPE).tofile(f"{prefix}.bin")


def blend_corpus(tmp: Path) -> tuple[tokload.Blend, list[int]]:
    """16 sources of three formats (``BLEND_FORMATS``), ``TOKENS / 16`` ``int32``
    tokens each, documents of the single source's log-normal lengths; their
    ``Blend`` (weights: their documents, one pass over all of them) and the
    documents of each format."""
    per = TOKENS // sum(n for _, n in BLEND_FORMATS)
    views, by_format = [], []
    c = 0
    for kind, count in BLEND_FORMATS:
        docs = 0
        for _ in range(count):
            rng = np.random.default_rng(100 + c)
            # tokens 1..127,999: 0 is the flat files' end of document
            flat = rng.integers(1, 128_000, per, dtype=np.int32)
            ends = np.cumsum(lognormal(per // 300, seed=200 + c))
            bounds = np.concatenate(([0], ends[ends < per], [per]))
            where = tmp / f"blend{c:02d}"
            if kind == "tokload builds":
                with tokload.Writer(where, BLEND_DTYPE, shard_bytes=64 << 20, durable=False) as w:
                    for a, e in itertools.pairwise(bounds):
                        w.write(flat[a:e])
                view = tokload.Documents(where)
            elif kind == "Megatron prefixes":
                write_megatron(where, flat, bounds)
                view = tokload.Documents(str(where))
            else:
                flat[bounds[1:] - 1] = 0  # every document ends with the eos token 0
                np.save(f"{where}.npy", flat)
                view = tokload.Documents(tokload.open_flat(f"{where}.npy", eos=0))
            assert len(view) == len(bounds) - 1, (kind, len(view), len(bounds) - 1)
            assert view.fields == {"tokens": BLEND_DTYPE}, view.fields
            views.append(view)
            docs += len(view)
            c += 1
        by_format.append(docs)
    for p in tmp.rglob("*"):
        if p.is_file() and p.relative_to(tmp).parts[0].startswith("blend"):
            p.read_bytes()  # warm the page cache
    sizes = [len(v) for v in views]
    blend = tokload.Blend(
        [(v, n) for v, n in zip(views, sizes, strict=True)], length=sum(sizes), seed=3
    )
    print(
        f"blend of {len(views)} sources: "
        + ", ".join(
            f"{count} {kind} ({docs:,} documents)"
            for (kind, count), docs in zip(BLEND_FORMATS, by_format, strict=True)
        )
        + f", {per * len(views):,} tokens"
    )
    return blend, by_format


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


ROUNDS = 1 if SMOKE else 7
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

    # a step's documents read alone, into its rows (the I/O engine's part of a Fill step)
    reads = []
    for (sp,) in steps[:100]:
        r = sched.rows(*sp)
        dst = row_offsets(r.lengths, r.counts, WINDOW, 1)
        out = {"tokens": np.empty(len(r.counts) * WINDOW, dtype=docs.fields["tokens"])}
        reads.append((r.ids, r.starts, r.lengths, dst, out))
    real_read = statistics.mean(int(a[2].sum()) for a in reads)

    plain = "TokenStream.read_batch"
    fill_base = "Fill(attention=False), one step"
    calls: dict[str, tuple[Any, float]] = {
        plain: (lambda: stream.read_batch(nxt(pool), np.empty), BATCH * WINDOW),
        "TokenStream.read_batch, boundaries=True": (
            lambda: stream_bounds.read_batch(nxt(pool), np.empty),
            BATCH * WINDOW,
        ),
        READS_ALONE: (lambda: docs.read_extents(*nxt(reads)), real_read),
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


SINGLE_FILL = "Documents, Fill (all attention keys)"

READS_ALONE = "a step's documents alone, read into its rows (Documents.read_extents)"
"""What a ``Fill`` step cannot do without: one read per document (about 45 of about
600 tokens for 8 rows, against a plain batch's 8 windows)."""


BLEND_FILL = (
    "Blend of 16 sources ("
    + ", ".join(f"{count} {kind}" for kind, count in BLEND_FORMATS)
    + "), Fill (all attention keys)"
)


def loader_rows(
    path: Path, blend: tokload.Blend, by_format: list[int]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Each view through the DataLoader flat out (1 reader thread, host batches):
    time per batch, in turns with a plain TokenStream's, rounds of ``ROUND_S``;
    and the I/O engine calls per reader task in those rounds (``stats()``)."""
    blended = BLEND_FILL
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
        SINGLE_FILL: (tokload.Documents(path), tokload.Fill(WINDOW)),
        blended: (blend, tokload.Fill(WINDOW)),
    }
    rates: dict[str, list[tuple[float, float]]] = {label: [] for label in views}
    # per label: [engine calls, engine requests, tasks built] summed over the rounds
    io: dict[str, list[int]] = {label: [0, 0, 0] for label in views}

    def measure(label: str) -> float:
        view, how = views[label]
        loader = tokload.DataLoader(view, BATCH, batching=how, seed=1, num_threads=1, device=None)
        it = iter(loader)
        for _ in range(50):
            next(it)
        loader.stats()  # the interval counted below starts here
        batches = real = rows_tokens = 0
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < ROUND_S:
            b = next(it)
            batches += 1
            rows_tokens += b["tokens"].numel()
            real += int(b["lengths"].sum()) if "lengths" in b else b["tokens"].numel()
        dt = time.perf_counter() - t0
        st = loader.stats()
        loader.close()
        rates[label].append((real / dt, rows_tokens / dt))
        for k, key in enumerate(("io_calls", "io_requests", "tasks_built")):
            io[label][k] += int(st[key])
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
        elif label == SINGLE_FILL:
            goals.append(
                _results.make_goal(
                    "DataLoader (1 thread, flat out), Documents with Fill(4096) and every "
                    "attention key: time per batch over a plain TokenStream's (issue 36; "
                    f"6.04x in 0.1; median of {ROUNDS} rounds, {lo:.2f}-{hi:.2f})",
                    2.0,
                    over,
                    higher_is_better=False,
                    fmt="{:.2f}x",
                )
            )
    speed, lo, hi = ratio(times, SINGLE_FILL, blended)
    print(f"blend of 16 with Fill: {speed:.2f} of a single source's speed ({lo:.2f}-{hi:.2f})")
    rows.append(
        {
            "part": "blend",
            "label": blended,
            "components": len(blend.views),
            "formats": dict(BLEND_FORMATS),
            "documents": len(blend),
            "documents_by_format": by_format,
            "dtype": BLEND_DTYPE.name,
            "single_source_s": statistics.median(times[SINGLE_FILL]),
            "blend_s": statistics.median(times[blended]),
            "speed_of_single": speed,
            "speed_of_single_range": [lo, hi],
        }
    )
    goals.append(
        _results.make_goal(
            "DataLoader (1 thread, flat out), Fill(4096) over a Blend of 16 sources of three "
            "formats: a single source's time per batch over the blend's (issue 36; median of "
            f"{ROUNDS} rounds, {lo:.2f}-{hi:.2f})",
            0.8,
            speed,
            fmt="{:.2f}",
        )
    )
    for label in views:
        calls, requests, tasks = io[label]
        per_task = calls / tasks if tasks else None
        rows.append(
            {
                "part": "io",
                "label": label,
                "components": len(blend.views) if label == blended else 1,
                "tasks_built": tasks,
                "io_calls": calls,
                "io_requests": requests,
                "io_calls_per_task": per_task,
                "target_per_task": 1,
            }
        )
        print(
            f"I/O engine calls per task, {label}: {calls:,} calls / {tasks:,} tasks = "
            + ("-" if per_task is None else f"{per_task:.2f}")
            + " (target 1)"
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
        blend, by_format = blend_corpus(tmp)
        rows, more = loader_rows(path, blend, by_format)
        results += rows
        goals += more
    finally:
        shutil.rmtree(tmp)
    # a smoke run checks the code: its figures never replace a measurement's
    _results.write("bench_packing", results, goals, directory=SMOKE_DIR if SMOKE else None)


if __name__ == "__main__":
    main()
