"""The transfer stage on a real CUDA device (skipped where there is none).

Every batch delivered with ``device=`` and with the GPU guide's ``non_blocking``
recipe is compared bit for bit with a CPU reference while the host is busy
(threads running NumPy and Python flat out, so reader threads and copies are
descheduled at random moments), and while the trainer's stream is kept busy
with kernels, so a copy that was not waited for, or a buffer reused before its
copy completed, would show as wrong bytes. Throughput and step-time figures are
in ``bench/bench_gpu.py``.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import tokload
from tokload import DataLoader, Documents, StreamWithMetadata, TokenStream, Writer

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("gpu") / "ds"
    rng = np.random.default_rng(0)
    with Writer(path, "<u4", shard_bytes=1 << 22) as w:
        for _ in range(3000):
            w.write(rng.integers(0, 1 << 31, int(rng.integers(50, 3000)), dtype=np.uint32))
    return path


@pytest.fixture
def host_load() -> Iterator[None]:
    stop = threading.Event()

    def numpy_work() -> None:
        a = np.random.default_rng(1).random((512, 512))
        while not stop.is_set():
            a = (a @ a.T) % 1.0

    def python_work() -> None:
        x = 0
        while not stop.is_set():
            for i in range(10_000):
                x ^= i

    threads = [threading.Thread(target=f, daemon=True) for f in (numpy_work, python_work)]
    for t in threads:
        t.start()
    yield
    stop.set()
    for t in threads:
        t.join()


def busy_stream() -> None:
    """Queue kernels on the current stream, so copies and uses overlap with them."""
    a = torch.randn(2048, 2048, device="cuda")
    for _ in range(4):
        a = a @ a
        a /= a.norm()


@pytest.mark.usefixtures("host_load")
@pytest.mark.parametrize("threads", [1, 3])
def test_device_batches_are_bitwise_right_under_load(threads: int, corpus: Path) -> None:
    view = TokenStream(corpus, window=4097, stride=4096)
    ld = DataLoader(
        view, 8, seed=3, num_threads=threads, device="cuda", read=tokload.ReadOptions(prefetch=16)
    )
    assert ld.pinned and ld.device == torch.device("cuda", torch.cuda.current_device())
    for step, batch in zip(range(300), ld, strict=False):
        assert batch["tokens"].device == ld.device and batch.ready is not None
        busy_stream()
        got = batch["tokens"].cpu().numpy()  # on the current stream: waits for the copy
        np.testing.assert_array_equal(got, view.read(batch["index"].cpu().numpy()), str(step))
    ld.close()


@pytest.mark.usefixtures("host_load")
def test_the_readme_non_blocking_recipe_is_bitwise_right(corpus: Path) -> None:
    view = TokenStream(corpus, window=4097, stride=4096)
    ld = DataLoader(
        view, 8, seed=4, num_threads=2, device=None, read=tokload.ReadOptions(prefetch=16)
    )
    assert ld.pinned
    kept = []
    for batch in zip(range(300), ld, strict=False):
        b = batch[1]
        assert b["tokens"].is_pinned() and b["index"].is_pinned()
        dev = b["tokens"].to("cuda", non_blocking=True)  # then the host batch is dropped
        kept.append((b["index"].clone(), dev))
        del b, batch
        busy_stream()
    torch.cuda.synchronize()
    for idx, dev in kept:
        np.testing.assert_array_equal(dev.cpu().numpy(), view.read(idx.numpy()))
    ld.close()


def test_each_rank_gets_its_own_device(corpus: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    last = torch.cuda.device_count() - 1
    monkeypatch.setenv("LOCAL_RANK", str(last))
    ld = DataLoader(TokenStream(corpus, window=65), 4, num_threads=2)
    assert ld.device == torch.device("cuda", last)
    b = next(iter(ld))
    assert b["tokens"].device == torch.device("cuda", last)
    ld.close()


def test_documents_and_other_streams(corpus: Path) -> None:
    docs = Documents(corpus)
    ld = DataLoader(docs, 4, batching=tokload.Pack(), num_threads=2, device="cuda")
    s = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    for batch in zip(range(50), ld, strict=False):
        b = batch[1]
        with torch.cuda.stream(s):  # another stream: wait on the batch's event first
            s.wait_event(b.ready)
            cu = b["cu_seqlens"].cpu().tolist()
            tokens = b["tokens"].cpu().numpy()
        for k, i in enumerate(b["index"].cpu().tolist()):
            np.testing.assert_array_equal(tokens[cu[k] : cu[k + 1]], docs[i])
    ld.close()


def test_token_stream_boundaries_on_the_device(corpus: Path) -> None:
    """The attention metadata arrives on the device with its batch (max_seqlen, an
    int, stays on the host), equal to the view's own."""
    view = TokenStream(corpus, window=257, stride=200, boundaries=True)
    ld = DataLoader(
        view, 8, seed=7, num_threads=2, device="cuda", read=tokload.ReadOptions(prefetch=16)
    )
    for step, batch in zip(range(50), ld, strict=False):
        busy_stream()
        want = view.boundaries(batch["index"].cpu().numpy())
        assert batch["max_seqlen"] == want.pop("max_seqlen")
        for key, value in want.items():
            assert batch[key].device == ld.device
            np.testing.assert_array_equal(batch[key].cpu().numpy(), value, f"{key} {step}")
    ld.close()


