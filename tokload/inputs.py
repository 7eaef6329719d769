"""Which files a build reads: the inputs a user means, never a dataset.

The one job of this module: turn the files, globs and directories given to
``tokload build`` into a sorted list of input files, and say what was found
and what was passed over.

- A file named on the command line is always an input, whatever its name.
- A glob's matches are taken like named files, except hidden ones (a shell
  would not have matched them either) and those ``exclude`` matches. A path
  that exists is itself, not a glob, whatever its name holds (``data[1].jsonl``).
- A directory is walked recursively and gives only **data files**: the
  known extensions (``.jsonl``/``.json``/``.ndjson``, optionally ``.gz``,
  ``.bz2``, ``.xz``, ``.zst``; ``.parquet``; ``.txt``), never hidden files or
  directories (``.git``, ``.gitattributes``, ``.cache``), never the usual
  metadata files of dataset repositories (``dataset_info.json``,
  ``state.json``, ``tokenizer.json``, ...), and never a tokload dataset
  (a directory holding a tokload ``manifest.json`` or a build's marker),
  so a dataset built inside its own input directory is not read back as
  text. ``include`` globs replace the extension rule (``--include '*.py'``
  takes Python files); ``exclude`` globs drop files. A pattern matches a
  file's path relative to the walked directory, or its name.
- Whatever is given, nothing inside ``output`` is an input.
- A path is read once however it is spelled (relative or absolute, with
  ``..``, a directory and a file in it): the first spelling in sorted order
  stands for it. Links are other paths: a file and a link to it are both read
  (a link upsamples a file); but a file reached again through a link to a
  directory (from another input, or a loop) is read once.
"""

from __future__ import annotations

import contextlib
import fnmatch
import glob
import os
import re
from collections import Counter
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tokload.errors import TokloadError

JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
COMPRESSED_SUFFIXES = (".gz", ".bz2", ".xz", ".zst")
TEXT_SUFFIXES = (".txt",)

BUILD_MARKER = ".tokload-build"
"""A file ``tokload build`` writes into its output before anything else: the
output is then known to hold a build (finished or not) that it may update."""

NON_DATA_NAMES = frozenset(
    {
        # Hugging Face datasets and hub repositories
        "dataset_info.json",
        "dataset_infos.json",
        "dataset_dict.json",
        "state.json",
        # tokenizers and model configurations kept beside data
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "config.json",
        "generation_config.json",
        "vocab.json",
        # dataset indexes of tokload and other loaders (MosaicML streaming, litdata)
        "manifest.json",
        "index.json",
    }
)
"""File names that are metadata, not data, though their extension is a data one."""


class InputError(TokloadError, ValueError):
    """An input cannot be used as given (e.g. it lies inside the output); names the path."""


def suffixes(path: str | os.PathLike[str]) -> list[str]:
    """``path``'s suffixes in lower case: ``DATA.JSONL.GZ`` is read as ``data.jsonl.gz``
    (its JSON is not taken for training text)."""
    return [s.lower() for s in Path(path).suffixes]


def kind(path: str | os.PathLike[str]) -> str:
    """``"jsonl"``, ``"parquet"`` or ``"text"``: how ``path`` is read (by its name)."""
    sx = suffixes(path) or [""]
    base = sx[-2] if len(sx) >= 2 and sx[-1] in COMPRESSED_SUFFIXES else sx[-1]
    if base in JSONL_SUFFIXES:
        return "jsonl"
    if sx[-1] == ".parquet":
        return "parquet"
    return "text"


