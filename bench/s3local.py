"""A local S3 server for tests and benchmarks, with latency and faults injected.

``LocalS3`` starts moto's S3 server (``moto[server]``) on 127.0.0.1 and, in
front of it, ``FaultProxy``: an HTTP/1.1 proxy that delays every request (the
round trip of an object store across a region), answers chosen requests with
503 SlowDown or 429, drops their connection, or truncates their body, and counts
what it saw.  Nothing leaves the machine.

    with LocalS3() as s3:
        s3.create_bucket("data")
        os.environ.update(s3.env())   # AWS_ENDPOINT_URL=http://127.0.0.1:PORT, keys
        s3.proxy.latency = 0.020
        s3.proxy.inject("503", times=2, match="GET")
"""

from __future__ import annotations

import http.client
import logging
import socket
import threading
import time
from collections import Counter
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Self

_HOP = {
    "connection",
    "keep-alive",
    "transfer-encoding",
    "proxy-connection",
    "te",
    "upgrade",
    "content-length",
}

SLOWDOWN = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate.</Message></Error>"
)
ACCESS_DENIED = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>AccessDenied</Code>'
    b"<Message>Access Denied</Message></Error>"
)


@dataclass
class Fault:
    kind: str  # "503", "429", "500", "403", "drop", "truncate", "short", "norange", "delay",
    # "stall"
    times: int  # how many matching requests it applies to (-1: all)
    match: str  # "GET", "PUT", "HEAD", ... or "" for any; and an optional " key-substring"
    seconds: float = 0.0  # for "delay" and "stall"

    def matches(self, method: str, path: str) -> bool:
        want_method, _, want_key = self.match.partition(" ")
        return (not want_method or method == want_method) and (not want_key or want_key in path)


class FaultProxy(ThreadingHTTPServer):
    """Forwards HTTP/1.1 requests to ``upstream`` (host, port), one thread per
    client connection, with ``latency`` seconds added to each request and the
    faults of ``inject`` applied in order."""

    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 1024

    def __init__(self, upstream: tuple[str, int]) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.upstream = upstream
        self.latency = 0.0
        self.seen: Counter[str] = Counter()
        self.faults_done: Counter[str] = Counter()
        self._faults: list[Fault] = []
        self._lock = threading.Lock()
        self.in_flight = 0
        self.max_in_flight = 0

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host!s}:{port}"

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that went away mid-answer (a loader closed, a probe ended) is no error."""
        import sys

        if isinstance(sys.exc_info()[1], (BrokenPipeError, ConnectionResetError)):
            return
        super().handle_error(request, client_address)

    def inject(self, kind: str, times: int = 1, match: str = "GET", seconds: float = 0.0) -> None:
        """Apply ``kind`` to the next ``times`` requests that match (method and,
        after a space, a substring of the path): ``"503"`` (SlowDown), ``"429"``,
        ``"500"``, ``"403"`` (AccessDenied), ``"drop"`` (close the connection
        without an answer), ``"truncate"`` (promise the whole body, send half,
        then close), ``"short"`` (a complete answer of half the body: a server
        that returns fewer bytes than asked), ``"norange"`` (the request is sent on
        without its ``Range``: ``200`` and the whole object, as a server or proxy that
        ignores ranges answers), ``"delay"`` (wait ``seconds`` more) or ``"stall"`` (send
        the headers and half the body, wait ``seconds``, then the rest)."""
        with self._lock:
            self._faults.append(Fault(kind, times, match, seconds))

    def clear(self) -> None:
        with self._lock:
            self._faults.clear()
            self.seen.clear()
            self.faults_done.clear()
            self.latency = 0.0

    def _take_fault(self, method: str, path: str) -> Fault | None:
        with self._lock:
            self.seen[method] += 1
            for f in self._faults:
                if f.times != 0 and f.matches(method, path):
                    if f.times > 0:
                        f.times -= 1
                    self.faults_done[f.kind] += 1
                    return f
        return None


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: FaultProxy
    _conn: http.client.HTTPConnection | None = None  # to moto, kept per client connection
    _head_length = "0"

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _control(self) -> None:
        """``/__proxy__/latency/MS`` sets the latency (for a proxy in another process)."""
        parts = self.path.strip("/").split("/")
        if len(parts) == 3 and parts[1] == "latency":
            self.server.latency = float(parts[2]) / 1e3
            self._answer(200, b"ok")
        else:
            self._answer(404, b"unknown control path")

    def _forward(self) -> None:
        srv = self.server
        if self.path.startswith("/__proxy__/"):
            self._control()
            return
        body = b""
        n = int(self.headers.get("Content-Length") or 0)
        if n:
            body = self.rfile.read(n)
        elif self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            body = self._read_chunked()
        fault = srv._take_fault(self.command, self.path)
        with srv._lock:
            srv.in_flight += 1
            srv.max_in_flight = max(srv.max_in_flight, srv.in_flight)
        counted = True

        def answered() -> None:
            # before the answer's last bytes go out: the client may send its next
            # request as soon as it has them, before this thread runs again
            nonlocal counted
            if counted:
                counted = False
                with srv._lock:
                    srv.in_flight -= 1

        try:
            delay = srv.latency + (fault.seconds if fault and fault.kind == "delay" else 0.0)
            if delay:
                time.sleep(delay)
            if fault and fault.kind in ("503", "429", "500"):
                self._answer(int(fault.kind), SLOWDOWN)
                return
            if fault and fault.kind == "403":
                self._answer(403, ACCESS_DENIED)
                return
            if fault and fault.kind == "drop":
                self.close_connection = True
                self.connection.shutdown(socket.SHUT_RDWR)
                return
            status, headers, data = self._upstream(
                body, ranged=not (fault and fault.kind == "norange")
            )
            if fault and fault.kind in ("truncate", "stall") and len(data) > 1:
                # the whole body promised, half of it sent; then the connection closed,
                # or, after a pause, the rest
                self.send_response(status)
                for k, v in headers:
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data[: len(data) // 2])
                self.wfile.flush()
                if fault.kind == "truncate":
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                time.sleep(fault.seconds)
                answered()
                self.wfile.write(data[len(data) // 2 :])
                return
            if fault and fault.kind == "short":
                data = data[: len(data) // 2]
            self.send_response(status)
            for k, v in headers:
                self.send_header(k, v)
            head = self.command == "HEAD"  # the object's length, and no body
            self.send_header("Content-Length", self._head_length if head else str(len(data)))
            answered()
            self.end_headers()
            if not head:
                self.wfile.write(data)
        finally:
            answered()

    def _read_chunked(self) -> bytes:
        out = bytearray()
        while True:
            size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
            if size == 0:
                self.rfile.readline()
                return bytes(out)
            out += self.rfile.read(size)
            self.rfile.readline()

    def _upstream(
        self, body: bytes, ranged: bool = True
    ) -> tuple[int, list[tuple[str, str]], bytes]:
        conn = self._conn
        for attempt in range(2):
            if conn is None:
                conn = http.client.HTTPConnection(*self.server.upstream, timeout=60)
                self._conn = conn
            headers = {
                k: v
                for k, v in self.headers.items()
                if k.lower() not in _HOP and (ranged or k.lower() != "range")
            }
            headers["Content-Length"] = str(len(body))
            try:
                conn.request(self.command, self.path, body=body, headers=headers)
                r = conn.getresponse()
                data = r.read()
                out = [(k, v) for k, v in r.getheaders() if k.lower() not in _HOP]
                self._head_length = r.getheader("Content-Length", "0")
                return r.status, out, data
            except (http.client.HTTPException, OSError):
                conn.close()
                conn = None
                self._conn = None
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def _answer(self, status: int, data: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _forward


class _Clients:
    """What a local server gives its clients, from its ``endpoint`` (the proxy)
    and ``direct`` (moto itself) URLs."""

    @property
    def endpoint(self) -> str:
        """The proxy's URL: what clients should talk to."""
        raise NotImplementedError

    @property
    def direct(self) -> str:
        """moto's own URL (no latency, no faults)."""
        raise NotImplementedError

    def env(self) -> dict[str, str]:
        """The standard AWS variables that point a client at the proxy."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_REGION": "us-east-1",
            "AWS_DEFAULT_REGION": "us-east-1",
        }

    def client(self) -> Any:
        """A boto3 client of the server itself (set-up and checks, no faults)."""
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.direct,
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
            region_name="us-east-1",
        )

    def create_bucket(self, name: str) -> None:
        self.client().create_bucket(Bucket=name)

    def upload_dir(self, local: str, bucket: str, prefix: str) -> None:
        """Upload every file under ``local`` to ``s3://bucket/prefix/...``."""
        import os

        c = self.client()
        for root, _, files in os.walk(local):
            for f in files:
                p = os.path.join(root, f)
                key = f"{prefix}/{os.path.relpath(p, local)}".lstrip("/")
                c.upload_file(p, bucket, key)


