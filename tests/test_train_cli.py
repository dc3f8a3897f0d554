"""train.py end to end, through the real command line (subprocesses on 8 simulated CPU devices)."""

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import ROOT, mesh_for
from flax import nnx
from helpers import (
    BASE,
    RUN_ARGS,
    SHAKESPEARE,
    assert_tensorboard_is_metrics,
    env,
    killed_after_checkpoint,
    losses,
    run,
    tiered,
)
from tolerances import F32

from megajax.cli.common import failed, start_jax
from megajax.errors import UserError
from megajax.runs.workdir import load_workdir


@pytest.fixture(scope="module")
def reference(trained_gpt):
    """An uninterrupted 16-step run on 2x4 that the other runs must reproduce (conftest.py)."""
    return trained_gpt


def test_end_to_end_run_writes_everything(reference):
    wd, ls, p = reference
    assert sorted(ls) == list(range(1, 17))
    assert ls[16] < ls[1] - 0.5  # it learns
    records = [json.loads(x) for x in (wd / "metrics.jsonl").read_text().splitlines()]
    step_rec = next(r for r in records if r.get("step") == 16 and "loss" in r)
    for key in (
        "step",
        "loss",
        "lr",
        "grad_norm",
        "tokens_per_sec",
        "step_time_s",
        "tflops_per_device",
        "mfu",
    ):
        assert key in step_rec, key
    val = [r for r in records if "val_loss" in r]
    assert [r["step"] for r in val] == [8, 16] and all(
        abs(r["val_ppl"] - 2.718281828 ** r["val_loss"]) < 1e-3 * r["val_ppl"] for r in val
    )
    cfg = json.loads((wd / "config.json").read_text())
    assert cfg["model"]["vocab_size"] == 65 and cfg["train"]["steps"] == 16
    assert json.loads((wd / "tokenizer.json").read_text())["kind"] == "chars"
    assert (wd / "loss.png").stat().st_size > 1000
    assert sorted(int(d.name) for d in (wd / "checkpoints").iterdir() if d.name.isdigit()) == [
        8,
        16,
    ]
    assert "mesh data=2 model=4 on 8 cpu" in p


def test_resume_after_sigkill_is_bitwise_exact(reference, tmp_path):
    _, ref, _ = reference
    wd = tmp_path / "killed"
    args = [
        *BASE,
        "--mesh",
        "2x4",
        "--workdir",
        str(wd),
        "--steps",
        "16",
        "--save-every",
        "4",
        "--eval-every",
        "8",
    ]
    killed_after_checkpoint(args, wd, 8)
    p = run(*args)
    assert "resuming from step" in p.stdout
    got = losses(wd)
    assert sorted(got) == list(range(1, 17))
    assert got == ref  # every step, bitwise
    # TensorBoard: each step once, what metrics.jsonl holds, however far the killed run got
    assert [s for s, _ in assert_tensorboard_is_metrics(wd)["train/loss"]] == list(range(1, 17))


@pytest.mark.parametrize(
    "saved_on,mesh,first,second",
    tiered(
        [
            ("2x4", "1x8", [], []),
            ("2x4", "4x2", ["train.shard_params=true"], ["train.shard_optimizer=true"]),
            ("data=2,pipe=2,model=2", "2x4", [], []),
        ],
        ("2x4", "1x8", [], []),
    ),
)
def test_resume_on_another_mesh(reference, tmp_path, saved_on, mesh, first, second):
    """Saved on one mesh, resumed on another: the second case saves an FSDP run (parameters
    split over "data", evaluated so) and resumes it with ZeRO-1, the third saves a pipelined run
    (two stages of one layer, evaluated so) and resumes it without stages: the plain
    reference's losses."""
    _, ref, _ = reference
    wd = tmp_path / "moved"
    # decay_steps pins the lr schedule of the 16-step reference while the first leg stops at 8.
    common = [
        *BASE,
        "--workdir",
        str(wd),
        "--save-every",
        "8",
        "--eval-every",
        "8",
        "--set",
        "train.decay_steps=16",
    ]
    sets = lambda keys: [a for k in keys for a in ("--set", k)]  # noqa: E731
    p = run(*common, "--mesh", saved_on, "--steps", "8", *sets(first))
    assert ("mesh pipe=2 data=2 model=2 on 8 cpu" in p.stdout) == ("pipe" in saved_on)
    p = run(*common, "--mesh", mesh, "--steps", "16", *sets(second))
    assert "resuming from step 8" in p.stdout and f"model={mesh[-1]}" in p.stdout
    got = losses(wd)
    for s in range(1, 17):
        # Two legs on two meshes, each within float32's mesh bound (tests/tolerances.py).
        assert got[s] == pytest.approx(ref[s], rel=2 * F32), s