def compressed(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is read through a decompressor (by its last suffix)."""
    return (suffixes(path) or [""])[-1] in COMPRESSED_SUFFIXES


def is_data_file(name: str) -> bool:
    """Whether a directory walk takes a file called ``name`` (without include globs)."""
    if name.startswith(".") or name.lower() in NON_DATA_NAMES:
        return False
    sx = suffixes(name)
    if sx and (sx[-1] == ".parquet" or sx[-1] in TEXT_SUFFIXES):
        return True
    if sx and sx[-1] in COMPRESSED_SUFFIXES:
        sx = sx[:-1]
    return bool(sx) and sx[-1] in JSONL_SUFFIXES


def is_dataset_dir(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` holds a tokload dataset or build (its manifest or build marker).

    A ``manifest.json`` counts when it is a JSON object saying ``"format":
    "tokload"`` (FORMAT.md): other tools' manifests do not hide a directory.
    """
    p = Path(path)
    if (p / BUILD_MARKER).is_file():
        return True
    manifest = p / "manifest.json"
    try:
        if not manifest.is_file() or manifest.stat().st_size > 64 << 20:
            return False
        with open(manifest, "rb") as f:
            head = f.read(4096)
    except OSError:
        return False
    return (
        head.lstrip().startswith(b"{") and re.search(rb'"format"\s*:\s*"tokload"', head) is not None
    )


SPELLED_AGAIN = "paths named again, spelled otherwise"


@dataclass
class Found:
    """The inputs found, and what a walk or glob passed over (for the user's report)."""

    files: list[Path] = field(default_factory=list)
    passed_over: Counter[str] = field(default_factory=Counter)  # reason -> files
    examples: dict[str, list[str]] = field(default_factory=dict)  # reason -> a few paths
    _skipped: dict[str, dict[str, Path]] = field(default_factory=dict, repr=False)

    def skip(self, reason: str, path: Path) -> None:
        key = str(path) if reason == SPELLED_AGAIN else os.path.abspath(path)
        self._skipped.setdefault(reason, {}).setdefault(key, path)

    def settle(self, read: Collection[str]) -> None:
        """Count what was passed over, each path once (under one reason), leaving
        out the paths of ``read`` (absolute: a file a walk passed over that a glob
        or a name took)."""
        counted = set(read)  # each path under one reason only
        for reason, paths in self._skipped.items():
            again = reason == SPELLED_AGAIN  # (those are read, under another spelling)
            shown = [p for a, p in paths.items() if again or a not in counted]
            counted.update(paths)
            if shown:
                self.passed_over[reason] = len(shown)
                self.examples[reason] = [str(p) for p in shown[:3]]

    def describe(self) -> str:
        """One line: how many files of each kind and their bytes, and what was passed over."""
        sizes: Counter[str] = Counter()
        counts: Counter[str] = Counter()
        for f in self.files:
            k = kind(f) + (" (compressed)" if compressed(f) else "")
            counts[k] += 1
            with contextlib.suppress(OSError):
                sizes[k] += f.stat().st_size
        total = sum(sizes.values())
        kinds = ", ".join(f"{counts[k]} {k} ({_mb(sizes[k])})" for k in sorted(counts))
        line = f"{len(self.files)} input files, {_mb(total)}: {kinds}"
        if self.passed_over:
            skipped = "; ".join(
                f"{n} {reason} (e.g. {', '.join(self.examples[reason])})"
                for reason, n in sorted(self.passed_over.items())
            )
            line += f"; passed over {skipped}"
        return line


def _mb(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


def _matches(rel: str, name: str, patterns: Sequence[str]) -> bool:
    return any(fnmatch.fnmatchcase(rel, p) or fnmatch.fnmatchcase(name, p) for p in patterns)


def _inside(path: Path, root: Path | None) -> bool:
    return root is not None and (path == root or root in path.parents)


def find_inputs(
    inputs: Sequence[str | os.PathLike[str]],
    *,
    output: str | os.PathLike[str] | None = None,
    include: Sequence[str] = (),
    exclude: Sequence[str] = (),
) -> Found:
    """The input files ``inputs`` name (see the module docstring), sorted and unique.

    Raises:
        FileNotFoundError: an input or a glob that matches nothing.
        InputError: an input is not a regular file or directory, or lies
            inside ``output`` (or is it).
    """
    out = Path(output).resolve() if output is not None else None
    found = Found()
    files = _Files()  # by absolute path: each path once
    for spec in inputs:
        s = os.fspath(spec)
        # a path that exists is itself, whatever its name holds ("data[1].jsonl")
        is_glob = glob.has_magic(s) and not os.path.lexists(s)
        matches = sorted(glob.glob(_pattern(s), recursive=True)) if is_glob else [s]
        if not matches:
            raise FileNotFoundError(2, "no input matches", s)
        for m in matches:
            p = Path(m)
            if _inside(p.resolve(), out):
                if is_glob:
                    found.skip("in the output", p)
                    continue
                raise InputError(
                    f"{p}: this input is inside the output {output}; a build never reads "
                    "its own output (name the input files, or build into another directory)"
                )
            if p.is_dir():
                _walk(p, out, include, exclude, found, files)
            elif p.is_file():
                if is_glob and (p.name.startswith(".") or _matches(str(p), p.name, exclude)):
                    found.skip("hidden or excluded", p)
                    continue
                _add(files, p, found)
            elif p.exists():
                raise InputError(f"{p}: an input must be a regular file or a directory")
            else:
                raise FileNotFoundError(2, "no such input", str(p))
    found.files = sorted(files.values())
    found.settle(files.keys())
    return found


def _pattern(spec: str) -> str:
    """The glob pattern of ``spec``: its longest leading part that exists is taken
    as it is spelled (``crawl[2024]/*.jsonl`` in the directory ``crawl[2024]``)."""
    parts = spec.split(os.sep)
    for k in range(len(parts) - 1, 0, -1):
        head = os.sep.join(parts[:k])
        if head and glob.has_magic(head) and os.path.lexists(head):
            return os.sep.join([glob.escape(head), *parts[k:]])
    return spec


REACHED_AGAIN = "files reached again through a link to a directory"


class _Files(dict[str, Path]):
    """The input files found, by absolute path (links not followed): each path once
    however spelled, and each file once however its directories were reached."""

    def __init__(self) -> None:
        super().__init__()
        self.places: dict[str, str] = {}  # a file's place, its directories' links followed
        self._real: dict[str, str] = {}  # a directory's real path

    def place(self, key: str) -> str:
        """Where the file ``key`` is, with the links to its directories followed but
        not its own (a link to a file is a file of its own)."""
        head, name = os.path.split(key)
        real = self._real.get(head)
        if real is None:
            real = self._real[head] = os.path.realpath(head)
        return os.path.join(real, name)


def _add(files: _Files, p: Path, found: Found) -> None:
    """Add file ``p``, unless ``files`` has it under another spelling (then the
    spelling that sorts first stands for it, whatever the order the inputs named
    them in) or reached through a link to a directory (then the path without
    one, else the one that sorts first). The path is made absolute
    without following links, which are other paths (the same on every machine
    of a ``--part`` build, whatever its copy kept of hard links)."""
    key = os.path.abspath(p)
    place = files.place(key)
    other = files.places.setdefault(place, key)
    if other != key:  # the file of another path: a directory reached twice
        seen = files[other]
        # the path that follows no link stands for it, else the one that sorts first
        if (key != place, str(p)) < (other != place, str(seen)):
            del files[other]
            files[key], files.places[place] = p, key
            p = seen
        found.skip(REACHED_AGAIN, p)
        return
    seen_p = files.get(key)
    if seen_p is None:
        files[key] = p
    elif seen_p != p:
        first, again = (p, seen_p) if str(p) < str(seen_p) else (seen_p, p)
        files[key] = first
        found.skip(SPELLED_AGAIN, again)


def _walk(
    top: Path,
    out: Path | None,
    include: Sequence[str],
    exclude: Sequence[str],
    found: Found,
    files: _Files,
) -> None:
    """Add the data files under ``top`` to ``files``; count what is passed over.

    Links to directories are followed (corpora are often put together from
    them); a directory reached a second time, through a link or a loop of
    links, is passed over, and a file reached again through a link to a
    directory, from this walk or another input, is one file (``_add``)."""
    walked: set[tuple[int, int]] = set()
    # A link to a directory under ``top`` itself is passed over wherever the walk
    # meets it, so that directory's files go by the path that follows no link.
    real_top = os.path.join(os.path.realpath(top), "")
    for dirpath, dirnames, filenames in os.walk(top, followlinks=True):
        here = Path(dirpath)
        st = os.stat(here)
        if (st.st_dev, st.st_ino) in walked:
            found.skip("directories reached again through a link", here)
            dirnames.clear()
            continue
        walked.add((st.st_dev, st.st_ino))
        if is_dataset_dir(here):
            found.skip("tokload datasets", here)
            dirnames.clear()
            continue
        kept = []
        for d in sorted(dirnames):
            sub = here / d
            if d.startswith("."):
                found.skip("hidden directories", sub)
            elif sub.is_symlink() and os.path.join(os.path.realpath(sub), "").startswith(real_top):
                found.skip("directories reached again through a link", sub)
            elif _inside(sub.resolve(), out):
                found.skip("the output", sub)
            else:
                kept.append(d)
        dirnames[:] = kept
        for name in sorted(filenames):
            p = here / name
            rel = str(p.relative_to(top))
            if name.startswith("."):
                found.skip("hidden files", p)
            elif name.lower() in NON_DATA_NAMES:  # --include replaces extensions, not this
                found.skip("files that are not data", p)
            elif include and not _matches(rel, name, include):
                found.skip("files not matching --include", p)
            elif not include and not is_data_file(name):
                found.skip("files that are not data", p)
            elif exclude and _matches(rel, name, exclude):
                found.skip("files matching --exclude", p)
            elif not p.is_file():
                found.skip("special files", p)
            else:
                _add(files, p, found)
