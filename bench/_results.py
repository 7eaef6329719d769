"""The JSON every benchmark writes to ``bench/results/NAME.json``.

One envelope for all of them::

    {"benchmark": NAME, "command": "...", "date": "2026-...Z",
     "machine": {...}, "load": 0.3, "results": [{...}, ...], "goals": [{...}, ...]}

``results`` is a list of flat rows (one dict each, the benchmark's own keys);
``goals`` lists what the benchmark checks against a limit measured in the same
run: ``{"what", "target", "measured", "met", "missed_by"}``. ``python -m
bench.report`` turns these files into ``docs/benchmarks.md``.

pytest benchmarks add rows and goals with :func:`record` and :func:`goal`;
``bench/conftest.py`` writes one file per module at the end of the session.
Scripts call :func:`write` at the end of ``main``.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = ROOT / "bench" / "results"

# rows and goals recorded by pytest benchmarks, by module name (bench_loader, ...)
RECORDED: dict[str, dict[str, list[dict[str, Any]]]] = {}


def load_average() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


LOAD_AT_IMPORT = load_average()


def command_line(argv: list[str] | None = None) -> str:
    """The command as it was typed (``python -m pytest ...``, ``python bench/x.py ...``)."""
    argv = list(sys.argv if argv is None else argv)
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None and spec.name:
        name = spec.name.removesuffix(".__main__")
        head = ["python", "-m", name]
    else:
        first = argv[0] if argv else ""
        head = ["python", os.path.relpath(first, ROOT) if os.path.isabs(first) else first]
    return shlex.join([*env_settings(), *head, *argv[1:]])


def env_settings() -> list[str]:
    """The ``TOKLOAD_*`` settings of this run, as ``NAME=value`` words of its command."""
    return [f"{k}={os.environ[k]}" for k in sorted(os.environ) if k.startswith("TOKLOAD_")]


def _git(*args: str) -> str:
    res = subprocess.run(
        ["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=20, check=False
    )
    return res.stdout.strip() if res.returncode == 0 else ""


def tokload_version() -> str:
    try:
        import tokload

        version = str(getattr(tokload, "__version__", "unknown"))
    except ImportError:
        version = "not importable"
    # a copy made for a remote GPU host (without .git, or with one of another commit):
    # the commit it was copied from, as the command that sent it says
    commit = os.environ.get("BENCH_GIT_COMMIT", "")
    if commit:
        return f"{version} ({commit})"
    commit = _git("rev-parse", "--short", "HEAD")
    if commit:
        dirty = _git("status", "--porcelain", "--untracked-files=no", "--", "tokload", "csrc")
        version += f" ({commit}{'-dirty' if dirty else ''})"
    return version


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _mem_gb() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return None


def _module_version(name: str) -> str | None:
    mod = sys.modules.get(name)
    if mod is None:
        try:
            mod = __import__(name)
        except ImportError:
            return None
    return str(getattr(mod, "__version__", "unknown"))


def _gpu() -> str | None:
    try:
        import torch

        if torch.cuda.is_available():
            return str(torch.cuda.get_device_name())
    except ImportError:
        pass
    return None


def machine() -> dict[str, Any]:
    return {
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "mem_gb": _mem_gb(),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "torch": _module_version("torch"),
        "numpy": _module_version("numpy"),
        "tokload": tokload_version(),
        "gpu": _gpu(),
    }


def missed_by(measured: float, target: float, higher_is_better: bool = True) -> str | None:
    """``None`` when ``measured`` meets ``target``, else "missed by X%" of the target."""
    met = measured >= target if higher_is_better else measured <= target
    if met:
        return None
    gap = abs(target - measured) / abs(target) if target else float("inf")
    return f"missed by {100 * gap:.0f}%"


def make_goal(
    what: str,
    target: float,
    measured: float,
    higher_is_better: bool = True,
    fmt: str = "{:.2f}",
) -> dict[str, Any]:
    """A goal row: ``target`` and ``measured`` as text, ``met`` and ``missed_by``."""
    miss = missed_by(measured, target, higher_is_better)
    op = ">=" if higher_is_better else "<="
    return {
        "what": what,
        "target": f"{op} {fmt.format(target)}",
        "measured": fmt.format(measured),
        "met": miss is None,
        "missed_by": miss,
    }


def record(module: str, **row: Any) -> None:
    """Add a result row for ``module`` (``bench_loader``...) to this session's JSON."""
    RECORDED.setdefault(module, {"results": [], "goals": []})["results"].append(row)


def goal(module: str, what: str, target: float, measured: float, **kw: Any) -> None:
    """Add a goal for ``module`` (see :func:`make_goal`)."""
    entry = RECORDED.setdefault(module, {"results": [], "goals": []})
    entry["goals"].append(make_goal(what, target, measured, **kw))


def envelope(
    name: str,
    results: list[dict[str, Any]],
    goals: list[dict[str, Any]] | None = None,
    command: str | None = None,
    load: float | None = None,
) -> dict[str, Any]:
    return {
        "benchmark": name,
        "command": command if command is not None else command_line(),
        "date": _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "machine": machine(),
        "load": LOAD_AT_IMPORT if load is None else load,
        "results": results,
        "goals": goals or [],
    }


def write(
    name: str,
    results: list[dict[str, Any]],
    goals: list[dict[str, Any]] | None = None,
    command: str | None = None,
    load: float | None = None,
    directory: Path | None = None,
) -> Path:
    """Write ``bench/results/NAME.json`` and return its path."""
    out = (directory or RESULTS_DIR) / f"{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = envelope(name, results, goals, command, load)
    out.write_text(json.dumps(doc, indent=1, sort_keys=False) + "\n")
    print(f"wrote {out.relative_to(ROOT) if out.is_relative_to(ROOT) else out}", file=sys.stderr)
    return out
