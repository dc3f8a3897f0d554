"""Megatron-LM's indexed datasets, read in place: `--data megatron:PREFIX`.

Megatron-LM's tools/preprocess_data.py writes a corpus as PREFIX.bin (every sequence's token
ids, back to back) and PREFIX.idx:

    b"MMIDIDX\\x00\\x00", version (uint64, 1), dtype code (uint8), S sequences (uint64),
    D + 1 document boundaries (uint64), then int32 lengths[S], int64 byte pointers[S],
    int64 document_indices[D + 1] (the first sequence of each document, then S), and for a
    multimodal dataset an int8 mode per sequence (not read).

A sequence is a document, or with --split-sentences a sentence (BERT's data). The tokens are
memory-mapped, never read whole (the index's tables are: 8 bytes a sequence), and both files are
checked against each other first, so that a damaged or foreign file is one line here rather
than wrong tokens later. Token ids are checked against the
run's vocabulary as its windows are read (data/tokens.py), as for megajax-prepare's corpora.
"""

from __future__ import annotations

import dataclasses
import struct
from pathlib import Path

import numpy as np

from megajax.data.prepared import held_out_cut
from megajax.data.tokenizer import Tokenizer, fixed_tokenizer
from megajax.errors import UserError

MAGIC = b"MMIDIDX\x00\x00"
# magic, version, dtype code, sequences, document boundaries
HEADER = struct.Struct("<9sQBQQ")
TOKEN_DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 8: np.uint16}
FLOAT_CODES = {6: "float64", 7: "float32"}


@dataclasses.dataclass
class IndexedDataset:
    prefix: Path
    tokens: np.ndarray  # every sequence's ids in order: the .bin, mapped
    # int64: the token offset where each sequence starts, then the number of tokens
    bounds: np.ndarray
    # int64: the first sequence of each document, then the number of sequences
    document_starts: np.ndarray

    @property
    def documents(self) -> int:
        return len(self.document_starts) - 1

    def document_ends(self) -> np.ndarray:
        """The token offset where each document ends."""
        return self.bounds[self.document_starts[1:]]

    def sentences(self):
        """Each document as a list of its sequences' ids (BERT: its sentences)."""
        for first, last in zip(self.document_starts[:-1], self.document_starts[1:]):
            b = self.bounds[first : last + 1]
            yield [self.tokens[x:y] for x, y in zip(b[:-1], b[1:])]


def prefix_of(arg: str) -> Path:
    """PREFIX as Megatron's --data-path takes it; PREFIX.bin or PREFIX.idx named instead work
    too."""
    path = Path(arg)
    return path.with_suffix("") if path.suffix in (".bin", ".idx") else path


def read_indexed(arg: str) -> IndexedDataset:
    prefix = prefix_of(arg)
    idx, data = Path(f"{prefix}.idx"), Path(f"{prefix}.bin")
    for path in (idx, data):
        if not path.is_file():
            raise UserError(
                f"{path} not found: megatron:PREFIX reads PREFIX.idx and PREFIX.bin, the files "
                "Megatron-LM's tools/preprocess_data.py writes"
            )
    raw = np.memmap(idx, dtype=np.uint8, mode="r") if idx.stat().st_size else np.zeros(0, np.uint8)
    if len(raw) < HEADER.size or bytes(raw[:9]) != MAGIC:
        raise UserError(f"{idx} is not a Megatron-LM index (no MMIDIDX header)")
    _, version, code, count, bounds = HEADER.unpack(bytes(raw[: HEADER.size]))
    if version != 1:
        raise UserError(f"{idx} is a version {version} Megatron-LM index; megajax reads version 1")
    if code not in TOKEN_DTYPES:
        what = (
            f"holds {FLOAT_CODES[code]} values, not token ids"
            if code in FLOAT_CODES
            else f"has unknown dtype code {code}"
        )
        raise UserError(f"{idx} {what}")
    tables = HEADER.size + 12 * count + 8 * bounds
    # + an int8 mode per sequence (multimodal)
    if len(raw) not in (tables, tables + count):
        raise UserError(
            f"{idx} should hold {tables:,} bytes for its {count:,} sequences and {bounds:,} "
            f"document boundaries, has {len(raw):,}: damaged or incomplete"
        )
    lengths = raw[HEADER.size : HEADER.size + 4 * count].view("<i4")
    pointers = raw[HEADER.size + 4 * count : HEADER.size + 12 * count].view("<i8")
    starts = np.asarray(raw[HEADER.size + 12 * count : tables].view("<i8"), np.int64)
    dtype = np.dtype(TOKEN_DTYPES[code]).newbyteorder("<")
    bounds = _check_tables(idx, lengths, pointers, starts, dtype.itemsize)
    total = int(bounds[-1])
    if data.stat().st_size != total * dtype.itemsize:
        raise UserError(
            f"{data} should hold {total:,} {dtype.name} tokens ({total * dtype.itemsize:,} bytes) "
            f"as {idx.name} says, has {data.stat().st_size:,} bytes: damaged, or another dataset's"
        )
    tokens = np.memmap(data, dtype=dtype, mode="r") if total else np.zeros(0, dtype)
    return IndexedDataset(prefix, tokens, bounds, starts)


