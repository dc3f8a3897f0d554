"""megajax-prepare --pairs: BERT's sentence pairs built once, into memory-mapped files that
`--data pairs:DIR` trains from (megajax/data/prepared.py reads them).

The pairs are those the in-memory path builds from the same text (megajax/data/bert_pretrain.py):
text files are read as if joined by newlines and split into paragraphs and sentences the same
way, the sentences are tokenized (in parallel, unit by unit, resumably, as for token files), and
the same generator packs them into pairs with the same draws. Only the pairs are ever whole:
in two files, their tokens and an index, which a run maps instead of reading.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

from megajax.data.sentences import iter_pairs, split_documents
from megajax.data.sources import read_utf8, tfds_texts
from megajax.errors import UserError
from megajax.prepare.units import tfds_split

UNIT_SENTENCES = 20_000
_PARAGRAPH = re.compile(r"\n\s*\n")


def documents(sources: list[dict], text_field: str):
    """Every document (a list of sentences) of the sources, in order. Text files behave as one
    text joined by newlines, as `text:` sources do in memory: a paragraph may run on into the
    next file; each jsonl record and TFDS record is split on its own."""
    carry = None
    for s in sources:
        if s["kind"] != "text":
            if carry is not None:
                yield from split_documents(carry)
                carry = None
            yield from (d for text in _records(s, text_field) for d in split_documents(text))
            continue
        text = read_utf8(Path(s["source"]))
        pieces = _PARAGRAPH.split(text if carry is None else carry + "\n" + text)
        for piece in pieces[:-1]:
            yield from split_documents(piece)
        carry = pieces[-1]
    if carry is not None:
        yield from split_documents(carry)


def _records(source: dict, text_field: str):
    if source["kind"] == "tfds":
        yield from tfds_texts(*tfds_split(source["source"]))
        return
    with open(source["source"], encoding="utf-8-sig") as f:  # a byte-order mark is no text
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    yield json.loads(line)[text_field]
                except (json.JSONDecodeError, KeyError, TypeError):
                    raise UserError(
                        f"{source['source']}: line {n} is not a JSON object with a '{text_field}' "
                        "field (--text-field)"
                    ) from None


def units(sources: list[dict], text_field: str):
    """(index, documents) groups of about UNIT_SENTENCES sentences, a pure function of the
    sources."""
    group, sentences, k = [], 0, 0
    for doc in documents(sources, text_field):
        group.append(doc)
        sentences += len(doc)
        if sentences >= UNIT_SENTENCES:
            yield k, group
            group, sentences, k = [], 0, k + 1
    if group:
        yield k, group


def tokenize_documents(docs: list[list[str]], tokenizer, dtype) -> dict:
    """One unit: every sentence's ids, flat, with the sentence lengths and sentences per
    document."""
    ids = tokenizer.encode_batch([s for d in docs for s in d])
    return {
        "tokens": np.asarray([t for s in ids for t in s], dtype),
        "lengths": np.asarray([len(s) for s in ids], np.int64),
        "sentences": np.asarray([len(d) for d in docs], np.int64),
    }


def _unit_documents(path: Path):
    # each item of an .npz is read (and checksummed) on every access: once here
    with np.load(path) as unit:
        tokens, lengths, per_document = (
            unit["tokens"].tolist(),
            unit["lengths"],
            unit["sentences"].tolist(),
        )
    bounds = np.concatenate([[0], np.cumsum(lengths)]).tolist()
    sentences = [tokens[a:b] for a, b in zip(bounds, bounds[1:])]
    at = 0
    for n in per_document:
        yield sentences[at : at + n]
        at += n


def write_pairs(unit_files: list[Path], out: Path, seq_len: int, seed: int, dtype) -> dict:
    """Pack the tokenized units into pairs: out/pairs.bin (A then B of each pair) and
    out/pairs_index.bin (int64 start, len(A), len(B) per pair). Returns the counts."""
    docs = (d for f in unit_files for d in _unit_documents(f))
    n, start = 0, 0
    with open(out / "pairs.bin", "wb") as tokens, open(out / "pairs_index.bin", "wb") as index:
        for a, b in iter_pairs(docs, seq_len, seed):
            tokens.write(np.asarray(a + b, dtype).tobytes())
            index.write(np.asarray([start, len(a), len(b)], np.int64).tobytes())
            start += len(a) + len(b)
            n += 1
    if n == 0:
        raise UserError(
            "the corpus has no sentence pairs: BERT pretraining needs paragraphs of at least two "
            "tokens"
        )
    return {"pairs": n, "tokens": start}
