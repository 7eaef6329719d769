"""Foreign formats read in place, without conversion.

- Megatron indexed datasets (``prefix.bin`` + ``prefix.idx``, as written by
  megatron-core's ``IndexedDatasetBuilder``): ``open_megatron``.
- Flat headerless token files (``.bin`` or ``.npy`` arrays of uint16/uint32,
  as OLMo-core/dolma, nanotron/datatrove and nanoGPT write them), one or
  several files read as one stream: ``open_flat``. Document boundaries
  come from an offsets index or from an end-of-document token.

Opening reads headers only (the ``.idx`` header is 34 bytes; a ``.npy``
header is one block) and, for the fingerprint, the first and last 4 KiB of
each file; sequence pointers and lengths are read once, when a batch first
needs one, and held in memory within ``TOKLOAD_INDEX_MEMORY`` (else read per
access). Anything but a
regular file in a file's place (a FIFO, a device, a directory) is refused
before it is opened.
"""

from __future__ import annotations

import ast
import os
import stat as statmod
import struct
import tempfile
import weakref
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from tokload._docindex import DocIndex
from tokload._megatron import MegatronIndex
from tokload._rows import RowSet
from tokload.arguments import is_integer
from tokload.errors import FormatError, TokloadError
from tokload.files import Sample, create_unique, file_version, open_regular
from tokload.format import check_dtype, fingerprint
from tokload.location import Location
from tokload.source import Source, index_memory, reopenable

MEGATRON_MAGIC = b"MMIDIDX\x00\x00"
# megatron.core.datasets.indexed_dataset.DType codes
MEGATRON_DTYPES: dict[int, np.dtype[Any]] = {
    1: np.dtype(np.uint8),
    2: np.dtype(np.int8),
    3: np.dtype("<i2"),
    4: np.dtype("<i4"),
    5: np.dtype("<i8"),
    8: np.dtype("<u2"),
}
_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequences, documents + 1


def _read_head(loc: Location, path: str, what: str, size: int) -> bytes:
    return loc.read(path, what, 0, min(size, loc.size(path, what)))


@reopenable
def open_megatron(
    prefix: str | os.PathLike[str], storage_options: Mapping[str, Any] | None = None
) -> Source:
    """Open ``prefix.bin``/``prefix.idx`` (Megatron ``MMapIndexedDataset`` layout).

    The ``.idx`` holds: the magic ``MMIDIDX\\0\\0``, version (u64, 1), dtype code
    (u8), sequence count S (u64), document count D + 1 (u64), then int32
    lengths[S], int64 byte pointers[S], int64 document_indices[D + 1].

    As ``Documents``, observation ``i`` is sequence ``i``
    (what ``IndexedDataset[i]`` returns); as a
    ``TokenStream``, the stream is the ``.bin`` in order.
    ``source.user["document_indices"]`` reads Megatron's document index on
    demand.

    ``prefix`` may be an object-store URL (``s3://bucket/path/prefix``;
    ``storage_options`` as for ``open_dataset``).
    """
    prefix = os.fspath(prefix)
    loc = Location(prefix, storage_options, listed=False)
    prefix = loc.root
    idx_path, bin_path = prefix + ".idx", prefix + ".bin"
    idx_size = loc.size(idx_path, "Megatron index")
    bin_size = loc.size(bin_path, "Megatron data")
    head = _read_head(loc, idx_path, "Megatron index", _HEADER.size)
    if len(head) < _HEADER.size:
        raise FormatError(f"{idx_path}: {len(head)} bytes is too short for a Megatron index header")
    magic, version, code, nseq, ndoc1 = _HEADER.unpack(head)
    if magic != MEGATRON_MAGIC:
        raise FormatError(f"{idx_path}: bad magic {magic!r}; not a Megatron .idx")
    if version != 1:
        raise FormatError(f"{idx_path}: unknown Megatron index version {version}")
    if code not in MEGATRON_DTYPES:
        raise FormatError(f"{idx_path}: unsupported Megatron dtype code {code}")
    dtype = MEGATRON_DTYPES[code]
    len_off = _HEADER.size
    ptr_off = len_off + 4 * nseq
    doc_off = ptr_off + 8 * nseq
    need = doc_off + 8 * ndoc1
    if idx_size < need:
        raise FormatError(
            f"{idx_path}: {idx_size} bytes, but {nseq} sequences and {ndoc1} document "
            f"indices need {need}"
        )
    if bin_size % dtype.itemsize:
        raise FormatError(f"{bin_path}: {bin_size} bytes is not a multiple of {dtype} rows")
    rows = bin_size // dtype.itemsize
    bin_files = loc.fileset([bin_path])
    idx_files = loc.fileset([idx_path])
    rowset = RowSet(bin_files, [rows], dtype.itemsize)
    # every sequence's extents held (16 bytes each) when the index memory allows
    in_memory = 16 * nseq <= index_memory()
    seq_index = MegatronIndex(
        idx_files, nseq, len_off, ptr_off, dtype.itemsize, rows, in_memory=in_memory
    )
    src = Source(
        rows=rowset,
        dtype=dtype,
        docs=seq_index,
        meta=None,
        fingerprint=fingerprint(
            dtype,
            [
                (
                    rows,
                    nseq,
                    loc.sample_digest(bin_path, "Megatron data"),
                    loc.sample_digest(idx_path, "Megatron index"),
                )
            ],
        ),
        description=str(prefix),
        _closers=[bin_files, idx_files],
    )
    src.user = {
        "document_indices": lambda: np.frombuffer(
            loc.read(idx_path, "Megatron index", doc_off, doc_off + 8 * ndoc1), "<i8"
        ).copy()
    }
    return src


