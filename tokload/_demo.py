"""``tokload demo``: the whole pipeline on a corpus every machine has.

1. Turn the top-level modules of Python's own standard library into a JSONL
   corpus: one document per file, its path kept as document metadata, and
   every ``def name`` annotated as a span (``{"kind": "function", ...}``).
2. ``tokload build`` it (byte tokenizer, 2 worker processes) into a stream
   with metadata, and ``verify --deep`` it (checksums and structure).
3. Stream shuffled batches through the DataLoader on 2 simulated ranks for
   two epochs (the reference run). Then replay: 2 ranks stop mid-epoch, the
   cursor is saved, and 3 ranks with another batch size resume from it.
4. Check that every position of both epochs was delivered exactly once, each
   epoch a permutation of the dataset, every sample bitwise equal to the
   reference run's, and every annotation attached to the right tokens; then
   print the throughput.
"""

from __future__ import annotations

import json
import re
import shutil
import sysconfig
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

WINDOW, STRIDE = 2049, 2048
_DEF = re.compile(r"^[ \t]*def (\w+)", re.M)


def _say(msg: str) -> None:
    print(msg, flush=True)


def _corpus(out: Path) -> tuple[Path, int]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(stdlib.glob("*.py"))
    out.mkdir(parents=True, exist_ok=True)
    halves = [out / "stdlib-0.jsonl", out / "stdlib-1.jsonl"]
    n_ann = 0
    with open(halves[0], "w") as f0, open(halves[1], "w") as f1:
        for k, path in enumerate(files):
            try:
                text = path.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError):
                continue
            anns = [
                {"start": m.start(1), "end": m.end(1), "kind": "function", "name": m.group(1)}
                for m in _DEF.finditer(text)
            ]
            n_ann += len(anns)
            rec = {"text": text, "path": path.name, "annotations": anns}
            (f0 if k % 2 == 0 else f1).write(json.dumps(rec) + "\n")
    return out, n_ann


def _canonical(tokens: np.ndarray, positions: np.ndarray, metadata: list[Any]) -> bytes:
    """A window's tokens and per-token records, independent of the rest of its batch.

    Positions index the batch's record list, which depends on the other
    windows of the batch; relabel them by first appearance in this window and
    attach the records themselves.
    """
    valid = positions >= 0
    uniq, first = np.unique(positions[valid], return_index=True)
    order = uniq[np.argsort(first)]
    relabel = np.full(max(len(metadata), 1), -1, dtype=np.int32)
    relabel[order] = np.arange(len(order), dtype=np.int32)
    local = np.where(valid, relabel[np.maximum(positions, 0)], -1)
    records = json.dumps([metadata[j] for j in order.tolist()], sort_keys=True)
    return tokens.tobytes() + local.tobytes() + records.encode()


def _run_ranks(
    view: Any, seed: int, world: int, batch: int, state: dict[str, Any] | None, steps: int | None
) -> tuple[dict[int, tuple[int, bytes]], dict[str, Any], int]:
    """Run `world` ranks for `steps` steps (None: to the end); position -> (index, bytes)."""
    from tokload import DataLoader

    loaders = [
        DataLoader(view, batch, seed=seed, rank=r, world_size=world, epochs=2, device=None)
        for r in range(world)
    ]
    if state is not None:
        for ld in loaders:
            ld.load_state_dict(state)
    got: dict[int, tuple[int, bytes]] = {}
    tokens = 0
    its = [iter(ld) for ld in loaders]
    step = 0
    while steps is None or step < steps:
        batches = [next(it, None) for it in its]
        if batches[0] is None:
            break
        for b in batches:
            if b is None:
                continue
            toks = b["token"].numpy()
            tokens += toks.size
            mpos = b["metadata_positions"].numpy()
            for k, (p, i) in enumerate(
                zip(b["position"].tolist(), b["index"].tolist(), strict=True)
            ):
                got[p] = (i, _canonical(toks[k], mpos[k], b["metadata"]))
        step += 1
    states = [ld.state_dict() for ld in loaders]
    for ld in loaders:
        ld.close()
    assert all(s == states[0] for s in states)
    return got, states[0], tokens


