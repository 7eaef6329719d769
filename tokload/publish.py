"""Publish a dataset built locally to an object store, so that a reader never sees half of it.

``tokload build ... -o s3://bucket/prefix`` builds into a local staging
directory (resumable chunk by chunk, as any build); a ``Publisher`` thread
uploads each chunk as soon as it is complete, while the others are built, and
``publish`` finishes:

1. before the first object that differs from what the store holds is
   uploaded or deleted, the top-level manifest is deleted: from then on the
   URL is not a dataset, rather than a mix (a re-run whose chunks the store
   holds already, the staging directory gone, uploads nothing and never
   takes the dataset offline);
2. each chunk (``parts/<chunk>/``) is uploaded shards first and its own
   manifest last, so a chunk whose manifest is in the store with the same
   bytes as the local one is complete and skipped on a re-run (an interrupted
   publish resumes where it stopped); objects of chunks no longer in the build
   are deleted, and so are a rebuilt chunk's objects that its new version lacks;
3. the tokenizer file, then the top-level manifest, last.

What it may replace or delete follows the rules of a local output
(``tokload.build_output``), checked by ``check_store`` before the build
starts: objects under the URL that no build wrote are never touched (a
prefix holding them is refused unless ``force``, and even then if the build
would write over one), and a dataset built there from other inputs is
replaced only with ``force``. Under ``parts/``, only the objects of chunks
(``parts/<chunk>/manifest.json`` and the files of its shards, named as the
build names them) are ever deleted.
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokload import remote
from tokload.build_output import recorded_input
from tokload.errors import FormatError, UsageError
from tokload.format import MANIFEST, parse_manifest
from tokload.tokenizer import TOKENIZER_FILE

CHUNK_NAME = re.compile(r"[0-9]{5,}-[0-9]{5,}")
"""The name of a chunk's folder under ``parts/`` (``tokload.build_plan.Chunk.name``)."""

SHARD_FILE = re.compile(r"in([0-9]{5,}-[0-9]{5,})-[0-9]{5,}\.[a-z]+")
"""The name of a file of a chunk's shard (``in<chunk>-<k>.rows``, ``.docs``, ...:
``tokload.build_part`` names them): with the chunk's manifest, the only objects of
its folder that are the build's, and ever deleted."""


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
    stored: Collection[str] = (),
    stale: Callable[[str], bool] = lambda name: True,
) -> Published:
    """Upload the dataset at ``local`` (built with chunk directories
    ``local/parts/<chunk>``, ``chunks`` in order) to ``url``.

    ``stored``: chunks known to be in the store already (a ``Publisher``'s),
    not compared again. ``stale``: whether a chunk in the store that is not one
    of ``chunks`` no longer belongs (``tokload.build_output.StaleChunks``: the
    chunks of other ``--part`` slices stay); its objects are deleted.

    Raises:
        RemoteError, RemoteAccessError: an upload failed after its retries
            (the URL has no top-level manifest then; run it again).
    """
    root = Path(local)
    url = remote.normalize(url)  # as the listing names the objects
    done = Published()
    have = remote.listing(url, options)
    top = remote.join(url, MANIFEST)
    todo = {c for c in chunks if c not in stored and not _chunk_stored(have, root, url, parts, c)}
    old = _stale_objects(have, url, parts, chunks, stale)
    # (hidden files, such as the build's marker, are local bookkeeping: not uploaded)
    extras = [
        p
        for p in sorted(root.iterdir())
        if p.is_file() and p.name != MANIFEST and not p.name.startswith(".")
    ]
    changed_extras = [p for p in extras if not _same(have, p, remote.join(url, p.name))]
    if not todo and not old and not changed_extras and _same(have, root / MANIFEST, top):
        done.skipped = len(chunks)
        return done
    if top in have:
        remote.delete([top], options)  # the URL stops being a dataset until the end
        done.deleted += 1
    remote.delete(old, options)
    done.deleted += len(old)
    for c in chunks:
        if c in todo:
            _upload_chunk(have, root, url, parts, c, options, done)
        else:
            done.skipped += 1
    for p in changed_extras:
        _put(p, remote.join(url, p.name), options, done)
    _put(root / MANIFEST, top, options, done)
    return done


def _stale_objects(
    have: Mapping[str, Any],
    url: str,
    parts: str,
    chunks: Collection[str],
    stale: Callable[[str], bool],
) -> list[str]:
    """The objects of ``have`` in chunk folders that are not ``chunks`` and ``stale``
    says no longer belong (nothing else under ``parts/`` is the build's)."""
    keep = set(chunks)
    return [
        u
        for u in have
        if (c := _chunk_of(u, url, parts)) is not None and c not in keep and stale(c)
    ]


def _same(have: Mapping[str, Any], path: Path, url: str) -> bool:
    """Whether the store (as ``have`` lists it) holds the bytes of the local file
    ``path`` at ``url`` (a manifest or another small file: read and compared)."""
    obj = have.get(url)
    if obj is None or obj.size != path.stat().st_size:
        return False
    return bool(remote.read_object(obj, "a manifest") == path.read_bytes())


