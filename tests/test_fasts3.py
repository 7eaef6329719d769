"""The benchmarks' fast local S3 server (bench/fasts3.py) serves what a dataset holds:
the same bytes as the local files through tokload, S3's answers for missing keys and
buckets, ranges and If-Match as S3 has them."""

from __future__ import annotations

import http.client
import urllib.parse
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("obstore")

import tokload
from bench.fasts3 import FastS3Process, Server, _range


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[FastS3Process, Path]]:
    root = tmp_path_factory.mktemp("fasts3")
    rng = np.random.default_rng(0)
    with tokload.Writer(root / "b" / "ds", "<u4", shard_bytes=1 << 16) as w:
        for _ in range(60):
            w.write(rng.integers(0, 2**31, int(rng.integers(1, 3000))))
    with FastS3Process(root, lifetime=120) as srv:
        yield srv, root


def request(
    srv: FastS3Process, method: str, path: str, **headers: str
) -> tuple[int, dict[str, str], bytes]:
    u = urllib.parse.urlsplit(srv.endpoint)
    conn = http.client.HTTPConnection(u.hostname or "127.0.0.1", u.port, timeout=5)
    try:
        conn.request(method, path, headers=headers)
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    finally:
        conn.close()


def test_tokload_reads_the_same_bytes_as_from_disk(
    served: tuple[FastS3Process, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    srv, root = served
    for k, v in srv.env().items():
        monkeypatch.setenv(k, v)
    local = tokload.TokenStream(root / "b" / "ds", 257)
    remote = tokload.TokenStream("s3://b/ds", 257)  # more than one shard, listed
    assert len(remote) == len(local) and len(local.source.manifest.shards) > 1  # type: ignore[union-attr]
    idx = np.arange(len(local))
    np.testing.assert_array_equal(remote.read(idx), local.read(idx))
    docs, on_disk = tokload.Documents("s3://b/ds"), tokload.Documents(root / "b" / "ds")
    for i in (0, 31, 59):
        np.testing.assert_array_equal(docs[i], on_disk[i])


def test_ranges_if_match_and_missing_things(served: tuple[FastS3Process, Path]) -> None:
    srv, root = served
    data = (root / "b" / "ds" / "manifest.json").read_bytes()
    status, head, body = request(srv, "GET", "/b/ds/manifest.json", Range="bytes=10-19")
    assert (status, body) == (206, data[10:20])
    assert head["content-range"] == f"bytes 10-19/{len(data)}"
    status, head, body = request(srv, "HEAD", "/b/ds/manifest.json")
    assert status == 200 and body == b"" and head["content-length"] == str(len(data))
    etag = head["etag"]
    assert request(srv, "GET", "/b/ds/manifest.json", **{"If-Match": etag})[0] == 200
    status, _, body = request(srv, "GET", "/b/ds/manifest.json", **{"If-Match": '"other"'})
    assert status == 412 and b"<Code>PreconditionFailed</Code>" in body
    status, _, body = request(srv, "GET", "/b/ds/nope")
    assert status == 404 and b"<Code>NoSuchKey</Code>" in body
    status, _, body = request(srv, "GET", "/nobucket/x")
    assert status == 404 and b"<Code>NoSuchBucket</Code>" in body
    status, _, body = request(srv, "GET", "/b?list-type=2&prefix=ds/&max-keys=2")
    assert status == 200 and body.count(b"<Key>") == 2 and b"<IsTruncated>true" in body


def test_latency_is_added_to_every_answer(served: tuple[FastS3Process, Path]) -> None:
    import time

    srv, _ = served
    srv.set_latency(80)
    try:
        t0 = time.perf_counter()
        assert request(srv, "HEAD", "/b/ds/manifest.json")[0] == 200
        assert time.perf_counter() - t0 >= 0.08
    finally:
        srv.set_latency(0)


@pytest.mark.parametrize(
    ("header", "want"),
    [
        ("bytes=0-9", (0, 10)),
        ("bytes=5-", (5, 100)),
        ("bytes=-10", (90, 100)),
        ("bytes=90-200", (90, 100)),
        ("bytes=100-", None),
        ("items=0-1", None),
        ("bytes=0-1,4-5", None),
    ],
)
def test_range_headers(header: str, want: tuple[int, int] | None) -> None:
    assert _range(header, 100) == want


def test_a_key_cannot_leave_the_root(tmp_path: Path) -> None:
    (tmp_path / "b").mkdir()
    (tmp_path / "secret").write_text("no")
    status = Server(tmp_path).handle("GET", "/b/../secret", {})[0]
    assert status.startswith("404")
