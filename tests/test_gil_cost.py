"""How much Python a reader thread runs per batch: the GIL it takes from the trainer.

``sys.setprofile`` counts every Python-level call (functions, and builtins called
from Python) while a reader task is built, exactly as a reader thread builds it.
The counts are deterministic, so they are asserted (docs/guide/dataloader.md quotes them).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import FrameType
from typing import Any

import numpy as np
import pytest

import tokload
from tokload import DataLoader, Documents, StreamWithMetadata, TokenStream, Writer


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("gil")
    with Writer(root / "ds", "<u4", shard_bytes=1 << 20) as w:
        for k in range(2000):
            w.write(np.arange(k, k + 300 + k % 97, dtype=np.uint32))
    with Writer(
        root / "meta",
        [("token", "<u4"), ("metadata_id", "<u4")],
        metadata=True,
        shard_bytes=1 << 20,
    ) as w:
        for k in range(500):
            w.write({"token": np.arange(300)}, spans=[(0, 100, b"a%d" % k), (150, 300, b"b%d" % k)])
    return root


def calls_per_batch(
    view: Any, batch_size: int = 8, steps_per_task: int = 8, **loader: Any
) -> float:
    """Python-level calls per batch while a reader thread builds a task, steady state.

    Host batches in ordinary memory unless ``loader`` says otherwise, so the counts
    are the same on hosts with and without CUDA (``tests/test_gpu.py`` counts the
    device path with this function)."""
    loader = {"pin_memory": False, "device": None, **loader}
    ld = DataLoader(
        view,
        batch_size,
        num_threads=0,
        **loader,
        read=tokload.ReadOptions(steps_per_task=steps_per_task),
    )
    build = ld._task_builder(0)
    build(0)  # first tasks: permutation tables, dtype caches
    build(1)
    count = 0

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        nonlocal count
        if event in ("call", "c_call"):
            count += 1

    sys.setprofile(profile)
    try:
        out = build(2)
    finally:
        sys.setprofile(None)
    return (count - 1) / len(out)  # less the setprofile(None) call itself


def test_a_token_stream_batch_costs_a_handful_of_calls(data: Path) -> None:
    per = calls_per_batch(TokenStream(data / "ds", window=4097))
    assert per <= 13, per  # 12.6 measured: ~95 per task of 8 steps, 1 per step
    # the cost is per task, not per sample: 8x the samples, the same calls (on a view
    # large enough that no measured task crosses an epoch, which costs a second
    # permutation call) ...
    small = calls_per_batch(TokenStream(data / "ds", window=65), batch_size=8)
    assert calls_per_batch(TokenStream(data / "ds", window=65), batch_size=64) == small
    # ... and not per step
    assert calls_per_batch(TokenStream(data / "ds", window=65), steps_per_task=16) < small / 1.6


@pytest.mark.parametrize(
    "policy",
    [
        tokload.Pad(),
        tokload.Pack(),
        tokload.Pad(to=512),
        tokload.Fill(512),
    ],
    ids=["padded", "packed", "fixed-length", "filled"],
)
def test_document_batches_cost_does_not_grow_with_the_batch(policy: Any, data: Path) -> None:
    small = calls_per_batch(Documents(data / "ds"), batch_size=4, batching=policy)
    large = calls_per_batch(Documents(data / "ds"), batch_size=64, batching=policy)
    # 16x the samples; a step of 64 packed rows also crosses more of the packer's
    # groups of documents (a few calls each, per group, never per row: per row it
    # would be 60 more)
    assert abs(large - small) <= (10 if isinstance(policy, tokload.Fill) else 2)


@pytest.mark.parametrize("layout", ["blocks", "spans", "per_token"])
def test_metadata_batches_cost_does_not_grow_with_their_records(
    tmp_path: Path, layout: str
) -> None:
    per = []
    per_token = layout == "per_token"
    for every in (100, 10):  # 10x the records per batch
        dtype: Any = [("token", "<u2"), ("metadata_id", "<u4")] if per_token else "<u2"
        with Writer(
            tmp_path / f"m{every}",
            dtype,
            metadata=True,
            metadata_layout=layout,
            shard_bytes=1 << 16,
        ) as w:
            for _ in range(200):
                toks = np.arange(600) % 1000
                spans = [(a, a + every, b"r%d" % a) for a in range(0, 600, every)]
                w.write({"token": toks} if per_token else toks, spans=spans)
        per.append(calls_per_batch(StreamWithMetadata(tmp_path / f"m{every}", window=256)))
    # measured: 80.9 with metadata blocks (a task's batches in one call), 101 with a
    # span table (one compiled call per batch), 118 with per-token ids (the loader's
    # statistics included: a few calls per task and one or two per batch)
    assert per[0] <= {"blocks": 84, "spans": 104, "per_token": 128}[layout], per
    assert abs(per[1] - per[0]) <= 1, per


# Run under gdb: builds one task of each view (after two to warm up) between two
# calls of os.getppid(), the marks the breakpoints below count between.
_DROPS_SCRIPT = """
import gc, os, sys
import tokload
root = sys.argv[1]
views = {
    "stream": (tokload.TokenStream(root + "/ds", window=4097), tokload.Stack()),
    "boundaries": (
        tokload.TokenStream(root + "/ds", window=4097, boundaries=True), tokload.Stack()
    ),
    "fill": (tokload.Documents(root + "/ds"), tokload.Fill(4096)),
    "pack": (tokload.Documents(root + "/ds"), tokload.Pack()),
}
for name, (view, policy) in views.items():
    ld = tokload.DataLoader(
        view, 8, batching=policy, num_threads=0, pin_memory=False, device=None,
        read=tokload.ReadOptions(steps_per_task=16),
    )
    build = ld._task_builder(0)
    build(0), build(1)
    gc.collect()
    os.getppid()
    kept = build(2)  # kept: freeing the batches is the trainer's, not the reader's
    os.getppid()
    print("VIEW", name, flush=True)
    del kept
    ld.close()