@pytest.mark.full
def test_sigterm_saves_and_exits_cleanly_and_a_second_run_is_refused(tmp_path):
    """A second run on the same workdir is refused; SIGTERM, SIGHUP (the terminal or SSH
    session closed) and SIGUSR1 (SLURM's warning before a time limit) together save once and
    exit 0. Before, either of the last two killed the run without saving."""
    wd = tmp_path / "term"
    args = [
        *BASE,
        "--mesh",
        "2x4",
        "--workdir",
        str(wd),
        "--steps",
        "100000",
        "--save-every",
        "100000",
    ]
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "train.py"), *args],
        env=env(),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.time() + 180
    while time.time() < deadline and not ((wd / "metrics.jsonl").exists() and len(losses(wd)) >= 3):
        time.sleep(0.05)
    # The same command again while the first runs: refused in one line, nothing touched.
    second = run(*args, check=False)
    assert second.returncode == 2 and "another megajax process holds" in second.stderr
    assert second.stderr.strip().count("\n") == 0 and proc.poll() is None
    # more signals must not lose the checkpoint
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1):
        proc.send_signal(sig)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    # Python runs the handlers of signals that arrive together in signal-number order: the
    # first one handled stops and saves, the others are only noted.
    names = {"SIGTERM", "SIGHUP", "SIGUSR1"}
    first = next(name for name in names if f"{name}: saved a checkpoint at step" in out)
    assert "Traceback" not in err and all(
        f"{name}: already stopping" in err for name in names - {first}
    ), err
    records = [json.loads(line) for line in (wd / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in records if "loss" in r]
    assert steps == sorted(set(steps))  # one writer: no step twice, none out of order
    step = max(losses(wd))
    assert (wd / "checkpoints" / str(step)).is_dir()


def test_nohup_keeps_the_hang_up_ignored():
    """Started under nohup (SIGHUP ignored), a closed terminal must not stop the run."""
    code = (
        "from megajax.host.signals import STOP_SIGNALS; print(sorted(s.name for s in STOP_SIGNALS))"
    )
    plain = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env(), cwd=ROOT
    )
    # what nohup does
    ignoring = (
        "import os, signal, sys; signal.signal(signal.SIGHUP, signal.SIG_IGN); "
        "os.execv(sys.executable, [sys.executable, '-c', sys.argv[1]])"
    )
    nohup = subprocess.run(
        [sys.executable, "-c", ignoring, code], capture_output=True, text=True, env=env(), cwd=ROOT
    )
    # a scheduler's, before a limit ends the job
    warnings = "'SIGTERM', 'SIGUSR1', 'SIGUSR2', 'SIGXCPU']\n"
    assert (plain.stdout, nohup.stdout) == (
        "['SIGHUP', 'SIGINT', " + warnings,
        "['SIGINT', " + warnings,
    )


@pytest.mark.full
def test_a_reader_that_goes_away_stops_the_run_as_sigterm_does(tmp_path):
    """`train.py | head -3`: the pipe under stdout closes and the next line fails to be written
    (BrokenPipeError). Before: a traceback, exit 1, the steps since the last save lost. Now the
    run stops as on SIGTERM, saves, and says so on stderr; the same command resumes."""
    wd = tmp_path / "pipe"
    args = [
        *BASE,
        "--mesh",
        "2x4",
        "--workdir",
        str(wd),
        "--steps",
        "100000",
        "--save-every",
        "100000",
    ]
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "train.py"), *args],
        env=env(),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    # the banner and two steps, as head -3 reads them
    head = [proc.stdout.readline() for _ in range(3)]
    proc.stdout.close()
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == 0, err
    assert head[2].startswith("step      2  loss") and "Traceback" not in err, err
    step = int(err.split("SIGPIPE: saved a checkpoint at step ")[1].split()[0])
    assert step >= 3 and (wd / "checkpoints" / str(step)).is_dir() and max(losses(wd)) == step


def test_every_program_outlives_a_closed_pipe_under_its_output():
    """eval.py, megajax-plan, -prepare, -convert (`| head`): what they would still print goes to
    /dev/null, with no BrokenPipeError now or at exit, and they finish their work."""
    from megajax.cli.common import _PipeGuard

    pipe, terminal = os.pipe(), os.openpty()  # a terminal whose other end closed: EIO (SSH gone)
    for reader, writer in (pipe, terminal):
        os.close(reader)
        closed = []
        with open(writer, "w", buffering=1) as stream:
            guard = _PipeGuard(
                stream, lambda: closed.append(True), to_stderr=False, name="standard output"
            )
            for i in range(3):
                print(f"line {i}", file=guard)
            guard.flush()
            assert closed == [True] and os.path.samestat(os.fstat(writer), os.stat(os.devnull))


