"""Regular files, opened safely: the one job of this module.

A dataset's files are opened only when they are regular files (a FIFO or a
device in a shard's place is refused by ``stat`` before the ``open`` that would
block on it); new files are created with the umask's mode under a unique name,
and directories are synced after a rename. Cheap identities of files without
checksums (``sample_digest``, ``Sample``) are computed here too.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import secrets
import stat
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Self

from tokload.errors import FormatError, MissingShardError


def file_kind(mode: int) -> str:
    """What a ``st_mode`` describes, for messages."""
    for test, kind in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return kind
    return "not a regular file"


def regular_size(path: str | os.PathLike[str], what: str) -> int:
    """The size of ``path``, which must be a regular file (symlinks followed).
    ``regular_stat``'s ``st_size``."""
    return regular_stat(path, what).st_size


def regular_stat(path: str | os.PathLike[str], what: str) -> os.stat_result:
    """The ``stat`` of ``path``, which must be a regular file (symlinks followed).

    Only ``stat``s, so a FIFO or device in a file's place is refused without
    the open that would block on it.

    Raises:
        MissingShardError: nothing is there.
        FormatError: something other than a regular file is there.
    """
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise MissingShardError(2, f"missing {what}", os.fspath(path)) from None
    if not stat.S_ISREG(st.st_mode):
        raise FormatError(
            f"{os.fspath(path)}: {what} is {file_kind(st.st_mode)}, not a regular file"
        )
    return st


def file_version(st: os.stat_result) -> tuple[int, ...]:
    """Which file, in which version: device, inode, size, mtime and ctime (in ns).
    Equal for two ``stat``s when nothing replaced or wrote the file between them
    (a copy that keeps an older mtime still sets the ctime)."""
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def open_regular(path: str | os.PathLike[str], what: str) -> int:
    """A read-only descriptor of a regular file, never blocking on a FIFO or device.

    ``stat`` first, then ``O_NONBLOCK`` (no effect on regular files) and
    ``fstat`` again, in case the file was replaced in between.
    """
    regular_size(path, what)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise MissingShardError(2, f"missing {what}", os.fspath(path)) from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise FormatError(f"{os.fspath(path)}: {what} is {file_kind(mode)}, not a regular file")
    return fd


def read_regular(path: str | os.PathLike[str], what: str) -> bytes:
    """All bytes of a regular file (see ``open_regular``)."""
    fd = open_regular(path, what)
    with os.fdopen(fd, "rb") as f:
        return f.read()


@dataclass(frozen=True)
class Sample:
    """A file's size and the bytes its ``sample_digest`` covers: the first
    ``block`` bytes (``head``) and the last ``block`` after them (``tail``,
    empty for a file of at most ``block`` bytes). Whoever needs a file's first
    or last bytes too reads them from here, not again."""

    size: int
    head: bytes
    tail: bytes

    @property
    def digest(self) -> str:
        """SHA-256 of the size, the head and the tail."""
        h = hashlib.sha256(self.size.to_bytes(8, "little"))
        h.update(self.head)
        h.update(self.tail)
        return h.hexdigest()

    def at(self, start: int, end: int) -> bytes | None:
        """The file's bytes ``[start, end)`` if the head or the tail holds them, else None."""
        if end <= len(self.head):
            return self.head[start:end]
        first = self.size - len(self.tail)
        if start >= first:
            return self.tail[start - first : end - first]
        return None


def sample(size: int, read: Callable[[int, int], bytes], block: int = 4096) -> Sample:
    """The ``Sample`` of ``size`` bytes that ``read(start, end)`` returns: two reads."""
    head = read(0, min(block, size))
    return Sample(size, head, read(max(block, size - block), size) if size > block else b"")


def sample_digest(path: str | os.PathLike[str], what: str, block: int = 4096) -> str:
    """SHA-256 of a file's size, first ``block`` bytes and last ``block`` bytes.

    A cheap identity for files that carry no checksum (two ``pread``s, whatever
    the size): it tells apart files of the same size whose headers or ends
    differ, without a pass over the data.
    """
    fd = open_regular(path, what)
    try:
        return sample(os.fstat(fd).st_size, lambda a, b: os.pread(fd, b - a, a), block).digest
    finally:
        os.close(fd)


def create_unique(directory: str | os.PathLike[str], prefix: str) -> tuple[int, str]:
    """Create a new file with a unique name in ``directory``, mode 0666 less the umask.

    (``tempfile.mkstemp`` would make it 0600, so a dataset renamed from it
    could not be read by another account, unlike its shards.)
    """
    for _ in range(100):
        tmp = os.path.join(directory, f"{prefix}{os.getpid()}-{secrets.token_hex(6)}.tmp")
        try:
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666), tmp
        except FileExistsError:
            continue
    raise FileExistsError(17, "could not find an unused temporary name", os.fspath(directory))


def fsync_dir(directory: str | os.PathLike[str]) -> None:
    dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


LOCK_FILE = ".tokload-lock"
"""The empty file a ``DirectoryLock`` locks where the directory itself cannot be
(NFS), left in place: removing a lock file races with the next process to open it."""

_held: set[int] = set()  # descriptors of the locks this process holds


def _drop_held_in_child() -> None:
    """A forked child's copies of the lock descriptors would keep the parent's locks
    (a flock belongs to the open file, which the child shares) after the parent let
    them go: closed in the child, the parent's stay."""
    for fd in _held:
        os.close(fd)
    _held.clear()


os.register_at_fork(after_in_child=_drop_held_in_child)


class DirectoryLock:
    """An exclusive ``flock`` on a directory, for one process at a time to update
    what it holds (a manifest, a build).

    Where the directory cannot be locked (NFS emulates ``flock`` with POSIX
    locks, which need a file open for writing), ``directory/.tokload-lock`` is
    locked instead. Where no lock can be had at all (ENOLCK), it warns and
    goes on without.

    Args:
        directory: the directory (made if missing).
        wait: wait for another holder; otherwise ``BlockingIOError`` at once.
    """

    def __init__(self, directory: str | os.PathLike[str], wait: bool = True) -> None:
        os.makedirs(directory, exist_ok=True)
        how = fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB)
        self.fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            fcntl.flock(self.fd, how)
        except BlockingIOError:
            os.close(self.fd)
            raise
        except OSError:  # EBADF on NFS: a file open for writing instead
            os.close(self.fd)
            path = os.path.join(directory, LOCK_FILE)
            self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
            try:
                fcntl.flock(self.fd, how)
            except BlockingIOError:
                os.close(self.fd)
                raise
            except OSError as e:
                warnings.warn(
                    f"{path}: no lock can be taken here ({e.strerror}): writers and builds "
                    "running at once into this directory are not kept apart",
                    RuntimeWarning,
                    stacklevel=2,
                )
        _held.add(self.fd)

    def release(self) -> None:
        """Let the lock go (idempotent)."""
        if self.fd in _held:
            _held.discard(self.fd)
            os.close(self.fd)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
