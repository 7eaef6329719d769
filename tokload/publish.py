"""Publish a dataset built locally to an object store, so that a reader never sees half of it.

``tokload build ... -o s3://bucket/prefix`` builds into a local staging
directory (resumable chunk by chunk, as any build); a ``Publisher`` thread
uploads each chunk as soon as it is complete, while the others are built, and
``publish`` finishes:

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
import threading
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


class Publisher:
    """Uploads the chunks of a build as they complete, in a thread.

    ``start`` deletes the store's top-level manifest when the dataset will
    change (``changing``), then uploads every chunk whose local directory is
    complete (``parts/<chunk>/manifest.json`` exists: the builder renames a
    chunk's directory into place when it is done) and that the store lacks,
    polling until ``finish``; ``finish`` stops the thread and runs ``publish``,
    which uploads what is left and the top-level manifest last. An upload error
    stops the thread and is raised by ``finish``.
    """

    def __init__(
        self,
        local: str | os.PathLike[str],
        url: str,
        parts: str,
        chunks: Sequence[str],
        options: Mapping[str, Any] | None = None,
        poll: float = 0.5,
    ) -> None:
        self.local, self.url, self.parts = Path(local), url.rstrip("/"), parts
        self.chunks, self.options, self.poll = list(chunks), options, poll
        self.done = Published()
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._have: dict[str, Any] = {}
        self._chunks_sent = 0  # chunks this thread uploaded (publish then finds them there)

    def start(self, changing: bool) -> Publisher:
        """Delete the top-level manifest if the dataset will change (``changing``:
        chunks to build or remove) or the store lacks a chunk built already, then
        start uploading."""
        self._have = remote.listing(self.url, self.options)
        lacking = [
            c
            for c in self.chunks
            if (self.local / self.parts / c / MANIFEST).exists() and not self._stored(c)
        ]
        top = remote.join(self.url, MANIFEST)
        if (changing or lacking) and top in self._have:
            remote.delete([top], self.options)  # the URL stops being a dataset until the end
        self._thread = threading.Thread(target=self._run, name="tokload-publish", daemon=True)
        self._thread.start()
        return self

    def _stored(self, c: str) -> bool:
        """Whether the store holds chunk ``c`` whole: its manifest, as the local one."""
        obj = self._have.get(f"{self.url}/{self.parts}/{c}/{MANIFEST}")
        local = self.local / self.parts / c / MANIFEST
        return (
            obj is not None
            and obj.size == local.stat().st_size
            and (remote.read_object(obj, "a manifest") == local.read_bytes())
        )

    def _run(self) -> None:
        sent: set[str] = set()
        try:
            while True:
                last = self._stop.is_set()
                for c in self.chunks:
                    cdir = self.local / self.parts / c
                    if c in sent or not (cdir / MANIFEST).exists():
                        continue
                    if not self._stored(c):
                        cman = f"{self.url}/{self.parts}/{c}/{MANIFEST}"
                        if cman in self._have:  # being replaced: incomplete until it is back
                            remote.delete([cman], self.options)
                        for f in sorted(cdir.iterdir()):
                            if f.is_file() and f.name != MANIFEST:
                                url = f"{self.url}/{self.parts}/{c}/{f.name}"
                                _put(f, url, self.options, self.done)
                        _put(cdir / MANIFEST, cman, self.options, self.done)
                        self._chunks_sent += 1
                    sent.add(c)
                if last or len(sent) == len(self.chunks):
                    return
                self._stop.wait(self.poll)
        except BaseException as e:
            self._error = e

    def finish(self, ok: bool = True) -> Published:
        """Stop the thread; with ``ok`` (the build succeeded), publish the rest
        and the top-level manifest. Returns what was uploaded in all."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self._error is not None and ok:
            raise self._error
        if not ok:
            return self.done
        rest = publish(self.local, self.url, self.parts, self.chunks, self.options)
        rest.uploaded += self.done.uploaded
        rest.bytes += self.done.bytes
        rest.skipped -= self._chunks_sent
        return rest


def _put(path: Path, url: str, options: Mapping[str, Any] | None, done: Published) -> None:
    remote.put_file(url, path, options)
    done.uploaded += 1
    done.bytes += path.stat().st_size
