"""Object-store URLs (``s3://``, ``gs://``, ``az://``): the policy of the I/O engine's
remote backend.

A dataset whose path is a URL is opened here (its manifest or index headers are
fetched, its objects listed with their sizes and ETags) and read through the
same I/O engine as local files, in two phases: the engine plans each batch's
read requests (object, offset, length, destination) in C and its reader thread
hands them over (``tokload/_remote.pyx``) and waits without the GIL; this
module's event loop thread fetches them (``tokload.remote_fetch``) and has
their bytes copied into the batch buffers without the GIL.  Requests for
nearby bytes of one object are merged; the process keeps as many GETs in flight,
for all its readers together, as cover the store's latency at the rate the reads
go (from the latency the GETs show); what a retry can help is retried; and every
answer is checked:

- every GET names the ETag the object had when the dataset was opened
  (``If-Match``): an object replaced since then is refused
  (``ObjectChangedError``), never mixed with the old one;
- a body shorter than the range asked for is retried, then refused;
- throttling (HTTP 429, 503 SlowDown), server errors (500, 502, 504), timeouts
  and dropped or refused connections are retried with exponential backoff and
  full jitter, at most ``retries`` times and ``retry_seconds`` seconds per
  range; then ``RemoteError`` names the URL, the byte range and the cause;
- no credentials, access denied (``RemoteAccessError``) and a missing bucket
  or object (``MissingShardError``) fail at once, in one line.

The client is obstore (Rust ``object_store``): one library for S3 and
S3-compatible stores, GCS and Azure, with credentials from the standard
environment (``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``,
``AWS_SESSION_TOKEN``, ``AWS_REGION``/``AWS_DEFAULT_REGION``, ``AWS_ENDPOINT_URL``;
``GOOGLE_APPLICATION_CREDENTIALS``; ``AZURE_STORAGE_ACCOUNT_NAME``, ...), web
identity and instance metadata, and bodies handed over without a copy; the AWS
CLI's profiles (SSO, ``credential_process``) come from boto3's session as a
credential provider (``_aws_credentials``).  Both are the optional extra
``tokload[cloud]``.  A plain ``http://`` endpoint (a local or
on-premises S3-compatible server) is allowed.

``storage_options`` (a dict, on every view, ``open_source``, ``tokload.build``)
overrides the environment: the store's own keys (``endpoint``, ``region``,
``access_key_id``, ``secret_access_key``, ``session_token``,
``skip_signature``, ... as obstore names them for the scheme) and these of
tokload's: ``retries`` (default 10), ``retry_seconds`` (120), ``timeout`` (one
request, seconds, 30), ``connect_timeout`` (seconds, 5) and ``merge_gap``
(bytes between two requested ranges of one object up to which they are read as
one GET, 1048576: as object_store's own ``get_ranges``; a store's first byte
takes far longer than a mebibyte's transfer).
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import os
import random
import re
import sys
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from tokload import _remote
from tokload.errors import (
    FormatError,
    MissingShardError,
    ObjectChangedError,
    RangesIgnoredError,
    RemoteAccessError,
    RemoteError,
)

SCHEMES = ("s3", "gs", "az", "abfs", "abfss")
"""The URL schemes read from an object store (``file://`` is a local path)."""

log = logging.getLogger("tokload.remote")

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
_STATUS = re.compile(r"status code: (\d{3})")
_RETRY_STATUS = frozenset({408, 429, 500, 502, 503, 504})
_TRANSPORT = re.compile(
    r"kind: (Connect|Timeout|Request|Body|Decode|Interrupted)|error sending request"
    r"|connection (reset|closed)|IncompleteMessage|operation timed out",
    re.I,
)
MAX_MERGED = 16 << 20
"""The largest range one GET reads when it merges requests."""


def scheme_of(path: object) -> str | None:
    """The lower-case scheme of a URL string (``None`` for a path)."""
    if not isinstance(path, str):
        return None
    m = _SCHEME.match(path)
    return m.group(1).lower() if m else None


def is_url(path: object) -> bool:
    """Whether ``path`` names an object in an object store (``s3://``, ``gs://``,
    ``az://``, ``abfs[s]://``).  ``file://`` URLs and paths are local.

    Raises:
        ValueError: another scheme (``http://`` and the like are not datasets).
    """
    scheme = scheme_of(path)
    if scheme is None or scheme == "file":
        return False
    if scheme not in SCHEMES:
        raise ValueError(
            f"{path}: unsupported URL scheme {scheme!r}; tokload reads "
            f"{', '.join(s + '://' for s in SCHEMES)}, file:// and local paths"
        )
    return True


def local_path(path: str | os.PathLike[str]) -> str:
    """A local path, with a ``file://`` prefix removed."""
    p = os.fspath(path)
    return p[len("file://") :] if p.startswith("file://") else p


def join(url: str, name: str) -> str:
    """``url/name`` (one slash between)."""
    return url.rstrip("/") + "/" + name


def split_url(url: str) -> tuple[str, str, str]:
    """``(scheme, bucket, key)`` of ``scheme://bucket/key``."""
    scheme = scheme_of(url)
    if scheme is None:
        raise ValueError(f"{url}: not a URL")
    rest = url[len(scheme) + 3 :]
    bucket, _, key = rest.partition("/")
    if not bucket:
        raise ValueError(f"{url}: no bucket in the URL")
    return scheme, bucket, key


@dataclass(frozen=True)
class Settings:
    """tokload's own ``storage_options`` (see the module's docstring)."""

    retries: int = 10
    retry_seconds: float = 120.0
    timeout: float = 30.0
    connect_timeout: float = 5.0
    merge_gap: int = 1 << 20
    backoff: float = 0.1
    max_backoff: float = 10.0

    def delay(self, attempt: int) -> float:
        """Full-jitter exponential backoff before retry ``attempt`` (1, 2, ...)."""
        cap = min(self.max_backoff, self.backoff * (2 ** (attempt - 1)))
        return random.uniform(0.0, cap)


_OWN = {
    "retries": int,
    "retry_seconds": float,
    "timeout": float,
    "connect_timeout": float,
    "merge_gap": int,
}


def _split_options(options: Mapping[str, Any] | None) -> tuple[Settings, dict[str, Any]]:
    own: dict[str, Any] = {}
    store: dict[str, Any] = {}
    for k, v in (options or {}).items():
        if k in _OWN:
            try:
                own[k] = _OWN[k](v)
            except (TypeError, ValueError):
                raise ValueError(f"storage_options[{k!r}]={v!r}: expected a number") from None
            if own[k] < 0:
                raise ValueError(f"storage_options[{k!r}]={v!r}: expected a number >= 0")
        else:
            store[k] = v
    return Settings(**own), store


def _obstore() -> Any:
    try:
        import obstore
        import obstore.store
    except ImportError:
        raise ImportError(
            "reading s3://, gs:// or az:// URLs needs obstore: pip install 'tokload[cloud]'"
        ) from None
    return obstore


class Store:
    """One bucket (or container) and the options it was opened with."""

    def __init__(self, scheme: str, bucket: str, options: Mapping[str, Any] | None) -> None:
        obs = _obstore()
        self.scheme, self.bucket = scheme, bucket
        self.settings, config = _split_options(options)
        endpoint = str(
            config.get("endpoint")
            or config.get("aws_endpoint")
            or config.get("endpoint_url")
            or (os.environ.get("AWS_ENDPOINT_URL_S3") if scheme == "s3" else None)
            or (os.environ.get("AWS_ENDPOINT_URL") if scheme == "s3" else None)
            or ""
        )
        if "endpoint_url" in config:
            config["endpoint"] = config.pop("endpoint_url")
        if (
            scheme == "s3"
            and endpoint
            and "endpoint" not in config
            and "aws_endpoint" not in config
        ):
            config["endpoint"] = endpoint
        client = {
            "timeout": f"{self.settings.timeout}s",
            "connect_timeout": f"{self.settings.connect_timeout}s",
        }
        if endpoint.startswith("http://"):
            client["allow_http"] = True  # type: ignore[assignment]
        provider = None
        if scheme == "s3":
            provider, self.credentials = _aws_credentials(config)
        else:
            self.credentials = "the client's default chain for " + scheme
        log.debug("%s://%s: credentials from %s", scheme, bucket, self.credentials)
        try:
            # tokload retries itself (counted, and with the error it names):
            # obstore's own retries are off.
            self.store = obs.store.from_url(
                f"{scheme}://{bucket}",
                config=config,
                client_options=client,
                retry_config={"max_retries": 0},
                credential_provider=provider,
            )
        except Exception as e:  # an unknown option, a malformed endpoint
            raise ValueError(f"{scheme}://{bucket}: storage_options: {_first_line(e)}") from None

    def url(self, key: str) -> str:
        return f"{self.scheme}://{self.bucket}/{key}"


_KEY_OPTIONS = ("access_key_id", "aws_access_key_id", "secret_access_key", "aws_secret_access_key")


def _aws_credentials(config: dict[str, Any]) -> tuple[Any, str]:
    """Where an S3 store's credentials come from: ``(credential provider or None, source)``.

    object_store's own chain reads keys from ``storage_options`` and the
    environment, web identity (``AWS_WEB_IDENTITY_TOKEN_FILE``), ECS task roles
    and the instance metadata service. It does not read the AWS CLI's files:
    where none of the first three is there and a profile is (``AWS_PROFILE``,
    ``~/.aws/config`` or ``~/.aws/credentials``), boto3's session provides the
    credentials (profiles, SSO, ``credential_process``, assumed roles; refreshed
    as they expire), and the profile's region is used unless one is set.
    """
    if config.get("skip_signature") in (True, "true", "True"):
        return None, "nowhere (skip_signature: unsigned requests)"
    if any(k in config for k in _KEY_OPTIONS):
        return None, "storage_options (access_key_id)"
    env = os.environ
    if env.get("AWS_ACCESS_KEY_ID"):
        return None, "the environment (AWS_ACCESS_KEY_ID)"
    if env.get("AWS_WEB_IDENTITY_TOKEN_FILE"):
        return None, "web identity (AWS_WEB_IDENTITY_TOKEN_FILE)"
    if env.get("AWS_CONTAINER_CREDENTIALS_RELATIVE_URI") or env.get(
        "AWS_CONTAINER_CREDENTIALS_FULL_URI"
    ):
        return None, "the container's task role (AWS_CONTAINER_CREDENTIALS_*)"
    home = os.path.expanduser("~")
    files = [
        env.get("AWS_CONFIG_FILE", os.path.join(home, ".aws", "config")),
        env.get("AWS_SHARED_CREDENTIALS_FILE", os.path.join(home, ".aws", "credentials")),
    ]
    profile = env.get("AWS_PROFILE") or env.get("AWS_DEFAULT_PROFILE")
    if profile or any(os.path.isfile(f) for f in files):
        try:
            import boto3
            from obstore.auth.boto3 import Boto3CredentialProvider
        except ImportError:
            return None, (
                "the instance metadata service (an AWS profile is configured, but reading "
                "it needs boto3: pip install 'tokload[cloud]')"
            )
        name = profile or "default"
        try:
            session = boto3.Session(profile_name=profile) if profile else boto3.Session()
            found = session.get_credentials() is not None
        except Exception as e:  # botocore's: an unknown profile, a broken file, SSO expired
            raise RemoteAccessError(
                f"the AWS profile {name!r} cannot give credentials ({_first_line(e)}); "
                f"files read: {', '.join(files)}"
            ) from None
        if found:
            no_region = not (config.get("region") or config.get("aws_region")) and not (
                env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION")
            )
            if no_region and session.region_name:
                config["region"] = session.region_name
            return Boto3CredentialProvider(session), (
                f"the AWS profile {name!r} (boto3: {', '.join(files)}; SSO and "
                "credential_process included)"
            )
    return None, "the instance metadata service (no keys, web identity, task role or profile)"


_ENV_PREFIXES = ("AWS_", "GOOGLE_", "AZURE_", "OBJECT_STORE_")
_stores: dict[tuple[Any, ...], Store] = {}
_stores_lock = threading.Lock()


def store_for(url: str, options: Mapping[str, Any] | None = None) -> tuple[Store, str]:
    """The (shared) Store of ``url``'s bucket and the object key."""
    scheme, bucket, key = split_url(url)
    # the environment the store reads its settings from is part of what it is
    env = tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith(_ENV_PREFIXES)))
    ident = (
        scheme,
        bucket,
        tuple(sorted((str(k), repr(v)) for k, v in (options or {}).items())),
        env,
    )
    with _stores_lock:
        st = _stores.get(ident)
        if st is None:
            st = _stores[ident] = Store(scheme, bucket, options)
    return st, key