def run(seed: int = 7, workdir: str | None = None) -> int:
    """Run the demo; returns a process exit code (0 when every check passed)."""
    import tokload
    from tokload.builder import build
    from tokload.tools import verify

    t_start = time.perf_counter()
    tmp = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="tokload-demo-"))
    tmp.mkdir(parents=True, exist_ok=True)
    try:
        corpus, n_ann = _corpus(tmp / "corpus")
        _say(
            f"tokload demo: corpus = the standard library's top-level modules "
            f"({sum(f.stat().st_size for f in corpus.glob('*.jsonl')) / 1e6:.1f} MB of JSONL, "
            f"{n_ann} 'def' annotations)"
        )
        summary = build(
            sorted(corpus.glob("*.jsonl")),
            tmp / "dataset",
            keep_fields=["path"],
            annotations_field="annotations",
            workers=2,
            shard_bytes=8 << 20,
            progress=False,
        )
        _say(f"  build: {summary}")
        problems = verify(tmp / "dataset", deep=True)
        if problems:
            _say(f"  FAIL: verify: {problems[0]}")
            return 1
        _say("  verify --deep: every file's checksum, every index checks out")

        view = tokload.StreamWithMetadata(
            tmp / "dataset", window=WINDOW, stride=STRIDE, deserialize=json.loads
        )
        n = len(view)
        ref, _, _ = _run_ranks(view, seed, world=2, batch=8, state=None, steps=None)
        _say(
            f"  reference run: 2 ranks x 8 windows of {WINDOW} tokens with their metadata, "
            f"2 epochs of {n} windows ({len(ref)} samples)"
        )

        stop_at = (n // 16) // 2 + 5  # mid-epoch 0
        first, state, _ = _run_ranks(view, seed, world=2, batch=8, state=None, steps=stop_at)
        _say(
            f"  interrupted: 2 ranks stop after {stop_at} steps; saved state = "
            f"{ {k: state[k] for k in ('cursor', 'n', 'seed')} }"
        )
        rest, final, _ = _run_ranks(view, seed, world=3, batch=5, state=state, steps=None)
        _say(f"  resumed: 3 ranks x 5 windows from cursor {state['cursor']} to {final['cursor']}")

        overlap = set(first) & set(rest)
        got = {**first, **rest}
        if overlap or sorted(got) != list(range(2 * n)):
            _say(
                f"  FAIL: positions delivered twice ({len(overlap)}) or missing "
                f"({2 * n - len(got)})"
            )
            return 1
        for e in range(2):
            idx = sorted(got[p][0] for p in range(e * n, (e + 1) * n))
            if idx != list(range(n)):
                _say(f"  FAIL: epoch {e} is not a permutation of the dataset")
                return 1
        if any(got[p] != ref[p] for p in range(2 * n)):
            _say("  FAIL: a resumed sample differs from the reference run")
            return 1
        _say(
            f"  checked: all {2 * n} positions exactly once, each epoch a permutation of the "
            f"{n} windows, every sample (tokens and metadata) bitwise equal to the reference run"
        )

        # Annotations land on their tokens: decode a window that has some.
        for i in range(n):
            s = view[i]
            names = [m for m in s.metadata if m.get("annotations")]
            if names:
                rec = names[0]
                p = s.metadata.index(rec)
                span = bytes(s.fields["token"][s.positions == p].astype(np.uint8).tolist())
                name = rec["annotations"][0]["name"]
                if span.decode() != name:
                    _say(f"  FAIL: annotation {name!r} covers {span!r}")
                    return 1
                _say(
                    f"  window {i}: tokens annotated {rec['annotations'][0]} decode to "
                    f"{span.decode()!r} in {rec['document']['path']}"
                )
                break
        bench = tokload.tools.bench(tmp / "dataset", seconds=1.0, window=WINDOW)
        _say(
            f"  DataLoader on the token stream: first batch in "
            f"{bench['time_to_first_batch_s'] * 1e3:.0f} ms, {bench['tokens_per_s'] / 1e6:.0f} M "
            f"tokens/s"
        )
        _say(f"demo passed in {time.perf_counter() - t_start:.1f} s")
        return 0
    finally:
        if not workdir:
            shutil.rmtree(tmp, ignore_errors=True)
