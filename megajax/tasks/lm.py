"""GPT language modelling: next-token cross-entropy over (b, seq_len + 1) token windows of a
corpus, or over packed conversations (chat: sources, megajax/data/packing.py), where the loss
covers the tokens their mask marks."""

from __future__ import annotations

import math

import numpy as np

from megajax.data.blend import is_blend, load_blend
from megajax.data.packing import load_chat
from megajax.data.tokens import load_tokens
from megajax.errors import UserError
from megajax.specs import DataSpec
from megajax.tasks.base import Field, Task

MAX_UNTOKENIZED_VOCAB = 2**20  # ids an untokenized bin: file may use before it looks misread


class LanguageModelling(Task):
    name, kind = "gpt", "gpt"
    sample_after_training = True

    def batch_fields(self, cfg):
        """One token array: inputs and next-token targets; conversations add each token's
        segment (0 padding, 1, 2, ... the conversations of a row) and the targets' loss mask."""
        s = cfg.model.seq_len
        tokens = Field((s + 1,), 0, cfg.model.vocab_size)
        if not is_chat(cfg):
            return tokens
        return {"tokens": tokens, "segments": Field((s + 1,), 0, 2), "loss_mask": Field((s,), 0, 2)}

    def load_data(self, cfg, tokenizer=None):
        d = cfg.data
        if is_blend(d.source):
            blend = load_blend(d.source, d.tokenizer, d.val_fraction, d.bin_dtype, tokenizer)
            for c, part in zip(blend.components, blend.data):
                if DataSpec.of(c.source).kind == "bin" and not part.prepared:
                    part.vocab_size = _bin_vocab(part, cfg, c.source)
            return blend
        if is_chat(cfg):
            return load_chat(DataSpec.of(d.source).arg, cfg, tokenizer)
        data = load_tokens(d.source, d.tokenizer, d.val_fraction, d.bin_dtype, tokenizer)
        if DataSpec.of(d.source).kind == "bin" and not data.prepared:
            data.vocab_size = _bin_vocab(data, cfg, d.source)
        return data

    def head_rows(self, cfg) -> int:
        return cfg.model.seq_len

    def matmul_params_per_token(self, cfg) -> float:
        # the layers and the output layer (the tied embedding or its own), not the lookups
        m = cfg.model
        return m.active_layer_params + m.padded_vocab * m.hidden + 2 * m.hidden

    def loss_targets(self, batch):
        return batch["loss_mask"].sum() if isinstance(batch, dict) else None

    def val_extras(self, val: dict) -> dict:
        return {"val_ppl": math.exp(min(val["loss"], 50))}


def is_chat(cfg) -> bool:
    return not is_blend(cfg.data.source) and DataSpec.of(cfg.data.source).kind == "chat"


def _bin_vocab(data, cfg, source: str) -> int:
    """Ids past the tokenizer are allowed for an untokenized file read with the default byte
    tokenizer (the vocabulary grows to cover them), within reason: a uint16 file read as
    uint32 has ids in the billions."""
    vocab = data.tokenizer.vocab_size
    top = int(max(np.max(data.train), np.max(data.val) if len(data.val) else 0))
    if top >= vocab and (data.tokenizer.kind != "bytes" or top >= MAX_UNTOKENIZED_VOCAB):
        raise UserError(
            f"{source} has token id {top}, beyond the {data.tokenizer.kind} tokenizer's "
            f"{vocab:,} ids: give the tokenizer that made it (--tokenizer), or check "
            f"data.bin_dtype ({cfg.data.bin_dtype})"
        )
    return max(vocab, top + 1, cfg.model.vocab_size)
