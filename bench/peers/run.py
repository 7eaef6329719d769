"""Side-by-side benchmark of tokload against the loaders users pick today.

    python bench/peers/run.py                 # ~200M tokens; prints the table
    python bench/peers/run.py --tokens 20000000 --seconds 3   # a quick pass

1. Creates a separate virtual environment (``bench/peers/.venv``, never the
   test environment) and installs, as docs/comparison.md says: torch==2.13.0
   first, then ``numpy<2.2`` megatron-core torchdata pygfc psutil with torch
   pinned by a constraints file, then mosaicml-streaming and litdata with
   ``--no-deps`` plus their light dependencies (both declare torchvision,
   which would pull a CUDA torch), then tokload itself from this checkout.
2. Builds one deterministic corpus into every system's format
   (``bench/peers/corpus.py``), in ``bench/peers/.corpus``.
3. Measures each loader in fresh processes (``bench/peers/child.py``): tokens/s
   delivered as torch tensors (window 4097, batch 8, shuffled, warm page
   cache) with 0 and 2 workers, time to first batch from process start, peak
   RSS, shuffle-index cost, and the main-thread slowdown of a pure-Python loop
   while the loader is drained flat out. Median of 3 runs for the rates.
4. Prints a Markdown table with tokload's ratio against each peer and writes
   ``bench/peers/results.json`` (everything, the peers' versions included) and
   ``bench/results/peers.json`` (one row per loader, for the benchmarks page).
   A peer that cannot be installed or run is reported as such, with the reason.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
VENV = HERE / ".venv"
CORPUS = HERE / ".corpus"
PY = VENV / "bin" / "python"
LIGHT_DEPS = [
    "boto3",
    "Brotli",
    "google-cloud-storage<3.3",
    "matplotlib",
    "paramiko",
    "python-snappy",
    "tqdm",
    "transformers<5",
    "xxhash",
    "zstd",
    "oci",
    "azure-storage-blob",
    "azure-storage-file-datalake",
    "azure-identity",
    "catalogue",
    "lightning-utilities",
    "filelock",
    "tifffile",
    "obstore",
    "psutil",
]
LOADERS = [
    ("tokload", "tokload (own format)"),
    ("tokload-megatron", "tokload (Megatron .bin/.idx in place)"),
    ("memmap", "plain torch DataLoader + np.memmap"),
    ("torchdata", "torchdata.nodes (threads)"),
    ("litdata", "litdata StreamingDataset + TokensLoader"),
    ("megatron", "Megatron-core GPTDataset"),
    ("mosaic", "MosaicML streaming (MDS)"),
]


def sh(*cmd: str, **kw: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, text=True, capture_output=True, **kw)


def pip(*args: str) -> None:
    res = sh(str(PY), "-m", "pip", "install", "-q", *args)
    if res.returncode:
        raise RuntimeError(f"pip install {' '.join(args)} failed:\n{res.stderr[-2000:]}")


def install() -> dict[str, str]:
    """The peers' venv; returns {package: version or 'not installed: why'}."""
    if not PY.exists():
        sh(sys.executable, "-m", "venv", str(VENV), check=True)
        pip("torch==2.13.0")
        constraints = VENV / "constraints.txt"
        constraints.write_text("torch==2.13.0\n")
        pip(
            "-c",
            str(constraints),
            "numpy<2.2",
            "megatron-core",
            "torchdata",
            "pygfc",
            "psutil",
            "tqdm",
            "tokenizers",
        )
        pip("--no-deps", "mosaicml-streaming", "litdata")
        pip("-c", str(constraints), *LIGHT_DEPS)
    # tokload from this checkout, rebuilt every run so the current code is measured
    pip("--no-deps", "--force-reinstall", str(ROOT))
    versions: dict[str, str] = {}
    for pkg in (
        "torch",
        "numpy",
        "megatron-core",
        "torchdata",
        "mosaicml-streaming",
        "litdata",
        "tokload",
    ):
        res = sh(str(PY), "-m", "pip", "show", pkg)
        line = [ln for ln in res.stdout.splitlines() if ln.startswith("Version:")]
        versions[pkg] = line[0].split()[1] if line else "not installed"
    return versions


# the package whose version each loader row names
PACKAGES = {
    "tokload-megatron": "tokload",
    "memmap": "torch",
    "megatron": "megatron-core",
    "mosaic": "mosaicml-streaming",
}


