"""``tokload build`` against the tokenizer alone and Megatron-LM's preprocessing recipe.

    flock /tmp/tokload-bench.lock python -m bench.bench_build --mb 200

One run, on the same cores and the same texts:

* a real-text corpus of ``--mb`` MB of text made from files every machine with
  Python has: the standard library's sources, ``/usr/share/doc`` and
  ``/usr/share/man`` pages, and the installed packages' sources and docs
  (deduplicated, split into documents of at most 32 KB at line ends), written
  as one big JSONL file and as 64 small ones; each record has an ``id`` and
  character-span annotations (``spans``: words like ``def``, ``the``);
* a 16k byte-level BPE ``tokenizer.json`` trained on 16 MB of it with
  ``tokenizers`` (cached in the work directory);
* the tokenizer alone: ``encode_batch`` (and ``encode_batch_fast``) over the same
  texts in batches of 256, its Rust thread pool on all cores, texts already in
  memory;
* ``tokload build`` as a user runs it (a new process, the same tokenizer), at
  ``-j 1`` and ``-j 2``, on the big file and on the small ones, without and with
  metadata (``--keep-field id --annotations spans``);
* Megatron-LM's ``tools/preprocess_data.py`` recipe: a ``multiprocessing.Pool``
  of ``-j`` workers mapping ``json.loads`` + ``encode`` + EOD over the lines
  (``imap``, chunksize 32), the parent appending each document to megatron-core's
  ``IndexedDatasetBuilder`` (``.bin``/``.idx``); its tokenizer is the same
  ``tokenizers`` object (Megatron wraps it in ``transformers``, which only adds
  time).

Throughput is MB of text (UTF-8 bytes of the ``text`` fields) per second of
wall time, for every row, so the ratios compare like with like. The figures
and ratios are printed as a table (``--json`` for machines) and written to
``bench/results/bench_build.json`` with issue 14's goals: ``tokload build -j N``
at least 90% of ``encode_batch`` on N threads (80% with metadata), and at
least 1.5x Megatron's recipe on the same cores.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import multiprocessing as mp
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench import _results

_WORDS = re.compile(r"\b(def|class|import|return|the|and|of|to)\b")
_DOC_CHARS = 32 << 10
_SMALL_FILES = 64


# ---- the corpus -------------------------------------------------------------------------


def _sources() -> Iterator[Path]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    purelib = Path(sysconfig.get_paths()["purelib"])
    yield from sorted(stdlib.glob("*.py"))
    for sub in sorted(p for p in stdlib.iterdir() if p.is_dir() and p != purelib.parent):
        if sub.name != "site-packages":
            yield from sorted(sub.rglob("*.py"))
    for root in (Path("/usr/share/doc"), Path("/usr/share/man")):
        if root.is_dir():
            yield from sorted(p for p in root.rglob("*") if p.is_file())
    for ext in ("*.py", "*.pyi", "*.md", "*.rst", "*.txt"):
        yield from sorted(purelib.rglob(ext))


def _read_text(p: Path) -> str | None:
    try:
        data = p.read_bytes()
        if p.suffix == ".gz":
            data = gzip.decompress(data)
        if b"\0" in data[:4096]:
            return None
        return data.decode("utf-8")
    except (OSError, UnicodeDecodeError, EOFError, gzip.BadGzipFile):
        return None


def _documents(text: str) -> Iterator[str]:
    while len(text) > _DOC_CHARS:
        cut = text.rfind("\n", 0, _DOC_CHARS) + 1 or _DOC_CHARS
        yield text[:cut]
        text = text[cut:]
    if text.strip():
        yield text


def make_corpus(work: Path, mb: int) -> dict[str, Any]:
    """Write ``big.jsonl`` and ``small/*.jsonl`` of ``mb`` MB of text (once, then reused)."""
    info_path = work / f"corpus-{mb}.json"
    if info_path.exists():
        return dict(json.loads(info_path.read_text()))
    target = mb * 1_000_000
    seen: set[bytes] = set()
    records: list[bytes] = []
    text_bytes = unique = 0
    passes = 0
    while text_bytes < target:
        passes += 1
        for p in _sources():
            text = _read_text(p)
            if text is None:
                continue
            for doc in _documents(text):
                h = hashlib.sha1(doc.encode("utf-8", "surrogatepass")).digest()
                if passes == 1:
                    if h in seen:
                        continue
                    seen.add(h)
                    unique += len(doc.encode())
                spans = [
                    {"start": m.start(), "end": m.end(), "concept": m.group()}
                    for m in _WORDS.finditer(doc, 0, 4096)
                ][:16]
                rec = {"text": doc, "id": f"{len(records)}", "spans": spans}
                records.append(json.dumps(rec, ensure_ascii=False).encode() + b"\n")
                text_bytes += len(doc.encode())
                if text_bytes >= target:
                    break
            if text_bytes >= target:
                break
        if passes == 1 and not records:
            raise SystemExit("no text found on this machine")
    (work / "small").mkdir(parents=True, exist_ok=True)
    with open(work / "big.jsonl", "wb") as f:
        f.writelines(records)
    per = -(-len(records) // _SMALL_FILES)
    for k in range(_SMALL_FILES):
        with open(work / "small" / f"part-{k:03d}.jsonl", "wb") as f:
            f.writelines(records[k * per : (k + 1) * per])
    info = {
        "text_mb": text_bytes / 1e6,
        "unique_text_mb": unique / 1e6,
        "documents": len(records),
        "jsonl_mb": (work / "big.jsonl").stat().st_size / 1e6,
    }
    info_path.write_text(json.dumps(info))
    return info


def train_tokenizer(work: Path, vocab: int = 16384) -> Path:
    out = work / "tokenizer.json"
    if out.exists():
        return out
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )

    def sample() -> Iterator[str]:
        n = 0
        with open(work / "big.jsonl", "rb") as f:
            for line in f:
                text = json.loads(line)["text"]
                n += len(text)
                yield text
                if n > 16_000_000:
                    return

    tok.train_from_iterator(sample(), trainer)
    tok.save(str(out))
    return out


def load_texts(path: Path) -> list[str]:
    with open(path, "rb") as f:
        return [json.loads(line)["text"] for line in f]


# ---- the measurements ---------------------------------------------------------------------


def tokenizer_alone(tj: Path, big: Path, threads: int, fast: bool) -> float:
    """encode_batch over the texts of ``big`` (already in memory), in a new process whose
    Rust thread pool has ``threads`` threads."""
    code = (
        "import sys; from bench.bench_build import _alone; "
        f"print(_alone({str(tj)!r}, {str(big)!r}, {fast}))"
    )
    env = {**os.environ, "RAYON_NUM_THREADS": str(threads)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(out.stderr)
    return float(out.stdout.split()[-1])


def _alone(tj: str, big: str, fast: bool) -> float:
    from tokenizers import Tokenizer

    texts = load_texts(Path(big))
    tok = Tokenizer.from_file(tj)
    encode = tok.encode_batch_fast if fast else tok.encode_batch
    t0 = time.perf_counter()
    for i in range(0, len(texts), 256):
        encode(texts[i : i + 256], add_special_tokens=False)
    return time.perf_counter() - t0


def tokload_build(inputs: list[Path], out: Path, tj: Path, workers: int, meta: bool) -> float:
    """A ``tokload build`` process, timed from start to exit. At ``-j 1`` the tokenizer gets
    one thread (RAYON_NUM_THREADS=1), so that every row uses the cores it is compared on."""
    shutil.rmtree(out, ignore_errors=True)
    env = {**os.environ, "RAYON_NUM_THREADS": "1"} if workers == 1 else None
    cmd = [sys.executable, "-m", "tokload", "build", *map(str, inputs), "-o", str(out)]
    cmd += ["--tokenizer", str(tj), "-j", str(workers), "--no-progress"]
    if meta:
        cmd += ["--keep-field", "id", "--annotations", "spans"]
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, env=env)
    took = time.perf_counter() - t0
    shutil.rmtree(out, ignore_errors=True)
    return took


_MEGATRON_TOK: Any = None


def _megatron_init(tj: str) -> None:
    global _MEGATRON_TOK
    from tokenizers import Tokenizer

    _MEGATRON_TOK = Tokenizer.from_file(tj)


def _megatron_encode(line: bytes) -> tuple[list[int], int]:
    # preprocess_data.py's Encoder.encode: json.loads, tokenize, append the EOD token
    text = json.loads(line)["text"]
    ids: list[int] = _MEGATRON_TOK.encode(text, add_special_tokens=False).ids
    ids.append(_MEGATRON_TOK.token_to_id("<|endoftext|>"))
    return ids, len(line)


def megatron_recipe(path: Path, out: Path, tj: Path, workers: int) -> float:
    import torch
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    out.mkdir(parents=True, exist_ok=True)
    vocab = json.loads(tj.read_text())["model"]["vocab"]
    t0 = time.perf_counter()
    builder = IndexedDatasetBuilder(
        str(out / "text_document.bin"), dtype=DType.optimal_dtype(len(vocab) + 1)
    )
    with (
        mp.get_context("fork").Pool(workers, _megatron_init, (str(tj),)) as pool,
        open(path, "rb") as fin,
    ):
        for ids, _ in pool.imap(_megatron_encode, fin, 32):
            builder.add_document(torch.IntTensor(ids), [len(ids)])
    builder.finalize(str(out / "text_document.idx"))
    took = time.perf_counter() - t0
    shutil.rmtree(out, ignore_errors=True)
    return took


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mb", type=int, default=200, help="MB of text in the corpus")
    ap.add_argument("--workdir", default=None, help="keep the corpus and tokenizer here")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    work = Path(args.workdir or Path(tempfile.gettempdir()) / "tokload-bench-build")
    work.mkdir(parents=True, exist_ok=True)
    return _run(work, args.mb, args.json)


def _run(work: Path, mb: int, as_json: bool) -> int:
    info = make_corpus(work, mb)
    tj = train_tokenizer(work)
    big = [work / "big.jsonl"]
    small = sorted((work / "small").glob("*.jsonl"))
    text_mb = float(info["text_mb"])
    cores = os.cpu_count() or 1
    rows: list[tuple[str, float]] = []

    def row(name: str, seconds: float) -> float:
        rate = text_mb / seconds
        rows.append((name, rate))
        print(f"  {name:<52} {seconds:7.1f} s {rate:7.2f} MB/s", file=sys.stderr, flush=True)
        return rate

    print(
        f"corpus: {info['text_mb']:.0f} MB of text ({info['unique_text_mb']:.0f} MB unique), "
        f"{info['documents']:,} documents, {info['jsonl_mb']:.0f} MB of JSONL; {cores} cores",
        file=sys.stderr,
    )
    alone = {
        t: row(f"tokenizer encode_batch, {t} thread(s)", tokenizer_alone(tj, big[0], t, False))
        for t in (1, 2)
    }
    fast = row("tokenizer encode_batch_fast, 2 threads", tokenizer_alone(tj, big[0], 2, True))
    builds: dict[tuple[int, str, bool], float] = {}
    for meta in (False, True):
        for name, inputs in (("one big file", big), (f"{len(small)} small files", small)):
            for j in (1, 2):
                label = f"tokload build -j {j}, {name}{', metadata' if meta else ''}"
                builds[j, name, meta] = row(label, tokload_build(inputs, work / "out", tj, j, meta))
    meg = {
        j: row(f"Megatron recipe, {j} worker(s)", megatron_recipe(big[0], work / "meg", tj, j))
        for j in (1, 2)
    }
    ratios = {}
    for (j, name, meta), rate in builds.items():
        what = f"-j {j}, {name}{', metadata' if meta else ''}"
        ratios[f"{what}: / encode_batch ({j} thread(s))"] = rate / alone[j]
        if not meta:
            ratios[f"{what}: / Megatron recipe ({j} worker(s))"] = rate / meg[j]
    ratios["-j 2, one big file: / encode_batch_fast (2 threads)"] = (
        builds[2, "one big file", False] / fast
    )
    summary = {"corpus": info, "cores": cores, "MB_per_s": dict(rows), "ratios": ratios}
    _results.write("bench_build", _result_rows(rows, alone, meg), _goals(builds, alone, meg))
    if as_json:
        print(json.dumps(summary, indent=1))
    else:
        print(f"\n{'':<52} {'MB/s':>7}")
        for name, rate in rows:
            print(f"{name:<52} {rate:7.2f}")
        print()
        for name, ratio in ratios.items():
            print(f"{name:<64} {ratio:5.2f}")
    return 0


def _result_rows(
    rows: list[tuple[str, float]], alone: dict[int, float], meg: dict[int, float]
) -> list[dict[str, Any]]:
    """Each measurement: MB of text/s, over ``encode_batch`` and Megatron's recipe on
    as many threads (the number in its name)."""
    out = []
    for name, rate in rows:
        j = 2 if ("-j 2" in name or "2 thread" in name or "2 worker" in name) else 1
        out.append(
            {
                "what": name,
                "mb_per_s": rate,
                "over_encode_batch": rate / alone[j],
                "over_megatron": rate / meg[j],
            }
        )
    return out


def _goals(
    builds: dict[tuple[int, str, bool], float], alone: dict[int, float], meg: dict[int, float]
) -> list[dict[str, Any]]:
    """Issue 14's goals, for each of the builds measured."""
    goals = []
    for (j, name, meta), rate in builds.items():
        what = f"tokload build -j {j}, {name}{', metadata' if meta else ''}"
        goals.append(
            _results.make_goal(
                f"{what} / encode_batch on {j} thread(s)", 0.8 if meta else 0.9, rate / alone[j]
            )
        )
        if not meta:
            goals.append(
                _results.make_goal(
                    f"{what} / Megatron's recipe on {j} worker(s)",
                    1.5,
                    rate / meg[j],
                    fmt="{:.2f}x",
                )
            )
    return goals


if __name__ == "__main__":
    sys.exit(main())
