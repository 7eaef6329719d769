"""A real distributed run: 4 processes, then resumed on 3 with another batch size."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import tokload

JOB = Path(__file__).with_name("torchrun_job.py")


def launch(nproc: int, out: Path, **args: object) -> None:
    out.mkdir(parents=True)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        str(JOB),
        "--out",
        str(out),
    ]
    for k, v in args.items():
        if v is not None:
            cmd += [f"--{k.replace('_', '-')}", str(v)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]


@pytest.mark.slow
def test_torchrun_resume_on_fewer_ranks(tmp_path: Path) -> None:
    data = tmp_path / "ds"
    with tokload.Writer(data, "<u4", shard_bytes=2000) as w:
        for k in range(60):
            w.write(np.arange(k * 100, k * 100 + 7 + k % 31, dtype=np.uint32))
    n = len(tokload.TokenStream(data, window=17, stride=13))
    epochs = 2
    state = tmp_path / "state.json"
    launch(
        4, tmp_path / "a", data=data, batch=5, steps=(n // 20) + 3, epochs=epochs, state_out=state
    )
    launch(
        3,
        tmp_path / "b",
        data=data,
        batch=7,
        steps=-1,
        epochs=epochs,
        state_in=state,
        state_out=tmp_path / "final.json",
    )
    parts = {
        f"{seg}{r}": np.load(tmp_path / seg / f"rank{r}.npy")
        for seg, ranks in (("a", 4), ("b", 3))
        for r in range(ranks)
    }
    # No rank read another rank's samples: the ranks' positions are disjoint.
    for seg, ranks in (("a", 4), ("b", 3)):
        sets = [set(parts[f"{seg}{r}"][:, 0].tolist()) for r in range(ranks)]
        assert sum(len(s) for s in sets) == len(set().union(*sets))
    allp = np.concatenate(list(parts.values()))
    allp = allp[np.argsort(allp[:, 0])]
    np.testing.assert_array_equal(allp[:, 0], np.arange(epochs * n))  # each position once
    for e in range(epochs):
        np.testing.assert_array_equal(np.sort(allp[e * n : (e + 1) * n, 1]), np.arange(n))
