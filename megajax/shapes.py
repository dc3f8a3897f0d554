"""Shape facts of the objectives that data readers, models and tasks all need: plain Python,
importing nothing, so that none of them has to import another to learn a number."""

from __future__ import annotations

import math

# BERT fine-tuning heads; race: one score per option
NUM_CLASSES = {"mnli": 3, "qqp": 2, "race": 1}
# the heads each model has
MODEL_TASKS = {"gpt": ("pretrain",), "bert": ("pretrain", *NUM_CLASSES)}
NUM_CHOICES = 4  # RACE's options per question
TYPE_VOCAB = 2  # BERT's segment A / segment B


def mlm_predictions(seq_len: int, mask_prob: float) -> int:
    """Masked positions per sequence the batch has room for (BERT: 20 at 128, 77 at 512)."""
    # round: 0.15 * 100 is 15.000000000000002
    return max(1, math.ceil(round(mask_prob * seq_len, 6)))
