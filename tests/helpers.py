"""What several test files share: the committed corpus and the tiny run the command-line tests
start, running train.py as a user does, reading back its losses, the audit's model-axis
count without the optimizer's scalars, and the Hugging Face fixtures imported once a module.
(conftest.py holds the session's setup: simulated devices, the compilation cache, tiny_config and
mesh_for.)"""
import json
import os
import subprocess
import sys
from pathlib import Path

from conftest import ROOT

SHAKESPEARE = ROOT / "data" / "tinyshakespeare.txt"
RUN_ARGS = ["--config", "tiny", "--data", f"text:{SHAKESPEARE}", "--tokenizer", "chars",
            "--sample-tokens", "0", "--log-every", "1"]
BASE = [*RUN_ARGS, "--host-devices", "8"]
HF_FIXTURES = ROOT / "tests" / "fixtures" / "hf"


def import_hf_fixtures(root: Path, names, settings) -> dict:
    """{name: (its imported config, its workdir under root)} for the tests/fixtures/hf/ models."""
    from megajax.convert import import_hf
    return {name: (import_hf(HF_FIXTURES / name, root / name, settings), root / name)
            for name in names}


def hf_reference(name: str):
    """What transformers computed for a fixture (tests/make_hf_fixtures.py,
    make_llama_fixtures.py)."""
    import numpy as np
    return np.load(HF_FIXTURES / name / "reference.npz")


def env():
    e = dict(os.environ)
    # train.py sets the device count from --host-devices; the other flags (conftest) carry over.
    e["XLA_FLAGS"] = " ".join(f for f in e.get("XLA_FLAGS", "").split()
                              if not f.startswith("--xla_force_host_platform_device_count"))
    e["PYTHONPATH"] = str(ROOT)
    return e


def run(*args, check=True, timeout=240, env=None):
    p = subprocess.run([sys.executable, str(ROOT / "train.py"), *args], capture_output=True,
                       text=True, env=env or globals()["env"](), timeout=timeout, cwd=ROOT)
    if check and p.returncode != 0:
        raise AssertionError(
            f"train.py {' '.join(args)} failed ({p.returncode}):\n{p.stdout}\n{p.stderr}")
    return p


def killed_after_checkpoint(args, workdir: Path, step: int, timeout=180):
    """train.py ARGS started, and SIGKILLed as soon as its checkpoint `step` exists (asserted):
    a run cut off with no chance to save or clean up."""
    import signal
    import time
    proc = subprocess.Popen([sys.executable, str(ROOT / "train.py"), *args], env=env(), cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
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
