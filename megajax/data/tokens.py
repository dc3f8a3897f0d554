"""Token streams and deterministic, data-sharded GPT batches.

Sources: those of megajax/data/sources.py, tokenized, or `bin:PATH`, a flat array of
uint16/uint32 token ids (nanoGPT's .bin format), or `bin:DIR`, a corpus prepared by
megajax-prepare (train and validation files, its tokenizer: megajax/data/prepared.py), or
`megatron:PREFIX`, a Megatron-LM indexed dataset (megajax/data/megatron.py).

Training batch `step` is a pure function of (seed, step): a resumed run sees exactly the
batches of an uninterrupted one. Validation sweeps fixed, non-overlapping windows spread over
the held-out split. Each process materialises only the rows its devices own.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import numpy as np

from megajax.data.megatron import check_first_ids, ids_tokenizer, read_indexed, token_split
from megajax.data.prepared import check_ids, is_prepared, load_prepared
from megajax.data.sources import builtin_text, read_text, tfds_texts
from megajax.data.tokenizer import Tokenizer, chosen
from megajax.errors import UserError
from megajax.specs import SOURCE_FORMS, DataSpec, TokenizerSpec


@dataclasses.dataclass
class TokenData:
    train: np.ndarray
    val: np.ndarray
    tokenizer: Tokenizer
    # ids the model must embed: the tokenizer's, or more (see megajax/tasks/lm.py)
    vocab_size: int = 0
    # from a megajax-prepare directory: split and tokenizer already checked
    prepared: bool = False
    source: str = ""  # where the ids were read from, for a message about a damaged file

    def __post_init__(self):
        self.vocab_size = self.vocab_size or self.tokenizer.vocab_size

    def describe(self) -> str:
        return f"{len(self.train):,} train tokens"

    def batches(self, split: str, cfg, sharding):
        """GPT batches of a split (None for a validation split too short for one sequence)."""
        t, s = cfg.train, cfg.model.seq_len
        if split == "train":
            return Batches(
                self.train,
                s,
                t.batch_size,
                t.seed,
                sharding,
                vocab_size=self.vocab_size,
                source=self.source,
            )
        if len(self.val) < s + 2:
            return None
        return EvalWindows(
            self.val, s, t.batch_size, t.eval_batches, sharding, self.vocab_size, self.source
        )


def load_tokens(
    source: str | DataSpec,
    tokenizer_spec: str | TokenizerSpec | None = None,
    val_fraction: float = 0.1,
    bin_dtype: str = "uint16",
    tokenizer: Tokenizer | None = None,
) -> TokenData:
    """Tokenize `source` with `tokenizer` (or else the one `tokenizer_spec` makes) and hold out
    the last `val_fraction` of it for validation (a source with its own splits keeps them)."""
    spec = DataSpec.of(source)
    if spec.kind not in SOURCES:
        if spec.kind == "pairs":
            raise UserError(
                f"data source '{source}' holds BERT sentence pairs, for model.kind = bert"
            )
        *most, last = SOURCE_FORMS.values()
        raise UserError(f"unknown data source '{source}' (use {', '.join(most)} or {last})")
    return SOURCES[spec.kind](spec, tokenizer, tokenizer_spec, val_fraction, bin_dtype)


def _bin(spec: DataSpec, given, tokenizer_spec, val_fraction: float, bin_dtype: str) -> TokenData:
    """bin:DIR, a megajax-prepare directory (its own splits and tokenizer), or bin:PATH, ids."""
    path = Path(spec.arg)
    if is_prepared(path):
        train, val, tok = load_prepared(path, given)
        return TokenData(train, val, tok, prepared=True, source=spec.arg)
    if path.is_dir():
        raise UserError(
            f"{path} is a directory without meta.json, not a corpus prepared by megajax-prepare "
            "(bin: takes one of those, or a file of tokens)"
        )
    if not path.is_file():
        raise UserError(f"data file not found: {path}")
    if path.stat().st_size == 0:
        raise UserError(f"data file is empty: {path}")
    width = np.dtype(bin_dtype).itemsize
    if path.stat().st_size % width:
        raise UserError(
            f"{path} has {path.stat().st_size} bytes, not a whole number of {bin_dtype} tokens (is "
            "data.bin_dtype right?)"
        )
    tokens = np.memmap(path, dtype=np.dtype(bin_dtype), mode="r")
    # ids need no vocabulary built from text: a chars spec reads them as bytes would
    by_ids = (
        "bytes"
        if tokenizer_spec is not None and TokenizerSpec.of(tokenizer_spec).kind == "chars"
        else tokenizer_spec
    )
    return dataclasses.replace(_split(tokens, val_fraction, chosen(given, by_ids)), source=spec.arg)


def _megatron(
    spec: DataSpec, given, tokenizer_spec, val_fraction: float, bin_dtype: str
) -> TokenData:
    ds = read_indexed(spec.arg)
    tok = ids_tokenizer(given, tokenizer_spec, spec)
    check_first_ids(ds, tok, str(spec))
    train, val = token_split(ds, val_fraction)
    return TokenData(train, val, tok, source=str(ds.prefix))


def _tfds(spec: DataSpec, given, tokenizer_spec, val_fraction: float, bin_dtype: str) -> TokenData:
    """The dataset's train split, and its validation (or test) split when it has one."""
    train_texts = tfds_texts(spec.arg, "train")
    tok = chosen(given, tokenizer_spec, "\n".join(train_texts))
    train = _encode(tok, "\n".join(train_texts))
    for split in ("validation", "test"):
        try:
            return TokenData(train, _encode(tok, "\n".join(tfds_texts(spec.arg, split))), tok)
        except UserError:
            continue
    return _split(train, val_fraction, tok)


