"""Document indexes held in memory (``TOKLOAD_INDEX_MEMORY``, ``_tables.ShardTables``).

An opened dataset whose document index fits the budget reads each shard's
index whole, once, when a batch first needs it; one that does not reads two
entries per document. Both give the same documents, a table that fails to
load names its file, and a damaged table is refused whole as it loads.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import numpy as np
import pytest

from tokload import Documents, TokenStream, Writer
from tokload._docindex import DocIndex
from tokload._tables import ShardTables
from tokload.errors import CorruptDataError, TruncatedFileError
from tokload.source import DEFAULT_INDEX_MEMORY, index_memory


def tables(view: Documents) -> ShardTables:
    docs = view.source.docs
    assert isinstance(docs, DocIndex)
    return docs.tables


def corpus(path: Path, seed: int = 0) -> tuple[Path, list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    docs = [rng.integers(0, 1000, int(rng.integers(0, 50))).astype(np.uint16) for _ in range(300)]
    with Writer(path, "<u2", shard_bytes=1500, name_prefix="s") as w:
        for d in docs:
            w.write(d)
    return path, docs


def test_the_budget_decides(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ds, _ = corpus(tmp_path / "ds")
    assert index_memory() == DEFAULT_INDEX_MEMORY
    docs_bytes = sum(p.stat().st_size for p in ds.glob("*.docs"))
    monkeypatch.setenv("TOKLOAD_INDEX_MEMORY", str(docs_bytes))
    assert tables(Documents(ds)).enabled
    monkeypatch.setenv("TOKLOAD_INDEX_MEMORY", str(docs_bytes - 1))
    assert not tables(Documents(ds)).enabled
    monkeypatch.setenv("TOKLOAD_INDEX_MEMORY", "0")
    assert not tables(Documents(ds)).enabled
    for bad in ("-1", "lots"):
        monkeypatch.setenv("TOKLOAD_INDEX_MEMORY", bad)
        with pytest.raises(ValueError, match=rf"TOKLOAD_INDEX_MEMORY='{bad}': expected a number"):
            Documents(ds)


def test_in_memory_or_not_the_same_documents(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ds, want = corpus(tmp_path / "ds", seed=1)
    held = Documents(ds)
    monkeypatch.setenv("TOKLOAD_INDEX_MEMORY", "0")
    read = Documents(ds)
    assert tables(held).enabled and not tables(read).enabled
    rng = np.random.default_rng(2)
    touched: set[int] = set()
    assert held.source.manifest is not None
    cum = np.cumsum([0] + [s.documents for s in held.source.manifest.shards])
    for _ in range(30):
        ids = rng.integers(0, len(want), int(rng.integers(1, 9)))
        touched |= {int(np.searchsorted(cum, i, side="right")) - 1 for i in ids}
        a, b = held.read(ids), read.read(ids)
        np.testing.assert_array_equal(a.values, b.values)
        np.testing.assert_array_equal(a.offsets, b.offsets)
        np.testing.assert_array_equal(a.values, np.concatenate([want[i] for i in ids]))
        pa, la = held.read_padded(ids)
        pb, lb = read.read_padded(ids)
        np.testing.assert_array_equal(pa, pb)
        np.testing.assert_array_equal(la, lb)
    # only the shards a batch touched were read, and only there
    assert tables(held).loaded() == sorted(touched)
    assert tables(read).loaded() == []


def test_threads_load_the_tables_together(tmp_path: Path) -> None:
    ds, want = corpus(tmp_path / "ds", seed=3)
    view = Documents(ds)
    errors: list[BaseException] = []

    def work(seed: int) -> None:
        rng = np.random.default_rng(seed)
        try:
            for _ in range(40):
                ids = rng.integers(0, len(want), 8)
                got = view.read(ids)
                np.testing.assert_array_equal(got.values, np.concatenate([want[i] for i in ids]))
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert view.source.manifest is not None
    assert tables(view).loaded() == list(range(len(view.source.manifest.shards)))


def test_a_table_that_fails_to_load_names_its_file(tmp_path: Path) -> None:
    ds, _ = corpus(tmp_path / "ds", seed=4)
    view = Documents(ds)  # opened (sizes checked), nothing read yet
    os.truncate(ds / "s-00001.docs", 8)
    assert view.source.manifest is not None
    first = view.source.manifest.shards[0].documents
    with pytest.raises(
        TruncatedFileError,
        match=rf"^{ds / 's-00001.docs'}: file ended at byte 8 while reading the document "
        rf"index entry of document {first}",
    ):
        view.read([0, first])  # both tables load in one call: shard 1's fails
    assert tables(view).loaded() == []  # a failed call keeps none of them
    assert len(view.read([0]).values) == view.read([0]).lengths[0]
    assert tables(view).loaded() == [0]


def test_a_damaged_table_is_refused_whole_when_it_loads(tmp_path: Path) -> None:
    """A table held in memory is checked whole as it loads (from 0, never
    decreasing, up to the shard's rows): review63 found windows' boundaries read
    from an unchecked table without a word (``cu_seqlens`` that left documents out
    or ran past the shard), where the reads per entry refuse it. Every read of the
    shard fails, naming the file, the entry's byte and its value, as ``tokload
    verify`` names it; nothing is held."""
    ds, _ = corpus(tmp_path / "ds", seed=5)
    path = ds / "s-00000.docs"
    good = np.fromfile(path, "<u8")
    rows = int(good[-1])
    last = len(good) - 1
    cases = {  # damage: (entry set, its value, entry blamed)
        "decreasing": (3, good[4] + 1, 4),
        "past the rows": (2, rows + 7, 2),
        "first not 0": (0, 1, 0),
        "last short": (last, rows - 1, last),
    }
    for name, (at, value, entry) in cases.items():
        idx = good.copy()
        idx[at] = value
        idx.tofile(path)
        view = Documents(ds)  # (opened anew: a view refuses a file written after it opened)
        assert tables(view).enabled
        for d in (0, 3, 5):
            with pytest.raises(
                CorruptDataError,
                match=rf"s-00000\.docs: the document index: bad value {idx[entry]} at byte "
                rf"{8 * entry}$",
            ):
                view.read([d])
        assert tables(view).loaded() == [], name
        with pytest.raises(CorruptDataError, match=r"s-00000\.docs: the document index: "):
            TokenStream(ds, window=64, boundaries=True).read_batch(np.arange(4), np.empty)
    good.tofile(path)
    view = Documents(ds)
    np.testing.assert_array_equal(view.read([3]).values, view.read([3]).values)


def _overcommit_refuses_huge() -> str | None:
    """Why a malloc larger than memory + swap might not fail here (None: it fails)."""
    if "asan" in os.environ.get("LD_PRELOAD", ""):
        return "ASan aborts on a huge allocation instead of returning NULL"
    try:
        mode = Path("/proc/sys/vm/overcommit_memory").read_text().strip()
    except OSError:
        return "no /proc/sys/vm/overcommit_memory"
    return None if mode in ("0", "2") else f"vm.overcommit_memory={mode} grants any malloc"


@pytest.mark.skipif(_overcommit_refuses_huge() is not None, reason=_overcommit_refuses_huge() or "")
def test_a_table_too_big_to_allocate_is_a_memory_error_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A document index larger than this machine's memory and swap (a sparse file),
    held because the budget allows it: its load fails to allocate, and the read
    says which file, instead of crashing; nothing is kept, and the index read
    entry by entry (the default budget) still works."""
    from tokload.format import Manifest, ShardInfo, write_manifest

    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    swap = 0
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("SwapTotal:"):
            swap = int(line.split()[1]) * 1024
    ndocs = max(1 << 37, 4 * (total + swap) // 8)  # 8 bytes an entry: > 4x memory + swap
    rows = 10
    ds = tmp_path / "ds"
    ds.mkdir()
    np.arange(rows, dtype="<u2").tofile(ds / "s.rows")
    with open(ds / "s.docs", "wb") as f:  # entries 0, ..., 0, rows: all but the last empty
        f.seek(8 * ndocs)
        f.write(np.array([rows], dtype="<u8").tobytes())
    m = Manifest(dtype=np.dtype("<u2"), documents=True)
    m.shards.append(ShardInfo("s", rows, ndocs))
    write_manifest(ds, m)

    monkeypatch.setenv("TOKLOAD_INDEX_MEMORY", str(1 << 62))
    view = Documents(ds)
    assert tables(view).enabled
    with pytest.raises(MemoryError, match=rf"^{ds / 's.docs'}: out of memory while reading"):
        view.read([ndocs - 1])
    assert tables(view).loaded() == []
    monkeypatch.delenv("TOKLOAD_INDEX_MEMORY")
    small = Documents(ds)
    assert not tables(small).enabled
    np.testing.assert_array_equal(small.read([ndocs - 1]).values, np.arange(rows))
    assert len(small.read([0]).values) == 0


def test_a_directory_is_for_plain_tables_of_every_shard(tmp_path: Path) -> None:
    ds, _ = corpus(tmp_path / "ds")
    rs = tables(Documents(ds)).rs
    nshards = len(rs.files.paths)
    with pytest.raises(ValueError, match=r"held as they are \(compress=False\)"):
        ShardTables(rs, True, True, directory=[10] * nshards)
    with pytest.raises(ValueError, match=rf"directory: 1 shards' rows for {nshards} tables"):
        ShardTables(rs, True, directory=[10])
