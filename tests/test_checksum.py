"""Checksums recorded while writing, deep verification, and fingerprints that identify data."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import xxhash

import tokload
from tokload import DataLoader, Documents, StateError, TokenStream
from tokload.checksum import verify_checksums

META_DT = [("token", "<u4"), ("metadata_id", "<u4")]
MEGATRON = Path(__file__).parent / "data" / "megatron"


def write(path: Path, seed: int = 0, metadata: bool = False) -> Path:
    rng = np.random.default_rng(seed)
    with tokload.Writer(
        path, META_DT if metadata else "<u4", metadata=metadata, shard_bytes=100, name_prefix="s"
    ) as w:
        for k in range(12):
            tokens = rng.integers(0, 1000, 5 + k % 4)
            if metadata:
                w.write({"token": tokens}, spans=[(0, 2, b"r%d" % k), (3, 4, b"")])
            else:
                w.write(tokens)
    return path


@pytest.mark.parametrize("metadata", [False, True])
def test_writer_records_the_xxh3_64_of_every_file(tmp_path: Path, metadata: bool) -> None:
    ds = write(tmp_path / "ds", metadata=metadata)
    m = json.loads((ds / "manifest.json").read_text())
    exts = ["rows", "docs", "mdx", "mdb"] if metadata else ["rows", "docs"]
    assert len(m["shards"]) > 1
    for s in m["shards"]:
        assert sorted(s["xxh3_64"]) == sorted(exts)
        for ext in exts:
            data = (ds / f"{s['name']}.{ext}").read_bytes()
            assert s["xxh3_64"][ext] == xxhash.xxh3_64(data).hexdigest()
    assert verify_checksums(ds) == []


def test_append_and_merge_carry_the_checksums(tmp_path: Path) -> None:
    a = write(tmp_path / "a")
    with tokload.Writer(a, mode="a", name_prefix="t") as w:
        w.write([1, 2, 3])
    b = write(tmp_path / "b", seed=1)
    merged = tokload.merge(tmp_path / "all", [a, b])
    assert all(s.checksums for s in merged.shards)
    first = tokload.format.read_manifest(a).shards[0]
    assert merged.shards[0].checksums == first.checksums
    assert verify_checksums(tmp_path / "all") == []


def test_deep_verify_names_the_first_damaged_file(tmp_path: Path) -> None:
    ds = write(tmp_path / "ds", metadata=True)
    assert verify_checksums(ds) == []
    # overwrite token bytes in place: sizes agree, so plain opening cannot notice
    victim = ds / "s-00001.rows"
    data = bytearray(victim.read_bytes())
    data[5] ^= 0x40
    victim.write_bytes(data)
    later = ds / "s-00002.mdb"
    later.write_bytes(b"X" * later.stat().st_size)
    TokenStream(ds, window=4)  # opens fine
    problems = verify_checksums(ds)
    assert len(problems) == 1
    assert problems[0].startswith(f"{victim}: damaged: its xxh3_64 is ")
    assert "the manifest records" in problems[0]
    victim.unlink()
    problems = verify_checksums(ds)
    assert problems[0].startswith(f"{victim}: cannot be checked: ")
    assert "missing shard .rows file" in problems[0]


def test_deep_verify_says_when_there_is_nothing_to_compare(tmp_path: Path) -> None:
    ds = write(tmp_path / "ds")
    m = json.loads((ds / "manifest.json").read_text())
    m["shards"][0].pop("xxh3_64")
    (ds / "manifest.json").write_text(json.dumps(m))
    n = len(m["shards"])
    assert verify_checksums(ds) == [
        f"{ds / 'manifest.json'}: 1 of {n} shards have no checksums recorded; "
        "their data could not be verified"
    ]
    for s in m["shards"]:
        s.pop("xxh3_64", None)
    (ds / "manifest.json").write_text(json.dumps(m))
    assert verify_checksums(ds) == [
        f"{ds / 'manifest.json'}: no checksums recorded (they are optional in the format: "
        "written by another tool, or by a tokload before it recorded them); --deep has "
        "nothing to verify the data against"
    ]
    with pytest.raises(tokload.MissingShardError, match="no tokload manifest"):
        verify_checksums(tmp_path / "nothing")


def test_file_checksum_streams_in_bounded_chunks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tokload import checksum

    monkeypatch.setattr(checksum, "CHUNK", 7)  # many chunks, a short last one
    blob = os.urandom(1000)
    (tmp_path / "f").write_bytes(blob)
    assert checksum.file_checksum(tmp_path / "f") == xxhash.xxh3_64(blob).hexdigest()


# ---- fingerprints identify the data, not only its sizes ------------------------------------


def _refused(old: tokload.views.View, new: tokload.views.View) -> None:
    assert len(old) == len(new)
    state = DataLoader(old, batch_size=2, seed=3).state_dict()
    with pytest.raises(StateError, match=r"saved for fingerprint="):
        DataLoader(new, batch_size=2, seed=3).load_state_dict(state)
    DataLoader(old, batch_size=2, seed=3).load_state_dict(state)  # the same data resumes


def test_same_sizes_other_tokens_change_the_tokload_fingerprint(tmp_path: Path) -> None:
    a = write(tmp_path / "a", seed=0)
    b = write(tmp_path / "b", seed=1)  # same names, same sizes, other tokens
    ma, mb = tokload.format.read_manifest(a), tokload.format.read_manifest(b)
    assert [(s.name, s.rows, s.documents) for s in ma.shards] == [
        (s.name, s.rows, s.documents) for s in mb.shards
    ]
    assert ma.fingerprint() != mb.fingerprint()
    _refused(Documents(a), Documents(b))
    # without checksums the fingerprint is FORMAT.md's name/size form, as before
    for path in (a, b):
        m = json.loads((path / "manifest.json").read_text())
        for s in m["shards"]:
            s.pop("xxh3_64")
        (path / "manifest.json").write_text(json.dumps(m))
    assert Documents(a).source.fingerprint == Documents(b).source.fingerprint


def test_same_sizes_other_data_change_megatron_and_flat_fingerprints(tmp_path: Path) -> None:
    for ext in (".bin", ".idx"):
        (tmp_path / f"a{ext}").write_bytes((MEGATRON / f"tiny_uint16{ext}").read_bytes())
        (tmp_path / f"b{ext}").write_bytes((MEGATRON / f"tiny_uint16{ext}").read_bytes())
    data = bytearray((tmp_path / "b.bin").read_bytes())
    data[-1] ^= 1  # the last token differs
    (tmp_path / "b.bin").write_bytes(data)
    _refused(Documents(tmp_path / "a"), Documents(tmp_path / "b"))
    assert Documents(tmp_path / "a").fingerprint == Documents(MEGATRON / "tiny_uint16").fingerprint

    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 60000, 100_000).astype(np.uint16)
    tokens.tofile(tmp_path / "x.bin")
    tokens[1] += 1  # the first block differs
    tokens.tofile(tmp_path / "y.bin")
    x = TokenStream(tokload.open_flat(tmp_path / "x.bin", np.uint16), window=64)
    y = TokenStream(tokload.open_flat(tmp_path / "y.bin", np.uint16), window=64)
    _refused(x, y)
    np.save(tmp_path / "x.npy", tokens)
    tokens[-1] += 1
    np.save(tmp_path / "y.npy", tokens)
    _refused(
        TokenStream(tokload.open_flat(tmp_path / "x.npy"), window=64),
        TokenStream(tokload.open_flat(tmp_path / "y.npy"), window=64),
    )
