"""What several test files share: the committed corpus and the tiny run the command-line tests
start; the programs run as a user runs them, in this process (`cli`) or in one of their own;
reading back losses and TensorBoard; the audit's model-axis count without the optimizer's
scalars; the grids whose cases split between the two tiers (`tiered`). (conftest.py holds the
session's setup: simulated devices, the compilation cache, the tiers, tiny_config, mesh_for and
the fixtures built once a run: the trained GPT and the imported Hugging Face models.)"""

import json
import os
import subprocess
import sys
from pathlib import Path

from conftest import ROOT

SHAKESPEARE = ROOT / "data" / "tinyshakespeare.txt"
RUN_ARGS = [
    "--config",
    "tiny",
    "--data",
    f"text:{SHAKESPEARE}",
    "--tokenizer",
    "chars",
    "--sample-tokens",
    "0",
    "--log-every",
    "1",
]
BASE = [*RUN_ARGS, "--host-devices", "8"]
HF_FIXTURES = ROOT / "tests" / "fixtures" / "hf"


def hf_reference(name: str):
    """What transformers computed for a fixture (tests/make_hf_fixtures.py,
    make_llama_fixtures.py)."""
    import numpy as np

    return np.load(HF_FIXTURES / name / "reference.npz")


def env():
    e = dict(os.environ)
    # train.py sets the device count from --host-devices; the other flags (conftest) carry over.
    e["XLA_FLAGS"] = " ".join(
        f
        for f in e.get("XLA_FLAGS", "").split()
        if not f.startswith("--xla_force_host_platform_device_count")
    )
    e["PYTHONPATH"] = str(ROOT)
    return e


def long_run_env():
    """env() for a process that trains for hundreds of steps: LLVM -O1 code, which runs such a
    run in a third of -O0's time (conftest.py). Only for runs compared with each other (its
    last bits are not -O0's)."""
    e = env()
    e["XLA_FLAGS"] = e["XLA_FLAGS"].replace(
        "--xla_backend_optimization_level=0", "--xla_backend_optimization_level=1"
    )
    return e


def run(*args, check=True, timeout=240, env=None, process=False):
    """train.py ARGS: in this process (`cli`) unless `process`, an `env` of its own, or arguments
    only a process of its own can honour (`in_process_ok`)."""
    args = tuple(map(str, args))
    if process or env is not None or not in_process_ok(args):
        p = subprocess.run(
            [sys.executable, str(ROOT / "train.py"), *args],
            capture_output=True,
            text=True,
            env=env or globals()["env"](),
            timeout=timeout,
            cwd=ROOT,
        )
    else:
        p = cli("train", *args)
    if check and p.returncode != 0:
        raise AssertionError(
            f"train.py {' '.join(args)} failed ({p.returncode}):\n{p.stdout}\n{p.stderr}"
        )
    return p


TOOLS = {
    "train": "megajax.cli.train:train_main",
    "eval": "megajax.cli.eval:eval_main",
    "plan": "megajax.cli.plan:plan_main",
    "convert": "megajax.cli.convert:convert_main",
    "prepare": "megajax.cli.prepare:prepare_main",
    "plot": "megajax.cli.plot:plot_main",
}


def in_process_ok(args) -> bool:
    """Whether a command line can run inside the test process: not when it asks for more
    simulated devices than this process has (XLA reads that once, at start-up; fewer, a program
    takes the first N: cli.common.program_devices), nor for a multi-process run."""
    import jax

    args = list(map(str, args))
    for i, a in enumerate(args):
        if (
            a == "--host-devices"
            and i + 1 < len(args)
            and args[i + 1].isdigit()
            and int(args[i + 1]) > jax.device_count()
        ):
            return False
        if a in ("--coordinator", "--num-processes", "--process-id"):
            return False
    return True


