"""From text to BERT's sentence pairs, in plain Python and NumPy (no jax, so the process pool of
megajax-prepare can fork safely): paragraphs and sentences, and the packing of consecutive
sentences into (A, B) segment pairs (ALBERT/Megatron). megajax/data/bert_pretrain.py lays the
pairs out as batches.
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np

from megajax.data.tokenizer import Tokenizer
from megajax.errors import UserError

_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")
SHORT_SEQ_PROB = 0.1  # share of chunks with a shorter random target length, as in BERT


def split_documents(text: str) -> list[list[str]]:
    """Paragraphs (separated by blank lines) as lists of sentences."""
    docs = []
    for para in re.split(r"\n\s*\n", text):
        joined = " ".join(line.strip() for line in para.splitlines() if line.strip())
        sentences = [s for s in _SENTENCE_END.split(joined) if s]
        if sentences:
            docs.append(sentences)
    return docs


@dataclasses.dataclass(frozen=True)
class Specials:
    cls: int
    sep: int
    mask: int
    pad: int

    @classmethod
    def of(cls, tok: Tokenizer) -> "Specials":
        ids = {t: tok.token_id(t) for t in ("[CLS]", "[SEP]", "[MASK]", "[PAD]")}
        missing = [t for t, i in ids.items() if i is None]
        if missing:
            raise UserError(
                f"BERT needs a tokenizer with {', '.join(missing)} (use --tokenizer "
                "wordpiece:PATH/vocab.txt, or wordpiece to train one)"
            )
        return cls(ids["[CLS]"], ids["[SEP]"], ids["[MASK]"], ids["[PAD]"])


def pair_room(seq_len: int) -> int:
    """Tokens of A and B that fit [CLS] A [SEP] B [SEP] in seq_len; at least one each, or a
    UserError naming the smallest seq_len that works."""
    if seq_len < 5:
        raise UserError(
            "BERT's sentence pairs ([CLS] A [SEP] B [SEP]) need model.seq_len of at least 5, got "
            f"{seq_len}"
        )
    return seq_len - 3


def truncate_pair(
    a: list[int], b: list[int], max_tokens: int, rng=None
) -> tuple[list[int], list[int]]:
    """BERT's truncate_seq_pair: drop tokens from the longer segment, at a random end when
    pretraining (`rng`), from its end when fine-tuning."""
    a, b = list(a), list(b)
    while len(a) + len(b) > max_tokens:
        longer = a if len(a) > len(b) else b
        del longer[0 if rng is not None and rng.random() < 0.5 else -1]
    return a, b


def make_pairs(
    docs: list[list[list[int]]], seq_len: int, seed: int
) -> list[tuple[list[int], list[int]]]:
    """(A, B) segment pairs of consecutive text, each fitting [CLS] A [SEP] B [SEP] in seq_len."""
    return list(iter_pairs(docs, seq_len, seed))


def iter_pairs(docs, seq_len: int, seed: int):
    """make_pairs over any iterable of documents, one pair at a time (megajax-prepare streams a
    corpus through it): the same draws, so the same pairs."""
    rng = np.random.default_rng([seed, 7])
    max_tokens = pair_room(seq_len)

    def target():
        return (
            max_tokens if rng.random() >= SHORT_SEQ_PROB else int(rng.integers(2, max_tokens + 1))
        )

    for doc in docs:
        chunk, length, goal = [], 0, target()
        for i, sentence in enumerate(doc):
            if sentence:
                chunk.append(sentence)
                length += len(sentence)
            if chunk and (i == len(doc) - 1 or length >= goal):
                if length >= 2:
                    if len(chunk) >= 2:
                        cut = int(rng.integers(1, len(chunk)))
                        a = [t for s in chunk[:cut] for t in s]
                        b = [t for s in chunk[cut:] for t in s]
                    else:  # one long sentence: cut it inside
                        cut = int(rng.integers(1, len(chunk[0])))
                        a, b = chunk[0][:cut], chunk[0][cut:]
                    yield truncate_pair(a, b, max_tokens, rng)
                chunk, length, goal = [], 0, target()
