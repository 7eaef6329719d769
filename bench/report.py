"""Generate the benchmarks page and the README's headline table from ``bench/results/*.json``.

    python -m bench.report            # rewrite docs/benchmarks.md and the README region
    python -m bench.report --check    # exit 1 if either differs from what the JSON gives

Every figure on the page comes from the JSON a benchmark wrote in its latest run
(``bench/_results.py`` describes the envelope); a benchmark without JSON is listed
as not run, with its command. Plots a benchmark saved next to its JSON
(``bench/results/NAME.png``) are copied to ``docs/benchmarks/``. Standard library
only.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = ROOT / "bench" / "results"
PAGE = ROOT / "docs" / "benchmarks.md"
README = ROOT / "README.md"
ASSETS = ROOT / "docs" / "benchmarks"
BEGIN, END = "<!-- bench:headline -->", "<!-- /bench:headline -->"
DASH = "—"

Row = dict[str, Any]
Doc = dict[str, Any]


class ReportError(Exception):
    """A results file that cannot be read, or a README without its headline markers."""


# ---- formatting ---------------------------------------------------------------------


def num(x: float | None, digits: int = 3) -> str:
    """``x`` with ``digits`` significant digits, thousands separated; a dash for None."""
    if x is None:
        return DASH
    if x == 0:
        return "0"
    mag = abs(x)
    decimals = 0
    while mag < 10 ** (digits - 1) and decimals < 6:
        mag *= 10
        decimals += 1
    return f"{x:,.{decimals}f}"


def mega(x: float | None, unit: str = "") -> str:
    return DASH if x is None else f"{num(x / 1e6)} M{unit}"


def ratio(a: float | None, b: float | None) -> str:
    if not a or not b:
        return DASH
    r = a / b
    if r >= 100:
        return f"{r:,.0f}×"  # noqa: RUF001
    return f"{r:.1f}×" if r >= 1.5 else f"{r:.2f}×"  # noqa: RUF001


def pct(x: float | None) -> str:
    return DASH if x is None else f"{100 * x:.0f}%"


def pct_1(x: float | None) -> str:
    return DASH if x is None else f"{100 * x:.1f}%"


def seconds(x: float | None) -> str:
    if x is None:
        return DASH
    if x < 1e-3:
        return f"{num(x * 1e6)} µs"
    if x < 1:
        return f"{num(x * 1e3)} ms"
    return f"{num(x)} s"


def nbytes(x: float | None) -> str:
    if x is None:
        return DASH
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(x) >= scale:
            return f"{num(x / scale)} {unit}"
    return f"{x:.0f} B"


def cell(v: Any) -> str:
    if v is None:
        return DASH
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return num(v)
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, list):
        return ", ".join(cell(x) for x in v)
    return str(v).replace("|", "\\|").replace("\n", " ")


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


# ---- reading -------------------------------------------------------------------------

REQUIRED = ("benchmark", "command", "date", "machine", "results", "goals")


def load(path: Path) -> Doc:
    try:
        doc = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ReportError(f"{path}: cannot read it as JSON: {e}") from e
    if not isinstance(doc, dict):
        raise ReportError(f"{path}: expected a JSON object, found {type(doc).__name__}")
    missing = [k for k in REQUIRED if k not in doc]
    if missing:
        raise ReportError(f"{path}: missing {', '.join(missing)}")
    if not isinstance(doc["results"], list) or not isinstance(doc["goals"], list):
        raise ReportError(f"{path}: 'results' and 'goals' must be lists")
    return doc


def load_all(results_dir: Path) -> dict[str, Doc]:
    docs: dict[str, Doc] = {}
    for path in sorted(results_dir.glob("*.json")):
        docs[path.stem] = load(path)
    return docs


def _rate(rows: list[Row], label: str, group: str | None = None) -> float | None:
    for r in rows:
        if r.get("label") == label and (group is None or r.get("group") == group):
            v = r.get("rate")
            return float(v) if v is not None else None
    return None


def _find(rows: list[Row], **match: Any) -> Row | None:
    for r in rows:
        if all(r.get(k) == v for k, v in match.items()):
            return r
    return None


# ---- per-benchmark tables --------------------------------------------------------------


def generic(rows: list[Row]) -> str:
    """Every row as it is, one column per key (in order of first appearance)."""
    keys: list[str] = []
    for r in rows:
        keys += [k for k in r if k not in keys and not isinstance(r[k], dict)]
    return table(keys, [[cell(r.get(k)) for k in keys] for r in rows])


def rate_tables(rows: list[Row], base: str | None = None) -> str:
    """pytest-benchmark rows: per group, rate and time per call, and the ratio to ``base``."""
    out = []
    groups: dict[str, list[Row]] = {}
    for r in rows:
        if "rate" in r:
            groups.setdefault(r.get("group", ""), []).append(r)
    for group, members in groups.items():
        ref = _rate(members, base) if base else None
        header = ["", "rate (median)", "time per call (median)"]
        if ref:
            header.append(f"vs {base}")
        body = []
        for r in sorted(members, key=lambda m: -float(m["rate"])):
            line = [
                cell(r["label"]),
                mega(r["rate"], f"{r.get('unit', 'items')}/s"),
                seconds(r.get("median_s")),
            ]
            if ref:
                line.append(pct(r["rate"] / ref))
            body.append(line)
        out.append(f"**{group}**\n\n" + table(header, body))
    return "\n\n".join(out)


def permute_tables(rows: list[Row]) -> str:
    labels = [
        ("tokload range (table auto)", "tokload `range`"),
        ("tokload range (table off)", "tokload `range`, no table"),
        ("tokload take (random indices)", "tokload `take` (random)"),
        ("pygfc p[i] loop", "pygfc `p[i]` loop"),
        ("numpy permutation", "numpy `permutation` (amortized)"),
    ]
    sizes = []
    for r in rows:
        g = str(r.get("group", ""))
        if g.startswith("n=") and g not in sizes:
            sizes.append(g)
    body = []
    for g in sizes:
        rates = {lab: _rate(rows, lab, g) for lab, _ in labels}
        ours = rates["tokload range (table auto)"]
        body.append(
            [g.removeprefix("n=")]
            + [mega(rates[lab], " idx/s") for lab, _ in labels]
            + [
                f"{num(1e9 / ours)} ns" if ours else DASH,
                ratio(ours, rates["pygfc p[i] loop"]),
                ratio(ours, rates["numpy permutation"]),
            ]
        )
    header = ["n", *(h for _, h in labels), "`range` per index", "vs pygfc", "vs numpy"]
    text = "Indices per second, one core (a dash: not measured, e.g. numpy cannot hold n).\n\n"
    text += table(header, body)
    build = _find(rows, group="table build")
    if build:
        text += (
            f"\n\nBuilding the table of round outputs at n = 2.7e8 takes "
            f"{seconds(build.get('median_s'))} (median)."
        )
    return text


def read_tables(rows: list[Row]) -> str:
    docs = [r for r in rows if str(r.get("group", "")).startswith("documents of")]
    text = rate_tables([r for r in rows if r not in docs], base="tokload TokenStream.read")
    if docs:
        text += "\n\n" + rate_tables(docs, base="TokenStream.read_batch")
    sys_row = _find(rows, group="syscalls (strace, TOKLOAD_IO=sync)")
    if sys_row:
        text += (
            f"\n\n`preadv` calls per window (strace, synchronous I/O, TokenStream then "
            f"StreamWithMetadata): {num(sys_row.get('value'))}; other syscalls in the read "
            f"loop: {cell(sys_row.get('other_syscalls'))}."
        )
    return text


def layout_tables(rows: list[Row]) -> str:
    rates = [r for r in rows if "tokens_per_s" in r]
    sizes = [r for r in rows if "bytes" in r]
    text = table(
        ["read kind", "tokens/s (median)", "share of TokenStream"],
        [
            [
                cell(r["label"]),
                mega(r["tokens_per_s"], " tokens/s"),
                pct_1(r["share_of_token_stream"]),
            ]
            for r in rates
        ],
    )
    if sizes:
        text += "\n\nThe same tokens on disk, by layout:\n\n" + table(
            ["build", "size", "over tokens only"],
            [
                [cell(r["label"]), nbytes(r["bytes"]), f"+{pct_1(r['over_tokens_only'])}"]
                for r in sizes
            ],
        )
    return text


def packing_tables(rows: list[Row]) -> str:
    """bench_packing: padding by look-ahead, the packer's cost, a batch's time, the loader."""
    pad = [r for r in rows if r.get("part") == "padding"]
    cost = {r["lookahead"]: r["ns_per_document"] for r in rows if r.get("part") == "packer"}
    text = table(
        ["lookahead", "best-fit padding", "greedy", "one per row", "best-fit / greedy",
         "packer, per document"],
        [
            [
                cell(r["lookahead"]),
                f"{100 * r['best_fit']:.2f}%",
                pct_1(r["greedy"]),
                pct_1(r["pad"]),
                f"{r['best_fit_over_greedy']:.3f}",
                DASH if r["lookahead"] not in cost else f"{num(cost[r['lookahead']])} ns",
            ]
            for r in pad
        ],
    )  # fmt: skip
    batch = [r for r in rows if r.get("part") == "batch"]
    if batch:
        text += "\n\nA batch of 8 rows of 4,096 tokens (median time per call):\n\n" + table(
            ["read", "time", "real tokens", "over a plain TokenStream batch"],
            [
                [
                    cell(r["label"]),
                    seconds(r["median_s"]),
                    f"{r['real_tokens_per_batch']:,.0f}",
                    f"{r['over_plain']:.2f}×",  # noqa: RUF001
                ]
                for r in batch
            ],
        )
    loader = [r for r in rows if r.get("part") == "loader"]
    if loader:
        text += "\n\nThe DataLoader flat out (1 reader thread, host batches):\n\n" + table(
            ["view", "time per batch", "over plain", "real tokens/s", "rows' tokens/s"],
            [
                [
                    cell(r["label"]),
                    seconds(r.get("batch_s")),
                    DASH if r.get("over_plain") is None else f"{r['over_plain']:.2f}×",  # noqa: RUF001
                    mega(r["real_tokens_per_s"], " tokens/s"),
                    mega(r["row_tokens_per_s"], " tokens/s"),
                ]
                for r in loader
            ],
        )
    blend = _find(rows, part="blend")
    if blend:
        lo, hi = blend.get("speed_of_single_range") or [None, None]
        text += (
            f"\n\nA blend of {cell(blend.get('components'))} sources of three formats "
            f"({cell(blend.get('documents'))} documents of `{blend.get('dtype', '?')}` tokens in "
            f"all, the single source's log-normal lengths) with `Fill(4096)`: "
            f"{seconds(blend.get('blend_s'))} per batch against the single source's "
            f"{seconds(blend.get('single_source_s'))}, i.e. "
            f"{num(blend.get('speed_of_single'))} of its speed (median of the rounds' "
            f"ratios, {num(lo)} to {num(hi)})."
        )
    io = [r for r in rows if r.get("part") == "io"]
    if io:
        text += (
            "\n\nI/O engine calls per reader task in those rounds (`DataLoader.stats()`: "
            "`io_calls` over `tasks_built`, summed over the rounds; the target is 1 call "
            "per task):\n\n"
            + table(
                ["view", "sources", "tasks", "engine calls", "requests", "calls per task"],
                [
                    [
                        cell(r["label"]),
                        cell(r.get("components")),
                        cell(r.get("tasks_built")),
                        cell(r.get("io_calls")),
                        cell(r.get("io_requests")),
                        num(r.get("io_calls_per_task")),
                    ]
                    for r in io
                ],
            )
        )
    return text


def _full_gcs(r: Row) -> str:
    """The full collections within a measurement, and their time (bench_remote)."""
    n = r.get("full_gcs")
    if n is None:
        return DASH
    return "none" if not n else f"{n:.0f} ({num(r['full_gc_ms'])} ms)"


def _kilobytes(n: Any) -> str:
    """Bytes per GET as kB (bench_remote); a dash where the run did not count them."""
    return DASH if n is None else f"{num(float(n) / 1e3)} kB"


def remote_tables(rows: list[Row]) -> str:
    """bench_remote: per latency, the plain client loop's best and each loader against it."""
    parts = []
    for lat in sorted({r["latency_ms"] for r in rows if "latency_ms" in r}):
        here = [r for r in rows if r.get("latency_ms") == lat]
        plain = [r for r in here if str(r["label"]).startswith("plain loop")]
        # the reference: the best measured again after tokload's, the two averaged
        best = next(
            (r for r in plain if "(the reference)" in str(r["label"])),
            max(plain, key=lambda r: float(r["gets_per_s"]), default=None),
        )
        body = []
        for r in sorted(plain, key=lambda m: -float(m["gets_per_s"])):
            body.append(
                [cell(r["label"]), num(r["gets_per_s"]), DASH, num(r["cpu_us_per_get"])]
                + [_kilobytes(r.get("bytes_per_get"))]
                + [DASH] * 4
                + [_full_gcs(r)]
            )
        for r in here:
            if r in plain:
                continue
            gets = r.get("gets_per_s")
            rate = r.get("tokens_per_s")
            body.append(
                [
                    cell(r["label"]),
                    num(gets) if gets is not None else DASH,
                    ratio(gets, best["gets_per_s"]) if best and gets else DASH,
                    num(r["cpu_us_per_get"]) if "cpu_us_per_get" in r else DASH,
                    _kilobytes(r.get("bytes_per_get")),
                    mega(rate, " tokens/s") if rate is not None else cell(r.get("error")),
                    seconds(r.get("open_to_first_batch_s", r.get("first_batch_s"))),
                    DASH if r.get("wait_p999_ms") is None else f"{num(r['wait_p999_ms'])} ms",
                    cell(r.get("local_bytes_written", r.get("local_cache_bytes"))),
                    _full_gcs(r),
                ]
            )
        parts.append(
            f"**{lat} ms per request**\n\n"
            + table(
                [
                    "",
                    "GETs/s",
                    "of the plain loop's best",
                    "client CPU per GET (µs)",
                    "bytes per GET",
                    "tokens/s",
                    "open to first batch",
                    "next() p99.9 (prefetch full)",
                    "local disk written (bytes)",
                    "full collections (GIL held)",
                ],
                body,
            )
        )
    return "\n\n".join(parts)


