"""Read-ahead: tell the view which samples the next tasks will read.

The one job of this module is the policy of the loader's read-ahead. The order
of every future sample is known (the permutation), so while the reader threads
build task ``t``, the view can be asked to start reading the samples of the
tasks up to ``t + lead`` (``view.hint(indices)``, optional in the view
protocol; tokload's windowed views advise the kernel with
``POSIX_FADV_WILLNEED``, which queues the reads and returns; a stream with
metadata blocks also reads, at the next hint, the index entries it advised
where a shard's block index table is not in memory (not held, or not loaded
by a read yet), to advise their blocks). A read that the
storage delays (a network filesystem's 200 ms spike) is then in flight long
before a reader thread needs it, instead of stopping that thread when it gets
there.

On a local disk the hints cost throughput instead (the kernel's read-ahead
competes with the reader's own deep queue: cold, 90 -> 78 M tokens/s with one
reader thread here, 134 -> 74 with two), so by default they are used only where
the view's files live on a network or FUSE filesystem (by the mount's type in
``/proc/self/mountinfo``).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

REMOTE_TYPES = frozenset(
    {
        "nfs",
        "nfs4",
        "cifs",
        "smb3",
        "smbfs",
        "ceph",
        "lustre",
        "gpfs",
        "beegfs",
        "glusterfs",
        "9p",
        "afs",
        "wekafs",
        "fuse",
        "fuseblk",
    }
)
"""Filesystem types read over a network (FUSE types, ``fuse.*``, count too:
s3fs, gcsfuse, blobfuse, ...)."""


def parse_mountinfo(text: str) -> list[tuple[str, str]]:
    """``(mount point, filesystem type)`` of each line of ``/proc/self/mountinfo``."""
    mounts = []
    for line in text.splitlines():
        left, sep, right = line.partition(" - ")
        fields = left.split()
        if not sep or len(fields) < 5 or not right.split():
            continue
        point = (
            fields[4]
            .replace("\\040", " ")
            .replace("\\011", "\t")
            .replace("\\012", "\n")
            .replace("\\134", "\\")
        )
        mounts.append((point, right.split()[0]))
    return mounts


def filesystem_of(path: str, mounts: Iterable[tuple[str, str]]) -> str | None:
    """The type of the filesystem holding ``path``: the deepest mount point above it,
    the last mounted of several on one point (the one in view: an automounter's
    ``autofs`` is listed before the ``nfs4`` mounted over it)."""
    real = os.path.realpath(path)
    best, kind = -1, None
    for point, fstype in mounts:
        inside = real == point or real.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= best:
            best, kind = len(point), fstype
    return kind


def is_remote(fstype: str | None) -> bool:
    return fstype is not None and (fstype in REMOTE_TYPES or fstype.startswith("fuse."))


def _mounts() -> tuple[tuple[str, str], ...]:
    """The process's mounts now (read at each DataLoader: mounts come and go)."""
    try:
        with open("/proc/self/mountinfo") as f:
            return tuple(parse_mountinfo(f.read()))
    except OSError:
        return ()


def wanted(view: Any) -> bool:
    """The automatic choice: read ahead when the view can (``hint``) and a file it
    reads (``storage_paths()``) is on a network or FUSE filesystem."""
    paths = getattr(view, "storage_paths", None)
    if getattr(view, "hint", None) is None or paths is None:
        return False
    mounts = _mounts()
    # thousands of shards, a few directories; a shard that is a link, where it leads
    dirs = {os.path.dirname(os.path.realpath(p) if os.path.islink(p) else p) for p in paths()}
    return any(is_remote(filesystem_of(d, mounts)) for d in dirs)


class ReadAhead:
    """The read-ahead of one iterator's reader threads.

    Args:
        hint: the view's ``hint(indices)``.
        indices_of: the sample indices of a future task (None past the end).
    """

    def __init__(
        self, hint: Callable[[np.ndarray], Any], indices_of: Callable[[int], np.ndarray | None]
    ) -> None:
        self._hint = hint
        self._indices_of = indices_of
        self._done = 0  # tasks below this were hinted (or are being built)
        self._lock = threading.Lock()
        self.hinted = 0  # tasks hinted so far (for tests and benchmarks)

    def ahead(self, task: int, lead: int) -> None:
        """While ``task`` is built: hint the tasks up to ``task + lead`` not hinted yet."""
        with self._lock:
            first = max(self._done, task + 1)
            self._done = max(self._done, task + lead + 1)
        for t in range(first, task + lead + 1):
            idx = self._indices_of(t)
            if idx is None:
                return
            if len(idx):
                self._hint(idx)
                self.hinted += 1