def _chunk_stored(have: Mapping[str, Any], root: Path, url: str, parts: str, c: str) -> bool:
    """Whether the store holds chunk ``c`` whole: its manifest (uploaded last), as
    the local one."""
    return _same(have, root / parts / c / MANIFEST, f"{url}/{parts}/{c}/{MANIFEST}")


def _upload_chunk(
    have: Mapping[str, Any],
    root: Path,
    url: str,
    parts: str,
    c: str,
    options: Mapping[str, Any] | None,
    done: Published,
) -> None:
    """Upload chunk ``c``: its shards, then its manifest (an older manifest in the
    store is deleted first: the chunk is incomplete until the new one is there)."""
    cdir = root / parts / c
    cman = f"{url}/{parts}/{c}/{MANIFEST}"
    if cman in have:
        remote.delete([cman], options)
        done.deleted += 1
    files = [
        f
        for f in sorted(cdir.iterdir())
        if f.is_file() and f.name != MANIFEST and not f.name.startswith(".")
    ]
    # the objects of the chunk's older version that this one lacks (a rebuild into
    # other shards): deleted while the chunk is incomplete, as its manifest is
    names = {f"{url}/{parts}/{c}/{f.name}" for f in files}
    old = [u for u in have if u != cman and _chunk_of(u, url, parts) == c and u not in names]
    remote.delete(old, options)
    done.deleted += len(old)
    for f in files:
        _put(f, f"{url}/{parts}/{c}/{f.name}", options, done)
    _put(cdir / MANIFEST, cman, options, done)


def _chunk_of(u: str, url: str, parts: str) -> str | None:
    """The chunk whose object ``u`` is (``url/parts/<chunk>/<its manifest or a file of
    its shards>``); None for any other object, one of another name in a chunk's
    folder included (not the build's)."""
    head = f"{url}/{parts}/"
    if not u.startswith(head):
        return None
    name, _, file = u[len(head) :].partition("/")
    if not CHUNK_NAME.fullmatch(name):
        return None
    if file == MANIFEST:
        return name
    shard = SHARD_FILE.fullmatch(file)
    return name if shard is not None and shard.group(1) == name else None


def check_store(
    url: str,
    files: Sequence[str | os.PathLike[str]],
    force: bool,
    parts: str = "parts",
    options: Mapping[str, Any] | None = None,
) -> None:
    """Refuse a URL whose objects a build would mix with or replace unasked: the
    rules ``tokload.build_output.check_output`` applies to a local output, for
    the objects under ``url`` (the build's own staging directory, checked as a
    local output, is a fresh one on another machine).

    Nothing there is fine. A build there (its top-level manifest written by
    ``tokload build``, or chunk folders under ``parts/``, ``00000-00000``: a
    publish that stopped) is fine when one of the inputs its chunks record is
    among ``files`` (a re-run, or inputs added), or when the chunks of an input
    do not say (a publish stopped in the middle of that input's chunks), else
    refused unless ``force``. Anything else needs ``force``, and even then a
    ``manifest.json`` or ``tokenizer.json`` there is refused: the build would
    write over it. Only chunk folders are ever deleted, so other objects, under
    ``parts/`` or not, stay as they are.

    The chunks' manifests are read one per input (its first chunk), many at
    once.

    Raises:
        UsageError: as above, naming the URL and what it holds.
        RemoteError, RemoteAccessError: the store cannot be listed or read.
    """
    url = remote.normalize(url)
    have = remote.listing(url, options)
    if not have:
        return
    top = have.get(remote.join(url, MANIFEST))
    built = _built_by_tokload(top)
    chunks = sorted({c for u in have if (c := _chunk_of(u, url, parts)) is not None})
    if not built and not chunks:
        if not force:
            shown = ", ".join(u[len(url) + 1 :] for u in sorted(have)[:5])
            more = ", ..." if len(have) > 5 else ""
            raise UsageError(
                f"{url}: holds {len(have)} objects and no tokload build ({shown}{more}); build "
                "to a new or empty prefix, or pass --force to build beside these objects "
                "(none of them is changed or deleted)"
            )
        taken = [n for n in (MANIFEST, TOKENIZER_FILE) if remote.join(url, n) in have]
        if taken:
            raise UsageError(
                f"{url}: holds {', '.join(taken)}, which tokload build did not write and "
                "would replace; --force builds beside other objects but never over these: "
                "build to another prefix"
            )
        return
    if top is not None and not built:  # chunk folders, and another writer's manifest
        raise UsageError(
            f"{url}: holds {MANIFEST}, which tokload build did not write and would replace: "
            "build to another prefix"
        )
    if force:
        return
    wanted = {os.path.abspath(f) for f in files}
    # the chunks' manifests record their input's absolute path (the top-level one
    # has the paths as given)
    first: dict[str, str] = {}  # input -> its first chunk
    for c in chunks:
        first.setdefault(c.split("-")[0], c)
    manifests = [have.get(f"{url}/{parts}/{c}/{MANIFEST}") for c in first.values()]
    if any(m is None for m in manifests):
        return  # a publish stopped in the middle of an input's chunks: its build's
    recorded = {os.path.abspath(p) for p in _chunk_inputs(manifests) if p is not None}
    if not recorded or len(recorded) < len(manifests) or recorded & wanted:
        return  # no chunk (a part of none), a chunk that does not say, or a re-run
    shown = ", ".join(sorted(recorded)[:3]) + (", ..." if len(recorded) > 3 else "")
    raise UsageError(
        f"{url}: holds a dataset built from other inputs ({shown}), none of which is an "
        "input of this build; build to another prefix, or pass --force to replace it"
    )