def loader_tables(rows: list[Row]) -> str:
    parts = []
    rated = [r for r in rows if "rate" in r]
    if rated:
        ours = _rate(rated, "tokload (2 threads)")
        body = [
            [
                cell(r["label"]),
                mega(r["rate"], " tokens/s"),
                ratio(ours, r["rate"]) if ours else DASH,
            ]
            for r in sorted(rated, key=lambda m: -float(m["rate"]))
        ]
        parts.append(
            "**Throughput**: tokens delivered as tensors per second (median of 5 rounds of "
            "200 batches).\n\n" + table(["loader", "tokens/s", "tokload (2 threads) vs it"], body)
        )
    kept = [r for r in rows if "loop_kept" in r and "rate_target" not in r]
    if kept:
        body = [
            [
                cell(r["label"]),
                pct(r["loop_kept"]),
                ", ".join(pct(x) for x in r.get("loop_kept_runs", [])),
                mega(r.get("tokens_per_s_meanwhile"), " tokens/s"),
            ]
            for r in kept
        ]
        parts.append(
            "**The training thread**: the speed a pure-Python loop on the main thread keeps "
            "while another thread drains the loader flat out (median of 5 alternating "
            "1.5 s phases).\n\n"
            + table(["loader", "loop speed kept", "single runs", "delivered meanwhile"], body)
        )
    paced = [r for r in rows if "rate_target" in r]
    if paced:
        body = [
            [
                cell(r["label"]),
                DASH if r.get("time_kept") is None else f"{100 * r['time_kept']:.2f}%",
                pct_1(r["loop_kept"]),
                ", ".join(pct(x) for x in r.get("loop_kept_runs", [])),
                pct_1(r.get("no_loader_again")),
                ", ".join(pct(x) for x in r.get("no_loader_again_runs", [])),
                seconds(r["wait_p999_s"]),
                seconds(r["wait_max_s"]),
            ]
            for r in paced
        ]
        parts.append(
            "**A trainer's loop at a fixed rate**: batches taken at a fixed cadence with "
            "GIL-holding Python between them, against the same loop with no loader "
            "(medians of 8 rounds of 1.5 s phases, every other round in reverse order), and "
            "the waits in `next()`. *Time kept*: 1 minus the share of the loop's time spent "
            "in `next()` and in pauses of its work longer than 20 µs (its thread "
            "descheduled, or waiting for the GIL), less the same without a loader. *Work "
            "rate kept*: its work per second with the loader over without; the A/A columns "
            "run the loop without a loader twice, which is the machine's own noise on this "
            "measure.\n\n"
            + table(
                [
                    "rate",
                    "time kept",
                    "work rate kept",
                    "single runs",
                    "A/A",
                    "A/A runs",
                    "p99.9 wait",
                    "max wait",
                ],
                body,
            )
        )
    cost = [r for r in rows if "consumer_s" in r]
    if cost:
        body = [
            [
                cell(r["label"]),
                seconds(r["consumer_s"]),
                seconds(r["reader_s"]),
                seconds(r["batch_s"]),
                f"{100 * r['share']:.2f}%",
            ]
            for r in cost
        ]
        parts.append(
            "**Statistics**: what the counters behind `DataLoader.stats()` cost per batch "
            "(always on), each part timed alone, against a batch's time drained flat out.\n\n"
            + table(["loader", "training thread", "reader threads", "a batch", "share"], body)
        )
    return "\n\n".join(parts)


