"""Publish a dataset built locally to an object store, so that a reader never sees half of it.

``tokload build ... -o s3://bucket/prefix`` builds into a local staging
directory (resumable chunk by chunk, as any build) and then calls ``publish``:

1. if anything differs from what the store holds, the top-level manifest is
   deleted first: from then on the URL is not a dataset, rather than a mix;
2. each chunk (``parts/<chunk>/``) is uploaded shards first and its own
   manifest last, so a chunk whose manifest is in the store with the same
   bytes as the local one is complete and skipped on a re-run (an interrupted
   publish resumes where it stopped); objects of chunks no longer in the build
   are deleted;
3. the tokenizer file, then the top-level manifest, last.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokload import remote
from tokload.format import MANIFEST


@dataclass
class Published:
    """What ``publish`` did: objects and bytes uploaded, chunks skipped as
    already in the store, objects deleted."""

    uploaded: int = 0
    bytes: int = 0
    skipped: int = 0
    deleted: int = 0


def publish(
    local: str | os.PathLike[str],
    url: str,
    parts: str,
    chunks: Sequence[str],
    options: Mapping[str, Any] | None = None,
) -> Published:
    """Upload the dataset at ``local`` (built with chunk directories
    ``local/parts/<chunk>``, ``chunks`` in order) to ``url``.

    Raises:
        RemoteError, RemoteAccessError: an upload failed after its retries
            (the URL has no top-level manifest then; run it again).
    """
    root = Path(local)
    url = url.rstrip("/")
    done = Published()
    have = remote.listing(url, options)
    top = remote.join(url, MANIFEST)

    def same(path: Path, key_url: str) -> bool:
        obj = have.get(key_url)
        if obj is None or obj.size != path.stat().st_size:
            return False
        return remote.read_object(obj, "a manifest") == path.read_bytes()

    todo = [
        c for c in chunks if not same(root / parts / c / MANIFEST, f"{url}/{parts}/{c}/{MANIFEST}")
    ]
    keep = {f"{url}/{parts}/{c}/" for c in chunks}
    stale = [
        u
        for u in have
        if u.startswith(f"{url}/{parts}/") and not any(u.startswith(k) for k in keep)
    ]
    extras = [p for p in sorted(root.iterdir()) if p.is_file() and p.name != MANIFEST]
    changed_extras = [p for p in extras if not same(p, remote.join(url, p.name))]
    if not todo and not stale and not changed_extras and same(root / MANIFEST, top):
        done.skipped = len(chunks)
        return done
    if top in have:
        remote.delete([top], options)  # the URL stops being a dataset until the end
        done.deleted += 1
    remote.delete(stale, options)
    done.deleted += len(stale)
    for c in chunks:
        if c not in todo:
            done.skipped += 1
            continue
        cdir = root / parts / c
        cman = f"{url}/{parts}/{c}/{MANIFEST}"
        if cman in have:  # being replaced: incomplete until its manifest is back
            remote.delete([cman], options)
        for f in sorted(cdir.iterdir()):
            if f.is_file() and f.name != MANIFEST:
                _put(f, f"{url}/{parts}/{c}/{f.name}", options, done)
        _put(cdir / MANIFEST, cman, options, done)
    for p in changed_extras:
        _put(p, remote.join(url, p.name), options, done)
    _put(root / MANIFEST, top, options, done)
    return done


def _put(path: Path, url: str, options: Mapping[str, Any] | None, done: Published) -> None:
    remote.put_file(url, path, options)
    done.uploaded += 1
    done.bytes += path.stat().st_size
