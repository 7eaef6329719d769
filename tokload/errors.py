"""tokload's exceptions.

Every problem with a dataset's files raises a subclass of ``TokloadError``
whose message names the file and the offending value.  The classes also
derive from the built-in exception a caller would expect (``ValueError``,
``OSError``, ``FileNotFoundError``), so generic handlers still work.
"""

from __future__ import annotations


class TokloadError(Exception):
    """Base class of tokload's own exceptions."""


class FormatError(TokloadError, ValueError):
    """A dataset's manifest or files are not what the format requires
    (unknown version, sizes that disagree with the manifest, bad dtype)."""


class CorruptDataError(FormatError):
    """An index disagrees with the data it indexes (offsets decreasing or past
    the end, a metadata id past its index)."""


class MissingShardError(TokloadError, FileNotFoundError):
    """A file the manifest lists is not there."""


class TruncatedFileError(TokloadError, OSError):
    """A file ended before the data the manifest promised (it shrank after
    the dataset was opened, or was never fully written)."""


class RemoteError(TokloadError, OSError):
    """A read from an object store failed: after its retries (throttling,
    timeouts, dropped connections), or at once where a retry cannot help (no
    credentials, access denied, an unreachable endpoint once its retries are
    spent).  The message gives the URL, the byte range and the cause;
    ``url``, ``start``, ``end`` (``None`` for a whole object) and ``attempts``
    are attributes too."""

    def __init__(
        self,
        message: str,
        url: str = "",
        start: int | None = None,
        end: int | None = None,
        attempts: int = 1,
    ) -> None:
        super().__init__(message)
        self.url = url
        self.start = start
        self.end = end
        self.attempts = attempts

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class RemoteAccessError(RemoteError, PermissionError):
    """The object store refused the request: no credentials, credentials it
    does not accept, or access denied to the bucket or object."""


class ObjectChangedError(RemoteError):
    """An object changed (another ETag or size) since the dataset was opened:
    its bytes could belong to other data, so tokload refuses to read them."""


class RangesIgnoredError(RemoteError):
    """The server answered ranged GETs with the whole object (``200``, not ``206``),
    again and again: it, or a proxy in front of it, does not honour ``Range``,
    which every read of tokload needs."""


class StateError(TokloadError, ValueError):
    """A saved loader state does not belong to this dataset or configuration."""


__all__ = [
    "BuildError",
    "CorruptDataError",
    "FormatError",
    "MissingShardError",
    "ObjectChangedError",
    "RangesIgnoredError",
    "RemoteAccessError",
    "RemoteError",
    "StateError",
    "TokloadError",
    "TruncatedFileError",
    "UsageError",
]


class BuildError(TokloadError, ValueError):
    """Bad input during a build; the message names the file and line."""


class UsageError(TokloadError, ValueError):
    """The arguments of a command are wrong (the ``tokload`` command exits with 2)."""