def blend_tables(rows: list[Row]) -> str:
    built = [r for r in rows if "construction_s" in r]
    text = ""
    if built:
        n = built[0].get("positions")
        body = [
            [cell(r["label"]), seconds(r["construction_s"]), nbytes(r.get("peak_traced_bytes"))]
            for r in built
        ]
        text = f"A blend of 3 sources over N = {cell(n)} positions.\n\n" + table(
            ["", "construction time", "peak traced memory"], body
        )
    look = _find(rows, label="tokload Blend.locate, 4096 random positions")
    if look:
        text += (
            f"\n\nOnce built, locating 4,096 random positions takes {seconds(look['lookup_s'])}."
        )
    many = [r for r in rows if "open_views_s" in r]
    for r in many:
        text += (
            f"\n\nA blend of {cell(r.get('components'))} local tokload builds "
            f"({cell(r.get('documents_per_component'))} documents each): opening the "
            f"`Documents` takes {seconds(r['open_views_s'])}, the `Blend` constructor "
            f"{seconds(r.get('blend_constructor_s'))}, together {seconds(r.get('total_s'))} "
            f"(median of {len(r.get('total_s_runs') or []) or DASH} runs: "
            f"{', '.join(seconds(x) for x in r.get('total_s_runs') or [])})."
        )
    heap = [r for r in rows if "heap_bytes" in r]
    if heap:
        text += (
            "\n\nThe Python heap the views and the blend hold once built (tracemalloc: "
            "Python and NumPy allocations):\n\n"
            + table(
                ["components", "held", "per component", "peak while building"],
                [
                    [
                        cell(r.get("components")),
                        nbytes(r["heap_bytes"]),
                        nbytes(r.get("bytes_per_component")),
                        nbytes(r.get("heap_peak_bytes")),
                    ]
                    for r in heap
                ],
            )
        )
    reads = [r for r in rows if "speed_over_single" in r]
    if reads:
        text += (
            "\n\nReading through the DataLoader flat out (1 reader thread, host batches of 8), "
            "a blend against one source of the same 32M tokens (median of the rounds, each "
            "the two in turns):\n\n"
            + table(
                ["batches", "sources", "per batch", "one source's", "speed over one source's"],
                [
                    [
                        cell(r.get("policy")),
                        cell(r.get("components")),
                        seconds(r["batch_s"]),
                        seconds(r.get("single_batch_s")),
                        f"{num(r['speed_over_single'])} ("
                        + ", ".join(num(x) for x in r.get("speed_over_single_runs") or [])
                        + ")",
                    ]
                    for r in reads
                ],
            )
        )
    return text


