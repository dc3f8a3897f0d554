"""megajax-prepare: text files, jsonl or a TFDS dataset tokenized once into a corpus directory
that train.py reads with `--data bin:DIR` (the implementation: corpus.py; units.py and pairs.py),
or conversations for `--data chat:DIR` (chat.py)."""

from megajax.prepare.chat import prepare_chat
from megajax.prepare.corpus import Settings, prepare

__all__ = ["Settings", "prepare", "prepare_chat"]
