"""Data sources, tokenizers and deterministic, data-sharded batches."""

import re

import numpy as np
import pytest
from conftest import mesh_for
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from megajax.data.sources import builtin_text, source_text, text_files
from megajax.data.tokenizer import (
    ByteTokenizer,
    CharTokenizer,
    HFTokenizer,
    TiktokenTokenizer,
    load_tokenizer,
    make_tokenizer,
)
from megajax.data.tokens import Batches, EvalWindows, load_tokens
from megajax.errors import UserError


def test_builtin_corpus_is_real_python_source():
    text = builtin_text(max_bytes=200_000)
    assert len(text) >= 200_000 and "def " in text and "import " in text
    assert builtin_text(max_bytes=50_000) == builtin_text(max_bytes=50_000)  # fixed order


def test_text_and_bin_sources_with_split(tmp_path):
    f = tmp_path / "a.txt"
    f.write_text("hello world, " * 100)
    d = load_tokens(f"text:{tmp_path}/*.txt", "bytes", val_fraction=0.1)
    assert len(d.train) + len(d.val) == 1300 and len(d.val) == 130
    assert ByteTokenizer().decode(d.train[:11]) == "hello world"
    ids = np.arange(1000, dtype=np.uint16) % 300
    ids.tofile(tmp_path / "t.bin")
    b = load_tokens(f"bin:{tmp_path / 't.bin'}", "bytes", val_fraction=0.2)
    np.testing.assert_array_equal(np.concatenate([b.train, b.val]), ids)


def test_char_tokenizer_roundtrip_and_save(tmp_path):
    tok = CharTokenizer.from_text("to be or not to be")
    assert tok.vocab_size == len(set("to be or not to be"))
    assert tok.decode(tok.encode("not to be")) == "not to be"
    tok.save(tmp_path)
    again = load_tokenizer(tmp_path)
    assert again.encode("be or") == tok.encode("be or")