class RemoteObject:
    """One object as the dataset saw it when opened: URL, size, ETag.

    The engine's requests carry a pointer to it (``tl_fent.remote``); the
    FileSet that lists it keeps it alive."""

    __slots__ = ("etag", "key", "size", "store", "url")

    def __init__(self, store: Store, key: str, size: int, etag: str | None) -> None:
        self.store, self.key, self.size, self.etag = store, key, size, etag
        self.url = store.url(key)

    def __repr__(self) -> str:
        return f"RemoteObject({self.url!r}, size={self.size}, etag={self.etag!r})"


# ---- errors -------------------------------------------------------------------------


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _cause(e: BaseException) -> str:
    """What went wrong, in a few words: ``HTTP 503 Service Unavailable
    (SlowDown)``, ``connect error: ...``, or the first line of the message."""
    text = str(e)
    m = re.search(r"status code: (\d{3}) ?([^:\n]*)", text)
    if m:
        code = re.search(r"<Code>([^<]+)</Code>", text)
        return f"HTTP {m.group(1)} {m.group(2).strip()}".strip() + (
            f" ({code.group(1)})" if code else ""
        )
    line = _first_line(e)
    line = re.sub(r"^.*? in [0-9.]+\S*s - ", "", line)  # "Error performing GET <url> in 3ms - "
    kind = re.search(r"kind: (\w+)", text)
    return f"{kind.group(1).lower()} error: {line}" if kind else line