def filled_on_the_device(
    view: Any, fill: tokload.Fill, seed: int, steps: int = 100
) -> Iterator[dict[str, np.ndarray]]:
    """``steps`` batches of ``view`` filled by ``fill`` and delivered on the device
    (2 reader threads, kernels queued on the trainer's stream before each is read
    back), each checked equal, key by key, to the same run's batches built on the
    host; yields each as NumPy arrays (``max_seqlen``, an int, stays on the host)."""
    ld = DataLoader(
        view,
        8,
        batching=fill,
        seed=seed,
        num_threads=2,
        device="cuda",
        read=tokload.ReadOptions(prefetch=16),
    )
    host = DataLoader(view, 8, batching=fill, seed=seed, num_threads=1, device=None)
    try:
        for step, (batch, want) in zip(range(steps), zip(ld, host, strict=False), strict=False):
            busy_stream()
            assert batch["max_seqlen"] == want.pop("max_seqlen")
            assert sorted(batch) == sorted([*want, "max_seqlen"])
            got = {}
            for key, value in want.items():
                assert batch[key].device == ld.device, key
                got[key] = batch[key].cpu().numpy()
                np.testing.assert_array_equal(got[key], value.numpy(), f"{key} {step}")
            yield got
    finally:
        ld.close()
        host.close()


@pytest.mark.usefixtures("host_load")
def test_packed_rows_on_the_device(corpus: Path) -> None:
    """Fill: each row's documents, the padding and the attention metadata arrive
    on the device, equal to the same run's batches built on the host."""
    for _ in filled_on_the_device(Documents(corpus), tokload.Fill(4096, lookahead=64), seed=3):
        pass


@pytest.mark.usefixtures("host_load")
def test_stream_with_metadata_on_the_device(tmp_path: Path) -> None:
    rng = np.random.default_rng(5)
    with Writer(tmp_path / "m", "<u2", metadata=True, shard_bytes=1 << 16) as w:
        for k in range(400):
            n = int(rng.integers(20, 900))
            cuts = np.sort(rng.choice(np.arange(1, n), size=min(n - 1, 6), replace=False))
            spans = [
                (int(a), int(b), b"doc%d:%d" % (k, a))
                for a, b in zip(cuts[::2], cuts[1::2], strict=False)
            ]
            w.write(rng.integers(0, 65535, n, dtype=np.uint16), spans=spans)
    view = StreamWithMetadata(tmp_path / "m", window=257, stride=200)
    ld = DataLoader(
        view, 8, seed=6, num_threads=2, device="cuda", read=tokload.ReadOptions(prefetch=16)
    )
    for step, batch in zip(range(200), ld, strict=False):
        busy_stream()
        assert batch["metadata_positions"].device == ld.device
        ref = view.read(batch["index"].cpu().numpy())
        got = batch["tokens"].cpu().numpy()
        np.testing.assert_array_equal(got, ref.fields["tokens"], str(step))
        np.testing.assert_array_equal(batch["metadata_positions"].cpu().numpy(), ref.positions)
        assert batch["metadata"] == ref.metadata  # host records, deserialized on access
    ld.close()