os._exit(0)
"""

_DROPS_GDB = """
set pagination off
set breakpoint pending on
python
import gdb
state = {"on": False, "n": 0}
class Mark(gdb.Breakpoint):
    def stop(self):
        if state["on"]:
            gdb.write("DROPS %d\\n" % state["n"])
        state["on"], state["n"] = not state["on"], 0
        return False
class Drop(gdb.Breakpoint):
    def stop(self):
        state["n"] += state["on"]
        return False
Mark("getppid")
Drop("PyEval_SaveThread")
end
run
"""


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("gdb") is None, reason="counts with gdb breakpoints")
@pytest.mark.skipif(
    "libasan" in os.environ.get("LD_PRELOAD", ""), reason="gdb runs the build without ASan"
)
def test_a_reader_task_drops_the_gil_a_few_times(data: Path, tmp_path: Path) -> None:
    """How many times a reader thread drops the GIL while it builds a task of 16
    steps (gdb counts ``PyEval_SaveThread``). Each drop costs the reader up to a
    switch interval (5 ms) to take it back when the training thread runs Python
    flat out: a task that drops it 60 times can take 0.3 s instead of 2 ms.

    Measured (torch 2.13, NumPy 2.4): a token stream 7, with boundaries 15, Fill
    with every attention key 34 (16 of them pack the next group of 1,024 documents,
    which this task reaches), Pack 10. In 0.2.0: 7, 29, 85 and 14, when a task's
    batches were cut with ``Tensor.split`` and the padding, the read checks and the
    gathers of packed rows were NumPy calls on arrays of over 500 elements."""
    script = tmp_path / "drops.py"
    script.write_text(_DROPS_SCRIPT)
    commands = tmp_path / "drops.gdb"
    commands.write_text(_DROPS_GDB)
    cmd = [shutil.which("gdb") or "gdb", "-q", "-batch", "-nx", "-x", str(commands)]
    cmd += ["--args", sys.executable, str(script), str(data)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env).stdout
    drops = dict(
        (view, int(n)) for n, view in re.findall(r"DROPS (\d+)\s*\n(?:.*\n)*?VIEW (\w+)", out)
    )
    assert sorted(drops) == ["boundaries", "fill", "pack", "stream"], out[-3000:]
    limits = {"stream": 8, "boundaries": 18, "fill": 40, "pack": 12}
    assert all(drops[v] <= limits[v] for v in drops), drops
