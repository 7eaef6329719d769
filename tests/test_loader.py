"""The DataLoader: order, rank split, exactly-once resume, prefetch threads, batches."""

from __future__ import annotations

import gc
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from harness import Segment, assert_exactly_once, run_segments
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tokload
from tokload import DataLoader, Documents, StreamWithMetadata, TokenStream, Writer
from tokload.errors import StateError


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Documents k = 0..119 whose tokens are k*1000 + (0, 1, ...): a token names its place."""
    path = tmp_path_factory.mktemp("loader") / "ds"
    with Writer(path, "<u4", shard_bytes=3000) as w:
        for k in range(120):
            w.write(np.arange(k * 1000, k * 1000 + 5 + k % 23, dtype=np.uint32))
    return path


@pytest.fixture(scope="module")
def meta_corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("loader") / "meta"
    with Writer(
        path, [("token", "<u4"), ("metadata_id", "<u4")], metadata=True, shard_bytes=2000
    ) as w:
        for k in range(40):
            w.write(
                {"token": np.arange(k * 100, k * 100 + 20)},
                spans=[(0, 5, b"head-%d" % k), (10, 20, b"tail-%d" % k)],
            )
    return path


def reader_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("tokload-reader")]


def wait_no_readers(timeout: float = 1.0) -> bool:
    deadline = time.monotonic() + timeout
    while reader_threads() and time.monotonic() < deadline:
        time.sleep(0.01)
    return not reader_threads()


# ---- order and rank split -----------------------------------------------------------------------


def test_positions_map_to_epoch_permutations(corpus: Path) -> None:
    view = TokenStream(corpus, window=7, stride=5)
    n = len(view)
    loader = DataLoader(view, 16, seed=11, num_threads=0)
    got = []
    for _, batch in zip(range(3 * n // 16 + 2), loader, strict=False):
        got.append(batch)
    pos = torch.cat([b["position"] for b in got]).numpy()
    idx = torch.cat([b["index"] for b in got]).numpy()
    np.testing.assert_array_equal(pos, np.arange(len(pos)))
    for q, i in zip(pos.tolist(), idx.tolist(), strict=True):
        e, j = divmod(q, n)
        assert i == tokload.Permutation.for_epoch(n, 11, e)[j]
    tokens = torch.cat([b["tokens"] for b in got]).numpy()
    for b, i in enumerate(idx[:50].tolist()):
        np.testing.assert_array_equal(tokens[b], view[i])


def test_a_global_batch_asked_for_by_hand_is_held_to_the_run(corpus: Path) -> None:
    """review68: ``raw_batch(0, 8)`` on a global batch of 4 gave 4 rows (positions
    4 to 7 dropped without a word), ``positions(0.5, 4.5)`` was taken, ``raw_batch(4,
    0)`` gave an empty batch, ``build_steps([])`` an IndexError. A span must be a
    global batch of the run (for packed rows: one of its steps)."""
    ld = DataLoader(TokenStream(corpus, window=8), 4, seed=1, num_threads=0, epochs=1)
    assert ld.raw_batch(0, 4)["tokens"].shape == (4, 8)
    assert ld.positions(1, 3).tolist() == [1, 2]  # (a part of one: as the last step is)
    bad: list[tuple[Any, Any, type[Exception]]] = [
        (0, 8, ValueError), (4, 0, ValueError), (-1, 3, ValueError), (0.5, 4.5, TypeError),
        (True, 4, TypeError), (10**9, 10**9 + 4, ValueError)]  # fmt: skip
    for a, e, error in bad:
        for what, call in (("raw_batch", ld.raw_batch), ("positions", ld.positions)):
            with pytest.raises(error, match=rf"^{what}: "):
                call(a, e)
        with pytest.raises(error, match=r"^build_steps: "):
            ld.build_steps([(a, e)])
    with pytest.raises(ValueError, match=r"build_steps: no steps given"):
        ld.build_steps([])
    assert len(ld.build_steps(np.array(ld.schedule.spans(0, 2)))) == 2  # type: ignore[arg-type]
    packed = DataLoader(Documents(corpus), 4, batching=tokload.Fill(32), num_threads=0, epochs=1)
    steps = packed.schedule.spans(0, 2)
    assert len(packed.build_steps(steps)) == 2
    a, e = steps[1]
    with pytest.raises(ValueError, match=rf"build_steps: \[{a + 1}, {e}\) is not a step"):
        packed.build_steps([(a + 1, e)])


@pytest.mark.parametrize("kind", ["stream", "documents", "metadata"])
def test_global_batches_do_not_depend_on_the_number_of_ranks(
    kind: str, corpus: Path, meta_corpus: Path
) -> None:
    def view() -> Any:
        if kind == "stream":
            return TokenStream(corpus, window=9)
        if kind == "documents":
            return Documents(corpus)
        return StreamWithMetadata(meta_corpus, window=8, stride=3)

    g = 16
    per_r: dict[int, list[list[tuple[int, bytes]]]] = {}
    for r_count in (1, 2, 4, 8):
        steps: list[list[tuple[int, bytes]]] = [[] for _ in range(12)]
        for r in range(r_count):
            ld = DataLoader(
                view(),
                g // r_count,
                seed=5,
                rank=r,
                world_size=r_count,
                num_threads=1,
                read=tokload.ReadOptions(prefetch=2),
            )
            for s, b in zip(range(12), ld, strict=False):
                # rank r takes positions c + r + k*R
                c = s * g
                np.testing.assert_array_equal(
                    b["position"].numpy(), c + r + r_count * np.arange(g // r_count)
                )
                for k in range(len(b["index"])):
                    row = b["tokens"][k] if "tokens" in b else b["token"][k]
                    if "lengths" in b:  # padding depends on the rank's batch: compare real rows
                        row = row[: int(b["lengths"][k])]
                    steps[s].append((int(b["index"][k]), row.numpy().tobytes()))
            ld.close()
        per_r[r_count] = [sorted(s) for s in steps]
    assert per_r[1] == per_r[2] == per_r[4] == per_r[8]


def test_device_mesh_data_parallel_dimension(corpus: Path) -> None:
    class FakeMesh:  # what the loader uses of a DeviceMesh (size takes an index only)
        mesh_dim_names = ("dp", "tp")
        ndim = 2

        def __init__(self, ranks: dict[str, int], sizes: dict[str, int]) -> None:
            self.ranks, self.sizes = ranks, sizes

        def get_local_rank(self, dim: int) -> int:
            return self.ranks[self.mesh_dim_names[dim]]

        def size(self, dim: int) -> int:
            assert isinstance(dim, int)
            return self.sizes[self.mesh_dim_names[dim]]

    view = TokenStream(corpus, window=9)
    a = DataLoader(
        view, 4, mesh=FakeMesh({"dp": 1, "tp": 0}, {"dp": 2, "tp": 4}), mesh_dim="dp", num_threads=0
    )
    b = DataLoader(
        view, 4, mesh=FakeMesh({"dp": 1, "tp": 3}, {"dp": 2, "tp": 4}), mesh_dim="dp", num_threads=0
    )
    assert (a.rank, a.world_size) == (1, 2)
    assert torch.equal(next(iter(a))["tokens"], next(iter(b))["tokens"])
    with pytest.raises(ValueError, match="either a DeviceMesh or rank/world_size"):
        DataLoader(view, 4, mesh=FakeMesh({"dp": 0}, {"dp": 1}), rank=0, world_size=1)
    with pytest.raises(ValueError, match=r"mesh_dim='pp' is not a dimension of the DeviceMesh: "
                       r"its dimensions are named \['dp', 'tp'\]"):  # fmt: skip
        DataLoader(view, 4, mesh=FakeMesh({"dp": 1}, {"dp": 2}), mesh_dim="pp")
    with pytest.raises(ValueError, match="mesh_dim=2 is not a dimension of a 2-D DeviceMesh"):
        DataLoader(view, 4, mesh=FakeMesh({"dp": 1}, {"dp": 2}), mesh_dim=2)
    c = DataLoader(view, 4, mesh=FakeMesh({"dp": 1, "tp": 3}, {"dp": 2, "tp": 4}), mesh_dim=-1)
    assert (c.rank, c.world_size) == (3, 4)
    # not a mesh, or a mesh's dimension without it (review27: an AttributeError, and
    # a dp x tp job that forgot mesh= split its data over the whole world)
    for not_a_mesh in ("dp", [[0, 1], [2, 3]]):
        with pytest.raises(TypeError, match=r"mesh must be a torch.distributed.device_mesh."
                           r"DeviceMesh, got (str 'dp'|list \[\[0, 1\], \[2, 3\]\])$"):  # fmt: skip
            DataLoader(view, 4, mesh=not_a_mesh)
    with pytest.raises(
        ValueError,
        match=r"^mesh_dim='dp' is given without a mesh, and this is rank 1 of 2: pass mesh= too",
    ):
        DataLoader(view, 4, mesh_dim="dp", rank=1, world_size=2)
    alone: Any = None  # one process, with no mesh to give (review33): it is moot
    assert DataLoader(view, 4, mesh=alone, mesh_dim="dp").world_size == 1

    class Elsewhere(FakeMesh):  # a mesh of other processes (another pipeline stage's)
        def get_coordinate(self) -> None:
            return None

    with pytest.raises(ValueError, match=r"^this process \(RANK=.*\) is not in the DeviceMesh "):
        DataLoader(view, 4, mesh=Elsewhere({"dp": 0}, {"dp": 2}), mesh_dim="dp")


def test_real_device_mesh_by_name(corpus: Path) -> None:
    """torch's own DeviceMesh (its ``size`` takes an index only), one gloo process."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))
        for dim in ("dp", "tp", 1):
            ld = DataLoader(TokenStream(corpus, window=9), 4, mesh=mesh, mesh_dim=dim)
            assert (ld.rank, ld.world_size) == (0, 1)
        with pytest.raises(ValueError, match="mesh_dim='pp' is not a dimension"):
            DataLoader(TokenStream(corpus, window=9), 4, mesh=mesh, mesh_dim="pp")
    finally:
        dist.destroy_process_group()


