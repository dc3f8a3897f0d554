"""A user's tools around a run: TensorBoard event files (read back with TensorBoard's own reader)
and W&B in its offline mode, across a resume; --profile's trace and its time by kind of op; MFU
on each log line."""

import json
import shutil
import struct

import numpy as np
import pytest
from conftest import mesh_for
from helpers import assert_tensorboard_is_metrics, env, run

from megajax.config import load_config
from megajax.errors import UserError
from megajax.runs import tracking
from megajax.tools.profile import KINDS, op_kinds
from megajax.training.profiling import parse_window
from megajax.training.step import make_trainer

TINY = ["--config", "tiny", "--sample-tokens", "0"]


def wandb_records(run_dir):
    """The records of a W&B offline run (run-ID.wandb: W&B's header, then LevelDB-log style
    records in 32 KiB blocks), parsed with W&B's own protobuf schema."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = next(run_dir.glob("run-*.wandb")).read_bytes()
    assert data[:4] == b":W&B"
    pos, block, records, pending = 7, 32768, [], b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header: padding
            pos += block - pos % block
            continue
        length, kind = struct.unpack("<HB", data[pos + 4 : pos + 7])
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL, LAST
            r = pb.Record()
            r.ParseFromString(pending)
            records.append(r)
            pending = b""
        elif kind == 0:
            break
    return records


def test_profile_command_leaves_events_equal_to_metrics_and_a_trace(tmp_path):
    """The command a user runs: event files whose scalars are metrics.jsonl's, the config as
    text, a trace TensorBoard's profile plugin and Perfetto read, and the time by kind; MFU and
    TFLOP/s per device on each log line against a peak the first line names."""
    wd = tmp_path / "run"
    # one device (in this process --mesh auto would span its 8, with the data axis's all-reduces)
    p = run(*TINY, "--host-devices", "1", "--steps", "12", "--profile", "4:6", "--workdir", str(wd))
    got = assert_tensorboard_is_metrics(wd)
    assert [s for s, _ in got["train/loss"]] == [1, 5, 10, 12]
    assert {
        "train/mfu",
        "train/tflops_per_device",
        "train/tokens_per_sec",
        "train/lr",
        "train/grad_norm",
        "val/loss",
        "val/ppl",
    } <= set(got)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(wd / "tensorboard"))
    acc.Reload()
    assert "config/text_summary" in acc.Tags()["tensors"]
    text = acc.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    assert json.loads(text.strip("`\n"))["model"]["hidden"] == 64
    traces = list((wd / "tensorboard" / "plugins" / "profile").iterdir())
    assert len(traces) == 1
    names = {f.name for f in traces[0].iterdir()}
    assert {"perfetto_trace.json.gz", "step.hlo.txt"} <= names
    assert any(n.endswith(".xplane.pb") for n in names)
    line = next(x for x in p.stdout.splitlines() if x.startswith("profile of steps 4-6"))
    ms = {
        k: float(v)
        for k, v in (
            part.split(" ms")[0].rsplit(" ", 1) for part in line.split("by kind: ")[1].split(", ")
        )
    }
    assert set(ms) == set(KINDS)
    assert ms["matmuls"] > 0 and ms["attention"] > 0 and ms["optimizer"] > 0
    # one device: its vocab-parallel embedding and loss keep all-reduces over a group of one
    # device (microseconds), nothing that takes a share of the step
    assert ms["collectives"] < 0.01 * sum(ms.values()), ms
    head = p.stdout.splitlines()[0]
    assert "MFU against" in head and "measured float32 matmul" in head
    step_lines = [
        x
        for x in p.stdout.splitlines()
        if x.startswith("step") and "loss " in x and "val_loss" not in x
    ]
    records = {
        r["step"]: r
        for r in map(json.loads, (wd / "metrics.jsonl").read_text().splitlines())
        if "loss" in r
    }
    for x in step_lines:
        r = records[int(x.split()[1])]
        assert f"MFU {100 * r['mfu']:.1f}%" in x and f"{r['tflops_per_device']:.3g} TFLOP/s" in x


@pytest.mark.full
def test_resume_after_death_past_a_checkpoint_purges_and_resumes_the_wandb_run(tmp_path):
    """A run that logged steps past its last checkpoint and died (its checkpoint 8 gone): the
    rerun resumes at 4, and TensorBoard shows each step once, equal to metrics.jsonl; W&B
    (offline) continues the same run, its records the run's own."""
    wd = tmp_path / "run"
    e = dict(env(), WANDB_MODE="offline", WANDB_PROJECT="megajax-test")
    args = [
        *TINY,
        "--workdir",
        str(wd),
        "--tracker",
        "wandb",
        "--save-every",
        "4",
        "--log-every",
        "1",
        "--eval-every",
        "4",
    ]
    first = run(*args, "--steps", "8", env=e)
    assert "wandb" not in first.stdout.lower() + first.stderr.lower()  # silent
    shutil.rmtree(wd / "checkpoints" / "8")
    second = run(*args, "--steps", "10", env=e)
    assert "resuming from step 4" in second.stdout
    got = assert_tensorboard_is_metrics(wd)
    assert [s for s, _ in got["train/loss"]] == list(range(1, 11))
    run_id = (wd / "wandb" / "run_id").read_text().strip()
    legs = sorted((wd / "wandb").glob(f"offline-run-*-{run_id}"))
    assert len(legs) == 2  # both legs logged to the same run
    metrics = {
        r["step"]: r
        for r in map(json.loads, (wd / "metrics.jsonl").read_text().splitlines())
        if "loss" in r
    }
    records = wandb_records(legs[1])
    history = [
        {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in r.history.item}
        for r in records
        if r.WhichOneof("record_type") == "history"
    ]
    logged = {h["step"]: h for h in history if "train/loss" in h}
    assert sorted(logged) == list(range(5, 11))
    for s, h in logged.items():
        assert h["train/loss"] == metrics[s]["loss"] and h["train/lr"] == metrics[s]["lr"]
    config = next(r.run.config for r in records if r.WhichOneof("record_type") == "run")
    values = {i.key: json.loads(i.value_json) for i in config.update}
    assert values["model"]["hidden"] == 64 and values["train"]["tracker"] == "wandb"