def cold_tables(rows: list[Row]) -> str:
    """bench_cold: each reader's cold tokens/s and share of the device's best; the
    training thread's loop while tokload streams cold data."""
    thr = [r for r in rows if r.get("part") == "throughput"]
    out = [
        table(
            ["reader", "M tokens/s", "of the device's best"],
            [
                [cell(r.get("reader")), num(r.get("m_tokens_per_s")), pct(r.get("of_device_best"))]
                for r in thr
            ],
        )
    ]
    for r in rows:
        if r.get("part") == "training thread":
            runs = ", ".join(pct(x) for x in r.get("loop_speed_kept_runs") or [])
            out.append(
                f"The training thread's pure-Python loop, while {cell(r.get('reader'))} "
                f"streams cold data (delivering {num(r.get('m_tokens_per_s'))} M tokens/s "
                f"meanwhile): {pct(r.get('loop_speed_kept'))} of its speed alone (runs: {runs})."
            )
    return "\n\n".join(out)


def read_cold_tables(rows: list[Row]) -> str:
    """bench_read_cold: each layout's cold tokens/s, read by read() and by the loader."""
    return table(
        ["read by", "layout", "M tokens/s", "of TokenStream's"],
        [
            [
                "`view.read`, one batch after the other"
                if r.get("how") == "read"
                else "the DataLoader, defaults",
                cell(r.get("layout")),
                num(r.get("m_tokens_per_s")),
                pct(r.get("of_token_stream")),
            ]
            for r in rows
        ],
    )