def _check_tables(idx: Path, lengths, pointers, starts, itemsize: int) -> np.ndarray:
    """The index must describe sequences laid back to back, grouped into documents in order;
    returns each sequence's first token offset and the number of tokens."""
    if len(lengths) and lengths.min() < 0:
        raise UserError(f"{idx} has a negative sequence length: damaged")
    bounds = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])
    if not np.array_equal(pointers, bounds[:-1] * itemsize):
        raise UserError(
            f"{idx}: its sequence pointers are not its lengths laid back to back: damaged"
        )
    if (
        len(starts) == 0
        or starts[0] != 0
        or starts[-1] != len(lengths)
        or np.any(np.diff(starts) < 0)
    ):
        raise UserError(
            f"{idx}: its document indices do not run from 0 to its {len(lengths):,} sequences: "
            "damaged"
        )
    return bounds


def token_split(ds: IndexedDataset, val_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """(train, validation), the held-out part whole trailing documents, as megajax-prepare cuts."""
    cut = held_out_cut(ds.document_ends(), len(ds.tokens), val_fraction)
    return ds.tokens[:cut], ds.tokens[cut:]


def ids_tokenizer(given: Tokenizer | None, spec, source) -> Tokenizer:
    """The tokenizer that made a dataset of ids (the one given, or the spec's): one built from
    the corpus's text cannot be."""
    return fixed_tokenizer(
        given,
        spec,
        f"--tokenizer {spec} is built from the corpus's text, and {source} holds token ids: give "
        "the tokenizer that made them (hf:PATH, tiktoken:gpt2, wordpiece:PATH/vocab.txt, ...)",
    )


def check_first_ids(ds: IndexedDataset, tok: Tokenizer, source: str, count: int = 1 << 20):
    """The first million ids against the tokenizer: a dataset made with another tokenizer is
    refused now, in one line (every window is checked again as it is read)."""
    head = np.asarray(ds.tokens[:count])
    if head.size and (head.min() < 0 or head.max() >= tok.vocab_size):
        bad = int(head.min() if head.min() < 0 else head.max())
        raise UserError(
            f"{source} has token id {bad}, outside the {tok.kind} tokenizer's {tok.vocab_size:,} "
            "ids: give the tokenizer that made it (--tokenizer)"
        )


def sentence_documents(arg: str, tok: Tokenizer, source: str) -> list[list[list[int]]]:
    """BERT's documents of sentences from a dataset preprocessed with --split-sentences, the ids
    all checked (they are read whole, into the pairs)."""
    ds = read_indexed(arg)
    starts = ds.document_starts
    if ds.documents and not np.any(np.diff(starts) >= 2):
        raise UserError(
            f"{source} holds one sequence per document (preprocess_data.py without "
            "--split-sentences): BERT's sentence pairs need the sentences; preprocess it with "
            "--split-sentences"
        )
    check_first_ids(ds, tok, source, count=len(ds.tokens))
    return [[s.tolist() for s in doc] for doc in ds.sentences()]
