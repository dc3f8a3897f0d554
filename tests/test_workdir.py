"""A workdir that is damaged, or a file system that fails under a run: one line, exit 2, and
nothing the user had is lost (found by an adversarial sweep of damaged workdirs and a full disk)."""

import errno
import json
import shutil
import subprocess

import jax.numpy as jnp
import pytest
from conftest import ROOT, file_size_limited, mesh_for, tiny_config
from helpers import BASE, env

from megajax.cli.common import failed
from megajax.config import load_config
from megajax.data.tokenizer import CharTokenizer, load_tokenizer
from megajax.errors import UserError
from megajax.runs.checkpoint import Checkpoints
from megajax.runs.workdir import (
    check_layout,
    load_workdir,
    refuse_overridden_shape,
    refuse_run_file,
    with_pretrained_shape,
)
from megajax.training.loop import train


def _snapshot(root):
    return {p: (p.is_dir(), p.stat().st_mtime_ns) for p in root.rglob("*")}


@pytest.fixture
def saved_workdir(tmp_path):
    """A workdir as train.py leaves it, with one checkpoint (written here, without training)."""
    wd = tmp_path / "run"
    wd.mkdir()
    tiny_config().save(wd / "config.json")
    CharTokenizer(list("abc")).save(wd)
    (wd / "metrics.jsonl").write_text('{"step": 1, "loss": 4.0}\n')
    ckpts = Checkpoints(wd, async_save=False)
    assert ckpts.save(1, {"w": jnp.ones(4)}, {"m": jnp.zeros(4)}, {"step": 1}) is None
    ckpts.close()
    return wd


def _replace_with_file(path):
    if path.is_dir():
        shutil.rmtree(path)
    path.write_text("x")


def _replace_with_directory(path):
    path.unlink()
    path.mkdir()


@pytest.mark.parametrize(
    "damage,message,also_eval",
    [
        (
            lambda wd: _replace_with_file(wd / "checkpoints"),
            "checkpoints is a file, where megajax keeps its directory",
            True,
        ),
        (lambda wd: _replace_with_file(wd / "damaged"), "damaged is a file", False),
        (
            lambda wd: _replace_with_directory(wd / "metrics.jsonl"),
            "metrics.jsonl is a directory",
            False,
        ),
        (
            lambda wd: _replace_with_directory(wd / "config.json"),
            "config.json is a directory",
            True,
        ),
        (
            lambda wd: (wd / "tokenizer.json").write_text('{"kind": "chars", "chars": 5}'),
            "tokenizer.json is damaged",
            True,
        ),
        (
            lambda wd: (wd / "tokenizer.json").unlink(),
            "has checkpoints but no tokenizer.json",
            False,
        ),
    ],
)
def test_a_damaged_workdir_is_refused_before_anything_is_written(
    saved_workdir, damage, message, also_eval
):
    """Before: a checkpoints path that was a file made every save wait out orbax's five-minute
    timeout and end in a traceback; a directory in a file's place, or a tokenizer description
    of the wrong form, was a traceback; a missing tokenizer was made again from the data."""
    damage(saved_workdir)
    before = _snapshot(saved_workdir)
    with pytest.raises(UserError, match=message):
        train(tiny_config(), mesh_for("1x1"), saved_workdir, sample_tokens=0, out=lambda _: None)
    if also_eval:
        with pytest.raises(UserError, match=message):
            load_workdir(saved_workdir, mesh_for("1x1"))
    assert _snapshot(saved_workdir) == before


@pytest.mark.parametrize(
    "spec",
    [
        {"kind": "chars", "chars": ["ab", "c"]},
        {"kind": "chars", "chars": []},
        {"kind": "hf", "file": "../elsewhere.json"},
        {"kind": "tiktoken", "name": 3},
        ["chars"],
        {"kind": "wordpiece"},
    ],
)
def test_a_tokenizer_description_of_the_wrong_form_is_damage(tmp_path, spec):
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    with pytest.raises(UserError, match="tokenizer.json is damaged"):
        load_tokenizer(tmp_path)


def test_a_checkpoints_directory_removed_or_replaced_mid_run(tmp_path):
    """Removed: the next save makes it again. Replaced by a file: the save fails at once, in
    one line, instead of orbax's threads waiting five minutes for a directory never made."""
    ckpts = Checkpoints(tmp_path)
    state = ({"w": jnp.ones(4)}, {"m": jnp.zeros(4)}, {})
    assert ckpts.save(1, *state) is None and ckpts.failed_save(block=True) is None
    shutil.rmtree(ckpts.directory)
    assert ckpts.save(2, *state) is None and ckpts.failed_save(block=True) is None
    assert (ckpts.directory / "2").is_dir()
    shutil.rmtree(ckpts.directory)
    ckpts.directory.write_text("x")
    step, why = ckpts.save(3, *state)
    assert step == 3 and "is not a writable directory" in why
    assert ckpts.directory.read_text() == "x"