def stall_tables(rows: list[Row]) -> str:
    """bench_stall: the storage through the delay filesystem, then each loader's waits."""
    probe = [r for r in rows if "p50_ms" not in r and "note" not in r]
    loaders = [r for r in rows if "p50_ms" in r or "note" in r]
    out = []
    if probe:
        out.append(
            "The storage through the delay filesystem (C probe, random window reads): "
            + ", ".join(
                f"{cell(r.get('loader')).removeprefix('C probe, ')} "
                f"{num(r.get('m_tokens_per_s'))} M tokens/s"
                for r in probe
            )
            + "."
        )
    body = []
    for r in loaders:
        if "note" in r:
            body.append([cell(r.get("loader")), cell(r.get("note"))] + [DASH] * 6)
            continue
        body.append(
            [
                cell(r.get("loader")),
                num(r.get("p50_ms")),
                num(r.get("p99_ms")),
                num(r.get("p999_ms")),
                num(r.get("max_ms")),
                num(r.get("waited_s")),
                cell(r.get("reads")),
                cell(r.get("delayed")),
            ]
        )
    out.append(
        table(
            ["loader", "p50 ms", "p99 ms", "p99.9 ms", "max ms", "waited s", "reads", "delayed"],
            body,
        )
    )
    return "\n\n".join(out)


def cost_tables(rows: list[Row]) -> str:
    sizes = sorted({int(r["tokens"]) for r in rows})
    by = {(r["loader"], int(r["tokens"])): r for r in rows}
    body = []
    for n in sizes:
        line = [f"{n:.0e}".replace("e+", "e")]
        for kind in ("tokload", "plain"):
            r = by.get((kind, n))
            line += [
                seconds(r["open_s"]) if r else DASH,
                seconds(r["ttfb_s"]) if r else DASH,
                nbytes(r["rss_growth_bytes"]) if r else DASH,
            ]
        body.append(line)
    header = [
        "tokens",
        "tokload open",
        "tokload first batch",
        "tokload RSS growth",
        "plain open",
        "plain first batch",
        "plain RSS growth",
    ]
    return (
        "Plain: `np.memmap` + a NumPy permutation + `torch.utils.data.DataLoader` "
        "(a dash: not measured, its permutation outgrows memory).\n\n" + table(header, body)
    )


# ---- the page --------------------------------------------------------------------------


@dataclass(frozen=True)
class Bench:
    name: str
    title: str
    what: str
    command: str
    render: Callable[[list[Row]], str] = generic


PYTEST = "python -m pytest bench/{} -o python_files='bench_*.py'"

