"""Datasets made from datasets: the one job of this module is ``merge`` (one
dataset that lists the shards of others, by writing a manifest only) and
``convert`` (a copy with its metadata in another layout, shard by shard through
``tokload.shardfiles.OpenShard``)."""

from __future__ import annotations

import dataclasses
import math
import os
import posixpath
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from tokload import remote
from tokload._meta import SPAN_DTYPE, decode_blocks
from tokload.errors import FormatError, UsageError
from tokload.files import fsync_dir, read_regular
from tokload.format import (
    LAYOUTS,
    MANIFEST,
    METADATA_FIELD,
    SHARD_FILES,
    U64,
    Manifest,
    ShardInfo,
    read_manifest,
    write_manifest,
)
from tokload.inputs import BUILD_MARKER
from tokload.location import Location
from tokload.shardfiles import OpenShard
from tokload.source import open_dataset
from tokload.writer import checked_block


def _refuse_output(out: Path) -> None:
    """UsageError if ``out`` is a file, FileExistsError if it holds a dataset (a
    manifest): checked before anything is written there."""
    if out.exists() and not out.is_dir():
        raise UsageError(f"{out}: the output must be a directory (or not exist yet); it is a file")
    if (out / MANIFEST).exists():
        raise FileExistsError(17, "a dataset already exists here", str(out))


def _new_dataset_dir(output: str | os.PathLike[str]) -> Path:
    """The directory a new dataset is written to (made if missing), refused as
    ``_refuse_output`` says."""
    out = Path(output)
    _refuse_output(out)
    out.mkdir(parents=True, exist_ok=True)
    return out


def _relative_to(output: str | os.PathLike[str], inputs: Sequence[Any]) -> list[str]:
    """Each input's path relative to ``output``: directories, or URLs of one bucket
    (a manifest names its shards by relative paths, which cannot lead from a
    bucket to a disk or to another bucket)."""
    paths = [os.fspath(p) for p in (output, *inputs)]
    urls = [remote.is_url(p) for p in paths]
    if not any(urls):
        top = Path(output).resolve()
        return [os.path.relpath(Path(p).resolve(), top) for p in inputs]
    parts = [
        remote.split_url(remote.normalize(p)) if u else None
        for p, u in zip(paths, urls, strict=True)
    ]
    if not all(parts) or len({p[:2] for p in parts if p}) > 1:
        raise UsageError(
            "the output and the inputs of a merge must be all local directories or all URLs "
            f"in one bucket (the manifest names the shards by relative paths), got "
            f"{', '.join(paths)}"
        )
    base, *keys = ["/" + p[2] for p in parts if p]
    return [posixpath.relpath(k, base) for k in keys]


