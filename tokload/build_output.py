"""A build's output directory: what is tokload's, what is current, what is stale.

Each chunk's manifest records, under ``user["build"]``, what it was built
from: the input's identity (absolute path, size, modification time), the
chunk's range and the SHA-256 of the input bytes it covers, the tokenizer's
SHA-256 and every option that changes the output. A re-run reuses a chunk only
when that record equals what this run would build (``up_to_date``), rebuilds
the others, and removes chunks that are no longer in the plan
(``stale_parts``). Nothing that ``tokload build`` did not write is ever
removed: every chunk directory gets the build's marker first, and removal
renames a directory out of the way before it deletes it, the marker last, so
no crash leaves a half-removed chunk that looks complete. One build at a time
writes an output (``OutputLock``): a second one into the same directory is
refused at once, instead of each removing the other's chunks in progress.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tokload.build_plan import Chunk
from tokload.errors import TokloadError, UsageError
from tokload.files import LOCK_FILE, DirectoryLock
from tokload.format import MANIFEST, Manifest, read_manifest
from tokload.inputs import BUILD_MARKER
from tokload.tokenizer import TOKENIZER_FILE

PARTS = "parts"
"""The folder under the output that holds one dataset per chunk."""

MARKER_TEXT = (
    '{"written_by": "tokload build", "note": "this directory holds a tokload build; '
    'a re-run of the build updates it"}\n'
)


class OutputLock:
    """A build's hold on its output directory (made if missing), until ``release``:
    ``files.DirectoryLock`` taken without waiting.

    Raises:
        UsageError: another build holds it.
    """

    def __init__(self, out: Path) -> None:
        try:
            self.lock = DirectoryLock(out, wait=False)
        except BlockingIOError:
            raise UsageError(
                f"{out}: another tokload build is writing this directory now; wait for it "
                "to end, or build into another directory"
            ) from None

    def release(self) -> None:
        self.lock.release()


def ours(d: Path) -> bool:
    """Whether the directory ``d`` was written by tokload build: it holds the build's
    marker (every chunk directory gets one first) or a manifest recording a build."""
    if (d / BUILD_MARKER).is_file():
        return True
    try:
        user = read_manifest(d).user
    except (TokloadError, OSError, ValueError):
        return False
    # "build": what a chunk was built from; "input" and "chunk" are there since chunks were
    return isinstance(user.get("build"), dict) or {"input", "chunk"} <= user.keys()


def check_output(out: Path, files: Sequence[Path], force: bool) -> None:
    """Refuse an output whose files the build would mix with or replace unasked.

    A directory that is empty, or holds a build (its marker, or a manifest
    written by ``tokload build``), is fine; any other non-empty directory
    needs ``force`` (and its files stay untouched: one the build would write
    over, such as a ``Writer`` dataset's manifest, is refused even then). A
    build from inputs of which none is among ``files`` needs ``force`` to be
    replaced.
    """
    if not out.is_dir():
        return
    entries = sorted(p.name for p in out.iterdir() if p.name != LOCK_FILE)
    if not entries:
        return
    built = (out / BUILD_MARKER).is_file()
    if not built:
        with contextlib.suppress(TokloadError, OSError, ValueError):
            built = read_manifest(out).user.get("built_by") == "tokload build"
    if not built:
        if force:
            _check_beside(out)
            return
        shown = ", ".join(entries[:5]) + (", ..." if len(entries) > 5 else "")
        raise UsageError(
            f"{out}: the output directory is not empty and holds no tokload build "
            f"({shown}); build into a new or empty directory, or pass --force to build "
            "beside these files (none of them is changed or removed)"
        )
    recorded = _recorded_inputs(out)
    if recorded and not force and not recorded & {os.path.abspath(f) for f in files}:
        shown = ", ".join(sorted(recorded)[:3]) + (", ..." if len(recorded) > 3 else "")
        raise UsageError(
            f"{out}: holds a dataset built from other inputs ({shown}), none of which is an "
            "input of this build; build into another directory, or pass --force to replace it"
        )


def _check_beside(out: Path) -> None:
    """Refuse to build beside files of the user's that the build would write over.

    A build writes ``manifest.json`` and ``tokenizer.json`` (or removes it, for
    the byte tokenizer) at the top of its output, and its chunks under
    ``parts/``; in a directory it did not build, any of these already there is
    the user's (a ``Writer`` dataset, a model's tokenizer), so even ``--force``
    does not replace it.
    """
    taken = [name for name in (MANIFEST, TOKENIZER_FILE) if (out / name).exists()]
    if (out / PARTS).exists() and not (out / PARTS).is_dir():
        taken.append(PARTS)
    if taken:
        raise UsageError(
            f"{out}: holds {', '.join(taken)}, which tokload build did not write and would "
            "replace; --force builds beside other files but never over these: build into "
            "another directory"
        )


def _recorded_inputs(out: Path) -> set[str]:
    """The absolute paths of the inputs the chunks under ``out`` record."""
    parts = out / PARTS
    found: set[str] = set()
    if not parts.is_dir():
        return found
    for d in parts.iterdir():
        try:
            path = recorded_input(read_manifest(d))
        except (TokloadError, OSError, ValueError):
            continue
        if path is not None:
            found.add(path)
    return found


def recorded_input(chunk: Manifest) -> str | None:
    """The absolute path of the input a chunk's manifest records it was built from
    (``user["build"]["input"]["path"]``); None where it records none."""
    rec = chunk.user.get("build")
    if isinstance(rec, dict) and isinstance(rec.get("input"), dict):
        path = rec["input"].get("path")
        return path if isinstance(path, str) else None
    return None


def up_to_date(part: Path, base: dict[str, Any], chunk: Chunk) -> bool:
    """Whether ``part`` is complete and was built from ``chunk`` as it is now, with ``base``."""
    from tokload.source import open_dataset

    # opened as a reader opens it: the manifest, and its shards' files there, of their
    # sizes (a shard deleted or cut short since: the build would reuse the chunk and
    # then fail, leaving a manifest that lists it)
    try:
        src = open_dataset(part)
    except (TokloadError, OSError, ValueError):
        return False
    src.close()
    m = src.manifest
    assert m is not None  # (a tokload dataset's)
    rec = m.user.get("build")
    if not isinstance(rec, dict):
        return False  # built by a tokload that recorded nothing: rebuild
    got: dict[str, Any] = {key: rec.get(key) for key in base}
    want = dict(base)
    stats = m.user.get("stats")
    skipped_none = isinstance(stats, dict) and not stats.get("skipped")
    if skipped_none and isinstance(got.get("options"), dict):
        # A chunk that skipped nothing is the same whether bad records stop or are skipped.
        got["options"] = {**got["options"], "on_error": want["options"]["on_error"]}
    recorded_input, recorded_chunk = rec.get("input"), rec.get("chunk")
    if not isinstance(recorded_input, dict) or not isinstance(recorded_chunk, dict):
        return False
    same_input = [recorded_input.get(key) for key in ("path", "size", "mtime_ns")]
    same_chunk = {key: recorded_chunk.get(key) for key in chunk.record()}
    return bool(
        got == want
        and same_input == [os.path.abspath(chunk.path), *chunk.identity]
        and same_chunk == chunk.record()
    )


def stale_parts(parts: Path, plan: list[Chunk], mine: list[Chunk]) -> list[Path]:
    """Directories under ``parts`` that no longer belong: chunks (finished, temporary
    or half-removed) of inputs past the end of the input list, chunks of the inputs
    this build touches that are not in their plan, and parts of the old one-per-input
    layout. Chunks of inputs this build does not touch (other ``--part`` slices) stay."""
    stale = []
    is_stale = StaleChunks(plan, mine)
    for d in parts.iterdir():
        stem = d.name.split(".")[0]
        fields = stem.split("-")
        if not all(f.isdigit() for f in fields) or len(fields) > 2 or not ours(d):
            continue  # never remove what tokload build did not write
        if (
            d.name.endswith(".old")
            or is_stale(stem)
            or (d.name.endswith(".tmp") and int(fields[0]) in is_stale.touched)
        ):
            stale.append(d)
    return sorted(stale)


class StaleChunks:
    """Whether a chunk's name (``00000-00000``, or ``00000`` of the old one-per-input
    layout) no longer belongs to a build of ``plan`` that builds ``mine``: a chunk of
    an input past the end of the input list, or of an input this build touches but
    not in its plan. Chunks of inputs this build does not touch (other ``--part``
    slices) stay. For a local output (``stale_parts``) and an object store
    (``tokload.publish``) alike."""

    def __init__(self, plan: list[Chunk], mine: list[Chunk]) -> None:
        self.planned = {c.name for c in plan}
        self.touched = {c.input for c in mine}
        self.n_inputs = plan[-1].input + 1 if plan else 0

    def __call__(self, name: str) -> bool:
        fields = name.split("-")
        i = int(fields[0])
        return i >= self.n_inputs or (
            i in self.touched and (len(fields) == 1 or name not in self.planned)
        )


def temporaries(parts: Path, name: str) -> list[Path]:
    """The temporary directories of chunk ``name`` under ``parts`` (``ours`` or not)."""
    return sorted(parts.glob(f"{name}.*.tmp")) + [p for p in [parts / f"{name}.tmp"] if p.exists()]


def remove_temporaries(parts: Path, names: list[str]) -> None:
    """Remove the temporary directories of chunks ``names``, which this build was
    writing when it stopped. A worker stopped between creating one and writing
    the build's marker into it leaves it empty and unmarked: an empty directory
    of such a name is removed too (``os.rmdir`` removes only an empty one)."""
    for name in names:
        for d in temporaries(parts, name):
            if d.is_dir() and not d.is_symlink() and not ours(d):
                with contextlib.suppress(OSError):  # not empty: not ours, kept
                    os.rmdir(d)
                continue
            remove_dir(d)


def remove_dir(d: Path) -> None:
    """Remove a chunk directory so that no crash leaves it looking complete.

    The directory is first renamed (atomically) to ``*.old``, which no reader
    or re-run takes for a chunk, then deleted, the build's marker last, so a
    crash part-way leaves a directory that a re-run still knows to remove.
    Nothing that tokload build did not write (``ours``) is ever removed.
    """
    if not d.is_dir() or d.is_symlink() or not ours(d):
        return
    marker = d / BUILD_MARKER
    if not marker.exists():  # a chunk of an older build, known by its manifest
        marker.write_text(MARKER_TEXT)
    if not d.name.endswith(".old"):
        old = d.with_name(f"{d.name}.{secrets.token_hex(4)}.old")
        os.replace(d, old)
        d = old
    for child in d.iterdir():
        if child.name == BUILD_MARKER:
            continue
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child, ignore_errors=True)
        else:
            child.unlink(missing_ok=True)
    shutil.rmtree(d, ignore_errors=True)