BENCHMARKS = [
    Bench(
        "bench_permute",
        "Permutation",
        "Indices per second of tokload's Feistel permutation filling a range and permuting "
        "random indices (one call, in C, one core), against pygfc's per-index `p[i]` and "
        "numpy's `permutation` amortized per index, for n = 10^6, 2.7·10^8 and 10^12.",
        PYTEST.format("bench_permute.py"),
        permute_tables,
    ),
    Bench(
        "bench_read",
        "Random window reads",
        "Tokens per second of batches of 8 random windows of 4,097 `uint32` tokens from a "
        "64M-token dataset in the page cache: tokload's views (one call, in C) against "
        "`np.memmap` fancy indexing and memmap slices stacked, and a stream with metadata.",
        PYTEST.format("bench_read.py"),
        read_tables,
    ),
    Bench(
        "bench_read_layouts",
        "Read kinds and metadata layouts",
        "Tokens per second of every read kind on the same 8M `uint16` tokens (documents of "
        "2,048, windows of 4,097, batches of 8, page cache warm), as a share of "
        "`TokenStream`'s measured in turns with it: metadata blocks, the span table and "
        "per-token ids at 1 record per 10, 100 and 1,000 tokens, documents padded and "
        "packed, and indexes read entry by entry (`TOKLOAD_INDEX_MEMORY=0`); and the size "
        "of each build on disk.",
        "python -m bench.bench_read",
        layout_tables,
    ),
    Bench(
        "bench_packing",
        "Best-fit packing",
        "Rows of 4,096 tokens filled with whole documents of log-normal lengths (median 600 "
        "tokens): the share of padding with best-fit packing by look-ahead, against greedy "
        "packing and one document per row (200,000 lengths in a shuffle's order), and the "
        "packer's time per document; then, on 32M `uint32` tokens in the page cache, one "
        "step's read of 8 packed rows by the `Fill` policy's reader "
        "(`tokload.Fill(4096).reader(...)`) and the reads of that step's documents alone "
        "(`Documents.read_extents`, one read per document: what a `Fill` step cannot do "
        "without) against a plain `TokenStream` batch, and through "
        "the DataLoader (1 reader thread, flat out, `device=None`) the time per batch of "
        "token streams with attention metadata, of "
        "`DataLoader(Documents(p), 8, batching=tokload.Fill(4096))` and of the same over a "
        "`tokload.Blend` of 16 sources of three formats (6 tokload builds, 5 Megatron "
        "`.bin/.idx` prefixes, 5 flat `.npy` files opened with "
        "`tokload.open_flat(path, eos=0)`; 32M `int32` tokens, since Megatron has no "
        "`uint32`), with the I/O engine calls per reader task.",
        "python -m bench.bench_packing",
        packing_tables,
    ),
    Bench(
        "bench_loader",
        "DataLoader throughput and the training thread",
        "End to end: tokens per second delivered as torch tensors by tokload's DataLoader and "
        "by a plain `torch.utils.data.DataLoader` over `np.memmap` windows (64M `uint32` "
        "tokens, page cache warm, windows of 4,097, batch 8, shuffled), and what each loader "
        "costs a pure-Python loop on the main thread.",
        PYTEST.format("bench_loader.py") + " -s",
        loader_tables,
    ),
    Bench(
        "bench_blend",
        "Blending",
        "Constructing a 3-source blend: tokload's `Blend` (nothing stored per sample) "
        "against the per-sample index arrays Megatron-style blending precomputes (time and "
        "peak traced memory), and a lookup once built. Then a blend of 1,000 tiny local "
        "tokload builds: the time to open the 1,000 `Documents` and of "
        "`tokload.Blend([(Documents(p), 1), ...], length=..., block_size=...)` (median of 3, "
        "views opened anew each time), and the Python heap held at 100 and 1,000 components. "
        "Last, the DataLoader's time per batch over a blend of 16 and of 256 sources against "
        "one source of the same tokens, as token windows, as token windows with every "
        "attention key (`boundaries=True`) and as `Fill(4096)`.",
        PYTEST.format("bench_blend.py") + " -s",
        blend_tables,
    ),
    Bench(
        "cost_curves",
        "Cost against dataset size",
        "Open time, time to first shuffled batch and resident memory growth against dataset "
        "size (10^6 to 10^12 `uint32` tokens, sparse files), each point in a fresh process, "
        "median of 3: tokload against the plain memmap + permutation recipe.",
        "python bench/cost_curves.py",
        cost_tables,
    ),
    Bench(
        "bench_cold",
        "Cold storage",
        "Tokens per second with the page cache dropped before every measurement: the "
        "device's own limit (a C probe with 1 to 64 reads in flight, io_uring), tokload's "
        "DataLoader on each I/O path, the plain loader and peers; and the training thread "
        "while tokload streams cold data. Needs root.",
        "sudo " + PYTEST.format("bench_cold.py") + " -s",
        cold_tables,
    ),
    Bench(
        "bench_read_cold",
        "Streams with metadata, cold",
        "Tokens per second of every metadata layout read cold (page cache dropped), one batch "
        "after the other and through the DataLoader, as a share of TokenStream's. Needs root.",
        "sudo python -m bench.bench_read_cold",
        read_cold_tables,
    ),
    Bench(
        "bench_stall",
        "Stalls on slow storage",
        "How long a trainer's `next()` blocks (p50, p99, p99.9, max) when every read goes "
        "through a FUSE filesystem that delays some of them, for tokload and the other "
        "loaders. Needs root and FUSE.",
        "sudo " + PYTEST.format("bench_stall.py") + " -s",
        stall_tables,
    ),
    Bench(
        "bench_build",
        "Building a dataset",
        "`tokload build` in MB of text per second against the tokenizer's own `encode_batch` "
        "on the same cores and Megatron-LM's preprocessing recipe, with and without metadata.",
        "python -m bench.bench_build --mb 200",
    ),
    Bench(
        "bench_build_memory",
        "Building from one large plain-text file",
        "`tokload build` of one plain-text file of 10 GB (one document, read and tokenized "
        "in pieces of 256 kB) with the byte tokenizer, in a new process as a user runs it: its "
        "peak resident memory (the process's own high-water mark), its speed, and how long "
        "it takes to stop after Ctrl+C (SIGINT a second and a half in).",
        "python -m bench.bench_build_memory --gb 10",
    ),
    Bench(
        "bench_remote",
        "Object storage",
        "Shuffled windows of 4,097 `uint32` tokens, batch 8, one ranged GET per window, from "
        "a local S3 server that answers about ten thousand GETs a second on one core "
        "(`bench/fasts3.py`, in its own process on the second core; this process on the "
        "first), with 0, 20 and 100 ms added to every answer: a plain obstore loop with 16 to "
        "1,024 GETs in flight (the client as plainly as it is written) against tokload's "
        "DataLoader with its defaults, tuned (4 threads, `io_depth` 256) and with its "
        "defaults after `gc.freeze()` (the object-storage guide's advice): GETs/s, the "
        "client's CPU per GET, the bytes per GET, tokens/s, open to first batch, the "
        "trainer's `next()` wait "
        "once the prefetch is full (at 20 ms, consuming at 80% of the rate), the bytes "
        "written to local disk; at 100 ms, `Documents` with its defaults (its storage "
        "options too) against the token stream in real tokens/s. tokload's defaults are "
        "measured in three rounds, each between two measurements of the plain loop's best "
        "whose mean is that round's reference (this VM's speed drifts by a fifth from one "
        "minute to the next, and one measurement may lose a second to it); the goals take "
        "each ratio's median over the rounds, and the table shows the median round (with "
        "the rounds' median `next()` p99.9 wait). The goals take tokload's GETs/s over the "
        "whole measurement (from the "
        "first batch, while the limit on GETs in flight settles) and over its second half. "
        "Every measurement starts with `gc.collect()` (as `timeit` and pyperf start theirs): "
        "a full collection of this process's heap (torch imported) holds the GIL for 0.1 to "
        "0.6 s, and the garbage one measurement left was otherwise collected, by chance, in "
        "another; the full collections that run within a measurement are in its row. "
        "`Documents` reads documents of about 1,000 tokens on average (a median of 600), a "
        "GET each (two of a task's documents less than `merge_gap`, 64 KiB, apart in the "
        "corpus's one object of 762 MiB are rare), against windows of 4,097 tokens: at the "
        "same GETs/s its real tokens/s are about a quarter of the token stream's, which "
        "bounds that goal. S3 serves about "
        "5,500 GETs/s per prefix. With "
        "`TOKLOAD_BENCH_REMOTE_PEERS=1`, MosaicML streaming and litdata read the same corpus "
        "in their own formats from moto (which they upload to) at 20 ms.",
        PYTEST.format("bench_remote.py") + " -s",
        remote_tables,
    ),
    Bench(
        "bench_gpu",
        "GPU hosts",
        "Host-to-device copy throughput of tokload's pinned batches against plain pinned "
        "tensors, and a training step's time fed by tokload against batches already on the "
        "device: token windows, and rows best-fit filled (with position_ids and loss_mask) "
        "from a blend of a tokload build, a Megatron prefix and a flat .npy file. Needs a "
        "CUDA device.",
        PYTEST.format("bench_gpu.py") + " -s",
    ),
    Bench(
        "peers",
        "Against other loaders",
        "tokload side by side with the loaders users pick today (plain memmap DataLoader, "
        "torchdata, litdata, Megatron-core, MosaicML streaming) on one corpus: tokens per "
        "second, time to first batch, peak memory, shuffle index cost, the training thread. "
        "Installs the peers in a separate environment.",
        "python bench/peers/run.py",
    ),
]