def _status(e: BaseException) -> int | None:
    m = _STATUS.search(str(e))
    return int(m.group(1)) if m else None


class _ShortBody(Exception):
    def __init__(self, got: int, want: int) -> None:
        super().__init__(f"short body: {got} of {want} bytes")


def _no_credentials(e: BaseException) -> bool:
    """The client found no credentials and fell back to (and failed at) the
    instance metadata service."""
    return "169.254.169.254" in str(e)


NOT_PARTIAL_TRIES = 3
"""Answers of the whole object to a ranged GET after which the server is taken to
ignore ranges (``RangesIgnoredError``) rather than to have hiccupped."""


def _not_partial(e: BaseException) -> bool:
    """A ranged GET answered with ``200`` and the whole object. object_store reports it
    as a generic error (``GetResultError::NotPartial``): its message is all there is."""
    return "non-partial response" in str(e)


def _retryable(e: BaseException) -> bool:
    if isinstance(e, (_ShortBody, TimeoutError, ConnectionError)):
        return True
    if _not_partial(e):
        return True  # a proxy or a server that dropped the Range once
    obs = _obstore()
    if not isinstance(e, obs.exceptions.GenericError):
        return False
    if _no_credentials(e):
        return False
    status = _status(e)
    if status is not None:
        return status in _RETRY_STATUS
    return bool(_TRANSPORT.search(str(e)))


