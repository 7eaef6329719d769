"""Tokenizers for ``tokload build``: a byte-level one needing no files, or a
Hugging Face ``tokenizer.json``.

Both give, for a batch of texts, the token ids of each text and each token's
character span ``[start, end)`` in it, which is how character annotations
become token spans. Tokenization of a batch runs in native code (Rust for
Hugging Face tokenizers, NumPy for bytes) with the GIL released.
"""

from __future__ import annotations

import copy
import hashlib
import itertools
import json
import os
import re
import socket
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from tokload.errors import FormatError, UsageError

TOKENIZER_FILE = "tokenizer.json"
"""The name of the copy of the tokenizer inside a dataset built with one."""


@dataclass
class Encoded:
    """One text: token ids (int64) and per-token character spans ``[T, 2]`` (int64)."""

    ids: np.ndarray
    offsets: np.ndarray


@dataclass
class EncodedBatch:
    """Many texts at once, flat: text ``d`` is ``ids[bounds[d]:bounds[d + 1]]`` (int64).

    ``offsets`` (``[T, 2]`` int64 character spans, in each text's own
    characters) is ``None`` when it was not asked for: computing it costs the
    tokenizer time, and only annotations need it.
    """

    ids: np.ndarray
    bounds: np.ndarray
    offsets: np.ndarray | None


