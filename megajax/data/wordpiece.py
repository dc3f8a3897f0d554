"""A deterministic WordPiece vocabulary trainer: the same corpus and size give the same
vocab.txt, byte for byte, in any process and at any thread count.

The `tokenizers` trainer is not reproducible (its intermediate ids come from hash-map order,
and they break ties between equally frequent merges), so two runs of one command trained
different BERTs. This is the same algorithm (BPE merges over words split into a first
character and `##`-prefixed continuation characters, the most frequent adjacent pair merged
first) with every tie broken by the tokens' text. Text is normalised and split into words by
the `tokenizers` BERT normaliser and pre-tokenizer, as the trained vocabulary will be used.
"""

from __future__ import annotations

import heapq
from collections import Counter, defaultdict

from tokenizers import normalizers, pre_tokenizers

from megajax.progress import Progress

PREFIX = "##"


def word_counts(text: str, lowercase: bool = True) -> Counter:
    """Words as BERT's normaliser and pre-tokenizer see them, with their counts. Both act
    within whitespace-separated chunks, so each distinct chunk is processed once."""
    normalize = normalizers.BertNormalizer(lowercase=lowercase).normalize_str
    split = pre_tokenizers.BertPreTokenizer().pre_tokenize_str
    counts: Counter = Counter()
    for chunk, n in Counter(text.split()).items():
        for word, _ in split(normalize(chunk)):
            counts[word] += n
    return counts


def _pairs(symbols):
    return zip(symbols, symbols[1:])


def _merge_everywhere(pair, new: int, words, freq, pair_count, where) -> set:
    """Replace `pair` by the token `new` in every word holding it, keeping the pair counts and
    the pair -> words index current; returns the pairs whose counts changed."""
    a, b = pair
    changed = set()
    for n in sorted(where.pop(pair)):
        w, f = words[n], freq[n]
        for p in _pairs(w):
            pair_count[p] -= f
            changed.add(p)
        out, i = [], 0
        while i < len(w):
            if i + 1 < len(w) and w[i] == a and w[i + 1] == b:
                out.append(new)
                i += 2
            else:
                out.append(w[i])
                i += 1
        words[n] = out
        for p in _pairs(out):
            pair_count[p] += f
            where[p].add(n)
            changed.add(p)
    return changed


def train_vocab(
    text: str, vocab_size: int, specials: tuple[str, ...], lowercase: bool = True
) -> list[str]:
    """specials, then every character, then `##` + every continuation character (each sorted),
    then merged tokens in the order they were made, until vocab_size tokens or no pair is left."""
    counts = word_counts(text, lowercase)
    chars = sorted({c for w in counts for c in w})
    continuations = sorted({PREFIX + c for w in counts for c in w[1:]})
    vocab = list(specials) + [t for t in chars + continuations if t not in specials]
    index = {t: i for i, t in enumerate(vocab)}

    words = [[index[w[0]]] + [index[PREFIX + c] for c in w[1:]] for w in counts]
    freq = list(counts.values())
    pair_count: dict = defaultdict(int)
    where: dict = defaultdict(set)
    for n, (w, f) in enumerate(zip(words, freq)):
        for p in _pairs(w):
            pair_count[p] += f
            where[p].add(n)

    def entry(p):  # most frequent first, then by the tokens' text
        return (-pair_count[p], vocab[p[0]], vocab[p[1]], p)

    heap = [entry(p) for p in pair_count]
    heapq.heapify(heap)
    shown = Progress(unit="token")  # a bar on a terminal: large vocabularies take minutes
    while len(vocab) < vocab_size and heap:
        if len(vocab) % 256 == 0:
            shown.advance(len(vocab), vocab_size)
        neg, _, _, pair = heapq.heappop(heap)
        if pair_count.get(pair, 0) != -neg or neg == 0:
            continue  # a stale entry: this pair's count changed since it was pushed
        a, b = pair
        merged = vocab[a] + vocab[b][len(PREFIX) :]
        if merged not in index:
            index[merged] = len(vocab)
            vocab.append(merged)
        new = index[merged]
        changed = _merge_everywhere(pair, new, words, freq, pair_count, where)
        pair_count.pop(pair, None)
        for p in changed:
            if p == pair:
                continue
            if pair_count[p] > 0:
                heapq.heappush(heap, entry(p))
            else:
                pair_count.pop(p, None)
                where.pop(p, None)
    shown.close()
    return vocab