def test_rank_defaults_to_torch_distributed(corpus: Path) -> None:
    import torch.distributed as dist

    assert not dist.is_initialized()
    ld = DataLoader(TokenStream(corpus, window=9), 4)
    assert (ld.rank, ld.world_size) == (0, 1)
    with pytest.raises(ValueError, match="give both rank and world_size"):
        DataLoader(TokenStream(corpus, window=9), 4, rank=1)
    with pytest.raises(ValueError, match=r"need 0 <= rank < world_size, got rank=3"):
        DataLoader(TokenStream(corpus, window=9), 4, rank=3, world_size=2)
    # not truncated (1.5 ran as rank 1), nor taken from a bool or compared as text
    bad: list[tuple[Any, Any]] = [(1.5, 2), (0, 2.5), (True, 2), ("1", "2"), (np.int64(1), 2.0)]
    for rank, world in bad:
        with pytest.raises(ValueError, match="rank and world_size must be integers"):
            DataLoader(TokenStream(corpus, window=9), 4, rank=rank, world_size=world)
    one: Any = np.int64(1)  # an index read from an array is an integer
    two: Any = np.int32(2)
    ld = DataLoader(TokenStream(corpus, window=9), 4, rank=one, world_size=two)
    assert (ld.rank, ld.world_size) == (1, 2) and type(ld.rank) is int


def test_a_loader_made_before_init_process_group_under_torchrun_is_refused(
    corpus: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each of torchrun's processes would read every batch as rank 0 of 1."""
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "2")
    with pytest.raises(ValueError, match=r"WORLD_SIZE=4 \(RANK=2\) but torch.distributed is not"):
        DataLoader(TokenStream(corpus, window=9), 4)
    ld = DataLoader(TokenStream(corpus, window=9), 4, rank=0, world_size=1)  # said so
    assert (ld.rank, ld.world_size) == (0, 1)
    # read as torch reads it (int(): " 2" and "2\n" from a config file ran unrefused)
    for spelt in (" 4", "4\n", "+4"):
        monkeypatch.setenv("WORLD_SIZE", spelt)
        with pytest.raises(ValueError, match=r"\(RANK=2\) but torch.distributed is not"):
            DataLoader(TokenStream(corpus, window=9), 4)
    for alone in ("1", "", "x", "\u00b2"):  # one process, or not a launcher's integer
        monkeypatch.setenv("WORLD_SIZE", alone)
        assert DataLoader(TokenStream(corpus, window=9), 4).world_size == 1


@pytest.mark.parametrize("threads", [0, 1])
def test_an_iterator_replaced_by_a_newer_one_says_so(corpus: Path, threads: int) -> None:
    """A peek with next(iter(loader)) inside a loop once ended that loop as if the data
    had run out."""
    ld = DataLoader(TokenStream(corpus, window=9), 4, seed=2, num_threads=threads)
    first = iter(ld)
    a = next(first)["position"].tolist()
    peek = next(iter(ld))["position"].tolist()
    with pytest.raises(RuntimeError, match="replaced by a newer iter"):
        next(first)
    assert peek == [4, 5, 6, 7] and a == [0, 1, 2, 3] and ld.cursor == 8
    for _ in ld:  # a for loop left with break, then another: no error, goes on
        break
    assert next(iter(ld))["position"].tolist() == [12, 13, 14, 15]
    ld.close()
    done = iter(ld)
    ld.close()  # closing the loader ends its iterator; it was not replaced
    with pytest.raises(StopIteration):
        next(done)
    # an iterator that has run out stays so after a new pass starts
    short = DataLoader(TokenStream(corpus, window=9), 4, epochs=1, num_threads=threads)
    first = iter(short)
    assert len(list(first)) == len(short.schedule.spans(0, 10**6))
    second = iter(short)
    with pytest.raises(StopIteration):
        next(first)
    with pytest.raises(StopIteration):  # at the end already: the cursor is there
        next(second)
    short.close()


# ---- exactly once and resume --------------------------------------------------------------------