def test_op_kinds_of_a_compiled_sharded_step():
    """The profiler's kinds from a 2x4 step's HLO: its all-reduces are collectives, the AdamW
    update is the optimizer, the attention core's ops are attention and the fused matmuls
    matmuls (each kind found, and every collective named so)."""
    cfg = load_config("tiny", ["model.hidden_dropout=0", "model.attention_dropout=0"])
    trainer = make_trainer(cfg, mesh_for("2x4"))
    text = trainer.lower_step().compile().as_text()
    kinds = op_kinds(text)
    assert set(kinds.values()) == {
        "matmuls",
        "attention",
        "element-wise",
        "collectives",
        "optimizer",
    }
    collectives = [n for n in kinds if n.startswith(("all-reduce", "all-gather", "reduce-scatter"))]
    assert collectives and all(kinds[n] == "collectives" for n in collectives)


@pytest.mark.parametrize("text", ["4", "0:3", "5:4", "a:b", "4:"])
def test_profile_window_checked(text):
    if text == "4":
        assert parse_window(text) == (4, 4)
        return
    with pytest.raises(UserError, match="--profile takes START:STOP"):
        parse_window(text)


def test_wandb_missing_is_one_line(monkeypatch):
    import builtins

    real = builtins.__import__
    monkeypatch.setattr(
        builtins,
        "__import__",
        lambda name, *a, **k: (
            (_ for _ in ()).throw(ImportError(name)) if name == "wandb" else real(name, *a, **k)
        ),
    )
    with pytest.raises(UserError, match=r"pip install 'megajax\[wandb\]'"):
        tracking.check_tracker("wandb")
    tracking.check_tracker("tensorboard")


def test_scalar_names():
    assert tracking.scalars(
        {
            "step": 3,
            "loss": 1.5,
            "val_loss": 2.0,
            "val_ppl": np.float32(7),
            "skipped_steps": 2,
            "grad_norm": None,
            "flag": True,
        }
    ) == {"train/loss": 1.5, "val/loss": 2.0, "val/ppl": 7.0, "train/skipped_steps": 2.0}


def test_the_log_finds_a_gpus_peak_by_its_whole_name():
    """The hardware table (the planner's) gives the log's MFU peak: by whole words of jax's
    device_kind, so that an A100 is not taken for an A10, nor an L40S for an L4."""
    from megajax.hardware import for_device

    named = {
        kind: getattr(for_device(kind), "name", None)
        for kind in (
            "NVIDIA H100 80GB HBM3",
            "NVIDIA H200",
            "NVIDIA A100-SXM4-80GB",
            "NVIDIA A10",
            "NVIDIA L40S",
            "NVIDIA L4",
            "Tesla T4",
            "Tesla V100-SXM2-32GB",
            "NVIDIA A10G",
            "cpu",
        )
    }
    assert named == {
        "NVIDIA H100 80GB HBM3": "h100-80g",
        "NVIDIA H200": "h200",
        "NVIDIA A100-SXM4-80GB": "a100-80g",
        "NVIDIA A10": "a10",
        "NVIDIA L40S": "l40s",
        "NVIDIA L4": "l4",
        "Tesla T4": "t4",
        "Tesla V100-SXM2-32GB": "v100-dgx2h",
        "NVIDIA A10G": None,
        "cpu": None,
    }
