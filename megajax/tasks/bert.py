"""BERT's objectives: pretraining (masked LM + sentence order) and fine-tuning on sentence
pairs (MNLI, QQP) or multiple choice (RACE)."""

from __future__ import annotations

import math
from pathlib import Path

from megajax.data.bert_pretrain import (
    PretrainData,
    Specials,
    load_pretraining,
    pretraining_from_documents,
)
from megajax.data.finetune import load_task_data
from megajax.data.megatron import ids_tokenizer, sentence_documents
from megajax.data.prepared import load_pairs
from megajax.data.sources import source_text
from megajax.data.tokenizer import chosen
from megajax.errors import UserError
from megajax.shapes import NUM_CHOICES, NUM_CLASSES, TYPE_VOCAB, mlm_predictions
from megajax.specs import DataSpec
from megajax.tasks.base import Field, Task


def _encoder_fields(cfg, lead: tuple[int, ...] = ()) -> dict:
    s = cfg.model.seq_len
    return {
        "tokens": Field((*lead, s), 5, cfg.model.vocab_size),
        "types": Field((*lead, s), 0, TYPE_VOCAB),
        "mask": Field((*lead, s), 1, 2),
    }


def _encoder_head_params(h: int) -> int:
    return TYPE_VOCAB * h + h * h + h  # token-type embeddings, pooler


class BertPretraining(Task):
    name, kind = "bert", "bert"
    heads_read_rows, extra_embedding_rows = True, TYPE_VOCAB

    def batch_fields(self, cfg):
        p = mlm_predictions(cfg.model.seq_len, cfg.data.mask_prob)
        return {
            **_encoder_fields(cfg),
            "mlm_positions": Field((p,), 1, cfg.model.seq_len),
            "mlm_ids": Field((p,), 5, cfg.model.vocab_size),
            "mlm_weights": Field((p,), 1, 2),
            "sop_label": Field((), 0, 2),
        }

    def load_data(self, cfg, tokenizer=None):
        spec = DataSpec.of(cfg.data.source)
        if spec.kind == "pairs":  # prepared by megajax-prepare --pairs: mapped, not read
            train, val, tokenizer = load_pairs(Path(spec.arg), tokenizer, cfg.model.seq_len)
            return PretrainData(train, val, tokenizer, Specials.of(tokenizer))
        # a Megatron-LM dataset preprocessed with --split-sentences
        if spec.kind == "megatron":
            tokenizer = ids_tokenizer(tokenizer, cfg.data.tokenizer, spec)
            return pretraining_from_documents(
                sentence_documents(spec.arg, tokenizer, str(spec)), tokenizer, cfg
            )
        text = source_text(spec)
        return load_pretraining(text, chosen(tokenizer, cfg.data.tokenizer, text), cfg)

    def chance_loss(self, cfg) -> float:
        return math.log(cfg.model.vocab_size) + math.log(2)  # MLM + sentence order

    def head_rows(self, cfg) -> int:
        return mlm_predictions(cfg.model.seq_len, cfg.data.mask_prob)

    def head_params(self, cfg) -> int:
        h, v = cfg.model.hidden, cfg.model.padded_vocab
        # MLM transform, its LayerNorm, output bias; sentence-order head
        return _encoder_head_params(h) + (h * h + h + 2 * h + v) + (2 * h + 2)

    def matmul_params_per_token(self, cfg) -> float:
        """The output layer and the MLM transform see only the masked positions."""
        m = cfg.model
        head = (m.padded_vocab * m.hidden + m.hidden * m.hidden) * self.head_rows(cfg) / m.seq_len
        return m.num_layers * m.layer_params + head


class FineTuning(Task):
    """A classifier on the pooled [CLS] vector; multiple choice scores each option's sequence."""

    kind = "bert"
    heads_read_rows, extra_embedding_rows = True, TYPE_VOCAB

    def __init__(self, name: str, choices: int = 0):
        self.name = self.model_task = name
        self.choices = choices
        self.sequences_per_example = choices or 1

    def batch_fields(self, cfg):
        lead = (self.choices,) if self.choices else ()
        return {
            **_encoder_fields(cfg, lead),
            "label": Field((), 0, max(self.choices, NUM_CLASSES[self.name])),
        }

    def load_data(self, cfg, tokenizer=None):
        if tokenizer is None:
            raise UserError(
                f"fine-tuning ({self.name}) needs a tokenizer: start from a pretrained workdir "
                "with --init-from DIR"
            )
        return load_task_data(self.name, cfg.data.source, tokenizer, cfg)

    def chance_loss(self, cfg) -> float:
        return math.log(self.choices or NUM_CLASSES[self.name])

    def head_params(self, cfg) -> int:
        h, c = cfg.model.hidden, NUM_CLASSES[self.name]
        return _encoder_head_params(h) + h * c + c


def fine_tuning_tasks() -> list[FineTuning]:
    return [FineTuning("race", NUM_CHOICES), FineTuning("mnli"), FineTuning("qqp")]