@pytest.mark.full
def test_a_signal_during_the_final_sample_stops_it(tmp_path):
    """Once the run is saved, SIGTERM stops the sample written after training (it was noted and
    ignored: a long --sample-tokens could only be killed): exit 0, the checkpoint kept."""
    wd, log = tmp_path / "w", tmp_path / "out.txt"
    args = [
        *RUN_ARGS,
        "--host-devices",
        "1",
        "--mesh",
        "1x1",
        "--steps",
        "3",
        "--sample-tokens",
        str(10**9),
        "--workdir",
        str(wd),
    ]
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, str(ROOT / "train.py"), *args],
            env=env(),
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.PIPE,
            text=True,
        )
        deadline = time.time() + 180
        while (
            time.time() < deadline
            and "done: 3 steps" not in log.read_text()
            and proc.poll() is None
        ):
            time.sleep(0.05)
        time.sleep(1)  # into the sample
        proc.send_signal(signal.SIGTERM)
        try:
            err = proc.communicate(timeout=60)[1]
        finally:
            proc.kill()  # (a no-op once it has exited; otherwise it would sample on)
    assert proc.returncode == 0 and "Traceback" not in err, err
    assert (
        "SIGTERM: stopped the sample; the run is complete, its last checkpoint at step 3"
        in log.read_text()
    )
    assert (wd / "checkpoints" / "3").is_dir()


# the swallowing, as intended
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_start_up_signal_whose_exception_was_swallowed_still_stops_the_run():
    """Python runs a signal handler wherever the main thread is, a weakref callback included,
    which swallows what the handler raises (it happened to the sample's stop in CI): the signal
    is recorded, and the run stops where training would begin."""
    import weakref

    from megajax.errors import UserError
    from megajax.host.signals import StopRequested

    class Thing:
        pass

    with StopRequested() as stop:
        thing = Thing()
        weakref.finalize(thing, lambda: os.kill(os.getpid(), signal.SIGTERM))
        del thing  # the handler runs in the finaliser; its exception is "ignored"
        time.sleep(0.1)
        with pytest.raises(
            UserError, match="SIGTERM during start-up: stopped before training any step"
        ):
            stop.start_training()
        assert not stop.training