def _span(start: int | None, end: int | None) -> str:
    return "" if start is None else f" bytes [{start}, {end})"


def _named(
    e: BaseException, url: str, start: int | None, end: int | None, attempts: int, what: str
) -> BaseException:
    """The tokload exception for a failed request (one line, URL and range)."""
    obs = _obstore()
    ex = obs.exceptions
    where = f"{url}{_span(start, end)}"
    tries = f" after {attempts} attempts" if attempts > 1 else ""
    cause = _cause(e)
    if isinstance(e, (ex.PreconditionError, ex.NotModifiedError)):
        return ObjectChangedError(
            f"{where}: the object changed since the dataset was opened (its ETag is no "
            "longer the one listed then); tokload does not mix old and new bytes: reopen the "
            "dataset to read the new data",
            url,
            start,
            end,
            attempts,
        )
    if isinstance(e, ex.NotFoundError) or _status(e) == 404:
        if "NoSuchBucket" in str(e):
            bucket = split_url(url)[1]
            err = MissingShardError(2, f"no such bucket {bucket!r} ({what})", url)
            err.missing = "bucket"  # type: ignore[attr-defined]
            return err
        return MissingShardError(2, f"missing {what}", url)
    if _no_credentials(e):
        return RemoteAccessError(
            f"{where}: no credentials found for this store (tried storage_options, the "
            "environment, web identity, a task role, AWS profiles (~/.aws, AWS_PROFILE) and "
            "the instance metadata service); set AWS_PROFILE or AWS_ACCESS_KEY_ID and "
            "AWS_SECRET_ACCESS_KEY, or pass storage_options={'skip_signature': True} for a "
            "public bucket",
            url,
            start,
            end,
            attempts,
        )
    if isinstance(e, (ex.PermissionDeniedError, ex.UnauthenticatedError)) or _status(e) in (
        401,
        403,
    ):
        return RemoteAccessError(
            f"{where}: access denied ({what}): {cause}", url, start, end, attempts
        )
    if _not_partial(e):
        return RangesIgnoredError(
            f"{where}: the server answered the ranged GET with the whole object{tries} "
            "(HTTP 200, not 206 Partial Content): it, or a proxy in front of it, ignores "
            "Range headers, and tokload reads byte ranges only; S3, GCS, Azure and MinIO "
            "honour them",
            url,
            start,
            end,
            attempts,
        )
    if isinstance(e, _ShortBody):
        return RemoteError(
            f"{where}: {what}: {e}{tries}; the connection kept ending early",
            url,
            start,
            end,
            attempts,
        )
    if re.search(r"kind: Connect|error sending request", str(e)):
        return RemoteError(
            f"{where}: endpoint unreachable{tries} ({what}): {cause}", url, start, end, attempts
        )
    return RemoteError(f"{where}: {what} failed{tries}: {cause}", url, start, end, attempts)