def merge(
    output: str | os.PathLike[str],
    inputs: Sequence[str | os.PathLike[str]],
    storage_options: Mapping[str, Any] | None = None,
    *,
    partial: bool = False,
) -> Manifest:
    """Join datasets into one by writing a manifest only; no data is copied.

    The merged manifest lists every input's shards, in the order given, by
    their paths relative to ``output`` (FORMAT.md), so the inputs must stay
    where they are. All inputs need the same dtype and options (for builds of
    ``tokload build``, the options their manifests record but ``on_error``, and
    where two read one input file, one chunk size and no chunk held by both),
    each given once. ``output`` may not
    already hold a dataset or an unfinished build; a refused merge writes
    nothing. ``output`` and the inputs are local directories,
    or URLs in one bucket (``storage_options`` for the store): the manifest is
    then uploaded to ``output``.

    Inputs built by ``tokload build`` record their tokenizer: two that record
    other tokenizers are refused (their ids mean other things); when all record
    the same one, the merged manifest records it and ``output`` gets a copy of
    its file, so ``tokload inspect`` decodes the merged dataset.

    Parts of one ``tokload build --part k/N`` split must all be given: parts
    that leave out chunks of the inputs their build planned (a part not given)
    are refused, unless ``partial`` (merge the parts built so far, knowing the
    merged dataset lacks the rest).

    Returns the merged manifest.

    Raises:
        FileExistsError: ``output`` holds a dataset, an unfinished build, or a
            tokenizer file that is not the inputs' tokenizer.
        UsageError: local and remote paths mixed, URLs of several buckets, an
            input given twice, or (without ``partial``) a part of a split
            left out.
        FormatError: an input differs from the first in dtype or options,
            records another tokenizer, or cuts a file another input reads
            into chunks of another size or holds one of its chunks too.
    """
    if not inputs:
        raise ValueError("merge needs at least one input dataset")
    rels = _relative_to(output, inputs)
    for k, rel in enumerate(rels):
        if rel in rels[:k]:
            raise UsageError(
                f"{os.fspath(inputs[k])}: given twice; merged, its documents would come twice "
                "(to weight a dataset, blend it: tokload.Blend)"
            )
    top = remote.join(os.fspath(output), MANIFEST) if remote.is_url(output) else None
    if top is not None:
        if remote.exists(top, storage_options):
            raise FileExistsError(17, "a dataset already exists here", os.fspath(output))
    else:
        _refuse_output(Path(output))
        if (Path(output) / BUILD_MARKER).exists():
            raise FileExistsError(
                17,
                "holds a tokload build (unfinished: no manifest), whose next run would "
                "replace the merged manifest: merge into another directory",
                os.fspath(output),
            )
    manifests = [(os.fspath(p), read_manifest(p, storage_options)) for p in inputs]
    first = manifests[0][1]
    merged = Manifest(
        dtype=first.dtype,
        documents=first.documents,
        metadata=first.metadata,
        metadata_layout=first.metadata_layout,
        span_block=first.span_block,
    )

    for (path, m), rel in zip(manifests, rels, strict=True):
        if m.shape() != first.shape():
            raise FormatError(
                f"{path}: dtype={m.dtype}, documents={m.documents}, metadata={m.metadata} "
                f"(layout {m.shape()[3]}) differs from {manifests[0][0]}: dtype={first.dtype}, "
                f"documents={first.documents}, metadata={first.metadata} "
                f"(layout {first.shape()[3]})"
            )
        for s in m.shards:
            name = posixpath.normpath(posixpath.join(rel, s.name))
            merged.shards.append(dataclasses.replace(s, name=name))  # checksums carried over
        merged.user.setdefault("merged_from", []).append(rel)
    tok = _one_tokenizer(manifests)
    if tok is not None:
        merged.user["tokenizer"] = tok[1]
    _same_build_options(manifests)
    _every_part(manifests, partial)
    tok_file = None if tok is None else _tokenizer_file(tok[0], tok[1], output, storage_options)
    if top is None:
        _new_dataset_dir(output)  # (only now: a refused merge leaves no directory behind)
        if tok_file is not None:
            Path(tok_file[0]).write_bytes(tok_file[1])
        write_manifest(output, merged)
        return merged
    with tempfile.TemporaryDirectory(prefix="tokload-merge-") as staging:
        if tok_file is not None:
            copy = Path(staging) / posixpath.basename(tok_file[0])
            copy.write_bytes(tok_file[1])
            remote.put_file(tok_file[0], copy, storage_options)
        write_manifest(staging, merged)
        remote.put_file(top, Path(staging) / MANIFEST, storage_options)
    return merged


def _tokenizer_file(
    source: str | os.PathLike[str],
    desc: Any,
    out: str | os.PathLike[str],
    options: Mapping[str, Any] | None,
) -> tuple[str, bytes] | None:
    """Where under ``out`` the copy of the tokenizer file that the dataset at
    ``source`` records (``desc``, its manifest's record) goes, and its bytes:
    None when it records no file, or lacks it. FileExistsError when ``out``
    holds another file of that name, which the copy would replace."""
    name = desc.get("file") if isinstance(desc, dict) else None
    if not isinstance(name, str) or posixpath.basename(name) != name:
        return None
    data = _read_if_there(Location(source, options, listed=False), name)
    if data is None:
        return None
    out_loc = Location(out, options, listed=False)
    there = _read_if_there(out_loc, name)
    if there is not None and there != data:
        raise FileExistsError(
            17,
            f"holds a tokenizer file that is not the tokenizer of {os.fspath(source)}, "
            "which the copy would replace: write into another directory",
            out_loc.join(name),
        )
    return out_loc.join(name), data


