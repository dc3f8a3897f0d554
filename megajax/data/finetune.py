"""BERT fine-tuning data: RACE (multiple choice), MNLI and QQP (sentence pairs).

Files are read in their published layouts:
  RACE   DIR/{train,dev,test}/{high,middle}/*.txt, one JSON object per file with "article",
         "questions", "options" (4 per question) and "answers" ("A".."D").
  MNLI   DIR/train.tsv, dev_matched.tsv, dev_mismatched.tsv (columns sentence1, sentence2,
  gold_label). QQP    DIR/train.tsv, dev.tsv (columns question1, question2, is_duplicate).
Each example is encoded as [CLS] A [SEP] B [SEP]; for RACE, A is the article and B the
question with the option (filling a "_" blank when the question has one), once per option.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import sys
from pathlib import Path

import jax
import numpy as np

from megajax.data.sentences import Specials, pair_room, truncate_pair
from megajax.data.sources import read_utf8
from megajax.data.tokenizer import Tokenizer
from megajax.errors import UserError

MNLI_LABELS = {"contradiction": 0, "entailment": 1, "neutral": 2}
SPLIT_FILES = {
    "mnli": {
        "train": "train.tsv",
        "dev": "dev_matched.tsv",
        "dev_matched": "dev_matched.tsv",
        "dev_mismatched": "dev_mismatched.tsv",
    },
    "qqp": {"train": "train.tsv", "dev": "dev.tsv"},
}


@dataclasses.dataclass
class Example:
    first: list[str]  # one text per option (RACE) or a single first sentence
    second: list[str]
    label: int
    group: str = ""  # RACE: "middle" or "high"


def read_race(directory: Path, split: str) -> list[Example]:
    root = Path(directory) / split
    if not root.is_dir():
        raise UserError(
            f"RACE split not found: {root} (expected {directory}/{split}/high and /middle)"
        )
    examples = []
    for level in ("middle", "high"):
        for path in sorted((root / level).glob("*")):
            if path.suffix in (".txt", ".json"):
                examples += [
                    Example([article] * 4, seconds, label, level)
                    for article, seconds, label in _race_file(path)
                ]
    if not examples:
        raise UserError(f"no RACE questions under {root}/middle or {root}/high")
    return examples


def _race_file(path: Path):
    """(article, the question with each option, the answer's index) per question of one file;
    anything else than RACE's layout is one line naming the file."""
    try:
        doc = json.loads(read_utf8(path))
        article, questions = (
            doc["article"],
            list(zip(doc["questions"], doc["options"], doc["answers"], strict=True)),
        )
    except json.JSONDecodeError as e:
        raise UserError(f"{path}: not a RACE JSON file ({e.msg})") from None
    except (KeyError, TypeError, ValueError):
        raise UserError(
            f'{path}: not a RACE file (an object with "article" and equally long lists '
            '"questions", "options" and "answers")'
        ) from None
    for question, options, answer in questions:
        if not isinstance(options, list) or len(options) != 4:
            raise UserError(f"{path}: a RACE question needs 4 options, got {options!r:.60}")
        if not (
            isinstance(article, str)
            and isinstance(question, str)
            and all(isinstance(o, str) for o in options)
            and isinstance(answer, str)
            and answer.strip() in ("A", "B", "C", "D")
        ):
            raise UserError(
                f"{path}: a RACE question needs text, 4 text options and an answer A-D, got "
                f"{answer!r:.20}"
            )
        seconds = [
            question.replace("_", o) if "_" in question else f"{question} {o}" for o in options
        ]
        yield article, seconds, "ABCD".index(answer.strip())


def read_glue(directory: Path, task: str, split: str) -> list[Example]:
    name = SPLIT_FILES[task].get(split)
    if name is None:
        raise UserError(f"{task} has no split '{split}' (use {', '.join(SPLIT_FILES[task])})")
    path = Path(directory) / name
    if not path.is_file():
        raise UserError(f"{task.upper()} file not found: {path}")
    csv.field_size_limit(sys.maxsize)
    examples = []
    with io.StringIO(read_utf8(path), newline="") as f:
        for row in csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE):
            if task == "mnli":
                a, b, label = (
                    row.get("sentence1"),
                    row.get("sentence2"),
                    MNLI_LABELS.get(row.get("gold_label", "")),
                )
            else:
                a, b, dup = row.get("question1"), row.get("question2"), row.get("is_duplicate")
                label = int(dup) if dup in ("0", "1") else None
            if a is None or b is None or label is None:
                continue  # GLUE's files have a few malformed rows; the test sets have no labels
            examples.append(Example([a], [b], label))
    if not examples:
        raise UserError(f"{path}: no labelled examples (is it the {task.upper()} layout?)")
    return examples


