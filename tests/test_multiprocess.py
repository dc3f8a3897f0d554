"""Multi-process runs on jax.distributed: two processes with 4 simulated CPU devices each
(gloo collectives, coordinator on 127.0.0.1) against one process with 8."""

import signal
import socket
import subprocess
import sys
import time

import pytest
from conftest import ROOT
from helpers import RUN_ARGS, env, losses, run
from tolerances import F32

from megajax.errors import UserError
from megajax.host.distributed import initialize


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def two_processes(*args, timeout=240, program="train.py"):
    """`program` ARGS in two processes of 4 simulated devices each, one run: (stdout, stderr)
    of each, both asserted to exit 0."""
    port = free_port()
    common = [
        sys.executable,
        str(ROOT / program),
        *args,
        "--host-devices",
        "4",
        "--coordinator",
        f"127.0.0.1:{port}",
        "--num-processes",
        "2",
    ]
    procs = [
        subprocess.Popen(
            common + ["--process-id", str(i)],
            env=env(),
            cwd=ROOT,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for i in range(2)
    ]
    outs = [p.communicate(timeout=timeout) for p in procs]
    for p, (_out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    return outs


# Runs of 6 steps on a 2x4 mesh; the schedule is pinned so that 3 + 3 equals 6 straight.
ARGS = [
    *RUN_ARGS,
    "--mesh",
    "2x4",
    "--save-every",
    "3",
    "--eval-every",
    "100",
    "--set",
    "train.decay_steps=6",
]


@pytest.fixture(scope="module")
def one_process_reference(tmp_path_factory):
    wd = tmp_path_factory.mktemp("one")
    run(*ARGS, "--host-devices", "8", "--workdir", str(wd), "--steps", "6")
    return losses(wd)


@pytest.mark.full
@pytest.mark.parametrize(
    "sharding", [[], ["--set", "train.shard_params=true"], ["--mesh", "data=2,pipe=2,model=2"]]
)
def test_two_processes_log_the_losses_of_one(one_process_reference, tmp_path, sharding):
    """Also with FSDP: parameters and Adam state split over the data axis, which here spans the
    two processes (each holds one data shard), and checkpointed from both; and with two
    pipeline stages, one in each process (the outermost mesh axis), their activations and
    gradients sent between the processes."""
    wd = tmp_path / "two"
    (out0, err0), (out1, err1) = two_processes(
        *ARGS, *sharding, "--workdir", str(wd), "--steps", "3"
    )
    # Only process 0 prints, megajax's lines only (not Gloo's C++ "[Gloo] Rank 1 is connected")
    assert "process 0/2" in out0 and "done:" in out0 and "Gloo" not in out0 + err0
    assert ("mesh pipe=2 data=2 model=2" in out0) == ("--mesh" in sharding)
    assert out1 == "" and err1 == ""
    assert len(list((wd / "tensorboard").glob("events.out.tfevents.*"))) == 1  # one writer
    got = losses(wd)
    assert sorted(got) == [1, 2, 3]
    for s in got:
        assert got[s] == pytest.approx(one_process_reference[s], rel=F32)
    # ... and the two-process checkpoint resumes in one process.
    p = run(*ARGS, "--host-devices", "8", "--workdir", str(wd), "--steps", "6")
    assert "resuming from step 3" in p.stdout
    got = losses(wd)
    for s in range(4, 7):
        assert got[s] == pytest.approx(one_process_reference[s], rel=F32)


def test_one_process_checkpoint_resumes_in_two(one_process_reference, tmp_path):
    wd = tmp_path / "back"
    run(*ARGS, "--host-devices", "8", "--workdir", str(wd), "--steps", "3")
    (out0, _), _ = two_processes(*ARGS, "--workdir", str(wd), "--steps", "6")
    assert "resuming from step 3" in out0
    got = losses(wd)
    for s in range(1, 7):
        assert got[s] == pytest.approx(one_process_reference[s], rel=F32)


@pytest.mark.full
def test_killing_one_process_ends_the_other(tmp_path):
    port = free_port()
    wd = tmp_path / "kill"
    cmd = [
        sys.executable,
        str(ROOT / "train.py"),
        *ARGS,
        "--workdir",
        str(wd),
        "--steps",
        "100000",
        "--host-devices",
        "4",
        "--coordinator",
        f"127.0.0.1:{port}",
        "--num-processes",
        "2",
        "--heartbeat-timeout",
        "10",
    ]
    procs = [
        subprocess.Popen(
            cmd + ["--process-id", str(i)],
            env=env(),
            cwd=ROOT,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for i in range(2)
    ]
    deadline = time.time() + 180
    while time.time() < deadline and not (wd / "checkpoints" / "6").is_dir():
        time.sleep(0.1)
    assert (wd / "checkpoints" / "6").is_dir()
    procs[1].kill()
    t = time.time()
    try:
        _, err = procs[0].communicate(timeout=90)
    except subprocess.TimeoutExpired:
        procs[0].kill()
        pytest.fail("the surviving process hung after its peer died")
    assert procs[0].returncode != 0
    assert time.time() - t < 90
    # Whichever notices first: the failed collective (the peer's connection closed) or, when
    # the host is loaded and the collective only hangs, the watchdog; both name a lost peer.
    assert any(
        m in err
        for m in (
            "another process has probably died",
            "another task died",
            "one has probably frozen or died",
        )
    ), err[-2000:]
    # The last complete checkpoint is still readable.
    p = run(
        *ARGS, "--host-devices", "8", "--workdir", str(wd), "--steps", "7", "--save-every", "100"
    )
    assert "resuming from step" in p.stdout


def _start_two(args, port):
    cmd = [
        sys.executable,
        str(ROOT / "train.py"),
        *args,
        "--host-devices",
        "4",
        "--coordinator",
        f"127.0.0.1:{port}",
        "--num-processes",
        "2",
    ]
    return [
        subprocess.Popen(
            cmd + ["--process-id", str(i)],
            env=env(),
            cwd=ROOT,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for i in range(2)
    ]


@pytest.mark.full
@pytest.mark.parametrize("who", ["one", "both"])
def test_a_signal_to_one_process_stops_both_at_the_same_step(tmp_path, who):
    """one: Ctrl-C reaches only process 1 (docs/guides/multi-host.md's `... &` then foreground
    example). both:
    SIGUSR1 (SLURM's warning before a time limit) reaches process 0, then process 1 0.4 s later,
    as it reaches two nodes.
    Either way the stop is agreed, both save the same step and exit 0; the checkpoint resumes
    in one process."""
    wd = tmp_path / "sig"
    procs = _start_two([*ARGS, "--workdir", str(wd), "--steps", "100000"], free_port())
    deadline = time.time() + 180
    while time.time() < deadline and not (wd / "checkpoints" / "3").is_dir():
        time.sleep(0.1)
    if who == "one":
        procs[1].send_signal(signal.SIGINT)
    else:
        procs[0].send_signal(signal.SIGUSR1)
        time.sleep(0.4)
        procs[1].send_signal(signal.SIGUSR1)
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [o[1][-2000:] for o in outs]
    name = "SIGINT" if who == "one" else "SIGUSR1"
    assert f"{name}: saved a checkpoint at step" in outs[0][0]
    step = int(outs[0][0].split("saved a checkpoint at step ")[1].split()[0])
    assert (wd / "checkpoints" / str(step)).is_dir()
    assert (
        sorted(int(d.name) for d in (wd / "checkpoints").iterdir() if d.name.isdigit())[-1] == step
    )
    p = run(
        *ARGS,
        "--host-devices",
        "8",
        "--workdir",
        str(wd),
        "--steps",
        str(step + 1),
        "--save-every",
        "100",
    )
    assert f"resuming from step {step}" in p.stdout


@pytest.mark.full
@pytest.mark.parametrize(
    "other,field",
    [
        (["--save-every", "5"], "config.train.save_every"),
        # before: Gloo failed 51 s later
        (["--mesh", "4x2"], "mesh.axes.data"),
    ],
)
def test_processes_with_different_settings_are_refused_naming_the_field(tmp_path, other, field):
    port = free_port()
    base = [
        sys.executable,
        str(ROOT / "train.py"),
        *ARGS,
        "--workdir",
        str(tmp_path / "w"),
        "--steps",
        "6",
        "--host-devices",
        "4",
        "--coordinator",
        f"127.0.0.1:{port}",
        "--num-processes",
        "2",
    ]
    procs = [
        subprocess.Popen(
            base + ["--process-id", "0"],
            env=env(),
            cwd=ROOT,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        ),
        subprocess.Popen(
            base + ["--process-id", "1", *other],
            env=env(),
            cwd=ROOT,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        ),
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 2 and f"process 1 has a different {field}" in err, err[-2000:]
        assert "Traceback" not in err


@pytest.mark.full
def test_a_frozen_process_ends_the_other_in_one_line(tmp_path):
    """A peer that stops answering (SIGSTOP: a hung host, swapped out) leaves the other waiting in
    a collective: it says so in one line and exits 1, before the runtime's heartbeat check would
    abort it from C++ (exit 134)."""
    wd = tmp_path / "frozen"
    procs = _start_two(
        [*ARGS, "--workdir", str(wd), "--steps", "100000", "--heartbeat-timeout", "10"], free_port()
    )
    deadline = time.time() + 180
    while time.time() < deadline and not (wd / "checkpoints" / "3").is_dir():
        time.sleep(0.1)
    procs[1].send_signal(signal.SIGSTOP)
    try:
        _, err = procs[0].communicate(timeout=60)
    finally:
        procs[1].kill()
        procs[1].communicate()
    assert procs[0].returncode == 1, err[-2000:]
    assert err.strip().splitlines()[-1].startswith("error: process 0 of 2: no progress for"), err[
        -2000:
    ]
    assert "one has probably frozen or died" in err and "Check failure" not in err


# Two processes that join and start JAX's backend; process 1 then ends without the runtime's
# shutdown (as one killed after its run ended does), and process 0 exits as train.py does.
ENDS_ALONE = """
import os, sys, time
import jax
from megajax.cli.common import bound_shutdown
from megajax.host import distributed
pid = int(sys.argv[2])
distributed.initialize(sys.argv[1], 2, pid, heartbeat_timeout_s=4)
jax.devices()
if pid == 1:
    os._exit(0)
time.sleep(1)
sys.exit(bound_shutdown(3))
"""


@pytest.mark.full
def test_a_peer_that_skips_the_shutdown_leaves_one_line_not_an_abort():
    """Before: the survivor waited at the runtime's shutdown barrier until its heartbeat check
    aborted it from C++ three heartbeat timeouts later (exit 134 and a stack dump; 180 s at the
    default 60: the hang CI saw once). Now it leaves after two, with its run's own status."""
    address = f"127.0.0.1:{free_port()}"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", ENDS_ALONE, address, str(i)],
            env=env(),
            cwd=ROOT,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for i in range(2)
    ]
    _, err = procs[0].communicate(timeout=120)
    procs[1].communicate(timeout=30)
    assert procs[0].returncode == 3, err[-3000:]
    assert err.endswith(
        "warning: process 0 of 2: the other processes did not reach the shutdown within 8 s (one "
        "probably ended without it); leaving with the run's status 3\n"
    ), err[-3000:]


@pytest.mark.parametrize(
    "args,message",
    [
        # before: ignored in one
        ((None, None, None, 0), "--heartbeat-timeout must be at least 1 second, got 0"),
        # process; a watchdog at -4 s
        (("127.0.0.1:1234", 2, 0, -5), "--heartbeat-timeout must be at least 1 second"),
        # "must be in 0..-1"
        (("127.0.0.1:1234", 0, 0, 60), "--num-processes must be at least 1, got 0"),
        (("127.0.0.1:1234", 2, 2, 60), "--process-id must be in 0..1, got 2"),
    ],
)
def test_multi_process_arguments_are_checked_before_anything_starts(args, message):
    with pytest.raises(UserError, match=message):
        initialize(*args)