@pytest.mark.full
def test_sigterm_during_start_up_is_one_line(tmp_path):
    """bert_tiny trains its WordPiece vocabulary at start-up: a SIGTERM then stops at once."""
    proc = subprocess.Popen(
        [
            sys.executable,
            str(ROOT / "train.py"),
            "--config",
            "bert_tiny",
            "--host-devices",
            "8",
            "--workdir",
            str(tmp_path / "w"),
        ],
        env=env(),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    time.sleep(4)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert (
        proc.returncode == 2
        and err.strip() == "error: SIGTERM during start-up: stopped before training any step"
    ), err
    assert "step " not in out


# train.py's signal handlers as its train_main sets them, through a run that has trained and
# returned: a signal after train() (a preemption reaching this process after its peer) must not
# be taken for one during start-up.
AFTER_TRAIN = """
import os, signal, sys
from megajax.cli.common import stop_during_startup
from megajax.host.signals import StopRequested
for sig in (signal.SIGTERM, signal.SIGINT):
    signal.signal(sig, stop_during_startup)
StopRequested.command_line = True
with StopRequested() as stop:
    stop.start_training()
os.kill(os.getpid(), signal.SIGTERM)
print("the run's own exit status")
"""


def test_a_signal_after_train_returns_is_not_a_start_up_stop():
    """Before: from the moment train() restored the start-up handler to the one that set the run
    as ended, a signal said "stopped before training any step" and left with status 2, skipping
    a multi-process run's shutdown (its peer then waited: a hang in CI)."""
    p = subprocess.run(
        [sys.executable, "-c", AFTER_TRAIN],
        capture_output=True,
        text=True,
        env=env(),
        cwd=ROOT,
        timeout=60,
    )
    assert (p.returncode, p.stdout, p.stderr) == (
        0,
        "the run's own exit status\n",
        "SIGTERM: the run is already ending\n",
    )


@pytest.mark.parametrize(
    "lr,save_every", tiered([("1e38", "2"), ("1e6", "1"), ("1e38", "1000")], ("1e6", "1"))
)
def test_non_finite_step_is_never_saved_and_the_named_checkpoint_exists(tmp_path, lr, save_every):
    """With train.spike_factor 0 (the non-finite check alone). lr 1e38: the loss itself
    overflows. lr 1e6: the loss of the fatal step is still finite
    (it is computed before the update) but its gradient norm is not, so the weights after it
    are NaN: that step must not be saved either. With no save before it, none is named."""
    wd = tmp_path / "nan"
    p = run(
        *BASE,
        "--mesh",
        "2x4",
        "--workdir",
        str(wd),
        "--steps",
        "40",
        "--save-every",
        save_every,
        "--set",
        f"train.lr={lr}",
        "--set",
        "train.warmup_steps=1",
        "--set",
        "train.grad_clip=1e30",
        "--set",
        "train.spike_factor=0",
        check=False,
    )
    assert p.returncode == 2, p.stderr
    line = p.stderr.strip()
    assert "\n" not in line and "Traceback" not in p.stderr
    assert (
        line.startswith("error: ") and " at step " in line and ("nan" in line or "inf" in line)
    ), line
    bad = int(line.split(" at step ")[1].split(";")[0])
    saved = sorted(int(d.name) for d in (wd / "checkpoints").iterdir() if d.name.isdigit())
    assert all(s < bad - 1 for s in saved)  # step bad - 1's weights gave the loss of step bad
    if "no checkpoint from before the divergence is left" in line:
        assert not saved
        return
    good = int(line.split("last good checkpoint: step ")[1].split(" ")[0])
    assert saved and good == max(saved)
    for step in saved:  # every checkpoint on disk holds finite weights
        loaded = load_workdir(wd, mesh_for("1x1"), step)
        assert all(
            np.isfinite(np.asarray(x)).all()
            for x in jax.tree.leaves(nnx.state(loaded.model, nnx.Param))
        )


def test_dry_run_of_paper_model_allocates_nothing():
    p = run(
        "--config",
        "gpt2_355m",
        "--host-devices",
        "8",
        "--mesh",
        "2x4",
        "--dry-run",
        "--set",
        "train.batch_size=16",
        "--set",
        "train.microbatches=1",
        "--set",
        "model.seq_len=128",
    )
    from megajax.config import load_config
    from megajax.tasks import param_count

    n = param_count(load_config("gpt2_355m", ["model.seq_len=128"]))
    assert f"dry run: gpt2_355m, {n:,} parameters" in p.stdout
    assert "per device: params" in p.stdout and "compiled step peak" in p.stdout
    assert "forward [2], backward [2]" in p.stdout
    assert "activations per sequence" not in p.stdout  # only with --costs


@pytest.mark.full
def test_dry_run_costs_follow_the_memory_model():
    """--costs: activation bytes per sequence compiled (whole step and layers) and modelled;
    FLOPs with recomputation's share. Float32 SP + selective on 2x4: the layers' compiled
    bytes are the model's within 15% (tests/test_memory_model.py holds the model to XLA)."""
    p = run(
        "--config",
        "tiny",
        "--host-devices",
        "8",
        "--mesh",
        "2x4",
        "--dry-run",
        "--costs",
        "--set",
        "model.sequence_parallel=true",
        "--set",
        "model.remat=selective",
        "--set",
        "model.compute_dtype=float32",
    )
    line = next(x for x in p.stdout.splitlines() if x.startswith("activations per sequence: "))
    assert "slope over 4 more per microbatch" in line and "the 2 layers" in line, line
    assert "recomputation +" in p.stdout and "step FLOPs per device: " in p.stdout
    compiled, modelled = (
        float(x)
        for x in re.findall(r"layers ([0-9.]+) KiB compiled, modelled ([0-9.]+) KiB", line)[0]
    )
    assert compiled == pytest.approx(modelled, rel=0.15), line


@pytest.mark.parametrize(
    "args,message",
    [
        (
            ["--mesh", "3x3"],
            "needs 9 devices (data=3 x model=3); 8 cpu devices available; simulate 9 on the CPU "
            "with --host-devices 9",
        ),
        # the spec's own mistake: no count of devices, simulated or not, would help
        (
            ["--mesh", "data=2,pipe=0,model=4"],
            "error: mesh 'data=2,pipe=0,model=4': size of 'pipe' must be positive, got 0; 8 cpu "
            "devices available\n",
        ),
        # every kind the source registry (megajax/specs.py) has
        (
            ["--data", "ftp:x"],
            "unknown data source 'ftp:x' (use builtin, text:PATH, bin:PATH, chat:PATH, "
            "megatron:PREFIX, tfds:NAME or pairs:DIR)",
        ),
        (
            ["--set", "model.num_heads=3", "--set", "model.hidden=96"],
            "num_heads=3 is not divisible by the model axis",
        ),
        (["--set", "train.batch_size=6"], "global batch 6 is not divisible by the data axis (4)"),
        (["--data", "text:/nonexistent/file.txt"], "data file not found: /nonexistent/file.txt"),
        (
            ["--data", "megatron:/nonexistent/corpus_text_document"],
            "/nonexistent/corpus_text_document.idx not found",
        ),
        (["--set", "model.num_layer=3"], "did you mean 'model.num_layers'"),
        (["--set", "train.lr=fast"], "train.lr expects float, got 'fast'"),
        (["--config", "nope"], "no config named 'nope'"),
        (["--set", "train.keep_checkpoints=0"], "train.keep_checkpoints must be positive, got 0"),
        (["--save-every", "0"], "train.save_every must be positive, got 0"),
        (["--set", "train.spike_factor=0.5"], "train.spike_factor must be 0 or above 1, got 0.5"),
        (["--set", "model.num_layers=2.5e0"], "model.num_layers expects int, got '2.5e0'"),
        (
            ["--set", "train.lr=nan"],
            "train.lr must be a finite number in float32's range (0, or 1.2e-38 to 3.4e+38 in "
            "magnitude), got nan",
        ),
        # the planner's memory, at once (not minutes of compiling)
        (["--set", "model.seq_len=100000"], "per device (the planner's figure"),
        (
            ["--set", "train.seed=4294967296"],
            "train.seed must be below 2^31 (the run counts in int32)",
        ),
        (
            ["--set", "train.batch_size=268435456"],
            "a batch of 268435456 x 33 tokens is more than the 2^31",
        ),
        # (it ran out of memory)
        (["--host-devices", "100000"], "--host-devices must be in 1..4096, got 100000"),
        (["--sample-tokens", "-1"], "--sample-tokens must be 0 (none) or more, got -1"),
        (
            ["--config", "bert_tiny", "--sample-tokens", "5"],
            "--sample-tokens is for a GPT run, which ends with a sample; this run trains a bert "
            "(pretrain), which writes none",
        ),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path, args, message):
    base = [a for a in BASE]
    p = run(*base, "--mesh", "4x2", "--workdir", str(tmp_path / "w"), *args, check=False)
    assert p.returncode == 2
    assert p.stderr.strip().count("\n") == 0 and "Traceback" not in p.stderr, p.stderr
    assert message in p.stderr
    assert not (tmp_path / "w").exists()


def test_a_compiled_step_too_big_for_the_devices_is_refused(monkeypatch):
    """What the planner lets through, the compiled step's own peak decides."""
    from types import SimpleNamespace

    from megajax.training import memory

    compiled = SimpleNamespace(
        memory_analysis=lambda: SimpleNamespace(
            argument_size_in_bytes=3 * 2**30,
            output_size_in_bytes=2**30,
            alias_size_in_bytes=2**30,
            temp_size_in_bytes=2**30,
        )
    )
    monkeypatch.setattr(memory, "device_memory_bytes", lambda: 4 * 2**30 - 1)
    with pytest.raises(UserError, match="needs 4.00 GiB per device, more than the 4.00 GiB"):
        memory.check_step_fits(compiled)
    monkeypatch.setattr(memory, "device_memory_bytes", lambda: 4 * 2**30)
    memory.check_step_fits(compiled)


@pytest.mark.full
def test_a_backend_jax_cannot_start_is_one_line(reference, tmp_path, monkeypatch):
    """JAX_PLATFORMS naming a backend this jax lacks (a GPU node's setting with a CPU-only jax:
    jax raises a bare AssertionError for `cuda`, a RuntimeError for others) is one line and exit
    2 from train.py, eval.py and megajax-convert, nothing written; megajax-plan, which needs
    only shapes, plans on the CPU. A full disk under stdout names it; an ASCII one escapes.
    JAX_DISABLE_JIT (which megajax's compiled steps cannot honour) is one line too; JAX_ENABLE_X64
    is turned off (with it, the cache update of generation failed, and host-side means moved to
    float64)."""
    e = {**env(), "JAX_PLATFORMS": "abacus"}
    for argv in (
        [ROOT / "train.py", *BASE, "--workdir", tmp_path / "w"],
        [
            ROOT / "eval.py",
            "--workdir",
            reference[0],
            "--task",
            "sample",
            "--out",
            tmp_path / "s.json",
        ],
        ["-m", "megajax.convert", "export", "--workdir", reference[0], "--out", tmp_path / "hf"],
    ):
        p = subprocess.run(
            [sys.executable, *map(str, argv)],
            capture_output=True,
            text=True,
            env=e,
            cwd=ROOT,
            timeout=120,
        )
        assert p.returncode == 2 and p.stderr.count("\n") == 1, (argv, p.stderr)
        assert p.stderr.startswith(
            "error: jax could not start its backend (JAX_PLATFORMS=abacus): "
        ), p.stderr
    assert sorted(x.name for x in tmp_path.iterdir()) == []
    p = subprocess.run(
        [sys.executable, "-m", "megajax.plan", "--config", "tiny", "--devices", "8"],
        capture_output=True,
        text=True,
        env=e,
        cwd=ROOT,
        timeout=120,
    )
    assert p.returncode == 0 and "plans," in p.stdout, p.stderr
    with open("/dev/full", "w") as full:
        p = subprocess.run(
            [
                sys.executable,
                str(ROOT / "train.py"),
                *BASE,
                "--workdir",
                str(tmp_path / "w"),
                "--steps",
                "2",
            ],
            stdout=full,
            stderr=subprocess.PIPE,
            text=True,
            env=env(),
            cwd=ROOT,
            timeout=240,
        )
    assert p.returncode == 2 and p.stderr.endswith(
        "error: No space left on device: standard output (what was saved before is intact)\n"
    ), p.stderr
    # A terminal that cannot encode a character of the output (an ASCII locale) gets it escaped:
    # every program's stdout is set up by guard_stdout (a byte tokenizer's sample holds U+FFFD).
    p = subprocess.run(
        [
            sys.executable,
            "-c",
            "from megajax.cli.common import guard_stdout; guard_stdout(); print('caf\\xe9 "
            "\\ufffd')",
        ],
        capture_output=True,
        text=True,
        env={**env(), "PYTHONIOENCODING": "ascii"},
        cwd=ROOT,
        timeout=60,
    )
    assert p.returncode == 0 and p.stdout == "caf\\xe9 \\ufffd\n", p.stderr
    monkeypatch.setenv("JAX_PLATFORMS", "cuda")
    monkeypatch.setattr(jax, "devices", lambda: (_ for _ in ()).throw(AssertionError()))
    with pytest.raises(
        UserError,
        match=r"^jax could not start its backend \(JAX_PLATFORMS=cuda\): this jax "
        r"has no "
        r"cuda backend\. Install",
    ):
        start_jax()
    monkeypatch.undo()
    p = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), *BASE, "--workdir", str(tmp_path / "nojit")],
        capture_output=True,
        text=True,
        env={**env(), "JAX_DISABLE_JIT": "1"},
        cwd=ROOT,
        timeout=120,
    )
    assert p.returncode == 2 and p.stderr.startswith(
        "error: JAX_DISABLE_JIT is set: megajax compiles its steps ahead of time"
    ), p.stderr
    assert not (tmp_path / "nojit").exists()
    # JAX_ENABLE_X64=1: the programs run in 32 bits all the same
    jax.config.update("jax_enable_x64", True)
    try:
        start_jax()
        assert not jax.config.jax_enable_x64
    finally:
        jax.config.update("jax_enable_x64", False)


