"""Shared benchmark plumbing: rates and ratios measured in the same run, and their JSON.

Each benchmark records ``extra_info["items"]`` (items processed per call),
``extra_info["unit"]`` and optionally ``extra_info["compare"]`` (the labels of
the benchmarks it is compared against, within its group).  At the end of the
session this prints items/s for each and the ratio against each baseline, and
writes ``bench/results/MODULE.json`` (see ``bench/_results.py``) for every
bench module that measured something: the pytest-benchmark stats of each
benchmark (mean, median, min, ops, the rate, its ``extra_info``), the rows and
goals the module's tests added with ``bench._results.record`` and ``goal``, and
the goals its ``bench_goals(rows)`` function (if any) derives from all of them.
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import Any

import pytest

from bench import _results

_START: dict[str, Any] = {}


def pytest_sessionstart(session: pytest.Session) -> None:
    _START["load"] = _results.load_average()
    args = [a for a in session.config.invocation_params.args]
    _START["command"] = shlex.join([*_results.env_settings(), "python", "-m", "pytest", *args])


def _benchmark_rows(config: pytest.Config) -> dict[str, list[dict[str, Any]]]:
    session = getattr(config, "_benchmarksession", None)
    rows: dict[str, list[dict[str, Any]]] = {}
    if session is None:
        return rows
    for bench in session.benchmarks:
        if not bench.stats:
            continue
        module = Path(bench.fullname.split("::", 1)[0]).stem
        stats = bench.stats
        info = dict(bench.extra_info)
        row: dict[str, Any] = {
            "group": bench.group or "",
            "name": bench.name,
            "label": info.pop("label", bench.name),
            "mean_s": stats.mean,
            "median_s": stats.median,
            "min_s": stats.min,
            "ops": stats.ops,
            "rounds": stats.rounds,
        }
        if "items" in info and stats.median:
            row["unit"] = info.get("unit", "items")
            row["rate"] = info["items"] / stats.median
        row.update({k: v for k, v in info.items() if k not in row})
        rows.setdefault(module, []).append(row)
    return rows


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if getattr(session.config.option, "collectonly", False):
        return
    rows = _benchmark_rows(session.config)
    for module in set(rows) | set(_results.RECORDED):
        results = rows.get(module, []) + _results.RECORDED.get(module, {}).get("results", [])
        goals = list(_results.RECORDED.get(module, {}).get("goals", []))
        mod = sys.modules.get(f"bench.{module}") or sys.modules.get(module)
        derive = getattr(mod, "bench_goals", None)
        if derive is not None:
            goals += derive(results)
        if results:
            _results.write(
                module, results, goals, command=_START.get("command"), load=_START.get("load")
            )


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
