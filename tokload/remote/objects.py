"""Requests for whole objects and listings, one at a time: the one job of this module
is what opening, building and publishing a dataset ask of a store (a HEAD, a
LIST, a small ranged read, an upload, a delete), each retried as
``tokload.remote.failures`` says and run on the fetcher's loop from the caller's
thread.  The reads of batches go through ``tokload.remote.fetch`` instead."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any

from tokload.errors import FormatError, MissingShardError
from tokload.remote import client
from tokload.remote.failures import ShortBody, named, not_partial, retry_delay
from tokload.remote.loop import counts, run, settled
from tokload.remote.store import RemoteObject, Settings, store_for


class _Failed(Exception):
    def __init__(self, cause: BaseException, attempts: int) -> None:
        super().__init__()
        self.cause, self.attempts = cause, attempts


async def _retrying(call: Callable[[], Awaitable[Any]], settings: Settings) -> Any:
    """``await call()`` until it succeeds or fails for good: returns ``(result,
    attempts)``, or raises ``_Failed`` holding the last exception and the
    attempts made (``retry_delay`` decides)."""
    attempt = whole = 0
    t0 = time.monotonic()
    while True:
        attempt += 1
        try:
            return await call(), attempt
        except Exception as e:
            whole = whole + 1 if not_partial(e) else 0
            delay = retry_delay(e, attempt, whole, t0, settings)
            if delay is None:
                raise _Failed(e, attempt) from None
            counts.retries += 1
            await asyncio.sleep(delay)


async def _get_range(obj: RemoteObject, start: int, end: int) -> Any:
    handle = obj.store.handle

    async def once() -> Any:
        answer = await settled(client.get(handle, obj.key, start, end, obj.etag))
        body = await settled(client.body_async(answer))
        if len(body) != end - start:
            raise ShortBody(len(body), end - start)
        return body

    body, _ = await _retrying(once, obj.store.settings)
    counts.gets += 1
    counts.bytes += end - start
    return body


def head(url: str, what: str, options: Mapping[str, Any] | None = None) -> RemoteObject:
    """The object at ``url`` as it is now (size, ETag).

    Raises:
        MissingShardError: no such object (or bucket).
        RemoteAccessError, RemoteError: access denied; failed after the retries.
    """
    st, key = store_for(url, options)
    try:
        (size, etag), _ = run(_retrying(lambda: settled(client.head(st.handle, key)), st.settings))
    except _Failed as f:
        failed = f
        if client.kind(f.cause) == client.MISSING:  # the object, or its bucket?
            try:
                run(_retrying(lambda: settled(client.list_first(st.handle, key)), st.settings))
            except _Failed as g:
                if client.kind(g.cause) == client.NO_BUCKET:
                    failed = g
        raise named(failed.cause, url, None, None, failed.attempts, what) from None
    return RemoteObject(st, key, size, etag)


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
    prefix = key.rstrip("/") + "/" if key else ""
    try:
        found, _ = run(
            _retrying(lambda: settled(client.list_prefix(st.handle, prefix)), st.settings)
        )
    except _Failed as f:
        raise named(f.cause, prefix_url, None, None, f.attempts, "the listing") from None
    objs = {}
    for k, size, etag in found:
        o = RemoteObject(st, k, size, etag)
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
        body = run(_get_range(obj, start, end))
    except _Failed as f:
        raise named(f.cause, obj.url, start, end, f.attempts, what) from None
    return bytes(body)


READS_AT_ONCE = 64
"""Whole objects ``read_objects`` keeps in flight."""


def read_objects(objs: Iterable[RemoteObject], what: str) -> list[bytes]:
    """``read_object`` of each of ``objs`` (whole), ``READS_AT_ONCE`` in flight: a
    check of many small objects (manifests) takes a round trip per
    ``READS_AT_ONCE`` of them, not per object. The first failure is raised."""
    objs = list(objs)
    if not objs:
        return []

    async def all_of() -> list[bytes]:
        room = asyncio.Semaphore(READS_AT_ONCE)

        async def one(obj: RemoteObject) -> bytes:
            if obj.size == 0:
                return b""
            async with room:
                try:
                    return bytes(await _get_range(obj, 0, obj.size))
                except _Failed as f:
                    raise named(f.cause, obj.url, 0, obj.size, f.attempts, what) from None

        return list(await asyncio.gather(*(one(o) for o in objs)))

    return run(all_of())  # type: ignore[no-any-return]


def put_file(
    url: str, path: str | os.PathLike[str], options: Mapping[str, Any] | None = None
) -> None:
    """Upload the local file ``path`` as the object at ``url`` (multipart for
    large files, by the client)."""
    st, key = store_for(url, options)
    try:
        run(_retrying(lambda: settled(client.put(st.handle, key, path)), st.settings))
    except _Failed as f:
        raise named(
            f.cause, url, None, None, f.attempts, f"the upload of {os.fspath(path)}"
        ) from None


def delete(urls: Iterable[str], options: Mapping[str, Any] | None = None) -> None:
    """Delete objects (a missing one is no error)."""
    for url in urls:
        st, key = store_for(url, options)

        def once(handle: Any = st.handle, key: str = key) -> Awaitable[Any]:
            return settled(client.delete(handle, key))

        try:
            run(_retrying(once, st.settings))
        except _Failed as f:
            if client.kind(f.cause) != client.MISSING:
                raise named(f.cause, url, None, None, f.attempts, "a delete") from None