def cli(
    tool: str, *args, cwd: Path = ROOT, environ: dict | None = None
) -> subprocess.CompletedProcess:
    """megajax's program TOOL (train, eval, plan, convert, prepare, plot) called in this process
    as its entry point calls it (`TOOL_main(argv) -> status`), with what it prints captured: for
    the tests whose subject is what a program says and writes, not its process (signals, a
    closed pipe, a second process run `run(..., process=True)` or by subprocess). Whatever the
    program sets for its process (signal handlers, standard streams, the environment, train.py's
    command-line flag) is put back afterwards; `environ` adds variables for the call. A bug's
    exception propagates, as a traceback would end the program."""
    import contextlib
    import importlib
    import io
    import signal

    from megajax.host.signals import STOP_SIGNALS, StopRequested

    assert in_process_ok(args), f"{tool} {args} needs a process of its own: run(..., process=True)"
    args = tuple(map(str, args))
    if tool in ("train", "eval") and "--host-devices" not in args:
        args += ("--host-devices", "1")  # what a process of its own has: XLA's one device
    module, name = TOOLS[tool].split(":")
    main = getattr(importlib.import_module(module), name)
    handlers = {s: signal.getsignal(s) for s in STOP_SIGNALS}
    saved_environ, streams = dict(os.environ), (sys.stdout, sys.stderr)
    command_line = StopRequested.command_line
    out, err = io.StringIO(), io.StringIO()
    sys.stdout, sys.stderr = out, err
    try:
        os.environ.update(environ or {})
        with contextlib.chdir(cwd):
            try:
                status = main([str(a) for a in args])
            except SystemExit as e:  # argparse's --help and usage errors, sys.exit(...)
                status = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
                if isinstance(e.code, str):
                    print(e.code, file=sys.stderr)
    finally:
        sys.stdout, sys.stderr = streams
        os.environ.clear()
        os.environ.update(saved_environ)
        StopRequested.command_line = command_line
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    return subprocess.CompletedProcess([tool, *args], status, out.getvalue(), err.getvalue())


def killed_after_checkpoint(args, workdir: Path, step: int, timeout=180, environ=None):
    """train.py ARGS started (in `environ`, default env()), and SIGKILLed as soon as its
    checkpoint `step` exists (asserted): a run cut off with no chance to save or clean up."""
    import signal
    import time

    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "train.py"), *args],
        env=environ or env(),
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.time() + timeout
    while time.time() < deadline and not (workdir / "checkpoints" / str(step)).is_dir():
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert (workdir / "checkpoints" / str(step)).is_dir()


def losses(workdir: Path) -> dict[int, float]:
    out = {}
    for line in (workdir / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        if "loss" in r:
            out[r["step"]] = r["loss"]
    return out


def exact_model_axis_elements(r):
    """Model-axis elements but the optimizer's scalar partial sums of the global grad norm."""
    scalars = [c for c in r.collectives if c.axis == "model" and c.origin == "optimizer"]
    assert all(c.shape == () for c in scalars)
    return r.model_axis_elements - sum(c.count for c in scalars)


def tensorboard_scalars(workdir: Path) -> dict[str, list[tuple[int, float]]]:
    """{tag: [(step, value)]} as TensorBoard itself reads WORKDIR/tensorboard (its event
    accumulator, which applies a resumed run's purge of the steps after its checkpoint)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(workdir / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def assert_tensorboard_is_metrics(workdir: Path):
    """Every number of every metrics.jsonl record is in TensorBoard, as float32, at its step,
    once (train/KEY, val/KEY for val_KEY); and TensorBoard holds nothing else."""
    import numpy as np

    records = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]
    want = {}
    for r in records:
        for k, v in r.items():
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool):
                tag = f"val/{k[4:]}" if k.startswith("val_") else f"train/{k}"
                want.setdefault(tag, []).append((r["step"], float(np.float32(v))))
    got = tensorboard_scalars(workdir)
    assert sorted(got) == sorted(want)
    for tag in want:
        assert got[tag] == want[tag], tag
    return got


def tiered(cases, *default) -> list:
    """A parametrized grid's cases: those in `default` run in both tiers, the others are marked
    `full` and run with `pytest --full` only (docs/testing.md)."""
    import pytest

    return [
        case
        if case in default
        else pytest.param(*(case if isinstance(case, tuple) else (case,)), marks=pytest.mark.full)
        for case in cases
    ]
