"""A failed request, as tokload answers it: the one job of this module is to decide
whether a failure is retried and after how long (``retry_delay``), and to name the
one that is not as tokload's exception (``named``), from what the client says it
means (``tokload.remote.client.kind``)."""

from __future__ import annotations

import time

from tokload.errors import (
    MissingShardError,
    ObjectChangedError,
    RangesIgnoredError,
    RemoteAccessError,
    RemoteError,
)
from tokload.remote import client
from tokload.remote.store import Settings
from tokload.remote.urls import split_url

NOT_PARTIAL_TRIES = 3
"""Answers of the whole object to a ranged GET after which the server is taken to
ignore ranges (``RangesIgnoredError``) rather than to have hiccupped."""

_RETRIED = frozenset({client.NOT_PARTIAL, client.UNREACHABLE, client.TIMEOUT, client.TRANSIENT})


class ShortBody(Exception):
    """A body shorter (or longer) than the range asked for."""

    def __init__(self, got: int, want: int) -> None:
        super().__init__(f"short body: {got} of {want} bytes")


def not_partial(e: BaseException) -> bool:
    """Whether ``e`` is the answer of the whole object to a ranged GET."""
    return not isinstance(e, ShortBody) and client.kind(e) == client.NOT_PARTIAL


def retryable(e: BaseException) -> bool:
    """Whether another attempt may succeed: a short body, a timeout, a dropped or
    refused connection, throttling, a server error, a whole object for a range (a
    proxy or a server that dropped the Range once)."""
    if isinstance(e, (ShortBody, TimeoutError, ConnectionError)):
        return True
    return client.kind(e) in _RETRIED


def retry_delay(e: BaseException, attempt: int, whole: int, t0: float, s: Settings) -> float | None:
    """The wait before attempt ``attempt + 1`` of a request whose attempt ``attempt``
    failed with ``e`` (``whole``: answers of the whole object in a row so far; ``t0``:
    when its first attempt was sent), or None when it has failed for good: not
    retryable, or past ``retries`` attempts or ``retry_seconds``."""
    if attempt > s.retries or not retryable(e) or whole >= NOT_PARTIAL_TRIES:
        return None
    delay = s.delay(attempt)
    if time.monotonic() - t0 + delay > s.retry_seconds:
        return None
    return delay


def span(start: int | None, end: int | None) -> str:
    """`` bytes [start, end)``, or nothing for a request of no range."""
    return "" if start is None else f" bytes [{start}, {end})"


def named(
    e: BaseException, url: str, start: int | None, end: int | None, attempts: int, what: str
) -> BaseException:
    """The tokload exception for a failed request (one line, URL and range)."""
    tries = f" after {attempts} attempts" if attempts > 1 else ""

    def at(cls: type[RemoteError], says: str) -> RemoteError:
        """``cls`` saying ``says`` of the request's URL and range."""
        return cls(f"{url}{span(start, end)}: {says}", url, start, end, attempts)

    if isinstance(e, ShortBody):
        return at(RemoteError, f"{what}: {e}{tries}; the connection kept ending early")
    k = client.kind(e)
    if k == client.CHANGED:
        return at(
            ObjectChangedError,
            "the object changed since the dataset was opened (its ETag is no longer the "
            "one listed then); tokload does not mix old and new bytes: reopen the dataset "
            "to read the new data",
        )
    if k == client.NO_BUCKET:
        bucket = split_url(url)[1]
        err = MissingShardError(2, f"no such bucket {bucket!r} ({what})", url)
        err.missing = "bucket"  # type: ignore[attr-defined]
        return err
    if k == client.MISSING:  # (OSError's form: the URL is its filename)
        where = "" if start is None else f" (bytes [{start}, {end}))"
        return MissingShardError(2, f"missing {what}{where}", url)
    if k == client.NO_CREDENTIALS:
        return at(
            RemoteAccessError,
            "no credentials found for this store (tried storage_options, the environment, "
            "web identity, a task role, AWS profiles (~/.aws, AWS_PROFILE) and the instance "
            "metadata service); set AWS_PROFILE or AWS_ACCESS_KEY_ID and "
            "AWS_SECRET_ACCESS_KEY, or pass storage_options={'skip_signature': True} for a "
            "public bucket",
        )
    cause = client.cause(e)
    if k == client.DENIED:
        return at(RemoteAccessError, f"access denied ({what}): {cause}")
    if k == client.NOT_PARTIAL:
        return at(
            RangesIgnoredError,
            f"the server answered the ranged GET with the whole object{tries} (HTTP 200, "
            "not 206 Partial Content): it, or a proxy in front of it, ignores Range "
            "headers, and tokload reads byte ranges only; S3, GCS, Azure and MinIO honour "
            "them",
        )
    if k == client.UNREACHABLE:
        return at(RemoteError, f"endpoint unreachable{tries} ({what}): {cause}")
    if k == client.TIMEOUT:
        return at(
            RemoteError,
            f"timed out{tries} ({what}): {cause}; the store answered too slowly for "
            "storage_options 'timeout' (per request; 'connect_timeout' to connect)",
        )
    return at(RemoteError, f"{what} failed{tries}: {cause}")
