"""What a run leaves and says when it fails: a save that cannot finish, a kill before the run
wrote its config, weights that diverge, a result that is not a number, a workdir eval.py cannot
write to, inputs that open with a byte-order mark, weights that are NaN on import. Each test
failed on megajax before its fix (the adversarial sweep's cases)."""

import json
import math
import os
import re
import subprocess
import sys
import threading

import numpy as np
import pytest
from conftest import ROOT
from helpers import BASE, cli, env, losses, run
from safetensors.numpy import load_file, save_file

from megajax.convert import import_hf
from megajax.data.tokenizer import make_tokenizer
from megajax.errors import UserError
from megajax.evaluation.lambada import lambada_examples
from megajax.runs.checkpoint import Checkpoints
from megajax.runs.workdir import check_layout

# orbax's failure under an address-space limit: the save's first thread starts and waits for one
# that could not start. train.py reports the failed save in one line; the waiting thread (not a
# daemon) then held the interpreter's shutdown forever.
STUCK_SAVE = """
import runpy, sys, threading
from megajax.runs import checkpoint

def save(self, step, *args, **kwargs):
    threading.Thread(target=threading.Event().wait, name="a writer waiting for another").start()
    return step, "RuntimeError: can't start new thread"

checkpoint.Checkpoints.save = save
sys.argv = ["train.py", *sys.argv[1:]]
runpy.run_path("train.py", run_name="__main__")
"""


@pytest.mark.full
def test_a_save_that_cannot_finish_ends_the_process_with_its_line(tmp_path):
    # (the patch lives in this process)
    e = {**env(), "MEGAJAX_EXIT_GRACE_S": "3", "MEGAJAX_MALLOC_TUNING": "0"}
    p = subprocess.run(
        [
            sys.executable,
            "-c",
            STUCK_SAVE,
            *BASE,
            "--mesh",
            "2x4",
            "--steps",
            "2",
            "--workdir",
            str(tmp_path / "w"),
        ],
        capture_output=True,
        text=True,
        env=e,
        cwd=ROOT,
        timeout=200,
    )
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2, p.stderr[-2000:]
    assert lines[-2].startswith(
        "error: saving step 2 failed (RuntimeError: can't start new thread)"
    ), lines
    assert lines[-1] == (
        "warning: background threads did not end within 3 s of the program's end (a checkpoint "
        "writer that cannot finish); leaving with status 2"
    )


@pytest.mark.full
def test_what_a_killed_start_leaves_is_megajaxs_own(tmp_path):
    """Killed after the checkpoint manager opened and before config.json was written, a run left
    an empty checkpoints/ (or a first save's temporary directory), and the workdir was refused
    from then on as another program's."""
    empty, half = tmp_path / "empty", tmp_path / "half"
    Checkpoints(empty).close()  # what the kill left: the manager's directory
    (half / "checkpoints" / "0.orbax-checkpoint-tmp-1733").mkdir(parents=True)
    for workdir in (empty, half):
        check_layout(workdir)
    foreign = tmp_path / "foreign"
    (foreign / "checkpoints").mkdir(parents=True)
    (foreign / "checkpoints" / "model.bin").write_bytes(b"")
    with pytest.raises(
        UserError, match="is not a megajax workdir: it holds another program's files"
    ):
        check_layout(foreign)
    p = run(*BASE, "--mesh", "1x8", "--steps", "2", "--workdir", str(half))
    assert "done: 2 steps" in p.stdout and (half / "checkpoints" / "2").is_dir()


