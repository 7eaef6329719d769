"""Measure one loader configuration in a fresh process (run in the peers venv).

    python bench/peers/child.py LOADER WORKERS CORPUS_DIR MODE [SECONDS] [options]

LOADER: tokload, tokload-flat (tokload over ``flat.bin``), tokload-megatron,
memmap, torchdata, megatron, mosaic, litdata.
WORKERS: worker processes for the peers (torch DataLoader / StreamingDataLoader),
threads for tokload and torchdata.nodes; -1 leaves tokload's default.
MODE: ``rate`` (time to first batch, tokens/s, peak RSS), ``slowdown`` (a
pure-Python loop on the main thread while another thread drains the loader),
``cold`` (seconds for ``--batches`` batches after the first; with
``--drop-caches`` the page cache is dropped once the libraries are imported,
before the loader is built) or ``stall`` (a simulated trainer: ``--warmup``
batches, then ``--batches`` batches each followed by ``--step`` seconds of
sleep; reports how long each ``next()`` blocked). ``--prefetch`` and ``--readahead on|off``
set tokload's.
Prints one JSON line.

Every loader delivers shuffled batches of 8 windows of 4097 tokens as torch
tensors, configured as its own docs recommend for LLM pretraining (docs/comparison.md).
"""

from __future__ import annotations

import time

T_START = time.perf_counter()

import json  # noqa: E402
import os  # noqa: E402
import resource  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

WINDOW, BATCH, SEED = 4097, 8, 1234


def peak_rss_mb() -> float:
    me = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    kids = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    return me + kids


INFO: dict[str, Any] = {}  # shuffle-index cost, where the loader has one to measure


def endless(make: Any) -> Iterator[Any]:
    """Batches across epochs: a new pass whenever one ends (a small corpus runs out)."""
    while True:
        yield from make()


