"""The loader's read-ahead: hints for the samples of the tasks ahead.

The filesystem policy is checked on mountinfo text; the hints' effect on a slow
filesystem is checked in ``test_delayfs.py`` (it needs FUSE).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

import tokload
from tokload import DataLoader, Documents, TokenStream, Writer, readahead
from tokload.readahead import filesystem_of, is_remote, parse_mountinfo

MOUNTINFO = r"""22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw
30 22 0:40 / /mnt/nfs rw,relatime shared:2 - nfs4 srv:/export rw,vers=4.2
31 30 0:41 / /mnt/nfs/local rw,relatime shared:3 - tmpfs tmpfs rw
32 22 0:42 / /mnt/my\040bucket rw,nosuid - fuse.s3fs s3fs rw,user_id=0
33 22 0:43 / /data rw - lustre 10.0.0.1@tcp:/fs rw
34 22 0:44 / /scratch rw - autofs systemd-1 rw,fd=45
35 34 0:45 / /scratch rw - nfs4 srv:/scratch rw,vers=4.2
36 22 0:46 / /mnt/new\012line rw - tmpfs tmpfs rw
"""


def test_the_filesystem_of_a_path_is_its_deepest_mount() -> None:
    mounts = parse_mountinfo(MOUNTINFO)
    assert ("/mnt/my bucket", "fuse.s3fs") in mounts
    assert filesystem_of("/mnt/nfs/a/b.rows", mounts) == "nfs4"
    assert filesystem_of("/mnt/nfs/local/x", mounts) == "tmpfs"  # nested, local
    assert filesystem_of("/mnt/nfsother/x", mounts) == "ext4"  # not a prefix match
    assert filesystem_of("/mnt/my bucket/shard", mounts) == "fuse.s3fs"
    # two mounts on one point: the later (in view) decides; an automounter's autofs
    # hid the nfs4 over it, so read-ahead was off on the storage it is for (review45)
    assert filesystem_of("/scratch/corpus/a.rows", mounts) == "nfs4"
    assert filesystem_of("/mnt/new\nline/x", mounts) == "tmpfs"  # \012 decoded too
    assert [is_remote(t) for t in ("nfs4", "tmpfs", "fuse.s3fs", "lustre", "ext4", None)] == [
        True,
        False,
        True,
        True,
        False,
        False,
    ]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("ra") / "ds"
    with Writer(path, "<u4", shard_bytes=4000) as w:
        for k in range(60):
            w.write(np.arange(k * 1000, k * 1000 + 50 + k % 17, dtype=np.uint32))
    return path


def test_the_automatic_choice_follows_the_mount(
    corpus: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    view = TokenStream(corpus, window=33)
    assert DataLoader(view, 2).readahead is readahead.wanted(view)
    root = str(Path(corpus).resolve().anchor)
    monkeypatch.setattr(readahead, "_mounts", lambda: ((root, "nfs4"),))
    assert readahead.wanted(view) and DataLoader(view, 2).readahead is True
    assert DataLoader(view, 2, read=tokload.ReadOptions(readahead=False)).readahead is False
    assert not readahead.wanted(Documents(corpus))  # no hint: nothing to read ahead
    monkeypatch.setattr(readahead, "_mounts", lambda: ((root, "xfs"),))
    assert DataLoader(view, 2).readahead is False
    with pytest.raises(ValueError, match=r"readahead must be None, True or False, got 'yes'"):
        DataLoader(view, 2, read=tokload.ReadOptions(readahead="yes"))  # type: ignore[arg-type]


@pytest.mark.parametrize("threads", [1, 2])
def test_hints_change_nothing_in_the_batches(corpus: Path, threads: int) -> None:
    view = TokenStream(corpus, window=33, stride=20)

    def run(ra: bool) -> tuple[list[Any], Any]:
        read = tokload.ReadOptions(steps_per_task=2, prefetch=8, readahead=ra)
        ld = DataLoader(view, 3, seed=4, epochs=2, num_threads=threads, read=read)
        it: Any = iter(ld)
        out = [b["tokens"].clone() for b in it]
        return out, it

    with_hints, it = run(True)
    without, _ = run(False)
    assert len(with_hints) == len(without) > 0
    for a, b in zip(with_hints, without, strict=True):
        assert (a == b).all()
    ahead = it._lead[1] if it._lead else None  # the iterator's ReadAhead
    assert ahead is not None and ahead.hinted > 0


def test_hint_windows_checks_like_a_read(corpus: Path) -> None:
    view = TokenStream(corpus, window=33)
    rows = view.source.rows
    n = len(view)
    # one hint per shard each window touches
    assert rows.hint_windows([0, n - 1], 0, n, 33, 33) == sum(
        len(rows.plan(i * 33, 33)) for i in (0, n - 1)
    )
    assert rows.hint_windows([], 0, n, 33, 33) == 0
    with pytest.raises(IndexError, match=rf"observation {n} is out of range for a view of {n}"):
        view.hint([n])
    with pytest.raises(TypeError, match="indices must be integers"):
        view.hint([0.5])
    view.close()
    with pytest.raises(ValueError, match="I/O on a closed dataset"):
        view.hint([0])


def test_a_blend_reads_ahead_through_its_components(
    corpus: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A blend had no ``hint``: on network storage its loader never read ahead, while
    one of its streams alone did (review44)."""
    a, b = TokenStream(corpus, window=33), TokenStream(corpus, window=33, stride=20)
    inner = tokload.Blend([(a, 1.0), (b, 1.0)], length=90, block_size=3)
    mix = tokload.Blend([(a, 1.0), (b, 2.0), (inner, 1.0)], length=300, block_size=4)
    root = str(Path(corpus).resolve().anchor)
    monkeypatch.setattr(readahead, "_mounts", lambda: ((root, "nfs4"),))
    assert readahead.wanted(mix) and DataLoader(mix, 2).readahead is True
    assert set(mix.storage_paths()) == set(a.storage_paths())
    docs = tokload.Blend([(Documents(corpus), 1.0)], length=10)
    assert docs.storage_paths() == [] and not readahead.wanted(docs)
    # each component is hinted its own indices of the positions (the inner blend's its own)
    seen: dict[int, list[np.ndarray]] = {0: [], 1: [], 2: []}
    for c, view in enumerate((a, b)):
        monkeypatch.setattr(view, "hint", lambda idx, c=c: seen[c].append(np.asarray(idx)))
    positions = np.arange(0, 300, 7)
    comp, index = mix.locate(positions)
    mix.hint(positions)
    got = {c: np.concatenate(seen[c]) if seen[c] else np.zeros(0, np.int64) for c in (0, 1)}
    ic, ii = inner.locate(index[comp == 2])
    for c in (0, 1):
        want = np.concatenate([index[comp == c], ii[ic == c]])
        assert sorted(got[c].tolist()) == sorted(want.tolist())
    assert mix.locate(positions)[0] is comp  # the hint kept the thread's last answer
    monkeypatch.undo()
    with pytest.raises(IndexError, match="observation 300 is out of range"):
        mix.hint([300])

    def run(ra: bool) -> list[Any]:
        read = tokload.ReadOptions(steps_per_task=2, prefetch=8, readahead=ra)
        ld = DataLoader(mix, 3, seed=4, epochs=1, num_threads=2, read=read)
        return [bt["tokens"].clone() for bt in ld]

    with_hints, without = run(True), run(False)
    assert len(with_hints) == len(without) == 100
    assert all((x == y).all() for x, y in zip(with_hints, without, strict=True))


def test_shards_linked_one_by_one_are_judged_where_they_lead(
    corpus: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A local directory whose shard files are links into a network mount was judged
    local: read-ahead stayed off (review45)."""
    links = tmp_path / "links"
    links.mkdir()
    for f in Path(corpus).iterdir():
        (links / f.name).symlink_to(f.resolve())
    view = TokenStream(links, window=33)
    monkeypatch.setattr(
        readahead, "_mounts", lambda: (("/", "ext4"), (str(Path(corpus).resolve()), "nfs4"))
    )
    assert readahead.wanted(view)
    monkeypatch.setattr(readahead, "_mounts", lambda: (("/", "ext4"),))
    assert not readahead.wanted(view)
