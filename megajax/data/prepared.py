"""A corpus prepared by megajax-prepare (megajax/prepare/): what is in its directory, and
reading it back for train.py (`--data bin:DIR`) with every check that can fail cheaply.

    DIR/meta.json        format, tokenizer, token dtype, end-of-document id, per split the file,
                         token and document counts, and each source's size and SHA-256
    DIR/train.bin        the training split: token ids, flat, in the dtype meta.json names
    DIR/val.bin          the held-out documents
    DIR/tokenizer.json   the tokenizer that made them (and its hf_tokenizer.json / vocab.txt)

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
VERSION = 1
SPLIT_FILES = {"train": "train.bin", "val": "val.bin"}
# Text every tokenizer encodes: two tokenizers that give it the same ids and have the same
# vocabulary size are taken to be the same.
PROBE = "The quick brown fox, 123 -- naïve café! Übermäßig.\n\n"


def token_dtype(vocab_size: int) -> str:
    return "uint16" if vocab_size <= 2 ** 16 else "uint32"


def tokenizer_fingerprint(tok: Tokenizer) -> dict:
    return {"kind": tok.kind, "vocab_size": tok.vocab_size, "probe_ids": [int(i) for i in tok.encode(PROBE)]}


def is_prepared(path: Path) -> bool:
    return (Path(path) / META).is_file()


def read_meta(directory: Path) -> dict:
    path = Path(directory) / META
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        raise UserError(f"{path} cannot be read: not a corpus prepared by megajax-prepare") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise UserError(f"{path} is not a megajax-prepare {FORMAT} v{VERSION} description")
    return meta


def load_prepared(directory: Path, tokenizer: Tokenizer | None = None) -> tuple[np.ndarray, np.ndarray, Tokenizer]:
    """(train tokens, val tokens, tokenizer), memory-mapped. A run that brings its own
    tokenizer (resuming, --init-from) must bring the one the corpus was made with."""
    directory = Path(directory)
    meta = read_meta(directory)
    saved = load_tokenizer(directory)
    if tokenizer is not None and tokenizer_fingerprint(tokenizer) != meta["tokenizer"]["fingerprint"]:
        raise UserError(f"{directory} was tokenized with another tokenizer ({meta['tokenizer']['kind']}, "
                        f"{meta['tokenizer']['fingerprint']['vocab_size']:,} ids) than this run's "
                        f"({tokenizer.kind}, {tokenizer.vocab_size:,} ids)")
    dtype = np.dtype(meta["dtype"])
    splits = []
    for name in ("train", "val"):
        info = meta["splits"][name]
        path = directory / info["file"]
        expected = info["tokens"] * dtype.itemsize
        if not path.is_file() or path.stat().st_size != expected:
            have = path.stat().st_size if path.is_file() else "no file"
            raise UserError(f"{path} should hold {info['tokens']:,} {dtype.name} tokens ({expected:,} bytes), "
                            f"has {have}: damaged or incomplete; prepare it again")
        splits.append(np.memmap(path, dtype=dtype, mode="r") if info["tokens"] else np.zeros(0, dtype))
    return splits[0], splits[1], tokenizer or saved