class Tokenizer(Protocol):
    name: str
    vocab_size: int  # the largest id + 1 (not the count: ids may leave gaps)
    bos_id: int | None
    eos_id: int | None

    def encode_batch(self, texts: list[str]) -> list[Encoded]: ...

    def encode_many(self, texts: list[str], offsets: bool = True) -> EncodedBatch: ...

    def decode(self, ids: list[int]) -> str: ...

    def describe(self) -> dict[str, Any]: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens 0-255, with BOS = 256 and EOS = 257 (vocabulary 258).

    Each byte's character span is the span of the character it belongs to.
    """

    name = "bytes"
    vocab_size = 258
    bos_id: int | None = 256
    eos_id: int | None = 257

    def encode_batch(self, texts: list[str]) -> list[Encoded]:
        out = []
        for text in texts:
            data = text.encode("utf-8", "surrogatepass")
            ids = np.frombuffer(data, dtype=np.uint8).astype(np.int64)
            # A byte starts a character unless it is a continuation byte 10xxxxxx.
            starts = (ids & 0xC0) != 0x80
            char_of_byte = np.cumsum(starts) - 1
            offsets = np.stack([char_of_byte, char_of_byte + 1], axis=1)
            out.append(Encoded(ids, offsets))
        return out

    def encode_many(self, texts: list[str], offsets: bool = True) -> EncodedBatch:
        data = [t.encode("utf-8", "surrogatepass") for t in texts]
        bounds = np.zeros(len(data) + 1, dtype=np.int64)
        np.cumsum([len(b) for b in data], out=bounds[1:])
        ids = np.frombuffer(b"".join(data), dtype=np.uint8).astype(np.int64)
        if not offsets:
            return EncodedBatch(ids, bounds, None)
        # Characters counted over the whole batch, then made relative to each text.
        char_of_byte = np.cumsum((ids & 0xC0) != 0x80) - 1
        chars_before = np.zeros(len(texts), dtype=np.int64)
        np.cumsum([len(t) for t in texts[:-1]], out=chars_before[1:])
        char_of_byte -= np.repeat(chars_before, np.diff(bounds))
        return EncodedBatch(ids, bounds, np.stack([char_of_byte, char_of_byte + 1], axis=1))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", "replace")

    def describe(self) -> dict[str, Any]:
        return {"kind": "bytes", "vocab_size": self.vocab_size, "bos": 256, "eos": 257}


class HFTokenizer:
    """A Hugging Face ``tokenizers`` ``tokenizer.json`` (fast; releases the GIL).

    BOS/EOS default to the first of the usual special tokens the vocabulary
    has, in this order (``<|endoftext|>``, ``</s>``, ``<eos>``,
    ``<|end_of_text|>``, ``[SEP]`` / ``<|begin_of_text|>``, ``<s>``, ``<bos>``,
    ``[CLS]``); pass ids to override. Texts are encoded without the
    tokenizer's own special tokens (``add_special_tokens=False``: a
    post-processor's ``<s>`` or ``[CLS]`` is not added); the build adds BOS and
    EOS itself.
    """

    _EOS_NAMES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "[SEP]")
    _BOS_NAMES = ("<|begin_of_text|>", "<s>", "<bos>", "[CLS]")

    def __init__(
        self, path: str | os.PathLike[str], bos_id: int | None = None, eos_id: int | None = None
    ) -> None:
        try:
            from tokenizers import Tokenizer as _Tok
        except ImportError:  # pragma: no cover - depends on the environment
            raise ImportError(
                "a tokenizer.json needs the 'tokenizers' package: pip install tokenizers"
            ) from None
        self.path = Path(path)
        self.data = self.path.read_bytes()
        try:
            text = self.data.decode("utf-8")
            json.loads(text)
        except (ValueError, RecursionError) as e:
            raise FormatError(
                f"{self.path}: not a tokenizer.json (not JSON: {_first_line(e)})"
            ) from None
        try:
            self._tok = _Tok.from_str(text)
        except Exception as e:  # tokenizers raises a bare Exception for any bad file
            raise FormatError(
                f"{self.path}: not a Hugging Face tokenizer.json ({_first_line(e)})"
            ) from None
        self.name = str(self.path)
        self.hub_name: str | None = None  # the Hugging Face name it was found by
        self.eos_id = eos_id if eos_id is not None else self._find(self._EOS_NAMES)
        self.bos_id = bos_id if bos_id is not None else self._find(self._BOS_NAMES)
        # the ids' range, not their count: a vocabulary may leave ids out (reserved
        # ranges, added tokens placed high), and the dtype must hold the largest
        ids = self._tok.get_vocab(with_added_tokens=True).values()
        special = [i for i in (self.eos_id, self.bos_id) if i is not None]
        self.vocab_size = max([*ids, *special], default=-1) + 1
        self.sha256 = hashlib.sha256(self.data).hexdigest()

    def _find(self, names: tuple[str, ...]) -> int | None:
        for name in names:
            i = self._tok.token_to_id(name)
            if i is not None:
                return int(i)
        return None

    def encode_batch(self, texts: list[str]) -> list[Encoded]:
        encs = self._tok.encode_batch(texts, add_special_tokens=False)
        return [
            Encoded(
                np.asarray(e.ids, dtype=np.int64),
                np.asarray(e.offsets, dtype=np.int64).reshape(-1, 2),
            )
            for e in encs
        ]

    def encode_many(self, texts: list[str], offsets: bool = True) -> EncodedBatch:
        # Without offsets, encode_batch_fast skips tracking them (tokenizers >= 0.20).
        fast = getattr(self._tok, "encode_batch_fast", None)
        if offsets or fast is None:
            encs = self._tok.encode_batch(texts, add_special_tokens=False)
        else:
            encs = fast(texts, add_special_tokens=False)
        id_lists = [e.ids for e in encs]
        bounds = np.zeros(len(id_lists) + 1, dtype=np.int64)
        np.cumsum([len(x) for x in id_lists], out=bounds[1:])
        total = int(bounds[-1])
        ids = np.fromiter(itertools.chain.from_iterable(id_lists), np.int64, total)
        if not offsets:
            return EncodedBatch(ids, bounds, None)
        spans = np.fromiter(
            itertools.chain.from_iterable(itertools.chain.from_iterable(e.offsets for e in encs)),
            np.int64,
            2 * total,
        )
        return EncodedBatch(ids, bounds, spans.reshape(-1, 2))

    def decode(self, ids: list[int]) -> str:
        return str(self._tok.decode(ids, skip_special_tokens=False))

    def describe(self) -> dict[str, Any]:
        hub = {"hub_name": self.hub_name} if self.hub_name else {}
        return {
            "kind": "tokenizer.json",
            **hub,
            "path": str(self.path),
            "sha256": self.sha256,
            "vocab_size": self.vocab_size,
            "bos": self.bos_id,
            "eos": self.eos_id,
        }


def load_tokenizer(spec: str | os.PathLike[str] | None) -> Tokenizer:
    """The tokenizer ``spec`` names.

    ``None`` or ``"bytes"``: the byte tokenizer. Otherwise, in this order:
    the path of a ``tokenizer.json``; a directory holding one (a model
    checkout); a Hugging Face model name (``"gpt2"``, ``"org/model"``, with
    ``@revision`` optionally): its ``tokenizer.json`` from the local Hugging
    Face cache (``HF_HUB_CACHE``/``HF_HOME``), else downloaded with
    ``huggingface_hub`` unless ``HF_HUB_OFFLINE`` is set.

    Raises:
        FileNotFoundError: none of these holds a tokenizer; the message says
            what was tried.
        FormatError: the file is not a ``tokenizer.json`` (names the file).
    """
    if spec is None or str(spec) == "bytes":
        return ByteTokenizer()
    path = Path(spec)
    if path.is_file():
        return HFTokenizer(path)
    if path.is_dir():
        if (path / TOKENIZER_FILE).is_file():
            return HFTokenizer(path / TOKENIZER_FILE)
        raise FileNotFoundError(2, f"the directory holds no {TOKENIZER_FILE}", str(path))
    tried = [f"no file or directory {str(path)!r}"]
    name = str(spec)
    if _HUB_NAME.fullmatch(name) and not name.endswith(".json"):
        found, why = _from_hub(name)
        if found is not None:
            tok = HFTokenizer(found)
            tok.name = f"{name} ({found})"
            tok.hub_name = name
            return tok
        tried += why
    raise FileNotFoundError(
        2,
        "no tokenizer: tried " + "; ".join(tried) + " (give a tokenizer.json, a directory "
        "holding one, a Hugging Face name such as gpt2, or 'bytes')",
        name,
    )


_HUB_NAME = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?(@[\w./-]+)?")


def _from_hub(name: str) -> tuple[Path | None, list[str]]:
    """``name``'s tokenizer.json from the Hugging Face cache or hub, or what was tried."""
    repo, _, revision = name.partition("@")
    try:
        import huggingface_hub as hub
    except ImportError:  # pragma: no cover - installed with tokenizers
        return None, ["no Hugging Face lookup ('huggingface_hub' is not installed)"]
    from huggingface_hub import constants

    cache = constants.HF_HUB_CACHE
    cached = hub.try_to_load_from_cache(repo, TOKENIZER_FILE, revision=revision or None)
    if isinstance(cached, str):
        return Path(cached), []
    tried = [f"the Hugging Face cache {cache} (no {repo}/{TOKENIZER_FILE})"]
    if constants.HF_HUB_OFFLINE:
        return None, [*tried, "no download (HF_HUB_OFFLINE is set)"]
    host = urllib.parse.urlsplit(constants.ENDPOINT).hostname or ""
    try:  # without a network the hub client retries for about 20 s: ask the resolver first
        socket.getaddrinfo(host, 443)
    except OSError as e:
        return None, [*tried, f"no download (cannot resolve {host}: {e.strerror or e})"]
    try:
        got = hub.hf_hub_download(repo, TOKENIZER_FILE, revision=revision or None)
    except Exception as e:  # the hub's errors: not found, gated, offline, ...
        first = _first_line(e)[:160]
        return None, [*tried, f"a download from {host} ({type(e).__name__}: {first})"]
    return Path(got), []


