"""megajax-prepare (megajax/prepare/): the tokens it writes against the tokenizer run by hand,
one process against a pool, an interrupted run resumed, and train.py reading the result."""

import argparse
import contextlib
import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import ROOT, file_size_limited, mesh_for
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import megajax.prepare.corpus as prep
from megajax.cli.prepare import prepare_main
from megajax.config import load_config
from megajax.data.prepared import tokenizer_fingerprint
from megajax.data.tokenizer import load_tokenizer, make_tokenizer
from megajax.errors import UserError
from megajax.evaluation import tasks as eval_tasks
from megajax.evaluation.bert import evaluate_pretraining
from megajax.files import WorkdirLock
from megajax.models.registry import init_model
from megajax.prepare import units as U
from megajax.runs.workdir import Loaded
from megajax.tasks import task_for

# a real WordPiece, 220 ids
TOKENIZER = f"hf:{ROOT / 'tests/fixtures/hf/megatron_bert/tokenizer.json'}"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Real text, offline: 24 modules of the standard library as documents, and a jsonl of 200."""
    root = tmp_path_factory.mktemp("corpus")
    stdlib = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:24]
    for i, path in enumerate(stdlib):
        (root / "text").mkdir(exist_ok=True)
        (root / "text" / f"{i:02d}_{path.stem}.txt").write_text(
            path.read_text(encoding="utf-8"), encoding="utf-8"
        )
    lines = [
        json.dumps({"id": i, "body": f"Record {i}: " + stdlib[i % 24].read_text()[:300]})
        for i in range(200)
    ]
    (root / "docs.jsonl").write_text("\n".join(lines) + "\n")
    return root


def outputs(out: Path) -> tuple[np.ndarray, dict]:
    meta = json.loads((out / "meta.json").read_text())
    dtype = np.dtype(meta["dtype"])
    return np.concatenate(
        [np.fromfile(out / meta["splits"][s]["file"], dtype) for s in ("train", "val")]
    ), meta


def test_tokens_are_each_document_then_its_end_token(corpus, tmp_path):
    meta = prep.prepare(
        [str(corpus / "text" / "*.txt")],
        tmp_path / "o",
        prep.Settings(TOKENIZER, 0.1),
        workers=1,
        say=lambda *a: None,
    )
    got, _ = outputs(tmp_path / "o")
    tok = make_tokenizer(TOKENIZER)
    sep = tok.token_id("[SEP]")
    want = [
        i
        for f in sorted((corpus / "text").glob("*.txt"))
        for i in [*tok.encode(f.read_text()), sep]
    ]
    np.testing.assert_array_equal(got, want)
    assert meta["dtype"] == "uint16" and meta["separator"] == [sep]
    t, v = meta["splits"]["train"], meta["splits"]["val"]
    assert t["documents"] + v["documents"] == 24 and t["tokens"] + v["tokens"] == len(want)
    # whole documents, ~10%
    assert (
        0.05 <= v["tokens"] / len(want) <= 0.2
        and v["documents"] >= 1
        and want[t["tokens"] - 1] == sep
    )
    assert tokenizer_fingerprint(load_tokenizer(tmp_path / "o")) == tokenizer_fingerprint(tok)
    assert all(len(s["sha256"]) == 64 and s["bytes"] > 0 for s in meta["plan"])


def test_jsonl_documents_by_field(corpus, tmp_path):
    prep.prepare(
        [str(corpus / "docs.jsonl")],
        tmp_path / "o",
        prep.Settings("bytes", 0.05, "body"),
        workers=1,
        say=lambda *a: None,
    )
    got, meta = outputs(tmp_path / "o")
    records = [
        json.loads(line)["body"] for line in (corpus / "docs.jsonl").read_text().splitlines()
    ]
    # bytes has no end-of-document token: a blank line separates the documents
    assert got.tobytes()[::2] == b"".join(r.encode() + b"\n\n" for r in records)
    assert meta["splits"]["train"]["documents"] + meta["splits"]["val"]["documents"] == 200


def test_a_file_named_twice_is_one_document_and_an_empty_one_none(corpus, tmp_path, capsys):
    """Before: a glob and a path to the same file tokenized it twice (the copy in the held-out
    tail, a validation set equal to training text); an empty file or jsonl text was a lone
    end-of-document token; inputs with no text at all made a corpus of end tokens."""
    files = sorted((corpus / "text").glob("*.txt"))[:3]
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "link.txt").symlink_to(files[1])
    (tmp_path / "blank.jsonl").write_text('{"text": ""}\n{"text": "one"}\n')
    inputs = [
        str(corpus / "text" / "0[0-2]_*.txt"),
        str(files[1]),
        str(tmp_path / "empty.txt"),
        str(tmp_path / "link.txt"),
        str(tmp_path / "blank.jsonl"),
    ]
    meta = prep.prepare(
        inputs, tmp_path / "o", prep.Settings(TOKENIZER, 0.1), workers=1, say=lambda *a: None
    )
    got, _ = outputs(tmp_path / "o")
    tok = make_tokenizer(TOKENIZER)
    sep = tok.token_id("[SEP]")
    want = [
        i for text in [f.read_text() for f in files] + ["one"] for i in [*tok.encode(text), sep]
    ]
    np.testing.assert_array_equal(got, want)
    assert meta["splits"]["train"]["documents"] + meta["splits"]["val"]["documents"] == 4
    assert [Path(s["source"]).name for s in meta["plan"]] == [f.name for f in files] + [
        "empty.txt",
        "blank.jsonl",
    ]
    assert (
        prepare_main(
            [
                str(tmp_path / "empty.txt"),
                str(tmp_path / "blank.jsonl"),
                "--text-field",
                "text",
                "--out",
                str(tmp_path / "none"),
                "--workers",
                "1",
            ]
        )
        == 0
    )  # "one" is text
    (tmp_path / "blank.jsonl").write_text('{"text": ""}\n')
    capsys.readouterr()
    assert (
        prepare_main(
            [
                str(tmp_path / "empty.txt"),
                str(tmp_path / "blank.jsonl"),
                "--out",
                str(tmp_path / "none2"),
                "--workers",
                "1",
            ]
        )
        == 2
    )
    assert (
        capsys.readouterr().err
        == "error: the inputs hold no text (every document is empty): nothing to prepare\n"
    )
    assert not (tmp_path / "none2").exists()


def test_a_pool_writes_what_one_process_writes(corpus, tmp_path, monkeypatch):
    # big files cut into many units, tokenized out of order
    monkeypatch.setattr(U, "UNIT_BYTES", 20_000)
    settings = prep.Settings(TOKENIZER, 0.2, "body")
    inputs = [str(corpus / "text" / "*.txt"), str(corpus / "docs.jsonl")]
    one = prep.prepare(inputs, tmp_path / "one", settings, workers=1, say=lambda *a: None)
    two = prep.prepare(inputs, tmp_path / "two", settings, workers=2, say=lambda *a: None)
    assert len(U.plan_units(one["plan"])) > 30
    np.testing.assert_array_equal(outputs(tmp_path / "one")[0], outputs(tmp_path / "two")[0])
    assert one["splits"] == two["splits"]


def interrupted_at(n: int, worker: str, monkeypatch, run):
    """`run()` stopped by Ctrl-C as its n-th unit starts (units run in-process with workers=1)."""
    real, calls = getattr(prep, worker), []

    def dies(job):
        calls.append(job[0])
        if len(calls) == n:
            raise KeyboardInterrupt
        return real(job)

    with monkeypatch.context() as m:
        m.setattr(prep, worker, dies)
        with pytest.raises(KeyboardInterrupt):
            run()


def test_an_interrupted_run_resumes_and_a_finished_one_is_kept(corpus, tmp_path, monkeypatch):
    settings, inputs, said = prep.Settings(TOKENIZER, 0.1), [str(corpus / "text" / "*.txt")], []
    prep.prepare(inputs, tmp_path / "clean", settings, workers=1, say=lambda *a: None)
    interrupted_at(
        5,
        "_run_unit",
        monkeypatch,
        lambda: prep.prepare(inputs, tmp_path / "o", settings, workers=1, say=said.append),
    )
    assert (
        not (tmp_path / "o" / "meta.json").exists()
        and len(list((tmp_path / "o" / ".partial" / "units").glob("*.npy"))) == 4
    )
    prep.prepare(inputs, tmp_path / "o", settings, workers=2, say=said.append)
    assert said == ["resuming: 4 of 24 units already tokenized"]
    np.testing.assert_array_equal(outputs(tmp_path / "o")[0], outputs(tmp_path / "clean")[0])
    assert not (tmp_path / "o" / ".partial").exists()
    before = (tmp_path / "o" / "train.bin").stat().st_mtime_ns
    prep.prepare(inputs, tmp_path / "o", settings, workers=1, say=said.append)
    assert said[-1].endswith("already prepared from these sources: nothing to do")
    assert (tmp_path / "o" / "train.bin").stat().st_mtime_ns == before
    with pytest.raises(UserError, match="other sources or settings"):
        prep.prepare(
            inputs, tmp_path / "o", prep.Settings(TOKENIZER, 0.2), workers=1, say=said.append
        )


def test_damaged_units_of_an_unfinished_run_are_tokenized_again(corpus, tmp_path, monkeypatch):
    """Units are written atomically, so one that does not read back was damaged since: before,
    a ValueError traceback at assembly; now it is tokenized again, like a missing one."""
    settings, inputs, said = prep.Settings(TOKENIZER, 0.1), [str(corpus / "text" / "*.txt")], []
    prep.prepare(inputs, tmp_path / "clean", settings, workers=1, say=lambda *a: None)
    interrupted_at(
        6,
        "_run_unit",
        monkeypatch,
        lambda: prep.prepare(inputs, tmp_path / "o", settings, workers=1, say=said.append),
    )
    units = tmp_path / "o" / ".partial" / "units"
    (units / "0.npy").write_bytes((units / "0.npy").read_bytes()[:100])  # cut short
    (units / "1.npy").write_bytes(b"garbage")
    (units / "2.docs").write_text("x")
    prep.prepare(inputs, tmp_path / "o", settings, workers=1, say=said.append)
    assert said == ["resuming: 2 of 24 units already tokenized"]
    np.testing.assert_array_equal(outputs(tmp_path / "o")[0], outputs(tmp_path / "clean")[0])
    interrupted_at(
        2,
        "_run_unit",
        monkeypatch,
        lambda: prep.prepare(inputs, tmp_path / "p", settings, workers=1, say=said.append),
    )
    (tmp_path / "p" / ".partial" / "plan.json").write_bytes(b"\xff\xfe")  # not even UTF-8
    with pytest.raises(UserError, match="or a damaged plan.json"):
        prep.prepare(inputs, tmp_path / "p", settings, workers=1, say=said.append)


def test_killed_mid_run_and_started_again(corpus, tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "megajax.prepare",
        str(corpus / "text" / "*.txt"),
        str(corpus / "docs.jsonl"),
        "--tokenizer",
        TOKENIZER,
        "--text-field",
        "body",
        "--out",
        str(tmp_path / "o"),
        "--workers",
        "2",
    ]
    p = subprocess.Popen(
        cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True
    )
    units = tmp_path / "o" / ".partial" / "units"
    deadline = time.time() + 120
    while p.poll() is None and time.time() < deadline and not list(units.glob("*.npy")):
        time.sleep(0.01)
    os.killpg(p.pid, signal.SIGKILL)
    p.wait()
    again = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr
    prep.prepare(
        cmd[3:5],
        tmp_path / "clean",
        prep.Settings(TOKENIZER, 0.01, "body"),
        workers=1,
        say=lambda *a: None,
    )
    np.testing.assert_array_equal(outputs(tmp_path / "o")[0], outputs(tmp_path / "clean")[0])


@pytest.mark.full
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_ctrl_c_or_sigterm_stops_with_one_line(corpus, tmp_path, sig):
    """Ctrl-C reaches every process of the group, SIGTERM (a scheduler) the main one: either way
    one line, exit 128 + the signal, no worker traceback, and the finished units kept."""
    big = tmp_path / "big"
    big.mkdir()
    text = "".join(f.read_text() for f in sorted((corpus / "text").glob("*.txt")))
    for i in range(12):
        (big / f"{i:02d}.txt").write_text(text)
    cmd = [
        sys.executable,
        "-m",
        "megajax.prepare",
        str(big / "*.txt"),
        "--tokenizer",
        TOKENIZER,
        "--out",
        str(tmp_path / "o"),
        "--workers",
        "2",
    ]
    p = subprocess.Popen(
        cmd,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    units = tmp_path / "o" / ".partial" / "units"
    while p.poll() is None and not list(units.glob("*.npy")):
        time.sleep(0.01)
    if sig == signal.SIGINT:
        os.killpg(p.pid, sig)
    else:
        p.send_signal(sig)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 128 + sig, err
    assert (
        err.startswith(f"stopped by {signal.Signals(sig).name}: the finished units are kept")
        and err.count("\n") == 1
    ), err
    assert list(units.glob("*.npy")) and not (tmp_path / "o" / "meta.json").exists()


def test_train_reads_and_checks_a_prepared_corpus(corpus, tmp_path):
    out = tmp_path / "o"
    prep.prepare(
        [str(corpus / "text" / "*.txt")],
        out,
        prep.Settings(TOKENIZER, 0.1),
        workers=1,
        say=lambda *a: None,
    )
    cfg = load_config("tiny", [f"data.source=bin:{out}"])
    data = task_for(cfg).load_data(cfg)
    tokens, meta = outputs(out)
    assert data.tokenizer.vocab_size == data.vocab_size == 220 and data.prepared
    np.testing.assert_array_equal(np.concatenate([data.train, data.val]), tokens)
    assert len(data.val) == meta["splits"]["val"]["tokens"]
    with pytest.raises(UserError, match="another tokenizer"):
        task_for(cfg).load_data(cfg, make_tokenizer("bytes"))
    with open(out / "val.bin", "r+b") as f:  # a damaged split is refused, not read short
        f.truncate(10)
    with pytest.raises(UserError, match="damaged or incomplete"):
        task_for(cfg).load_data(cfg)


@pytest.fixture(scope="module")
def prepared(corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("prepared") / "o"
    prep.prepare(
        [str(corpus / "text" / "*.txt")],
        out,
        prep.Settings(TOKENIZER, 0.1),
        workers=1,
        say=lambda *a: None,
    )
    return out


DAMAGED_META = {
    "splits": lambda m: m.pop("splits"),
    "splits.val": lambda m: m["splits"].pop("val"),
    "dtype": lambda m: m.update(dtype="float99"),
    "splits.train": lambda m: m["splits"]["train"].update(file="../elsewhere/train.bin"),
    "tokenizer": lambda m: m["tokenizer"].update(fingerprint="x"),
}


@pytest.mark.parametrize("field", DAMAGED_META)
def test_a_damaged_meta_json_is_one_line(prepared, tmp_path, field):
    """Before: KeyError or TypeError tracebacks, or a file outside the corpus read."""
    out = tmp_path / "o"
    shutil.copytree(prepared, out)
    meta = json.loads((out / "meta.json").read_text())
    DAMAGED_META[field](meta)
    (out / "meta.json").write_text(json.dumps(meta))
    cfg = load_config("tiny", [f"data.source=bin:{out}"])
    expected = "splits.train" if field == "splits" else field
    with pytest.raises(
        UserError, match=re.escape(f"meta.json is damaged (its '{expected}' is missing or invalid)")
    ):
        task_for(cfg).load_data(cfg)


def test_token_ids_outside_the_vocabulary_stop_the_run_in_one_line(prepared, tmp_path):
    """A train.bin of the right size with ids beyond its tokenizer's (a damaged disk, a file
    swapped for another tokenizer's): before, the model embedded them as zeros and trained on
    garbage without a word. Each window is checked as it is read from the memory map."""
    out = tmp_path / "o"
    shutil.copytree(prepared, out)
    cfg = load_config("tiny", [f"data.source=bin:{out}", "train.batch_size=8"])
    sharding = NamedSharding(mesh_for("1x1"), P("data", None))
    batches = task_for(cfg).load_data(cfg).batches("train", cfg, sharding)
    first = batches.starts(0)[3] + 5  # a token the first batch reads
    rows = batches.rows(0, slice(None))
    ids = np.memmap(out / "train.bin", dtype=np.uint16, mode="r+")
    ids[first] = 220  # the tokenizer has ids 0..219
    ids.flush()
    with pytest.raises(
        UserError,
        match=f"{re.escape(str(out))}: the train split holds token id 220 at token {first:,}",
    ):
        batches(0)
    ids[first] = rows[3, 5]
    ids.flush()
    np.testing.assert_array_equal(np.asarray(batches(0)), rows)


def test_user_errors_are_one_line(corpus, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\nnot json\n')
    latin = tmp_path / "latin.txt"
    latin.write_bytes("caf\xe9".encode("latin-1"))
    cases = [
        ([str(tmp_path / "nothing*.txt")], "no file matches"),
        ([str(bad)], "is not a JSON object"),
        ([str(latin)], "is not UTF-8 text"),
        ([str(corpus / "docs.jsonl"), "--text-field", "nope"], "'nope' field"),
        ([str(latin), "--tokenizer", "chars"], "--tokenizer chars is made from the corpus"),
        (
            [str(latin), "--tokenizer", "wordpiece:300"],
            "--tokenizer wordpiece:300 is made from the corpus",
        ),
        ([str(corpus / "docs.jsonl"), "--pairs", "--seq-len", "0"], "--seq-len must be at least 8"),
        ([str(corpus / "docs.jsonl"), "--pairs", "--seed", "-1"], "--seed must be in 0..2^31-1"),
        (
            [str(corpus / "docs.jsonl"), "--seq-len", "128"],
            "--seq-len and --seed shape BERT sentence pairs: add --pairs",
        ),
        ([str(corpus / "docs.jsonl"), "--workers", "0"], "--workers must be at least 1"),
    ]
    for argv, message in cases:
        assert (
            prepare_main(
                [*argv, "--out", str(tmp_path / "o")]
                + (["--workers", "1"] if "--workers" not in argv else [])
            )
            == 2
        )
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1 and err.startswith("error: "), err
        assert not (tmp_path / "o").exists()  # nothing left behind
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    assert prepare_main([str(corpus / "docs.jsonl"), "--out", str(tmp_path / "full")]) == 2
    assert (
        "not empty" in capsys.readouterr().err
        and (tmp_path / "full" / "keep.txt").read_text() == "mine"
    )


# --- BERT sentence pairs on disk -------------------------------------------------------------
VOCAB = ROOT / "tests/fixtures/hf/bert/vocab.txt"


def test_pairs_on_disk_give_the_in_memory_batches(corpus, tmp_path, monkeypatch):
    """The same files, in memory (text:) and prepared (pairs:): the same pairs, hence the same
    batches, step for step; prepared in units out of a pool, resumed after an interruption."""
    monkeypatch.setattr(prep.pairs, "UNIT_SENTENCES", 500)
    files = sorted(str(f) for f in (corpus / "text").glob("*.txt"))
    settings = prep.Settings(f"wordpiece:{VOCAB}", 0.1, pairs_seq_len=64, seed=3)
    interrupted_at(
        3,
        "_run_pairs_unit",
        monkeypatch,
        lambda: prep.prepare(files, tmp_path / "p", settings, workers=1, say=lambda *a: None),
    )
    said = []
    meta = prep.prepare(files, tmp_path / "p", settings, workers=2, say=said.append)
    assert said == ["resuming: 2 units already tokenized"]
    common = ["model.seq_len=64", "train.seed=3", "data.val_fraction=0.1", "train.batch_size=8"]
    disk = load_config("bert_tiny", [*common, f"data.source=pairs:{tmp_path / 'p'}"])
    memory = load_config(
        "bert_tiny",
        [*common, f"data.source=text:{','.join(files)}", f"data.tokenizer=wordpiece:{VOCAB}"],
    )
    a, b = task_for(disk).load_data(disk), task_for(memory).load_data(memory)
    assert (
        len(a.train_pairs) == len(b.train_pairs) > 1000
        and len(a.val_pairs) == len(b.val_pairs) == meta["val_pairs"]
    )
    assert a.describe() == b.describe()
    for split in ("train", "val"):
        batches_a, batches_b = (d.batches(split, disk, None) for d in (a, b))
        for step in range(3):
            rows_a, rows_b = batches_a.rows(step, slice(0, 8)), batches_b.rows(step, slice(0, 8))
            for k in rows_b:
                np.testing.assert_array_equal(
                    rows_a[k], rows_b[k], err_msg=f"{split} step {step} {k}"
                )
    with pytest.raises(UserError, match="pairs for model.seq_len = 64, not 128"):
        task_for(disk).load_data(
            load_config("bert_tiny", [f"data.source=pairs:{tmp_path / 'p'}", "model.seq_len=128"])
        )
    gpt = load_config("tiny", [f"data.source=bin:{tmp_path / 'p'}"])
    with pytest.raises(UserError, match="it holds BERT sentence pairs"):
        task_for(gpt).load_data(gpt)
    # eval.py --task mlm --data pairs:DIR scores the held-out pairs, the text's own last pairs.
    cfg = dataclasses.replace(
        disk, model=dataclasses.replace(disk.model, vocab_size=a.tokenizer.vocab_size)
    )
    model = init_model(cfg.model, mesh_for("1x1"), seed=0)
    args = argparse.Namespace(data=f"pairs:{tmp_path / 'p'}", batch_size=8)
    got = eval_tasks.mlm(args, Loaded(cfg, model, a.tokenizer, 0), None)[0]
    want = evaluate_pretraining(model, b.val_pairs, cfg, b.specials, b.tokenizer, 8)
    assert got.pop("split") == "val" and got == want and want["pairs"] == meta["val_pairs"]
    index = np.memmap(tmp_path / "p" / "pairs_index.bin", dtype=np.int64, mode="r+").reshape(-1, 3)
    index[1, 0] = meta["tokens"]  # pair 1 starts past the end of pairs.bin
    tokens = np.memmap(tmp_path / "p" / "pairs.bin", dtype=meta["dtype"], mode="r+")
    tokens[index[2, 0] + 1] = a.tokenizer.vocab_size  # pair 2 holds an id beyond the vocabulary
    with pytest.raises(
        UserError, match="pairs_index.bin is damaged: pair 1 lies outside pairs.bin"
    ):
        a.train_pairs[1]
    with pytest.raises(
        UserError,
        match=f"pairs.bin holds token id {a.tokenizer.vocab_size} at token {index[2, 0] + 1:,}",
    ):
        a.train_pairs[2]


RSS_PROBE = """
import resource, sys
from megajax.config import load_config
from megajax.tasks import task_for
cfg = load_config("bert_tiny", sys.argv[1:])
data = task_for(cfg).load_data(cfg)
train, val = data.batches("train", cfg, None), data.batches("val", cfg, None)
train.rows(0, slice(0, cfg.train.batch_size)), val.rows(0, slice(0, cfg.train.batch_size))
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, len(data.train_pairs))
"""


def startup_rss(*settings) -> tuple[int, int]:
    """Peak RSS (KiB) of a fresh process that loads BERT's data and builds its first batches."""
    p = subprocess.run(
        [sys.executable, "-c", RSS_PROBE, *settings],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=600,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert p.returncode == 0, p.stderr[-2000:]
    rss, pairs = p.stdout.split()
    return int(rss), int(pairs)


def tile_pairs(src: Path, dest: Path, times: int):
    """`times` copies of a prepared pairs directory's pairs, one after another, as one directory."""
    meta = json.loads((src / "meta.json").read_text())
    dest.mkdir()
    tokens = np.fromfile(src / "pairs.bin", meta["dtype"])
    index = np.fromfile(src / "pairs_index.bin", np.int64).reshape(-1, 3)
    with open(dest / "pairs.bin", "wb") as t, open(dest / "pairs_index.bin", "wb") as i:
        for c in range(times):
            t.write(tokens.tobytes())
            i.write((index + np.asarray([c * len(tokens), 0, 0])).tobytes())
    for f in src.iterdir():
        if f.name not in ("pairs.bin", "pairs_index.bin", "meta.json"):
            (dest / f.name).write_bytes(f.read_bytes())
    n = meta["pairs"] * times
    meta.update(
        pairs=n, tokens=meta["tokens"] * times, val_pairs=int(n * meta["settings"]["val_fraction"])
    )
    (dest / "meta.json").write_text(json.dumps(meta))


@pytest.mark.full
def test_startup_memory_does_not_grow_with_a_prepared_corpus(corpus, tmp_path):
    """The built-in corpus (12 MB of the standard library) read into memory, against a prepared
    pairs corpus ten times its size (the test corpus prepared, its pairs written over and over
    until there are ten times the built-in corpus's): start-up's peak RSS must stay within 10%
    of the in-memory one's."""
    memory_rss, memory_pairs = startup_rss(
        "data.source=builtin", f"data.tokenizer=wordpiece:{VOCAB}"
    )
    files = sorted(str(f) for f in (corpus / "text").glob("*.txt"))
    meta = prep.prepare(
        files,
        tmp_path / "one",
        prep.Settings(f"wordpiece:{VOCAB}", 0.1, pairs_seq_len=64),
        workers=1,
        say=lambda *a: None,
    )
    # pairs per copy that are training pairs
    train_share = meta["pairs"] - meta["val_pairs"]
    tile_pairs(tmp_path / "one", tmp_path / "ten", -(-10 * memory_pairs // train_share) + 1)
    disk_rss, disk_pairs = startup_rss(f"data.source=pairs:{tmp_path / 'ten'}")
    assert disk_pairs >= 10 * memory_pairs
    assert disk_rss <= 1.1 * memory_rss, (disk_rss, memory_rss)


def test_the_tool_does_not_import_jax():
    """Its pool forks (cheapest) only because nothing it imports starts JAX's threads."""
    code = "import sys, megajax.prepare; print('jax' in sys.modules)"
    assert (
        subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True
        ).stdout.strip()
        == "False"
    )


def test_a_file_system_that_refuses_a_write_is_one_line_and_the_same_command_continues(
    corpus, tmp_path
):
    """A unit's tokens that no file may hold (64 KiB at most here: what a full disk or a quota
    does): one line naming the file, exit 2, no partial unit; once the limit is gone the same
    command finishes. Before: numpy's OSError without an errno ("N requested and M written"),
    a traceback, and the half-written unit left taking the space."""
    big = tmp_path / "big"
    big.mkdir()
    (big / "doc.txt").write_text(
        "".join(f.read_text() for f in sorted((corpus / "text").glob("*.txt"))) * 2
    )
    args = [
        "-m",
        "megajax.prepare",
        str(big / "doc.txt"),
        "--tokenizer",
        "bytes",
        "--out",
        str(tmp_path / "o"),
        "--workers",
        "1",
    ]
    p = subprocess.run(
        file_size_limited(*args), cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert (
        p.returncode == 2
        and p.stderr.startswith("error: File too large: ")
        and p.stderr.count("\n") == 1
    ), p.stderr
    assert ".partial/units/" in p.stderr and not list(
        (tmp_path / "o" / ".partial" / "units").glob("*.npy*")
    )
    again = subprocess.run(
        [sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert again.returncode == 0, again.stderr
    prep.prepare(
        [str(big / "doc.txt")],
        tmp_path / "clean",
        prep.Settings("bytes", 0.01, "text"),
        workers=1,
        say=lambda *a: None,
    )
    np.testing.assert_array_equal(outputs(tmp_path / "o")[0], outputs(tmp_path / "clean")[0])


def test_a_split_no_file_may_hold_names_its_file(tmp_path):
    """Units small enough to write, a train split too large for the file size limit (`ulimit -f`):
    one line naming the split's file. Before: "File too large" and no file."""
    src = tmp_path / "src"
    src.mkdir()
    text = (ROOT / "data" / "tinyshakespeare.txt").read_text(encoding="utf-8")
    for i in range(8):  # 20,000 bytes a unit: 40 KB of uint16 ids each, 320 KB together
        (src / f"{i}.txt").write_text(text[i * 20_000 : (i + 1) * 20_000], encoding="utf-8")
    args = [
        "-m",
        "megajax.prepare",
        str(src / "*.txt"),
        "--tokenizer",
        "bytes",
        "--out",
        str(tmp_path / "o"),
        "--workers",
        "1",
    ]
    p = subprocess.run(
        file_size_limited(*args), cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert p.returncode == 2 and p.stderr.count("\n") == 1, p.stderr
    assert p.stderr.startswith(
        f"error: File too large: {tmp_path / 'o' / '.partial' / 'train.bin'}"
    ), p.stderr


def test_a_corpus_of_one_document_says_where_it_is_cut(tmp_path, capsys):
    """No document ends near the held-out fraction: the cut is inside the one document, and the
    line says so (before: "train ... (0 documents)", as if nothing trained)."""
    doc = tmp_path / "play.txt"
    doc.write_text(
        (ROOT / "data" / "tinyshakespeare.txt").read_text(encoding="utf-8")[:50_000],
        encoding="utf-8",
    )
    assert (
        prepare_main(
            [
                str(doc),
                "--tokenizer",
                "bytes",
                "--val-fraction",
                "0.1",
                "--out",
                str(tmp_path / "o"),
                "--workers",
                "1",
            ]
        )
        == 0
    )
    # 50,000 bytes and the blank-line separator; int(10% of 50,002) held out
    out = capsys.readouterr().out
    assert (
        "train 45,002 tokens (0 whole documents and the start of one more), validation 5,000 "
        "tokens (the rest of that document: no document ends near the held-out fraction, so the "
        "cut is inside one)"
    ) in out, out
    meta = json.loads((tmp_path / "o" / "meta.json").read_text())
    assert meta["splits"]["val"]["starts_inside_a_document"] is True
    assert (
        prepare_main(
            [
                str(doc),
                str(corpus_file(tmp_path)),
                "--tokenizer",
                "bytes",
                "--out",
                str(tmp_path / "two"),
                "--workers",
                "1",
            ]
        )
        == 0
    )
    # a document ends near: whole documents held out
    assert "(1 documents)" in capsys.readouterr().out


def corpus_file(tmp_path) -> Path:
    small = tmp_path / "small.txt"
    small.write_text("A short last document.\n" * 20, encoding="utf-8")
    return small


def test_a_killed_prepares_workers_do_not_keep_its_directory_locked(tmp_path):
    """SIGKILL reaches the main process alone; its pool workers (forked: they share the lock's
    open file) went on tokenizing for a while, and a rerun was told that another prepare was
    writing. The lock is released with the main process now. A directory a training run holds
    is named as such, not as another prepare."""
    big = tmp_path / "big"
    big.mkdir()
    text = (ROOT / "data" / "tinyshakespeare.txt").read_text(encoding="utf-8")
    for i in range(6):
        (big / f"{i:02d}.txt").write_text(text * 4, encoding="utf-8")
    out = tmp_path / "o"
    p = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "megajax.prepare",
            str(big / "*.txt"),
            "--tokenizer",
            TOKENIZER,
            "--out",
            str(out),
            "--workers",
            "2",
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        deadline = time.time() + 120
        while (
            p.poll() is None
            and time.time() < deadline
            and not (out / ".partial" / "plan.json").exists()
        ):
            time.sleep(0.01)
        time.sleep(1.0)  # the workers are tokenizing their first units
        p.kill()
        p.wait()
        with WorkdirLock(out, what="the corpus directory"):
            pass
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
    with WorkdirLock(out, what="the corpus directory"):
        with pytest.raises(
            UserError,
            match="another megajax process holds .* \\(a megajax-prepare writing it, or a run",
        ):
            prep.prepare(
                [str(big / "00.txt")], out, prep.Settings("bytes"), workers=1, say=lambda *a: None
            )