@pytest.mark.full
def test_a_program_started_without_stdout_or_stderr_runs_and_its_files_stay_its_own(
    reference, tmp_path
):
    """`>&-` / `2>&-` (some launchers start daemons so): Python's sys.stdout was None and
    train.py crashed at its first print; and the first file opened took descriptor 1 or 2, to
    receive whatever was printed. /dev/null now stands in; every line of metrics.jsonl is
    JSON and eval.py's result is whole."""

    def closed(argv, redirect):
        cmd = " ".join(map(shlex.quote, [sys.executable, *map(str, argv)]))
        return subprocess.run(
            ["bash", "-c", f"exec {cmd} {redirect}"],
            capture_output=True,
            text=True,
            env=env(),
            cwd=ROOT,
            timeout=240,
        )

    p = closed([ROOT / "train.py", *BASE, "--workdir", tmp_path / "w", "--steps", "2"], ">&-")
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr
    records = [
        json.loads(line) for line in (tmp_path / "w" / "metrics.jsonl").read_text().splitlines()
    ]
    assert [r["step"] for r in records if "loss" in r] == [1, 2]
    p = closed(
        [
            ROOT / "eval.py",
            "--workdir",
            reference[0],
            "--task",
            "sample",
            "--max-new-tokens",
            "5",
            "--out",
            tmp_path / "s.json",
            "--host-devices",
            "8",
        ],
        ">&- 2>&-",
    )
    assert p.returncode == 0 and len(json.loads((tmp_path / "s.json").read_text())["tokens"]) == 5