def with_special_tokens(tok: Tokenizer, bos: str | None, eos: str | None) -> Tokenizer:
    """``tok`` with the tokens whose text is ``bos`` and ``eos`` as its BOS and EOS
    (``None``: the one ``tok`` found), as a copy: ``eos="<|eot_id|>"`` ends
    each document of a Llama 3 build with the end of a turn.

    Raises:
        UsageError: the byte tokenizer (its BOS and EOS are fixed), or a name
            that is not a token of the vocabulary (naming the tokenizer).
    """
    if bos is None and eos is None:
        return tok
    if not isinstance(tok, HFTokenizer):
        name = bos if bos is not None else eos
        raise UsageError(
            f"the byte tokenizer's BOS and EOS are fixed (256 and 257); a token named "
            f"{name!r} needs a tokenizer.json"
        )
    out = copy.copy(tok)
    for what, name in (("BOS", bos), ("EOS", eos)):
        if name is None:
            continue
        if not isinstance(name, str) or not name:
            raise UsageError(f"the {what} token must be a token's text, got {name!r}")
        i = tok._tok.token_to_id(name)
        if i is None:
            raise UsageError(
                f"the tokenizer {tok.name} has no token {name!r} (asked for as {what}): give "
                "the token's text exactly as the vocabulary spells it, e.g. '<|eot_id|>'"
            )
        if what == "BOS":
            out.bos_id = int(i)
        else:
            out.eos_id = int(i)
    return out


