"""Chat templates: a conversation rendered as the model was trained to read it.

A tokenizer's template is Jinja (tokenizer_config.json's `chat_template`, or chat_template.jinja
beside it), rendered as transformers' `apply_chat_template` renders it: jinja2's immutable
sandbox (templates come from the Hub and are untrusted code), trim_blocks and lstrip_blocks,
the loop controls, and the same globals (`raise_exception`, `strftime_now`, a `tojson` that
keeps non-ASCII text, `dict`, `namespace`) and variables (`messages`, `add_generation_prompt`,
the tokenizer's named special tokens). A `{% generation %}` block marks the characters the
assistant writes; templates without one are split by rendering each prefix of the
conversation (`ChatTemplate.render`).

A tokenizer without a template gets PLAIN_TEMPLATE: documented here, and by construction
trained on consistently.
"""

from __future__ import annotations

import contextvars
import datetime
import json
from pathlib import Path

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from megajax.errors import UserError, first_line

# Each turn as `<|role|>\ncontent` closed by the end-of-turn text: the tokenizer's end of text
# where it has one, else END_OF_TURN. The assistant's content and its end of turn are what it
# learns to write.
END_OF_TURN = "<|end|>"
PLAIN_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}{{ end_of_turn }}{% "
    "endgeneration %}{% else %}{{ m['content'] }}{{ end_of_turn }}{% endif %}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n"
    "{% endif %}"
)

SPECIAL_TOKENS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
CONFIG_FILE, TEMPLATE_FILE = "tokenizer_config.json", "chat_template.jinja"
# Kept beside a tokenizer.json (a workdir's copy, an export): special tokens and the template.
TOKENIZER_EXTRAS = (CONFIG_FILE, TEMPLATE_FILE, "special_tokens_map.json")

_tracking = contextvars.ContextVar("megajax_generation_spans", default=None)


