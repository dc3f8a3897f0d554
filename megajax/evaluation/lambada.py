"""LAMBADA: a passage counts as correct only if every token of its last word is the argmax
given the passage before it (teacher forcing), as Megatron-LM evaluates it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from megajax.data.sources import read_utf8
from megajax.data.tokenizer import Tokenizer
from megajax.errors import UserError
from megajax.evaluation.scoring import score_windows
from megajax.files import text_lines


def lambada_examples(path: Path, tokenizer: Tokenizer, seq_len: int):
    """(context tokens, target tokens) per passage. The target is the last word, split off at the
    last run of any whitespace (a newline too), and the context is stripped, as Megatron does."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"LAMBADA file not found: {path}")
    examples = []
    for n, line in enumerate(text_lines(read_utf8(path)), 1):
        if not line.strip():
            continue
        try:
            text = json.loads(line)["text"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise UserError(f'{path}:{n}: expected a JSON object with a "text" field') from None
        if not isinstance(text, str) or len(text.split()) < 2:
            raise UserError(
                f'{path}:{n}: "text" must be a passage of at least two words, got {text!r:.60}'
            )
        text = text.strip()
        *context, word = text.rsplit(None, 1)
        context = context[0] if context else ""
        ctx, tgt = tokenizer.encode(context), tokenizer.encode(" " + word)
        keep = seq_len + 1 - len(tgt)
        examples.append((ctx[-keep:] if len(ctx) > keep else ctx, tgt))
    if not examples:
        raise UserError(f"{path} has no passages")
    return examples


def evaluate_lambada(
    model, tokenizer: Tokenizer, path: Path, batch_size: int = 8, progress=None
) -> dict:
    """Accuracy over the passages, and the mean loss of the target tokens."""
    examples = lambada_examples(path, tokenizer, model.cfg.seq_len)
    rows = []
    for ctx, tgt in examples:
        t = np.asarray(ctx + tgt, np.int32)
        mask = np.zeros(len(t) - 1, bool)
        mask[len(ctx) - 1 :] = True
        rows.append((t, mask))
    scored = score_windows(model, rows, batch_size, progress)
    correct = []
    for (t, mask), (_, _, _, argmax) in zip(rows, scored):
        idx = np.nonzero(mask)[0]
        correct.append(bool(np.all(argmax[idx] == t[idx + 1])))
    loss = sum(s[0] for s in scored) / sum(s[1] for s in scored)
    return {
        "accuracy": float(np.mean(correct)),
        "correct": int(np.sum(correct)),
        "passages": len(rows),
        "mean_target_loss": loss,
        "per_passage_correct": correct,
        "file": str(path),
    }
