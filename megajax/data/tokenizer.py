"""Tokenizers: raw bytes, characters, Hugging Face tokenizer.json, tiktoken, BERT WordPiece.

Each is saved into the workdir (`tokenizer.json`), so evaluation and sampling need no flags.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import tiktoken
import tokenizers
from tokenizers import decoders, models, normalizers, pre_tokenizers

from megajax.data.chat_template import TOKENIZER_EXTRAS, special_tokens
from megajax.data.sources import read_utf8
from megajax.data.wordpiece import train_vocab
from megajax.errors import UserError, first_line
from megajax.files import text_lines, write_atomic
from megajax.specs import TokenizerSpec

FILE = "tokenizer.json"
HF_FILE = "hf_tokenizer.json"


class Tokenizer:
    kind = ""
    eos_id: int | None = None

    @property
    def vocab_size(self) -> int:
        raise NotImplementedError

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def decode(self, ids) -> str:
        raise NotImplementedError

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def token_id(self, token: str) -> int | None:
        """The id of a special token such as [MASK], if this tokenizer has it."""
        return None

    def continuation_mask(self):
        """Per token id, whether it continues the word before it (WordPiece's `##` pieces);
        None when the tokenizer does not mark word pieces."""
        return None

    def spec(self) -> dict:
        return {"kind": self.kind}

    def save(self, workdir: Path):
        write_atomic(Path(workdir) / FILE, json.dumps(self.spec()) + "\n")


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes: 256 ids, no training, works on any text."""

    kind = "bytes"

    @property
    def vocab_size(self):
        return 256

    def encode(self, text):
        return list(text.encode("utf-8"))

    def decode(self, ids):
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")


class CharTokenizer(Tokenizer):
    """One id per distinct character of the training corpus (nanoGPT's shakespeare_char)."""

    kind = "chars"

    def __init__(self, chars: list[str]):
        self.chars = list(chars)
        self.index = {c: i for i, c in enumerate(self.chars)}

    @classmethod
    def from_text(cls, text: str) -> "CharTokenizer":
        return cls(sorted(set(text)))

    @property
    def vocab_size(self):
        return len(self.chars)

    def encode(self, text):
        try:
            return [self.index[c] for c in text]
        except KeyError as e:
            raise UserError(f"character {e.args[0]!r} is not in the character vocabulary") from None

    def decode(self, ids):
        return "".join(self.chars[int(i)] for i in ids if 0 <= int(i) < len(self.chars))

    def spec(self):
        return {"kind": self.kind, "chars": self.chars}


class HFTokenizer(Tokenizer):
    """A Hugging Face `tokenizer.json` (BPE, WordPiece, ...) through the `tokenizers` package."""

    kind = "hf"

    def __init__(self, path: Path):
        self.path = Path(path)
        if not self.path.is_file():
            raise UserError(f"tokenizer file not found: {self.path}")
        try:
            self.tok = tokenizers.Tokenizer.from_file(str(self.path))
        except Exception as e:  # noqa: BLE001  (the tokenizers package raises its own Exception)
            raise UserError(
                f"{self.path} is not a Hugging Face tokenizer.json ({first_line(e, 120)})"
            ) from None
        named = special_tokens(self.path.parent)
        for token in (
            named.get("eos_token"),
            "<|endoftext|>",
            "<|end_of_text|>",
            "</s>",
            "[SEP]",
            "<eos>",
        ):
            if token is not None and (i := self.tok.token_to_id(token)) is not None:
                self.eos_id = i
                break
        self.bos_id = self.tok.token_to_id(named["bos_token"]) if named.get("bos_token") else None

    @property
    def vocab_size(self):
        return self.tok.get_vocab_size()

    def encode(self, text):
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids):
        return self.tok.decode([int(i) for i in ids])

    def encode_batch(self, texts):
        return [e.ids for e in self.tok.encode_batch(texts, add_special_tokens=False)]

    def token_id(self, token):
        return self.tok.token_to_id(token)

    def continuation_mask(self):
        prefix = getattr(self.tok.model, "continuing_subword_prefix", None)
        if not prefix:
            return None
        mask = np.zeros(self.vocab_size, bool)
        for token, i in self.tok.get_vocab().items():
            mask[i] = token.startswith(prefix)
        return mask

    def save(self, workdir):
        write_atomic(Path(workdir) / HF_FILE, self.path.read_bytes())
        for name in TOKENIZER_EXTRAS:  # its special tokens and chat template go with it
            if (self.path.parent / name).is_file() and Path(workdir) != self.path.parent:
                write_atomic(Path(workdir) / name, (self.path.parent / name).read_bytes())
        write_atomic(Path(workdir) / FILE, json.dumps({"kind": "hf", "file": HF_FILE}) + "\n")


