"""The assistant's answer to a conversation: the chat template with its generation prompt,
sampled with the KV cache until the template's end of turn."""

from __future__ import annotations

import numpy as np

from megajax.data.chat import encode_with_offsets, parse_line, prompt_ids, template_for
from megajax.data.sources import read_utf8, text_files
from megajax.errors import UserError
from megajax.files import text_lines
from megajax.models.generate import generate


def end_of_turn_id(tokenizer, template) -> int | None:
    """The token that ends an assistant turn, where it is one token (else the text is cut)."""
    ids = encode_with_offsets(tokenizer, template.end_of_turn)[0]
    return ids[0] if len(ids) == 1 else None


def until_end_of_turn(text: str, template) -> str:
    return text.split(template.end_of_turn, 1)[0]


def answer(
    model,
    tokenizer,
    messages: list[dict],
    max_new_tokens: int,
    temperature: float,
    top_k: int | None,
    rng,
    emit=None,
    stopped=None,
) -> dict:
    """{"prompt": the rendered ids' text, "answer": the text up to the end of turn, "tokens"}.
    A prompt longer than the model's context keeps its last tokens (`generate`'s window)."""
    template = template_for(tokenizer)
    if messages and messages[-1].get("role") == "assistant":
        raise UserError("the conversation ends with an assistant turn: nothing to answer")
    return answer_ids(
        model,
        tokenizer,
        prompt_ids(messages, template, tokenizer),
        max_new_tokens,
        temperature,
        top_k,
        rng,
        emit,
        stopped,
    )


def answer_ids(
    model,
    tokenizer,
    prompt: list[int],
    max_new_tokens: int,
    temperature: float,
    top_k: int | None,
    rng,
    emit=None,
    stopped=None,
) -> dict:
    """`answer` for the ids of a rendered conversation."""
    template = template_for(tokenizer)
    new = generate(
        model,
        np.asarray([prompt], np.int32),
        max_new_tokens,
        temperature,
        top_k,
        rng,
        eos_id=end_of_turn_id(tokenizer, template),
        emit=emit,
        stopped=stopped,
    )
    tokens = new[0].tolist()
    return {
        "prompt": with_special_tokens(tokenizer, prompt),
        "answer": until_end_of_turn(tokenizer.decode(tokens), template).strip(),
        "tokens": tokens,
    }


def with_special_tokens(tokenizer, ids) -> str:
    """The text of ids as the template wrote it, its special tokens (headers, turn ends)
    shown."""
    if tokenizer.kind == "hf":
        return tokenizer.tok.decode([int(i) for i in ids], skip_special_tokens=False)
    return tokenizer.decode(ids)


def conversations_to_answer(spec: str) -> list[list[dict]]:
    """The conversations of JSONL files (one a line, as chat: training data, or a "prompt"
    alone), each cut after its last user turn: what the model answers."""
    out = []
    for path in text_files(spec):
        for n, line in enumerate(text_lines(read_utf8(path)), 1):
            if line.strip():
                messages = list(parse_line(line, f"{path}:{n}", to_learn=False).messages)
                users = [i for i, m in enumerate(messages) if m["role"] == "user"]
                if not users:
                    raise UserError(f"{path}:{n}: no user turn to answer")
                out.append(messages[: users[-1] + 1])
    if not out:
        raise UserError(f"{spec} holds no conversation")
    return out