def _environment():
    """The sandboxed environment of a chat template, with the `generation` tag."""

    class Generation(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}`: records the (start, end) characters of what
        its body renders, where the text rendered so far ends."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_span"), [], [], body).set_lineno(
                lineno
            )

        def _span(self, caller):
            text = caller()
            if (spans := _tracking.get()) is not None:
                start = sum(len(block) for block in spans[0])
                spans[1].append((start, start + len(text)))
            return text

    class Namespace(jinja2.utils.Namespace):
        """jinja's namespace without underscore names (no way to CPython's internals)."""

        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            for name in dict(*args, **kwargs):
                Namespace._check(name)
            jinja2.utils.Namespace.__init__(self, *args, **kwargs)

        def __setitem__(self, name, value):
            Namespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"a namespace cannot hold {name!r}")

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals.update(
        raise_exception=raise_exception,
        namespace=Namespace,
        strftime_now=lambda f: datetime.datetime.now().strftime(f),
        dict=lambda *a, **k: dict(*a, **k),
    )
    return env


class ChatTemplate:
    """A compiled template and the variables it renders with."""

    def __init__(
        self,
        source: str,
        special_tokens: dict | None = None,
        origin: str = "",
        end_of_turn: str | None = None,
    ):
        self.source, self.origin = source, origin or "the chat template"
        self.variables = dict(special_tokens or {})
        self.variables.setdefault("end_of_turn", end_of_turn or END_OF_TURN)
        self.tagged = "generation" in source and "endgeneration" in source
        try:
            self.compiled = _environment().from_string(source)
        except jinja2.exceptions.TemplateError as e:
            raise UserError(f"{self.origin} is not a Jinja template: {first_line(e)}") from None

    @classmethod
    def plain(cls, eos_token: str | None = None) -> "ChatTemplate":
        """PLAIN_TEMPLATE, turns ending with `eos_token` (or END_OF_TURN)."""
        tokens = {"eos_token": eos_token} if eos_token else {}
        return cls(PLAIN_TEMPLATE, tokens, "megajax's plain chat template", eos_token)

    @property
    def end_of_turn(self) -> str:
        """The text closing an assistant turn, where sampling stops: the plain template's, or the
        tokenizer's end of text."""
        return self.variables.get("eos_token") or self.variables["end_of_turn"]

    def _render(self, messages, add_generation_prompt: bool, spans: list | None):
        blocks: list[str] = []
        token = _tracking.set((blocks, spans)) if spans is not None else None
        try:
            for block in self.compiled.generate(
                messages=messages, add_generation_prompt=add_generation_prompt, **self.variables
            ):
                blocks.append(block)
        except Exception as e:  # noqa: BLE001  a template is the user's code: any error is its
            what = (
                first_line(e)
                if isinstance(e, (jinja2.exceptions.TemplateError, TypeError, ValueError, KeyError))
                else (f"{type(e).__name__}: {first_line(e)}")
            )
            raise ValueError(f"{self.origin} fails to render it: {what}") from None
        finally:
            if token is not None:
                _tracking.reset(token)
        return "".join(blocks)

    def render(
        self, messages: list[dict], add_generation_prompt: bool = False
    ) -> tuple[str, list[tuple[int, int]]]:
        """(text, the (start, end) character spans the assistant writes). A template without
        `{% generation %}` is rendered once per assistant turn: the turn's span runs from the end
        of the conversation before it, with the generation prompt, to the end of the
        conversation through it (each must begin the next, as a template that renders turns in
        order gives)."""
        if self.tagged:
            spans: list[tuple[int, int]] = []
            return self._render(messages, add_generation_prompt, spans), spans
        text = self._render(messages, add_generation_prompt, None)
        spans = []
        for i, m in enumerate(messages):
            if m.get("role") != "assistant":
                continue
            before = self._render(messages[:i], True, None)
            through = self._render(messages[: i + 1], False, None)
            if not (through.startswith(before) and text.startswith(through)):
                raise ValueError(
                    f"{self.origin} does not render turns in order (a conversation's start renders "
                    "differently alone), so the assistant's tokens cannot be told: mark them with "
                    "{% generation %}"
                )
            spans.append((len(before), len(through)))
        return text, spans


def _tokenizer_config(directory: Path, strict: bool = True) -> dict:
    """tokenizer_config.json in `directory` ({} if none); damaged: a UserError, or {} if not
    `strict`."""
    path = Path(directory) / CONFIG_FILE
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        if not strict:
            return {}
        raise UserError(f"{path} is not JSON: {first_line(e)}") from None
    return config if isinstance(config, dict) else {}


def special_tokens(directory: Path) -> dict[str, str]:
    """The named special tokens (bos_token, eos_token, ...) of a tokenizer_config.json in
    `directory`, as strings (a Llama's end of turn is its eos, not the first end-like token of
    the vocabulary); {} when there is none."""
    tokens = {}
    for key, value in _tokenizer_config(directory, strict=False).items():
        value = value.get("content") if isinstance(value, dict) else value
        if key in SPECIAL_TOKENS and isinstance(value, str):
            tokens[key] = value
    return tokens


def read_template(directory: Path) -> ChatTemplate | None:
    """The template of a tokenizer directory (tokenizer_config.json's `chat_template`, its
    "default" if it names several, or chat_template.jinja), with its special tokens; None if
    it has none."""
    directory = Path(directory)
    source, origin = _tokenizer_config(directory).get("chat_template"), str(directory / CONFIG_FILE)
    if isinstance(source, list):  # named templates: [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default")
    if not isinstance(source, str) and (directory / TEMPLATE_FILE).is_file():
        source, origin = (
            (directory / TEMPLATE_FILE).read_text(encoding="utf-8"),
            str(directory / TEMPLATE_FILE),
        )
    if not isinstance(source, str):
        return None
    return ChatTemplate(source, special_tokens(directory), origin)