BERT_SPECIALS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
VOCAB_FILE = "vocab.txt"


class WordPieceTokenizer(HFTokenizer):
    """BERT's WordPiece from a `vocab.txt` (one token per line, id = line number), with BERT's
    normaliser (lower-casing by default) and pre-tokenizer, run by the `tokenizers` package.
    `train` builds such a vocabulary from a corpus, offline."""

    kind = "wordpiece"

    def __init__(self, vocab: list[str], lowercase: bool = True):
        missing = [t for t in BERT_SPECIALS if t not in vocab]
        if missing:
            raise UserError(f"the WordPiece vocabulary lacks {', '.join(missing)}")
        self.vocab, self.lowercase = list(vocab), lowercase
        self.tok = tokenizers.Tokenizer(
            models.WordPiece({t: i for i, t in enumerate(self.vocab)}, unk_token="[UNK]")
        )
        self.tok.normalizer = normalizers.BertNormalizer(lowercase=lowercase)
        self.tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        self.tok.decoder = decoders.WordPiece()
        self.eos_id = self.tok.token_to_id("[SEP]")

    @classmethod
    def from_file(cls, path: Path, lowercase: bool = True) -> "WordPieceTokenizer":
        path = Path(path)
        if not path.is_file():
            raise UserError(f"vocabulary file not found: {path}")
        vocab = text_lines(read_utf8(path))
        if not vocab:
            raise UserError(f"vocabulary file is empty: {path}")
        return cls(vocab, lowercase)

    @classmethod
    def train(
        cls, text: str, vocab_size: int = 8000, lowercase: bool = True
    ) -> "WordPieceTokenizer":
        """A vocabulary trained on `text`, reproducibly (megajax/wordpiece.py)."""
        return cls(train_vocab(text, vocab_size, BERT_SPECIALS, lowercase), lowercase)

    def save(self, workdir):
        write_atomic(Path(workdir) / VOCAB_FILE, "\n".join(self.vocab) + "\n")
        write_atomic(
            Path(workdir) / FILE,
            json.dumps({"kind": self.kind, "file": VOCAB_FILE, "lowercase": self.lowercase}) + "\n",
        )


class TiktokenTokenizer(Tokenizer):
    """A tiktoken encoding (e.g. gpt2) whose files are already in tiktoken's local cache."""

    kind = "tiktoken"

    def __init__(self, name: str, encoding=None):
        self.name = name
        if encoding is None:
            if name not in (known := tiktoken.list_encoding_names()):
                raise UserError(
                    f"unknown tiktoken encoding '{name}' (tiktoken has {', '.join(known)})"
                )
            try:
                encoding = tiktoken.get_encoding(name)
            # No network: requests' errors, or tiktoken's own.
            except Exception as e:  # noqa: BLE001
                raise UserError(
                    f"tiktoken encoding '{name}' is not available offline (put its files in "
                    f"TIKTOKEN_CACHE_DIR): {type(e).__name__}"
                ) from None
        self.enc = encoding
        self.eos_id = getattr(encoding, "eot_token", None)

    @property
    def vocab_size(self):
        return self.enc.n_vocab

    def encode(self, text):
        return self.enc.encode_ordinary(text)

    def decode(self, ids):
        return self.enc.decode([int(i) for i in ids])

    def spec(self):
        return {"kind": self.kind, "name": self.name}


def _wordpiece(arg: str, corpus_text: str | None) -> Tokenizer:
    if arg and not arg.isdigit():
        return WordPieceTokenizer.from_file(Path(arg))
    if int(arg or 8000) < len(BERT_SPECIALS):
        raise UserError(
            f"wordpiece:SIZE must be at least {len(BERT_SPECIALS)}, its special tokens (got {arg})"
        )
    if corpus_text is None:
        raise UserError("training a WordPiece vocabulary needs the training text")
    return WordPieceTokenizer.train(corpus_text, int(arg or 8000))