def _read_if_there(loc: Location, name: str) -> bytes | None:
    """The bytes of the tokenizer file ``name`` under ``loc``, None if there is none."""
    try:
        return loc.read(loc.join(name), "tokenizer file")
    except FileNotFoundError:  # (MissingShardError is one)
        return None


def _one_tokenizer(manifests: list[tuple[str, Manifest]]) -> tuple[str, dict[str, Any]] | None:
    """``(the first input, its tokenizer record)`` when every input records the same
    tokenizer, None when one records none; FormatError when two record other ones."""

    def what(t: dict[str, Any]) -> dict[str, Any]:  # (where its file was is not what it is)
        return {k: v for k, v in t.items() if k not in ("source", "file")}

    toks = [(path, m.user.get("tokenizer")) for path, m in manifests]
    known = [(path, t) for path, t in toks if isinstance(t, dict)]
    for path, t in known[1:]:
        if what(t) != what(known[0][1]):
            same = all(t.get(k) == known[0][1].get(k) for k in ("kind", "sha256"))
            raise FormatError(
                f"{path}: tokenized with {_tokenizer_name(t, same)}, but {known[0][0]} with "
                f"{_tokenizer_name(known[0][1], same)}: a merge would mix ids that mean other "
                "things; build the inputs with one tokenizer"
            )
    return known[0] if known and len(known) == len(toks) else None


def _tokenizer_name(t: dict[str, Any], ids: bool = False) -> str:
    """The tokenizer a record names, with its BOS and EOS ids when ``ids`` (one
    file built with other ones)."""
    sha = t.get("sha256")
    return (
        f"{t.get('kind')!r}"
        + (f" (SHA-256 {str(sha)[:12]}...)" if sha else "")
        + (f", BOS {t.get('bos')}, EOS {t.get('eos')}" if ids else "")
    )


# Options of ``tokload build`` that leave the documents as they are: how they are cut
# into files, what a bad record does (a part that finished with "stop" had none), and
# the tokenizer (compared by _one_tokenizer).
_NOT_CONTENT = ("shard_bytes", "chunk_bytes", "on_error", "tokenizer")


def _same_build_options(manifests: list[tuple[str, Manifest]]) -> None:
    """FormatError when two inputs built by ``tokload build`` record options that
    make other documents (BOS/EOS, fields), cut an input file they both read into
    chunks of other sizes (parts of two chunk plans), or both hold a chunk of one
    file (parts of two splits, a part beside its whole build): documents twice."""
    built = [
        (path, m.user["options"], m.user)
        for path, m in manifests
        if m.user.get("built_by") == "tokload build" and isinstance(m.user.get("options"), dict)
    ]
    if not built:
        return
    path0, opts0, _ = built[0]
    first = {k: v for k, v in opts0.items() if k not in _NOT_CONTENT}
    for path, opts, _ in built[1:]:
        these = {k: v for k, v in opts.items() if k not in _NOT_CONTENT}
        if these != first:
            keys = sorted(k for k in first.keys() | these.keys() if first.get(k) != these.get(k))
            said, said0 = (", ".join(f"{k}={o.get(k)!r}" for k in keys) for o in (these, first))
            raise FormatError(
                f"{path}: built with {said}, but {path0} with {said0}: their "
                "documents differ; build the parts with the same options"
            )
    held: dict[str, list[tuple[str, Any, float, float]]] = {}  # file: (dataset, size, chunks)
    for path, opts, user in built:
        size = opts.get("chunk_bytes")
        for f, (lo, hi) in _chunks_read(user).items():
            for other, other_size, olo, ohi in held.get(f, ()):
                if other_size != size:
                    raise FormatError(
                        f"{path} and {other} both read {f}, cut into chunks of {size} "
                        f"and {other_size} bytes: merged, some of its documents would come "
                        "twice and others never; build the parts with one --chunk-size"
                    )
                if lo < ohi and olo < hi:
                    a, b = max(lo, olo), min(hi, ohi)
                    which = (
                        f"chunk {a:g}"
                        if b == a + 1
                        else f"chunks {a:g} to {b - 1:g}"
                        if b < math.inf
                        else f"its chunks from {a:g} on"
                    )
                    raise FormatError(
                        f"{path} and {other} both hold {which} of {f}: merged, its documents "
                        "would come twice; merge the parts of one --part k/N split, each once"
                    )
            held.setdefault(f, []).append((path, size, lo, hi))


