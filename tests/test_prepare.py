"""megajax-prepare (megajax/prepare/): the tokens it writes against the tokenizer run by hand,
one process against a pool, an interrupted run resumed, and train.py reading the result."""
import json
import os
import signal
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import ROOT

import megajax.prepare as prep
from megajax.cli.prepare import prepare_main
from megajax.config import load_config
from megajax.data.prepared import tokenizer_fingerprint
from megajax.data.tokenizer import load_tokenizer, make_tokenizer
from megajax.errors import UserError
from megajax.prepare import units as U
from megajax.tasks import task_for

TOKENIZER = f"hf:{ROOT / 'tests/fixtures/hf/megatron_bert/tokenizer.json'}"   # a real WordPiece, 220 ids


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Real text, offline: 24 modules of the standard library as documents, and a jsonl of 200."""
    root = tmp_path_factory.mktemp("corpus")
    stdlib = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:24]
    for i, path in enumerate(stdlib):
        (root / "text").mkdir(exist_ok=True)
        (root / "text" / f"{i:02d}_{path.stem}.txt").write_text(path.read_text(encoding="utf-8"), encoding="utf-8")
    lines = [json.dumps({"id": i, "body": f"Record {i}: " + stdlib[i % 24].read_text()[:300]}) for i in range(200)]
    (root / "docs.jsonl").write_text("\n".join(lines) + "\n")
    return root


def outputs(out: Path) -> tuple[np.ndarray, dict]:
    meta = json.loads((out / "meta.json").read_text())
    dtype = np.dtype(meta["dtype"])
    return np.concatenate([np.fromfile(out / meta["splits"][s]["file"], dtype) for s in ("train", "val")]), meta


def test_tokens_are_each_document_then_its_end_token(corpus, tmp_path):
    meta = prep.prepare([str(corpus / "text" / "*.txt")], tmp_path / "o", prep.Settings(TOKENIZER, 0.1), workers=1,
                        say=lambda *a: None)
    got, _ = outputs(tmp_path / "o")
    tok = make_tokenizer(TOKENIZER)
    sep = tok.token_id("[SEP]")
    want = [i for f in sorted((corpus / "text").glob("*.txt")) for i in [*tok.encode(f.read_text()), sep]]
    np.testing.assert_array_equal(got, want)
    assert meta["dtype"] == "uint16" and meta["separator"] == [sep]
    t, v = meta["splits"]["train"], meta["splits"]["val"]
    assert t["documents"] + v["documents"] == 24 and t["tokens"] + v["tokens"] == len(want)
    assert 0.05 <= v["tokens"] / len(want) <= 0.2 and v["documents"] >= 1 and want[t["tokens"] - 1] == sep   # whole documents, ~10%
    assert tokenizer_fingerprint(load_tokenizer(tmp_path / "o")) == tokenizer_fingerprint(tok)
    assert all(len(s["sha256"]) == 64 and s["bytes"] > 0 for s in meta["plan"])


def test_jsonl_documents_by_field(corpus, tmp_path):
    prep.prepare([str(corpus / "docs.jsonl")], tmp_path / "o", prep.Settings("bytes", 0.05, "body"), workers=1,
                 say=lambda *a: None)
    got, meta = outputs(tmp_path / "o")
    records = [json.loads(line)["body"] for line in (corpus / "docs.jsonl").read_text().splitlines()]
    # bytes has no end-of-document token: a blank line separates the documents
    assert got.tobytes()[::2] == b"".join(r.encode() + b"\n\n" for r in records)
    assert meta["splits"]["train"]["documents"] + meta["splits"]["val"]["documents"] == 200


def test_a_pool_writes_what_one_process_writes(corpus, tmp_path, monkeypatch):
    monkeypatch.setattr(U, "UNIT_BYTES", 20_000)    # big files cut into many units, tokenized out of order
    settings = prep.Settings(TOKENIZER, 0.2, "body")
    inputs = [str(corpus / "text" / "*.txt"), str(corpus / "docs.jsonl")]
    one = prep.prepare(inputs, tmp_path / "one", settings, workers=1, say=lambda *a: None)
    two = prep.prepare(inputs, tmp_path / "two", settings, workers=2, say=lambda *a: None)
    assert len(U.plan_units(one["plan"])) > 30
    np.testing.assert_array_equal(outputs(tmp_path / "one")[0], outputs(tmp_path / "two")[0])
    assert one["splits"] == two["splits"]


def test_an_interrupted_run_resumes_and_a_finished_one_is_kept(corpus, tmp_path, monkeypatch):
    settings, inputs, said = prep.Settings(TOKENIZER, 0.1), [str(corpus / "text" / "*.txt")], []
    prep.prepare(inputs, tmp_path / "clean", settings, workers=1, say=lambda *a: None)
    real, calls = prep._run_unit, []

    def dies_on_the_fifth(job):
        calls.append(job[0])
        if len(calls) == 5:
            raise KeyboardInterrupt
        return real(job)

    monkeypatch.setattr(prep, "_run_unit", dies_on_the_fifth)
    with pytest.raises(KeyboardInterrupt):
        prep.prepare(inputs, tmp_path / "o", settings, workers=1, say=said.append)
    assert not (tmp_path / "o" / "meta.json").exists() and len(list((tmp_path / "o" / ".partial" / "units").glob("*.npy"))) == 4
    monkeypatch.setattr(prep, "_run_unit", real)
    prep.prepare(inputs, tmp_path / "o", settings, workers=2, say=said.append)
    assert said == ["resuming: 4 of 24 units already tokenized"]
    np.testing.assert_array_equal(outputs(tmp_path / "o")[0], outputs(tmp_path / "clean")[0])
    assert not (tmp_path / "o" / ".partial").exists()
    before = (tmp_path / "o" / "train.bin").stat().st_mtime_ns
    prep.prepare(inputs, tmp_path / "o", settings, workers=1, say=said.append)
    assert said[-1].endswith("already prepared from these sources: nothing to do")
    assert (tmp_path / "o" / "train.bin").stat().st_mtime_ns == before
    with pytest.raises(UserError, match="other sources or settings"):
        prep.prepare(inputs, tmp_path / "o", prep.Settings(TOKENIZER, 0.2), workers=1, say=said.append)


def test_killed_mid_run_and_started_again(corpus, tmp_path):
    cmd = [sys.executable, "-m", "megajax.prepare", str(corpus / "text" / "*.txt"), str(corpus / "docs.jsonl"),
           "--tokenizer", TOKENIZER, "--text-field", "body", "--out", str(tmp_path / "o"), "--workers", "2"]
    p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    units = tmp_path / "o" / ".partial" / "units"
    deadline = time.time() + 120
    while p.poll() is None and time.time() < deadline and not list(units.glob("*.npy")):
        time.sleep(0.01)
    os.killpg(p.pid, signal.SIGKILL)
    p.wait()
    again = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr
    prep.prepare(cmd[3:5], tmp_path / "clean", prep.Settings(TOKENIZER, 0.01, "body"), workers=1, say=lambda *a: None)
    np.testing.assert_array_equal(outputs(tmp_path / "o")[0], outputs(tmp_path / "clean")[0])


def test_train_reads_and_checks_a_prepared_corpus(corpus, tmp_path):
    out = tmp_path / "o"
    prep.prepare([str(corpus / "text" / "*.txt")], out, prep.Settings(TOKENIZER, 0.1), workers=1, say=lambda *a: None)
    cfg = load_config("tiny", [f"data.source=bin:{out}"])
    data = task_for(cfg).load_data(cfg)
    tokens, meta = outputs(out)
    assert data.tokenizer.vocab_size == data.vocab_size == 220 and data.prepared
    np.testing.assert_array_equal(np.concatenate([data.train, data.val]), tokens)
    assert len(data.val) == meta["splits"]["val"]["tokens"]
    with pytest.raises(UserError, match="another tokenizer"):
        task_for(cfg).load_data(cfg, make_tokenizer("bytes"))
    with open(out / "val.bin", "r+b") as f:      # a damaged split is refused, not read short
        f.truncate(10)
    with pytest.raises(UserError, match="damaged or incomplete"):
        task_for(cfg).load_data(cfg)


def test_user_errors_are_one_line(corpus, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\nnot json\n')
    latin = tmp_path / "latin.txt"
    latin.write_bytes("caf\xe9".encode("latin-1"))
    cases = [([str(tmp_path / "nothing*.txt")], "no file matches"), ([str(bad)], "is not a JSON object"),
             ([str(latin)], "is not UTF-8 text"), ([str(corpus / "docs.jsonl"), "--text-field", "nope"], "'nope' field"),
             ([str(latin), "--tokenizer", "chars"], "needs the training text")]
    for argv, message in cases:
        assert prepare_main([*argv, "--out", str(tmp_path / "o"), "--workers", "1"]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1 and err.startswith("error: "), err
        assert not (tmp_path / "o").exists()                # nothing left behind
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    assert prepare_main([str(corpus / "docs.jsonl"), "--out", str(tmp_path / "full")]) == 2
    assert "not empty" in capsys.readouterr().err and (tmp_path / "full" / "keep.txt").read_text() == "mine"