def _text(spec: DataSpec, given, tokenizer_spec, val_fraction: float, bin_dtype: str) -> TokenData:
    text = builtin_text() if spec.kind == "builtin" else read_text(spec.arg)
    tok = chosen(given, tokenizer_spec, text)
    return _split(_encode(tok, text), val_fraction, tok)


# The kinds of source a GPT reads: (spec, tokenizer given, tokenizer spec, val_fraction, bin_dtype)
# -> TokenData.
SOURCES = {"builtin": _text, "text": _text, "bin": _bin, "megatron": _megatron, "tfds": _tfds}


def _encode(tok: Tokenizer, text: str) -> np.ndarray:
    ids = np.asarray(tok.encode(text), dtype=np.uint32 if tok.vocab_size > 65535 else np.uint16)
    if ids.size == 0:
        raise UserError("the data source has no tokens")
    return ids


def _split(tokens: np.ndarray, val_fraction: float, tok: Tokenizer) -> TokenData:
    n_val = int(len(tokens) * val_fraction)
    return TokenData(tokens[: len(tokens) - n_val], tokens[len(tokens) - n_val :], tok)


class Batches:
    """Random windows of seq_len + 1 tokens; row r of batch `step` depends only on (seed, step,
    r)."""

    def __init__(
        self,
        tokens: np.ndarray,
        seq_len: int,
        batch_size: int,
        seed: int,
        sharding,
        name="train",
        vocab_size: int | None = None,
        source: str = "",
    ):
        if len(tokens) < seq_len + 2:
            raise UserError(
                f"the {name} split has {len(tokens)} tokens, fewer than one sequence of "
                f"{seq_len + 1}; use more data or a smaller model.seq_len"
            )
        self.tokens, self.seq_len, self.batch_size = tokens, seq_len, batch_size
        self.seed, self.sharding, self.vocab_size = seed, sharding, vocab_size
        self.where = f"{source + ': ' if source else ''}the {name} split"
        self.stream = 0 if name == "train" else 1

    def starts(self, step: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, self.stream, step])
        return rng.integers(0, len(self.tokens) - self.seq_len - 1, size=self.batch_size)

    def rows(self, step: int, row_slice: slice) -> np.ndarray:
        starts = self.starts(step)[row_slice]
        rows = [np.asarray(self.tokens[s : s + self.seq_len + 1]) for s in starts]
        # a memory-mapped file is only read here: checked as it is read
        if self.vocab_size is not None:
            for s, row in zip(starts, rows):
                check_ids(row, self.vocab_size, self.where, int(s))
        return np.stack(rows).astype(np.int32)

    def __call__(self, step: int) -> jax.Array:
        """The global (batch, seq_len + 1) array for `step`, each process filling only its rows."""
        shape = (self.batch_size, self.seq_len + 1)
        return jax.make_array_from_callback(
            shape, self.sharding, lambda idx: self.rows(step, idx[0])
        )


class EvalWindows(Batches):
    """`num_batches` validation batches of non-overlapping windows, evenly spread over the split.

    Window w holds tokens [w * seq_len, w * seq_len + seq_len + 1), so every token is a target
    at most once, with the same spread of context lengths as random windows. Unlike random
    windows (nanoGPT's estimate) the sweep is fixed: the validation loss of two runs, or two
    evaluations of one run, differ only by the model. When `max_batches` batches have room
    for every window the sweep covers the whole split (less the tail of fewer than
    batch_size windows that would not fill a batch), and the mean is the split's own loss.
    """

    def __init__(
        self,
        tokens: np.ndarray,
        seq_len: int,
        batch_size: int,
        max_batches: int,
        sharding,
        vocab_size: int | None = None,
        source: str = "",
    ):
        super().__init__(tokens, seq_len, batch_size, 0, sharding, "val", vocab_size, source)
        n_windows = (len(tokens) - 1) // seq_len
        self.num_batches = max(1, min(max_batches, n_windows // batch_size))
        self.n_windows = n_windows

    def starts(self, step: int) -> np.ndarray:
        # may exceed n_windows for a tiny split: windows repeat
        count = self.num_batches * self.batch_size
        # (made per batch: a batch's worth of memory, however many)
        first = step * self.batch_size
        return (
            np.arange(first, min(first + self.batch_size, count), dtype=np.int64)
            * self.n_windows
            // count
            * self.seq_len
        )
