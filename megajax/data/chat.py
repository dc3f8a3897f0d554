"""Conversations for supervised fine-tuning: `--data chat:FILE.jsonl[,...]`.

One conversation a line, `{"messages": [{"role": ..., "content": ...}, ...]}` or
`{"prompt": ..., "completion": ...}` (a user turn and the assistant's answer). Each is rendered
with the tokenizer's chat template (chat_template.py) and tokenized as transformers'
`apply_chat_template(..., return_assistant_tokens_mask=True)` does: the rendered text as one
string, no special tokens added, and a token is the assistant's where its characters overlap
what the assistant writes. The loss covers those tokens (data.chat_loss = "assistant") or every
token (all).

Packing (packing.py) puts several conversations in each row.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

from megajax.data.chat_template import ChatTemplate, read_template
from megajax.data.sources import read_utf8, text_files
from megajax.data.tokenizer import Tokenizer
from megajax.errors import UserError, first_line
from megajax.files import text_lines

ROLES = ("system", "user", "assistant", "tool")
LOSS_ON = ("assistant", "all")


@dataclasses.dataclass(frozen=True)
class Conversation:
    messages: tuple
    where: str  # FILE:LINE, for a message about it


def parse_line(line: str, where: str, to_learn: bool = True) -> Conversation:
    """One JSONL line as a conversation; anything else is a UserError naming `where`. Not
    `to_learn` (one to answer): no assistant turn needed, a "prompt" alone is a user turn."""
    try:
        record = json.loads(line)
    except ValueError as e:
        raise UserError(f"{where}: not JSON ({first_line(e)})") from None
    if not isinstance(record, dict):
        raise UserError(f"{where}: a conversation is a JSON object, got {type(record).__name__}")
    if "messages" not in record and "prompt" in record:
        answer = [{"role": "assistant", "content": record.get("completion")}]
        record = {
            "messages": [{"role": "user", "content": record["prompt"]}]
            + (answer if "completion" in record or to_learn else [])
        }
    messages = record.get("messages")
    if not isinstance(messages, list) or not messages:
        raise UserError(f'{where}: no "messages" list (or "prompt" and "completion")')
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            got = m.get("role") if isinstance(m, dict) else m
            raise UserError(
                f"{where}: message {i + 1} has no role among {', '.join(ROLES)} (got {got!r})"
            )
        if not isinstance(m.get("content"), str):
            raise UserError(f'{where}: message {i + 1} ({m["role"]}) has no text "content"')
    if to_learn and not any(m["role"] == "assistant" for m in messages):
        raise UserError(f"{where}: the conversation has no assistant turn to learn from")
    return Conversation(
        tuple({k: v for k, v in m.items() if v is not None} for m in messages), where
    )


def read_conversations(spec: str) -> list[Conversation]:
    """Every conversation of the files a chat: spec names, in order."""
    conversations = []
    for path in text_files(spec):
        lines = text_lines(read_utf8(path))
        conversations += [
            parse_line(line, f"{path}:{n}") for n, line in enumerate(lines, 1) if line.strip()
        ]
    if not conversations:
        raise UserError(f"chat:{spec} holds no conversation")
    return conversations


def template_for(tokenizer: Tokenizer) -> ChatTemplate:
    """The tokenizer's own chat template (a Hugging Face tokenizer's directory), or the plain one
    ending turns with its end of text."""
    path = getattr(tokenizer, "path", None)
    template = read_template(Path(path).parent) if path is not None else None
    if template is not None:
        return template
    eos = tokenizer.eos_id
    return ChatTemplate.plain(None if eos is None else _token_text(tokenizer, eos))


def _token_text(tokenizer: Tokenizer, token: int) -> str:
    if tokenizer.kind == "hf":
        return tokenizer.tok.id_to_token(token)
    return tokenizer.decode([token])


def encode_with_offsets(tokenizer: Tokenizer, text: str) -> tuple[list[int], list[tuple]]:
    """Token ids of `text` (special tokens in it recognised as such) and each token's (start,
    end) characters."""
    kind = tokenizer.kind
    if kind in ("hf", "wordpiece"):
        enc = tokenizer.tok.encode(text, add_special_tokens=False)
        return enc.ids, enc.offsets
    if kind == "tiktoken":
        ids = tokenizer.enc.encode(text, allowed_special="all")
        _, starts = tokenizer.enc.decode_with_offsets(ids)
        return ids, list(zip(starts, starts[1:] + [len(text)]))
    if kind == "bytes":
        ids, offsets = [], []
        for i, ch in enumerate(text):
            raw = ch.encode("utf-8")
            ids += list(raw)
            offsets += [(i, i + 1)] * len(raw)
        return ids, offsets
    ids = tokenizer.encode(text)  # chars: one token a character
    return ids, [(i, i + 1) for i in range(len(ids))]


def assistant_mask(offsets, spans) -> np.ndarray:
    """1 for each token overlapping one of the (start, end) character spans (transformers'
    rule: a span cut by truncation keeps its remaining tokens)."""
    mask = np.zeros(len(offsets), np.int8)
    k = 0
    for i, (start, end) in enumerate(offsets):
        while k < len(spans) and start >= spans[k][1]:
            k += 1
        if k == len(spans):
            break
        mask[i] = end > spans[k][0]
    return mask


def encode_conversation(
    conversation: Conversation,
    template: ChatTemplate,
    tokenizer: Tokenizer,
    loss_on: str = "assistant",
) -> tuple[np.ndarray, np.ndarray]:
    """(token ids, loss mask) of one conversation, int32 and int8."""
    try:
        text, spans = template.render(list(conversation.messages))
    except ValueError as e:
        raise UserError(f"{conversation.where}: {e}") from None
    ids, offsets = encode_with_offsets(tokenizer, text)
    mask = assistant_mask(offsets, spans) if loss_on == "assistant" else np.ones(len(ids), np.int8)
    return np.asarray(ids, np.int32), mask


def prompt_ids(messages: list[dict], template: ChatTemplate, tokenizer: Tokenizer) -> list[int]:
    """The ids a model reads to answer `messages`: the template with its generation prompt."""
    try:
        text, _ = template.render(messages, add_generation_prompt=True)
    except ValueError as e:
        raise UserError(str(e)) from None
    return encode_with_offsets(tokenizer, text)[0]