HEADER = """\
<!-- Generated by `python -m bench.report` from bench/results/*.json: do not edit. -->
# Benchmarks

Every figure on this page comes from the JSON the benchmark wrote in its latest run,
kept in `bench/results/`, with the command, the machine and the date of that run.
`python -m bench.report` regenerates the page; CI fails when the page and the JSON
disagree. A benchmark's ratios compare figures measured in the same run on the same
machine. Goals are checked against figures of the same run and stated as met or
missed, with by how much.
"""


def machine_line(doc: Doc) -> str:
    m = doc.get("machine") or {}
    parts = [
        f"{m.get('cpu', '?')}, {m.get('cores', '?')} cores, {num(m.get('mem_gb'))} GB",
        f"Linux {m.get('kernel', '?')}",
        f"Python {m.get('python', '?')}",
        f"torch {m.get('torch') or DASH}",
        f"NumPy {m.get('numpy') or DASH}",
        f"tokload {m.get('tokload', '?')}",
        f"GPU: {m.get('gpu') or 'none'}",
    ]
    return "; ".join(parts)


def _goal_state(g: Row) -> str:
    """The word met, or by how much the goal is missed."""
    return "met" if g.get("met") else str(g.get("missed_by") or "missed")


def goals_section(goals: list[Row]) -> str:
    body = []
    for g in goals:
        body.append(
            [cell(g.get("what")), cell(g.get("target")), cell(g.get("measured")), _goal_state(g)]
        )
    return "**Goals**\n\n" + table(["goal", "target", "measured", "result"], body)


def section(bench: Bench, doc: Doc | None, assets: set[str]) -> str:
    out = [f"## {bench.title}", "", bench.what, ""]
    if doc is None:
        out.append(f"Not run yet: `{bench.command}`")
        return "\n".join(out)
    load = doc.get("load")
    out += [
        f"- Command: `{doc['command']}`",
        f"- Date: {doc['date']}",
        f"- Machine: {machine_line(doc)}",
        f"- Load average at start: {num(load) if load is not None else DASH}",
        "",
    ]
    rows = doc["results"]
    out.append(bench.render(rows) if rows else "The run recorded no results.")
    if f"{bench.name}.png" in assets:
        out += ["", f"![{bench.title}](benchmarks/{bench.name}.png)"]
    if doc["goals"]:
        out += ["", goals_section(doc["goals"])]
    return "\n".join(out)


def _assets(results_dir: Path) -> set[str]:
    return {p.name for p in results_dir.glob("*.png")}


def render_page(results_dir: Path) -> str:
    docs = load_all(results_dir)
    assets = _assets(results_dir)
    known = {b.name for b in BENCHMARKS}
    benches = BENCHMARKS + [
        Bench(name, name, "A benchmark without a description in bench/report.py.", DASH)
        for name in sorted(docs)
        if name not in known
    ]
    parts = [HEADER]
    parts += [section(b, docs.get(b.name), assets) for b in benches]
    return "\n\n".join(p.rstrip("\n") for p in parts) + "\n"


# ---- the README headline ---------------------------------------------------------------