segments = st.lists(
    st.builds(
        Segment,
        world_size=st.integers(1, 5),
        batch_size=st.integers(1, 9),
        steps=st.one_of(st.none(), st.integers(0, 25)),
        num_threads=st.sampled_from([0, 0, 1, 2]),
    ),
    min_size=1,
    max_size=5,
)


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(
    segs=segments,
    epochs=st.integers(1, 3),
    seed=st.integers(0, 2**64 - 1),
    window=st.integers(5, 60),
    block=st.sampled_from([1, 1, 2, 7, 64]),
)
def test_exactly_once_across_resumes_and_rescales(
    corpus: Path, segs: list[Segment], epochs: int, seed: int, window: int, block: int
) -> None:
    view = TokenStream(corpus, window=window, stride=max(1, window // 2))
    n = len(view)
    block = min(block, n // 2)  # (more than half the samples is refused)

    def make(**kw: Any) -> DataLoader:
        return DataLoader(
            view,
            seed=seed,
            epochs=epochs,
            shuffle_block=block,
            **kw,
            read=tokload.ReadOptions(prefetch=3),
        )

    segs = [*segs, Segment(world_size=3, batch_size=4, steps=None)]  # finish the run
    got = run_segments(make, segs)
    assert got.cursors[-1] == epochs * n
    assert_exactly_once(got, n, epochs * n)


@pytest.mark.parametrize("kind", ["stream", "documents", "metadata"])
def test_resumed_batches_equal_an_uninterrupted_run(
    kind: str, corpus: Path, meta_corpus: Path
) -> None:
    def make(**kw: Any) -> DataLoader:
        if kind == "stream":
            view: Any = TokenStream(corpus, window=33, stride=20)
        elif kind == "documents":
            view = Documents(corpus)
        else:
            view = StreamWithMetadata(meta_corpus, window=8, stride=3)
        return DataLoader(view, seed=99, epochs=2, **kw, read=tokload.ReadOptions(prefetch=4))

    whole = run_segments(make, [Segment(2, 5, None, num_threads=2)])
    parts = run_segments(
        make,
        [
            Segment(2, 5, 7, num_threads=2),
            Segment(2, 5, 4, num_threads=1),
            Segment(2, 5, None, num_threads=0),
        ],
    )
    flat_whole = [whole.batches[k] for k in sorted(whole.batches)]
    flat_parts = [parts.batches[k] for k in sorted(parts.batches)]
    assert len(flat_whole) == len(flat_parts)
    for a, b in zip(flat_whole, flat_parts, strict=True):
        assert a.keys() == b.keys()
        for key in a:
            if torch.is_tensor(a[key]):
                assert torch.equal(a[key], b[key]), key
            else:
                assert a[key] == b[key], key


def test_state_dict_round_trip_and_refusals(corpus: Path, tmp_path: Path) -> None:
    view = TokenStream(corpus, window=9)
    ld = DataLoader(view, 4, seed=1, num_threads=0)
    it = iter(ld)
    for _ in range(5):
        next(it)
    st1 = ld.state_dict()
    assert st1["cursor"] == 20
    other = DataLoader(view, 7, seed=1, num_threads=0)
    other.load_state_dict(st1)
    assert other.state_dict() == st1  # save -> load -> save is the identity
    with pytest.raises(StateError, match=r"saved for seed=1, this loader has seed=2"):
        DataLoader(view, 4, seed=2).load_state_dict(st1)
    with pytest.raises(StateError, match=r"saved for n=.*pass force=True"):
        DataLoader(TokenStream(corpus, window=10), 4, seed=1).load_state_dict(st1)
    DataLoader(view.subset(0, len(view)), 4, seed=1).load_state_dict(st1)  # the same data
    twin = tmp_path / "twin"  # another dataset with exactly the same sizes
    with Writer(twin, "<u4", shard_bytes=3000) as w:
        for k in range(120):
            w.write(np.zeros(5 + k % 23, dtype=np.uint32))
    assert len(TokenStream(twin, window=9)) == len(view)
    with pytest.raises(StateError, match=r"saved for fingerprint="):
        DataLoader(TokenStream(twin, window=9), 4, seed=1).load_state_dict(st1)
    forced = DataLoader(TokenStream(corpus, window=10), 4, seed=1)
    forced.load_state_dict(st1, force=True)
    assert forced.cursor == 20
    # a blend of many components with one changed: where the fingerprints differ is
    # shown, not both whole (review31: 744 characters naming no component)
    parts = [view.subset(10 * k, 10 * k + 10) for k in range(8)]
    mix = tokload.Blend([(v, 1) for v in parts], length=80)
    saved = DataLoader(mix, 4, seed=1).state_dict()
    moved = [*parts[:5], view.subset(51, 61), *parts[6:]]
    with pytest.raises(StateError) as e:
        again = tokload.Blend([(v, 1) for v in moved], length=80)
        DataLoader(again, 4, seed=1).load_state_dict(saved)
    message = str(e.value)
    assert len(mix.fingerprint) > 500 and len(message) < 400
    before, after = message.split(", this loader has fingerprint=")
    assert before.startswith("the state was saved for fingerprint=...'") and ":50:60" in before
    assert ":51:61" in after and "(they differ from character " in after
    with pytest.raises(StateError, match="not a tokload loader state"):
        ld.load_state_dict({"step": 3})
    from torch.distributed.checkpoint.stateful import Stateful

    assert isinstance(ld, Stateful)
    torch.save(ld.state_dict(), tmp_path / "state.pt")
    ld.load_state_dict(torch.load(tmp_path / "state.pt"))


def test_jump_to_any_step(corpus: Path) -> None:
    view = TokenStream(corpus, window=9)
    ld = DataLoader(view, 4, seed=3, num_threads=1)
    first = [b["position"].tolist() for _, b in zip(range(3), ld, strict=False)]
    assert first == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    ld.cursor = 1000  # skip a bad stretch
    assert next(iter(ld))["position"].tolist() == [1000, 1001, 1002, 1003]
    assert ld.cursor == 1004
    with pytest.raises(ValueError, match="cursor must be a non-negative integer"):
        ld.cursor = -1


# ---- epochs and evaluation ----------------------------------------------------------------------


def test_epochs_drop_last_and_evaluation(corpus: Path) -> None:
    view = Documents(corpus)  # n = 120
    ld = DataLoader(view, 7, rank=0, world_size=2, epochs=2, num_threads=0)
    assert len(ld) == 18  # ceil(240 / 14)
    batches = list(ld)
    assert len(batches) == 18 and ld.cursor == 240
    assert batches[-1]["position"].tolist() == [238]  # a partial last batch: rank 0 gets one
    assert list(ld) == []  # done
    # drop_last: no global batch straddles an epoch; 120 = 8*14 + 8 -> 8 steps per epoch
    dl = DataLoader(view, 7, rank=1, world_size=2, epochs=2, drop_last=True, num_threads=0)
    got = [b["position"] for b in dl]
    assert (
        len(got) == 16 == len(DataLoader(view, 7, rank=0, world_size=2, epochs=2, drop_last=True))
    )
    assert got[8][0] == 121  # the second epoch starts at position 120 (+ rank 1)
    # evaluation: one pass in order, split across ranks, last partial batch delivered
    seen = []
    for r in range(3):
        ev = DataLoader(view, 50, shuffle=False, epochs=1, rank=r, world_size=3, num_threads=0)
        seen += [
            (int(p), int(i)) for b in ev for p, i in zip(b["position"], b["index"], strict=True)
        ]
    assert sorted(seen) == [(i, i) for i in range(120)]
    with pytest.raises(TypeError, match="endless"):
        len(DataLoader(view, 2))


def test_batch_contents_per_view_kind(corpus: Path, meta_corpus: Path) -> None:
    docs = Documents(corpus)
    b = next(iter(DataLoader(docs, 3, seed=4, num_threads=0)))
    lengths = b["lengths"].tolist()
    assert b["tokens"].shape == (3, max(lengths))
    for k, i in enumerate(b["index"].tolist()):
        np.testing.assert_array_equal(b["tokens"][k, : lengths[k]].numpy(), docs[i])
        assert (b["tokens"][k, lengths[k] :] == 0).all()
    fixed_pad = tokload.Pad(to=8, value=7)
    fixed = next(iter(DataLoader(docs, 3, batching=fixed_pad, seed=4, num_threads=0)))
    assert fixed["tokens"].shape == (3, 8)
    for k, i in enumerate(fixed["index"].tolist()):
        n = int(fixed["lengths"][k])
        doc = np.asarray(docs[i])
        assert n == min(8, len(doc))
        np.testing.assert_array_equal(fixed["tokens"][k, :n].numpy(), doc[:n])
        assert (fixed["tokens"][k, n:] == 7).all()
    packed = next(iter(DataLoader(docs, 3, batching=tokload.Pack(), seed=4, num_threads=0)))
    assert sorted(packed) == ["cu_seqlens", "index", "lengths", "position", "tokens"]
    cu = packed["cu_seqlens"].tolist()
    for k, i in enumerate(packed["index"].tolist()):
        np.testing.assert_array_equal(packed["tokens"][cu[k] : cu[k + 1]].numpy(), docs[i])
    meta = StreamWithMetadata(meta_corpus, window=8, stride=3)
    m = next(iter(DataLoader(meta, 4, seed=4, num_threads=0)))
    assert m["metadata_positions"].shape == (4, 8) and m["token"].shape == (4, 8)
    for k, i in enumerate(m["index"].tolist()):
        ref = meta[i]
        want = [None if p < 0 else ref.metadata[p] for p in ref.positions]
        got = [None if p < 0 else m["metadata"][p] for p in m["metadata_positions"][k]]
        assert got == want
    custom = DataLoader(docs, 2, num_threads=1, collate=lambda raw: sorted(raw))
    assert next(iter(custom)) == sorted(["tokens", "lengths", "index", "position"])


# ---- threads ------------------------------------------------------------------------------------


def test_an_error_in_a_reader_thread_reaches_the_right_next(corpus: Path) -> None:
    def collate(raw: dict[str, Any]) -> int:
        if 40 in raw["position"]:
            raise_in_collate()
        return int(raw["position"][0])

    def raise_in_collate() -> None:
        raise ValueError("bad sample at position 40")

    ld = DataLoader(
        TokenStream(corpus, window=9),
        4,
        num_threads=3,
        collate=collate,
        read=tokload.ReadOptions(prefetch=6),
    )
    it = iter(ld)
    assert [next(it) for _ in range(10)] == list(range(0, 40, 4))
    with pytest.raises(ValueError, match="bad sample at position 40") as e:
        next(it)
    names = [f.name for f in e.traceback]
    assert "raise_in_collate" in names  # the original traceback
    assert any("reader thread" in note and "cursor 40" in note for note in e.value.__notes__)
    assert ld.cursor == 40  # nothing after the failure counts as delivered
    with pytest.raises(RuntimeError, match=r"stopped at a failure \(ValueError: bad sample"):
        next(it)  # the pass ended at the failure, and says so ...
    with pytest.raises(ValueError, match="position 40"):
        next(iter(ld))  # ... and a new one starts at the batch that failed


@pytest.mark.parametrize("threads", [0, 1, 3])
def test_an_error_in_collate_over_a_blend_reaches_the_user(corpus: Path, threads: int) -> None:
    """review59: over a ``Blend`` the collate error became tokload's own "zip()
    argument 2 is longer than argument 1" (the per-component counts were not cut
    to the steps delivered), and a reader thread lost the batch before it too."""
    view = TokenStream(corpus, window=9)
    blend = tokload.Blend([(view, 1.0), (view.subset(0, len(view) // 2), 1.0)], length=100)

    def collate(raw: dict[str, Any]) -> int:
        if int(raw["position"][0]) == 8:  # the third batch
            raise KeyError("boom")
        return int(raw["position"][0])

    ld = DataLoader(blend, 4, num_threads=threads, collate=collate, seed=2)
    it = iter(ld)
    assert [next(it) for _ in range(2)] == [0, 4]
    with pytest.raises(KeyError, match="boom"):
        next(it)
    assert ld.cursor == 8
    assert ld.stats()["batches"] == 2
    ld.close()


def test_threads_stop_on_close_break_and_gc(corpus: Path) -> None:
    view = TokenStream(corpus, window=9)
    ld = DataLoader(view, 4, num_threads=3, read=tokload.ReadOptions(prefetch=8))
    it = iter(ld)
    next(it)
    assert len(reader_threads()) == 3
    ld.close()
    assert wait_no_readers()
    for i, _b in enumerate(DataLoader(view, 4, num_threads=2)):
        if i == 3:
            break
    gc.collect()
    assert wait_no_readers()

    def consume() -> None:
        it2 = iter(DataLoader(view, 4, num_threads=2))
        next(it2)

    consume()
    gc.collect()
    assert wait_no_readers()
    with DataLoader(view, 4, num_threads=2) as ctx:
        next(iter(ctx))
    assert wait_no_readers()


def test_ctrl_c_stops_promptly(corpus: Path) -> None:
    # Python keeps SIGINT ignored if it started that way (a background job of a
    # shell, as under CI): install the usual KeyboardInterrupt handler first.
    code = f"""
import signal, sys, time, threading, tokload
signal.signal(signal.SIGINT, signal.default_int_handler)
view = tokload.TokenStream({str(corpus)!r}, window=9)
loader = tokload.DataLoader(view, 4, num_threads=2, prefetch=4)
print("ready", flush=True)
try:
    for b in loader:
        time.sleep(0.01)
except KeyboardInterrupt:
    t0 = time.monotonic()
    loader.close()
    alive = [t.name for t in threading.enumerate() if t.name.startswith("tokload-reader")]
    print("interrupted", round(time.monotonic() - t0, 3), alive, flush=True)
"""
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "ready"
    time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=10)
    words = out.split()
    assert words[0] == "interrupted", out
    assert float(words[1]) < 1.0 and words[2] == "[]", out


def test_prefetched_batches_are_not_counted(corpus: Path) -> None:
    ld = DataLoader(
        TokenStream(corpus, window=9), 4, num_threads=2, read=tokload.ReadOptions(prefetch=8)
    )
    it = iter(ld)
    next(it)
    time.sleep(0.2)  # let the threads run ahead
    assert ld.cursor == 4
    ld.close()


# ---- pinned memory ------------------------------------------------------------------------------


def test_pin_memory_without_a_gpu(corpus: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    view = TokenStream(corpus, window=9)
    with pytest.raises(RuntimeError, match=r"pin_memory=True needs a CUDA device"):
        DataLoader(view, 4, pin_memory=True)
    ld = DataLoader(view, 4, pin_memory="auto", num_threads=1)
    assert not ld.pinned
    b = next(iter(ld))
    assert not b["tokens"].is_pinned()
    with pytest.raises(ValueError, match="pin_memory must be"):
        DataLoader(view, 4, pin_memory="yes")


def test_buffers_are_never_reused(corpus: Path) -> None:
    ld = DataLoader(
        TokenStream(corpus, window=9), 4, num_threads=2, read=tokload.ReadOptions(prefetch=2)
    )
    kept: Iterator[Any] = iter(ld)
    batches = [next(kept) for _ in range(20)]
    ptrs = {b["tokens"].data_ptr() for b in batches}
    assert len(ptrs) == 20
    view = TokenStream(ld.view.source, window=9)
    for b in batches:
        for k, i in enumerate(b["index"].tolist()):
            np.testing.assert_array_equal(b["tokens"][k].numpy(), view[i])
    ld.close()


def test_bad_arguments(corpus: Path) -> None:
    view = TokenStream(corpus, window=9)
    with pytest.raises(TypeError, match="list is not a view: it lacks fingerprint, read_batch"):
        DataLoader([1, 2], 4)
    with pytest.raises(ValueError, match="batch_size must be a positive integer, got 0"):
        DataLoader(view, 0)
    with pytest.raises(ValueError, match="epochs must be an integer >= 1 or None, got 0"):
        DataLoader(view, 2, epochs=0)
    with pytest.raises(ValueError, match=r"epochs must be an integer >= 1 or None, got 1\.5"):
        DataLoader(view, 2, epochs=1.5)  # type: ignore[arg-type]
    two: Any = np.int64(2)
    assert len(DataLoader(view, 2, epochs=two, num_threads=0)) == len(
        DataLoader(view, 2, epochs=2, num_threads=0)
    )
    # review68: each failed later, or with an error that named something else
    with pytest.raises(TypeError, match=r"read must be a tokload\.ReadOptions\(\.\.\.\)"):
        DataLoader(view, 2, read={"prefetch": 2})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"write batching=tokload\.Pad\(\.\.\.\), not the cl"):
        DataLoader(Documents(corpus), 2, batching=tokload.Pad)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"collate must be a function of a batch's arrays, got 5"):
        DataLoader(view, 2, collate=5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"batch_size must be below 2\*\*40, got 10{30}"):
        DataLoader(view, 10**30)
    with pytest.raises(ValueError, match=r"Pad\(to=\.\.\.\) must be a positive integer below"):
        DataLoader(Documents(corpus), 2, batching=tokload.Pad(to=2**70))
    with pytest.raises(
        ValueError, match=r"^window must be below 2\*\*64, got 18446744073709551616"
    ):
        TokenStream(corpus, window=2**64)
    with pytest.raises(TypeError, match=r"deserialize must be a function of a record's bytes"):
        StreamWithMetadata(corpus, window=4, deserialize=5)  # type: ignore[arg-type]
    for every in (float("nan"), float("inf"), 0, True, 10**400):  # (review68: NaN logged nothing)
        with pytest.raises(ValueError, match=r"log_every must be a positive number of seconds"):
            DataLoader(view, 2, log_every=every)
    assert DataLoader(view, 2, log_every=two, num_threads=0).log_every == 2  # (was refused)
    with pytest.raises(ValueError, match="drop_last with a global batch of 8000"):
        DataLoader(view, 1000, rank=0, world_size=8, drop_last=True)
    with pytest.raises(ValueError, match="the view is empty"):
        DataLoader(view.subset(0, 0), 2)
    with pytest.raises(TypeError, match=r"Documents\(data, batch='ragged'\) was retired"):
        Documents(view.source, batch="ragged")
    for retired in ("read_rows", "packing"):  # (review68: a bare AttributeError)
        with pytest.raises(AttributeError, match=rf"Documents\.{retired} was retired in.*Fill"):
            getattr(Documents(corpus), retired)
        assert getattr(Documents(corpus), retired, None) is None  # (hasattr: False, as before)
    with pytest.raises(ValueError, match="past the end"):
        DataLoader(view, 2, epochs=1).cursor = len(view) + 1
    with pytest.raises(ValueError, match=r"prefetch must be >= 1 or None, got 0"):
        DataLoader(view, 2, read=tokload.ReadOptions(prefetch=0))
    with pytest.raises(ValueError, match=r"prefetch_bytes must be a positive integer, got 0"):
        DataLoader(view, 2, read=tokload.ReadOptions(prefetch_bytes=0))
    for depth in (1.5, True):  # truncated to 1 before
        with pytest.raises(ValueError, match=rf"io_depth={depth}: expected an integer in \[1, "):
            tokload.ReadOptions(io_depth=depth)  # type: ignore[arg-type]
    assert os.cpu_count()


@pytest.mark.parametrize(
    ("value", "integer"),
    [
        (3, True),
        (np.int64(-3), True),
        (np.uint64(2**64 - 1), True),
        (np.int8(0), True),
        (True, False),
        (np.True_, False),
        (3.0, False),
        (np.float32(3), False),
        ("3", False),
        (None, False),
        (np.array(3), False),  # an array, even of one integer
    ],
)
def test_what_an_integer_argument_is(value: object, integer: bool) -> None:
    from tokload.arguments import is_integer

    assert is_integer(value) is integer


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        # a float was truncated (seed 1.5 ran, and resumed, as seed 1), a string failed in int()
        ({"seed": 1.5}, r"seed must be an integer in \[0, 2\*\*64 - 1\], got 1\.5"),
        ({"seed": "a"}, r"seed must be an integer in \[0, 2\*\*64 - 1\], got 'a'"),
        ({"seed": -1}, r"seed must be an integer in \[0, 2\*\*64 - 1\], got -1"),
        (
            {"seed": 1 << 64},
            r"seed must be an integer in \[0, 2\*\*64 - 1\], got 18446744073709551616",
        ),
        ({"seed": True}, r"seed must be an integer in \[0, 2\*\*64 - 1\], got True"),
        ({"rounds": 6.0}, r"rounds must be an integer in \[0, 65536\], got 6\.0"),
        ({"rounds": 70000}, r"rounds must be an integer in \[0, 65536\], got 70000"),
        ({"num_threads": 1.5}, r"num_threads must be an integer from 0 to 256 or None, got 1\.5"),
        ({"num_threads": -1}, r"num_threads must be an integer from 0 to 256 or None, got -1"),
        ({"num_threads": 100_000}, r"from 0 to 256 or None, got 100000"),
        ({"batch_size": 2.0}, r"batch_size must be a positive integer, got 2\.0"),
        ({"batch_size": True}, r"batch_size must be a positive integer, got True"),
    ],
)
def test_numbers_are_checked_when_the_loader_is_made(
    corpus: Path, kwargs: dict[str, Any], message: str
) -> None:
    args = {"batch_size": 2, "num_threads": 0, **kwargs}
    with pytest.raises(ValueError, match=message):
        DataLoader(TokenStream(corpus, window=9), **args)


def test_numpy_integers_are_integers_everywhere(corpus: Path) -> None:
    """A size or seed read from an array is taken as the int it holds, and kept as an int."""
    view = TokenStream(corpus, window=9)
    plain = DataLoader(view, 4, seed=2**64 - 1, rounds=6, epochs=1, num_threads=0, device=None)
    ld = DataLoader(
        view,
        np.int64(4),  # type: ignore[arg-type]
        seed=np.uint64(2**64 - 1),  # type: ignore[arg-type]
        rounds=np.int32(6),  # type: ignore[arg-type]
        epochs=np.int64(1),  # type: ignore[arg-type]
        num_threads=np.int8(0),  # type: ignore[arg-type]
        device=None,
        read=tokload.ReadOptions(prefetch=np.int64(2), steps_per_task=np.int16(3)),  # type: ignore[arg-type]
    )
    assert type(ld.batch_size) is int and type(ld.state_dict()["seed"]) is int
    assert ld.state_dict() == plain.state_dict()
    for a, b in zip(plain, ld, strict=True):
        assert torch.equal(a["tokens"], b["tokens"])


def test_automatic_prefetch_follows_the_batch_size_in_bytes(corpus: Path) -> None:
    """prefetch=None: two tasks ahead until the first batch is delivered, then as many
    batches as prefetch_bytes hold (at most 512); an explicit prefetch stays as given."""
    from tokload.tasks import (
        MAX_AUTO_PREFETCH,
        UNKNOWN_SIZE_PREFETCH,
        auto_prefetch,
        batch_nbytes,
    )

    assert auto_prefetch(100, 1 << 20) == MAX_AUTO_PREFETCH
    assert auto_prefetch(1 << 20, 64 << 20) == 64
    assert auto_prefetch(1 << 30, 1 << 20) == 1
    assert auto_prefetch(0, 1) == UNKNOWN_SIZE_PREFETCH  # unknown size
    nested = (torch.zeros(10), [np.zeros(3, np.uint8), {"x": torch.zeros(2, dtype=torch.int64)}])
    assert batch_nbytes(nested) == 40 + 3 + 16 and batch_nbytes("text") == 0
    view = TokenStream(corpus, window=33)
    for budget in (1 << 30, 40_000, 1):
        ld = DataLoader(
            view,
            4,
            num_threads=1,
            read=tokload.ReadOptions(steps_per_task=4, prefetch_bytes=budget),
        )
        it: Any = iter(ld)
        assert it._pf is not None and it._pf.depth == 2
        first = next(it)
        nbytes = batch_nbytes(first)
        assert nbytes == 4 * 33 * 4 + 2 * 4 * 8  # tokens, index and position
        want = max(2, -(-auto_prefetch(nbytes, budget) // 4))
        assert it._pf.depth == want, (budget, nbytes)
        it.close()
    assert want == 2  # a budget below one task: still two tasks ahead
    it = iter(
        DataLoader(view, 4, num_threads=1, read=tokload.ReadOptions(steps_per_task=4, prefetch=24))
    )
    next(it)
    assert it._pf is not None and it._pf.depth == 6
    it.close()
    pf = tokload.prefetch.Prefetcher(lambda s: s, 0, None, 1, 1)
    try:
        with pytest.raises(ValueError, match="depth must be >= 1, got 0"):
            pf.set_depth(0)
    finally:
        pf.close()  # its reader thread would otherwise run for the rest of the session


def test_automatic_prefetch_shrinks_for_larger_later_batches(corpus: Path) -> None:
    """Documents padded to each batch's longest vary in size: the depth follows the
    largest batch that began a task, and never grows back."""
    from tokload.tasks import auto_prefetch, batch_nbytes

    ld = DataLoader(
        Documents(corpus),
        2,
        num_threads=1,
        read=tokload.ReadOptions(steps_per_task=1, prefetch_bytes=2000),
    )
    it: Any = iter(ld)
    largest, depths = 0, []
    for _ in range(40):
        largest = max(largest, batch_nbytes(next(it)))
        depths.append(it._pf.depth)
        assert it._pf.depth == max(2, auto_prefetch(largest, 2000))
    assert depths == sorted(depths, reverse=True) and depths[0] > depths[-1]
    it.close()


@pytest.mark.parametrize("kind", ["stream", "documents"])
def test_batches_do_not_depend_on_threads_or_task_size(kind: str, corpus: Path) -> None:
    def run(threads: int, per_task: int) -> list[dict[str, Any]]:
        view: Any = (
            TokenStream(corpus, window=11, stride=7) if kind == "stream" else Documents(corpus)
        )
        ld = DataLoader(
            view,
            6,
            seed=8,
            epochs=2,
            num_threads=threads,
            read=tokload.ReadOptions(prefetch=5, steps_per_task=per_task),
        )
        return list(ld)

    ref = run(0, 1)
    for threads, per_task in [(1, 1), (2, 4), (3, 7)]:
        got = run(threads, per_task)
        assert len(got) == len(ref)
        for a, b in zip(ref, got, strict=True):
            for key in a:
                assert torch.equal(a[key], b[key]), (threads, per_task, key)


# ---- the cursor during iteration ----------------------------------------------------------------


@pytest.mark.parametrize("threads", [0, 1, 3])
def test_setting_the_cursor_inside_a_loop_goes_on_from_there(threads: int, corpus: Path) -> None:
    view = TokenStream(corpus, window=9)
    ld = DataLoader(
        view,
        4,
        seed=3,
        num_threads=threads,
        read=tokload.ReadOptions(prefetch=12, steps_per_task=3),
    )
    got = []
    for step, b in enumerate(ld):
        got.append(b["position"].tolist())
        if step == 2:
            ld.cursor = 1000  # skip a bad stretch, as the DataLoader guide shows
        if step == 4:
            ld.cursor = 8  # and back: prefetched batches for 1008.. are dropped
        if step == 7:
            break
    assert got == [
        [0, 1, 2, 3],
        [4, 5, 6, 7],
        [8, 9, 10, 11],
        [1000, 1001, 1002, 1003],
        [1004, 1005, 1006, 1007],
        [8, 9, 10, 11],
        [12, 13, 14, 15],
        [16, 17, 18, 19],
    ]
    assert ld.cursor == 20


def test_load_state_dict_inside_a_loop_goes_on_from_the_state(corpus: Path) -> None:
    view = TokenStream(corpus, window=9)
    ld = DataLoader(view, 4, seed=3, num_threads=2, epochs=1, read=tokload.ReadOptions(prefetch=8))
    saved = None
    seen: list[int] = []
    for step, b in enumerate(ld):
        seen += b["position"].tolist()
        if step == 3:
            saved = ld.state_dict()
        if step == 6 and saved is not None:
            ld.load_state_dict(saved)  # roll back three steps, e.g. after a loss spike
            saved = None
    n = len(view)
    want = list(range(0, 28)) + list(range(16, n))
    assert seen == want  # nothing skipped; the rolled-back steps come again, once
    assert ld.cursor == n


def test_bad_cursors_are_refused_when_set(corpus: Path) -> None:
    view = TokenStream(corpus, window=9)
    ld = DataLoader(view, 4, epochs=2, num_threads=1)
    it = iter(ld)
    next(it)
    for bad, message in [
        (-1, "non-negative integer below 2\\*\\*64, got -1"),
        (1 << 64, "below 2\\*\\*64, got 18446744073709551616"),
        (2 * len(view) + 1, "past the end of the 2 epochs"),
        (3.0, "non-negative integer, got 3.0"),
        (True, "non-negative integer, got True"),
    ]:
        with pytest.raises(ValueError, match=message):
            ld.cursor = bad  # type: ignore[assignment]
    assert ld.cursor == 4  # unchanged, and the loop goes on
    assert next(it)["position"].tolist() == [4, 5, 6, 7]
    state = ld.state_dict()
    state["cursor"] = 10 * len(view)
    with pytest.raises(StateError, match=r"cursor is unusable here: cursor .* past the end"):
        ld.load_state_dict(state)
    endless = DataLoader(view, 4, num_threads=0)
    endless.cursor = (1 << 64) - 3  # the last positions there are
    assert next(iter(endless))["position"].numpy().view(np.uint64).tolist() == [
        (1 << 64) - 3,
        (1 << 64) - 2,
        (1 << 64) - 1,
    ]
    ld.close()


@given(
    n=st.integers(1, 60),
    batch=st.integers(1, 9),
    world=st.integers(1, 4),
    epochs=st.integers(1, 4),
    drop_last=st.booleans(),
    data=st.data(),
)
@settings(max_examples=150, deadline=None)
def test_len_is_the_number_of_steps_left(
    n: int, batch: int, world: int, epochs: int, drop_last: bool, data: st.DataObject
) -> None:
    from tokload.schedule import Schedule

    if drop_last and batch * world > n:
        return
    s = Schedule(n, batch, world_size=world, epochs=epochs, drop_last=drop_last)
    c = data.draw(st.integers(0, epochs * n))
    steps, at = 0, c
    while (sp := s.span(at)) is not None:
        steps += 1
        at = sp[1]
    assert s.steps_left(c) == steps


@given(
    n=st.integers(1, 3000),
    block=st.integers(1, 400),
    seed=st.integers(0, 2**64 - 1),
    epoch=st.integers(0, 5),
)
@settings(max_examples=200, deadline=None)
def test_a_block_shuffle_is_a_permutation_of_whole_blocks_in_order(
    n: int, block: int, seed: int, epoch: int
) -> None:
    """Every sample once an epoch; each block's samples in order, consecutive
    positions; the blocks' order is the permutation of the blocks, the short one
    (``n % block`` samples, numbered last) among them; block 1 is the plain shuffle."""
    from tokload._permute import Permutation
    from tokload.schedule import Schedule

    s = Schedule(n, 4, seed=seed, shuffle_block=block)
    got = s.indices(np.arange(epoch * n, (epoch + 1) * n, dtype=np.uint64))
    assert sorted(got.tolist()) == list(range(n))
    whole, rest = divmod(n, block)
    sizes = [block] * whole + ([rest] if rest else [])
    order = Permutation.for_epoch(len(sizes), seed, epoch)[:].tolist()
    if block == 1:
        assert got.tolist() == Permutation.for_epoch(n, seed, epoch)[:].tolist()
    at = 0
    for b in order:  # block b's samples, in order, at the slot the permutation gives it
        assert got[at : at + sizes[b]].tolist() == list(range(b * block, b * block + sizes[b]))
        at += sizes[b]


def test_a_block_shuffle_is_recorded_and_checked_on_resume(corpus: Path) -> None:
    view = TokenStream(corpus, window=9)
    a = DataLoader(view, 4, seed=5, shuffle_block=16, device=None)
    b = DataLoader(view, 4, seed=5, device=None)
    state = a.state_dict()
    assert state["shuffle_block"] == 16
    with pytest.raises(StateError, match=r"saved for shuffle_block=16, this loader has "):
        b.load_state_dict(state)
    old = b.state_dict()
    del old["shuffle_block"]  # (a state saved before the key: blocks of 1)
    b.load_state_dict(old)
    with pytest.raises(ValueError, match=r"shuffle_block=8 shuffles blocks .* shuffle=False"):
        DataLoader(view, 4, shuffle=False, shuffle_block=8)
    half = len(view) // 2
    with pytest.raises(ValueError, match=rf"shuffle_block={half + 1} leaves fewer than two"):
        DataLoader(view, 4, shuffle_block=half + 1)  # (one whole block: nearly no shuffle)
    DataLoader(view, 4, shuffle_block=half).close()
    bad: Any
    for bad in (0, 2.5, True):
        with pytest.raises(ValueError, match=r"shuffle_block must be a positive integer"):
            DataLoader(view, 4, shuffle_block=bad)
    a.close()
    b.close()


def test_len_does_not_walk_the_steps(corpus: Path) -> None:
    # about 2.6 * 10**10 steps: walking them (as len() once did) would never finish
    ld = DataLoader(TokenStream(corpus, window=9), 8, epochs=10**9, drop_last=True)
    ld.cursor = 12_345
    n = len(ld.view)
    assert len(ld) == (n - 12_345 % n) // 8 + (10**9 - 12_345 // n - 1) * (n // 8)


@pytest.mark.parametrize("io", ["sync", "threads", "uring", "auto"])
def test_every_io_path_gives_the_same_batches(io: str, corpus: Path) -> None:
    from tokload import _io

    if io == "uring" and not _io.uring_available():
        pytest.skip(f"io_uring is not available here: {_io.uring_error()}")

    def run(io: str | None, depth: int | None) -> list[Any]:
        view = TokenStream(corpus, window=9, stride=4)
        ld = DataLoader(
            view,
            5,
            seed=2,
            epochs=1,
            num_threads=2,
            read=tokload.ReadOptions(io=io, io_depth=depth),
        )
        assert ld._io is not None and ld._io.value[0] >= 0  # the loader's own backend
        return [b["tokens"].numpy().copy() for b in ld]

    ref = run("sync", None)
    for depth in (1, 3, None):
        got = run(io, depth)
        assert len(got) == len(ref)
        for a, b in zip(ref, got, strict=True):
            np.testing.assert_array_equal(a, b)


def test_io_is_the_loaders_own(corpus: Path) -> None:
    """``io=``/``io_depth=`` apply to this loader's reads, not to the dataset: the
    files keep their settings, and another loader of the same view keeps its own."""
    from tokload import _io

    view = TokenStream(corpus, window=9, stride=4)
    files = [f for f in view.source._closers if isinstance(f, _io.FileSet)]
    settings = [(f.io, f.queue_depth) for f in files]
    depth = min(_io.MAX_QUEUE_DEPTH, _io._pool_threads() + 7)
    ld = DataLoader(
        view,
        5,
        seed=2,
        epochs=1,
        num_threads=1,
        read=tokload.ReadOptions(io="threads", io_depth=depth),
    )
    other = DataLoader(view, 5, seed=2, epochs=1, num_threads=1)
    assert [b["tokens"].numpy().tolist() for b in ld] == [
        b["tokens"].numpy().tolist() for b in other
    ]
    # the threads backend grew its pool to the loader's depth: its reads used both
    assert _io._pool_threads() >= depth - 1
    assert [(f.io, f.queue_depth) for f in files] == settings
    # a scope is this thread's: nested ones restore what they replaced
    with _io.io_scope("sync", 2) as outer:
        with _io.io_scope(queue_depth=3):
            view.read(np.arange(3))
        assert outer.value[1] == 2
        view.read(np.arange(3))
    with pytest.raises(ValueError, match="io_depth"):
        DataLoader(view, 2, read=tokload.ReadOptions(io_depth=0))
    with pytest.raises(ValueError, match="io"):
        DataLoader(TokenStream(corpus, window=9), 2, read=tokload.ReadOptions(io="fast"))


@pytest.mark.parametrize("threads", [0, 1])
def test_a_loaders_own_reads_of_lengths_and_advice_are_in_its_io_scope(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, threads: int
) -> None:
    """Fill's packer reads lengths (from disk, for an index not held in memory), and
    read-ahead advice reads index entries: without reader threads the first, and
    with them the second, used the dataset's io and depth, not the loader's."""
    from tokload import _io

    with Writer(tmp_path / "ds", "<u2", shard_bytes=2000, metadata=True) as w:
        for k in range(120):
            w.write(np.arange(5 + k % 40, dtype=np.uint16), spans=[(0, 2, b"r%d" % k)])
    scopes: dict[str, list[Any]] = {"extents": [], "hint": []}

    def spy(cls: Any, name: str) -> None:
        real = getattr(cls, name)

        def wrapped(self: Any, *args: Any) -> Any:
            scopes[name].append(_io._scope.__dict__.get("value"))  # type: ignore[attr-defined]
            return real(self, *args)

        monkeypatch.setattr(cls, name, wrapped)

    spy(Documents, "extents")
    spy(tokload.StreamWithMetadata, "hint")
    read = tokload.ReadOptions(io="sync", io_depth=3, readahead=True)
    loaders = [
        DataLoader(
            Documents(tmp_path / "ds"),
            4,
            batching=tokload.Fill(64, lookahead=32),
            num_threads=threads,
            read=read,
            seed=1,
        ),
        DataLoader(
            tokload.StreamWithMetadata(tmp_path / "ds", window=16),
            4,
            num_threads=threads,
            read=read,
            seed=1,
        ),
    ]
    for ld in loaders:
        for _ in zip(range(20), ld, strict=False):
            pass
        ld.close()
    mine = {(_io._BACKEND_CODES["sync"], 3)}  # type: ignore[attr-defined]
    assert scopes["extents"] and set(scopes["extents"]) == mine, scopes
    if threads:  # advice goes with reader threads only
        assert scopes["hint"] and set(scopes["hint"]) == mine, scopes


def test_the_retired_read_keywords_warn_and_still_work(corpus: Path) -> None:
    """0.1's DataLoader(prefetch=, steps_per_task=, ...) are thin aliases of
    ReadOptions: they warn with the new spelling and do what it does."""
    view = TokenStream(corpus, window=9)
    new = r"write DataLoader\(\.\.\., read=tokload\.ReadOptions\(prefetch=4, steps_per_task=2\)\)"
    with pytest.warns(DeprecationWarning, match=r"is retired since tokload 0\.2: " + new):
        old = DataLoader(view, 2, num_threads=0, prefetch=4, steps_per_task=2)
    assert old.read == tokload.ReadOptions(prefetch=4, steps_per_task=2)
    assert (old.prefetch, old.steps_per_task) == (4, 2)
    with pytest.raises(TypeError, match=r"give prefetch in read=ReadOptions\(\.\.\.\), not beside"):
        DataLoader(view, 2, read=tokload.ReadOptions(), prefetch=4)
    with pytest.raises(TypeError, match=r"unexpected keyword arguments: colour"):
        DataLoader(view, 2, colour=1)
    for bad, message in (
        (dict(prefetch=0), r"prefetch must be >= 1 or None, got 0"),
        (dict(steps_per_task=0), r"steps_per_task must be >= 1, got 0"),
        (dict(readahead="yes"), r"readahead must be None, True or False, got 'yes'"),
        (dict(readahead=1), r"readahead must be None, True or False, got 1"),
        (dict(io="fast"), r"io='fast': expected one of"),
        (dict(io_depth=0), r"io_depth"),
    ):
        with pytest.raises(ValueError, match=message):
            tokload.ReadOptions(**bad)


class _Waiting:
    """A view whose reads wait ``wait`` seconds a batch, using no CPU (a slow store)."""

    def __init__(self, wait: float = 0.0) -> None:
        self.wait = wait

    def __len__(self) -> int:
        return 10_000

    @property
    def fingerprint(self) -> str:
        return f"waiting-{self.wait}"

    def read_batch(self, indices: np.ndarray, alloc: Any) -> dict[str, Any]:
        time.sleep(self.wait)
        out = alloc((len(indices),), np.int64)
        out[:] = indices
        return {"tokens": out}


def _threads_after(view: Any, batches: int, **kw: Any) -> int:
    loader = tokload.DataLoader(view, 4, seed=0, device=None, **kw)
    it: Any = iter(loader)
    try:
        for _ in range(batches):
            next(it)
        assert it._pf is not None
        return int(it._pf.threads)
    finally:
        it.close()


def test_reader_threads_grow_while_tasks_wait_for_reads() -> None:
    """Tasks that mostly wait (an object store's latency) get more reader threads, up
    to MAX_WAITING_THREADS: the waits overlap, so the loader keeps up."""
    from tokload.tasks import MAX_WAITING_THREADS

    read = tokload.ReadOptions(steps_per_task=2, prefetch=16)
    base = tokload.DataLoader(_Waiting(), 4, device=None).num_threads
    grown = _threads_after(_Waiting(wait=0.01), 40, read=read)
    assert base < grown <= MAX_WAITING_THREADS
    # asked for: as many as asked, whatever the waits
    assert _threads_after(_Waiting(wait=0.01), 40, read=read, num_threads=1) == 1


def test_how_many_threads_waiting_tasks_get() -> None:
    from tokload.tasks import MAX_WAITING_THREADS, waiting_threads

    assert waiting_threads(1, 1.0, 0.9, 32) == 1  # busy with their own work
    assert waiting_threads(1, 0.01, 0.0, 32) == 1  # too little seen
    assert waiting_threads(1, 1.0, 0.2, 32) == 5  # a fifth of the time busy: five
    assert waiting_threads(2, 1.0, 0.2, 32) == 10
    assert waiting_threads(1, 10.0, 0.01, 32) == MAX_WAITING_THREADS
    assert waiting_threads(1, 1.0, 0.2, 3) == 4  # no more than the prefetch's tasks, + 1
    assert waiting_threads(4, 1.0, 0.45, 1) == 4  # never fewer than asked
