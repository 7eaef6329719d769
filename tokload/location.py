"""Where a dataset's files are: a local directory or an object-store URL prefix.

The one job of this module: one interface for both (``Location``), so the
code that opens datasets has one path: names joined, sizes checked, small files
read, ``FileSet``s made. A remote location lists its prefix once (sizes and
ETags) and reads files through the remote backend.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from tokload._io import FileSet
from tokload.errors import FormatError, MissingShardError, UsageError
from tokload.files import (
    Sample,
    open_regular,
    read_regular,
    regular_stat,
    sample,
    sample_digest,
)


class Location:
    """Where a dataset's files are: a local directory, or an object-store URL
    prefix (``s3://bucket/prefix``; see ``tokload.remote``).  One interface
    for both, so opening code has one path: names joined, sizes checked,
    small files read, FileSets made.  A remote location lists its prefix once
    (sizes and ETags) and reads files through the remote backend.

    Args:
        root: the directory or URL prefix (``file://`` is local).
        storage_options: the object store's options (remote only).
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        storage_options: Mapping[str, Any] | None = None,
        *,
        listed: bool = True,
    ) -> None:
        from tokload import remote

        self.remote = remote.is_url(root)
        self.options = storage_options
        self.listed = listed  # remote: one LIST of the prefix (else a HEAD per object)
        self._heads: dict[str, Any] = {}
        self._known: dict[str, tuple[int, int, int]] = {}  # local: (ino, size, mtime_ns)
        self.root: str = (
            # a local root made absolute: its files are opened as reads need them,
            # after the caller may have changed directory
            remote.normalize(os.fspath(root))
            if self.remote
            else os.path.abspath(remote.local_path(root))
        )
        self._objects: dict[str, Any] | None = None

    def join(self, name: str) -> str:
        """The path or URL of ``name`` under the root (``..`` resolved in a URL: a
        merged dataset names its parts' shards so)."""
        if self.remote:
            from tokload import remote

            try:
                return remote.join(self.root, name)
            except UsageError:  # a name from a manifest: the dataset's, not the caller's
                raise FormatError(
                    f"{self.root}: {name!r} climbs above the bucket (a dataset merged "
                    "elsewhere and stored here without its parts?)"
                ) from None
        return os.path.join(self.root, name)

    def stores_nothing(self) -> bool:
        """Whether a remote root's listing (when one was made) holds no object at all."""
        return self.remote and self._objects is not None and not self._objects

    def _object(self, path: str, what: str) -> Any:
        from tokload import remote

        if not self.listed or not path.startswith(self.root + "/"):
            if path not in self._heads:
                self._heads[path] = remote.head(path, what, self.options)
            return self._heads[path]
        if self._objects is None:
            self._objects = remote.listing(self.root, self.options)
        obj = self._objects.get(path)
        if obj is None:
            raise MissingShardError(2, f"missing {what}", path)
        return obj

    def size(self, path: str, what: str) -> int:
        """The size of a regular file or object (MissingShardError when absent)."""
        if self.remote:
            return int(self._object(path, what).size)
        st = regular_stat(path, what)
        self._known[path] = (st.st_ino, st.st_size, st.st_mtime_ns)
        return st.st_size

    def exists(self, path: str) -> bool:
        if not self.remote:
            return os.path.isfile(path)
        try:
            self._object(path, "object")
        except MissingShardError as e:
            from tokload import remote

            if remote.missing_bucket(e):
                raise
            return False
        return True

    def read(self, path: str, what: str, start: int = 0, end: int | None = None) -> bytes:
        """Bytes ``[start, end)`` of a file or object (all of it by default)."""
        if self.remote:
            from tokload import remote

            return remote.read_object(self._object(path, what), what, start, end)
        if start == 0 and end is None:
            return read_regular(path, what)
        fd = open_regular(path, what)
        try:
            size = os.fstat(fd).st_size
            end = size if end is None else end
            data = os.pread(fd, end - start, start)
        finally:
            os.close(fd)
        if len(data) != end - start:
            raise FormatError(f"{path}: {what}: {size} bytes, not the {end} it needs")
        return data

    def sample_digest(self, path: str, what: str, block: int = 4096) -> str:
        """``sample_digest`` of a file or object: SHA-256 of its size, first and
        last ``block`` bytes (the same value for a local copy and a remote one)."""
        if not self.remote:
            return sample_digest(path, what, block)
        return self.sample(path, what, block).digest

    def sample(self, path: str, what: str, block: int = 4096) -> Sample:
        """The size and the first and last ``block`` bytes of a file or object
        (``Sample``; its ``digest`` is ``sample_digest``'s): two reads."""
        return sample(self.size(path, what), lambda a, b: self.read(path, what, a, b), block)

    def fileset(self, paths: Sequence[str], bases: Sequence[int] | None = None) -> FileSet:
        """A FileSet of ``paths`` (objects keep the ETag they were listed with)."""
        if self.remote:
            objs = [self._object(p, "file") for p in paths]
            return FileSet(paths, bases, remote=objs)
        # a file opened later, by path, is checked to be the one sized here
        return FileSet(paths, bases, known=[self._known.get(p) for p in paths])
