"""megajax-prepare's pool of worker processes (megajax/prepare/pool.py), for every kind of
corpus: several units over two workers, killed mid-run and started again, write byte for byte
what one process writes; a worker that cannot start ends the run with its error, at once."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT
from helpers import SHAKESPEARE

import megajax.prepare.chat as chat
from megajax.errors import UserError
from megajax.prepare import pairs, units
from megajax.prepare.pool import WorkerPool

CHAT = ROOT / "tests" / "fixtures" / "chat"
WORDPIECE = ROOT / "tests" / "fixtures" / "hf" / "bert" / "vocab.txt"
UNIT_BYTES, UNIT_SENTENCES = 400, 100

# The child process: megajax-prepare with small units, each slowed down when SLOW is given, so
# that a kill lands while units remain.
CHILD = f"""
import sys, time
import megajax.prepare.units as units, megajax.prepare.pairs as pairs
import megajax.prepare.corpus as corpus, megajax.prepare.chat as chat
units.UNIT_BYTES, pairs.UNIT_SENTENCES = {UNIT_BYTES}, {UNIT_SENTENCES}
if sys.argv[1] == "slow":
    for module, name in ((corpus, "_run_unit"), (corpus, "_run_pairs_unit"), (chat, "_run_unit")):
        def slow(job, real=getattr(module, name)):
            time.sleep(0.3)
            return real(job)
        # pickled by name for the workers (forked: they have this module state)
        slow.__module__, slow.__qualname__ = module.__name__, name
        setattr(module, name, slow)
from megajax.cli.prepare import prepare_main
sys.exit(prepare_main(sys.argv[2:]))
"""


def kinds(tmp_path: Path) -> dict:
    text = tmp_path / "text.txt"
    text.write_text(SHAKESPEARE.read_text(encoding="utf-8")[:40_000], encoding="utf-8")
    return {
        "text": [str(text), "--tokenizer", f"wordpiece:{WORDPIECE}"],
        "chat": [
            str(CHAT / "conversations.jsonl"),
            "--chat",
            "--tokenizer",
            f"hf:{CHAT / 'llama3' / 'tokenizer.json'}",
            "--val-fraction",
            "0.2",
        ],
        "pairs": [
            str(text),
            "--pairs",
            "--seq-len",
            "64",
            "--tokenizer",
            f"wordpiece:{WORDPIECE}",
            "--val-fraction",
            "0.1",
        ],
    }


def files(out: Path) -> dict[str, bytes]:
    """Every file of a finished directory but meta.json's timing."""
    import json

    found = {
        str(p.relative_to(out)): p.read_bytes()
        for p in sorted(out.rglob("*"))
        if p.is_file() and p.name != "meta.json"
    }
    meta = json.loads((out / "meta.json").read_text())
    meta.pop("seconds", None)
    found["meta.json"] = json.dumps(meta, sort_keys=True).encode()
    return found


@pytest.mark.parametrize("kind", ["text", "chat", "pairs"])
def test_two_workers_killed_and_started_again_write_what_one_process_writes(
    kind, tmp_path, monkeypatch
):
    args = kinds(tmp_path)[kind]
    out = tmp_path / "pool"
    cmd = [sys.executable, "-c", CHILD]
    argv = [*args, "--out", str(out), "--workers", "2"]
    p = subprocess.Popen(
        [*cmd, "slow", *argv],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    done = out / ".partial" / "units"
    deadline = time.time() + 120
    while (
        p.poll() is None
        and time.time() < deadline
        and len([f for f in done.glob("*.np*") if not f.name.startswith(".")]) < 2
    ):  # finished units
        time.sleep(0.01)
    os.killpg(p.pid, signal.SIGKILL)
    p.wait()
    assert not (out / "meta.json").exists(), "the kill came after the last unit"
    assert p.returncode == -signal.SIGKILL, p.stderr.read().decode()[-3000:]
    left = sorted(p.name for p in done.iterdir())
    again = subprocess.run(
        [*cmd, "fast", *argv], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert again.returncode == 0, again.stderr
    assert "resuming: " in again.stdout + again.stderr, left
    # the same units, in this process, one at a time
    monkeypatch.setattr(units, "UNIT_BYTES", UNIT_BYTES)
    monkeypatch.setattr(pairs, "UNIT_SENTENCES", UNIT_SENTENCES)
    from megajax.cli.prepare import prepare_main

    assert prepare_main([*args, "--out", str(tmp_path / "one"), "--workers", "1"]) == 0
    assert files(out) == files(tmp_path / "one")


def test_a_worker_that_cannot_start_ends_the_run_with_its_error(tmp_path):
    """Its initializer raises (here: the tokenizer it loads is missing): every task it is given
    raises that error, and the run ends with it in one line, instead of the pool starting the
    worker again for ever."""
    jobs = [(i, {}, 0, str(tmp_path)) for i in range(4)]
    start = time.time()
    with pytest.raises(UserError, match="a tokenizing process could not start: .*tokenizer"):
        with WorkerPool(
            2, chat._init_worker, (str(tmp_path / "missing"), "assistant", "int32")
        ) as pool:
            list(pool.imap_unordered(chat._run_unit, jobs))
    assert time.time() - start < 60


def test_a_worker_killed_mid_task_ends_the_run_in_one_line(tmp_path):
    """A worker that dies (the kernel's out-of-memory killer) breaks the pool: one line saying
    what to do, not a wait for a result that never comes."""
    with pytest.raises(UserError, match="ended without its result .* run the same command"):
        with WorkerPool(2, os.getpid, ()) as pool:
            list(pool.imap_unordered(os._exit, [9, 9]))
