"""Cost curves: open time, time to first batch and RSS against dataset size.

    python bench/cost_curves.py              # writes bench/results/cost_curves.json and .png
    python bench/cost_curves.py --plot-only  # redraws the PNG from the .json

Datasets of 10^6 to 10^12 uint32 tokens are sparse files (shards of at most
10^9 tokens; a 10^12-token dataset takes 4 TB of address space and a few KB
of disk). Every point is measured in a fresh Python process, which imports
what it needs (not timed), then times opening the data and building the
first shuffled batch of 8 windows of 4097 tokens, and reports its RSS growth
over that time (peak resident memory from /proc, minus the baseline after
imports).

Next to tokload: the plain recipe (``np.memmap`` of the token file, a NumPy
permutation of the windows, ``torch.utils.data.DataLoader``, 0 workers), the
fastest peer to first batch in docs/comparison.md, where it can run: its permutation
grows with the data (8 bytes per window), so it is measured up to 10^11
tokens (24M windows) and left out beyond.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

SIZES = [10**6, 10**7, 10**8, 10**9, 10**10, 10**11, 10**12]
PLAIN_MAX = 10**11
SHARD = 10**9
HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"

_CHILD = r"""
import json, sys, time
import numpy as np, torch

def rss():
    with open("/proc/self/status") as f:
        fields = dict(line.split(":", 1) for line in f)
    return int(fields["VmHWM"].split()[0]) * 1024, int(fields["VmRSS"].split()[0]) * 1024

kind, path, tokens = sys.argv[1], sys.argv[2], int(sys.argv[3])
import tokload
torch.empty(1)
base_peak, base = rss()
t0 = time.perf_counter()
if kind == "tokload":
    view = tokload.TokenStream(path, window=4097, stride=4096)
    t_open = time.perf_counter() - t0
    batch = next(iter(tokload.DataLoader(view, 8, seed=1, num_threads=1, device=None)))["tokens"]
else:
    import glob
    files = sorted(glob.glob(path + "/*.rows"))
    mms = [np.memmap(f, dtype=np.uint32, mode="r") for f in files]
    cum = np.cumsum([0] + [len(m) for m in mms])
    n = (int(cum[-1]) - 4097) // 4096 + 1
    t_open = time.perf_counter() - t0
    order = np.random.default_rng(1).permutation(n)
    class DS(torch.utils.data.Dataset):
        def __len__(self): return n
        def __getitem__(self, i):
            s = i * 4096
            k = int(np.searchsorted(cum, s, side="right")) - 1
            a = mms[k][s - cum[k]: s - cum[k] + 4097]
            if len(a) < 4097:
                a = np.concatenate([a, mms[k + 1][: 4097 - len(a)]])
            return torch.from_numpy(np.array(a))
    batch = next(iter(torch.utils.data.DataLoader(DS(), batch_size=8, sampler=order)))
ttfb = time.perf_counter() - t0
peak, now = rss()
growth = max(peak - base_peak, now - base)
print(json.dumps({"open_s": t_open, "ttfb_s": ttfb, "rss_growth": growth}))
"""


def make_dataset(root: Path, tokens: int) -> Path:
    """A sparse tokload dataset of `tokens` uint32 tokens (shards of <= 10^9)."""
    import tokload
    from tokload.format import Manifest, ShardInfo, write_manifest

    path = root / f"ds{tokens}"
    path.mkdir()
    m = Manifest(dtype=np.dtype("<u4"), documents=True)
    left, k = tokens, 0
    while left:
        rows = min(left, SHARD)
        with open(path / f"s{k:05d}.rows", "wb") as f:
            f.truncate(rows * 4)
        np.array([0, rows], dtype="<u8").tofile(path / f"s{k:05d}.docs")
        m.shards.append(ShardInfo(f"s{k:05d}", rows, 1))
        left -= rows
        k += 1
    write_manifest(path, m)
    assert tokload.open_dataset(path).num_rows == tokens
    return path


def measure(kind: str, path: Path, tokens: int) -> dict[str, float]:
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, kind, str(path), str(tokens)],
        capture_output=True,
        text=True,
        check=True,
        timeout=1800,
    )
    result: dict[str, float] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    sys.path.insert(0, str(HERE.parent))
    from bench import _results  # notes the load average now, at the start

    if "--plot-only" in sys.argv:  # redraw from the last measurement
        rows = json.loads((RESULTS / "cost_curves.json").read_text())["results"]
        redraw: dict[str, dict[int, dict[str, float]]] = {}
        for r in rows:
            redraw.setdefault(r["loader"], {})[int(r["tokens"])] = {
                "open_s": r["open_s"],
                "ttfb_s": r["ttfb_s"],
                "rss_growth": r["rss_growth_bytes"],
            }
        plot(redraw, RESULTS / "cost_curves.png")
        return
    results: dict[str, dict[int, dict[str, float]]] = {"tokload": {}, "plain": {}}
    with tempfile.TemporaryDirectory(prefix="tokload-curves-") as tmp:
        for tokens in SIZES:
            path = make_dataset(Path(tmp), tokens)
            for kind in ("tokload", "plain"):
                if kind == "plain" and tokens > PLAIN_MAX:
                    continue
                runs = [measure(kind, path, tokens) for _ in range(3)]
                med = {k: float(np.median([r[k] for r in runs])) for k in runs[0]}
                results[kind][tokens] = med
                print(
                    f"{kind:8} {tokens:>16,} tokens: open {med['open_s'] * 1e3:9.1f} ms, "
                    f"first batch {med['ttfb_s'] * 1e3:9.1f} ms, "
                    f"RSS +{med['rss_growth'] / 2**20:8.1f} MiB",
                    flush=True,
                )
    rows = [
        {
            "loader": kind,
            "tokens": tokens,
            "open_s": r["open_s"],
            "ttfb_s": r["ttfb_s"],
            "rss_growth_bytes": r["rss_growth"],
        }
        for kind, by_size in results.items()
        for tokens, r in sorted(by_size.items())
    ]
    _results.write("cost_curves", rows)
    plot(results, RESULTS / "cost_curves.png")
    print(f"wrote {RESULTS / 'cost_curves.png'}")


def plot(results: dict[str, dict[int, dict[str, float]]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 4.2))
    panels = [
        ("open_s", "open time (s)"),
        ("ttfb_s", "time to first batch (s)"),
        ("rss_growth", "RSS growth (MiB)"),
    ]
    labels = {"tokload": "tokload", "plain": "np.memmap + NumPy permutation + torch DataLoader"}
    for ax, (key, title) in zip(axes, panels, strict=True):
        for kind, style in (("tokload", "o-"), ("plain", "s--")):
            xs = sorted(results[kind])
            ys = [results[kind][x][key] / (2**20 if key == "rss_growth" else 1) for x in xs]
            ax.plot(xs, ys, style, label=labels[kind])
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("dataset size (tokens)")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(
        "Cost against dataset size (windows of 4097, batch 8, shuffled; fresh process "
        "per point, median of 3)"
    )
    fig.tight_layout()
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    main()
