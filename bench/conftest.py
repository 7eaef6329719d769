"""Shared benchmark plumbing: print rates and ratios measured in the same run.

Each benchmark records ``extra_info["items"]`` (items processed per call),
``extra_info["unit"]`` and optionally ``extra_info["baseline"]`` (the name of
the benchmark it is compared against, within its group).  At the end of the
session this prints items/s for each and the ratio against its baseline.
"""

from __future__ import annotations

from typing import Any

import pytest


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    session = getattr(config, "_benchmarksession", None)
    if session is None or not session.benchmarks:
        return
    rows: dict[str, dict[str, tuple[float, str]]] = {}
    baselines: dict[str, list[tuple[str, str]]] = {}
    for bench in session.benchmarks:
        info = bench.extra_info
        if "items" not in info or not bench.stats:
            continue
        rate = info["items"] / bench.stats.median
        group, label = bench.group or "", info.get("label", bench.name)
        rows.setdefault(group, {})[label] = (rate, info.get("unit", "items"))
        for other in info.get("compare", []):
            baselines.setdefault(group, []).append((label, other))
    write = terminalreporter.write_line
    write("")
    write("rates (median) and ratios, all measured in this run:")
    for group, entries in sorted(rows.items()):
        write(f"  [{group}]")
        for label, (rate, unit) in sorted(entries.items(), key=lambda kv: -kv[1][0]):
            write(f"    {label:<44} {rate / 1e6:10.2f} M{unit}/s")
        for label, other in baselines.get(group, []):
            if other in entries:
                ratio = entries[label][0] / entries[other][0]
                write(f"    {label} vs {other}: {ratio:.1f}x")