def run_child(loader: str, workers: int, mode: str, seconds: float) -> dict[str, Any]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    res = sh(
        str(PY),
        str(HERE / "child.py"),
        loader,
        str(workers),
        str(CORPUS),
        mode,
        str(seconds),
        env=env,
        timeout=600,
    )
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("{")]
    if res.returncode or not lines:
        err = (res.stderr.strip().splitlines() or ["no output"])[-1]
        return {"error": err[:300]}
    result: dict[str, Any] = json.loads(lines[-1])
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=200_000_000)
    ap.add_argument("--seconds", type=float, default=4.0, help="throughput window per run")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    t_all = time.perf_counter()
    versions = install()
    print("versions:", json.dumps(versions), flush=True)
    info_path = CORPUS / "corpus.json"
    if not info_path.exists() or json.loads(info_path.read_text())["tokens"] != args.tokens:
        res = sh(str(PY), str(HERE / "corpus.py"), str(CORPUS), "--tokens", str(args.tokens))
        if res.returncode:
            raise SystemExit(f"building the corpus failed:\n{res.stderr[-3000:]}")
    corpus = json.loads(info_path.read_text())
    print("corpus:", json.dumps(corpus), flush=True)
    for p in CORPUS.rglob("*"):  # warm page cache for every format
        if p.is_file():
            with open(p, "rb") as f:
                while f.read(1 << 24):
                    pass
    results: dict[str, Any] = {
        "versions": versions,
        "corpus": corpus,
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "loaders": {},
    }
    for loader, _label in LOADERS:
        entry: dict[str, Any] = {}
        for workers in (0, 2):
            runs = [run_child(loader, workers, "rate", args.seconds) for _ in range(args.repeats)]
            ok = [r for r in runs if "error" not in r]
            if not ok:
                entry[f"w{workers}"] = runs[0]
                continue
            entry[f"w{workers}"] = {
                k: statistics.median(r[k] for r in ok)
                for k in ok[0]
                if isinstance(ok[0][k], (int, float))
            }
        entry["slowdown"] = run_child(loader, 0, "slowdown", args.seconds)
        results["loaders"][loader] = entry
        print(loader, json.dumps(entry), flush=True)
    results["seconds"] = time.perf_counter() - t_all
    (HERE / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    write_page_results(results)
    print(table(results))


def write_page_results(results: dict[str, Any]) -> None:
    """One row per loader in ``bench/results/peers.json``, for ``python -m bench.report``."""
    sys.path.insert(0, str(HERE.parents[1]))
    from bench import _results

    rows = []
    for name, label in LOADERS:
        e = results["loaders"].get(name, {})
        package = PACKAGES.get(name, name)
        row: dict[str, Any] = {"label": label, "version": results["versions"].get(package)}
        for workers in (0, 2):
            got = e.get(f"w{workers}", {})
            if "error" in got:
                row["error"] = got["error"]
                continue
            row[f"tokens_per_s_{workers}_workers"] = got.get("tokens_per_s")
        w0 = e.get("w0", {})
        for key in ("ttfb_s", "import_s", "peak_rss_mb", "index_bytes"):
            if key in w0:
                row[key] = w0[key]
        kept = e.get("slowdown", {}).get("loop_kept")
        if kept is not None:
            row["loop_kept"] = kept
        rows.append(row)
    _results.write("peers", rows)


def table(results: dict[str, Any]) -> str:
    L = results["loaders"]
    ref = L.get("tokload", {})

    def get(name: str, key: str, sub: str) -> float | None:
        v = L.get(name, {}).get(key, {})
        return v.get(sub) if isinstance(v, dict) else None

    rows = [
        "| loader | Mtok/s, 0 workers | Mtok/s, 2 workers | time to first batch, s "
        "(of which import) | peak RSS MB | shuffle index | Python loop kept | "
        "tokload vs it (0 w / 2 w / first batch / RSS) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, label in LOADERS:
        e = L.get(name, {})
        if "error" in e.get("w0", {}):
            rows.append(f"| {label} | could not run: {e['w0']['error']} | | | | | | |")
            continue
        r0, r2 = get(name, "w0", "tokens_per_s"), get(name, "w2", "tokens_per_s")
        ttfb, imp = get(name, "w0", "ttfb_s"), get(name, "w0", "import_s")
        rss = get(name, "w0", "peak_rss_mb")
        idx_b, idx_s = get(name, "w0", "index_bytes"), get(name, "w0", "index_s")
        sd = e.get("slowdown", {})
        kept = (
            f"{sd['loop_kept']:.0%} ({sd['tokens_per_s_while_busy'] / 1e6:.1f} Mtok/s)"
            if "loop_kept" in sd
            else "n/a"
        )
        t0, t2 = ref.get("w0", {}).get("tokens_per_s"), ref.get("w2", {}).get("tokens_per_s")
        rt, rr = ref.get("w0", {}).get("ttfb_s"), ref.get("w0", {}).get("peak_rss_mb")
        ratio = " / ".join(
            [
                f"{t0 / r0:.1f}x" if t0 and r0 else "-",
                f"{t2 / r2:.1f}x" if t2 and r2 else "-",
                f"{ttfb / rt:.1f}x" if ttfb and rt else "-",
                f"{rss / rr:.1f}x" if rss and rr else "-",
            ]
        )
        index = (
            f"{idx_b / 1e6:.0f} MB, {idx_s:.2f} s"
            if idx_b is not None and idx_s is not None
            else "built internally"
        )

        def fmt(v: float | None, scale: float = 1.0, spec: str = ".1f") -> str:
            return "n/a" if v is None else format(v / scale, spec)

        rows.append(
            f"| {label} | {fmt(r0, 1e6)} | {fmt(r2, 1e6)} | {fmt(ttfb, spec='.2f')} "
            f"({fmt(imp, spec='.2f')}) | {fmt(rss, spec='.0f')} | {index} | {kept} | {ratio} |"
        )
    return "\n".join(rows)


if __name__ == "__main__":
    main()