def test_a_loss_spike_past_chance_is_a_divergence_and_good_means_before_it(tmp_path):
    """lr 1e6: the loss leaves ln V for ~1e15 within a step or two, steps before any NaN. That
    step is the divergence (train.spike_factor): the checkpoint its loss came from moves to
    diverged/, the line names the newest one saved before it, and the same command, resumed
    there, diverges again instead of training on (before: the "last good" checkpoint had a loss
    of 3.5e15, and a rerun trained from it to "done" at 4e15, exit 0)."""
    wd = tmp_path / "w"
    args = (
        *BASE,
        "--mesh",
        "2x4",
        "--steps",
        "10",
        "--save-every",
        "1",
        "--set",
        "train.lr=1e6",
        "--workdir",
        str(wd),
    )
    p = run(*args, check=False)
    line = p.stderr.strip()
    assert p.returncode == 2 and "\n" not in line, p.stderr[-2000:]
    bad = int(line.split(" at step ")[1].split(";")[0])
    found = re.match(
        r"error: loss (\S+), over train.spike_factor 10 x the median (\S+) of the "
        r"(\d+) step\(s\) before and over a uniform guess's (\S+): diverged at step",
        line,
    )
    assert found, line
    before = [losses(wd)[s] for s in range(1, bad)]
    assert int(found[3]) == len(before) == bad - 1
    assert float(found[2]) == pytest.approx(float(np.median(before)), rel=1e-3)
    assert float(found[4]) == pytest.approx(math.log(65), rel=1e-3)  # the 65 characters
    assert float(found[1]) > 10 * float(found[2]) and float(found[1]) > math.log(65)
    assert max(before) < 10 * float(np.median(before))
    kept = sorted(int(d.name) for d in (wd / "checkpoints").iterdir() if d.name.isdigit())
    assert kept == list(range(1, bad - 1)) and (wd / "diverged" / str(bad - 1)).is_dir()
    assert line.endswith(
        f"last good checkpoint: step {bad - 2} in {wd / 'checkpoints'}"
        if kept
        else "no checkpoint from before the divergence is left"
    )
    again = run(*args, check=False)
    assert again.returncode == 2 and "diverged at step" in again.stderr, again.stderr[-2000:]
    assert "done:" not in again.stdout


def test_diverged_weights_are_set_aside_and_the_last_good_checkpoint_named(tmp_path):
    """lr 1e6 with train.spike_factor 0 (only a non-finite loss stops the run): steps 3 and 4
    log finite losses, step 5's is NaN. The loss at step 5 was computed from the weights saved
    as step 4, so checkpoint 4 is not good: it moves to diverged/, and the line names step 3
    (before: "last good checkpoint: step 4", and a resume failed again at once). eval.py on what
    is left reports no perplexity of inf with exit 0 (before: it did, or crashed with an
    OverflowError)."""
    wd = tmp_path / "w"
    p = run(
        *BASE,
        "--mesh",
        "2x4",
        "--steps",
        "10",
        "--save-every",
        "1",
        "--set",
        "train.lr=1e6",
        "--set",
        "train.spike_factor=0",
        "--workdir",
        str(wd),
        check=False,
    )
    logged = [json.loads(x) for x in (wd / "metrics.jsonl").read_text().splitlines()]
    bad = next(s for s in range(1, 11) if all(r["step"] != s for r in logged if "loss" in r))
    assert p.returncode == 2 and bad >= 3, p.stderr[-2000:]
    assert p.stderr.strip().endswith(
        f"at step {bad}; stopped, nothing of step {bad} or later saved; checkpoint step {bad - 1}, "
        f"the weights step {bad} started from, moved to {wd / 'diverged' / str(bad - 1)}; last "
        f"good checkpoint: step {bad - 2} in {wd / 'checkpoints'}"
    ), p.stderr[-2000:]
    assert max(int(d.name) for d in (wd / "checkpoints").iterdir()) == bad - 2
    assert (wd / "diverged" / str(bad - 1)).is_dir()
    text = tmp_path / "play.txt"
    text.write_text(
        (ROOT / "data" / "tinyshakespeare.txt").read_text(encoding="utf-8")[:3000], encoding="utf-8"
    )
    e = cli("eval", "--workdir", wd, "--task", "ppl", "--data", text, "--step", bad - 2)
    assert e.returncode == 2 and not (wd / "eval_ppl.json").exists(), e.stderr[-2000:]
    assert e.stderr.startswith(
        f"error: checkpoint step {bad - 2} of {wd} gives ppl inf on this data"
    )