def _chars(arg: str, corpus_text: str | None) -> Tokenizer:
    if corpus_text is None:
        raise UserError("the chars tokenizer needs the training text to build its vocabulary")
    return CharTokenizer.from_text(corpus_text)


# The tokenizer kinds: (argument, the corpus's text where the kind builds from it) -> Tokenizer.
MAKERS = {
    "bytes": lambda arg, text: ByteTokenizer(),
    "chars": _chars,
    # a tokenizer.json, or a Hugging Face model directory holding one
    "hf": lambda arg, text: HFTokenizer(
        Path(arg) / "tokenizer.json" if Path(arg).is_dir() else Path(arg)
    ),
    "tiktoken": lambda arg, text: TiktokenTokenizer(arg or "gpt2"),
    "wordpiece": _wordpiece,
}


def make_tokenizer(spec: str | TokenizerSpec, corpus_text: str | None = None) -> Tokenizer:
    """The tokenizer a spec names (megajax/specs.py), built from `corpus_text` where its kind
    builds its vocabulary from the corpus."""
    spec = TokenizerSpec.of(spec)
    if spec.kind in ("bytes", "chars") and spec.arg:
        raise UserError(f"the {spec.kind} tokenizer takes no argument (got '{spec}')")
    if spec.kind not in MAKERS:
        raise UserError(
            f"unknown tokenizer '{spec}' (use bytes, chars, hf:PATH/tokenizer.json, tiktoken:NAME, "
            "wordpiece:PATH/vocab.txt or wordpiece[:SIZE])"
        )
    return MAKERS[spec.kind](spec.arg, corpus_text)


def chosen(
    given: Tokenizer | None, spec: str | TokenizerSpec | None, corpus_text: str | None = None
) -> Tokenizer:
    """The tokenizer a run uses: the one it was given (its workdir's, a pretrained run's, a
    prepared corpus's, an evaluated model's) wins over the one its spec would make."""
    if given is not None:
        return given
    if spec is None:
        raise ValueError("no tokenizer given and no spec to make one")
    return make_tokenizer(spec, corpus_text)


def fixed_tokenizer(given: Tokenizer | None, spec: str | TokenizerSpec, refusal: str) -> Tokenizer:
    """`chosen` for ids made before (a Megatron dataset or checkpoint, a corpus prepared in
    parts): a tokenizer that builds its vocabulary from the corpus's text cannot have made
    them, and is refused with `refusal`, which says why for that input."""
    if given is None and TokenizerSpec.of(spec).built_from_corpus:
        raise UserError(refusal)
    return chosen(given, spec)


def load_tokenizer(workdir: Path, what: str = "a megajax workdir") -> Tokenizer:
    path = Path(workdir) / FILE
    if not path.is_file():
        raise UserError(f"no {FILE} in {workdir}: is it {what}?")
    try:
        return _from_spec(json.loads(path.read_text(encoding="utf-8")), Path(workdir))
    except (KeyError, TypeError, ValueError, AttributeError):  # JSON's, UTF-8's: ValueErrors
        raise UserError(f"{path} is damaged (not a megajax tokenizer description)") from None


def _from_spec(spec: dict, workdir: Path) -> Tokenizer:
    """The tokenizer a saved description names; a description of the wrong form raises one of
    the errors load_tokenizer reports as damage."""
    kind = spec["kind"]
    if kind == "bytes":
        return ByteTokenizer()
    if kind == "chars":
        chars = spec["chars"]
        if not (
            isinstance(chars, list)
            and all(isinstance(c, str) and len(c) == 1 for c in chars)
            and len(set(chars)) == len(chars)
            and chars
        ):
            raise ValueError("chars: not a list of distinct characters")
        return CharTokenizer(chars)
    if kind == "hf":
        return HFTokenizer(workdir / _file_name(spec))
    if kind == "tiktoken":
        if not isinstance(spec["name"], str):
            raise TypeError("name: not a string")
        return TiktokenTokenizer(spec["name"])
    if kind == "wordpiece":
        return WordPieceTokenizer.from_file(
            workdir / _file_name(spec), bool(spec.get("lowercase", True))
        )
    raise UserError(f"{workdir / FILE}: unknown tokenizer kind {kind!r}")


def _file_name(spec: dict) -> str:
    """A companion file is one in the workdir itself, by name."""
    name = spec["file"]
    if not isinstance(name, str) or Path(name).name != name:
        raise ValueError("file: not a file name")
    return name
