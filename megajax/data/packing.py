"""Conversations packed into rows, and their batches.

Each row of seq_len + 1 tokens holds whole conversations one after another (in a fixed shuffled
order), each with its own segment id 1, 2, ...; the tail is padding (segment 0). The model
attends only within a segment and restarts positions at each (core/attention.py), so a packed
conversation's loss is its loss alone. A target is in the loss where the loss mask marks it
and it continues its input's conversation.

Batch `step` is a pure function of (seed, step): rows in a fresh permutation each epoch.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import numpy as np

from megajax.data.chat import LOSS_ON, encode_conversation, read_conversations, template_for
from megajax.data.chat_template import ChatTemplate
from megajax.data.prepared import is_prepared, load_conversations
from megajax.data.tokenizer import Tokenizer, chosen
from megajax.errors import UserError

OVERFLOW = ("refuse", "truncate")


@dataclasses.dataclass
class Packed:
    tokens: np.ndarray  # (rows, length) int32
    segments: np.ndarray  # (rows, length) int32: 1, 2, ... each conversation, 0 padding
    mask: np.ndarray  # (rows, length) int8: the tokens the loss may predict

    @property
    def rows(self) -> int:
        return len(self.tokens)


def pack(examples: list[tuple[np.ndarray, np.ndarray]], length: int) -> Packed:
    """Examples (ids, mask), none longer than `length`, in rows of `length` tokens, in order: a
    row takes the next example while it fits."""
    rows: list[list] = [[]]
    used = 0
    for ids, mask in examples:
        if used + len(ids) > length:
            rows.append([])
            used = 0
        rows[-1].append((ids, mask))
        used += len(ids)
    out = Packed(*(np.zeros((len(rows), length), t) for t in (np.int32, np.int32, np.int8)))
    for r, row in enumerate(rows):
        at = 0
        for seg, (ids, mask) in enumerate(row, 1):
            n = len(ids)
            out.tokens[r, at : at + n], out.segments[r, at : at + n] = ids, seg
            out.mask[r, at : at + n] = mask
            at += n
    return out


def target_weights(segments: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """(rows, length - 1) 0/1 int32: target t + 1 is in the loss where its mask is set and it
    continues input t's conversation (never the first token of the next, nor padding)."""
    same = (segments[:, 1:] == segments[:, :-1]) & (segments[:, 1:] > 0)
    return (same & (mask[:, 1:] > 0)).astype(np.int32)