@pytest.mark.parametrize("kind", ["host", "device"])
def test_running_out_of_memory_is_one_line(capsys, kind):
    """A real allocation that fails (a petabyte: on any machine), on the host (numpy's
    MemoryError) or the device (XLA's RESOURCE_EXHAUSTED), is one line and exit status 2 at the
    top of train.py and eval.py (cli.common.failed); any other exception stays a traceback."""
    try:
        if kind == "host":
            np.empty(2**50, np.uint8)
        else:
            jax.block_until_ready(jax.numpy.zeros(2**50, jax.numpy.uint8))
    except Exception as e:  # noqa: BLE001
        status = failed(e, "lower the batch")
    assert status == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: out of {kind} memory (") and err.endswith(
        ": lower the batch\n"
    ), err
    assert err.count("\n") == 1
    with pytest.raises(ValueError, match="a bug"):
        failed(ValueError("a bug"), "lower the batch")


NO_THREAD = """
import resource, sys, threading
from megajax.cli.common import failed
# the address space this process has, and a little: no room for a thread's 8 MiB stack
used = int(open("/proc/self/statm").read().split()[0]) * resource.getpagesize()
resource.setrlimit(resource.RLIMIT_AS, (used + (1 << 20), resource.RLIM_INFINITY))
try:
    threading.Thread(target=print).start()
except Exception as e:
    sys.exit(failed(e, "lower the batch"))
"""


def test_a_thread_the_system_refuses_is_one_line():
    """`ulimit -v` leaves no address space for a thread's stack: Python's "can't start new
    thread" (from orbax's writers, say) is one line and exit status 2, not a traceback."""
    p = subprocess.run(
        [sys.executable, "-c", NO_THREAD],
        capture_output=True,
        text=True,
        env=env(),
        cwd=ROOT,
        timeout=60,
    )
    assert p.returncode == 2 and p.stderr == (
        "error: out of host memory (the system refused a thread: its address space or threads are "
        "limited, `ulimit -v` / `ulimit -u`): raise the limit, or lower the batch\n"
    ), p.stderr


