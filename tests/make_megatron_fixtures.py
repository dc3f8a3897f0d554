"""Build the Megatron-LM fixtures of tests/test_megatron_data.py: three tiny indexed datasets
written by Megatron-LM's own IndexedDatasetBuilder, as its tools/preprocess_data.py writes
them, and what Megatron-LM's own IndexedDataset reads back from each.

Run by hand, in an environment with PyTorch and megatron-core (never by the test suite, whose
environment has neither):

    python -m venv /tmp/mcore
    /tmp/mcore/bin/pip install torch --index-url https://download.pytorch.org/whl/cpu
    /tmp/mcore/bin/pip install --no-deps megatron-core==0.16.1 && /tmp/mcore/bin/pip install tokenizers numpy packaging
    /tmp/mcore/bin/python tests/make_megatron_fixtures.py

It rewrites tests/fixtures/megatron/ (about 10 kB):
- zen_text_document.{bin,idx}: one sequence per document, [SEP] appended as the end of
  document (`--append-eod`), uint16 ids (DType.optimal_dtype of a 220-id vocabulary): GPT data;
- zen_text_sentence.{bin,idx}: one sequence per sentence (`--split-sentences`), no end token,
  int32 ids (what Megatron writes for vocabularies of 65,500 ids or more): BERT data;
- zen_multimodal.{bin,idx}: the document file again with a mode byte per sequence;
- reference.npz: for each, Megatron's reading: every sequence's ids in order, the sequence
  lengths and the document indices.
The text is the Zen of Python (the stdlib's `this`), tokenized with the BERT fixture's
vocabulary by the `tokenizers` library, not by megajax.
"""
import codecs
import json
from pathlib import Path

import numpy as np
import torch
from megatron.core.datasets.indexed_dataset import DType, IndexedDataset, IndexedDatasetBuilder
from tokenizers import BertWordPieceTokenizer

HERE = Path(__file__).resolve().parent
OUT = HERE / "fixtures" / "megatron"
VOCAB = HERE / "fixtures" / "hf" / "bert" / "vocab.txt"


def zen_documents() -> list[list[str]]:
    """The 19 aphorisms, three or four sentences to a document."""
    import this  # noqa: F401  (prints the text; its rot13 source is this.s)

    lines = [line for line in codecs.decode(this.s, "rot13").splitlines()[2:] if line.strip()]
    sizes = [3, 4, 3, 3, 4, 2]
    docs, at = [], 0
    for n in sizes:
        docs.append(lines[at:at + n])
        at += n
    return docs


def encode(tok, sentences: list[str], append_eod: bool, eod: int) -> tuple[list[int], list[int]]:
    """preprocess_data.py's Encoder.encode for one document: each non-empty sentence's ids, the
    end of document appended to the last."""
    doc_ids, lens = [], []
    for sentence in sentences:
        ids = tok.encode(sentence, add_special_tokens=False).ids
        if ids:
            doc_ids.extend(ids)
            lens.append(len(ids))
    if doc_ids and append_eod:
        doc_ids.append(eod)
        lens[-1] += 1
    return doc_ids, lens


def build(prefix: Path, docs, split_sentences: bool, append_eod: bool, dtype, multimodal=False):
    tok = BertWordPieceTokenizer(str(VOCAB), lowercase=True)
    eod = tok.token_to_id("[SEP]")
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=dtype, multimodal=multimodal)
    for doc in docs:
        sentences = doc if split_sentences else [" ".join(doc)]
        ids, lens = encode(tok, sentences, append_eod, eod)
        builder.add_document(torch.IntTensor(ids), lens, modes=[0] * len(lens) if multimodal else None)
    builder.finalize(f"{prefix}.idx")
    read = IndexedDataset(str(prefix), multimodal=multimodal)
    items = [read[i][0] if multimodal else read[i] for i in range(len(read))]   # multimodal: (ids, mode)
    return {"tokens": np.concatenate(items),
            "lengths": np.asarray(read.sequence_lengths), "document_indices": np.asarray(read.document_indices)}


def main():
    OUT.mkdir(parents=True, exist_ok=True)
    docs = zen_documents()
    vocab = len(VOCAB.read_text().splitlines())
    made = {"zen_text_document": build(OUT / "zen_text_document", docs, False, True, DType.optimal_dtype(vocab)),
            "zen_text_sentence": build(OUT / "zen_text_sentence", docs, True, False, np.int32),
            "zen_multimodal": build(OUT / "zen_multimodal", docs, False, True, DType.optimal_dtype(vocab), True)}
    np.savez(OUT / "reference.npz", **{f"{name}/{k}": v for name, r in made.items() for k, v in r.items()})
    (OUT / "documents.json").write_text(json.dumps(docs, indent=1) + "\n")
    for name, r in made.items():
        print(name, len(r["tokens"]), "tokens,", len(r["lengths"]), "sequences,", len(r["document_indices"]) - 1, "documents")


if __name__ == "__main__":
    main()