def test_hf_tokenizer_json(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tk = Tokenizer(models.BPE(unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tk.train_from_iterator(
        ["the cat sat on the mat"] * 50,
        trainers.BpeTrainer(vocab_size=60, special_tokens=["<unk>", "<|endoftext|>"]),
    )
    path = tmp_path / "tokenizer.json"
    tk.save(str(path))
    hf = HFTokenizer(path)
    assert hf.eos_id == tk.token_to_id("<|endoftext|>")
    assert hf.encode("the cat") == tk.encode("the cat").ids
    wd = tmp_path / "wd"
    wd.mkdir()
    hf.save(wd)
    assert load_tokenizer(wd).encode("sat on the mat") == tk.encode("sat on the mat").ids


def test_tiktoken_wrapper_and_offline_error(monkeypatch, tmp_path):
    import tiktoken

    ranks = {bytes([i]): i for i in range(256)}
    enc = tiktoken.Encoding(
        "bytes", pat_str=r"\S+|\s+", mergeable_ranks=ranks, special_tokens={"<|endoftext|>": 256}
    )
    tok = TiktokenTokenizer("bytes", enc)
    assert tok.encode("hi") == [104, 105] and tok.eos_id == 256 and tok.vocab_size == 257
    with pytest.raises(
        UserError, match=r"unknown tiktoken encoding 'definitely_not_one' \(tiktoken has gpt2, "
    ):
        TiktokenTokenizer("definitely_not_one")  # before: "not available offline"

    def offline(name):  # what tiktoken raises with an empty cache and no network
        raise ConnectionError("Max retries exceeded")

    monkeypatch.setattr(tiktoken, "get_encoding", offline)
    with pytest.raises(
        UserError, match="tiktoken encoding 'gpt2' is not available offline .*: ConnectionError"
    ):
        TiktokenTokenizer("gpt2")
    # hf:DIR reads DIR/tokenizer.json (a model directory)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(
        UserError, match=f"{tmp_path / 'tokenizer.json'} is not a Hugging Face tokenizer.json"
    ):
        make_tokenizer(f"hf:{tmp_path}")


def test_tfds_source_with_mock_data():
    import tensorflow_datasets as tfds

    with tfds.testing.mock_data(num_examples=4):
        d = load_tokens("tfds:tiny_shakespeare", "bytes")
    assert len(d.train) > 0 and len(d.val) > 0
    assert d.train.dtype == np.uint16


def test_batches_are_a_pure_function_of_seed_and_step():
    tokens = np.arange(10_000, dtype=np.uint16)
    mesh = mesh_for("2x4")
    sh = NamedSharding(mesh, P("data", None))
    a = Batches(tokens, seq_len=16, batch_size=8, seed=1, sharding=sh)
    b = Batches(tokens, seq_len=16, batch_size=8, seed=1, sharding=sh)
    x5, y5 = np.asarray(a(5)), np.asarray(b(5))
    np.testing.assert_array_equal(x5, y5)
    assert not np.array_equal(np.asarray(a(6)), x5)
    np.testing.assert_array_equal(x5[:, 1:], x5[:, :-1] + 1)  # contiguous windows
    # Each device holds only its data shard's rows.
    shard = a(5).addressable_shards[0]
    assert shard.data.shape == (4, 17)
    single = Batches(tokens, 16, 8, 1, NamedSharding(mesh_for("1x1"), P("data", None)))
    np.testing.assert_array_equal(np.asarray(single(5)), x5)  # the same rows on any mesh


def test_validation_sweeps_disjoint_windows_over_the_split():
    tokens = np.arange(1_000, dtype=np.uint16)
    sh = NamedSharding(mesh_for("2x4"), P("data", None))
    # 999 // 16 = 62 windows; 62 // 8 = 7 full batches: all 56 fit in a budget of 10 batches.
    whole = EvalWindows(tokens, 16, 8, max_batches=10, sharding=sh)
    assert whole.num_batches == 7
    rows = np.concatenate([np.asarray(whole(i)) for i in range(7)])
    starts = rows[:, 0].astype(int)
    np.testing.assert_array_equal(rows, starts[:, None] + np.arange(17))
    # Targets (columns 1..16) never repeat and are spread over the whole split, in order.
    targets = rows[:, 1:].ravel()
    assert len(set(targets)) == targets.size == 56 * 16
    assert np.all(np.diff(starts) >= 16) and starts[0] == 0 and starts[-1] >= 1_000 - 3 * 16
    # A smaller budget keeps the windows disjoint and spread: evenly spaced over all 62.
    two = EvalWindows(tokens, 16, 8, max_batches=2, sharding=sh)
    starts2 = np.concatenate([np.asarray(two(i))[:, 0] for i in range(two.num_batches)]).astype(int)
    np.testing.assert_array_equal(starts2, np.arange(16) * 62 // 16 * 16)
    # The same sweep on any mesh, whatever the seed (it has none).
    single = EvalWindows(tokens, 16, 8, 10, NamedSharding(mesh_for("1x1"), P("data", None)))
    np.testing.assert_array_equal(np.asarray(single(3)), np.asarray(whole(3)))
    # A split with fewer windows than one batch still gives one (repeating) batch.
    tiny = EvalWindows(np.arange(40), 16, 8, 10, None)
    assert tiny.num_batches == 1 and set(tiny.starts(0)) == {0, 16}


def test_malformed_sources_are_refused_with_where(tmp_path):
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("caf\u00e9 au lait".encode("latin-1"))
    with pytest.raises(UserError, match=r"latin1.txt is not UTF-8 text \(byte 3: b'\\xe9'\)"):
        load_tokens(f"text:{bad}", "bytes")
    (tmp_path / "odd.bin").write_bytes(b"\x01\x00\x02")
    with pytest.raises(UserError, match="3 bytes, not a whole number of uint16 tokens"):
        load_tokens(f"bin:{tmp_path / 'odd.bin'}", "bytes")


def test_garbage_tokenizer_file_is_one_line(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(UserError, match="is not a Hugging Face tokenizer.json"):
        make_tokenizer(f"hf:{tmp_path / 'tokenizer.json'}")
    # before: a UnicodeDecodeError traceback
    (tmp_path / "vocab.txt").write_bytes(b"[PAD]\ncaf\xe9\n")
    with pytest.raises(UserError, match=r"vocab.txt is not UTF-8 text \(byte 9"):
        make_tokenizer(f"wordpiece:{tmp_path / 'vocab.txt'}")


@pytest.mark.parametrize(
    "spec, message",
    [
        ("bytes:3", "the bytes tokenizer takes no argument"),
        ("chars:x", "the chars tokenizer takes no argument"),
        ("wordpiece:0", "wordpiece:SIZE must be at least 5"),
    ],
)
def test_tokenizer_arguments_that_would_be_ignored_are_refused(spec, message):
    """Before, each was accepted: the argument ignored, or a vocabulary of the alphabet alone."""
    with pytest.raises(UserError, match=re.escape(message)):
        make_tokenizer(spec, "some training text")


def test_paths_that_exist_are_not_split_or_globbed(tmp_path):
    """A file named `a,b.txt` or `run[1].txt` is that file (before: split at the comma, not
    found; or read as a pattern, which matched `run1.txt`); lists and globs work as before."""
    for name in ("a,b.txt", "run[1].txt", "run1.txt", "x.txt"):
        (tmp_path / name).write_text(name, encoding="utf-8")
    assert text_files(str(tmp_path / "a,b.txt")) == [tmp_path / "a,b.txt"]
    assert text_files(str(tmp_path / "run[1].txt")) == [tmp_path / "run[1].txt"]
    assert text_files(f"{tmp_path / 'x.txt'},{tmp_path / 'run1.txt'}") == [
        tmp_path / "x.txt",
        tmp_path / "run1.txt",
    ]
    assert text_files(str(tmp_path / "run?.txt")) == [tmp_path / "run1.txt"]
    assert len(text_files(str(tmp_path / "*.txt"))) == 4
    with pytest.raises(UserError, match="data file not found"):
        text_files(f"{tmp_path / 'x.txt'},{tmp_path / 'a'}")
    # A file named twice is read once (before: twice, the second copy in the held-out tail),
    # however it is spelt: a glob that includes it, another path, a link.
    (tmp_path / "link.txt").symlink_to("x.txt")
    (tmp_path / "sub").mkdir()
    x = tmp_path / "x.txt"
    assert text_files(f"{x},{tmp_path / 'sub' / '..' / 'x.txt'},{tmp_path / 'link.txt'},{x}") == [x]
    assert text_files(f"{tmp_path / 'run1.txt'},{tmp_path / 'run?.txt'}") == [tmp_path / "run1.txt"]


def test_missing_and_empty_sources(tmp_path):
    with pytest.raises(UserError, match="data file not found"):
        load_tokens(f"bin:{tmp_path / 'none.bin'}", "bytes")
    with pytest.raises(
        UserError,
        match=re.escape(
            f"data file {tmp_path} is a directory: give its files (a glob such as {tmp_path}/*.txt)"
        ),
    ):
        load_tokens(f"text:{tmp_path}", "bytes")
    with pytest.raises(UserError, match="data file /dev/null is not a regular file"):
        load_tokens("text:/dev/null", "bytes")
    with pytest.raises(
        UserError, match=f"{tmp_path} is a directory without meta.json, not a corpus prepared"
    ):
        load_tokens(f"bin:{tmp_path}", "bytes")  # before: "data file not found"
    (tmp_path / "e.bin").write_bytes(b"")
    with pytest.raises(UserError, match="empty"):
        load_tokens(f"bin:{tmp_path / 'e.bin'}", "bytes")
    with pytest.raises(UserError, match="unknown data source"):
        load_tokens("ftp:x", "bytes")
    with pytest.raises(
        UserError, match="'pairs:x' holds BERT sentence pairs, for model.kind = bert"
    ):
        load_tokens("pairs:x", "bytes")  # GPT given a BERT corpus, and BERT given token files:
    with pytest.raises(
        UserError, match="token files keep no sentence boundaries: BERT reads pairs:DIR"
    ):
        source_text("bin:x")
    with pytest.raises(UserError, match="fewer than one sequence"):
        Batches(np.arange(10), 16, 2, 0, None)