@pytest.mark.full
def test_a_save_the_file_system_refuses_is_one_line_and_leaves_nothing_half_written(tmp_path):
    """A real failure of orbax's background writers: no file may grow past 64 KiB (what a full
    disk or a quota does to a checkpoint, without needing one). Before: orbax's threads logged
    a traceback each, and waiting for them raised one more, exit status 1."""
    wd = tmp_path / "w"
    # its files are larger too
    no_cache = {k: v for k, v in env().items() if k != "JAX_COMPILATION_CACHE_DIR"}
    p = subprocess.run(
        file_size_limited(
            str(ROOT / "train.py"),
            *BASE,
            "--mesh",
            "2x4",
            "--workdir",
            str(wd),
            "--steps",
            "2",
            "--save-every",
            "2",
            "--eval-every",
            "2",
        ),
        capture_output=True,
        text=True,
        env=no_cache,
        cwd=ROOT,
        timeout=240,
    )
    assert p.returncode == 2, (p.stdout, p.stderr)
    assert (
        p.stderr.startswith("error: saving step 2 failed (File too large; ")
        and p.stderr.count("\n") == 1
    ), p.stderr
    assert "no checkpoint of this run is intact" in p.stderr
    # the half-written step is gone, not left taking space
    assert list((wd / "checkpoints").iterdir()) == []
    assert (wd / "metrics.jsonl").is_file() and (wd / "config.json").is_file()


@pytest.mark.parametrize(
    "error,line",
    [
        (
            OSError(errno.ENOSPC, "No space left on device", "/data/run/metrics.jsonl"),
            "error: No space left on device: /data/run/metrics.jsonl (what was saved before is "
            "intact)",
        ),
        # safetensors
        (
            RuntimeError(
                "Error while serializing: I/O error: No space left on device (os error 28)"
            ),
            "error: No space left on device (RuntimeError: Error while serializing: I/O error",
        ),
        # tensorstore
        (
            ValueError(
                "RESOURCE_EXHAUSTED: Error writing \"w/0\" in OCDBT database [os_error_code='122']"
            ),
            "error: Disk quota exceeded (ValueError: RESOURCE_EXHAUSTED: Error writing",
        ),
    ],
)
def test_a_file_system_failure_is_one_line_whichever_library_raises_it(capsys, error, line):
    assert failed(error, "lower the batch") == 2
    err = capsys.readouterr().err
    assert err.startswith(line) and err.count("\n") == 1, err


def test_a_step_removed_while_it_is_read_is_no_damage(tmp_path):
    """A reader (eval.py, megajax-convert export) while a run trains with keep_checkpoints: the
    run removes the step being read. Before, that counted as damage, each older step (removed
    too) was tried, and the reader failed: "none of the checkpoints can be read". Now the steps
    are listed again and the newest one read, without a warning; real damage still warns."""
    writer = Checkpoints(tmp_path, async_save=False)
    for step in (1, 2):
        assert (
            writer.save(step, {"w": jnp.full(4, step)}, {"m": jnp.zeros(4)}, {"step": step}) is None
        )
    reader, warnings, reads = Checkpoints(tmp_path, writer=False), [], []

    def restore(step):
        reads.append(step)
        if reads == [2]:  # the writer saves step 3 and removes steps 1 and 2 as step 2 is read
            assert writer.save(3, {"w": jnp.full(4, 3)}, {"m": jnp.zeros(4)}, {"step": 3}) is None
            shutil.rmtree(tmp_path / "checkpoints" / "1")
            # half removed: the directory lingers
            shutil.rmtree(tmp_path / "checkpoints" / "2" / "params")
            raise KeyError("Unknown key: params")
        return reader.restore_params(step, {"w": jnp.zeros(4)})

    step, (params, _) = reader.restore_newest_intact(restore, warnings.append, set_aside=False)
    assert step == 3 and float(params["w"][0]) == 3.0 and reads == [2, 3] and warnings == []

    def damaged(step):
        raise ValueError("a truncated array file")

    with pytest.raises(UserError, match=r"none of the checkpoints .* can be read \(steps 3, 2\)"):
        reader.restore_newest_intact(damaged, warnings.append, set_aside=False)
    assert [w.split(" cannot")[0] for w in warnings] == [
        "warning: checkpoint step 3",
        "warning: checkpoint step 2",
    ]
    assert (
        "(ValueError: a truncated array file); left in place; trying the one before" in warnings[0]
    )
    writer.close()
    reader.close()