def test_device_copies_cost_the_reader_little_python(corpus: Path) -> None:
    """Python calls per batch in a reader thread with the defaults (pinned, device copies).

    A rowwise view's task is copied once for all its steps, so the copies add a few
    calls per batch to the host path's count (``tests/test_gil_cost.py``); other
    views copy a task's batches in one backend call. Measured on an H100 with torch
    2.11: a token stream 10.4 on the host, 22.1 with device copies (109.5 when each
    batch was copied on its own); packed documents 71.4 and 85.1 (164.9)."""
    from test_gil_cost import calls_per_batch

    view = TokenStream(corpus, window=4097)
    host = calls_per_batch(view)
    pinned = calls_per_batch(view, pin_memory=True, device=None)
    dev = calls_per_batch(view, pin_memory="auto", device="auto")
    pack = tokload.Pack()
    docs = calls_per_batch(Documents(corpus), pin_memory="auto", device="auto", batching=pack)
    docs_host = calls_per_batch(Documents(corpus), batching=pack)
    print(f"\ncalls per batch: host {host}, pinned {pinned}, device {dev}")
    print(f"packed documents: host {docs_host}, device {docs}")
    assert dev <= host + 16, (host, pinned, dev)
    assert docs <= docs_host + 16, (docs_host, docs)


@pytest.mark.usefixtures("host_load")
def test_a_mixture_filled_on_the_device(tmp_path: Path) -> None:
    """The recipe on the device: a blend of a tokload build, a Megatron prefix and a
    flat ``.npy`` file, best-fit filled with every attention key. Every key, the
    provenance included, equals the same run's batches built on the host, and each
    document in a row is the one the provenance names."""
    from test_mixtures import write_megatron

    rng = np.random.default_rng(8)

    def docs(c: int, n: int) -> list[np.ndarray]:
        return [
            rng.integers(1, 60_000, int(rng.integers(20, 1500)), dtype=np.uint16) for _ in range(n)
        ]

    built, mega, flat = docs(0, 300), docs(1, 200), docs(2, 250)
    with Writer(tmp_path / "build", np.uint16, shard_bytes=1 << 18) as w:
        for d in built:
            w.write(d)
    write_megatron(tmp_path / "mega", mega)
    np.save(
        tmp_path / "flat.npy", np.concatenate([np.append(d, 0) for d in flat]).astype(np.uint16)
    )
    views = [
        Documents(tmp_path / "build"),
        Documents(str(tmp_path / "mega")),
        Documents(tokload.open_flat(tmp_path / "flat.npy", eos=0)),
    ]
    blend = tokload.Blend(list(zip(views, (0.5, 0.3, 0.2), strict=True)), seed=2, length=4000)
    for got in filled_on_the_device(blend, tokload.Fill(2048, lookahead=64), seed=5):
        tokens, segments = got["tokens"], got["segment_ids"]
        pairs = zip(got["component"].tolist(), got["component_index"].tolist(), strict=True)
        k = 0
        for row, count in enumerate(got["doc_counts"].tolist()):
            for seg in range(count):
                c, d = next(pairs)
                doc = np.asarray(views[c][d])
                np.testing.assert_array_equal(tokens[row][segments[row] == seg], doc, str(k))
                k += 1
