"""The command line: one line and the right exit code for every mistake, never
a traceback (unless asked for), ``--version``, help with descriptions, defaults
and examples, and ``bench`` as a table or JSON."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from test_build import _hf_tokenizer, write_corpus

import tokload
from tokload.__main__ import main
from tokload.errors import UsageError

COMMANDS = ["demo", "build", "merge", "inspect", "verify", "plan", "bench"]


def cli(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """Exit code, stdout and stderr of ``tokload ARGS`` run in this process."""
    try:
        code = main(args)
    except SystemExit as e:  # argparse: usage errors, --help, --version
        code = int(e.code or 0)
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return code, out, err


def one_line(err: str) -> str:
    lines = err.splitlines()
    assert len(lines) == 1, err
    return lines[0]


BUILD_REPORT = re.compile(
    r"tokload build: (no --tokenizer given: .*|tokenizer .*, vocabulary .*|\d+ input files, .*"
    r"|\d+ chunks: .*)"
)


def error_line(err: str) -> str:
    """The last line of a build's stderr, after only its report lines (tokenizer, inputs)."""
    *report, last = err.splitlines()
    for line in report:
        assert BUILD_REPORT.fullmatch(line), err
    return last


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("cli")
    inputs = write_corpus(root / "in", files=2)
    tokload.build(inputs, root / "ds", keep_fields=["id"], progress=False)
    return root / "ds"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["build", "x.jsonl", "-o", "o", "-j", "0"],
            "argument -j/--workers: must be at least 1, got 0",
        ),
        (
            ["build", "x.jsonl", "-o", "o", "-j", "two"],
            "argument -j/--workers: 'two' is not an integer",
        ),
        (["build", "x.jsonl", "-o", "o", "--part", "5/3"], "argument --part: 5/3: need 0 <= k < N"),
        (
            ["build", "x.jsonl", "-o", "o", "--part", "3"],
            "argument --part: must look like 'k/N' (e.g. 3/16), got '3'",
        ),
        (["build", "x.jsonl", "-o", "o", "--shard-size", "big"], "'big' is not a size"),
        (["build", "x.jsonl", "-o", "o", "--shard-size", "0"], "--shard-size: must be positive"),
        (["build", "x.jsonl", "-o", "o", "--on-error", "ignore"], "invalid choice: 'ignore'"),
        (["build", "x.jsonl"], "the following arguments are required: -o/--output"),
        (["bench", "ds", "--batch-size", "0"], "argument --batch-size: must be at least 1, got 0"),
        (["bench", "ds", "--seconds", "0"], "must be a positive number of seconds, got 0"),
        (["bench", "ds", "--seconds", "nan"], "must be a positive number of seconds, got nan"),
        (["bench", "ds", "--window", "1"], "argument --window: must be at least 2, got 1"),
        (["bench", "ds", "--threads", "0"], "argument --threads: must be at least 1, got 0"),
        (["inspect", "ds", "--sample", "-1"], "argument --sample: must be at least 0, got -1"),
        (
            ["plan", "ds", "--world-size", "8"],
            "the following arguments are required: --tokens-per-s",
        ),
        (
            ["plan", "ds", "--world-size", "0", "--tokens-per-s", "1"],
            "argument --world-size: must be at least 1, got 0",
        ),
        (
            ["plan", "ds", "--world-size", "8", "--tokens-per-s", "fast"],
            "argument --tokens-per-s: 'fast' is not a number",
        ),
        (["frobnicate"], "invalid choice: 'frobnicate'"),
        ([], "the following arguments are required: COMMAND"),
    ],
)
def test_usage_errors_exit_2_with_one_line(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = cli(args, capsys)
    assert code == 2 and out == ""
    line = one_line(err)
    assert message in line
    assert line.startswith("tokload") and "error:" in line and "--help" in line


def test_inspect_shows_any_fields_and_no_record_for_an_empty_document(tmp_path: Path) -> None:
    """Structured rows without a ``token`` field are shown field by field (inspect
    raised KeyError: 'token'); an empty document has no first token, so no record
    (the next document's was shown as its own)."""
    from tokload.tools import inspect

    with tokload.Writer(tmp_path / "labelled", [("input_ids", "<u4"), ("labels", "<u2")]) as w:
        w.write({"input_ids": np.arange(6), "labels": [0, 0, 3, 3, 3, 0]})
    text = inspect(tmp_path / "labelled")
    assert "  input_ids 0 1 2 3 4 5" in text and "  labels  0 0 3 3 3 0" in text
    (tmp_path / "a.jsonl").write_text(
        "".join(
            json.dumps({"id": f"doc-{i}", "text": t}) + "\n" for i, t in enumerate(["a", "", "d"])
        )
    )
    tokload.build(
        [tmp_path / "a.jsonl"], tmp_path / "out", eos=False, keep_fields=["id"], progress=False
    )
    empty = inspect(tmp_path / "out", sample=1)
    assert "document 1: 0 rows" in empty and "doc-2" not in empty and "metadata" in empty
    assert "metadata of its first token" in inspect(tmp_path / "out", sample=2)


def test_bench_without_a_window_is_a_usage_error(
    dataset: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A window longer than the dataset, or an empty dataset, is the command line's
    mistake (exit 2), not 'a bug in tokload' (exit 1)."""
    rows = tokload.open_dataset(dataset).num_rows
    code, _, err = cli(["bench", str(dataset), "--window", str(rows + 1)], capsys)
    assert code == 2
    assert f"holds {rows:,} tokens, no window of {rows + 1:,}: give a smaller --window" in (
        one_line(err)
    )
    with tokload.Writer(tmp_path / "empty", "<u2"):
        pass
    code, _, err = cli(["bench", str(tmp_path / "empty")], capsys)
    assert code == 2 and "the dataset has no rows: there is nothing to read" in one_line(err)
    # windows of one token from Python (the command line asks for two): a stride of 1,
    # not the "stride must be a positive integer, got 0" of a stride it made itself
    one = tokload.tools.bench(dataset, seconds=0.05, window=1, batch_size=2, num_threads=0)
    assert one["tokens_per_s"] > 0


def test_build_argument_mistakes_found_late_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (inp,) = write_corpus(tmp_path / "in", files=1, docs=3)
    a_file = tmp_path / "file"
    a_file.write_text("x")
    code, _, err = cli(["build", str(inp), "-o", str(a_file)], capsys)
    assert code == 2
    assert error_line(err) == (
        f"tokload build: error: {a_file}: the output must be a directory (or not exist "
        "yet); it is a file"
    )
    # a tokenizer with neither EOS nor BOS among its special tokens
    tj = _hf_tokenizer(tmp_path / "tok.json")
    raw = json.loads(tj.read_text())
    raw["added_tokens"] = [t for t in raw["added_tokens"] if t["content"] != "<|endoftext|>"]
    raw["model"]["vocab"].pop("<|endoftext|>")
    no_eos = tmp_path / "no-eos.json"
    no_eos.write_text(json.dumps(raw))
    code, _, err = cli(
        ["build", str(inp), "-o", str(tmp_path / "o1"), "--tokenizer", str(no_eos)], capsys
    )
    assert code == 2
    assert error_line(err) == (
        f"tokload build: error: the tokenizer {no_eos} has no EOS token that tokload "
        "recognizes; name one with --eos-token, build with --no-eos, or use a tokenizer "
        "that has one"
    )
    named = ["--tokenizer", str(no_eos), "--eos-token", "[UNK]", "--bos-token", "[UNK]"]
    code, out, _ = cli(["build", str(inp), "-o", str(tmp_path / "o0"), *named], capsys)
    assert code == 0 and "3 documents" in out
    assert tokload.format.read_manifest(tmp_path / "o0").user["tokenizer"]["eos"] == 0
    code, _, err = cli(
        ["build", str(inp), "-o", str(tmp_path / "o1"), "--no-eos", "--eos-token", "x"], capsys
    )
    assert code == 2
    assert error_line(err) == (
        "tokload build: error: --no-eos and --eos-token contradict each other: give one"
    )
    code, _, err = cli(["build", str(inp), "-o", str(tmp_path / "o1"), "--bos-token", ""], capsys)
    assert code == 2
    assert (
        error_line(err)
        == "tokload build: error: --bos-token needs a token's text, e.g. '<|eot_id|>'"
    )
    named = ["--tokenizer", str(no_eos), "--eos-token", "<|endoftext|>"]
    code, _, err = cli(["build", str(inp), "-o", str(tmp_path / "o1"), *named], capsys)
    assert code == 2
    assert error_line(err) == (
        f"tokload build: error: the tokenizer {no_eos} has no token '<|endoftext|>' (asked "
        "for as EOS): give the token's text exactly as the vocabulary spells it, e.g. "
        "'<|eot_id|>'"
    )
    code, out, _ = cli(
        ["build", str(inp), "-o", str(tmp_path / "o1"), "--tokenizer", str(no_eos), "--no-eos"],
        capsys,
    )
    assert code == 0 and "3 documents" in out
    code, _, err = cli(["build", str(inp), "-o", str(tmp_path / "o2"), "--bos"], capsys)
    assert code == 0  # bytes has a BOS
    code, _, err = cli(
        ["build", str(inp), "-o", str(tmp_path / "o3"), "--tokenizer", str(tj), "--bos"], capsys
    )
    assert code == 2 and "has no BOS token" in error_line(err)


def test_data_errors_exit_1_naming_the_file(
    tmp_path: Path, dataset: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (inp,) = write_corpus(tmp_path / "in", files=1, docs=3)
    out = str(tmp_path / "o")
    not_json = tmp_path / "tok.json"
    not_json.write_bytes(b"\xff\xfe not json")
    cases = [
        (
            ["build", str(inp), "-o", out, "--tokenizer", str(not_json)],
            f"tokload build: {not_json}: not a tokenizer.json (not JSON: 'utf-8' codec can't "
            "decode byte 0xff in position 0: invalid start byte)",
        ),
        (
            ["build", str(tmp_path / "nope.jsonl"), "-o", out],
            f"{tmp_path / 'nope.jsonl'}: no such input",
        ),
        (
            ["build", str(inp), "-o", out, "--tokenizer", "missing.json"],
            "missing.json: no tokenizer: tried no file or directory 'missing.json'",
        ),
        (
            ["inspect", str(tmp_path / "none")],
            f"{tmp_path / 'none' / 'manifest.json'}: no tokload manifest here",
        ),
        (
            ["verify", str(tmp_path / "none")],
            f"{tmp_path / 'none' / 'manifest.json'}: no tokload manifest here",
        ),
        (
            ["bench", str(tmp_path / "none")],
            f"{tmp_path / 'none'}: not a tokload dataset, a Megatron .bin/.idx prefix",
        ),
        (
            ["merge", str(tmp_path / "m"), str(tmp_path / "none")],
            f"{tmp_path / 'none' / 'manifest.json'}: no tokload manifest here",
        ),
    ]
    not_tokenizer = tmp_path / "empty.json"
    not_tokenizer.write_text("{}")
    cases.append(
        (
            ["build", str(inp), "-o", out, "--tokenizer", str(not_tokenizer)],
            f"tokload build: {not_tokenizer}: not a Hugging Face tokenizer.json (",
        )
    )
    for args, message in cases:
        code, _, err = cli(args, capsys)
        assert code == 1, args
        assert message in error_line(err), args
    # corrupt manifests: not JSON, not UTF-8, wrong schema
    for k, text in enumerate([b"{not json", b'{"format": "tokload", "x": "\xff"}', b"[]"]):
        bad = tmp_path / f"bad{k}"
        bad.mkdir()
        (bad / "manifest.json").write_bytes(text)
        for command in ("inspect", "verify", "bench"):
            code, _, err = cli([command, str(bad)], capsys)
            assert code == 1
            assert error_line(err).startswith(f"tokload {command}: {bad / 'manifest.json'}")


def test_debug_flag_and_environment_show_the_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(tokload.MissingShardError, match="no tokload manifest here"):
        main(["inspect", str(tmp_path), "--debug"])
    with pytest.raises(tokload.MissingShardError):
        main(["--debug", "inspect", str(tmp_path)])
    env = {**os.environ, "TOKLOAD_DEBUG_CLI": "1"}
    p = subprocess.run(
        [sys.executable, "-m", "tokload", "inspect", str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
    )
    assert p.returncode == 1
    assert p.stderr.startswith("Traceback (most recent call last):")
    assert "MissingShardError" in p.stderr


def test_an_unexpected_exception_is_one_line_that_says_it_is_a_bug(
    dataset: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def broken(*args: object, **kwargs: object) -> str:
        raise KeyError("shards")

    monkeypatch.setattr(tokload.tools, "inspect", broken)
    code, _, err = cli(["inspect", str(dataset)], capsys)
    assert code == 1
    assert one_line(err) == (
        "tokload inspect: unexpected KeyError: 'shards' (a bug in tokload: rerun with --debug "
        "for the traceback and report it)"
    )

    def interrupted(*args: object, **kwargs: object) -> dict[str, object]:
        raise KeyboardInterrupt

    monkeypatch.setattr(tokload.tools, "bench", interrupted)
    code, _, err = cli(["bench", str(dataset)], capsys)
    assert code == 130
    assert one_line(err) == "tokload bench: interrupted"


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = cli(["--version"], capsys)
    assert code == 0 and out == f"tokload {tokload.__version__}\n"
    p = subprocess.run(
        [sys.executable, "-m", "tokload", "--version"], capture_output=True, text=True
    )
    assert (p.returncode, p.stdout, p.stderr) == (0, f"tokload {tokload.__version__}\n", "")


@pytest.mark.parametrize(
    ("name", "value", "expected"),
    [
        ("TOKLOAD_MAX_OPEN_FILES", "0", "a positive integer"),
        ("TOKLOAD_HOST_CACHE_MB", "-1", "a whole number of MiB (>= 0)"),
        ("TOKLOAD_INDEX_MEMORY", "x", "a number of bytes (>= 0)"),
        ("TOKLOAD_IO", "bogus", "one of auto, uring, threads, sync"),
        ("TOKLOAD_IO_DEPTH", "x", "an integer in [1, "),
    ],
)
def test_a_bad_setting_in_the_environment_is_a_usage_error(
    name: str, value: str, expected: str, tmp_path: Path
) -> None:
    """A bad ``TOKLOAD_*`` value was a traceback at import (even for ``--version``) or
    "unexpected ValueError ... a bug in tokload" (review43): exit 2, one line."""
    with tokload.Writer(tmp_path / "ds", "<u4") as w:
        w.write(np.arange(100, dtype=np.uint32))
    env = {**os.environ, name: value}
    run = [sys.executable, "-m", "tokload"]
    p = subprocess.run([*run, "--version"], capture_output=True, text=True, env=env)
    assert (p.returncode, p.stderr) == (0, "")
    p = subprocess.run([*run, "bench", str(tmp_path / "ds"), "--window", "8"], env=env,
                       capture_output=True, text=True)  # fmt: skip
    assert p.returncode == 2, p.stderr
    assert p.stderr.startswith(f"tokload bench: error: {name}='{value}': expected {expected}")
    assert len(p.stderr.splitlines()) == 1, p.stderr


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_has_a_description_defaults_and_an_example(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = cli([command, "--help"], capsys)
    assert code == 0
    usage, description, *_ = out.split("\n\n")
    assert usage.startswith(f"usage: tokload {command}")
    assert len(description) > 40  # a sentence, not a placeholder
    assert re.search(rf"example:\n  tokload {command}\b", out)
    assert "--debug" in out
    defaults = {
        "demo": ["(default: 7)"],
        "build": [
            "(default: text)",
            "(default: 1)",
            "(default: stop)",
            "(default: 1G)",
        ],
        "inspect": ["(default: 0)"],
        "plan": ["(default: 4097)"],
        "bench": ["(default: 5.0)", "(default: 4097)", "(default: 8)"],
        "merge": [],
        "verify": [],
    }[command]
    flat = " ".join(out.split())
    for d in defaults:
        assert d in flat
    assert "(default: None)" not in flat and "(default: False)" not in flat
    code, top, _ = cli(["--help"], capsys)
    assert command in top and "Exit codes: 0 ok, 1 bad data, 2 bad command line, 130" in top


def test_bench_table_and_json(
    dataset: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WORLD_SIZE", "8")  # run in a launcher's job: it reads alone
    code, out, _ = cli(["bench", str(dataset), "--seconds", "0.2", "--window", "17"], capsys)
    assert code == 0
    lines = out.splitlines()
    assert lines[0].startswith(f"tokload bench {dataset}: window 17, batch 8,")
    labels = [line.split("  ")[1].strip() for line in lines[1:] if line.startswith("  ")]
    assert labels == [
        "start-up (Python, tokload)",
        "import torch and the loader",
        "open the dataset",
        "first batch",
        "steady rate",
    ]
    assert not re.search(r"\d\.\d{4,}", out)  # no 16-digit floats
    assert re.search(r"steady rate +\d+\.\d M tokens/s \([\d,]+ batches\)", out)
    code, out, _ = cli(
        ["bench", str(dataset), "--seconds", "0.2", "--window", "17", "--json"], capsys
    )
    r = json.loads(out)
    assert set(r) >= {"startup_s", "import_s", "open_s", "first_batch_s", "tokens_per_s", "batches"}
    assert r["tokens_per_s"] > 0 and r["window"] == 17 and r["batch_size"] == 8
    assert r["open_s"] + r["first_batch_s"] == pytest.approx(r["time_to_first_batch_s"])


def test_verify_deep_notices_overwritten_token_bytes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    inputs = write_corpus(tmp_path / "in", files=2)
    out = tmp_path / "ds"
    tokload.build(inputs, out, progress=False)
    code, stdout, _ = cli(["verify", str(out), "--deep"], capsys)
    assert (
        code == 0 and stdout == f"tokload verify: {out}: ok (every file's checksum and structure)\n"
    )
    m = tokload.open_dataset(out).manifest
    assert m is not None
    rows = out / (m.shards[1].name + ".rows")
    data = np.fromfile(rows, "<u2")
    data[5] = 300 - data[5]  # same size, other tokens: the structure is still sound
    data.tofile(rows)
    code, stdout, _ = cli(["verify", str(out)], capsys)
    assert code == 0 and stdout.endswith(": ok (structure)\n")
    code, _, err = cli(["verify", str(out), "--deep"], capsys)
    assert code == 1
    assert str(rows) in one_line(err)


@pytest.mark.parametrize("suffix", [".rows", ".docs"])
def test_verify_names_a_file_it_cannot_read(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, suffix: str
) -> None:
    """review63: a shard whose rows could not be read (permissions) passed ``verify``
    as "ok (structure)" while every read of it failed, and ``tools.verify`` raised
    for an unreadable document index: each is a problem, named (exit 1). (Faults
    injected: tests run as root, whom permissions do not stop.)"""
    from tokload.location import Location

    inputs = write_corpus(tmp_path / "in", files=2)
    out = tmp_path / "ds"
    tokload.build(inputs, out, progress=False)
    m = tokload.open_dataset(out).manifest
    assert m is not None
    locked = str(out / (m.shards[-1].name + suffix))
    read = Location.read

    def refused(self: Location, path: str, what: str, *args: Any) -> bytes:
        if path == locked:
            raise PermissionError(13, "Permission denied", path)
        return read(self, path, what, *args)

    monkeypatch.setattr(Location, "read", refused)
    assert tokload.tools.verify(out) == [f"{locked}: Permission denied"]
    code, stdout, err = cli(["verify", str(out)], capsys)
    assert code == 1 and stdout == "" and err == f"tokload verify: {locked}: Permission denied\n"


def test_the_readme_walk_through_shows_no_traceback(tmp_path: Path) -> None:
    """build, verify (plain and deep), inspect, bench: real processes, as a user runs them."""
    inputs = write_corpus(tmp_path / "data", files=3)
    steps = [
        [
            "build",
            *map(str, inputs),
            "-o",
            "corpus",
            "-j",
            "2",
            "--keep-field",
            "id",
            "--annotations",
            "spans",
        ],
        [
            "build",
            *map(str, inputs),
            "-o",
            "corpus",
            "-j",
            "2",
            "--keep-field",
            "id",
            "--annotations",
            "spans",
        ],
        ["verify", "corpus"],
        ["verify", "corpus", "--deep"],
        ["inspect", "corpus"],
        ["bench", "corpus", "--seconds", "0.3", "--window", "65"],
    ]
    outputs = []
    for args in steps:
        p = subprocess.run(
            [sys.executable, "-m", "tokload", *args], capture_output=True, text=True, cwd=tmp_path
        )
        assert "Traceback" not in p.stdout + p.stderr, p.stderr
        assert p.returncode == 0, (args, p.stderr)
        outputs.append(p.stdout)
    assert "(3 built now)" in outputs[0] and "(0 built now)" in outputs[1]
    assert "metadata of its first token" in outputs[4]
    assert "steady rate" in outputs[5]


def test_a_closed_pipe_ends_quietly(dataset: Path) -> None:
    """``tokload inspect ds | head -0``: the reader is gone before the output comes."""
    p = subprocess.Popen(
        [sys.executable, "-m", "tokload", "inspect", str(dataset)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert p.stdout is not None and p.stderr is not None
    p.stdout.close()  # long before the interpreter has started
    err = p.stderr.read()
    assert p.wait(timeout=60) == 141
    assert err == ""


def test_convert_between_metadata_layouts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spans = tmp_path / "spans"  # tokload build writes metadata blocks
    tokload.build(write_corpus(tmp_path / "in", files=1), spans, keep_fields=["id"], progress=False)
    code, out, _ = cli(
        ["convert", str(spans), str(tmp_path / "ids"), "--layout", "per_token"], capsys
    )
    assert code == 0 and out.startswith("tokload convert: ") and "metadata as per_token" in out
    code, _, _ = cli(["convert", str(tmp_path / "ids"), str(tmp_path / "back")], capsys)
    assert code == 0
    code, _, _ = cli(["convert", str(spans), str(tmp_path / "table"), "--layout", "spans"], capsys)
    assert code == 0
    views = [
        tokload.StreamWithMetadata(tmp_path / d, window=7)
        for d in ("spans", "ids", "back", "table")
    ]
    got = [v.read(np.arange(len(v))) for v in views]
    for g in got[1:]:
        np.testing.assert_array_equal(g.fields["token"], got[0].fields["token"])
        np.testing.assert_array_equal(g.positions, got[0].positions)
        assert list(g.metadata) == list(got[0].metadata)
    code, _, err = cli(["convert", str(spans), str(tmp_path / "z")], capsys)  # blocks already
    assert code == 1 and "the metadata already has layout 'blocks'" in one_line(err)
    code, _, err = cli(
        ["convert", str(spans), str(tmp_path / "ids"), "--layout", "per_token"], capsys
    )
    assert code == 1 and str(tmp_path / "ids") in one_line(err)  # it exists
    plain = tmp_path / "plain"
    with tokload.Writer(plain, "<u2") as w:
        w.write(np.arange(5, dtype=np.uint16))
    code, _, err = cli(["convert", str(plain), str(tmp_path / "x")], capsys)
    assert code == 1 and "has no metadata" in one_line(err)
    code, _, err = cli(["convert", str(spans), str(tmp_path / "y"), "--span-block", "0"], capsys)
    assert code == 2 and "--span-block: must be at least 1, got 0" in one_line(err)
    # past a metadata block's most rows: a usage error (exit 2), not "a bug in tokload"
    code, _, err = cli(
        ["convert", str(spans), str(tmp_path / "y"), "--span-block", "70000"], capsys
    )
    assert code == 2 and "span_block must be at most 65536 for metadata blocks, got 70000" in err
    assert "bug" not in err and not (tmp_path / "y").exists()
    code, _, _ = cli(
        ["convert", str(spans), str(tmp_path / "y"), "--layout", "spans", "--span-block", "70000"],
        capsys,
    )
    assert code == 0  # a span table's index takes any block


def test_plan_spreads_the_gets_over_the_prefixes_that_hold_the_rows(
    dataset: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A shuffled read touches every row equally: each chunk's prefix serves the GETs
    of the windows that touch its files (a window that runs across two files takes
    two GETs, the second in the later file); with documents, a GET per document in its
    file (review49: the GETs of documents were spread by rows)."""
    from tokload.tools import S3_GETS_PER_PREFIX, plan

    src = tokload.open_dataset(dataset)
    paths, cum = list(src.rows.files.paths), src.rows.cum.astype(float)
    src.close()
    total, window = cum[-1], 33
    r = plan(dataset, 64, 1000.0, window)
    # counted: the files a window at each start touches (the boundaries between files
    # inside it, plus one); k files have k - 1 such boundaries
    starts = np.arange(int(total))
    inner = cum[1:-1]
    crossed = np.searchsorted(inner, starts + window, "left") - np.searchsorted(
        inner, starts, "right"
    )
    per_window = 1 + float(crossed.mean())
    assert per_window == pytest.approx(1 + (window - 1) * (len(paths) - 1) / total)
    assert r["gets_per_sample"] == pytest.approx(per_window)
    # files shorter than a window: a window runs across several (this was capped at 2)
    small = tmp_path / "small"
    with tokload.Writer(small, "<u4", shard_bytes=40) as w:
        for k in range(60):
            w.write(np.arange(k % 7 + 4, dtype=np.uint32))
    s = tokload.open_dataset(small)
    scum = s.rows.cum.astype(float)
    s.close()
    sinner, sstarts = scum[1:-1], np.arange(int(scum[-1]) - window + 1)
    scrossed = np.searchsorted(sinner, sstarts + window, "left") - np.searchsorted(
        sinner, sstarts, "right"
    )
    assert 1 + scrossed.mean() > 3
    assert plan(small, 8, 1000.0, window)["gets_per_sample"] == pytest.approx(
        1 + scrossed.mean(), rel=0.02
    )
    # one file: no window runs across two (this said 1 + (window - 1) / rows)
    np.save(tmp_path / "one.npy", np.arange(100_000, dtype=np.uint16))
    one = plan(tmp_path / "one.npy", 8, 1000.0, 4097)
    assert one["gets_per_sample"] == 1.0
    assert r["gets_per_s"] == pytest.approx(64 * 1000 / window * per_window)
    want: dict[str, float] = {}
    for k, p in enumerate(paths):  # counted: the windows (of every start) touching file k
        touching = (starts < cum[k + 1]) & (starts + window > cum[k])
        prefix = p.rsplit("/", 1)[0] + "/"
        want[prefix] = want.get(prefix, 0.0) + 64 * 1000 / window * touching.mean()
    assert len(want) == 2 and all("/parts/" in k for k in want)  # one per chunk
    assert r["prefixes"] == pytest.approx(want)
    assert r["busiest"] == pytest.approx(max(want.values()) / S3_GETS_PER_PREFIX)
    docs = plan(dataset, 64, 1000.0, None)
    assert docs["gets_per_sample"] == 1.0  # the document index is held in memory
    n_docs = len(tokload.Documents(dataset))
    assert docs["tokens_per_sample"] == pytest.approx(total / n_docs)
    m = tokload.format.read_manifest(dataset)
    by_docs: dict[str, float] = {}
    for p, shard in zip(paths, m.shards, strict=True):
        prefix = p.rsplit("/", 1)[0] + "/"
        by_docs[prefix] = by_docs.get(prefix, 0.0) + docs["gets_per_s"] * shard.documents / n_docs
    assert docs["prefixes"] == pytest.approx(by_docs)
    # as many tokens under each prefix, 100 times the documents under one: 99% of the
    # GETs there (the rows' split said 50/50, "ok" with the busiest over the limit)
    (tmp_path / "short.jsonl").write_text("".join('{"text": "ab"}\n' for _ in range(1000)))
    (tmp_path / "long.jsonl").write_text('{"text": "%s"}\n' % ("ab" * 999) * 10)
    tokload.build([tmp_path / "short.jsonl", tmp_path / "long.jsonl"], tmp_path / "skew",
                  progress=False)  # fmt: skip
    skew = plan(tmp_path / "skew", 64, 20_000.0, None)["prefixes"]
    assert len(skew) == 2 and max(skew.values()) / sum(skew.values()) == pytest.approx(1000 / 1010)

    code, out, _ = cli(["plan", str(dataset), "--world-size", "8", "--tokens-per-s", "10"], capsys)
    assert code == 0 and out.splitlines()[-1].startswith("ok ")
    code, out, _ = cli(
        ["plan", str(dataset), "--world-size", "4096", "--tokens-per-s", "1e6", "--documents"],
        capsys,
    )
    assert code == 0
    assert re.search(r"too many +the data needs [\d,]+ prefixes or more at 5,500 GETs/s", out)
    code, out, _ = cli(
        ["plan", str(dataset), "--world-size", "2", "--tokens-per-s", "5", "--json"], capsys
    )
    assert json.loads(out)["prefixes_needed"] == 1


def test_plan_and_inspect_say_what_the_data_cannot_give(
    dataset: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Arguments the data cannot answer are the user's mistake (exit 2, one line), not
    a bug of tokload's; a document past the last is not another one wrapped around."""
    np.save(tmp_path / "flat.npy", np.arange(50, dtype=np.uint16))
    code, _, err = cli(
        ["plan", str(tmp_path / "flat.npy"), "--world-size", "2", "--tokens-per-s", "5",
         "--documents"],
        capsys,
    )  # fmt: skip
    assert code == 2
    assert one_line(err) == (
        f"tokload plan: error: {tmp_path / 'flat.npy'}: has no document boundaries to read "
        "documents by: plan it as windows (without --documents; window=N in Python)"
    )
    code, _, err = cli(
        ["plan", str(tmp_path / "flat.npy"), "--world-size", "2", "--tokens-per-s", "5",
         "--window", "51"],
        capsys,
    )  # fmt: skip
    assert code == 2
    assert one_line(err) == (
        f"tokload plan: error: {tmp_path / 'flat.npy'}: a window of 51 tokens is longer than "
        "the dataset's 50: it has no sample to read"
    )
    # inspect and verify read tokload datasets: a token file or a Megatron prefix is
    # said to be one (review31: "<file>.npy/manifest.json: Not a directory")
    megatron = Path(__file__).parent / "data" / "megatron" / "tiny_uint16"
    for command in ("inspect", "verify"):
        for path, kind in [
            (tmp_path / "flat.npy", "a flat token file"),
            (megatron, "a Megatron-LM .bin/.idx prefix"),
            (megatron.with_suffix(".idx"), "a Megatron-LM .bin/.idx prefix"),
        ]:
            code, out, err = cli([command, str(path)], capsys)
            assert code == 2 and out == ""
            assert one_line(err) == (
                f"tokload {command}: error: {path}: {kind}, not a tokload dataset (a directory "
                f"with manifest.json): {command} reads tokload datasets; read it with the "
                "views (tokload.Documents, TokenStream, open_flat) or tokload plan and bench"
            )
    code, _, err = cli(["inspect", str(dataset / "manifest.json")], capsys)
    assert code == 2 and one_line(err) == (
        f"tokload inspect: error: {dataset / 'manifest.json'}: a dataset's manifest: give its "
        f"directory, {dataset}"
    )
    # the arguments the command line checks, checked in Python too (review26: negative
    # GETs/s, ZeroDivisionError, OverflowError)
    plan = tokload.tools.plan
    cases: list[tuple[dict[str, Any], str]] = [
        ({"window": -5}, "window must be a positive integer, got -5"),
        ({"window": 0}, "window must be a positive integer, got 0"),
        ({"window": 2.5}, "window must be a positive integer, got 2.5"),
        ({"tokens_per_s": float("inf")}, "tokens_per_s must be a positive finite number, got inf"),
        ({"tokens_per_s": float("nan")}, "tokens_per_s must be a positive finite number, got nan"),
        ({"tokens_per_s": "5"}, "tokens_per_s must be a positive finite number, got '5'"),
        ({"world_size": 0}, "world_size must be a positive integer, got 0"),
        ({"world_size": 1.5}, "world_size must be a positive integer, got 1.5"),
        ({"shuffle_block": 0}, "shuffle_block must be a positive integer, got 0"),
        (
            {"shuffle_block": 64},
            "plan: with shuffle_block, give the batch size too: the GETs a block saves "
            "depend on how many samples a reader task holds",
        ),
        ({"shuffle_block": 64, "batch_size": -1}, "batch_size must be a positive integer, got -1"),
    ]
    for kw, message in cases:
        args: dict[str, Any] = {"world_size": 2, "tokens_per_s": 5.0, "window": 10, **kw}
        with pytest.raises(UsageError) as e:
            plan(tmp_path / "flat.npy", **args)
        assert str(e.value) == message
    rate: Any = np.float32(5)  # NumPy numbers are numbers
    window: Any = np.int64(50)
    assert plan(tmp_path / "flat.npy", 2, rate, window)["gets_per_sample"] == 1
    code, out, _ = cli(
        ["plan", str(dataset), "--world-size", "2", "--tokens-per-s", "5", "--documents",
         "--shuffle-block", "2", "--batch-size", "4"],
        capsys,
    )  # fmt: skip
    assert code == 0 and "shuffled in blocks of 2 (which saves no GET: a rank reads 1 " in out
    n = len(tokload.Documents(dataset))
    code, out, _ = cli(["inspect", str(dataset), "--sample", str(n - 1)], capsys)
    assert code == 0 and f"document {n - 1}: " in out
    code, out, err = cli(["inspect", str(dataset), "--sample", str(n)], capsys)
    assert code == 2 and out == ""
    assert one_line(err) == (
        f"tokload inspect: error: {dataset}: there is no document {n}: the dataset has {n:,} "
        f"(0 to {n - 1:,})"
    )


def test_options_that_do_nothing_where_given_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--staging`` with a local output, ``--span-block`` with ``--layout per_token``
    and ``plan --documents --window`` were ignored silently (review43)."""
    (inp,) = write_corpus(tmp_path / "in", files=1, docs=3)
    out = tmp_path / "o"
    code, _, err = cli(
        ["build", str(inp), "-o", str(out), "--staging", str(tmp_path / "s")], capsys
    )
    assert code == 2 and not out.exists()
    assert error_line(err) == (
        f"tokload build: error: staging='{tmp_path / 's'}' is the local build directory of a "
        f"URL output (s3://...); the output '{out}' is local: it is built there"
    )
    assert cli(["build", str(inp), "-o", str(out), "--keep-field", "id"], capsys)[0] == 0
    code, _, err = cli(
        ["convert", str(out), str(tmp_path / "c"), "--layout", "per_token", "--span-block", "64"],
        capsys,
    )
    assert code == 2 and not (tmp_path / "c").exists()
    assert "--span-block is for --layout blocks or spans, not per_token" in error_line(err)
    plan = ["plan", str(out), "--world-size", "8", "--tokens-per-s", "1e6", "--documents"]
    code, _, err = cli([*plan, "--window", "64"], capsys)
    assert code == 2
    assert error_line(err) == (
        "tokload plan: error: --window and --documents contradict each other: give one"
    )
    assert cli(plan, capsys)[0] == 0


def test_a_small_max_skipped_is_said_as_it_is(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--max-skipped 0.0005`` failed with "more than the 0% allowed" (review43)."""
    lines = [json.dumps({"text": f"doc {k}"}) for k in range(99)] + ['{"text": 5}']
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    code, _, err = cli(
        [
            *("build", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "o")),
            *("--on-error", "skip", "--max-skipped", "0.0005"),
        ],
        capsys,
    )
    assert code == 1
    assert "more than the 0.05% allowed" in error_line(err), err