def test_workdir_mistakes_are_one_line(reference, tmp_path):
    """A workdir that is a file, a coordinator without a port, a resume asking for another
    tokenizer, a damaged tokenizer file: one line, exit 2, nothing changed."""
    import shutil

    (tmp_path / "afile").write_text("x")
    wd = tmp_path / "copy"
    shutil.copytree(reference[0], wd)
    cases = [
        ([*BASE, "--workdir", str(tmp_path / "afile")], "cannot use"),
        (
            [
                *BASE,
                "--workdir",
                str(tmp_path / "w"),
                "--coordinator",
                "localhost",
                "--num-processes",
                "2",
                "--process-id",
                "0",
            ],
            "--coordinator must be HOST:PORT",
        ),
        (
            [*BASE, "--mesh", "2x4", "--workdir", str(wd), "--tokenizer", "bytes", "--steps", "20"],
            "was trained with tokenizer 'chars', not 'bytes'",
        ),
    ]
    for args, message in cases:
        p = run(*args, check=False)
        assert p.returncode == 2 and message in p.stderr and p.stderr.strip().count("\n") == 0, (
            p.stderr
        )
    (wd / "tokenizer.json").write_text('{"kind": "ch')
    p = run(*BASE, "--mesh", "2x4", "--workdir", str(wd), "--steps", "20", check=False)
    assert p.returncode == 2 and "tokenizer.json is damaged" in p.stderr, p.stderr
    assert sorted(losses(wd)) == list(range(1, 17))  # nothing trained, nothing rewritten


def test_misread_bin_file_is_refused(tmp_path):
    """uint16 token ids read as uint32 are ids in the billions: refused, not a vocabulary of
    them."""
    ids = (np.arange(4000) % 200 + 20000).astype(np.uint16)
    ids.tofile(tmp_path / "t.bin")
    p = run(
        *RUN_ARGS,
        "--host-devices",
        "8",
        "--data",
        f"bin:{tmp_path / 't.bin'}",
        "--tokenizer",
        "bytes",
        "--set",
        "data.bin_dtype=uint32",
        "--workdir",
        str(tmp_path / "w"),
        check=False,
    )
    assert p.returncode == 2 and "check data.bin_dtype (uint32)" in p.stderr, p.stderr
    assert not (tmp_path / "w").exists()


