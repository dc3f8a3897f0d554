"""What a data source and a tokenizer are named by (`--data`, `--tokenizer`, data.source,
data.tokenizer), parsed once, here, into small typed specs that the loaders take.

    DataSpec       builtin | text:PATH[,PATH|GLOB] | bin:PATH | bin:DIR | pairs:DIR |
                   megatron:PREFIX | chat:FILE.jsonl[,FILE|GLOB]
                   | tfds:NAME[/CONFIG][:SPLIT]; fine-tuning: the task's directory
    TokenizerSpec  bytes | chars | hf:PATH | tiktoken:NAME | wordpiece:PATH/vocab.txt |
    wordpiece[:SIZE]

Each kind has its loader in one registry (megajax/data/tokens.py for sources, megajax/data/
tokenizer.py for tokenizers), and its own error there. No jax: the command lines parse their
arguments before JAX starts.
"""

from __future__ import annotations

import dataclasses

# every kind of data source, as a user writes it
SOURCE_FORMS = {
    "builtin": "builtin",
    "text": "text:PATH",
    "bin": "bin:PATH",
    "chat": "chat:PATH",
    "megatron": "megatron:PREFIX",
    "tfds": "tfds:NAME",
    "pairs": "pairs:DIR",
}
SOURCE_KINDS = tuple(SOURCE_FORMS)
TOKENIZER_KINDS = ("bytes", "chars", "hf", "tiktoken", "wordpiece")


def split_kind(text: str) -> tuple[str, str]:
    """('kind', 'rest') of 'kind:rest' where kind is a word (text:, bin:, hf:, ...); ('', text)
    for anything else, such as a path: a colon later in it is the path's own."""
    kind, colon, rest = text.partition(":")
    return (kind, rest) if colon and kind.isalpha() else ("", text)


@dataclasses.dataclass(frozen=True)
class DataSpec:
    # one of SOURCE_KINDS, or what a user wrote (refused by the loader that reads it)
    kind: str
    arg: str = ""  # paths, a prefix, a dataset name; "" for builtin

    @classmethod
    def of(cls, source: "str | DataSpec", bare_path_is_text: bool = False) -> "DataSpec":
        """`source` parsed (as it is if already a spec). `bare_path_is_text`: a path without a
        kind is a text file (eval.py's --data), not an unknown kind."""
        if isinstance(source, DataSpec):
            return source
        kind, arg = split_kind(source)
        if kind:
            return cls(kind, arg)
        if source == "builtin" or not bare_path_is_text:
            return cls(source)
        return cls("text", source)

    def __str__(self) -> str:
        return self.kind if not self.arg and self.kind == "builtin" else f"{self.kind}:{self.arg}"

    @property
    def paths(self) -> list[str]:
        return self.arg.split(",")

    def tfds_split(self, default: str = "train") -> tuple[str, str]:
        """tfds:NAME[/CONFIG][:SPLIT] -> (NAME[/CONFIG], SPLIT)."""
        name, _, split = self.arg.partition(":")
        return name, split or default


@dataclasses.dataclass(frozen=True)
class TokenizerSpec:
    kind: str  # one of TOKENIZER_KINDS, or what a user wrote (refused by make_tokenizer)
    arg: str = ""  # a path, an encoding's name, a vocabulary size

    @classmethod
    def of(cls, spec: "str | TokenizerSpec") -> "TokenizerSpec":
        if isinstance(spec, TokenizerSpec):
            return spec
        kind, _, arg = spec.partition(":")
        return cls(kind, arg)

    def __str__(self) -> str:
        return f"{self.kind}:{self.arg}" if self.arg else self.kind

    @property
    def built_from_corpus(self) -> bool:
        """chars and wordpiece[:SIZE] build their vocabulary from the training text itself."""
        return self.kind == "chars" or (
            self.kind == "wordpiece" and (not self.arg or self.arg.isdigit())
        )


def is_blend(source) -> bool:
    """Whether a data source names a weighted blend, a weight before each source
    ("0.3 text:a.txt 0.7 bin:corpus": megajax/data/blend.py)."""
    if not isinstance(source, str):
        return False
    words = source.split()
    return len(words) >= 2 and blend_number(words[0]) is not None


def blend_number(word: str) -> float | None:
    try:
        return float(word)
    except ValueError:
        return None