def build(
    loader: str,
    workers: int,
    corpus: Path,
    prefetch: int | None = None,
    readahead: bool | None = None,
) -> tuple[Iterator[Any], float]:
    """(an iterator of [8, 4097] token batches, seconds spent importing)."""
    t0 = time.perf_counter()
    import numpy as np
    import torch

    if loader in ("tokload", "tokload-megatron", "tokload-flat", "tokload-meta"):
        import tokload

        t_imp = time.perf_counter() - t0
        t1 = time.perf_counter()
        view: Any
        if loader == "tokload-meta":  # a stream with metadata blocks (bench_stall's "meta")
            view = tokload.StreamWithMetadata(corpus / "meta", window=WINDOW, stride=WINDOW - 1)
        else:
            if loader == "tokload-flat":
                data: Any = tokload.open_flat([corpus / "flat.bin"], np.uint32)
            else:
                data = corpus / "tokload" if loader == "tokload" else corpus / "megatron"
            view = tokload.TokenStream(data, window=WINDOW, stride=WINDOW - 1)
        extra: dict[str, Any] = {} if prefetch is None else {"prefetch": prefetch}
        if readahead is not None:
            extra["readahead"] = readahead
        threads = None if workers < 0 else max(1, workers)
        tl = tokload.DataLoader(view, BATCH, seed=SEED, num_threads=threads, device=None, **extra)
        INFO.update(index_s=time.perf_counter() - t1, index_bytes=0)
        return (b["tokens"] for b in tl), t_imp

    if loader in ("memmap", "torchdata"):
        t_imp = time.perf_counter() - t0
        mm = np.memmap(corpus / "flat.bin", dtype=np.uint32, mode="r")
        n = (len(mm) - WINDOW) // (WINDOW - 1) + 1

        def get(i: int) -> torch.Tensor:
            s = int(i) * (WINDOW - 1)
            return torch.from_numpy(np.array(mm[s : s + WINDOW]))

        t1 = time.perf_counter()
        order = np.random.default_rng(SEED).permutation(n)
        INFO.update(index_s=time.perf_counter() - t1, index_bytes=order.nbytes)
        if loader == "memmap":

            class Windows(torch.utils.data.Dataset[torch.Tensor]):
                def __len__(self) -> int:
                    return n

                def __getitem__(self, i: int) -> torch.Tensor:
                    return get(i)

            dl = torch.utils.data.DataLoader(
                Windows(),
                batch_size=BATCH,
                sampler=order,
                num_workers=workers,
                persistent_workers=workers > 0,
            )
            return endless(lambda: dl), t_imp
        from torchdata.nodes import Batcher, Loader, ParallelMapper, Prefetcher, SamplerWrapper

        node = SamplerWrapper(order)
        node = ParallelMapper(node, map_fn=get, num_workers=max(1, workers), method="thread")
        node = Batcher(node, batch_size=BATCH)
        node = ParallelMapper(node, map_fn=torch.stack, num_workers=1, method="thread")
        node = Prefetcher(node, prefetch_factor=4)
        return endless(lambda: Loader(node)), t_imp

    if loader == "megatron":
        from types import SimpleNamespace

        from megatron.core.datasets.blended_megatron_dataset_builder import (
            BlendedMegatronDatasetBuilder,
        )
        from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

        t_imp = time.perf_counter() - t0
        tok = SimpleNamespace(vocab_size=128_000, eod=0, pad=1, unique_identifiers={})
        cfg = GPTDatasetConfig(
            random_seed=SEED,
            sequence_length=WINDOW - 1,
            blend=([str(corpus / "megatron")], None),
            split="100,0,0",
            path_to_cache=tempfile.mkdtemp(prefix="megatron-cache-"),
            tokenizer=tok,
            reset_position_ids=False,
            reset_attention_mask=False,
            eod_mask_loss=False,
            create_attention_mask=False,
            mmap_bin_files=True,
        )
        n = (os.path.getsize(corpus / "megatron.bin") // 4 - WINDOW) // (WINDOW - 1) + 1
        t1 = time.perf_counter()
        train, _, _ = BlendedMegatronDatasetBuilder(
            GPTDataset, [n, None, None], lambda: True, cfg
        ).build()
        assert cfg.path_to_cache is not None
        INFO.update(
            index_s=time.perf_counter() - t1,
            index_bytes=sum(
                f.stat().st_size for f in Path(cfg.path_to_cache).rglob("*") if f.is_file()
            ),
        )
        dl = torch.utils.data.DataLoader(
            train, batch_size=BATCH, num_workers=workers, persistent_workers=workers > 0
        )
        return (
            torch.cat([b["tokens"], b["labels"][:, -1:]], dim=1) for b in endless(lambda: dl)
        ), t_imp

    if loader == "mosaic":
        sys.path.insert(0, str(Path(__file__).parent))
        import torchvision_stub

        torchvision_stub.install()
        from streaming import StreamingDataset
        from streaming.base.util import clean_stale_shared_memory

        t_imp = time.perf_counter() - t0
        clean_stale_shared_memory()

        class Tokens(StreamingDataset):  # type: ignore[misc]
            def __getitem__(self, i: int) -> torch.Tensor:
                raw = super().__getitem__(i)["tokens"]
                return torch.from_numpy(np.frombuffer(raw, dtype=np.int32).copy())

        ds = Tokens(local=str(corpus / "mds"), shuffle=True, shuffle_seed=SEED, batch_size=BATCH)
        dl = torch.utils.data.DataLoader(
            ds, batch_size=BATCH, num_workers=workers, persistent_workers=workers > 0
        )
        return endless(lambda: dl), t_imp

    if loader == "litdata":
        from litdata import StreamingDataLoader, StreamingDataset, TokensLoader

        t_imp = time.perf_counter() - t0
        ds = StreamingDataset(
            input_dir=str(corpus / "litdata"),
            item_loader=TokensLoader(block_size=WINDOW),
            shuffle=True,
            drop_last=True,
            seed=SEED,
        )
        sdl = StreamingDataLoader(ds, batch_size=BATCH, num_workers=workers)
        return endless(lambda: sdl), t_imp

    raise SystemExit(f"unknown loader {loader}")


def python_loop(seconds: float) -> float:
    n, end = 0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        for i in range(1000):
            n += i & 7
    return n / seconds


def preimport(loader: str) -> None:
    """Import what the loader needs now, so a cache drop after it spares the libraries."""
    import numpy  # noqa: F401
    import torch  # noqa: F401

    if loader.startswith("tokload"):
        import tokload  # noqa: F401
    elif loader == "megatron":
        import megatron.core.datasets.gpt_dataset  # noqa: F401
    elif loader == "litdata":
        import litdata  # noqa: F401


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("loader")
    ap.add_argument("workers", type=int)
    ap.add_argument("corpus", type=Path)
    ap.add_argument("mode", choices=["rate", "slowdown", "cold", "stall"])
    ap.add_argument("seconds", type=float, nargs="?", default=8.0)
    ap.add_argument("--prefetch", type=int)
    ap.add_argument("--readahead", choices=["on", "off"])
    ap.add_argument("--drop-caches", action="store_true")
    ap.add_argument("--batches", type=int, default=500)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--step", type=float, default=0.0)
    args = ap.parse_args()
    loader, workers, corpus, mode, seconds = (
        args.loader,
        args.workers,
        args.corpus,
        args.mode,
        args.seconds,
    )
    os.environ.setdefault("TMPDIR", tempfile.mkdtemp(prefix="peer-tmp-"))
    t_before = time.perf_counter()
    if args.drop_caches:
        preimport(loader)
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("1\n")
    ra = None if args.readahead is None else args.readahead == "on"
    it, t_imp = build(loader, workers, corpus, args.prefetch, ra)
    first = next(it)
    ttfb = time.perf_counter() - T_START
    assert tuple(first.shape) == (BATCH, WINDOW), first.shape
    out: dict[str, Any] = {
        "loader": loader,
        "workers": workers,
        "ttfb_s": ttfb,
        "import_s": (t_before - T_START) + t_imp,
        **INFO,
    }
    if mode == "cold":
        t0 = time.perf_counter()
        for _ in range(args.batches):
            next(it)
        out["seconds"] = time.perf_counter() - t0
    elif mode == "stall":
        for _ in range(args.warmup):
            next(it)
            time.sleep(args.step)
        waits = []
        for _ in range(args.batches):
            t0 = time.perf_counter()
            next(it)
            waits.append(time.perf_counter() - t0)
            time.sleep(args.step)  # the training step
        out["waits_ms"] = [round(w * 1e3, 4) for w in waits]
    elif mode == "rate":
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            next(it)
            n += 1
        out["tokens_per_s"] = n * BATCH * WINDOW / (time.perf_counter() - t0)
        out["peak_rss_mb"] = peak_rss_mb()
    else:
        # Idle and busy loop measurements alternate (5 each) and medians are compared,
        # so the machine's own drift moves both alike.
        draining, stop = threading.Event(), threading.Event()
        got = [0]

        def drain() -> None:
            while not stop.is_set():
                if draining.wait(0.05):
                    next(it)
                    got[0] += 1

        t = threading.Thread(target=drain, daemon=True)
        t.start()
        idle, busy, rates = [], [], []
        for _ in range(5):
            idle.append(python_loop(seconds / 5))
            draining.set()
            time.sleep(0.2)
            g0, t0 = got[0], time.perf_counter()
            busy.append(python_loop(seconds / 5))
            rates.append((got[0] - g0) * BATCH * WINDOW / (time.perf_counter() - t0))
            draining.clear()
            time.sleep(0.1)
        stop.set()
        out["loop_kept"] = sorted(busy)[2] / sorted(idle)[2]
        out["tokens_per_s_while_busy"] = sorted(rates)[2]
    print(json.dumps(out), flush=True)
    os._exit(0)  # do not wait for peers' worker teardown


if __name__ == "__main__":
    main()