def _every_part(manifests: list[tuple[str, Manifest]], partial: bool) -> None:
    """FormatError when inputs planned other numbers of chunks from the same
    inputs (an input changed between the builds); unless ``partial``, UsageError
    when the inputs that took their chunks from one build plan (the ``plan``
    record of ``tokload build``, one per ``--part k/N`` split) leave some of its
    chunks out."""

    def pair(v: Any) -> bool:
        return isinstance(v, list) and len(v) == 2 and all(type(x) is int for x in v)

    plans: dict[str, list[tuple[str, dict[str, Any]]]] = {}
    for path, m in manifests:
        p = m.user.get("plan") if m.user.get("built_by") == "tokload build" else None
        if (  # (a record of another shape, edited by hand: not checked)
            isinstance(p, dict)
            and isinstance(p.get("id"), str)
            and type(p.get("chunks")) is int
            and pair(p.get("span"))
            and pair(p.get("part"))
        ):
            plans.setdefault(p["id"], []).append((path, p))
    for parts in plans.values():
        (path0, p0), *rest = parts
        for path, p in rest:
            if p.get("chunks") != p0.get("chunks"):
                raise FormatError(
                    f"{path} and {path0}: built from inputs of the same names, split into "
                    f"{p.get('chunks')} and {p0.get('chunks')} chunks: an input changed "
                    "between the two builds (or they are other files of those names); "
                    "build every part again from the same inputs"
                )
        if partial:
            continue
        total = int(p0["chunks"])
        held = sorted(tuple(p["span"]) for _, p in parts)
        gaps, at = [], 0
        for lo, hi in held:
            if lo > at:
                gaps.append((at, lo))
            at = max(at, hi)
        if at < total:
            gaps.append((at, total))
        if not gaps:
            continue
        splits = {p["part"][1] for _, p in parts}
        missing = ""
        if len(splits) == 1:  # the parts (with chunks) of the split that are not given
            (n,) = splits
            given = {p["part"][0] for _, p in parts}
            ks = [k for k in range(n) if k not in given and k * total // n < (k + 1) * total // n]
            missing = " (" + ", ".join(f"--part {k}/{n}" for k in ks) + " not given)"
        where = ", ".join(f"{lo} to {hi - 1}" if hi > lo + 1 else f"{lo}" for lo, hi in gaps)
        lost = sum(hi - lo for lo, hi in gaps)
        names = ", ".join(path for path, _ in parts)
        raise UsageError(
            f"{names}: parts of one build of {total} chunks, which leave out {lost} of them "
            f"(chunks {where}){missing}: merged, their documents would be missing; give "
            "every part, or merge these alone with --partial (partial=True)"
        )


def _chunks_read(user: dict[str, Any]) -> dict[str, tuple[float, float]]:
    """Each input file a build read (absolute where its manifest records them) and
    the chunks ``[lo, hi)`` of it it holds (``hi`` infinite: to the file's end)."""
    files = user.get("input_files") or user.get("inputs") or []
    first = (user.get("input_range") or [0])[0]
    cut = user.get("chunk_range") or []
    out: dict[str, tuple[float, float]] = {}
    for k, f in enumerate(files):
        at = first + k
        lo = cut[1] if len(cut) == 4 and at == cut[0] else 0
        hi = cut[3] if len(cut) == 4 and at == cut[2] else math.inf
        out[str(f)] = (lo, hi)
    return out


def convert(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    layout: str = "blocks",
    *,
    span_block: int | None = None,
    durable: bool = True,
) -> Manifest:
    """Write a copy of a dataset with its metadata in another layout (FORMAT.md).

    ``layout="blocks"`` (version 3) or ``"spans"`` (version 2): the rows lose
    their ``metadata_id`` field if they have one (the other fields stay, as a
    structured dtype) and each shard gets metadata blocks or a span table;
    ``"per_token"`` (version 1): the rows gain a ``metadata_id`` field (a
    plain dtype becomes the field ``"tokens"``). ``span_block`` is the
    target's (default: 4096 rows per block, 1024 per span table block index
    entry; converting to the same layout with another ``span_block`` re-blocks
    it). Shards, documents and records stay as they are (a record no row
    refers to keeps no bytes when the source is in blocks), so a
    ``StreamWithMetadata`` of the copy gives the same batches,
    bit for bit. Memory stays within a shard's metadata (the rows are
    streamed in chunks). The tokenizer file a build records is copied too, so
    ``tokload inspect`` decodes the copy (a different file of its name already
    in ``dst``: FileExistsError). ``dst`` may not hold a dataset. Both are local
    directories (a URL is refused with ``UsageError``).

    Returns the new manifest.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(map(repr, LAYOUTS))}, got {layout!r}")
    for path in (src, dst):
        if remote.is_url(path):
            raise UsageError(
                f"{os.fspath(path)}: convert reads and writes local directories; "
                "copy the dataset here first, or convert it here and upload the result"
            )
    root, out = Path(src), Path(dst)
    # opened as a reader opens it, every file checked (regular files, sizes that
    # agree with the manifest) before any is read: a FIFO would block the reads
    # below forever
    source = open_dataset(root)
    source.close()
    m = source.manifest
    assert m is not None  # (a dataset's source has its manifest)
    if not m.metadata or not m.documents:
        raise FormatError(f"{root}: the dataset has no metadata (or no documents) to convert")
    block = checked_block(span_block, layout)
    if m.metadata_layout == layout and (layout == "per_token" or block == m.span_block):
        raise FormatError(
            f"{root}: the metadata already has layout {layout!r}"
            + ("" if layout == "per_token" else f" with span_block {block}")
            + "; nothing to convert"
        )
    old = m.dtype
    if layout != "per_token":
        if m.metadata_layout == "per_token":
            assert old.fields is not None
            keep = [(n, old.fields[n][0].str) for n in old.names or () if n != METADATA_FIELD]
            new: np.dtype[Any] = np.dtype(keep)
        else:
            new = old
    else:
        fields = (
            [("tokens", old.str)]
            if old.fields is None
            else [(n, old.fields[n][0].str) for n in old.names or ()]
        )
        new = np.dtype([*fields, (METADATA_FIELD, "<u4")])
    out = _new_dataset_dir(out)
    target = Manifest(
        dtype=new,
        documents=m.documents,
        metadata=True,
        user=dict(m.user),
        user_other=m.user_other,
        metadata_layout=layout,
        span_block=block,
    )
    names: set[str] = set()
    tok = _tokenizer_file(root, m.user.get("tokenizer"), out, None)
    tok_file: Path | None = None  # (written here: removed if the convert fails)
    try:
        for k, s in enumerate(m.shards):
            name = os.path.basename(s.name)
            if name in names:
                name = f"c{k:05d}-{name}"
            names.add(name)
            target.shards.append(_convert_shard(root, s, m, out, name, target, durable))
        if tok is not None and not Path(tok[0]).exists():
            # the tokenizer's copy travels with the dataset (inspect decodes with it)
            tok_file = Path(tok[0])
            tok_file.write_bytes(tok[1])
        if durable:
            fsync_dir(out)
        write_manifest(out, target)
    except BaseException:
        # a convert that fails leaves no shard of its own behind (a retry would
        # find them in its way): those it finished, as the failing one removed its own
        for done in target.shards:
            for ext in SHARD_FILES:
                (out / f"{done.name}.{ext}").unlink(missing_ok=True)
        if tok_file is not None:
            tok_file.unlink(missing_ok=True)
        raise
    return target


_CHUNK_ROWS = 1 << 22


def _source_metadata(
    base: str, s: ShardInfo, m: Manifest, rows: np.ndarray | None
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """A shard's runs (starts, records) and records (mdx, mdb), whatever its layout."""
    if m.blocks:
        index = _read_array(f"{base}.mbx", U64)
        msb = _read_array(f"{base}.msb", np.uint8)
        got: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] = decode_blocks(
            m.span_block, s.rows, s.metadata_records, index, msb, f"{base}.mbx", f"{base}.msb"
        )
        return got
    mdx = _read_array(f"{base}.mdx", U64)
    mdb = _read_array(f"{base}.mdb", np.uint8)
    if m.spans:
        runs = _read_array(f"{base}.mds", SPAN_DTYPE) if s.metadata_runs else None
        if runs is None:
            return np.zeros(0, np.uint64), np.zeros(0, np.uint32), mdx, mdb
        return runs["start"].copy(), runs["record"].copy(), mdx, mdb
    starts: list[np.ndarray] = []
    records: list[np.ndarray] = []
    last = None
    for a in range(0, s.rows, _CHUNK_ROWS):
        assert rows is not None
        ids = np.asarray(rows[a : a + _CHUNK_ROWS][METADATA_FIELD])
        change = np.flatnonzero(ids[1:] != ids[:-1]) + 1
        if last is None or ids[0] != last:
            change = np.concatenate([[0], change])
        starts.append(change.astype(np.uint64) + np.uint64(a))
        records.append(ids[change].astype(np.uint32))
        last = ids[-1]
    if not starts:
        return np.zeros(0, np.uint64), np.zeros(0, np.uint32), mdx, mdb
    return np.concatenate(starts), np.concatenate(records), mdx, mdb