def read_task(task: str, directory: Path, split: str) -> list[Example]:
    if not Path(directory).is_dir():
        raise UserError(f"{task} data directory not found: {directory}")
    return read_race(directory, split) if task == "race" else read_glue(directory, task, split)


def encode(examples: list[Example], tok: Tokenizer, seq_len: int) -> dict:
    """Arrays tokens/types/mask of (n, [4,] seq_len) and label (n,), truncating like BERT's
    fine-tuning (the end of the longer segment: for RACE, usually the article's)."""
    specials = Specials.of(tok)
    # RACE repeats each article per question
    texts = sorted({t for e in examples for t in e.first})
    cache = dict(zip(texts, tok.encode_batch(texts)))
    seconds = tok.encode_batch([t for e in examples for t in e.second])
    choices = len(examples[0].first)
    shape = (len(examples), choices, seq_len)
    out = {
        "tokens": np.full(shape, specials.pad, np.int32),
        "types": np.zeros(shape, np.int32),
        "mask": np.zeros(shape, np.int32),
    }
    k = 0
    for i, e in enumerate(examples):
        for j, first in enumerate(e.first):
            a, b = truncate_pair(cache[first], seconds[k], pair_room(seq_len))
            k += 1
            n = len(a) + len(b) + 3
            out["tokens"][i, j, :n] = [specials.cls, *a, specials.sep, *b, specials.sep]
            out["types"][i, j, len(a) + 2 : n] = 1
            out["mask"][i, j, :n] = 1
    if choices == 1:
        out = {key: v[:, 0] for key, v in out.items()}
    out["label"] = np.array([e.label for e in examples], np.int32)
    return out


class ExampleBatches:
    """Batches of encoded examples in a fresh permutation every epoch, a pure function of (seed,
    step)."""

    def __init__(self, arrays: dict, batch_size: int, seed: int, sharding, name: str = "train"):
        self.arrays, self.batch_size, self.seed, self.sharding = arrays, batch_size, seed, sharding
        self.n = len(arrays["label"])
        self.stream = 0 if name == "train" else 1

    def indices(self, step: int, rows: slice) -> np.ndarray:
        g = step * self.batch_size + np.arange(*rows.indices(self.batch_size))
        epochs = g // self.n
        out = np.empty(len(g), np.int64)
        for epoch in np.unique(epochs):
            perm = np.random.default_rng([self.seed, self.stream, int(epoch)]).permutation(self.n)
            sel = epochs == epoch
            out[sel] = perm[g[sel] % self.n]
        return out

    def __call__(self, step: int) -> dict:
        def build(name):
            a = self.arrays[name]
            return jax.make_array_from_callback(
                (self.batch_size, *a.shape[1:]),
                self.sharding,
                lambda idx: a[self.indices(step, idx[0])],
            )

        return {name: build(name) for name in self.arrays}


@dataclasses.dataclass
class TaskData:
    task: str
    train: dict
    val: dict
    tokenizer: Tokenizer

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    def describe(self) -> str:
        return (
            f"{len(self.train['label']):,} {self.task} train examples, {len(self.val['label']):,} "
            "validation"
        )

    def batches(self, split: str, cfg, sharding):
        arrays = self.train if split == "train" else self.val
        return ExampleBatches(arrays, cfg.train.batch_size, cfg.train.seed, sharding, split)


def load_task_data(task: str, directory: str, tok: Tokenizer, cfg) -> TaskData:
    """Train split, and the dev split for validation (a held-out tail of train without one)."""
    train = read_task(task, Path(directory), "train")
    try:
        val = read_task(task, Path(directory), "dev")
    except UserError:
        n_val = max(1, int(len(train) * cfg.data.val_fraction))
        train, val = train[:-n_val], train[-n_val:]
    s = cfg.model.seq_len
    return TaskData(task, encode(train, tok, s), encode(val, tok, s), tok)
