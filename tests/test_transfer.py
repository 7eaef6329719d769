"""The transfer stage: buffer lifetime and device copies, on a fake asynchronous device.

A GPU-less machine still runs the device path's logic here: ``FakeDevice``
completes copies after random delays on other threads and records any copy
from memory its allocator cannot see, and any host buffer written while a copy
from it is pending. The real CUDA tests are in ``test_gpu.py``.
"""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from fake_device import FakeDevice

import tokload
from tokload import DataLoader, Documents, StreamWithMetadata, TokenStream, Writer
from tokload.transfer import Batch, HostBackend, Transfer, make_backend


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("transfer") / "ds"
    with Writer(path, "<u4", shard_bytes=4000) as w:
        for k in range(200):
            w.write(np.arange(k * 1000, k * 1000 + 7 + k % 31, dtype=np.uint32))
    return path


@pytest.fixture(scope="module")
def meta_corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("transfer") / "meta"
    with Writer(
        path, [("token", "<u4"), ("metadata_id", "<u4")], metadata=True, shard_bytes=2000
    ) as w:
        for k in range(40):
            w.write({"token": np.arange(k * 100, k * 100 + 20)}, spans=[(2, 9, b"m%d" % k)])
    return path


@pytest.fixture(scope="module")
def blocks_corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Plain tokens with metadata blocks: the loader reads a task's batches in one
    call (``read_batches``), as slices of shared arrays."""
    path = tmp_path_factory.mktemp("transfer") / "blocks"
    with Writer(path, "<u4", metadata=True, shard_bytes=2000, span_block=16) as w:
        for k in range(40):
            w.write(np.arange(k * 100, k * 100 + 20), spans=[(2, 9, b"b%d" % k)])
    return path


# ---- the fake device itself can fail ----------------------------------------------------------


def test_a_missing_key_names_the_keys_a_batch_has() -> None:
    """review31: a bare KeyError: 'tokens' for a batch of a structured dtype, whose
    tokens are the field 'token'."""
    batch = Batch({"token": torch.zeros(2), "index": torch.zeros(2)})
    with pytest.raises(KeyError) as e:
        batch["tokens"]
    assert e.value.args[0] == (
        "'tokens': this batch has the keys 'token', 'index' (a dataset of a structured dtype, "
        "as a build with --keep-field or --annotations writes, has a key per field: its "
        "tokens are 'token')"
    )
    with pytest.raises(KeyError, match=r"'lengths': this batch has the keys 'token', 'index'\"$"):
        batch["lengths"]
    assert batch.get("tokens") is None and "tokens" not in batch


def test_the_fake_device_sees_a_buffer_written_during_a_copy() -> None:
    fd = FakeDevice(min_delay=0.05, max_delay=0.05)
    host = fd.host_empty((1000,), torch.int32)
    host.fill_(3)
    _dev, event = fd.to_device(host)
    host.fill_(4)  # too early: the copy has not run yet
    event.synchronize()
    assert any("written while a copy" in v for v in fd.violations), fd.violations
    fd.close()


def test_the_fake_device_sees_a_copy_from_untracked_memory() -> None:
    fd = FakeDevice()
    _dev, event = fd.to_device(torch.from_numpy(np.zeros(10, dtype=np.int64)))
    event.synchronize()
    assert fd.violations == [
        "copy from host memory the allocator does not track (torch.Size([10]), torch.int64)"
    ]
    fd.close()


def test_the_fake_device_reuses_a_block_only_after_its_copies() -> None:
    fd = FakeDevice(min_delay=0.2, max_delay=0.2)
    t = fd.host_empty((256,), torch.int64)
    ptr = t.data_ptr()
    _, event = fd.to_device(t)
    del t  # no cycles: the lease is released at once
    pending = fd.host_empty((256,), torch.int64)  # the first block is free but copying
    assert pending.data_ptr() != ptr
    event.synchronize()
    del pending
    again = fd.host_empty((256,), torch.int64)
    assert fd.reuses == 1 and again.data_ptr() in {ptr, again.data_ptr()}
    assert fd.violations == []
    fd.close()


# ---- the loader on the fake device ------------------------------------------------------------


def _views(corpus: Path, meta_corpus: Path, blocks_corpus: Path) -> dict[str, Any]:
    """Each kind of batch: ``(view, batching policy)``."""
    return {
        "stream": (TokenStream(corpus, window=9, stride=5), None),
        "boundaries": (TokenStream(corpus, window=9, stride=5, boundaries=True), None),
        "padded": (Documents(corpus), tokload.Pad(to=16, value=9)),
        "packed": (Documents(corpus), tokload.Pack()),
        "filled": (Documents(corpus), tokload.Fill(24, lookahead=30)),
        "metadata": (StreamWithMetadata(meta_corpus, window=8, stride=3), None),
        "metadata-blocks": (StreamWithMetadata(blocks_corpus, window=8, stride=3), None),
    }


def _reference(view: Any, policy: Any, batch: Batch) -> None:
    """Compare a delivered batch with direct reads of its indices."""
    idx = batch["index"].numpy()
    if isinstance(view, StreamWithMetadata):
        ref = view.read(idx)
        for name, values in ref.fields.items():
            np.testing.assert_array_equal(batch[name].numpy(), values)
        np.testing.assert_array_equal(batch["metadata_positions"].numpy(), ref.positions)
        assert batch["metadata"] == ref.metadata
    elif isinstance(policy, tokload.Fill):  # each row: its documents back to back, then 0
        tokens, lengths = batch["tokens"].numpy(), batch["lengths"].numpy()
        k = 0
        for row, count in enumerate(batch["doc_counts"].tolist()):
            at = 0
            for d in range(k, k + count):
                n = int(lengths[d])
                np.testing.assert_array_equal(tokens[row, at : at + n], view[int(idx[d])][:n])
                at += n
            assert (tokens[row, at:] == 0).all()
            k += count
        assert k == len(idx)
        cu = batch["cu_seqlens"].numpy()
        assert cu[0] == 0 and cu[-1] == tokens.size and batch["max_seqlen"] == np.diff(cu).max()
    elif isinstance(policy, tokload.Pack):
        got = view.read(idx)
        np.testing.assert_array_equal(batch["tokens"].numpy(), got.values)
        np.testing.assert_array_equal(batch["cu_seqlens"].numpy(), got.offsets)
        np.testing.assert_array_equal(batch["lengths"].numpy(), got.lengths)
    elif isinstance(policy, tokload.Pad):
        values, lengths = view.read_padded(idx, policy.to, policy.value)
        np.testing.assert_array_equal(batch["tokens"].numpy(), values)
        np.testing.assert_array_equal(batch["lengths"].numpy(), lengths)
    else:
        np.testing.assert_array_equal(batch["tokens"].numpy(), view.read(idx))
        if getattr(view, "with_boundaries", False):  # the batch's extras, on the device
            want = view.boundaries(idx)
            assert batch["max_seqlen"] == want.pop("max_seqlen")  # an int: not copied
            for k, v in want.items():
                np.testing.assert_array_equal(batch[k].numpy(), v)


@pytest.mark.parametrize(
    "kind", ["stream", "boundaries", "padded", "packed", "filled", "metadata", "metadata-blocks"]
)
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_device_copies_under_randomized_timing(
    kind: str, seed: int, corpus: Path, meta_corpus: Path, blocks_corpus: Path
) -> None:
    rng = random.Random(seed)
    view, policy = _views(corpus, meta_corpus, blocks_corpus)[kind]
    fd = FakeDevice(seed=seed, max_delay=0.003)
    ld = DataLoader(
        view,
        rng.choice([3, 4, 7]),
        batching=policy,
        seed=seed,
        num_threads=rng.choice([0, 1, 2, 3]),
        device=fd,
        read=tokload.ReadOptions(
            prefetch=rng.choice([1, 4, 12]), steps_per_task=(spt := rng.choice([1, 3, 8]))
        ),
    )
    assert ld.pinned and ld.device == "fake"
    held: list[Batch] = []
    for step, batch in zip(range(60), ld, strict=False):
        assert batch.ready is not None and batch.ready.query()  # next() waited for it
        _reference(view, policy, batch)
        if rng.random() < 0.3:
            held.append(batch)  # the trainer keeps some batches for a while
        if len(held) > 5:
            held.pop(rng.randrange(len(held)))
        if step % 7 == 0:
            time.sleep(rng.uniform(0, 0.004))  # a slow trainer step: copies overtake it
    ld.close()
    fd.close()
    assert fd.violations == []
    # a task read in one call is copied once for all its steps; others once per batch
    one_call = policy is not None or getattr(view, "rowwise", False)
    assert fd.copies_issued >= 60 // (spt if one_call else 1)
    assert fd.reuses > 0  # blocks went round the pool: the test exercised reuse


def test_build_steps_delivers_its_batches_as_next_does(corpus: Path) -> None:
    """``DataLoader.build_steps`` (public) returned device batches whose copies the
    caller's stream never waited for, nor kept their memory from the next copy
    (review40): they are delivered as ``next()`` delivers a batch."""
    fd = FakeDevice(min_delay=0.05, max_delay=0.05)
    ld = DataLoader(TokenStream(corpus, window=9), 4, device=fd, num_threads=0)
    got = ld.build_steps(ld.schedule.spans(0, 3))
    assert len(got) == 3 and all(b.ready is not None and b.ready.query() for b in got)
    ld.close()
    fd.close()
    assert fd.violations == []


@pytest.mark.parametrize("threads", [0, 2])
def test_the_readme_non_blocking_recipe(threads: int, corpus: Path) -> None:
    """Host batches copied by the trainer itself, then dropped at once."""
    view = TokenStream(corpus, window=9, stride=5)
    fd = FakeDevice(seed=threads, max_delay=0.01, copies=False)
    ld = DataLoader(
        view, 4, seed=6, num_threads=threads, device=fd, read=tokload.ReadOptions(prefetch=8)
    )
    assert ld.device is None
    copies = []
    for batch in zip(range(80), ld, strict=False):
        b = batch[1]
        assert b.ready is None
        dev, event = fd.to_device(b["tokens"])  # tokens.to("cuda", non_blocking=True)
        copies.append((b["index"].clone(), dev, event))
        del b, batch  # the trainer drops the host batch while the copy runs
    ld.close()
    for idx, dev, event in copies:
        event.synchronize()
        np.testing.assert_array_equal(dev.numpy(), view.read(idx.numpy()))
    fd.close()
    assert fd.violations == []
    assert fd.reuses > 0


def test_slices_made_by_from_numpy_would_be_caught() -> None:
    """The defect this stage removes, and why its own slices are safe.

    The old loader read a task into one pinned buffer and gave each batch
    ``torch.from_numpy`` of a slice: a storage of its own, inside the buffer,
    that the allocator cannot connect to the buffer (so a copy from it was not
    tracked). ``Transfer.tensor`` gives views of the allocation's own storage.
    """
    fd = FakeDevice(seed=4)
    tr = Transfer(fd)
    task = tr.alloc((8, 9), np.uint32)
    task[...] = np.arange(72).reshape(8, 9)
    for k in range(0, 8, 2):
        ev = fd.copy(Batch(tokens=torch.from_numpy(task[k : k + 2]))).ready
        ev.synchronize()
    assert len(fd.violations) == 3  # all but the slice at offset 0
    fd.violations.clear()
    for k in range(0, 8, 2):
        out = fd.copy(Batch(tokens=tr.tensor(task[k : k + 2])))
        out.ready.synchronize()
        np.testing.assert_array_equal(out["tokens"].numpy(), task[k : k + 2])
    assert fd.violations == []
    fd.close()


# ---- tensors share the allocation -----------------------------------------------------------


def test_tensors_are_views_of_the_allocation_not_copies() -> None:
    tr = Transfer(HostBackend())
    a = tr.alloc((4, 6), np.uint16)
    a[...] = np.arange(24).reshape(4, 6)
    for part in (a, a[1:3], a.reshape(-1)[5:17], a[3:3]):
        t = tr.tensor(part)
        assert t.data_ptr() == part.__array_interface__["data"][0] or part.size == 0
        assert t.untyped_storage().data_ptr() == a.__array_interface__["data"][0]
        np.testing.assert_array_equal(t.numpy(), part)
    column = tr.tensor(a[:, 2])  # strided: copied into an allocation of its own
    assert column.untyped_storage().data_ptr() != a.__array_interface__["data"][0]
    np.testing.assert_array_equal(column.numpy(), a[:, 2])
    empty = np.empty(0, dtype=np.uint8)[:0]  # not from alloc, no bytes
    assert tr.tensor(empty).shape == (0,)
    foreign = np.arange(5, dtype=np.int64)
    t = tr.tensor(foreign)  # not from alloc: copied into a buffer the backend tracks
    assert t.data_ptr() != foreign.__array_interface__["data"][0]
    np.testing.assert_array_equal(t.numpy(), foreign)
    # a view's own data held in a torch tensor was handed out as the batch's memory, so
    # a trainer's in-place edit of the batch changed the data (review41): copied
    corpus = torch.arange(20, dtype=torch.int64)
    for part in (corpus.numpy(), corpus.numpy()[4:12], corpus.numpy().reshape(4, 5)[1:3]):
        t = tr.tensor(part)
        t.fill_(-100)
        assert corpus.tolist() == list(range(20))


def test_device_arguments_without_a_gpu() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert make_backend("auto", "auto").device is None
    assert make_backend(False, "cpu").device is None
    with pytest.raises(RuntimeError, match=r"device='cuda:1' needs CUDA"):
        make_backend("auto", "cuda:1")
    with pytest.raises(ValueError, match="only CUDA devices"):
        make_backend("auto", "meta")
    with pytest.raises(ValueError, match="device must be a torch device"):
        make_backend("auto", "gpu-please")


def test_collate_and_an_explicit_device_conflict(corpus: Path) -> None:
    with pytest.raises(ValueError, match="give either collate or device='cuda'"):
        DataLoader(TokenStream(corpus, window=9), 2, collate=dict, device="cuda")
    # "cpu" copies nothing, as None: collate goes with it (it was refused; "cpu:0" and
    # torch.device("cpu", 0) were still refused, review40)
    for host in ("cpu", torch.device("cpu"), "cpu:0", torch.device("cpu", 0)):
        ld = DataLoader(TokenStream(corpus, window=9), 2, collate=dict, device=host, epochs=1)
        batch = next(iter(ld))
        assert isinstance(batch, dict) and isinstance(batch["tokens"], np.ndarray)
        ld.close()


def test_a_backend_is_given_as_the_device(corpus: Path) -> None:
    view = TokenStream(corpus, window=9)
    fd = FakeDevice(seed=1)
    ld = DataLoader(view, 2, device=fd, num_threads=0)
    assert ld.transfer.backend is fd and ld.device == "fake"
    batch = next(iter(ld))
    np.testing.assert_array_equal(
        batch["tokens"].numpy(), view.read_batch(batch["index"].numpy(), np.empty)["tokens"]
    )
    ld.close()
    with pytest.raises(
        ValueError,
        match=r"is a TransferBackend, which decides pinning itself; "
        r"leave pin_memory at 'auto', not False",
    ):
        DataLoader(view, 2, device=fd, pin_memory=False)
    with pytest.raises(ValueError, match=r"give either collate or a backend that copies \(device="):
        DataLoader(view, 2, device=fd, collate=dict)
    host = FakeDevice(seed=1, copies=False)  # host batches: collate may replace the tensors
    assert DataLoader(view, 2, device=host, collate=dict, num_threads=0).transfer.backend is host
    fd.close()
    host.close()


def test_the_retired_transfer_keyword_says_to_write_device(corpus: Path) -> None:
    view = TokenStream(corpus, window=9)
    fd = FakeDevice(seed=1)
    with pytest.warns(
        DeprecationWarning,
        match=r"is retired \(tokload after 0\.2\.0\): write DataLoader\(\.\.\., device=backend\)",
    ):
        ld = DataLoader(view, 2, transfer=fd)
    assert ld.transfer.backend is fd
    ld.close()
    with pytest.raises(
        TypeError, match="give the TransferBackend as device=, not transfer= beside device="
    ):
        DataLoader(view, 2, transfer=fd, device=None)
    with pytest.raises(TypeError, match="unexpected keyword arguments: transfers"):
        DataLoader(view, 2, transfers=fd)
    fd.close()


def test_a_batch_saved_with_torch_loads_with_weights_only(corpus: Path, tmp_path: Path) -> None:
    """torch.load refuses classes it does not know (weights_only=True, its default):
    a batch saved to reproduce a failure loads back as a dict of its tensors."""
    ld = DataLoader(Documents(corpus), 2, batching=tokload.Fill(16), seed=3, device=None)
    batch = next(iter(ld))
    ld.close()
    assert isinstance(batch, Batch)
    import copy

    for twin in (copy.copy(batch), copy.deepcopy(batch)):  # a Batch, its event kept
        assert isinstance(twin, Batch) and twin.ready is batch.ready and list(twin) == list(batch)
    torch.save(batch, tmp_path / "b.pt")
    back = torch.load(tmp_path / "b.pt")
    assert list(back) == list(batch)
    for k, v in batch.items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(back[k], v), k
        else:
            assert back[k] == v, k
