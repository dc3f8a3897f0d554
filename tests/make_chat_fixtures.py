"""Build tests/fixtures/chat/: conversations, two tokenizers with chat templates, and what
transformers' `apply_chat_template(..., return_assistant_tokens_mask=True)` gives for each
conversation (its token ids and assistant mask), for tests/test_chat.py.

Run by hand, in an environment with transformers (never by the test suite):

    /tmp/hfenv/bin/pip install transformers==5.25.0 tokenizers jinja2==3.1.6
    /tmp/hfenv/bin/python tests/make_chat_fixtures.py

The tokenizers are the byte-level BPE of tests/fixtures/hf/llama (make_llama_fixtures.py):
`llama3` with a Llama 3-style template (bos, headers, content trimmed, <|eot_id|>), `chatml`
with ChatML's <|im_start|>/<|im_end|> added as special tokens and a Qwen-style template (a
default system turn). Both mark the assistant's text with {% generation %}, as transformers
needs for its mask.
"""

import json
from pathlib import Path

import transformers
from tokenizers import AddedToken, Tokenizer

HERE = Path(__file__).resolve().parent
OUT = HERE / "fixtures" / "chat"
BASE = HERE / "fixtures" / "hf" / "llama" / "tokenizer.json"

LLAMA3 = (
    "{{ bos_token }}{% for message in messages %}<|start_header_id|>{{ message['role'] "
    "}}<|end_header_id|>\n"
    "\n"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] | trim "
    "}}<|eot_id|>{% endgeneration %}{% else %}{{ message['content'] | trim }}<|eot_id|>{% endif "
    "%}{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n"
    "\n"
    "{% endif %}"
)
CHATML = (
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}{{ "
    "'<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}{{ "
    "'<|im_start|>' + message['role'] + '\\n' }}{% if message['role'] == 'assistant' %}{% "
    "generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\\n' }}{% else "
    "%}{{ message['content'] + '<|im_end|>\\n' }}{% endif %}{% endfor %}{% if "
    "add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

TOPICS = [
    "the river",
    "a lamp",
    "tea",
    "rain on the roof",
    "prime numbers",
    "a violin",
    "Zürich",
    "the moon",
    "bread",
    "a garden",
    "chess",
    "snow",
]


def conversations() -> list[dict]:
    """24 conversations: single and multi-turn, with and without a system turn, prompt and
    completion records, non-ASCII text, surrounding spaces (which one template trims)."""
    out = []
    for i, topic in enumerate(TOPICS * 2):
        if i % 6 == 0:
            out.append(
                {
                    "prompt": f"Say something about {topic}.",
                    "completion": f"{topic.capitalize()} is worth a line.",
                }
            )
            continue
        messages = []
        if i % 4 == 1:
            messages.append({"role": "system", "content": "Answer in one short sentence."})
        messages += [
            {"role": "user", "content": f"  What do you know about {topic}? "},
            {"role": "assistant", "content": f"{topic} — fact {i}: it exists."},
        ]
        if i % 3 == 2:
            messages += [
                {"role": "user", "content": "Tell me more, über kurz."},
                {"role": "assistant", "content": f" More on {topic}, {i * 7}. "},
            ]
        out.append({"messages": messages})
    return out


def messages_of(record: dict) -> list[dict]:
    if "messages" in record:
        return record["messages"]
    return [
        {"role": "user", "content": record["prompt"]},
        {"role": "assistant", "content": record["completion"]},
    ]


def tokenizer(name: str) -> transformers.PreTrainedTokenizerFast:
    tok = Tokenizer.from_file(str(BASE))
    if name == "llama3":
        return transformers.PreTrainedTokenizerFast(
            tokenizer_object=tok,
            bos_token="<|begin_of_text|>",
            eos_token="<|eot_id|>",
            chat_template=LLAMA3,
        )
    tok.add_special_tokens(
        [AddedToken("<|im_start|>", special=True), AddedToken("<|im_end|>", special=True)]
    )
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", chat_template=CHATML
    )


def main():
    OUT.mkdir(parents=True, exist_ok=True)
    records = conversations()
    (OUT / "conversations.jsonl").write_text(
        "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8"
    )
    reference = {"transformers": transformers.__version__}
    for name in ("llama3", "chatml"):
        tok = tokenizer(name)
        tok.save_pretrained(OUT / name)
        rows = []
        for r in records:
            out = tok.apply_chat_template(
                messages_of(r), tokenize=True, return_dict=True, return_assistant_tokens_mask=True
            )
            rows.append(
                {
                    "input_ids": list(out["input_ids"]),
                    "assistant_masks": list(out["assistant_masks"]),
                }
            )
        prompt = tok.apply_chat_template(
            messages_of(records[1])[:-1],
            tokenize=True,
            add_generation_prompt=True,
            return_dict=True,
        )
        reference[name] = {"conversations": rows, "prompt_1": list(prompt["input_ids"])}
        print(name, sum(map(sum, (r["assistant_masks"] for r in rows))), "assistant tokens")
    (OUT / "reference.json").write_text(json.dumps(reference) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
