"""A corpus prepared by megajax-prepare (megajax/prepare/): what is in its directory, and
reading it back for train.py (`--data bin:DIR`, `--data pairs:DIR`) with every check that
can fail cheaply.

    DIR/meta.json        format, tokenizer, token dtype, end-of-document id, per split the file,
                         token and document counts, and each source's size and SHA-256
    DIR/train.bin        the training split: token ids, flat, in the dtype meta.json names
    DIR/val.bin          the held-out documents
    DIR/tokenizer.json   the tokenizer that made them (and its hf_tokenizer.json / vocab.txt)

BERT's sentence pairs (`megajax-prepare --pairs`): DIR/pairs.bin holds each pair's A then B
tokens, DIR/pairs_index.bin an int64 (start, len A, len B) per pair; the last meta["val_pairs"]
pairs are the validation split. Both are memory-mapped: a run's memory does not grow with them.

meta.json is written last: a directory without it is an unfinished preparation.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from megajax.data.tokenizer import Tokenizer, load_tokenizer
from megajax.errors import UserError

META = "meta.json"
FORMAT = "megajax-tokens"
PAIRS_FORMAT = "megajax-pairs"
CHAT_FORMAT = "megajax-chat"  # megajax-prepare --chat: megajax/prepare/chat.py
VERSION = 1
SPLIT_FILES = {"train": "train.bin", "val": "val.bin"}
# Text every tokenizer encodes: two tokenizers that give it the same ids and have the same
# vocabulary size are taken to be the same.
PROBE = "The quick brown fox, 123 -- naïve café! Übermäßig.\n\n"


def token_dtype(vocab_size: int) -> str:
    return "uint16" if vocab_size <= 2**16 else "uint32"


def held_out_cut(document_ends: np.ndarray, total: int, val_fraction: float) -> int:
    """Where train ends: about val_fraction of `total` tokens held out as whole trailing
    documents (the document end nearest the goal among those that hold out between half and
    twice it), or inside the tokens when none is near (a few large documents)."""
    goal = total - int(total * val_fraction)
    span = max(1, total - goal)
    ends = np.asarray(document_ends, np.int64)
    ends = ends[(ends < total) & (total - ends >= 0.5 * span) & (total - ends <= 2 * span)]
    return int(ends[np.argmin(np.abs(ends - goal))]) if len(ends) and val_fraction else goal


def tokenizer_fingerprint(tok: Tokenizer) -> dict:
    return {
        "kind": tok.kind,
        "vocab_size": tok.vocab_size,
        "probe_ids": [int(i) for i in tok.encode(PROBE)],
    }


def is_prepared(path: Path) -> bool:
    return (Path(path) / META).is_file()


def read_meta(directory: Path, fmt: str = FORMAT) -> dict:
    path = Path(directory) / META
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        raise UserError(
            f"{path} cannot be read: not a corpus prepared by megajax-prepare"
        ) from None
    if not isinstance(meta, dict) or meta.get("format") != fmt or meta.get("version") != VERSION:
        other = meta.get("format") if isinstance(meta, dict) else None
        hint = {
            FORMAT: f" (it holds token files: --data bin:{directory})",
            PAIRS_FORMAT: f" (it holds BERT sentence pairs: --data pairs:{directory})",
            CHAT_FORMAT: f" (it holds conversations: --data chat:{directory})",
        }.get(other, "")
        raise UserError(f"{path} is not a megajax-prepare {fmt} v{VERSION} description{hint}")
    _check_fields(meta, path, fmt)
    return meta


def _check_fields(meta: dict, path: Path, fmt: str):
    """Every field a reader of the corpus uses, of the type it must have: a meta.json damaged or
    edited by hand is one line, not a KeyError or TypeError from deep inside."""

    def need(ok: bool, field: str):
        if not ok:
            raise UserError(
                f"{path} is damaged (its {field!r} is missing or invalid): prepare the corpus again"
            )

    need(meta.get("dtype") in ("uint16", "uint32"), "dtype")
    tok = meta.get("tokenizer")
    fingerprint = tok.get("fingerprint") if isinstance(tok, dict) else None
    need(
        isinstance(tok, dict)
        and isinstance(tok.get("kind"), str)
        and isinstance(fingerprint, dict)
        and _count(fingerprint.get("vocab_size"))
        and isinstance(fingerprint.get("probe_ids"), list),
        "tokenizer",
    )
    if fmt in (FORMAT, CHAT_FORMAT):  # per split its tokens and its file, or conversations
        field, valid = ("file", _bare_name) if fmt == FORMAT else ("conversations", _count)
        splits = meta.get("splits")
        for split in SPLIT_FILES:
            entry = splits.get(split) if isinstance(splits, dict) else None
            need(
                isinstance(entry, dict) and _count(entry.get("tokens")) and valid(entry.get(field)),
                f"splits.{split}",
            )
        return
    for field in ("seq_len", "pairs", "val_pairs", "tokens"):
        need(_count(meta.get(field)), field)
    need(meta["val_pairs"] < meta["pairs"], "val_pairs")


def _count(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _bare_name(x) -> bool:
    """A file name in the corpus directory itself (meta.json names its files; never a path)."""
    return isinstance(x, str) and x not in ("", ".", "..") and Path(x).name == x


def _check_tokenizer(directory: Path, meta: dict, tokenizer: Tokenizer | None) -> Tokenizer:
    if (
        tokenizer is not None
        and tokenizer_fingerprint(tokenizer) != meta["tokenizer"]["fingerprint"]
    ):
        raise UserError(
            f"{directory} was tokenized with another tokenizer ({meta['tokenizer']['kind']}, "
            f"{meta['tokenizer']['fingerprint']['vocab_size']:,} ids) than this run's "
            f"({tokenizer.kind}, {tokenizer.vocab_size:,} ids)"
        )
    return tokenizer or load_tokenizer(directory, "a whole corpus prepared by megajax-prepare")


def _mapped(path: Path, dtype, count: int) -> np.ndarray:
    dtype = np.dtype(dtype)
    expected = count * dtype.itemsize
    if not path.is_file() or path.stat().st_size != expected:
        have = f"{path.stat().st_size:,} bytes" if path.is_file() else "no file"
        raise UserError(
            f"{path} should hold {count:,} {dtype.name} values ({expected:,} bytes), has {have}: "
            "damaged or incomplete; prepare it again"
        )
    return np.memmap(path, dtype=dtype, mode="r") if count else np.zeros(0, dtype)


def load_prepared(
    directory: Path, tokenizer: Tokenizer | None = None
) -> tuple[np.ndarray, np.ndarray, Tokenizer]:
    """(train tokens, val tokens, tokenizer), memory-mapped. A run that brings its own
    tokenizer (resuming, --init-from) must bring the one the corpus was made with."""
    directory = Path(directory)
    meta = read_meta(directory)
    tokenizer = _check_tokenizer(directory, meta, tokenizer)
    train, val = (
        _mapped(directory / meta["splits"][s]["file"], meta["dtype"], meta["splits"][s]["tokens"])
        for s in ("train", "val")
    )
    return train, val, tokenizer


def load_conversations(directory: Path, tokenizer: Tokenizer | None):
    """([train (ids, mask) per conversation], [val ones], tokenizer) of a `megajax-prepare
    --chat` directory: the arrays memory-mapped, each conversation a view into them."""
    directory = Path(directory)
    meta = read_meta(directory, CHAT_FORMAT)
    tokenizer = _check_tokenizer(directory, meta, tokenizer)
    out = []
    for split in SPLIT_FILES:
        entry = meta["splits"][split]

        def load(k, dtype, count):
            path = directory / f"{split}.{k}.npy"
            try:
                array = np.load(path, mmap_mode="r")
            except (OSError, ValueError):
                array = None
            if array is None or array.dtype != np.dtype(dtype) or array.shape != (count,):
                raise UserError(
                    f"{path} is damaged or incomplete (not {count:,} {dtype} values): prepare the "
                    "corpus again"
                )
            return array

        ids, mask = (
            load(k, t, entry["tokens"]) for k, t in (("ids", meta["dtype"]), ("mask", "int8"))
        )
        lengths = load("lengths", "int32", entry["conversations"])
        if int(lengths.sum(dtype=np.int64)) != entry["tokens"] or (lengths < 0).any():
            raise UserError(
                f"{directory / f'{split}.lengths.npy'} is damaged: prepare the corpus again"
            )
        check_ids(ids, tokenizer.vocab_size, str(directory / f"{split}.ids.npy"))
        ends = np.cumsum(lengths)
        out.append(
            [
                (ids[e - n : e].astype(np.int32), mask[e - n : e])
                for n, e in zip(lengths.tolist(), ends.tolist())
            ]
        )
    return out[0], out[1], tokenizer


class DiskPairs:
    """Pairs lo..hi of a prepared pairs directory, as the (A, B) lists PretrainBatches reads.
    Each pair read is checked against its files' bounds and the tokenizer's ids: cheap per pair,
    where reading the whole corpus up front would not be, and a damaged file is one line."""

    def __init__(
        self,
        tokens: np.ndarray,
        index: np.ndarray,
        lo: int,
        hi: int,
        directory: Path,
        vocab_size: int,
    ):
        self.tokens_file, self.index, self.lo, self.hi = tokens, index, lo, hi
        self.directory, self.vocab_size = directory, vocab_size

    def __len__(self) -> int:
        return self.hi - self.lo

    def __getitem__(self, i: int):
        if not 0 <= i < len(self):
            raise IndexError(i)
        start, len_a, len_b = (int(x) for x in self.index[self.lo + i])
        if min(start, len_a, len_b) < 0 or start + len_a + len_b > len(self.tokens_file):
            raise UserError(
                f"{self.directory / 'pairs_index.bin'} is damaged: pair {self.lo + i:,} lies "
                "outside pairs.bin; prepare the corpus again"
            )
        pair = self.tokens_file[start : start + len_a + len_b]
        check_ids(pair, self.vocab_size, f"{self.directory / 'pairs.bin'}", start)
        pair = pair.tolist()
        return pair[:len_a], pair[len_a:]

    @property
    def tokens(self) -> int:
        rows = self.index[self.lo : self.hi]
        return int(rows[:, 1].sum() + rows[:, 2].sum())


def load_pairs(
    directory: Path, tokenizer: Tokenizer | None, seq_len: int
) -> tuple[DiskPairs, DiskPairs, Tokenizer]:
    """(train pairs, val pairs, tokenizer) of a `megajax-prepare --pairs` directory, mapped."""
    directory = Path(directory)
    if not (directory / META).is_file():
        raise UserError(
            f"{directory} is not a prepared corpus (no {META}): make one with megajax-prepare "
            "--pairs"
        )
    meta = read_meta(directory, PAIRS_FORMAT)
    if meta["seq_len"] != seq_len:
        raise UserError(
            f"{directory} holds pairs for model.seq_len = {meta['seq_len']}, not {seq_len}: set "
            f"model.seq_len={meta['seq_len']} or prepare it again with --seq-len {seq_len}"
        )
    tokenizer = _check_tokenizer(directory, meta, tokenizer)
    n, n_val = meta["pairs"], meta["val_pairs"]
    tokens = _mapped(directory / "pairs.bin", meta["dtype"], meta["tokens"])
    index = _mapped(directory / "pairs_index.bin", np.int64, 3 * n).reshape(n, 3)

    def split(lo, hi):
        return DiskPairs(tokens, index, lo, hi, directory, tokenizer.vocab_size)

    return split(0, n - n_val), split(n - n_val, n), tokenizer


def check_ids(ids: np.ndarray, vocab_size: int, where: str, offset: int = 0):
    """Token ids read from a file must be ids of the run's vocabulary: one out of range is a
    damaged file (the model would embed it as zeros and train on garbage without a word)."""
    if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
        first = int(np.flatnonzero((ids < 0) | (ids >= vocab_size))[0])
        raise UserError(
            f"{where} holds token id {int(ids[first])} at token {offset + first:,}, outside the "
            f"vocabulary's {vocab_size:,} ids: the file is damaged, or was made with another "
            "tokenizer; prepare it again"
        )