def describe_tokenizer(tok: Tokenizer) -> str:
    """One line for a build's log: which tokenizer, its vocabulary and the stored dtype."""
    dtype = token_dtype(tok.vocab_size)
    special = f"BOS {tok.bos_id}, EOS {tok.eos_id}"
    where = "built in" if isinstance(tok, ByteTokenizer) else "tokenizer.json"
    return (
        f"tokenizer {tok.name} ({where}), vocabulary {tok.vocab_size:,}, "
        f"tokens stored as {dtype.name}, {special}"
    )


def dataset_record(tok: Tokenizer) -> dict[str, Any]:
    """The tokenizer's description for a dataset's manifest: for a ``tokenizer.json``,
    its copy's name relative to the dataset (``TOKENIZER_FILE``), its SHA-256
    and where it was copied from."""
    desc = tok.describe()
    if desc["kind"] == "bytes":
        return desc
    source = desc.pop("path")
    return {**desc, "file": TOKENIZER_FILE, "source": source}


def dataset_copy_is_current(tok: Tokenizer, root: str | os.PathLike[str]) -> bool:
    """Whether ``root`` holds the tokenizer copy ``tok`` needs (and no other copy)."""
    dest = Path(root) / TOKENIZER_FILE
    if not isinstance(tok, HFTokenizer):
        return not dest.exists()
    try:
        return hashlib.sha256(dest.read_bytes()).hexdigest() == tok.sha256
    except OSError:
        return False


def copy_tokenizer(tok: Tokenizer, root: str | os.PathLike[str]) -> None:
    """Make ``root/tokenizer.json`` the copy of ``tok``'s file (atomically), or
    remove it for the byte tokenizer, so that ``from_description`` finds it
    wherever the dataset moves."""
    dest = Path(root) / TOKENIZER_FILE
    if dataset_copy_is_current(tok, root):
        return
    if not isinstance(tok, HFTokenizer):
        dest.unlink(missing_ok=True)
        return
    tmp = dest.with_name(f".{TOKENIZER_FILE}.{os.getpid()}.tmp")
    try:
        tmp.write_bytes(tok.data)
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)


def from_description(
    desc: dict[str, Any], root: str | os.PathLike[str] | None = None
) -> Tokenizer | None:
    """The tokenizer a dataset was built with, if it can still be loaded (for decoding).

    A ``tokenizer.json`` is looked up as ``root/desc["file"]`` (the copy inside
    the dataset) and, for datasets built before tokload copied it, at
    ``desc["path"]``; it is used only when its SHA-256 is the recorded one.
    """
    if desc.get("kind") == "bytes":
        return ByteTokenizer()
    if desc.get("kind") != "tokenizer.json":
        return None
    candidates = []
    if isinstance(desc.get("file"), str) and root is not None:
        candidates.append(Path(root) / desc["file"])
    if isinstance(desc.get("path"), str):
        candidates.append(Path(desc["path"]))
    for path in candidates:
        if not path.is_file():
            continue
        try:
            tok = HFTokenizer(path, desc.get("bos"), desc.get("eos"))
        except (ImportError, OSError, FormatError):
            continue
        if desc.get("sha256") in (None, tok.sha256):
            return tok
    return None


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def token_dtype(vocab_size: int) -> np.dtype[Any]:
    """uint16 when every id fits, else uint32."""
    return np.dtype("<u2") if vocab_size <= 1 << 16 else np.dtype("<u4")