def _read_array(path: str, dtype: Any) -> np.ndarray:
    """A whole file as an array (a regular file: never blocking on a FIFO)."""
    return np.frombuffer(read_regular(path, "shard file"), dtype=dtype)


def _convert_shard(
    root: Path, s: ShardInfo, m: Manifest, out: Path, name: str, target: Manifest, durable: bool
) -> ShardInfo:
    shard = OpenShard(out, name, target, durable)
    try:
        base = str(root / s.name)
        rows = (
            np.memmap(f"{base}.rows", dtype=m.dtype, mode="r", shape=(s.rows,)) if s.rows else None
        )
        starts, records, mdx, mdb = _source_metadata(base, s, m, rows)
        ends = np.append(starts[1:], np.uint64(s.rows))
        for a in range(0, s.rows, _CHUNK_ROWS):
            assert rows is not None
            chunk = np.asarray(rows[a : a + _CHUNK_ROWS])
            packed = np.empty(len(chunk), target.dtype)
            for n in target.dtype.names or ("tokens",):
                if n == METADATA_FIELD:
                    b = a + len(chunk)
                    r0 = int(np.searchsorted(starts, a, side="right")) - 1
                    r1 = int(np.searchsorted(starts, b, side="left"))
                    lo = np.maximum(starts[r0:r1], a)
                    hi = np.minimum(ends[r0:r1], b)
                    packed[n] = np.repeat(records[r0:r1], (hi - lo).astype(np.int64))
                elif target.dtype.names is None:
                    packed = chunk if m.dtype.names is None else chunk[n]
                else:
                    packed[n] = chunk if m.dtype.names is None else chunk[n]
            shard.put(0, np.ascontiguousarray(packed).view(np.uint8).data)
        if target.metadata_layout != "per_token":
            e = np.empty(len(starts), SPAN_DTYPE)
            e["start"], e["record"] = starts, records
            shard.put(4, e.tobytes())
            shard.runs = len(e)
        if target.spans:
            nblocks = -(-s.rows // target.span_block)
            at = np.arange(nblocks, dtype=np.uint64) * np.uint64(target.span_block)
            idx = np.searchsorted(starts, at, side="right") - 1
            shard.put(5, idx.astype(U64).tobytes())
        # documents and records are copied as they are
        if m.documents:
            data = read_regular(f"{base}.docs", "shard .docs file")
            shard.put(1, data[8:])  # OpenShard wrote the first 0 already
        shard.put(2, mdx[1:].astype(U64).tobytes())
        shard.put(3, mdb.data)
        shard.rows, shard.documents = s.rows, s.documents
        shard.records, shard.meta_bytes = s.metadata_records, int(mdx[-1])
        return shard.finish(durable)
    except BaseException:
        for f in shard.files:
            f.close()
        shard.remove()
        raise