def _has_npy_magic(loc: Location, path: str) -> bool:
    """Whether ``path`` starts as NumPy's ``.npy`` format does (``\\x93NUMPY``)."""
    return _read_head(loc, path, "token file", 6) == b"\x93NUMPY"


def _npy_layout(loc: Location, path: str, what: str) -> tuple[np.dtype[Any], int, int]:
    """(dtype, rows, data offset) of a 1-D ``.npy`` file, from its header alone
    (versions 1.0 and 2.0, Latin-1, and 3.0, UTF-8: what ``np.save`` writes for
    field names outside Latin-1; a header of any length)."""
    size = loc.size(path, what)
    head = _read_head(loc, path, what, 12)
    try:
        if len(head) < 10 or head[:6] != b"\x93NUMPY":
            raise ValueError("the magic string is not \\x93NUMPY")
        version = (head[6], head[7])
        if version not in ((1, 0), (2, 0), (3, 0)):
            raise ValueError(f"format version {version[0]}.{version[1]} is not one NumPy writes")
        start = 10 if version == (1, 0) else 12
        if len(head) < start:
            raise ValueError("the header is cut short")
        (length,) = struct.unpack("<H" if version == (1, 0) else "<I", head[8:start])
        text = _read_head(loc, path, what, start + length)[start:]
        if len(text) < length:
            raise ValueError(f"the header is cut short ({len(text)} of its {length} bytes)")
        header = ast.literal_eval(text.decode("utf-8" if version == (3, 0) else "latin-1"))
        if not isinstance(header, dict) or set(header) != {"descr", "fortran_order", "shape"}:
            raise ValueError(f"the header is not the dict of a .npy file: {header!r}")
        shape = header["shape"]
        if not isinstance(shape, tuple) or not all(isinstance(x, int) for x in shape):
            raise ValueError(f"the header's shape is not a tuple of integers: {shape!r}")
        dtype = np.lib.format.descr_to_dtype(header["descr"])
    except Exception as e:  # (a malformed header: ValueError, SyntaxError, TypeError ...)
        hint = ""
        if not _has_npy_magic(loc, path):
            hint = (
                "; a headerless token file named .npy (as OLMo-core and dolma write "
                "them) is read with tokload.open_flat(path, dtype=...)"
            )
        raise FormatError(f"{path}: not a .npy file: {e}{hint}") from None
    offset = start + length
    if len(shape) != 1:
        raise FormatError(f"{path}: a {what} must be 1-D, got shape {shape}")
    rows = shape[0]
    if rows < 0 or dtype.itemsize == 0 or offset + rows * dtype.itemsize > size:
        raise FormatError(
            f"{path}: the header promises {rows} rows of {dtype} after byte {offset}, "
            f"but the file has {size} bytes"
        )
    return dtype, rows, offset