# ---- the event loop the GETs run on ---------------------------------------------------


class _Counters:
    """Process-wide totals of the remote backend (read with ``counters()``)."""

    def __init__(self) -> None:
        self.gets = 0
        self.retries = 0
        self.bytes = 0


_counts = _Counters()
_loop: asyncio.AbstractEventLoop | None = None
_loop_pid = -1
_loop_lock = threading.Lock()


def counters() -> dict[str, int]:
    """Process-wide totals since start: ``gets`` (ranged GETs that succeeded),
    ``retries`` (attempts repeated after a retryable failure) and ``bytes``."""
    return {"gets": _counts.gets, "retries": _counts.retries, "bytes": _counts.bytes}


class _Loop(asyncio.SelectorEventLoop):
    """The fetcher's event loop.  Its ``call_soon_threadsafe``, through which the
    client's runtime threads hand every result over, wakes it through the
    handoff's eventfd without letting the GIL go (``_remote.loop_call_soon_threadsafe``)."""

    call_soon_threadsafe = _remote.loop_call_soon_threadsafe  # type: ignore[assignment]


def _get_loop() -> asyncio.AbstractEventLoop:
    """The process's event loop thread, the fetcher of the engine's remote batches
    (a new one in a forked child)."""
    global _loop, _loop_pid
    with _loop_lock:
        if _loop is None or _loop_pid != os.getpid():
            from tokload.remote_fetch import on_wake  # it imports this module

            efd = _remote.open_handoff()
            loop = _Loop()
            loop.add_reader(efd, on_wake)
            threading.Thread(target=loop.run_forever, name="tokload-remote", daemon=True).start()
            if _loop is None:
                atexit.register(_quiesce)
            _loop, _loop_pid = loop, os.getpid()
        return _loop


# ---- exit: the client's threads leave Python before the interpreter finalizes ---------------
#
# obstore completes each request on one of its runtime's threads (Rust tokio, not
# Python's): it takes the GIL and hands the result to the event loop
# (``loop.call_soon_threadsafe``).  A thread of that runtime that has to take the GIL
# once the interpreter is finalizing is ended with pthread_exit, which cannot unwind
# through Rust's frames: the process would abort (SIGABRT, nothing printed) after a run
# that did all its work.  Three things close the window: a request is never cancelled on
# obstore's side (a failed batch's other GETs run to their end, their results dropped;
# ``_settled`` shields the few awaited ones); the loop's ``call_soon_threadsafe`` never
# lets the GIL go and counts the threads inside it (``_remote.inside``); and at exit
# ``_quiesce`` waits until every request has completed and no thread is inside.

_pending: set[asyncio.Future[Any]] = set()  # obstore's requests not completed (loop thread)