def test_eval_checks_where_it_writes_before_it_starts(tmp_path, monkeypatch):
    """A workdir eval.py cannot write its default result into is refused before any model loads
    (before: the whole evaluation ran, then the write failed). The check asks access(), which
    answers True to root for any mode bits: this swaps in what a read-only mount answers."""
    from megajax.cli import eval as eval_cli

    wd = tmp_path / "w"
    wd.mkdir()
    monkeypatch.setattr(eval_cli.os, "access", lambda path, mode: str(path) != str(wd))
    args = eval_cli.eval_parser().parse_args(["--workdir", str(wd), "--task", "sample"])
    with pytest.raises(
        UserError, match=f"{wd} is not writable, and the result goes to {wd / 'eval_sample.json'}"
    ):
        eval_cli.check_eval_args(args)
    args = eval_cli.eval_parser().parse_args(
        ["--workdir", str(wd), "--task", "sample", "--out", str(tmp_path / "r.json")]
    )
    eval_cli.check_eval_args(args)


def test_a_byte_order_mark_opens_a_file_it_is_not_text(tmp_path):
    """Windows editors start UTF-8 files with U+FEFF. Before: a LAMBADA file's first line was
    "expected a JSON object", and a text corpus trained on the mark as text."""
    tok = make_tokenizer("bytes")
    lines = [
        json.dumps({"text": "the cat sat on the mat"}),
        json.dumps({"text": "a dog ran far away"}),
    ]
    plain, marked = tmp_path / "plain.jsonl", tmp_path / "marked.jsonl"
    plain.write_text("\n".join(lines), encoding="utf-8")
    marked.write_text("\n".join(lines), encoding="utf-8-sig")
    assert marked.read_bytes().startswith(b"\xef\xbb\xbf")
    assert lambada_examples(marked, tok, 64) == lambada_examples(plain, tok, 64)


def test_non_finite_weights_are_not_imported(tmp_path):
    """An HF checkpoint whose weights hold a NaN imported with exit 0 before; now one line names
    the tensor, and nothing is written."""
    src = ROOT / "tests/fixtures/hf/gpt2"
    bad = tmp_path / "gpt2"
    bad.mkdir()
    for f in src.iterdir():
        if f.is_file() and f.name != "model.safetensors":
            (bad / f.name).write_bytes(f.read_bytes())
    tensors = load_file(str(src / "model.safetensors"))
    name = next(k for k in sorted(tensors) if k.endswith("mlp.c_fc.weight"))
    tensors[name] = tensors[name].copy()
    tensors[name].flat[7] = np.nan
    save_file(tensors, str(bad / "model.safetensors"))
    with pytest.raises(
        UserError, match=f"tensor '.*{name.split('.', 1)[1]}' holds 1 non-finite value"
    ):
        import_hf(bad, tmp_path / "w")
    assert not (tmp_path / "w").exists()


def test_an_exception_ending_one_of_orbaxs_threads_is_left_to_the_one_line(tmp_path):
    """A failed save reaches the user as megajax's one line, from the save that waits on it; the
    same failure ending one of orbax's own threads printed "Exception in thread ..." and a
    traceback too, or not, by which thread met it first (a full disk's final save, sometimes).
    Now an exception raised in orbax's code in a background thread is never printed."""
    from megajax.runs import checkpoint

    Checkpoints(tmp_path / "w").close()  # opening checkpoints installs the hook
    hook = threading.excepthook
    assert getattr(hook, "_megajax", False)
    seen = []
    inner = checkpoint._orbax_threads_reported(seen.append)

    def raised_in(filename: str):
        code = compile(
            "def write():\n    raise OSError(28, 'No space left on device')\n", filename, "exec"
        )
        space = {}
        exec(code, space)
        try:
            space["write"]()
        except OSError as e:
            return threading.ExceptHookArgs(
                [type(e), e, e.__traceback__, threading.current_thread()]
            )

    inner(
        raised_in(
            f"{os.sep}site-packages{os.sep}orbax{os.sep}checkpoint{os.sep}async_checkpointer.py"
        )
    )
    assert seen == []
    inner(raised_in(f"{os.sep}site-packages{os.sep}mine{os.sep}writer.py"))
    assert len(seen) == 1 and isinstance(seen[0].exc_value, OSError)