@reopenable
def open_flat(
    paths: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
    dtype: npt.DTypeLike | None = None,
    *,
    doc_index: str | os.PathLike[str] | Sequence[str | os.PathLike[str]] | None = None,
    eos: int | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> Source:
    """Open headerless token files (``.bin``, OLMo-core ``.npy``) or ``.npy`` arrays as one stream.

    Args:
        paths: one file or several (read in the order given, as shards).
        dtype: row dtype of headerless files (``uint16``/``uint32``;
            little-endian). A ``.npy`` file written by ``np.save`` carries its own
            (``dtype``, if given, must match it); one without NumPy's header (as
            OLMo-core and dolma write them, with ``np.memmap``) is read as headerless
            when ``dtype`` is given.
        doc_index: per file, a ``.npy`` or raw little-endian ``uint64`` array of
            ``documents + 1`` row offsets (0 first, the file's rows last, else
            FormatError); gives the source documents.
        eos: alternatively, the end-of-document token (an integer the dtype
            holds, else ValueError): document boundaries are
            found by one pass over each file the first time (vectorized, in
            chunks) and cached next to it as ``<file>.eos<token>.docs``, which
            later opens read without scanning. A document ends with its eos
            token; trailing tokens after the last eos form a last document.
            Local files only.
        storage_options: for object-store URLs (``s3://...``), as for
            ``open_dataset``.

    Without either, the source has a token stream but no documents.
    """
    given = [paths] if isinstance(paths, (str, os.PathLike)) else paths
    if not given:
        raise ValueError("open_flat needs at least one file")
    loc = Location(os.fspath(given[0]), storage_options, listed=False)
    for p in given:
        if Location(os.fspath(p), storage_options, listed=False).remote != loc.remote:
            raise ValueError(
                f"{os.fspath(p)}: open_flat takes local files or object-store URLs, not both "
                "in one source (open each kind apart and Blend them)"
            )
    plist = [os.fspath(p) if loc.remote else Location(p).root for p in given]
    if doc_index is not None and eos is not None:
        raise ValueError("give doc_index or eos, not both")
    if eos is not None and loc.remote:
        raise ValueError(
            f"{plist[0]}: eos= finds document boundaries with a pass over the files, which "
            "tokload does not do on an object store; give doc_index= (an offsets file next "
            "to the tokens) or build a tokload dataset (tokload build ... -o s3://...)"
        )
    layouts = []
    for p in plist:
        if p.endswith(".npy") and (dtype is None or _has_npy_magic(loc, p)):
            dt, rows, base = _npy_layout(loc, p, "token file")
            if dtype is not None and np.dtype(dtype) != dt:
                raise FormatError(f"{p}: holds {dt}, but dtype={np.dtype(dtype)} was given")
        else:
            if dtype is None:
                raise ValueError(f"{p}: a headerless file needs dtype= (e.g. np.uint16)")
            dt = np.dtype(dtype)  # as given: a big-endian one is refused below, not flipped
            size = loc.size(p, "token file")
            if size % dt.itemsize:
                raise FormatError(f"{p}: {size} bytes is not a whole number of {dt} rows")
            rows, base = size // dt.itemsize, 0
        layouts.append((dt, rows, base))
    dt0 = layouts[0][0]
    check_dtype(dt0, str(plist[0]))
    if eos is not None:
        _check_eos(eos, dt0, plist[0])
    for p, (dt, _, _) in zip(plist, layouts, strict=True):
        if dt != dt0:
            raise FormatError(f"{p}: dtype {dt} differs from {plist[0]}'s {dt0}")
    samples = [loc.sample_digest(p, "token file") for p in plist]
    files = loc.fileset(plist, [b for _, _, b in layouts])
    closers: list[Any] = [files]
    rowset = RowSet(files, [r for _, r, _ in layouts], dt0.itemsize)
    docs = None
    doc_counts = [0] * len(plist)
    private: list[Path] = []  # eos indexes that could not be cached next to the data
    try:
        if eos is not None:
            doc_index = [
                _eos_index(Path(p), r, b, dt0, int(eos), private)
                for p, (_, r, b) in zip(plist, layouts, strict=True)
            ]
        if doc_index is not None:
            ilist = [
                os.fspath(p) if loc.remote else Location(p).root
                for p in ([doc_index] if isinstance(doc_index, (str, os.PathLike)) else doc_index)
            ]
            if len(ilist) != len(plist):
                raise ValueError(f"{len(plist)} token files but {len(ilist)} document indexes")
            bases = []
            for k, ip in enumerate(ilist):
                if ip.endswith(".npy"):
                    idt, entries, ibase = _npy_layout(loc, ip, "document index")
                    if idt != np.dtype("<u8") and idt != np.dtype("<i8"):
                        raise FormatError(f"{ip}: a document index must be int64/uint64, got {idt}")
                else:
                    size = loc.size(ip, "document index")
                    if size % 8:
                        raise FormatError(f"{ip}: {size} bytes is not a whole number of uint64")
                    entries, ibase = size // 8, 0
                if entries < 1:
                    raise FormatError(f"{ip}: a document index needs at least one entry")
                ends = loc.sample(ip, "document index")
                _check_index_ends(loc, ip, ends, ibase, entries, plist[k], layouts[k][1])
                doc_counts[k] = entries - 1
                bases.append(ibase)
                samples[k] += ":" + ends.digest
            ifiles = loc.fileset(ilist, bases)
            closers.append(ifiles)
            in_memory = 8 * (sum(doc_counts) + len(doc_counts)) <= index_memory()
            docs = DocIndex(ifiles, doc_counts, rowset, in_memory)
    except BaseException:
        for c in closers:
            c.close()
        for tmp in private:
            tmp.unlink(missing_ok=True)
        raise
    src = Source(
        rows=rowset,
        dtype=dt0,
        docs=docs,
        meta=None,
        fingerprint=fingerprint(
            dt0,
            [(r, d, h) for (_, r, _), d, h in zip(layouts, doc_counts, samples, strict=True)],
        ),
        description=", ".join(map(str, plist)),
        _closers=closers,
    )
    for tmp in private:  # files may be (re)opened lazily: unlinked when the source goes
        src._closers.append(_Unlink(tmp))
        weakref.finalize(src, tmp.unlink, missing_ok=True)
    return src


def _check_eos(eos: Any, dtype: np.dtype[Any], path: str) -> None:
    """ValueError unless ``eos`` is a token that rows of ``dtype`` can hold (any other
    value matches no row: the whole file would be one document)."""
    if dtype.fields is not None:
        raise ValueError(f"{path}: eos= needs plain token rows, not the structured dtype {dtype}")
    if not is_integer(eos):
        raise ValueError(f"eos must be an integer token, got {eos!r}")
    info = np.iinfo(dtype)
    if not info.min <= int(eos) <= info.max:
        raise ValueError(
            f"{path}: eos={int(eos)} is not a token of its dtype {dtype} ({info.min} to {info.max})"
        )


def _check_index_ends(
    loc: Location, index: str, ends: Sample, base: int, entries: int, tokens: str, rows: int
) -> None:
    """FormatError unless the document index ``index`` (``entries`` uint64 from byte
    ``base``; ``ends`` its sample) starts at row 0 and ends at ``rows``, the token
    file's: a document index covers its file (the rows between would be in no
    document). The two entries come from the sample, read for the file's digest
    anyway, unless it does not hold them."""

    def entry(k: int) -> int:
        at = base + 8 * k
        got = ends.at(at, at + 8)
        if got is None:
            got = loc.read(index, "document index", at, at + 8)
        if len(got) != 8:  # the file shrank since it was sized
            raise FormatError(
                f"{index}: the document index changed while it was being opened; open it again"
            )
        return int(np.frombuffer(got, "<u8")[0])

    first, last = entry(0), entry(entries - 1)
    if first != 0 or last != rows:
        raise FormatError(
            f"{index}: a document index of {tokens} must run from row 0 to its {rows} rows, "
            f"but it runs from {first} to {last}"
        )


class _Unlink:
    """A closer that removes a private temporary file."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def close(self) -> None:
        self.path.unlink(missing_ok=True)


def _eos_index(
    path: Path, rows: int, base: int, dtype: np.dtype[Any], eos: int, private: list[Path]
) -> Path:
    """The document index of a token file from its eos tokens, cached next to it.

    Several processes may open the same file at once (every rank of a job
    does): each writes the cache under a unique temporary name and renames it
    into place atomically, so a reader sees no cache or a whole one. A cache
    is used only when it is a regular file of the right shape (0 first, never
    decreasing, the file's rows last) whose mtime is the version of the data it was computed
    from (the data's last change, by its mtime or its ctime: a copy that keeps
    an older mtime still sets the ctime) or later; otherwise the index is
    recomputed. A cache is written with the scanned version as its mtime, so a
    file replaced at any moment after the scan is newer than the cache; and
    it is cached only if the data did not change while scanned.
    Where the cache cannot be written (a read-only directory), the index goes
    to a private temporary file, appended to ``private`` for the caller to
    unlink when the source is closed or collected.
    """
    cache = path.with_name(f"{path.name}.eos{eos}.docs")
    st = os.stat(path)
    _check_unchanged(path, st, base + rows * dtype.itemsize)
    # a link on the way re-pointed to another (older) file is a change of the data
    before = max(_changed_ns(st), _links_changed_ns(path))
    if _cache_ok(cache, rows, before):
        return cache
    fd = open_regular(path, "token file")  # scanned through this one, checked to be that file
    try:
        _check_unchanged(path, os.fstat(fd), base + rows * dtype.itemsize, st)
        with open(fd, "rb", closefd=False) as f:
            data = np.memmap(f, dtype=dtype, mode="r", offset=base, shape=(rows,)) if rows else None
    finally:
        os.close(fd)
    ends: list[np.ndarray] = [np.zeros(1, dtype="<u8")]
    chunk = 1 << 24
    for start in range(0, rows, chunk):
        assert data is not None
        hits = np.flatnonzero(np.asarray(data[start : start + chunk]) == eos)
        ends.append((hits + start + 1).astype("<u8"))
    offsets = np.concatenate(ends)
    if offsets[-1] != rows:
        offsets = np.append(offsets, np.uint64(rows))
    payload = offsets.astype("<u8").tobytes()
    if file_version(os.stat(path)) != file_version(st):  # changed while scanned: cache nothing
        return _private_index(payload, private)
    try:
        fd, tmp = create_unique(cache.parent, f".{cache.name}-")
    except OSError:  # read-only directory, no permission, ...
        return _private_index(payload, private)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(payload)
        # the cache's mtime is the scanned file's version (_cache_ok): a file
        # replaced since, whenever this cache is renamed into place, is newer
        os.utime(tmp, ns=(before, before))
        os.replace(tmp, cache)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    if file_version(os.stat(path)) != file_version(st):  # replaced meanwhile: the old file's
        return _private_index(payload, private)
    return cache


def _check_unchanged(
    path: Path, st: os.stat_result, size: int, opened: os.stat_result | None = None
) -> None:
    """FormatError unless the file still holds the ``size`` bytes its rows need
    (and, given ``opened``, is the same file as that): it was replaced while
    being opened."""
    if st.st_size < size or (opened is not None and file_version(st) != file_version(opened)):
        raise FormatError(
            f"{path}: the file changed while it was being opened ({st.st_size} bytes now; "
            f"its rows needed {size}); open it again"
        )


def _private_index(payload: bytes, private: list[Path]) -> Path:
    """``payload`` in a private temporary file, appended to ``private``."""
    fd, name = tempfile.mkstemp(prefix="tokload-eos-", suffix=".docs")
    with os.fdopen(fd, "wb") as f:
        f.write(payload)
    private.append(Path(name))
    return Path(name)


def _changed_ns(st: os.stat_result) -> int:
    """When a file last changed, in ns: the later of its mtime and its ctime. A copy
    that keeps an older mtime (``cp -p``, ``rsync -a``, ``tar x``) still sets the
    ctime, which cannot be set back."""
    return max(st.st_mtime_ns, st.st_ctime_ns)


def _links_changed_ns(path: Path) -> int:
    """When a symbolic link that ``path`` goes through (the file's own, a
    directory's, one a link leads to) last changed, in ns (its ctime: when it
    was made or re-pointed); 0 without links. The cache sits beside the name
    given: a link re-pointed to an older file of the same size must not find
    the cache of the file it named before."""
    latest, hops = 0, 0
    todo = list(Path(os.path.abspath(path)).parts)
    at = Path(todo.pop(0))
    while todo:
        part = todo.pop(0)
        if part in (".", ""):
            continue
        if part == "..":
            at = at.parent
            continue
        step = at / part
        st = os.lstat(step)
        if not statmod.S_ISLNK(st.st_mode):
            at = step
            continue
        hops += 1
        if hops > 40:  # a loop: os.stat raised for it already; stop counting
            break
        latest = max(latest, st.st_ctime_ns)
        target = os.readlink(step)
        if os.path.isabs(target):
            at = Path(Path(target).anchor)
        todo[:0] = list(Path(target).parts[1:] if os.path.isabs(target) else Path(target).parts)
    return latest


def _cache_ok(cache: Path, rows: int, data_changed_ns: int) -> bool:
    """Whether ``cache`` is a usable document index of a file of ``rows`` rows that
    last changed at ``data_changed_ns`` (``_changed_ns``): computed from that
    version or a later one (its mtime), and whole (0 first, never decreasing,
    ``rows`` last: read through, ~0.4% of the bytes of data it saves scanning)."""
    try:
        fd = open_regular(cache, "document index cache")
    except (OSError, TokloadError):
        return False
    try:
        st = os.fstat(fd)
        if st.st_mtime_ns < data_changed_ns or st.st_size < 8 or st.st_size % 8:
            return False
        with open(fd, "rb", closefd=False) as f:
            prev, at = -1, 0
            while block := f.read(_CACHE_CHECK):
                t = np.frombuffer(block, dtype="<u8")
                if len(block) % 8 or (at == 0 and t[0] != 0):
                    return False
                if int(t[0]) < prev or bool(np.any(t[1:] < t[:-1])):
                    return False
                prev, at = int(t[-1]), at + len(block)
        return at == st.st_size and prev == rows
    finally:
        os.close(fd)


_CACHE_CHECK = 8 << 20
"""Bytes of an eos index cache checked at a time."""