async def _settled(request: Any) -> Any:
    """``await request`` (an awaitable of obstore's), shielded: if the awaiting task is
    cancelled, the request still runs to its end (``_pending`` until then) and its
    result or error is dropped."""
    fut = asyncio.ensure_future(request)
    _pending.add(fut)
    fut.add_done_callback(_completed)
    return await asyncio.shield(fut)


def _completed(fut: asyncio.Future[Any]) -> None:
    _pending.discard(fut)
    if not fut.cancelled():
        fut.exception()  # retrieved: an abandoned request's error is not logged


def _quiesce(limit: float | None = None) -> bool:
    """Wait until obstore's requests have completed and its threads have handed their
    results over, at most ``limit`` seconds (by default the longest request
    ``timeout`` of the stores opened, plus 5): run at exit, before the interpreter
    finalizes.  Returns whether they did; if not, says so on stderr."""
    if _loop is None or _loop_pid != os.getpid():
        return True
    if limit is None:
        with _stores_lock:
            limit = max((s.settings.timeout for s in _stores.values()), default=0.0) + 5.0
    deadline = time.monotonic() + limit
    while _pending or _remote.inside():
        if time.monotonic() > deadline:
            print(
                f"tokload: at exit, after waiting {limit:g} s, {len(_pending)} object-store "
                f"request(s) still in flight and {_remote.inside()} of the client's threads "
                "still handing a result over: the process may abort",
                file=sys.stderr,
            )
            return False
        time.sleep(0.001)
    return True


_used_pid: int | None = None  # the process whose object-store client has done I/O


def _check_fork() -> None:
    """obstore's runtime (Rust tokio threads) does not survive ``fork()``: in a
    child forked after the parent read from a store, every request would hang.
    Refuse at once instead."""
    global _used_pid
    pid = os.getpid()
    if _used_pid is None:
        _used_pid = pid
    elif _used_pid != pid:
        raise RemoteError(
            "tokload cannot read an object store in a process forked after its parent "
            "read from one: the client's runtime (obstore) does not survive fork(). Use the "
            "DataLoader's reader threads (num_threads=) instead of worker processes, or start "
            "worker processes with the 'spawn' or 'forkserver' method"
        )


def _run(coro: Any) -> Any:
    try:
        _check_fork()
    except RemoteError:
        coro.close()
        raise
    fut = asyncio.run_coroutine_threadsafe(coro, _get_loop())
    try:
        return fut.result()
    except BaseException:
        fut.cancel()
        raise


def _retry_delay(
    e: BaseException, attempt: int, whole: int, t0: float, s: Settings
) -> float | None:
    """The wait before attempt ``attempt + 1`` of a request whose attempt ``attempt``
    failed with ``e`` (``whole``: answers of the whole object in a row so far), or
    None when it has failed for good: not retryable, or past ``retries`` attempts or
    ``retry_seconds``."""
    if attempt > s.retries or not _retryable(e) or whole >= NOT_PARTIAL_TRIES:
        return None
    delay = s.delay(attempt)
    if time.monotonic() - t0 + delay > s.retry_seconds:
        return None
    return delay


async def _retrying(call: Any, settings: Settings) -> Any:
    """``await call()`` until it succeeds or fails for good: returns ``(result,
    attempts)``, or raises ``_Failed`` holding the last exception and the
    attempts made (``_retry_delay`` decides)."""
    attempt = whole = 0
    t0 = time.monotonic()
    while True:
        attempt += 1
        try:
            return await call(), attempt
        except Exception as e:
            whole = whole + 1 if _not_partial(e) else 0
            delay = _retry_delay(e, attempt, whole, t0, settings)
            if delay is None:
                raise _Failed(e, attempt) from None
            _counts.retries += 1
            await asyncio.sleep(delay)


class _Failed(Exception):
    def __init__(self, cause: BaseException, attempts: int) -> None:
        super().__init__()
        self.cause, self.attempts = cause, attempts


def _get_options(obj: RemoteObject, start: int, end: int) -> dict[str, Any]:
    opts: dict[str, Any] = {"range": (start, end)}
    if obj.etag:
        opts["if_match"] = obj.etag  # an object replaced since it was opened is refused
    return opts


