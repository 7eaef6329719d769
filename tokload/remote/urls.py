"""Object-store URLs: the one job of this module is to tell a URL from a local path
and take it apart (``scheme://bucket/key``)."""

from __future__ import annotations

import os
import re

from tokload.errors import UsageError

SCHEMES = ("s3", "gs", "az", "abfs", "abfss")
"""The URL schemes read from an object store (``file://`` is a local path)."""

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


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


def absolute_local(path: object) -> object:
    """``path`` as it names the same file from any working directory: a relative
    local path (or each of a list's or tuple's) made absolute against the
    current one, a ``file://`` prefix removed; URLs, absolute paths and other
    objects unchanged.

    A pickled source or view opens its data again where it is unpickled, which
    may be another directory (a Ray worker's, a job launched elsewhere): what it
    records is its path made absolute when it was opened.
    """
    if isinstance(path, (list, tuple)):
        return type(path)(absolute_local(p) for p in path)
    if not isinstance(path, (str, os.PathLike)):
        return path
    p = os.fspath(path)
    if not isinstance(p, str):
        return path  # bytes paths are not opened by tokload
    scheme = scheme_of(p)
    if scheme is not None and scheme != "file":
        return path
    local = local_path(p)
    return path if local == p and os.path.isabs(p) else os.path.abspath(local)


def join(url: str, name: str) -> str:
    """``url/name``, normalized (``normalize``): a merged dataset's shard names
    climb out of its prefix with ``..``."""
    return normalize(url.rstrip("/") + "/" + name)


def normalize(url: str) -> str:
    """``url`` as the store names its objects: the scheme in lower case, and the
    key's empty, ``.`` and ``..`` segments resolved, as in a path (object_store's
    keys have none of them), with no slash at the end.

    Raises:
        UsageError: the key climbs above its bucket.
    """
    scheme, bucket, key = split_url(url)
    parts: list[str] = []
    for seg in key.split("/"):
        if seg == "..":
            if not parts:
                raise UsageError(f"{url}: the key climbs above the bucket {bucket!r}")
            parts.pop()
        elif seg not in ("", "."):
            parts.append(seg)
    return f"{scheme}://{bucket}" + "".join("/" + p for p in parts)


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
