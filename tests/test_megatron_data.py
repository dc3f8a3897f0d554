"""Megatron-LM's indexed datasets (`--data megatron:PREFIX`) against Megatron-LM's own code: the
fixtures were written by megatron-core's IndexedDatasetBuilder, as tools/preprocess_data.py
writes them, and reference.npz holds what megatron-core's IndexedDataset reads back from each
(tests/make_megatron_fixtures.py). Damaged files are written here by hand, from the format."""

import re
import shutil
import struct

import jax
import numpy as np
import pytest
from conftest import ROOT

from megajax.config import load_config
from megajax.data.megatron import read_indexed
from megajax.data.sentences import make_pairs
from megajax.errors import UserError
from megajax.tasks import task_for

FIXTURES = ROOT / "tests/fixtures/megatron"
REFERENCE = np.load(FIXTURES / "reference.npz")
VOCAB = f"wordpiece:{ROOT / 'tests/fixtures/hf/bert/vocab.txt'}"  # the fixtures' 220 ids


def reference(name: str) -> tuple[np.ndarray, list[np.ndarray], np.ndarray]:
    """(tokens, each sequence, document indices) as Megatron-LM read them."""
    tokens, lengths = REFERENCE[f"{name}/tokens"], REFERENCE[f"{name}/lengths"]
    bounds = np.concatenate([[0], np.cumsum(lengths)])
    return (
        tokens,
        [tokens[a:b] for a, b in zip(bounds[:-1], bounds[1:])],
        REFERENCE[f"{name}/document_indices"],
    )


@pytest.mark.parametrize("name", ["zen_text_document", "zen_text_sentence", "zen_multimodal"])
def test_megajax_reads_what_megatron_reads(name):
    """Documents of one sequence in uint16 (GPT data), of sentences in int32 (BERT data, and
    any vocabulary of 65,500 ids or more), and a multimodal index (its mode bytes skipped)."""
    tokens, sequences, documents = reference(name)
    ds = read_indexed(str(FIXTURES / name))
    assert ds.tokens.dtype == tokens.dtype and ds.documents == len(documents) - 1 == 6
    np.testing.assert_array_equal(ds.tokens, tokens)
    got = [s for doc in ds.sentences() for s in doc]
    assert len(got) == len(sequences) and all(np.array_equal(a, b) for a, b in zip(got, sequences))
    assert [len(doc) for doc in ds.sentences()] == np.diff(documents).tolist()
    assert (
        ds.document_ends().tolist()
        == np.cumsum([len(s) for s in sequences])[documents[1:] - 1].tolist()
    )
    # PREFIX.idx names PREFIX too
    assert read_indexed(str(FIXTURES / f"{name}.idx")).documents == 6


def test_a_gpt_run_reads_the_tokens_and_holds_out_whole_trailing_documents():
    prefix = FIXTURES / "zen_text_document"
    cfg = load_config(
        "tiny",
        [f"data.source=megatron:{prefix}", f"data.tokenizer={VOCAB}", "data.val_fraction=0.2"],
    )
    data = task_for(cfg).load_data(cfg)
    tokens, sequences, _ = reference("zen_text_document")
    np.testing.assert_array_equal(np.concatenate([data.train, data.val]), tokens)
    # 481 tokens, 20% held out: the goal is 385 trained. Of the document ends that hold out
    # between half and twice 96 (293 and 403), 403 is the nearest.
    assert np.cumsum([len(s) for s in sequences]).tolist() == [58, 125, 199, 293, 403, 481]
    assert len(data.train) == 403 and data.vocab_size == 220
    batch = np.asarray(
        data.batches("train", cfg, jax.sharding.SingleDeviceSharding(jax.devices()[0]))(0)
    )
    assert batch.shape == (cfg.train.batch_size, cfg.model.seq_len + 1) and batch.max() < 220


def test_a_bert_run_pairs_the_sentences_megatron_split():
    cfg = load_config(
        "bert_tiny",
        [f"data.source=megatron:{FIXTURES / 'zen_text_sentence'}", f"data.tokenizer={VOCAB}"],
    )
    data = task_for(cfg).load_data(cfg)
    _, sequences, documents = reference("zen_text_sentence")
    docs = [
        [sequences[i].tolist() for i in range(a, b)] for a, b in zip(documents[:-1], documents[1:])
    ]
    assert [*data.train_pairs, *data.val_pairs] == make_pairs(
        docs, cfg.model.seq_len, cfg.train.seed
    )
    assert len(data.val_pairs) == int(
        len(make_pairs(docs, cfg.model.seq_len, cfg.train.seed)) * cfg.data.val_fraction
    )
    gpt_data = load_config(
        "bert_tiny",
        [f"data.source=megatron:{FIXTURES / 'zen_text_document'}", f"data.tokenizer={VOCAB}"],
    )
    with pytest.raises(
        UserError, match="one sequence per document .* preprocess it with --split-sentences"
    ):
        task_for(gpt_data).load_data(gpt_data)