async def _get_range(obj: RemoteObject, start: int, end: int) -> Any:
    obs = _obstore()
    opts = _get_options(obj, start, end)

    async def once() -> Any:
        r = await _settled(obs.get_async(obj.store.store, obj.key, options=opts))
        body = await _settled(r.bytes_async())
        if len(body) != end - start:
            raise _ShortBody(len(body), end - start)
        return body

    body, _ = await _retrying(once, obj.store.settings)
    _counts.gets += 1
    _counts.bytes += end - start
    return body


# ---- opening ------------------------------------------------------------------------


def head(url: str, what: str, options: Mapping[str, Any] | None = None) -> RemoteObject:
    """The object at ``url`` as it is now (size, ETag).

    Raises:
        MissingShardError: no such object (or bucket).
        RemoteAccessError, RemoteError: as ``fetch``.
    """
    st, key = store_for(url, options)
    obs = _obstore()
    try:
        meta, _ = _run(_retrying(lambda: _settled(obs.head_async(st.store, key)), st.settings))
    except _Failed as f:
        raise _named(f.cause, url, None, None, f.attempts, what) from None
    return RemoteObject(st, key, int(meta["size"]), meta.get("e_tag"))


def missing_bucket(e: BaseException) -> bool:
    """Whether ``e`` says the bucket itself is missing (not only an object or a prefix)."""
    return getattr(e, "missing", None) == "bucket"


def exists(url: str, options: Mapping[str, Any] | None = None) -> bool:
    """Whether there is an object at ``url`` (a missing bucket raises ``MissingShardError``)."""
    try:
        head(url, "object", options)
    except MissingShardError as e:
        if missing_bucket(e):
            raise
        return False
    return True


def listing(prefix_url: str, options: Mapping[str, Any] | None = None) -> dict[str, RemoteObject]:
    """Every object under ``prefix_url/`` (recursively), by URL, in one paginated LIST."""
    st, key = store_for(prefix_url, options)
    obs = _obstore()
    prefix = key.rstrip("/") + "/" if key else ""

    async def collect() -> list[dict[str, Any]]:
        return list(await _settled(obs.list(st.store, prefix or None).collect_async()))

    try:
        metas, _ = _run(_retrying(collect, st.settings))
    except _Failed as f:
        raise _named(f.cause, prefix_url, None, None, f.attempts, "the listing") from None
    objs = {}
    for m in metas:
        o = RemoteObject(st, m["path"], int(m["size"]), m.get("e_tag"))
        objs[o.url] = o
    return objs


def read_object(obj: RemoteObject, what: str, start: int = 0, end: int | None = None) -> bytes:
    """Bytes ``[start, end)`` of an object opened with ``head``/``listing`` (its
    ETag checked), the whole object by default."""
    end = obj.size if end is None else end
    if not 0 <= start <= end <= obj.size:
        raise FormatError(
            f"{obj.url}: {what}: bytes [{start}, {end}) are not within its {obj.size} bytes"
        )
    if start == end:
        return b""
    try:
        body = _run(_get_range(obj, start, end))
    except _Failed as f:
        raise _named(f.cause, obj.url, start, end, f.attempts, what) from None
    return bytes(body)


def put_file(
    url: str, path: str | os.PathLike[str], options: Mapping[str, Any] | None = None
) -> None:
    """Upload the local file ``path`` as the object at ``url`` (multipart for
    large files, by obstore)."""
    st, key = store_for(url, options)
    obs = _obstore()

    async def once() -> Any:
        from pathlib import Path

        return await _settled(obs.put_async(st.store, key, Path(path)))

    try:
        _run(_retrying(once, st.settings))
    except _Failed as f:
        raise _named(
            f.cause, url, None, None, f.attempts, f"the upload of {os.fspath(path)}"
        ) from None


def delete(urls: Iterable[str], options: Mapping[str, Any] | None = None) -> None:
    """Delete objects (a missing one is no error)."""
    obs = _obstore()
    for url in urls:
        st, key = store_for(url, options)
        try:
            _run(
                _retrying(
                    lambda st=st, key=key: _settled(obs.delete_async(st.store, key)),
                    st.settings,
                )
            )
        except _Failed as f:
            if not isinstance(f.cause, obs.exceptions.NotFoundError):
                raise _named(f.cause, url, None, None, f.attempts, "a delete") from None
