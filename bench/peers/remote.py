"""MosaicML streaming and litdata reading the same S3 server as tokload.

    .venv/bin/python bench/peers/remote.py [--tokens 20000000] [--seconds 5] [--latency-ms 20]

Run with the main venv's python (it needs boto3 and, for ``__main__``, moto):
``measure_remote_peers(endpoint, env, seconds, tokens)`` makes sure the peers'
venv (``bench/peers/run.py``'s ``install``) and a corpus of ``tokens`` tokens
in their formats (``bench/peers/corpus.py``: MDS shards of 4097-token windows,
litdata ``optimize`` chunks) exist, uploads them to ``s3://peers/mds`` and
``s3://peers/litdata`` on the server at ``endpoint``, then measures each peer in
a fresh process of the peers' venv (this file, ``child`` mode) with ``env`` in
its environment: shuffled batches of 8 windows of 4097 tokens, configured as
their docs recommend (docs/comparison.md) but with the S3 URL as the
remote and a fresh, empty local cache directory. Per peer: tokens/s for
``seconds`` after the first batch (within the first pass: a second pass would
read the local copy), the seconds from building the dataset to the first
batch, and the bytes in the local cache directory at the end (both download
whole shards to local disk before they read a window from them).

The pass is short on a small corpus (20M tokens: 80 MB, fetched in about a
second): then ``pass_ended`` is true, ``tokens_per_s`` covers less than
``seconds`` and ``pass_tokens_per_s`` gives the whole pass, downloads included.
A steady-state figure needs ``tokens`` above ``seconds`` times the rate (200M
tokens for 5 s).

Two adjustments, both for the plain-http local server (real S3 is https):
litdata's obstore store is allowed http (its fixed client options lack
``allow_http``), and MosaicML streaming's boto3 client, made in the parent for
index.json, is dropped before the DataLoader forks (its workers would share one
keep-alive connection and stall 60 s on a mixed-up response).

``__main__`` starts ``bench.s3local.LocalS3`` with 20 ms per request and
prints the rows as JSON.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
WINDOW, BATCH, SEED = 4097, 8, 1234
BUCKET = "peers"
PEERS = {"mosaic": "MosaicML streaming", "litdata": "litdata"}
PREFIXES = {"mosaic": "mds", "litdata": "litdata"}


# --------------------------------------------------------------------------- parent side
# (main venv: boto3; imports of bench.* stay inside functions, so the child mode
# below runs in the peers' venv, where neither tokload nor bench's deps exist)


def _run_module() -> Any:
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from bench.peers import run

    return run


def ensure_venv() -> str | None:
    """Create the peers' venv with run.py's ``install`` unless it exists; None, or why not.

    tokload itself is not installed there (``install`` would rebuild it from this
    checkout, a C compile): the remote comparison runs only the peers in it.
    """
    run = _run_module()
    if run.PY.exists() and _peers_importable(run.PY):
        return None
    original = run.pip

    def pip_without_tokload(*args: str) -> None:
        if str(run.ROOT) not in args:
            original(*args)

    run.pip = pip_without_tokload
    try:
        run.install()
    except Exception as e:
        return f"creating the peers' venv failed: {_one_line(str(e))}"
    finally:
        run.pip = original
    if not _peers_importable(run.PY):
        return "the peers' venv has no streaming or litdata after install"
    return None


def _peers_importable(py: Path) -> bool:
    res = subprocess.run(
        [
            str(py),
            "-c",
            "import importlib.util as u; "
            "assert u.find_spec('streaming') and u.find_spec('litdata')",
        ],
        capture_output=True,
        text=True,
    )
    return res.returncode == 0


def ensure_corpus(tokens: int) -> Path:
    """A corpus of ``tokens`` tokens with the MDS and litdata formats; its directory.

    run.py's own corpus (``bench/peers/.corpus``) when it has these formats at this
    size, else one built by corpus.py with only these formats in
    ``.corpus/remote-TOKENS`` (inside run.py's directory so git ignores it, and
    beside its files so run.py's checks of its own corpus are unaffected).
    """
    run = _run_module()
    for d in (run.CORPUS, run.CORPUS / f"remote-{tokens}"):
        info = d / "corpus.json"
        if info.exists():
            got = json.loads(info.read_text())
            if got["tokens"] == tokens and {"mds", "litdata"} <= set(got["formats"]):
                return Path(d)
    out = Path(run.CORPUS / f"remote-{tokens}")
    shutil.rmtree(out, ignore_errors=True)
    res = run.sh(
        str(run.PY),
        str(HERE / "corpus.py"),
        str(out),
        "--tokens",
        str(tokens),
        "--formats",
        "mds,litdata",
    )
    if res.returncode:
        raise RuntimeError(f"building the corpus failed: {_one_line(res.stderr)}")
    return out


def upload(corpus: Path, endpoint: str, env: dict[str, str]) -> dict[str, int]:
    """Upload the MDS and litdata directories to s3://peers/{mds,litdata}; bytes per prefix.

    Objects already there with the same size are not sent again.
    """
    import boto3

    client = boto3.client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id=env.get("AWS_ACCESS_KEY_ID", "testing"),
        aws_secret_access_key=env.get("AWS_SECRET_ACCESS_KEY", "testing"),
        region_name=env.get("AWS_REGION", env.get("AWS_DEFAULT_REGION", "us-east-1")),
    )
    existing = {b["Name"] for b in client.list_buckets().get("Buckets", [])}
    if BUCKET not in existing:
        client.create_bucket(Bucket=BUCKET)
    sizes: dict[str, int] = {}
    for local, prefix in ((corpus / "mds", "mds"), (corpus / "litdata", "litdata")):
        there: dict[str, int] = {}
        for page in client.get_paginator("list_objects_v2").paginate(
            Bucket=BUCKET, Prefix=prefix + "/"
        ):
            there.update({o["Key"]: o["Size"] for o in page.get("Contents", [])})
        total = 0
        for p in sorted(local.rglob("*")):
            if not p.is_file() or p.name.endswith(".lock"):
                continue
            key = f"{prefix}/{p.relative_to(local).as_posix()}"
            size = p.stat().st_size
            if there.get(key) != size:
                client.upload_file(str(p), BUCKET, key)
            total += size
        sizes[prefix] = total
    return sizes


def run_peer(
    peer: str, env: dict[str, str], seconds: float, workers: int, timeout: float | None = None
) -> dict[str, Any]:
    """One peer in a fresh process of the peers' venv; its row.

    ``timeout``: default 180 s more than ``seconds`` (litdata waits about 120 s for a chunk
    that cannot be fetched before it gives up; streaming retries a stalled shard after 60 s).
    """
    timeout = seconds + 180 if timeout is None else timeout
    run = _run_module()
    label = PEERS[peer]
    scratch = Path(tempfile.mkdtemp(prefix=f"peers-remote-{peer}-"))
    cache, tmp = scratch / "cache", scratch / "tmp"
    cache.mkdir()
    tmp.mkdir()
    child_env = {
        **os.environ,
        **env,
        "TMPDIR": str(tmp),
        "PYTHONUNBUFFERED": "1",
        "OMP_NUM_THREADS": "1",
    }
    # MosaicML streaming's S3 downloader passes S3_ENDPOINT_URL to boto3 as endpoint_url
    # (streaming/base/storage/download.py); litdata's S3Client and its obstore store take
    # the endpoint from boto3, which reads AWS_ENDPOINT_URL.
    child_env["S3_ENDPOINT_URL"] = child_env["AWS_ENDPOINT_URL"]
    cmd = [
        str(run.PY),
        str(Path(__file__).resolve()),
        "child",
        peer,
        f"s3://{BUCKET}/{PREFIXES[peer]}",
        str(cache),
        str(seconds),
        str(workers),
    ]
    # its own process group, so a child that hangs goes with its DataLoader workers
    proc = subprocess.Popen(
        cmd,
        env=child_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return {"label": label, "workers": workers, "error": f"no result in {timeout:.0f} s"}
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    lines = [ln for ln in stdout.splitlines() if ln.startswith("{")]
    if proc.returncode or not lines:
        return {"label": label, "workers": workers, "error": _last_error(stderr)}
    row: dict[str, Any] = {"label": label, **json.loads(lines[-1])}
    return row


def measure_remote_peers(
    endpoint: str,
    env: dict[str, str],
    seconds: float,
    tokens: int,
    workers: int = 2,
) -> list[dict[str, Any]]:
    """MosaicML streaming and litdata reading shuffled windows from the S3 server at ``endpoint``.

    ``env``: the variables that point a client at it (``LocalS3.env()``: AWS_ENDPOINT_URL,
    keys, region). One row per peer: ``label``, ``tokens_per_s``, ``first_batch_s`` (from
    building the dataset to the first batch; ``process_to_first_batch_s`` includes the
    imports), ``local_cache_bytes`` (the local cache directory at the end; ``..._peak_bytes``
    the most seen), ``workers`` (DataLoader worker processes), ``version``, ``pass_ended``
    (the first pass ended within ``seconds``; then ``pass_tokens_per_s``, the whole pass from
    building the dataset); or ``label`` and ``error`` (one line) when it could not run.
    Creating the peers' venv takes minutes the first time, a 200M-token corpus about one.
    """
    env = {**env, "AWS_ENDPOINT_URL": endpoint}
    why = ensure_venv()
    if why is None:
        try:
            corpus = ensure_corpus(tokens)
            upload(corpus, endpoint, env)
        except Exception as e:
            why = _one_line(f"{type(e).__name__}: {e}")
    if why is not None:
        return [{"label": label, "error": why} for label in PEERS.values()]
    return [run_peer(peer, env, seconds, workers) for peer in PEERS]


def _one_line(text: str, limit: int = 300) -> str:
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return (lines[-1] if lines else "no output")[:limit]


def _last_error(stderr: str) -> str:
    """The last exception line of a traceback (``SomeError: ...``), else the last line."""
    lines = [ln.strip() for ln in stderr.strip().splitlines() if ln.strip()]
    for ln in reversed(lines):
        head = ln.split(":", 1)[0]
        if ln[:1].isalpha() and " " not in head and head.endswith(("Error", "Exception", "Exit")):
            return ln[:300]
    return _one_line(stderr)


# --------------------------------------------------------------------------- child side
# (peers' venv, a fresh process per peer)


def _dir_bytes(path: str) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            with contextlib.suppress(OSError):  # a temporary file renamed meanwhile
                total += os.path.getsize(os.path.join(root, f))
    return total


def child(peer: str, remote: str, cache: str, seconds: float, workers: int) -> None:
    t_start = time.perf_counter()
    import threading

    import numpy as np
    import torch

    loader: Any
    if peer == "mosaic":
        sys.path.insert(0, str(HERE))
        import torchvision_stub

        torchvision_stub.install()
        import streaming
        from streaming import StreamingDataset
        from streaming.base.util import clean_stale_shared_memory

        version = streaming.__version__
        clean_stale_shared_memory()

        class Tokens(StreamingDataset):  # type: ignore[misc]
            def __getitem__(self, i: int) -> Any:
                raw = super().__getitem__(i)["tokens"]
                return torch.from_numpy(np.frombuffer(raw, dtype=np.int32).copy())

        t_build = time.perf_counter()
        ds = Tokens(remote=remote, local=cache, shuffle=True, shuffle_seed=SEED, batch_size=BATCH)
        # The dataset fetched index.json with a boto3 client whose pooled keep-alive
        # connection every forked DataLoader worker would inherit and use at once: over
        # plain http their responses interleave and a shard download stalls for its read
        # timeout (60 s) before a retry (streaming 0.13.0; seen here as a 62 s first batch
        # with 2 workers). Drop it so each process opens its own.
        for stream in ds.streams:
            if hasattr(stream._downloader, "_s3_client"):
                stream._downloader._s3_client = None
        loader = torch.utils.data.DataLoader(ds, batch_size=BATCH, num_workers=workers)
        windows = len(ds)
    elif peer == "litdata":
        import litdata
        import litdata.streaming.downloader as downloader
        from litdata import StreamingDataLoader, StreamingDataset, TokensLoader

        version = litdata.__version__
        endpoint = os.environ.get("AWS_ENDPOINT_URL", "")
        if endpoint.startswith("http://"):
            # litdata fetches chunks with obstore, whose client options it fixes
            # (_OBSTORE_CLIENT_OPTIONS) without allow_http: against a plain-http endpoint
            # every GET fails ("BadScheme"). Real S3 is https; allow http here, as a user of
            # a local MinIO would have to, and keep litdata's own (obstore) download path.
            downloader._OBSTORE_CLIENT_OPTIONS = {
                **downloader._OBSTORE_CLIENT_OPTIONS,
                "allow_http": True,
            }
        t_build = time.perf_counter()
        lds = StreamingDataset(
            remote,
            item_loader=TokensLoader(block_size=WINDOW),
            shuffle=True,
            drop_last=True,
            seed=SEED,
            cache_dir=cache,
        )
        loader = StreamingDataLoader(lds, batch_size=BATCH, num_workers=workers)
        windows = len(lds)
    else:
        raise SystemExit(f"unknown peer {peer}")

    peak = [0]
    stop = threading.Event()

    def watch() -> None:  # the cache's largest size (chunks may be evicted)
        while not stop.wait(0.1):
            peak[0] = max(peak[0], _dir_bytes(cache))

    threading.Thread(target=watch, daemon=True).start()
    it = iter(loader)
    first = next(it)
    t_first = time.perf_counter()
    assert tuple(first.shape) == (BATCH, WINDOW), first.shape
    n, done = 0, False
    while time.perf_counter() - t_first < seconds:
        try:
            next(it)
        except StopIteration:
            done = True
            break
        n += 1
    t_end = time.perf_counter()
    elapsed = t_end - t_first
    stop.set()
    end_bytes = _dir_bytes(cache)
    out = {
        "version": version,
        "workers": workers,
        "tokens_per_s": n * BATCH * WINDOW / elapsed,
        "first_batch_s": t_first - t_build,
        "process_to_first_batch_s": t_first - t_start,
        "local_cache_bytes": end_bytes,
        "local_cache_peak_bytes": max(peak[0], end_bytes),
        "batches": n + 1,
        "windows_in_pass": windows,
        "pass_ended": done,
        "seconds": elapsed,
    }
    if done:  # the whole pass, downloads included, from building the dataset
        out["pass_tokens_per_s"] = (n + 1) * BATCH * WINDOW / (t_end - t_build)
    print(json.dumps(out), flush=True)
    os._exit(0)  # do not wait for the workers' teardown


# --------------------------------------------------------------------------- main


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=20_000_000)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--latency-ms", type=float, default=20.0)
    ap.add_argument("--workers", type=int, default=2)
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from bench.s3local import LocalS3

    s3 = LocalS3().start()
    try:
        assert s3.proxy is not None
        s3.proxy.latency = args.latency_ms / 1e3
        rows = measure_remote_peers(
            s3.endpoint, s3.env(), args.seconds, args.tokens, workers=args.workers
        )
    finally:
        s3.stop()
    print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "child":
        _, _, peer_, remote_, cache_, seconds_, workers_ = sys.argv
        child(peer_, remote_, cache_, float(seconds_), int(workers_))
    else:
        main()
