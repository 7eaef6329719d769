"""``tokload build`` of one large plain-text file: resident memory, speed, and Ctrl+C.

    python -m bench.bench_build_memory --gb 10

Writes a plain-text file of ``--gb`` GB (lines of words; one document, as a
plain-text input is) in a work directory, then runs ``tokload build`` on it as
a user does (a new process, ``--tokenizer bytes`` unless ``--tokenizer`` names
another), and reports:

* the build's peak resident memory (``ru_maxrss`` of the child) against the
  goal of 500 MB for a 10 GB input, and the input's size for scale;
* the build's speed in MB of text per second;
* how long the build takes to stop after SIGINT (Ctrl+C), sent a few seconds in.

Everything it wrote is removed at the end (the output of a 10 GB input with the
byte tokenizer is 20 GB; the disk needs room for both). Results go to
``bench/results/bench_build_memory.json``.
"""

from __future__ import annotations

import argparse
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench import _results

GOAL_RSS_MB = 500.0
BLOCK = 64 << 20


def make_text(path: Path, size: int, seed: int = 0) -> int:
    """A plain-text file of about ``size`` bytes: lines of words (a 64 MB block of random
    words, written again and again, each time after a line of its own)."""
    rng = np.random.default_rng(seed)
    words = [
        w.encode()
        for w in [
            "the",
            "of",
            "and",
            "to",
            "in",
            "is",
            "was",
            "for",
            "on",
            "that",
            "with",
            "as",
            "by",
            "at",
        ]
    ]
    words += [f"word{i}".encode() for i in range(2000)]
    picks = rng.integers(0, len(words), BLOCK // 6).tolist()
    ends = (rng.random(len(picks)) < 1 / 12).tolist()  # about 12 words a line
    block = b"".join(words[p] + (b"\n" if e else b" ") for p, e in zip(picks, ends, strict=True))
    written = 0
    with open(path, "wb") as f:
        k = 0
        while written < size:
            piece = (f"block {k}\n".encode() + block)[: size - written]
            f.write(piece)
            written += len(piece)
            k += 1
    return written


def build_cmd(text: Path, out: Path, tokenizer: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "tokload",
        "build",
        str(text),
        "-o",
        str(out),
        "--tokenizer",
        tokenizer,
        "--no-progress",
    ]


def run_build(text: Path, out: Path, tokenizer: str) -> dict[str, Any]:
    """One whole build in a child process: seconds and the child's peak RSS.

    The peak is the child's own ``VmHWM``, read every 50 ms until it exits: its
    ``ru_maxrss`` would start from this process's size at the fork.
    """
    shutil.rmtree(out, ignore_errors=True)
    t0 = time.perf_counter()
    p = subprocess.Popen(build_cmd(text, out, tokenizer), stdout=subprocess.DEVNULL)
    peak_kb = 0
    while p.poll() is None:
        peak_kb = max(peak_kb, _hwm_kb(p.pid))
        time.sleep(0.05)
    seconds = time.perf_counter() - t0
    if p.returncode != 0:
        raise RuntimeError(f"tokload build exited with {p.returncode}")
    return {"seconds": seconds, "peak_rss_mb": peak_kb / 1024}


def _hwm_kb(pid: int) -> int:
    """The process's peak resident memory so far (kB), or 0 once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def ctrl_c(text: Path, out: Path, tokenizer: str, after: float) -> dict[str, Any]:
    """SIGINT ``after`` seconds into a build: how long it takes to exit, and its exit code."""
    shutil.rmtree(out, ignore_errors=True)
    # As from a terminal: SIGINT not ignored, even when this script runs in the background
    # (where a shell starts it with SIGINT ignored, and Python keeps that).
    p = subprocess.Popen(
        build_cmd(text, out, tokenizer),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    time.sleep(after)
    if p.poll() is not None:
        raise RuntimeError("the build ended before SIGINT: use a larger --gb")
    sent = time.perf_counter()
    p.send_signal(signal.SIGINT)
    p.communicate(timeout=60)
    return {"stop_seconds": time.perf_counter() - sent, "exit_code": p.returncode}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gb", type=float, default=10.0, help="size of the text file (default 10)")
    ap.add_argument("--tokenizer", default="bytes", help="as for tokload build (default bytes)")
    ap.add_argument("--workdir", default=None, help="where to write (default: a temp dir)")
    args = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="tokload-bench-mem-", dir=args.workdir))
    try:
        text = work / "big.txt"
        t0 = time.perf_counter()
        size = make_text(text, int(args.gb * 1e9))
        print(f"wrote {size / 1e9:.2f} GB of text in {time.perf_counter() - t0:.0f} s")
        stop = ctrl_c(text, work / "out", args.tokenizer, after=1.5)
        print(f"Ctrl+C: stopped in {stop['stop_seconds']:.2f} s, exit {stop['exit_code']}")
        run = run_build(text, work / "out", args.tokenizer)
        out_bytes = sum(f.stat().st_size for f in (work / "out").rglob("*") if f.is_file())
        mbs = size / 1e6 / run["seconds"]
        print(
            f"build: {run['seconds']:.0f} s ({mbs:.1f} MB/s of text), peak RSS "
            f"{run['peak_rss_mb']:.0f} MB, output {out_bytes / 1e9:.1f} GB"
        )
        results = [
            {
                "input_gb": round(size / 1e9, 2),
                "tokenizer": args.tokenizer,
                "seconds": round(run["seconds"], 1),
                "mb_per_s": round(mbs, 1),
                "peak_rss_mb": round(run["peak_rss_mb"], 1),
                "output_gb": round(out_bytes / 1e9, 2),
                "ctrl_c_stop_s": round(stop["stop_seconds"], 2),
                "ctrl_c_exit": stop["exit_code"],
            }
        ]
        goals = [
            _results.make_goal(
                f"peak resident memory building {size / 1e9:.0f} GB of plain text, MB",
                GOAL_RSS_MB,
                run["peak_rss_mb"],
                higher_is_better=False,
                fmt="{:.0f}",
            ),
            _results.make_goal(
                "seconds from Ctrl+C to exit", 1.0, stop["stop_seconds"], higher_is_better=False
            ),
        ]
        _results.write("bench_build_memory", results, goals)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