def test_init_from_decides_shape_and_tokenizer_and_refuses_overrides_of_them(tmp_path):
    """--init-from takes the pretrained workdir's shape and tokenizer. A command-line override of
    one of them was silently ignored (and config.json named the asked tokenizer while the run
    used the pretrained one); now it is refused in one line, and config.json names the one used."""
    pre = load_config("tiny", ["model.num_layers=3", "data.tokenizer=chars"])
    pre.save(tmp_path / "config.json")
    overrides = [
        f"train.init_from={tmp_path}",
        "model.num_layers=5",
        "data.tokenizer=bytes",
        "train.lr=1e-3",
    ]
    cfg = load_config("tiny", overrides)
    with pytest.raises(
        UserError,
        match=rf"^--init-from {tmp_path} decides model.num_layers \(3\): drop the override "
        r"model.num_layers=5$",
    ):
        refuse_overridden_shape(cfg, with_pretrained_shape(cfg)[0], overrides)
    with pytest.raises(
        UserError,
        match=r"decides data.tokenizer \('chars'\): drop the override "
        r"data.tokenizer='bytes'",
    ):
        refuse_overridden_shape(cfg, with_pretrained_shape(cfg)[0], [overrides[0], overrides[2]])
    # agreeing, or not decided
    same = [f"train.init_from={tmp_path}", "model.num_layers=3", "train.lr=1e-3"]
    agreeing = load_config("tiny", same)
    refuse_overridden_shape(agreeing, with_pretrained_shape(agreeing)[0], same)
    shaped, _ = with_pretrained_shape(cfg)
    assert (
        shaped.model.num_layers == 3
        and shaped.data.tokenizer == "chars"
        and shaped.train.lr == 1e-3
    )


def test_an_output_never_replaces_what_a_workdir_keeps(tmp_path, capsys):
    """eval.py --out W/config.json replaced the workdir's config with a result, and the workdir
    could neither resume nor be evaluated again; megajax-plot --out W/config.json wrote a PNG
    there. Both are refused, as is anything inside W/checkpoints; their own outputs are not."""
    from megajax.cli.plot import plot_main

    wd = tmp_path / "w"
    (wd / "checkpoints" / "3").mkdir(parents=True)
    for name in ("config.json", "tokenizer.json", "metrics.jsonl"):
        (wd / name).write_text("{}\n")
    for name in ("config.json", "tokenizer.json", "metrics.jsonl", "loss.png"):
        with pytest.raises(
            UserError,
            match=f"^--out {wd / name} is the {name} of the workdir {wd}: give another file$",
        ):
            refuse_run_file(wd / name)
    with pytest.raises(UserError, match=f"is inside the checkpoints directory of the workdir {wd}"):
        refuse_run_file(wd / "checkpoints" / "3" / "x.json")
    for fine in (wd / "eval_ppl.json", tmp_path / "config.json", wd / "sub" / "config.json"):
        refuse_run_file(fine)
    refuse_run_file(wd / "loss.png", may_write=("loss.png",))
    assert plot_main([str(wd), "--out", str(wd / "config.json")]) == 2
    assert (
        "is the config.json of the workdir" in capsys.readouterr().err
        and (wd / "config.json").read_text() == "{}\n"
    )


def test_another_programs_directory_is_not_taken_for_a_workdir(tmp_path):
    """train.py --workdir HF_MODEL_DIR replaced the model's config.json with megajax's; a
    prepared corpus as --workdir made its tokenizer.json the run's. Both are refused before
    anything is written, and so is reading an HF directory as a workdir; a new or empty
    directory, or one holding unrelated files only, is still a workdir."""
    hf = tmp_path / "hf"
    shutil.copytree(ROOT / "tests" / "fixtures" / "hf" / "gpt2", hf)
    before = (hf / "config.json").read_bytes()
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "tokenizer.json").write_text('{"kind": "bytes"}')
    for wd, names in ((hf, "config.json"), (corpus, "tokenizer.json")):
        with pytest.raises(
            UserError,
            match=f"^{wd} is not a megajax workdir: it holds another program's files "
            rf"\({names}\); give a new or empty --workdir",
        ):
            check_layout(wd)
    with pytest.raises(
        UserError, match="it holds another program's files .*a Hugging Face model directory\\?"
    ):
        load_workdir(hf, mesh_for("1x1"))
    assert (hf / "config.json").read_bytes() == before
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "notes.txt").write_text("mine")
    for fine in (tmp_path / "new", tmp_path / "notes"):
        check_layout(fine)
