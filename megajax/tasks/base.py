"""What every training objective provides: one object per task owns what varies with it.

The trainer, the data pipeline, the audit, the FLOP count, evaluation and the GPU bench ask
the run's task (megajax/tasks/__init__.py: `task_for(cfg)`) instead of switching on
`model.kind` / `model.task`. Adding an objective means a Task here, its model head and its
data reader.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np


@dataclasses.dataclass(frozen=True)
class Field:
    """One int32 array of a batch: its shape per example, and the range [low, high) of the
    values a synthetic batch draws (for the GPU bench: speed does not depend on the text)."""

    shape: tuple[int, ...]
    low: int = 0
    high: int = 1


class Task:
    name = ""  # registry key
    kind = ""  # model.kind
    model_task = "pretrain"  # model.task
    sequences_per_example = 1  # sequences one example feeds the encoder (RACE: its options)
    sample_after_training = False  # train.py prints a sample at the end
    # With sequence parallelism: the heads read only their rows of the last hidden states
    # ([CLS] and the masked positions: BERT) rather than the whole gathered sequence (GPT).
    heads_read_rows = False
    # replicated embedding rows added besides positions (BERT: token types)
    extra_embedding_rows = 0

    # -- the batch ---------------------------------------------------------------------------
    def batch_fields(self, cfg):
        """A Field, or a dict of them: the batch layout, written once."""
        raise NotImplementedError

    def batch_shapes(self, cfg, batch_size: int, sharding=None):
        """The global batch as ShapeDtypeStructs (every array split over "data" by rows)."""
        return jax.tree.map(
            lambda f: jax.ShapeDtypeStruct((batch_size, *f.shape), np.int32, sharding=sharding),
            self.batch_fields(cfg),
            is_leaf=lambda x: isinstance(x, Field),
        )

    def synthetic_batch(self, cfg, batch_size: int, rng: np.random.Generator):
        """Random values of the right shapes and ranges, as numpy arrays."""
        return jax.tree.map(
            lambda f: rng.integers(f.low, f.high, (batch_size, *f.shape)).astype(np.int32),
            self.batch_fields(cfg),
            is_leaf=lambda x: isinstance(x, Field),
        )

    # -- data -------------------------------------------------------------------------------
    def load_data(self, cfg, tokenizer=None):
        """The run's data: an object with .tokenizer, .vocab_size (ids the model must embed),
        .describe() and .batches(split, cfg, sharding). `tokenizer` is the workdir's (resuming)
        or the pretrained one's (fine-tuning); None makes one from data.tokenizer."""
        raise NotImplementedError

    # -- what the audit, the FLOP count and the parameter count need -------------------------
    def tokens_per_example(self, cfg) -> int:
        return cfg.model.seq_len * self.sequences_per_example

    def head_rows(self, cfg) -> int:
        """Positions per sequence that reach the tied vocab-parallel output layer and the loss."""
        return 0

    def head_params(self, cfg) -> int:
        """Parameters besides the layers, token and position embeddings and one LayerNorm."""
        return 0

    def matmul_params_per_token(self, cfg) -> float:
        """Weights each trained token goes through in a matmul (6 FLOPs each, forward and
        backward)."""
        return cfg.model.active_layer_params

    # -- evaluation during training ------------------------------------------------------------
    def chance_loss(self, cfg) -> float:
        """The loss of a uniform guess (what a model's loss starts near): a loss above it after
        a spike is a divergence (training/divergence.py)."""
        return math.log(cfg.model.vocab_size)

    def loss_targets(self, batch):
        """How many targets the loss of `batch` averages, for a task whose loss has a mask (a
        batch with none has no loss to report); None when every example counts."""
        return None

    def val_extras(self, val: dict) -> dict:
        """Figures derived from the validation means, logged next to them."""
        return {}
