"""The remote backend over another client: ``tokload.remote.client``'s functions
replaced by an in-memory store (no obstore, no server), so that what the rest of
``tokload.remote`` asks of a client is exactly what its docstring lists, and the
fetcher's own logic (merging, retries, the checks of every answer) is tested
apart from obstore's."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tokload import Documents, ObjectChangedError, RemoteError, TokenStream, Writer
from tokload.remote import client, counters, store

_buckets = itertools.count()


class FakeError(Exception):
    """An error of the fake client's, saying what it means (``client.kind``)."""

    def __init__(self, kind: str | None, text: str) -> None:
        super().__init__(text)
        self.kind = kind


class FakeStore:
    """A bucket in memory: the files under ``root`` as objects, each with an ETag;
    ``faults`` maps a key to the errors its next GETs raise, in turn."""

    def __init__(self, root: Path) -> None:
        self.objects = {
            str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()
        }
        self.etags = {k: f'"v1-{k}"' for k in self.objects}
        self.faults: dict[str, list[FakeError]] = {}
        self.gets = 0
        self.longest = 0

    def answer(self, key: str, start: int, end: int, etag: str | None) -> bytes:
        self.gets += 1
        self.longest = max(self.longest, end - start)
        if self.faults.get(key):
            raise self.faults[key].pop(0)
        if key not in self.objects:
            raise FakeError(client.MISSING, f"no object {key}")
        if etag is not None and etag != self.etags[key]:
            raise FakeError(client.CHANGED, f"{key}: If-Match {etag} failed")
        return self.objects[key][start:end]


@pytest.fixture
def fake(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Path, str, FakeStore]]:
    """A dataset of documents, local and in a fake store, read through the fake client."""
    local = tmp_path / "ds"
    rng = np.random.default_rng(5)
    with Writer(local, "<u4", shard_bytes=20_000) as w:
        for _ in range(120):
            w.write(rng.integers(0, 2**32, int(rng.integers(1, 500)), dtype=np.uint32))
    fs = FakeStore(tmp_path)
    bucket = f"fake-{next(_buckets)}"

    def connect(scheme: str, b: str, config: dict[str, Any], *_: Any) -> tuple[Any, str]:
        assert b == bucket and not config
        return fs, "the fake client"

    def get(handle: FakeStore, key: str, start: int, end: int, etag: str | None) -> Any:
        # a future of the fetcher's loop, answered on a later turn of it (as a
        # client's thread would), or failed
        fut = asyncio.get_running_loop().create_future()
        try:
            body = handle.answer(key, start, end, etag)
        except FakeError as e:
            fut.get_loop().call_soon(fut.set_exception, e)
        else:
            fut.get_loop().call_soon(fut.set_result, body)
        return fut

    async def body_async(answer: Any) -> Any:
        return answer

    async def head(handle: FakeStore, key: str) -> tuple[int, str | None]:
        if key not in handle.objects:
            raise FakeError(client.MISSING, f"no object {key}")
        return len(handle.objects[key]), handle.etags[key]

    async def list_prefix(handle: FakeStore, prefix: str) -> list[tuple[str, int, str | None]]:
        return [
            (k, len(v), handle.etags[k]) for k, v in sorted(handle.objects.items())
            if k.startswith(prefix)
        ]  # fmt: skip

    def kind(e: BaseException) -> str | None:
        return getattr(e, "kind", None)

    for name, fn in {
        "connect": connect,
        "get": get,
        "body": lambda answer: answer,
        "body_async": body_async,
        "head": head,
        "list_prefix": list_prefix,
        "kind": kind,
        "cause": str,
    }.items():
        monkeypatch.setattr(client, name, fn)
    monkeypatch.setattr(store, "_stores", {})  # no store of another test's client
    yield local, f"s3://{bucket}/ds", fs


FAST = {"retries": 3, "retry_seconds": 10}


def test_a_dataset_reads_the_same_through_another_client(
    fake: tuple[Path, str, FakeStore],
) -> None:
    """Windows and documents, merged GETs and one GET per window: the bytes of the
    local dataset, every request through the client's functions."""
    local, url, fs = fake
    idx = 2 * np.random.default_rng(0).permutation(50)  # no two windows adjacent
    for gap, longest in ((0, 64 * 4), (1 << 20, None)):
        opts = {**FAST, "merge_gap": gap}
        view = TokenStream(url, 64, storage_options=opts)  # its opening reads the index
        fs.longest = 0
        got = view.read(idx)
        np.testing.assert_array_equal(got, TokenStream(local, 64).read(idx))
        if longest is None:  # merged: windows of one shard within a MiB read as one GET
            assert fs.longest > 64 * 4
        else:  # one GET per window
            assert fs.longest == longest
    docs, ref = Documents(url, storage_options=FAST), Documents(local)
    assert len(docs) == len(ref) == 120
    batch, expected = docs.read([3, 77, 3, 119]), ref.read([3, 77, 3, 119])
    np.testing.assert_array_equal(batch.lengths, expected.lengths)
    np.testing.assert_array_equal(batch.offsets, expected.offsets)
    np.testing.assert_array_equal(np.asarray(batch.values), np.asarray(expected.values))
    assert fs.gets > 0


def test_another_clients_transient_errors_are_retried(fake: tuple[Path, str, FakeStore]) -> None:
    """What ``client.kind`` calls transient is retried, and counted; what it calls a
    changed object fails at once, named; what it does not know fails at once too."""
    local, url, fs = fake
    view = TokenStream(url, 64, storage_options={**FAST, "merge_gap": 0})
    rows = next(k for k in sorted(fs.objects) if k.endswith(".rows"))  # read by any full read
    before = counters()["retries"]
    fs.faults[rows] = [FakeError(client.TRANSIENT, "HTTP 503 SlowDown")] * 2
    everything = np.arange(len(view))
    np.testing.assert_array_equal(view.read(everything), TokenStream(local, 64).read(everything))
    assert not fs.faults[rows] and counters()["retries"] - before == 2

    fs.faults[rows] = [FakeError(client.CHANGED, "If-Match failed")]
    with pytest.raises(ObjectChangedError, match=r"the object changed since the dataset was"):
        view.read(everything)
    fs.faults[rows] = [FakeError(None, "the client broke")]
    with pytest.raises(RemoteError, match=r"a range failed: the client broke"):
        view.read(everything)
    np.testing.assert_array_equal(view.read(everything), TokenStream(local, 64).read(everything))
