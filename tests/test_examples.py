"""The examples/ folder runs as its README says.

- ``train_gpt.py`` trains a small GPT under torchrun on 2 processes (CPU, gloo) and the
  loss goes down; resumed from its step-20 checkpoint on 3 processes, it starts at the
  saved step and cursor, and its losses are those of the uninterrupted run (the global
  batch, and so each step's data and gradient, does not depend on the world size).
- ``slurm_build.sh``, run as 3 array tasks and a merge, gives the dataset one
  ``tokload build`` gives.
- ``ray_build.py`` gives it too (skipped without ray).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path
from typing import Any

import pytest
from test_build import dataset_files, write_corpus

import tokload

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
BIN = Path(sys.executable).parent  # tokload and torchrun of this environment


def env(**extra: str) -> dict[str, str]:
    # Not a cluster's: no Slurm task of the caller's, no Ray cluster to join.
    e = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RAY_ADDRESS"))}
    # CPU processes (a GPU host would give every local rank a device of its own).
    e.update(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", PATH=f"{BIN}{os.pathsep}{e['PATH']}")
    e.update(extra)
    return e


def run(cmd: list[str], timeout: float = 120, **kw: Any) -> str:
    """Run cmd; its stdout. A failure shows the end of its output."""
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)
    assert p.returncode == 0, (cmd, p.stdout[-3000:], p.stderr[-3000:])
    out: str = p.stdout
    return out


def stdlib_jsonl(path: Path, files: int = 30) -> Path:
    """A JSONL corpus of Python's standard library sources (about 1 MB)."""
    sources = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:files]
    with open(path, "w") as f:
        for src in sources:
            f.write(json.dumps({"text": src.read_text(encoding="utf-8")}) + "\n")
    return path


def torchrun(nproc: int, *args: str | Path) -> str:
    """``torchrun --standalone --nproc_per_node=NPROC examples/train_gpt.py ARGS``"""
    cmd = [str(BIN / "torchrun"), "--standalone", f"--nproc_per_node={nproc}"]
    return run([*cmd, str(EXAMPLES / "train_gpt.py"), *map(str, args)], env=env(), timeout=180)


def log(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.slow
def test_train_gpt_learns_and_resumes_on_another_world_size(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus"
    docs = stdlib_jsonl(tmp_path / "docs.jsonl")
    run(["tokload", "build", str(docs), "-o", str(corpus), "--tokenizer", "bytes"], env=env())
    schedule = ["--steps", "30", "--global-batch", "12", "--save-every", "20"]
    common = ["--data", str(corpus), *schedule]

    # 30 steps on 2 processes, checkpoints at steps 20 and 30.
    torchrun(2, *common, "--ckpt", tmp_path / "a", "--log-file", tmp_path / "a.jsonl")
    a = log(tmp_path / "a.jsonl")
    assert [r["step"] for r in a] == list(range(1, 31))
    assert {r["world_size"] for r in a} == {2}
    assert [r["cursor"] for r in a] == [12 * s for s in range(1, 31)]  # the global batch
    first = sum(r["loss"] for r in a[:5]) / 5
    last = sum(r["loss"] for r in a[-5:]) / 5
    assert first > 4.5  # about ln(258) = 5.55 at the start: bytes are guesses
    assert last < first - 1.0, (first, last)

    # Resume the step-20 checkpoint on 3 processes.
    shutil.copytree(tmp_path / "a" / "step-00000020", tmp_path / "b" / "step-00000020")
    out = torchrun(3, *common, "--ckpt", tmp_path / "b", "--log-file", tmp_path / "b.jsonl")
    assert "step 20, cursor 240" in out, out
    b = log(tmp_path / "b.jsonl")
    assert [r["step"] for r in b] == list(range(21, 31))
    assert {r["world_size"] for r in b} == {3}
    assert [r["cursor"] for r in b] == [r["cursor"] for r in a[20:]]
    # The curve goes on where it was: the very losses of the uninterrupted run, up to
    # floating-point summation order (DDP's averaging over 2 or 3 ranks).
    assert [r["loss"] for r in b] == pytest.approx([r["loss"] for r in a[20:]], rel=1e-4)
    assert sorted(p.name for p in (tmp_path / "b").iterdir()) == [
        "step-00000020",
        "step-00000030",
    ]


def test_slurm_recipe_builds_the_same_dataset_as_one_build(tmp_path: Path) -> None:
    inputs = tmp_path / "in"
    write_corpus(inputs, files=3, docs=60)
    common = {"INPUTS": str(inputs), "OUT": str(tmp_path / "corpus"), "PARTS": "3"}
    common["BUILD_ARGS"] = "--keep-field id --chunk-size 2000"
    script = str(EXAMPLES / "slurm_build.sh")
    for k in range(3):  # the array's tasks, as Slurm would set them
        run(["bash", script], env=env(SLURM_ARRAY_TASK_ID=str(k), **common))
    run(["bash", script], env=env(MERGE="1", **common))

    direct = tmp_path / "direct"
    s = tokload.build([inputs], direct, keep_fields=["id"], chunk_bytes=2000, progress=False)
    assert s.chunks >= 6  # so that every part has chunks of its own
    merged = tokload.open_dataset(tmp_path / "corpus")
    assert merged.fingerprint == tokload.open_dataset(direct).fingerprint
    run(["tokload", "verify", "--deep", str(tmp_path / "corpus")], env=env())
    # every chunk is the same bytes as the direct build's
    built: dict[str, bytes] = {}
    for k in range(3):
        built |= dataset_files(tmp_path / "corpus-parts" / str(k) / "parts")
    assert built == dataset_files(direct / "parts")


@pytest.mark.slow
def test_ray_recipe_builds_the_same_dataset_as_one_build(tmp_path: Path) -> None:
    pytest.importorskip("ray")
    inputs = write_corpus(tmp_path / "in", files=3, docs=60)
    out = tmp_path / "corpus"
    # A new session: Ray's daemons and signal handling stay away from pytest's.
    cmd = [sys.executable, str(EXAMPLES / "ray_build.py"), *map(str, inputs), "-o", str(out)]
    run([*cmd, "--chunk-size", "2000"], env=env(), timeout=300, start_new_session=True)
    direct = tmp_path / "direct"
    tokload.build(inputs, direct, chunk_bytes=2000, progress=False)
    assert dataset_files(out) == dataset_files(direct)
