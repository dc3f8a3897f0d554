"""The tokenizer of a Hugging Face model directory, as a megajax tokenizer, and back.

In: `tokenizer.json` (any fast tokenizer), GPT-2's `vocab.json` + `merges.txt` (byte-level
BPE, rebuilt with the `tokenizers` package) or BERT's `vocab.txt` (WordPiece, lower-cased
unless tokenizer_config.json says otherwise). Out: `tokenizer.json`, or `vocab.txt` with its
tokenizer_config.json; a bytes / chars / tiktoken tokenizer has no HF file and is reported.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import tokenizers
from tokenizers import decoders, models, pre_tokenizers

from megajax.data.tokenizer import HF_FILE, HFTokenizer, Tokenizer, WordPieceTokenizer
from megajax.errors import UserError, first_line
from megajax.files import write_atomic

FILES = "tokenizer.json, vocab.json + merges.txt, or vocab.txt"


def _tokenizer_config(hf_dir: Path) -> dict:
    path = hf_dir / "tokenizer_config.json"
    try:
        return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise UserError(f"{path} is not valid JSON") from None


def _byte_level_bpe(vocab: Path, merges: Path, out: Path) -> HFTokenizer:
    """GPT-2's slow-tokenizer files as the equivalent fast tokenizer, written to `out`."""
    try:
        tok = tokenizers.Tokenizer(models.BPE.from_file(str(vocab), str(merges)))
    except Exception as e:  # noqa: BLE001  (the tokenizers package raises its own Exception)
        raise UserError(
            f"{vocab} / {merges} are not a BPE vocabulary ({first_line(e, 120)})"
        ) from None
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(out))
    return HFTokenizer(out)


def read_tokenizer(hf_dir: Path, scratch: Path) -> Tokenizer:
    """The tokenizer of an HF model directory (`scratch`: where a rebuilt tokenizer.json goes)."""
    if (hf_dir / "tokenizer.json").is_file():
        return HFTokenizer(hf_dir / "tokenizer.json")
    if (hf_dir / "vocab.json").is_file() and (hf_dir / "merges.txt").is_file():
        return _byte_level_bpe(hf_dir / "vocab.json", hf_dir / "merges.txt", scratch / HF_FILE)
    if (hf_dir / "vocab.txt").is_file():
        lowercase = _tokenizer_config(hf_dir).get("do_lower_case", True)
        return WordPieceTokenizer.from_file(hf_dir / "vocab.txt", lowercase=bool(lowercase))
    raise UserError(f"no tokenizer in {hf_dir} (looked for {FILES})")


def write_tokenizer(tokenizer: Tokenizer, out: Path) -> str | None:
    """The HF files for a megajax tokenizer; a note when it has none."""
    if isinstance(tokenizer, WordPieceTokenizer):
        write_atomic(out / "vocab.txt", "\n".join(tokenizer.vocab) + "\n")
        write_atomic(
            out / "tokenizer_config.json",
            json.dumps(
                {"tokenizer_class": "BertTokenizer", "do_lower_case": tokenizer.lowercase}, indent=1
            )
            + "\n",
        )
        return None
    if isinstance(tokenizer, HFTokenizer):
        shutil.copyfile(tokenizer.path, out / "tokenizer.json")
        return None
    return (
        f"the '{tokenizer.kind}' tokenizer has no Hugging Face file: the model is written without "
        "one (load a tokenizer for it separately)"
    )
