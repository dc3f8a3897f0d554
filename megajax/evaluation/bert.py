"""Evaluating BERT: a pretrained model's masked-LM and sentence-order figures over every pair
of a text, and a fine-tuned model's accuracy on a RACE / MNLI / QQP split."""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np

from megajax.core.mesh import padded_batches
from megajax.core.sharding import BATCH
from megajax.data.bert_pretrain import PretrainBatches
from megajax.data.finetune import encode, read_task
from megajax.data.tokenizer import Tokenizer
from megajax.errors import UserError


def evaluate_pretraining(model, pairs, cfg, specials, tokenizer, batch_size: int = 16) -> dict:
    """A pretrained BERT's MLM loss and accuracy over the masked tokens and SOP loss and
    accuracy over the pairs: each pair once, with a fixed masking and order (seeded by its
    index), summed exactly over padded batches."""
    builder = PretrainBatches(pairs, cfg, specials, tokenizer, None, "eval")
    sharding = model.layout.sharding(BATCH)
    outputs = jax.jit(lambda m, batch: m.pretrain_outputs(batch))
    sums = dict(mlm_loss=0.0, mlm_hits=0.0, masked=0.0, sop_loss=0.0, sop_hits=0.0)
    for idx, real in padded_batches(len(pairs), batch_size, model.layout.shape):
        examples = [
            builder.encode(pairs[i], np.random.default_rng([cfg.train.seed, 2, int(i)]))
            for i in idx
        ]
        batch = {k: np.stack([e[k] for e in examples]) for k in examples[0]}
        out = jax.device_get(
            outputs(model, {k: jax.device_put(v, sharding) for k, v in batch.items()})
        )
        w = batch["mlm_weights"] * real[:, None]
        sums["mlm_loss"] += float((out["mlm_losses"] * w).sum())
        sums["mlm_hits"] += float((out["mlm_hits"] * w).sum())
        sums["masked"] += float(w.sum())
        sums["sop_loss"] += float((out["sop_losses"] * real).sum())
        sums["sop_hits"] += float((out["sop_hits"] * real).sum())
    n = len(pairs)
    if not sums["masked"]:
        raise UserError(f"the {n} pair(s) mask no token: no MLM loss to report")
    return {
        "pairs": n,
        "masked_tokens": int(sums["masked"]),
        "mlm_loss": sums["mlm_loss"] / sums["masked"],
        "mlm_accuracy": sums["mlm_hits"] / sums["masked"],
        "sop_loss": sums["sop_loss"] / n,
        "sop_accuracy": sums["sop_hits"] / n,
    }


def predict(model, arrays: dict, batch_size: int) -> np.ndarray:
    """Argmax class (or option) of every example; the last batch is padded and trimmed."""
    layout = model.layout
    sharding = layout.sharding(BATCH)

    @jax.jit
    def logits(m, batch):
        return m.class_logits(batch)

    preds = []
    for idx, real in padded_batches(len(arrays["label"]), batch_size, layout.shape):
        batch = {k: jax.device_put(v[idx], sharding) for k, v in arrays.items() if k != "label"}
        preds.append(np.asarray(jax.device_get(logits(model, batch))).argmax(-1)[real > 0])
    return np.concatenate(preds)


def evaluate_task(
    model, task: str, directory: Path, split: str, tok: Tokenizer, batch_size: int = 16
) -> dict:
    """Accuracy on a split (RACE: also by middle/high school level)."""
    examples = read_task(task, Path(directory), split)
    arrays = encode(examples, tok, model.cfg.seq_len)
    correct = predict(model, arrays, batch_size) == arrays["label"]
    result = {
        "task": task,
        "split": split,
        "examples": len(examples),
        "accuracy": float(correct.mean()),
    }
    if task == "race":
        for level in ("middle", "high"):
            sel = np.array([e.group == level for e in examples])
            if sel.any():
                result[f"accuracy_{level}"] = float(correct[sel].mean())
                result[f"examples_{level}"] = int(sel.sum())
    return result