def test_empty_data_file(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    p = run(
        *BASE,
        "--mesh",
        "2x4",
        "--workdir",
        str(tmp_path / "w"),
        "--data",
        f"text:{empty}",
        check=False,
    )
    assert p.returncode == 2 and "is empty" in p.stderr and "Traceback" not in p.stderr


def test_checkpoint_of_another_shape_is_refused_untouched(reference, tmp_path):
    import shutil

    wd = tmp_path / "copy"
    shutil.copytree(reference[0], wd)
    before = {p: p.stat().st_mtime_ns for p in wd.rglob("*")}
    p = run(
        *BASE,
        "--mesh",
        "2x4",
        "--workdir",
        str(wd),
        "--steps",
        "20",
        "--set",
        "model.num_layers=3",
        check=False,
    )
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert "another model shape" in p.stderr and "in the checkpoint vs" in p.stderr
    after = {p: p.stat().st_mtime_ns for p in wd.rglob("*")}
    assert before == after


def _damage(step_dir: Path, how: str):
    if how == "truncated array file":
        for f in (step_dir / "params" / "d").iterdir():
            f.write_bytes(f.read_bytes()[: f.stat().st_size // 3])
    elif how == "missing manifest":
        (step_dir / "params" / "manifest.ocdbt").unlink()
    else:  # an empty step directory
        import shutil

        shutil.rmtree(step_dir)
        step_dir.mkdir()


@pytest.mark.parametrize(
    "how", ["truncated array file", "missing manifest", "empty step directory"]
)
def test_damaged_newest_checkpoint_falls_back_to_the_one_before(reference, tmp_path, how):
    """eval reads the newest checkpoint that is intact and says which one it skipped."""
    import shutil

    wd = tmp_path / "damaged"
    shutil.copytree(reference[0], wd)
    _damage(wd / "checkpoints" / "16", how)
    loaded = load_workdir(wd, mesh_for("1x1"))
    assert loaded.step == 8 and (wd / "checkpoints" / "16").exists()  # eval only reads


@pytest.mark.full
def test_training_resumes_past_a_damaged_checkpoint(reference, tmp_path):
    """train.py warns in one line, sets the damaged step aside (kept), resumes from the one
    before and reproduces the uninterrupted run bitwise, saving that step again."""
    import shutil

    wd = tmp_path / "damaged"
    shutil.copytree(reference[0], wd)
    _damage(wd / "checkpoints" / "16", "truncated array file")
    p = run(
        *BASE,
        "--mesh",
        "2x4",
        "--workdir",
        str(wd),
        "--steps",
        "16",
        "--save-every",
        "8",
        "--eval-every",
        "8",
    )
    assert (
        "warning: checkpoint step 16 cannot be read" in p.stdout
        and "resuming from step 8" in p.stdout
    )
    assert "Traceback" not in p.stderr, p.stderr
    assert (wd / "damaged" / "16" / "params").is_dir() and (
        wd / "checkpoints" / "16" / "params"
    ).is_dir()
    assert losses(wd) == reference[1]


class _FullDisk:
    """An orbax commit future that fails as a full disk does, after the write has begun."""

    def result(self, timeout=None):
        raise OSError(28, "No space left on device")


@pytest.mark.parametrize(
    "fails,save_every,outcome",
    [
        # step 2 is intact: a one-line warning, training goes on, steps 6 and 8 are saved
        (4, 2, "goes on"),
        (8, 4, "stops"),  # the last save fails: an error naming the intact step 4
        (2, 2, "stops"),  # nothing intact: stop at once
    ],
)
def test_a_failed_save_is_reported_in_one_line(
    tmp_path, monkeypatch, capsys, fails, save_every, outcome
):
    import orbax.checkpoint as ocp

    from megajax.config import load_config
    from megajax.errors import UserError
    from megajax.training.loop import train

    write = ocp.StandardCheckpointHandler.async_save

    async def full_disk(self, directory, *args, **kwargs):
        futures = await write(self, directory, *args, **kwargs)
        step = int(Path(directory).parent.name.split(".")[0])
        return [*(futures or []), _FullDisk()] if step == fails else futures

    monkeypatch.setattr(ocp.StandardCheckpointHandler, "async_save", full_disk)
    cfg = load_config(
        "tiny",
        [
            f"data.source=text:{SHAKESPEARE}",
            "data.tokenizer=chars",
            "model.num_layers=1",
            "train.steps=8",
            f"train.save_every={save_every}",
            "train.log_every=1",
        ],
    )
    lines = []
    if outcome == "goes on":
        result = train(cfg, mesh_for("2x4"), tmp_path / "w", sample_tokens=0, out=lines.append)
        assert result.final_step == 8
        assert (
            "warning: saving step 4 failed (OSError: [Errno 28] No space left on device); step 2 "
            "in " in capsys.readouterr().out
        )
    else:
        with pytest.raises(UserError) as e:
            train(cfg, mesh_for("2x4"), tmp_path / "w", sample_tokens=0, out=lines.append)
        intact = "step 4 in" if fails == 8 else "no checkpoint of this run is intact"
        assert (
            f"saving step {fails} failed (OSError: [Errno 28] No space left on device); {intact}"
            in str(e.value)
        )
    steps = sorted(
        int(p.name) for p in (tmp_path / "w" / "checkpoints").iterdir() if p.name.isdigit()
    )
    assert steps == {4: [2, 6, 8], 8: [4], 2: []}[fails]


@pytest.mark.full
def test_a_sequence_parallel_run_samples_and_evaluates(tmp_path):
    """Trained with sequence parallelism (2x4), the workdir serves inference like any other:
    the sample at the end and evaluation run the same weights with the switch off (decoding
    feeds one token at a time, which cannot be split over the model axis)."""
    from megajax.config import load_config
    from megajax.evaluation.scoring import perplexity_of_tokens
    from megajax.training.loop import train

    cfg = load_config(
        "tiny",
        [
            f"data.source=text:{SHAKESPEARE}",
            "data.tokenizer=chars",
            "model.num_layers=1",
            "model.sequence_parallel=true",
            "train.steps=4",
            "train.save_every=4",
        ],
    )
    result = train(cfg, mesh_for("2x4"), tmp_path / "w", sample_tokens=8, out=lambda *a: None)
    assert result.final_step == 4 and result.sample is not None and len(result.sample) >= 16
    tokens = np.asarray(
        load_workdir(tmp_path / "w", mesh_for("1x1")).tokenizer.encode(
            SHAKESPEARE.read_text()[:3000]
        )
    )
    one, many = (load_workdir(tmp_path / "w", mesh_for(spec)) for spec in ("1x1", "2x4"))
    assert one.cfg.model.sequence_parallel and not (
        one.model.layout.sequence_parallel or many.model.layout.sequence_parallel
    )
    a, b = (perplexity_of_tokens(x.model, tokens, 16, 8) for x in (one, many))
    assert abs(a["loss"] - b["loss"]) <= F32 * a["loss"]


@pytest.mark.full
def test_more_simulated_devices_than_xla_cpu_compiles_for_is_one_line(tmp_path):
    """XLA:CPU takes simulated devices past 2048 for other processes and refuses to compile
    over them: one line naming the way out, exit 2, nothing written."""
    e = env()
    e["XLA_FLAGS"] = e["XLA_FLAGS"].replace("--xla_force_host_platform_device_count=8", "")
    p = subprocess.run(
        [
            sys.executable,
            str(ROOT / "train.py"),
            "--config",
            "tiny",
            "--host-devices",
            "3072",
            "--mesh",
            "model=1",
            "--set",
            "train.batch_size=3072",
            "--dry-run",
            "--workdir",
            str(tmp_path / "w"),
        ],
        capture_output=True,
        text=True,
        env=e,
        cwd=ROOT,
        timeout=240,
    )
    assert p.returncode == 2 and p.stderr.count("\n") == 1, p.stderr[-2000:]
    assert "simulate fewer with --host-devices" in p.stderr
    assert not (tmp_path / "w").exists()
