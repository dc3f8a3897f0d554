"""WikiText perplexity as the paper reports it: the detokenized text scored with overlapping
windows, and the perplexity adjusted to the original word-level token count."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from megajax.data.sources import read_utf8
from megajax.data.tokenizer import Tokenizer
from megajax.errors import UserError
from megajax.evaluation.scoring import perplexity, perplexity_of_tokens


def wikitext_detokenize(text: str) -> str:
    """Undo WikiText's word-level tokenization (as the paper did for GPT-2 evaluation)."""
    text = text.replace("s '", "s'")
    text = re.sub(r"/' [0-9]/", r"/'[0-9]/", text)
    text = text.replace(" @-@ ", "-").replace(" @,@ ", ",").replace(" @.@ ", ".")
    for p in (":", ";", ".", "!", "?", ","):
        text = text.replace(f" {p} ", f"{p} ")
    text = re.sub(r"\(\s*([^\)]*?)\s*\)", r"(\1)", text)
    text = re.sub(r"\[\s*([^\]]*?)\s*\]", r"[\1]", text)
    text = re.sub(r"{\s*([^}]*?)\s*}", r"{\1}", text)
    text = re.sub(r"\"\s*([^\"]*?)\s*\"", r'"\1"', text)
    text = re.sub(r"'\s*([^']*?)\s*'", r"'\1'", text)
    text = text.replace("= = = =", "====").replace("= = =", "===").replace("= =", "==")
    text = text.replace(" " + chr(176) + " ", chr(176))
    text = text.replace(" \n", "\n").replace("\n ", "\n")
    text = text.replace(" N ", " 1 ")
    text = text.replace(" 's", "'s")
    return text


def original_token_count(raw: str) -> int:
    """T_o: word-level tokens of the original file, counted as the paper (Megatron) does."""
    return len(raw.strip().split(" "))


def evaluate_wikitext(
    model, tokenizer: Tokenizer, path: Path, stride: int = 32, batch_size: int = 8, progress=None
) -> dict:
    path = Path(path)
    if not path.is_file():
        raise UserError(f"WikiText file not found: {path}")
    raw = read_utf8(path)
    if not raw.strip():
        raise UserError(f"WikiText file {path} is empty")
    t_o = original_token_count(raw)
    tokens = np.asarray(tokenizer.encode(wikitext_detokenize(raw)), np.int32)
    r = perplexity_of_tokens(model, tokens, stride, batch_size, progress)
    # The paper divides by T_o; Megatron-LM's evaluation script by T_o - 1 (it counts the
    # predictions, one fewer than the words): both, so either kind of figure can be compared.
    r.update(
        {
            "original_tokens": t_o,
            "adjusted_ppl": perplexity(r["loss_sum"] / t_o),
            "adjusted_ppl_megatron": perplexity(r["loss_sum"] / (t_o - 1)),
            "file": str(path),
        }
    )
    return r
