"""Buckets and objects as a dataset opened them: the one job of this module is to
turn a URL and its ``storage_options`` into a shared ``Store`` (a client of
``tokload.remote.client`` and tokload's own settings) and to describe an object as
it was listed (``RemoteObject``)."""

from __future__ import annotations

import logging
import os
import random
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tokload.remote import client
from tokload.remote.urls import split_url

log = logging.getLogger("tokload.remote")


@dataclass(frozen=True)
class Settings:
    """tokload's own ``storage_options`` (see ``tokload.remote``)."""

    retries: int = 10
    retry_seconds: float = 120.0
    timeout: float = 30.0
    connect_timeout: float = 5.0
    merge_gap: int = 1 << 16
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


_TIMEOUTS = (0.001, 86_400 * 365)
"""The bounds of a timeout option, in seconds (0: every request times out; the
client counts milliseconds)."""


def split_options(options: Mapping[str, Any] | None) -> tuple[Settings, dict[str, Any]]:
    """``storage_options`` as tokload's ``Settings`` and the client's own options.

    Raises:
        ValueError: one of tokload's options that is not a number >= 0 (a
            timeout: 1 ms to a year).
    """
    own: dict[str, Any] = {}
    store: dict[str, Any] = {}
    for k, v in (options or {}).items():
        if k in _OWN:
            try:
                own[k] = _OWN[k](v)
            except (TypeError, ValueError):
                raise ValueError(f"storage_options[{k!r}]={v!r}: expected a number") from None
            if k in ("timeout", "connect_timeout") and not _TIMEOUTS[0] <= own[k] <= _TIMEOUTS[1]:
                raise ValueError(
                    f"storage_options[{k!r}]={v!r}: expected a number of seconds from "
                    f"{_TIMEOUTS[0]} to {_TIMEOUTS[1]:,}"
                )
            if not own[k] >= 0:  # (NaN too)
                raise ValueError(f"storage_options[{k!r}]={v!r}: expected a number >= 0")
        else:
            store[k] = v
    return Settings(**own), store


class Store:
    """One bucket (or container), its client (``handle``, for
    ``tokload.remote.client``'s requests) and the options it was opened with."""

    def __init__(self, scheme: str, bucket: str, options: Mapping[str, Any] | None) -> None:
        self.scheme, self.bucket = scheme, bucket
        self.settings, config = split_options(options)
        self.handle, self.credentials = client.connect(
            scheme, bucket, config, self.settings.timeout, self.settings.connect_timeout
        )
        log.debug("%s://%s: credentials from %s", scheme, bucket, self.credentials)

    def url(self, key: str) -> str:
        return f"{self.scheme}://{self.bucket}/{key}"


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


def longest_timeout() -> float:
    """The longest request ``timeout`` of the stores opened (0 when none is)."""
    with _stores_lock:
        return max((s.settings.timeout for s in _stores.values()), default=0.0)


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
