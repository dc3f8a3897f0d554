"""BERT pretraining data: sentence pairs for sentence-order prediction, and masked tokens.

From plain text (the built-in corpus or `text:` files): a paragraph (text between blank
lines) is a document, split into sentences. Consecutive sentences are packed into chunks of
about seq_len - 3 tokens and each chunk is cut at a sentence boundary into segments A and B
(ALBERT/Megatron). At batch time each example is laid out as [CLS] A [SEP] B [SEP]; half are
swapped to B, A (sentence-order label 1), and 15% of the non-special tokens are chosen for
prediction as Megatron-LM chooses them: whole words (a token and its `##` pieces) in n-gram
spans of 1 to 3 words, n drawn with probability proportional to 1/n (`data.masking =
"token"`: independent tokens instead). Each chosen token then becomes [MASK] 80% of the time,
a random token 10%, and stays 10%. Everything random is drawn
from (seed, step, row), so a batch is a pure function of the step, like GPT's.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import numpy as np

from megajax.data.sentences import Specials, make_pairs, split_documents
from megajax.data.tokenizer import Tokenizer
from megajax.errors import UserError
from megajax.shapes import mlm_predictions


def masking_budget(n_candidates: int, n_predict: int, mask_prob: float, rng) -> int:
    """mask_prob of the candidates, at least one, at most n_predict. The count is rounded up or
    down at random, so the rate is mask_prob even for short sequences (BERT's round() gives 3
    of 18 = 17% there)."""
    expected = n_candidates * mask_prob
    n = int(expected) + int(rng.random() < expected - int(expected))
    return min(n_predict, max(1, n))


def whole_words(
    ids: np.ndarray, candidates: np.ndarray, continuation: np.ndarray | None
) -> list[list[int]]:
    """Candidate positions grouped into words: a token and the `##` pieces that follow it. A
    word never spans a special token (the candidates skip [CLS] and [SEP])."""
    words: list[list[int]] = []
    for p in candidates.tolist():
        if words and words[-1][-1] == p - 1 and continuation is not None and continuation[ids[p]]:
            words[-1].append(p)
        else:
            words.append([p])
    return words


def choose_ngrams(words: list[list[int]], budget: int, max_ngram: int, rng) -> list[list[int]]:
    """Megatron-LM's create_masked_lm_predictions: visit the words in random order; at each,
    draw a span of n = 1..max_ngram consecutive words with probability proportional to 1/n,
    shorten it while it would overshoot the budget, and take it unless it overlaps a span
    already taken. Returns the spans (token positions), so no word is ever partly masked."""
    weights = 1.0 / np.arange(1, max_ngram + 1)
    covered: set[int] = set()
    spans, taken = [], 0
    for start in rng.permutation(len(words)).tolist():
        if taken >= budget:
            break
        longest = min(max_ngram, len(words) - start)
        n = int(
            rng.choice(np.arange(1, longest + 1), p=weights[:longest] / weights[:longest].sum())
        )
        span = [q for w in words[start : start + n] for q in w]
        while taken + len(span) > budget and n > 1:
            n -= 1
            span = [q for w in words[start : start + n] for q in w]
        if taken + len(span) > budget or covered.intersection(span):
            continue
        covered.update(span)
        spans.append(span)
        taken += len(span)
    return spans


def mask_tokens(
    ids: np.ndarray, positions: np.ndarray, specials: Specials, random_ids: np.ndarray, rng
):
    """BERT's replacement of the chosen positions: 80% -> [MASK], 10% -> a random token, 10%
    unchanged, each token on its own. Returns (masked ids, sorted positions, original ids)."""
    positions = np.sort(positions)
    originals = ids[positions].copy()
    r = rng.random(len(positions))
    out = ids.copy()
    out[positions[r < 0.8]] = specials.mask
    swap = positions[(r >= 0.8) & (r < 0.9)]
    out[swap] = rng.choice(random_ids, size=len(swap))
    return out, positions, originals


class PretrainBatches:
    """Global BERT pretraining batches; each process builds only the rows its devices own."""

    def __init__(
        self, pairs, cfg, specials: Specials, tokenizer: Tokenizer, sharding, name: str = "train"
    ):
        if not pairs:
            raise UserError(
                f"the {name} split has no sentence pairs: BERT pretraining needs paragraphs of at "
                "least two tokens"
            )
        self.pairs, self.specials, self.sharding = pairs, specials, sharding
        self.seq_len, self.batch_size, self.seed = (
            cfg.model.seq_len,
            cfg.train.batch_size,
            cfg.train.seed,
        )
        self.mask_prob, self.max_ngram = cfg.data.mask_prob, cfg.data.max_ngram
        # Whole-word masking needs to know which tokens continue a word; per-token masking
        # treats every token as a word of its own and draws single tokens (n-grams of 1).
        self.continuation = (
            tokenizer.continuation_mask() if cfg.data.masking == "whole_word" else None
        )
        if cfg.data.masking == "token":
            self.max_ngram = 1
        self.n_predict = mlm_predictions(self.seq_len, self.mask_prob)
        special_ids = [specials.cls, specials.sep, specials.mask, specials.pad]
        self.random_ids = np.setdiff1d(np.arange(tokenizer.vocab_size), special_ids)
        self.stream = 0 if name == "train" else 1
        self._memo = {}

    def example(self, step: int, row: int) -> dict:
        rng = np.random.default_rng([self.seed, self.stream, step, row])
        return self.encode(self.pairs[int(rng.integers(len(self.pairs)))], rng)

    def encode(self, pair, rng) -> dict:
        """[CLS] A [SEP] B [SEP] (or B first, half the time), padded, with its masked tokens."""
        a, b = pair
        swapped = rng.random() < 0.5
        if swapped:
            a, b = b, a
        sp, s = self.specials, self.seq_len
        ids = np.full(s, sp.pad, np.int32)
        n = len(a) + len(b) + 3
        ids[:n] = [sp.cls, *a, sp.sep, *b, sp.sep]
        types = np.zeros(s, np.int32)
        types[len(a) + 2 : n] = 1
        candidates = np.setdiff1d(np.arange(1, n - 1), [len(a) + 1])
        budget = masking_budget(len(candidates), self.n_predict, self.mask_prob, rng)
        spans = choose_ngrams(
            whole_words(ids, candidates, self.continuation), budget, self.max_ngram, rng
        )
        chosen = np.asarray([q for span in spans for q in span], np.int64)
        ids, positions, originals = mask_tokens(ids, chosen, sp, self.random_ids, rng)
        pad = self.n_predict - len(positions)
        return {
            "tokens": ids,
            "types": types,
            "mask": (np.arange(s) < n).astype(np.int32),
            "mlm_positions": np.pad(positions, (0, pad)).astype(np.int32),
            "mlm_ids": np.pad(originals, (0, pad)).astype(np.int32),
            "mlm_weights": np.pad(np.ones(len(positions), np.int32), (0, pad)),
            "sop_label": np.int32(swapped),
        }

    def rows(self, step: int, rows: slice) -> dict:
        key = (step, rows.start, rows.stop)
        if key not in self._memo:  # one build per step and row range, shared by every array
            self._memo = {key: None}
            examples = [self.example(step, r) for r in range(*rows.indices(self.batch_size))]
            self._memo[key] = {k: np.stack([e[k] for e in examples]) for k in examples[0]}
        return self._memo[key]

    def __call__(self, step: int) -> dict:
        """The global batch of `step`: each array of `encode`, batch_size rows of it."""

        def build(name, shape):
            return jax.make_array_from_callback(
                (self.batch_size, *shape), self.sharding, lambda idx: self.rows(step, idx[0])[name]
            )

        return {k: build(k, shape) for k, shape in self.example_shapes.items()}

    @functools.cached_property
    def example_shapes(self) -> dict:
        return {
            k: np.shape(v) for k, v in self.encode(self.pairs[0], np.random.default_rng(0)).items()
        }


@dataclasses.dataclass
class PretrainData:
    train_pairs: list
    val_pairs: list
    tokenizer: Tokenizer
    specials: Specials

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    def describe(self) -> str:
        n = getattr(self.train_pairs, "tokens", None) or sum(
            len(a) + len(b) for a, b in self.train_pairs
        )
        return f"{len(self.train_pairs):,} train sentence pairs ({n:,} tokens)"

    def batches(self, split: str, cfg, sharding):
        pairs = self.train_pairs if split == "train" else self.val_pairs
        if split != "train" and not pairs:
            return None
        return PretrainBatches(pairs, cfg, self.specials, self.tokenizer, sharding, split)


def load_pretraining(text: str, tokenizer: Tokenizer, cfg) -> PretrainData:
    """Documents -> sentence token ids -> (A, B) pairs; the last val_fraction of pairs held out."""
    specials = Specials.of(tokenizer)
    docs = split_documents(text)
    flat = [s for d in docs for s in d]
    ids = tokenizer.encode_batch(flat)
    it = iter(ids)
    return pretraining_from_documents(
        [[next(it) for _ in d] for d in docs], tokenizer, cfg, specials
    )


def pretraining_from_documents(
    doc_ids, tokenizer: Tokenizer, cfg, specials: Specials | None = None
) -> PretrainData:
    """Documents already as sentences of token ids (a Megatron-LM dataset's) -> pairs, split."""
    specials = specials or Specials.of(tokenizer)
    pairs = make_pairs(doc_ids, cfg.model.seq_len, cfg.train.seed)
    n_val = int(math.floor(len(pairs) * cfg.data.val_fraction))
    return PretrainData(
        pairs[: len(pairs) - n_val], pairs[len(pairs) - n_val :], tokenizer, specials
    )