def _built_by_tokload(obj: Any) -> bool:
    """Whether the manifest object ``obj`` was written by ``tokload build``
    (``user["built_by"]``): False for no object, or another writer's."""
    if obj is None:
        return False
    try:
        m = parse_manifest(remote.read_object(obj, "a manifest"), obj.url)
    except (FormatError, ValueError):
        return False
    return bool(m.user.get("built_by") == "tokload build")


def _chunk_inputs(objs: list[Any]) -> list[str | None]:
    """The input path each chunk manifest object of ``objs`` records
    (``build_output.recorded_input``), None where it records none."""
    out: list[str | None] = []
    for obj, raw in zip(objs, remote.read_objects(objs, "a manifest"), strict=True):
        try:
            out.append(recorded_input(parse_manifest(raw, obj.url)))
        except (FormatError, ValueError):
            out.append(None)
    return out


class Publisher:
    """Uploads the chunks of a build as they complete, in a thread.

    ``start`` lists the store, then uploads every chunk whose local directory
    is complete (``parts/<chunk>/manifest.json`` exists: the builder renames a
    chunk's directory into place when it is done) and that the store lacks
    (its manifest there is not the local one), polling until ``finish``; the
    store's top-level manifest is deleted before the first such upload.
    ``finish`` stops the thread and runs ``publish``, which uploads what is
    left and the top-level manifest last. An upload error stops the thread and
    is raised by ``finish``.
    """

    def __init__(
        self,
        local: str | os.PathLike[str],
        url: str,
        parts: str,
        chunks: Sequence[str],
        options: Mapping[str, Any] | None = None,
        poll: float = 0.5,
        stale: Callable[[str], bool] = lambda name: True,
    ) -> None:
        self.local, self.url, self.parts = Path(local), remote.normalize(url), parts
        self.chunks, self.options, self.poll = list(chunks), options, poll
        self.stale = stale
        self.done = Published()
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._have: dict[str, Any] = {}
        self._stored: set[str] = set()  # chunks the store holds whole (checked or uploaded)
        self._chunks_sent = 0  # chunks this thread uploaded (publish then finds them there)
        self._offline = False  # the top-level manifest deleted by this thread

    def _complete(self, c: str) -> bool:
        return (self.local / self.parts / c / MANIFEST).exists()

    def start(self) -> Publisher:
        """List the store and start uploading."""
        self._have = remote.listing(self.url, self.options)
        self._thread = threading.Thread(target=self._run, name="tokload-publish", daemon=True)
        self._thread.start()
        return self

    def _take_offline(self) -> None:
        """Before the first object that changes the dataset: delete the top-level
        manifest (the URL stops being a dataset until ``publish`` ends), then the
        chunks no longer in the build, as a local build removes them before it
        builds: a publish stopped after this leaves no chunk of other inputs
        that would make its re-run look like a build of other inputs."""
        if self._offline:
            return
        top = remote.join(self.url, MANIFEST)
        if top in self._have:
            remote.delete([top], self.options)
            self.done.deleted += 1
        old = _stale_objects(self._have, self.url, self.parts, self.chunks, self.stale)
        remote.delete(old, self.options)
        self.done.deleted += len(old)
        self._offline = True

    def _run(self) -> None:
        try:
            while True:
                last = self._stop.is_set()
                for c in self.chunks:
                    if c in self._stored or not self._complete(c):
                        continue
                    if not _chunk_stored(self._have, self.local, self.url, self.parts, c):
                        self._take_offline()
                        _upload_chunk(
                            self._have, self.local, self.url, self.parts, c, self.options, self.done
                        )
                        self._chunks_sent += 1
                    self._stored.add(c)
                if last or len(self._stored) == len(self.chunks):
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
        rest = publish(
            self.local,
            self.url,
            self.parts,
            self.chunks,
            self.options,
            stored=self._stored,
            stale=self.stale,
        )
        rest.uploaded += self.done.uploaded
        rest.bytes += self.done.bytes
        rest.deleted += self.done.deleted
        rest.skipped -= self._chunks_sent
        return rest


def _put(path: Path, url: str, options: Mapping[str, Any] | None, done: Published) -> None:
    remote.put_file(url, path, options)
    done.uploaded += 1
    done.bytes += path.stat().st_size