class LocalS3(_Clients):
    """moto's S3 server on 127.0.0.1 behind a ``FaultProxy`` (``proxy``)."""

    def __init__(self) -> None:
        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.ERROR)
        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self.proxy: FaultProxy | None = None

    def start(self) -> Self:
        self.server.start()
        self.proxy = FaultProxy(self.server.get_host_and_port())
        threading.Thread(target=self.proxy.serve_forever, name="s3-proxy", daemon=True).start()
        return self

    def stop(self) -> None:
        if self.proxy is not None:
            self.proxy.shutdown()
            self.proxy.server_close()
        self.server.stop()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def endpoint(self) -> str:
        assert self.proxy is not None
        return self.proxy.url

    @property
    def direct(self) -> str:
        host, port = self.server.get_host_and_port()
        return f"http://{host}:{port}"


class LocalS3Process(_Clients):
    """A LocalS3 in a child process (``python -m bench.s3local``), for benchmarks:
    its Python threads (moto, the proxy) must not share the GIL of the process
    measured. The latency is set through the proxy's control path."""

    def __init__(self) -> None:
        import subprocess
        import sys
        from pathlib import Path

        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bench.s3local"],
            cwd=Path(__file__).resolve().parents[1],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        self._endpoint, self._direct = self.proc.stdout.readline().split()

    @property
    def endpoint(self) -> str:
        return self._endpoint

    @property
    def direct(self) -> str:
        return self._direct

    def set_latency(self, ms: float) -> None:
        import urllib.request

        urllib.request.urlopen(f"{self.endpoint}/__proxy__/latency/{ms}").read()

    def stop(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(30)


def serve() -> None:
    """``python -m bench.s3local``: a LocalS3 in its own process (so its Python
    threads do not share the measured process's GIL). Prints ``ENDPOINT DIRECT``
    on one line, then serves until stdin closes."""
    import sys

    with LocalS3() as s3:
        print(s3.endpoint, s3.direct, flush=True)
        sys.stdin.read()


if __name__ == "__main__":
    serve()