@dataclasses.dataclass
class ChatData:
    tokenizer: Tokenizer
    template: object
    train: Packed
    val: Packed | None
    conversations: int
    truncated: int
    # what train.py's sample answers: the ids of a conversation up to its first target
    sample_prompt: list
    vocab_size: int = 0
    prepared = False

    def __post_init__(self):
        self.vocab_size = self.vocab_size or self.tokenizer.vocab_size

    def describe(self) -> str:
        p = self.train
        fill = (p.segments > 0).mean()
        cut = f", {self.truncated} truncated to fit" if self.truncated else ""
        return (
            f"{self.conversations:,} conversations packed in {p.rows:,} rows ({fill:.0%} filled), "
            f"{int(target_weights(p.segments, p.mask).sum()):,} target tokens{cut}"
        )

    def batches(self, split: str, cfg, sharding):
        t = cfg.train
        if split == "train":
            return PackedBatches(self.train, t.batch_size, t.seed, sharding)
        if self.val is None:
            return None
        return PackedBatches(
            self.val,
            t.batch_size,
            None,
            sharding,
            num_batches=min(t.eval_batches, -(-self.val.rows // t.batch_size)),
        )


def load_chat(spec: str, cfg, tokenizer: Tokenizer | None) -> ChatData:
    """The conversations of chat:`spec` (JSONL files, rendered and tokenized here, the last
    data.val_fraction of them in a fixed shuffled order held out; or a `megajax-prepare
    --chat` directory with its own splits), packed in rows of seq_len + 1."""
    d, length = cfg.data, cfg.model.seq_len + 1
    if is_prepared(Path(spec)):
        train, val, tokenizer = load_conversations(Path(spec), tokenizer)
        where = [f"{spec} conversation {i + 1}" for i in range(len(train) + len(val))]
    else:
        conversations = read_conversations(spec)
        if tokenizer is None:  # chars and wordpiece[:SIZE] build theirs from the rendered text
            plain = ChatTemplate.plain()
            tokenizer = chosen(
                None,
                d.tokenizer,
                "\n".join(plain.render(list(c.messages))[0] for c in conversations),
            )
        template = template_for(tokenizer)
        examples = [encode_conversation(c, template, tokenizer, d.chat_loss) for c in conversations]
        order = np.random.default_rng([cfg.train.seed, 2]).permutation(len(examples))
        n_val = int(len(examples) * d.val_fraction)
        train = [examples[i] for i in order[: len(examples) - n_val]]
        val = [examples[i] for i in order[len(examples) - n_val :]]
        where = [conversations[i].where for i in order]
    train, val, long = _fitted(train + val, len(train), where, length, d.chat_overflow)
    packed = pack(train, length)
    lost = "were truncated away" if long else "are empty"  # why the turns have no target
    if not target_weights(packed.segments, packed.mask).any():
        raise UserError(
            f"chat:{spec} leaves no target token to learn from (the assistant's turns {lost} at "
            f"model.seq_len {cfg.model.seq_len}): raise model.seq_len, or set data.chat_loss = "
            '"all"'
        )
    held_out = pack(val, length) if val else None
    hold_none = (
        "megajax-prepare --val-fraction 0" if is_prepared(Path(spec)) else "data.val_fraction = 0"
    )
    if held_out is not None and not target_weights(held_out.segments, held_out.mask).any():
        # a validation loss over no target would read 0 (perplexity 1): no number at all
        raise UserError(
            f"chat:{spec}'s {len(val)} held-out conversation(s) keep no target token at "
            f"model.seq_len {cfg.model.seq_len} (their assistant turns {lost}): raise "
            f"model.seq_len, or hold none out ({hold_none})"
        )
    # what train.py's sample answers: the first held-out (else trained) conversation with a
    # target, up to its first one
    ids, mask = next(e for e in val + train if e[1][1:].any())
    sample = ids[: int(np.argmax(mask[1:] > 0)) + 1].tolist()
    return ChatData(
        tokenizer, template_for(tokenizer), packed, held_out, len(train) + len(val), long, sample
    )


def _fitted(examples, n_train: int, where: list[str], length: int, overflow: str):
    """(train, val, how many were cut): conversations longer than a row refused, or cut."""
    long = [(w, len(e[0])) for w, e in zip(where, examples) if len(e[0]) > length]
    if long and overflow == "refuse":
        raise UserError(
            f"{len(long)} conversation(s) longer than model.seq_len + 1 = {length} tokens (first: "
            f"{long[0][0]}, {long[0][1]} tokens): raise model.seq_len, or set data.chat_overflow = "
            '"truncate"'
        )
    examples = [(ids[:length], mask[:length]) for ids, mask in examples]
    return examples[:n_train], examples[n_train:], len(long)


class PackedBatches:
    """Batches of packed rows: {"tokens", "segments": (b, length), "loss_mask": (b, length - 1)}.
    Training (a seed): rows in a permutation per epoch drawn from (seed, epoch). Validation
    (no seed): `num_batches` fixed batches over the rows in order."""

    def __init__(
        self,
        packed: Packed,
        batch_size: int,
        seed: int | None,
        sharding,
        num_batches: int | None = None,
    ):
        self.packed, self.batch_size, self.seed, self.sharding = packed, batch_size, seed, sharding
        self.num_batches = num_batches

    def row_ids(self, step: int) -> np.ndarray:
        n = self.packed.rows
        i = step * self.batch_size + np.arange(self.batch_size)
        if self.seed is None:
            return i % n
        epochs = {
            e: np.random.default_rng([self.seed, 3, e]).permutation(n)
            for e in set((i // n).tolist())
        }
        return np.array([epochs[e][r] for e, r in zip((i // n).tolist(), (i % n).tolist())])

    def rows(self, step: int, row_slice: slice) -> dict:
        ids = self.row_ids(step)[row_slice]
        p = self.packed
        return {
            "tokens": p.tokens[ids],
            "segments": p.segments[ids],
            "loss_mask": target_weights(p.segments[ids], p.mask[ids]),
        }

    def __call__(self, step: int) -> dict:
        """The global batch for `step`, each process filling only its rows."""
        length = self.packed.tokens.shape[1]
        shapes = {"tokens": length, "segments": length, "loss_mask": length - 1}
        return {
            k: jax.make_array_from_callback(
                (self.batch_size, n), self.sharding, lambda idx, k=k: self.rows(step, idx[0])[k]
            )
            for k, n in shapes.items()
        }


__all__ = ["LOSS_ON", "OVERFLOW", "ChatData", "Packed", "PackedBatches", "load_chat", "pack"]
