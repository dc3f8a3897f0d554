"""Small files in the published layouts, written by the tests: a pretraining corpus whose
sentence order is learnable, a WordPiece vocabulary trained on it, and RACE / MNLI / QQP
fixtures whose labels follow a learnable rule."""

from __future__ import annotations

import csv
import json
import random
from pathlib import Path

from megajax.data.tokenizer import BERT_SPECIALS

ANIMALS = ["cat", "dog", "fox", "owl", "bear", "wolf", "deer", "hare", "crow", "frog"]
VERBS = ["saw", "found", "took", "lost", "moved", "watched", "chased", "carried"]
THINGS = ["ball", "stone", "leaf", "stick", "apple", "shell", "feather", "rope"]
FRUITS = ["apple", "pear", "plum", "grape", "melon", "lemon", "peach", "cherry"]
TOOLS = ["hammer", "saw", "drill", "wrench", "chisel", "shovel", "rake", "axe"]


def corpus(n_docs: int = 300, seed: int = 0) -> str:
    """Paragraphs of a short "first ..." sentence and a long "finally ..." one: their order is
    learnable (from the words, and from where the segment boundary falls)."""
    rng = random.Random(seed)
    docs = []
    for _ in range(n_docs):
        a, t = rng.choice(ANIMALS), lambda: rng.choice(THINGS)  # noqa: E731
        docs.append(
            f"first the {a} {rng.choice(VERBS)}. finally the {a} {rng.choice(VERBS)} the {t()} "
            f"with the {t()} near the {t()}."
        )
    return "\n\n".join(docs) + "\n"


WORDS = sorted(
    set(
        ANIMALS
        + VERBS
        + THINGS
        + FRUITS
        + TOOLS
        + [
            "first",
            "finally",
            "the",
            "with",
            "near",
            "what",
            "is",
            "it",
            "which",
            "one",
            "story",
            "about",
            "always",
            "never",
            "maybe",
            "same",
            "other",
        ]
    )
)


def write_corpus(directory: Path) -> tuple[Path, Path]:
    """corpus.txt and a WordPiece vocab.txt written out here: BERT's specials, punctuation, the
    fixtures' words and single-letter pieces (a fixed vocabulary, so every run sees the same
    ids)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "corpus.txt").write_text(corpus())
    letters = "abcdefghijklmnopqrstuvwxyz"
    vocab = (
        list(BERT_SPECIALS) + list(".,?!_") + WORDS + list(letters) + [f"##{c}" for c in letters]
    )
    (directory / "vocab.txt").write_text("\n".join(vocab) + "\n")
    return directory / "corpus.txt", directory / "vocab.txt"


def write_race(root: Path, per_split: dict | None = None, seed: int = 0) -> Path:
    """RACE layout: root/{train,dev,test}/{middle,high}/N.txt; the answer is the (thrice said)
    fruit."""
    rng = random.Random(seed)
    per_split = per_split or {"train": 40, "dev": 10, "test": 10}
    for split, n_files in per_split.items():
        for level in ("middle", "high"):
            d = root / split / level
            d.mkdir(parents=True, exist_ok=True)
            for i in range(n_files // 2):
                questions, options, answers = [], [], []
                for _ in range(3):
                    fruit = rng.choice(FRUITS)
                    opts = rng.sample(TOOLS, 3) + [f"{fruit} {fruit} {fruit}"]
                    rng.shuffle(opts)
                    questions.append(
                        "which one is it ?" if rng.random() < 0.5 else "the story is about _ ."
                    )
                    options.append(opts)
                    answers.append(
                        "ABCD"[next(j for j, o in enumerate(opts) if o.split()[0] in FRUITS)]
                    )
                a = rng.choice(ANIMALS)
                doc = {
                    "article": f"first the {a} {rng.choice(VERBS)} the {rng.choice(THINGS)}.",
                    "questions": questions,
                    "options": options,
                    "answers": answers,
                    "id": f"{level}{i}.txt",
                }
                (d / f"{i}.txt").write_text(json.dumps(doc))
    return root


def _tsv(path: Path, header: list[str], rows: list[list[str]]):
    with path.open("w", newline="") as f:
        w = csv.writer(f, delimiter="\t", quoting=csv.QUOTE_NONE, escapechar="\\")
        w.writerow(header)
        w.writerows(rows)


def write_mnli(root: Path, n_train: int = 240, n_dev: int = 60, seed: int = 0) -> Path:
    """MNLI layout; the label follows the hypothesis' adverb (always x1, never x2, maybe x3)."""
    rng = random.Random(seed)
    header = [
        "index",
        "promptID",
        "pairID",
        "genre",
        "sentence1_binary_parse",
        "sentence2_binary_parse",
        "sentence1_parse",
        "sentence2_parse",
        "sentence1",
        "sentence2",
        "label1",
        "gold_label",
    ]
    cue = {"entailment": "always", "contradiction": "never never", "neutral": "maybe maybe maybe"}
    root.mkdir(parents=True, exist_ok=True)
    for name, n in (("train.tsv", n_train), ("dev_matched.tsv", n_dev)):
        rows = []
        for i in range(n):
            label = rng.choice(list(cue))
            a, v, t = rng.choice(ANIMALS), rng.choice(VERBS), rng.choice(THINGS)
            p, h = f"the {a} {v} the {t}.", f"the {a} {cue[label]} {v} the {rng.choice(THINGS)}."
            rows.append(
                [
                    str(i),
                    str(i),
                    f"{i}e",
                    "fiction",
                    "( x )",
                    "( y )",
                    "(ROOT x)",
                    "(ROOT y)",
                    p,
                    h,
                    label,
                    label,
                ]
            )
        _tsv(root / name, header, rows)
    return root


def write_qqp(root: Path, n_train: int = 240, n_dev: int = 60, seed: int = 0) -> Path:
    """QQP layout; duplicates are the pairs whose second question says 'same same same'."""
    rng = random.Random(seed)
    root.mkdir(parents=True, exist_ok=True)
    for name, n in (("train.tsv", n_train), ("dev.tsv", n_dev)):
        rows = []
        for i in range(n):
            dup = rng.random() < 0.5
            a = rng.choice(ANIMALS)
            q1 = f"what is the {a} ?"
            q2 = f"what is the {'same same same' if dup else 'other'} {rng.choice(ANIMALS)} ?"
            rows.append([str(i), str(2 * i), str(2 * i + 1), q1, q2, str(int(dup))])
        _tsv(root / name, ["id", "qid1", "qid2", "question1", "question2", "is_duplicate"], rows)
    return root