def write_indexed(
    prefix, sequences: list[list[int]], documents: list[int], code: int = 8, version: int = 1
) -> None:
    """A version-1 index and its tokens, written from the format alone."""
    dtype = {8: np.uint16, 4: np.int32, 7: np.float32}[code]
    lengths = np.array([len(s) for s in sequences], np.int32)
    pointers = (
        np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64) * np.dtype(dtype).itemsize
    )
    with open(f"{prefix}.idx", "wb") as f:
        f.write(
            b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", version, code, len(sequences), len(documents))
        )
        f.write(lengths.tobytes() + pointers.tobytes() + np.array(documents, np.int64).tobytes())
    with open(f"{prefix}.bin", "wb") as f:
        f.write(np.array([t for s in sequences for t in s], dtype).tobytes())


def test_damaged_or_foreign_files_are_one_line(tmp_path):
    good = tmp_path / "good"
    write_indexed(good, [[1, 2, 3], [4, 5], [6]], [0, 2, 3])
    assert read_indexed(str(good)).tokens.tolist() == [1, 2, 3, 4, 5, 6]

    def damaged(name, change):
        for end in (".idx", ".bin"):
            shutil.copy(f"{good}{end}", tmp_path / f"{name}{end}")
        change(tmp_path / name)
        return str(tmp_path / name)

    def patch(path, offset, data):
        with open(path, "r+b") as f:
            f.seek(offset)
            f.write(data)

    cases = [
        (
            damaged("no_idx", lambda p: p.with_suffix(".idx").unlink()),
            "no_idx.idx not found: megatron:PREFIX reads",
        ),
        (damaged("no_bin", lambda p: p.with_suffix(".bin").unlink()), "no_bin.bin not found"),
        (
            damaged("magic", lambda p: patch(p.with_suffix(".idx"), 0, b"TNTIDX")),
            "is not a Megatron-LM index",
        ),
        (
            damaged("version", lambda p: patch(p.with_suffix(".idx"), 9, struct.pack("<Q", 2))),
            "is a version 2",
        ),
        (
            damaged("floats", lambda p: patch(p.with_suffix(".idx"), 17, b"\x07")),
            "holds float32 values, not token ids",
        ),
        (
            damaged("code", lambda p: patch(p.with_suffix(".idx"), 17, b"\x09")),
            "has unknown dtype code 9",
        ),
        (
            damaged("short_idx", lambda p: open(p.with_suffix(".idx"), "r+b").truncate(40)),
            "damaged or incomplete",
        ),
        (
            damaged("short_bin", lambda p: open(p.with_suffix(".bin"), "r+b").truncate(10)),
            "should hold 6 uint16 tokens (12 bytes) as short_bin.idx says, has 10 bytes",
        ),
        (
            damaged(
                "pointers",
                lambda p: patch(p.with_suffix(".idx"), 34 + 12 + 8, struct.pack("<q", 4)),
            ),
            "sequence pointers are not its lengths laid back to back",
        ),
        (
            damaged("negative", lambda p: patch(p.with_suffix(".idx"), 34, struct.pack("<i", -3))),
            "negative sequence length",
        ),
        (
            damaged(
                "documents",
                lambda p: patch(p.with_suffix(".idx"), 34 + 36 + 16, struct.pack("<q", 2)),
            ),
            "document indices do not run from 0 to its 3 sequences",
        ),
    ]
    for prefix, message in cases:
        with pytest.raises(UserError, match=re.escape(message)):
            read_indexed(prefix)
    write_indexed(tmp_path / "wide", [[300, 1], [2]], [0, 1, 2], code=4)
    for tokenizer, message in [
        ("bytes", "has token id 300, outside the bytes tokenizer's 256 ids: give the tokenizer"),
        ("chars", "--tokenizer chars is built from the corpus's text"),
    ]:
        cfg = load_config(
            "tiny", [f"data.source=megatron:{tmp_path / 'wide'}", f"data.tokenizer={tokenizer}"]
        )
        with pytest.raises(UserError, match=message):
            task_for(cfg).load_data(cfg)
