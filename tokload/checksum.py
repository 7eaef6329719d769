"""Deep verification: recompute the checksums the writer recorded (FORMAT.md).

The one job of this module is ``verify_checksums``, which ``tokload verify
--deep`` runs. It reads every byte of a dataset once, in fixed-size chunks
(memory stays bounded whatever the file sizes), so it costs a full pass over
the data; opening a dataset never does this.
"""

from __future__ import annotations

import os

import xxhash

from tokload import remote
from tokload.errors import TokloadError
from tokload.files import open_regular
from tokload.format import CHECKSUM_KEY, MANIFEST, manifest_at
from tokload.location import Location

CHUNK = 8 << 20
"""Bytes read per call while hashing."""


def file_checksum(path: str | os.PathLike[str], what: str = "file") -> str:
    """The xxh3_64 of a regular file's (or object's) bytes, as 16 lowercase hex digits.

    Reads in chunks of ``CHUNK`` bytes into one reused buffer (an object in an
    object store: one ranged GET per chunk).
    """
    if remote.is_url(path):
        obj = remote.head(os.fspath(path), what)
        h = xxhash.xxh3_64()
        for start in range(0, obj.size, CHUNK):
            h.update(remote.read_object(obj, what, start, min(obj.size, start + CHUNK)))
        return h.hexdigest()
    fd = open_regular(path, what)
    try:
        h = xxhash.xxh3_64()
        buf = bytearray(CHUNK)
        view = memoryview(buf)
        while n := os.readv(fd, [buf]):
            h.update(view[:n])
    finally:
        os.close(fd)
    return h.hexdigest()


def verify_checksums(path: str | os.PathLike[str]) -> list[str]:
    """Recompute every shard file's xxh3_64 and compare it with the manifest.

    Args:
        path: a tokload dataset directory or object-store URL prefix.

    Returns:
        The problems found, each a line naming the file; empty when every
        recorded checksum matches. Stops at the first damaged (or missing,
        or unreadable) file, so the first problem names it. A dataset, or
        some of its shards, without recorded checksums (written before
        tokload recorded them) gives a line saying so: their bytes could
        not be verified.

    Raises:
        MissingShardError, FormatError: the manifest itself is missing or bad.
    """
    loc = Location(path)
    m = manifest_at(loc)
    exts = m.files()
    problems: list[str] = []
    unchecked = 0
    for s in m.shards:
        sums = s.checksums or {}
        if not sums:
            unchecked += 1
            continue
        for ext in exts:
            want = sums.get(ext)
            if want is None:
                continue
            file = loc.join(f"{s.name}.{ext}")
            try:
                got = file_checksum(file, f"shard .{ext} file")
            except (OSError, TokloadError) as e:
                return [f"{file}: cannot be checked: {e}"]
            if got != want:
                return [
                    f"{file}: damaged: its {CHECKSUM_KEY} is {got}, the manifest records {want}",
                ]
    if unchecked:
        where = loc.join(MANIFEST)
        if unchecked == len(m.shards):
            problems.append(
                f"{where}: no checksums recorded (they are optional in the format: written "
                "by another tool, or by a tokload before it recorded them); --deep has nothing "
                "to verify the data against"
            )
        else:
            problems.append(
                f"{where}: {unchecked} of {len(m.shards)} shards have no checksums recorded; "
                "their data could not be verified"
            )
    return problems
