"""A fast local S3 server for benchmarks: the subset a reader needs, fast enough that the
client, not the server, is what a benchmark measures.

    python -m bench.fasts3 --root DIR [--port 0] [--latency-ms 20] [--lifetime 3600]

moto (``bench/s3local.py``) answers a few hundred ranged GETs a second here and
stays for compatibility and fault tests; this server answers about ten thousand
on one core. It serves the files under ``--root`` as objects, path-style,
``http://127.0.0.1:PORT/BUCKET/KEY`` being ``ROOT/BUCKET/KEY``, and speaks:

- ``GET /BUCKET?list-type=2`` (ListObjectsV2: ``prefix``, ``max-keys``,
  ``continuation-token``/``start-after``; keys sorted, pages of at most 1,000);
- ``HEAD /BUCKET/KEY``: ``Content-Length``, ``ETag``, ``Last-Modified``;
- ``GET /BUCKET/KEY`` with or without ``Range: bytes=A-B`` (``206`` and
  ``Content-Range``), ``If-Match`` (``412`` when the ETag differs), ``404``
  ``NoSuchKey``/``NoSuchBucket`` as S3 words them.

Signatures are not checked. Every answer waits ``latency`` first (a timer, not a
sleeping task: the wait costs the server nothing), which ``POST /_latency?ms=N``
changes while it runs. It listens on 127.0.0.1 only, keeps at most
``MAX_CONNECTIONS`` connections, and exits by itself after ``--lifetime`` seconds.
HTTP/1.1 keep-alive, one request at a time per connection (as S3 clients send
them). Files are read with ``os.pread`` from descriptors kept open; the ETag is
derived from the file's size and modification time.

``FastS3Process`` runs it in a child process pinned to chosen cores, so that it
never competes with the process measured.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import importlib
import os
import signal
import subprocess
import sys
import time
import urllib.parse
from collections.abc import Sequence
from email.utils import formatdate
from html import escape
from pathlib import Path
from typing import Any, Self

MAX_CONNECTIONS = 4096
MAX_HEADER = 64 << 10
PAGE = 1000


def _etag(st: os.stat_result) -> str:
    h = hashlib.md5(f"{st.st_size}:{st.st_mtime_ns}".encode(), usedforsecurity=False)
    return f'"{h.hexdigest()}"'


class Objects:
    """The files under ``root`` as buckets and keys, with their descriptors kept open."""

    def __init__(self, root: Path) -> None:
        self.root = root.resolve()
        self._open: dict[str, tuple[int, int, str, str]] = {}  # path -> fd, size, etag, date

    def find(self, bucket: str, key: str) -> tuple[int, int, str, str] | None:
        path = str(self.root / bucket / key)
        got = self._open.get(path)
        if got is not None:
            return got
        if ".." in key.split("/") or not os.path.isfile(path):
            return None
        fd = os.open(path, os.O_RDONLY)
        st = os.fstat(fd)
        got = (fd, st.st_size, _etag(st), formatdate(st.st_mtime, usegmt=True))
        self._open[path] = got
        return got

    def bucket_exists(self, bucket: str) -> bool:
        return bool(bucket) and "/" not in bucket and (self.root / bucket).is_dir()

    def keys(self, bucket: str, prefix: str) -> list[tuple[str, os.stat_result]]:
        base = self.root / bucket
        found = []
        for dirpath, _dirs, files in os.walk(base):
            for name in files:
                p = Path(dirpath) / name
                key = str(p.relative_to(base))
                if key.startswith(prefix):
                    found.append((key, p.stat()))
        return sorted(found)


def _error(status: str, code: str, message: str, resource: str) -> tuple[str, list[str], bytes]:
    body = (
        f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code>'
        f"<Message>{escape(message)}</Message><Resource>{escape(resource)}</Resource></Error>"
    ).encode()
    return status, ["Content-Type: application/xml"], body


class Server:
    """The request handling, independent of the transport (for tests)."""

    def __init__(self, root: Path, latency: float = 0.0) -> None:
        self.objects = Objects(root)
        self.latency = latency
        self.requests = 0

    def handle(self, method: str, target: str, headers: dict[str, str]) -> tuple[Any, ...]:
        """``(status, extra headers, body, (fd, offset, length) or None, head_only)``."""
        self.requests += 1
        path, _, query = target.partition("?")
        path = urllib.parse.unquote(path)
        if method == "POST" and path == "/_latency":
            ms = float(urllib.parse.parse_qs(query).get("ms", ["0"])[0])
            self.latency = ms / 1000
            return "200 OK", [], b"", None, False
        bucket, _, key = path.lstrip("/").partition("/")
        if method not in ("GET", "HEAD"):
            return (*_error("501 Not Implemented", "NotImplemented", method, path), None, False)
        if not self.objects.bucket_exists(bucket):
            return (
                *_error("404 Not Found", "NoSuchBucket", "The bucket does not exist", bucket),
                None,
                method == "HEAD",
            )
        if not key:
            return (*self._list(bucket, urllib.parse.parse_qs(query)), None, False)
        obj = self.objects.find(bucket, key)
        if obj is None:
            return (
                *_error("404 Not Found", "NoSuchKey", "The key does not exist", path),
                None,
                method == "HEAD",
            )
        fd, size, etag, date = obj
        want = headers.get("if-match")
        if want is not None and want != "*" and want.strip() != etag:
            return (
                *_error("412 Precondition Failed", "PreconditionFailed", "If-Match", path),
                None,
                method == "HEAD",
            )
        extra = [f"ETag: {etag}", f"Last-Modified: {date}", "Accept-Ranges: bytes"]
        rng = headers.get("range")
        start, end = 0, size
        status = "200 OK"
        if rng is not None:
            parsed = _range(rng, size)
            if parsed is None:
                return (
                    *_error("416 Requested Range Not Satisfiable", "InvalidRange", rng, path),
                    None,
                    False,
                )
            start, end = parsed
            status = "206 Partial Content"
            extra.append(f"Content-Range: bytes {start}-{end - 1}/{size}")
        if method == "HEAD":
            return status, extra, b"", (fd, start, end - start), True
        return status, extra, b"", (fd, start, end - start), False

    def _list(self, bucket: str, q: dict[str, list[str]]) -> tuple[str, list[str], bytes]:
        prefix = q.get("prefix", [""])[0]
        limit = min(PAGE, int(q.get("max-keys", [str(PAGE)])[0]))
        after = q.get("continuation-token", q.get("start-after", [""]))[0]
        keys = [(k, st) for k, st in self.objects.keys(bucket, prefix) if k > after]
        page, more = keys[:limit], len(keys) > limit
        items = "".join(
            f"<Contents><Key>{escape(k)}</Key><LastModified>"
            f"{time.strftime('%Y-%m-%dT%H:%M:%S.000Z', time.gmtime(st.st_mtime))}"
            f"</LastModified><ETag>{escape(_etag(st))}</ETag><Size>{st.st_size}</Size>"
            f"<StorageClass>STANDARD</StorageClass></Contents>"
            for k, st in page
        )
        token = (
            f"<NextContinuationToken>{escape(page[-1][0])}</NextContinuationToken>" if more else ""
        )
        body = (
            f'<?xml version="1.0" encoding="UTF-8"?>\n<ListBucketResult xmlns='
            f'"http://s3.amazonaws.com/doc/2006-03-01/"><Name>{escape(bucket)}</Name>'
            f"<Prefix>{escape(prefix)}</Prefix><KeyCount>{len(page)}</KeyCount>"
            f"<MaxKeys>{limit}</MaxKeys><IsTruncated>{'true' if more else 'false'}"
            f"</IsTruncated>{token}{items}</ListBucketResult>"
        ).encode()
        return "200 OK", ["Content-Type: application/xml"], body


def _range(header: str, size: int) -> tuple[int, int] | None:
    """``bytes=A-B`` / ``bytes=A-`` / ``bytes=-N`` as ``[start, end)``, or None."""
    unit, _, spec = header.partition("=")
    if unit.strip() != "bytes" or "," in spec:
        return None
    a, _, b = spec.strip().partition("-")
    try:
        if not a:
            n = int(b)
            start, end = max(0, size - n), size
        else:
            start = int(a)
            end = min(size, int(b) + 1) if b else size
    except ValueError:
        return None
    if start >= size or start >= end:
        return None
    return start, end


class _Connection(asyncio.Protocol):
    def __init__(self, server: Server, live: set[_Connection]) -> None:
        self.server = server
        self.live = live
        self.buf = b""
        self.transport: asyncio.Transport | None = None
        self.loop = asyncio.get_running_loop()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # (uvloop's is no subclass)
        if len(self.live) >= MAX_CONNECTIONS:
            transport.close()
            return
        self.live.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.live.discard(self)
        self.transport = None

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while True:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                if len(self.buf) > MAX_HEADER and self.transport is not None:
                    self.transport.close()
                return
            head, self.buf = self.buf[:end].decode("latin-1"), self.buf[end + 4 :]
            lines = head.split("\r\n")
            try:
                method, target, _version = lines[0].split(" ", 2)
            except ValueError:
                if self.transport is not None:
                    self.transport.close()
                return
            headers = {}
            for line in lines[1:]:
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip()
            length = int(headers.get("content-length", "0") or 0)
            if length:  # a body (PUT): not served; skip it if it is all here
                self.buf = self.buf[length:]
            answer = self.server.handle(method, target, headers)
            if self.server.latency > 0:
                self.loop.call_later(self.server.latency, self._send, answer)
            else:
                self._send(answer)

    def _send(self, answer: tuple[Any, ...]) -> None:
        t = self.transport
        if t is None:
            return
        status, extra, body, span, head_only = answer
        if span is not None:
            fd, offset, length = span
            data = b"" if head_only else os.pread(fd, length, offset)
            n = length
        else:
            data, n = body, len(body)
        lines = [f"HTTP/1.1 {status}", f"Content-Length: {n}", "Connection: keep-alive", *extra]
        t.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"))
        if data and not head_only:
            t.write(data)


async def serve(root: Path, port: int, latency: float, lifetime: float) -> None:
    server = Server(root, latency)
    live: set[_Connection] = set()
    loop = asyncio.get_running_loop()
    srv = await loop.create_server(
        lambda: _Connection(server, live), "127.0.0.1", port, backlog=1024, reuse_address=True
    )
    sock_port = srv.sockets[0].getsockname()[1]
    print(f"fasts3 listening on http://127.0.0.1:{sock_port}", flush=True)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), timeout=lifetime)
    srv.close()
    for c in list(live):
        if c.transport is not None:
            c.transport.close()


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", required=True, help="the directory whose subdirectories are buckets")
    ap.add_argument("--port", type=int, default=0, help="0: any free port (printed)")
    ap.add_argument("--latency-ms", type=float, default=0.0, help="added to every answer")
    ap.add_argument("--lifetime", type=float, default=3600.0, help="exit after this many seconds")
    args = ap.parse_args(argv)
    with contextlib.suppress(ImportError):  # a faster loop where installed (no stub needed)
        importlib.import_module("uvloop").install()
    asyncio.run(serve(Path(args.root), args.port, args.latency_ms / 1000, args.lifetime))
    return 0


class FastS3Process:
    """The server in a child process (pinned to ``cores`` when given).

    ``endpoint`` is its URL; ``env()`` the environment an S3 client needs to use
    it (any keys: signatures are not checked); ``set_latency(ms)`` changes the
    added latency; ``stop()`` (or leaving the ``with`` block) ends it.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        cores: set[int] | None = None,
        latency_ms: float = 0.0,
        lifetime: float = 3600.0,
    ) -> None:
        cmd = [sys.executable, "-m", "bench.fasts3", "--root", os.fspath(root)]
        cmd += ["--latency-ms", str(latency_ms), "--lifetime", str(lifetime)]

        def pin() -> None:
            if cores:
                os.sched_setaffinity(0, cores)

        here = Path(__file__).resolve().parents[1]
        self.proc = subprocess.Popen(
            cmd, cwd=here, stdout=subprocess.PIPE, text=True, preexec_fn=pin
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if "listening on" not in line:
            self.proc.kill()
            raise RuntimeError(f"fasts3 did not start: {line!r}")
        self.endpoint = line.rsplit(" ", 1)[1].strip()

    def env(self) -> dict[str, str]:
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": "bench",
            "AWS_SECRET_ACCESS_KEY": "bench",
            "AWS_REGION": "us-east-1",
        }

    def set_latency(self, ms: float) -> None:
        import http.client

        host = urllib.parse.urlsplit(self.endpoint)
        conn = http.client.HTTPConnection(host.hostname or "127.0.0.1", host.port, timeout=5)
        try:
            conn.request("POST", f"/_latency?ms={ms}")
            conn.getresponse().read()
        finally:
            conn.close()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


if __name__ == "__main__":
    raise SystemExit(main())