def headline_rows(docs: dict[str, Doc]) -> list[list[str]]:
    rows: list[list[str]] = []
    perm = docs.get("bench_permute", {}).get("results", [])
    ours = _rate(perm, "tokload range (table auto)", "n=2.7e8")
    if ours:
        pygfc = _rate(perm, "pygfc p[i] loop", "n=2.7e8")
        rows.append(
            [
                "Permutation, n = 2.7·10^8, one core",
                f"{num(1e9 / ours)} ns per index",
                f"{ratio(ours, pygfc)} pygfc's `p[i]`" if pygfc else DASH,
            ]
        )
    read = docs.get("bench_read", {}).get("results", [])
    ts = _rate(read, "tokload TokenStream.read")
    if ts:
        mm = _rate(read, "np.memmap slices + np.stack")
        rows.append(
            [
                "`TokenStream` random windows, warm cache",
                f"{num(ts * 4 / 1e9)} GB/s ({mega(ts, ' tokens/s')})",
                f"{ratio(ts, mm)} memmap slices" if mm else DASH,
            ]
        )
    loader = docs.get("bench_loader", {}).get("results", [])
    tl = _rate(loader, "tokload (2 threads)")
    if tl:
        # against the faster of the plain loader's settings, whichever it was in this run
        plain = [
            (rate, label)
            for label in (
                "torch DataLoader + memmap, 0 workers",
                "torch DataLoader + memmap, 2 workers",
            )
            if (rate := _rate(loader, label))
        ]
        best = max(plain) if plain else None
        rows.append(
            [
                "DataLoader, shuffled, tensors",
                mega(tl, " tokens/s"),
                f"{ratio(tl, best[0])} {best[1]} (the faster setting)" if best else DASH,
            ]
        )
    kept = _find(loader, label="tokload (1 thread)", group=_KEPT_GROUP)
    if kept:
        meanwhile = next(
            (
                g
                for g in docs.get("bench_loader", {}).get("goals", [])
                if "delivers meanwhile" in str(g.get("what"))
            ),
            None,
        )
        rate_goal = f"; goal {meanwhile['target']} M, {_goal_state(meanwhile)}" if meanwhile else ""
        rows.append(
            [
                "Main-thread Python loop kept while tokload loads",
                pct(kept["loop_kept"]),
                f"goal: 97%{' (over 100%: the noise of the run)' if kept['loop_kept'] > 1 else ''}"
                f"; while delivering {mega(kept.get('tokens_per_s_meanwhile'), ' tokens/s')}"
                f"{rate_goal}",
            ]
        )
    for g in docs.get("bench_cold", {}).get("goals", []):
        if "device" in str(g.get("what")):
            rows.append(["Cold storage, tokload defaults", cell(g["measured"]), "of the disk"])
            break
    blend = docs.get("bench_blend", {}).get("results", [])
    b = _find(blend, label="tokload Blend")
    n = _find(blend, label="NumPy Megatron-style arrays")
    if b and n:
        rows.append(
            [
                f"Blend construction, {cell(b.get('positions'))} positions",
                seconds(b["construction_s"]),
                f"{ratio(n['construction_s'], b['construction_s'])} faster than "
                "Megatron-style index arrays",
            ]
        )
    gpu = docs.get("bench_gpu", {})
    fed = _find(gpu.get("results", []), label="tokload (device='auto')")
    pre = _find(gpu.get("results", []), label="pre-loaded on the GPU")
    if fed and pre:
        rows.append(
            [
                f"Training step fed by tokload, {gpu['machine'].get('gpu') or 'GPU'}",
                f"{num(fed['step_ms'])} ms",
                f"{fed['step_ms'] / pre['step_ms']:.3f}× the step on batches already on the GPU",  # noqa: RUF001
            ]
        )
    return rows[:7]


_KEPT_GROUP = "main-thread Python loop while the loader is drained"


def render_headline(results_dir: Path) -> str:
    rows = headline_rows(load_all(results_dir))
    lines = []
    if rows:
        lines += [table(["", "measured", "compared with"], rows), ""]
    else:
        lines += ["No benchmark has been run yet.", ""]
    lines.append("Full results, machine and command: [benchmarks](docs/benchmarks.md)")
    return "\n".join(lines)


def replace_region(readme_text: str, body: str, where: str = "README.md") -> str:
    start, end = readme_text.find(BEGIN), readme_text.find(END)
    if start < 0 or end < start:
        raise ReportError(f"{where}: no {BEGIN} ... {END} region")
    return readme_text[: start + len(BEGIN)] + "\n" + body + "\n" + readme_text[end:]


# ---- generate and check ------------------------------------------------------------------


def expected(results_dir: Path, readme: Path) -> tuple[str, str]:
    page = render_page(results_dir)
    readme_text = replace_region(readme.read_text(), render_headline(results_dir), str(readme))
    return page, readme_text


def generate(results_dir: Path, page: Path, readme: Path, assets: Path) -> None:
    page_text, readme_text = expected(results_dir, readme)
    page.parent.mkdir(parents=True, exist_ok=True)
    page.write_text(page_text)
    readme.write_text(readme_text)
    pngs = sorted(results_dir.glob("*.png"))
    if pngs:
        assets.mkdir(parents=True, exist_ok=True)
    for p in pngs:
        shutil.copyfile(p, assets / p.name)


def check(results_dir: Path, page: Path, readme: Path, assets: Path) -> list[str]:
    """What differs from what the JSON gives (empty when everything is up to date)."""
    page_text, readme_text = expected(results_dir, readme)
    problems = []
    if not page.exists() or page.read_text() != page_text:
        problems.append(f"{page} differs from what {results_dir}/*.json gives")
    if readme.read_text() != readme_text:
        problems.append(f"{readme}: the {BEGIN} region differs from what the JSON gives")
    for p in sorted(results_dir.glob("*.png")):
        copy = assets / p.name
        if not copy.exists() or copy.read_bytes() != p.read_bytes():
            problems.append(f"{copy} is not a copy of {p}")
    return problems


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    ap.add_argument("--check", action="store_true", help="fail if the outputs are stale")
    ap.add_argument("--results", type=Path, default=RESULTS_DIR)
    ap.add_argument("--page", type=Path, default=PAGE)
    ap.add_argument("--readme", type=Path, default=README)
    ap.add_argument("--assets", type=Path, default=ASSETS)
    args = ap.parse_args(argv)
    try:
        if args.check:
            problems = check(args.results, args.page, args.readme, args.assets)
            for p in problems:
                print(f"bench.report --check: {p}", file=sys.stderr)
            if problems:
                print("run `python -m bench.report` and commit the result", file=sys.stderr)
                return 1
            return 0
        generate(args.results, args.page, args.readme, args.assets)
    except ReportError as e:
        print(f"bench.report: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
