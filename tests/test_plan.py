"""The planner (megajax/plan/) against what it predicts from: the dry run's compiled memory, the
audit's collective volumes, the paper's formulas and scaling study; and its command line."""

import dataclasses
import json
import math
import os
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import pytest
from conftest import ROOT, TEST_XLA_FLAGS, handles_signal, mesh_for, tiny_config
from helpers import cli, tiered

from megajax.cli.plan import plan_main
from megajax.config import ConfigError, load_config, with_values
from megajax.core.mesh import make_mesh
from megajax.core.sharding import MODEL
from megajax.errors import UserError
from megajax.mesh_shape import MeshShape
from megajax.plan import BUILTIN, measured, paper, paper2021, pick_hardware, plan, timing
from megajax.plan.memory import kept_activation_bytes, memory_bytes, state_split
from megajax.plan.report import why
from megajax.plan.search import SCHEMES
from megajax.plan.volumes import data_axis_sent, model_axis_elements, paper_flops, step_flops
from megajax.tools.audit import audit_hlo
from megajax.training.memory import per_device_bytes, step_memory
from megajax.training.step import make_trainer

MEMORY_TOLERANCE = 0.10  # the bound on predicted against compiled peak bytes

# XLA:CPU's plans (`backend="cpu"`), in float32: how XLA:CPU stores 16-bit activations changed
# between jax releases (0.10 keeps them as float32 plus a 16-bit copy of the checkpoints; 0.12
# as 16-bit, what an accelerator does), float32 is stored as float32 by both.
# (config, data, model, overrides): a paper config on model=8, sequence parallelism with
# selective recomputation, no recomputation, BERT; and on 64 devices (a subprocess) plain and
# FSDP. (ZeRO-1 differs from plain in the optimizer state, which is exact, and in its gradient
# buffers: one whole accumulator, the other copies slices; the MoE points below check it.)
# Scanned stacks without full remat: with LayerNorm's and GeLU's outputs recomputed, and (the
# default) with Megatron's set kept.
F32 = "model.compute_dtype=float32"
RECOMPUTE = "model.recompute_norm_gelu=true"
LOCAL_POINTS = [
    ("gpt2_8.3b", 1, 8, [F32]),
    (
        "gpt2_355m",
        2,
        4,
        [
            F32,
            RECOMPUTE,
            "train.microbatches=16",
            "model.remat=selective",
            "model.sequence_parallel=true",
        ],
    ),
    ("gpt2_355m", 2, 4, [F32, RECOMPUTE, "train.microbatches=64", "model.remat=none"]),
    (
        "gpt2_355m",
        2,
        4,
        [F32, "model.recompute_norm_gelu=false", "train.microbatches=64", "model.remat=none"],
    ),
    ("bert_336m", 2, 4, [F32]),
]
# (config, data, model, overrides, pipeline stages): ... and a 70B Llama on the plan the
# planner picks for 64 H100s with plain data parallelism (remat full: the CPU's float32 copy
# fits a GPU's 80 GB too)
WIDE_POINTS = [
    ("gpt2_8.3b", 8, 8, [F32, "train.microbatches=8"], 1),
    ("gpt2_8.3b", 8, 8, [F32, "train.microbatches=8", "train.shard_params=true"], 1),
    (
        "llama3.1_70b",
        2,
        4,
        [F32, "train.microbatches=128", "model.remat=full", "model.sequence_parallel=true"],
        8,
    ),
]

WIDE_SCRIPT = """
import json, sys, jax
from megajax.cli.plan import plan_main
from megajax.config import ConfigError, load_config, with_values
from megajax.core.mesh import make_mesh
from megajax.training.memory import per_device_bytes, step_memory
from megajax.training.step import make_trainer
for name, dp, tp, sets, pp in json.loads(sys.argv[1]):
    mesh = make_mesh(f"data={dp},pipe={pp},model={tp}", jax.devices()[:dp * tp * pp])
    compiled = make_trainer(load_config(name, sets), mesh).lower_step().compile()
    print(step_memory(compiled)["step_peak_bytes"])
"""


def compiled_peak(name, dp, tp, sets) -> int:
    cfg = load_config(name, sets)
    return step_memory(make_trainer(cfg, mesh_for(f"{dp}x{tp}")).lower_step().compile())[
        "step_peak_bytes"
    ]


@pytest.mark.parametrize("name,dp,tp,sets", tiered(LOCAL_POINTS, LOCAL_POINTS[1]))
def test_memory_within_ten_percent_of_the_compiled_step(name, dp, tp, sets):
    predicted = memory_bytes(load_config(name, sets), MeshShape(data=dp, model=tp), backend="cpu")[
        "total"
    ]
    assert predicted == pytest.approx(compiled_peak(name, dp, tp, sets), rel=MEMORY_TOLERANCE)


@pytest.mark.full
@pytest.mark.parametrize(
    "sets",
    [
        [],
        ["model.num_layers=8", "train.shard_optimizer=true"],
        ["model.num_layers=8", "train.shard_params=true"],
    ],
    ids=["plain", "zero", "fsdp"],
)
def test_pipelined_memory_within_ten_percent_of_the_compiled_step(sets):
    """Two stages, each split over model=2, two data shards: the stage's state (with ZeRO-1 its
    Adam moments, with FSDP its weights too, split over "data"), the 1F1B schedule's stage
    inputs and the backward tick's recomputed stage."""
    cfg = load_config("gpt2_355m", [F32, "train.microbatches=8", "train.batch_size=32", *sets])
    compiled = make_trainer(cfg, make_mesh("data=2,pipe=2,model=2")).lower_step().compile()
    predicted = memory_bytes(cfg, MeshShape(data=2, pipe=2, model=2), backend="cpu")["total"]
    assert predicted == pytest.approx(
        step_memory(compiled)["step_peak_bytes"], rel=MEMORY_TOLERANCE
    )


def compiled_peaks(points, devices: int) -> list[int]:
    """The compiled train steps' peak bytes per device, on `devices` simulated devices."""
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices} {TEST_XLA_FLAGS}",
    }
    out = subprocess.run(
        [sys.executable, "-c", WIDE_SCRIPT, json.dumps(points)],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    return list(map(int, out))


@pytest.mark.full
def test_the_1t_gpt_fits_on_the_plan_megajax_plan_picks_within_ten_percent():
    """Narayanan et al.'s 1T GPT on 3,072 A100s: megajax-plan picks the paper's layout,
    data=6,pipe=64,model=8, with ZeRO-1 over the six data replicas. One replica of that plan
    (512 simulated devices, float32) compiles to a step that fits an 80 GB GPU, within 10% of
    the planner's bytes."""
    best = plan("gpt_1t", 3072, "a100-80g")[0]
    assert (best.data, best.pipe, best.model) == (6, 64, 8) and best.fits
    sets = [
        F32,
        f"train.batch_size={3072 // best.data}",
        f"train.microbatches={best.microbatches}",
        f"model.remat={best.remat}",
        f"model.sequence_parallel={best.sequence_parallel}",
        *[f"{k}={v}" for k, v in SCHEMES[best.scheme].items()],
    ]
    [peak] = compiled_peaks([("gpt_1t", 1, best.model, sets, best.pipe)], 512)
    predicted = memory_bytes(
        load_config("gpt_1t", sets), MeshShape(pipe=best.pipe, model=best.model), backend="cpu"
    )["total"]
    assert predicted == pytest.approx(peak, rel=MEMORY_TOLERANCE)
    assert peak < BUILTIN["a100-80g"].memory_bytes, peak


@pytest.mark.full
def test_memory_within_ten_percent_on_64_devices():
    peaks = compiled_peaks(WIDE_POINTS, 64)
    for (name, dp, tp, sets, pp), peak in zip(WIDE_POINTS, peaks, strict=True):
        predicted = memory_bytes(
            load_config(name, sets), MeshShape(data=dp, pipe=pp, model=tp), backend="cpu"
        )["total"]
        assert predicted == pytest.approx(peak, rel=MEMORY_TOLERANCE), (name, sets)
        if pp > 1:
            assert peak < BUILTIN["h100-80g"].memory_bytes, peak
    best = plan("llama3.1_70b", 64, "h100-80g", schemes=("plain",))[0]
    assert (best.data, best.pipe, best.model) == (2, 8, 4)


# The runs megajax/plan/measured.py records from one H200 (bench/gpu_check.py): XLA's memory
# plans of the compiled step, and the step times. The plans still held bf16 weight copies that
# the scanned stack no longer keeps (2.1 GiB at 1.2B); with or without them, within the bound.
PLANNED = [r for r in measured.H200 if r.plan_gib is not None]


@pytest.mark.parametrize("run", PLANNED, ids=lambda r: f"{r.config}-{r.overrides[-1]}")
def test_memory_within_ten_percent_of_the_h200s_compiled_plans(run):
    gpu, cpu = (
        memory_bytes(run.cfg(), MeshShape(), backend=b)["total"] / 2**30 for b in ("gpu", "cpu")
    )
    assert gpu == pytest.approx(run.plan_gib, rel=MEMORY_TOLERANCE)
    assert abs(gpu - run.plan_gib) < abs(cpu - run.plan_gib)  # XLA:CPU's rules miss by 9-49%


# The "megajax" stack's one constant is fitted on the 1.2B step (exact); the rest are predictions:
# within 10%, but the run with the paper's attention dropout, whose mask bits (b·heads·s² a
# layer, then one threefry call each) the model leaves out: 15.9% short.
STEP_TOLERANCE, STEP_KNOWN_MISSES = 0.10, {2: 0.20}


def test_h200_step_times_predicted():
    assert measured.calibrate() == pytest.approx(timing.XLA_MATMUL_EFFICIENCY, rel=1e-3)
    for i, run in enumerate(measured.H200):
        assert measured.predicted_ms(run) == pytest.approx(
            run.step_ms, rel=STEP_KNOWN_MISSES.get(i, STEP_TOLERANCE)
        ), i
    # the paper's stack on the same machine would be 2-3x slow: what the planner said before
    paper_stack = dataclasses.replace(BUILTIN["h200"], stack="megatron-2019")
    run = measured.CALIBRATED_ON
    assert timing.step_time(run.cfg(), MeshShape(), paper_stack).seconds * 1000 > 2 * run.step_ms


def test_gradient_copies_and_logit_bytes_by_backend():
    """The two rules that differ between XLA:GPU's and XLA:CPU's plans, by hand."""
    cfg = load_config(
        "gpt2_355m", ["model.compute_dtype=bfloat16", "train.microbatches=1", "model.remat=none"]
    )
    gpu, cpu = memory_bytes(cfg, MeshShape()), memory_bytes(cfg, MeshShape(), backend="cpu")
    assert gpu["gradients"] == gpu["params"] and cpu["gradients"] == 2 * cpu["params"]
    rows = cfg.train.batch_size * cfg.model.seq_len * cfg.model.padded_vocab
    assert (gpu["working"], cpu["working"]) == ((4 + 2) * rows, 3 * 4 * rows)
    accumulating = with_values(cfg, {"train.microbatches": 2})
    assert memory_bytes(accumulating, MeshShape())["gradients"] == 2 * gpu["params"]
    with pytest.raises(ValueError, match="backend"):
        memory_bytes(cfg, MeshShape(), backend="tpu")


def test_parameters_and_optimizer_state_are_the_dry_runs_exactly():
    cfg = tiny_config(num_layers=2)
    cfg.train.batch_size, cfg.train.shard_params = 8, True
    trainer = make_trainer(cfg, mesh_for("2x4"))
    params, opt = trainer.abstract_state()
    predicted = memory_bytes(cfg, MeshShape(data=2, model=4))
    assert predicted["params"] == per_device_bytes(params)
    assert predicted["optimizer"] == per_device_bytes(opt)


# Every option for GPT; for BERT (whose heads read only their rows) the forms that differ.
COMM_CASES = [
    ("gpt", "2x4", {}),
    ("gpt", "2x4", {"sequence_parallel": True}),
    ("gpt", "2x4", {"remat": "full"}),
    ("gpt", "2x4", {"sequence_parallel": True, "remat": "full"}),
    ("gpt", "2x4", {"remat": "selective"}),
    ("gpt", "2x4", {"shard_optimizer": True}),
    ("gpt", "2x4", {"shard_params": True}),
    ("gpt", "1x8", {}),
    ("gpt", "1x8", {"sequence_parallel": True, "remat": "full"}),
    ("bert", "2x4", {}),
    ("bert", "2x4", {"sequence_parallel": True, "remat": "full"}),
    ("bert", "2x4", {"shard_params": True}),
]


@pytest.mark.parametrize("kind,mesh,options", tiered(COMM_CASES, COMM_CASES[3], COMM_CASES[11]))
def test_communication_volumes_are_the_audits(kind, mesh, options):
    model = {k: v for k, v in options.items() if k in ("sequence_parallel", "remat")}
    cfg = tiny_config(num_layers=2, kind=kind, **model)
    cfg.train.batch_size, cfg.train.microbatches = 16, 2
    cfg.train.shard_optimizer = options.get("shard_optimizer", False)
    cfg.train.shard_params = options.get("shard_params", False)
    cfg = cfg.validate()
    m = mesh_for(mesh)
    trainer = make_trainer(cfg, m)
    shape = MeshShape.of(m)
    audit = audit_hlo(trainer.lower_step().compile().as_text(), cfg, shape, trainer=trainer)
    # the audit's analytic forms, and what it found compiled but the optimizer's and the
    # metrics' scalar reductions (the gradient norm's partial sums), exactly
    planned = sum(model_axis_elements(cfg, shape).values())
    assert (
        planned
        == audit.analytic_min_elements + audit.remat_extra_elements + audit.regathered_elements
    )
    scalars = sum(
        c.elements * c.count
        for c in audit.collectives
        if MODEL in c.axis and c.origin in ("optimizer", "metrics")
    )
    assert planned == audit.model_axis_elements - scalars
    sent, least = data_axis_sent(cfg, shape), audit.data_axis_minimum
    if audit.data_scheme == "plain":
        # once per microbatch, as compiled (the tied embedding's two contributions apart: a little
        # more)
        assert sent["gradients"] == cfg.train.microbatches * least.get("gradients", 0)
        assert sent["gradients"] <= audit.data_axis_sent("gradients") <= 1.1 * sent["gradients"]
        return
    assert sent["gradients"] == pytest.approx(least["gradients"], rel=1e-12)
    assert sent["params"] == pytest.approx(least["params"], rel=1e-12)
    assert sent["regather"] == pytest.approx(least.get("regather", 0), rel=1e-12)
    assert sent["gradients"] + sent["params"] == pytest.approx(
        audit.data_axis_sent("gradients")
        + audit.data_axis_sent("params")
        - audit.data_axis_regathered,
        rel=1e-9,
    )


def test_flops_are_the_papers_formula():
    for remat, full in (("full", True), ("none", False)):
        cfg = load_config("gpt2_8.3b", [f"model.remat={remat}"])
        assert step_flops(cfg) == pytest.approx(paper_flops(cfg, full_recompute=full), rel=1e-12)


# The planner's figures for the paper's scaling study, and how far each may be from the
# paper's. Two constants are fitted on two figures (exact); the rest are predictions: within
# 5 points (weak scaling) and 10% (strong scaling) but for the 2.5B and 8.3B models with
# 64-way data parallelism, which no model of the all-reduce as bytes over a fixed bandwidth can
# both meet (test_two_data_parallel_figures_cannot_both_be_met; docs/concepts/planner.md).
KNOWN_MISSES = {("model_and_data_parallel", 1): 10, ("model_and_data_parallel", 3): 8}


def test_scaling_study_reproduced():
    study = paper.scaling_study()
    assert study["baseline_tflops"] == pytest.approx(paper.PAPER["baseline_tflops"], rel=1e-3)
    assert study["model_parallel"][3] == pytest.approx(paper.PAPER["model_parallel"][3], abs=0.1)
    for key in ("model_parallel", "model_and_data_parallel"):
        for i, (ours, theirs) in enumerate(zip(study[key], paper.PAPER[key])):
            assert abs(ours - theirs) <= KNOWN_MISSES.get((key, i), 5), (key, i, ours, theirs)
    for ours, theirs in zip(study["strong_scaling"], paper.PAPER["strong_scaling"]):
        assert ours == pytest.approx(theirs, rel=0.10)


def test_two_data_parallel_figures_cannot_both_be_met():
    """The paper's own figures, read as "the 64-way step is the model-parallel one plus the
    gradient all-reduce": the 2.5B's 83% needs a node bandwidth of at most 52 GB/s to be met
    within 5 points, the 8.3B's 74% at least 119 GB/s (more than the DGX-2H's 100 GB/s), even
    counting only the least traffic any all-reduce algorithm sends. The planner's data-axis
    time is exactly that model (each node's ring traffic over its adapters), so its two misses
    are forced and the other two figures' windows hold its bandwidth."""
    windows = paper.node_bandwidth_windows()
    hw = BUILTIN["v100-dgx2h"]
    small, big = windows["gpt2_2.5b"], windows["gpt2_8.3b"]
    assert small["high"] < big["low"] * small["node_bytes_lower"] / small["node_bytes"]
    assert big["low"] * big["node_bytes_lower"] / big["node_bytes"] > hw.inter_node_bandwidth
    for name, tp in zip(paper.CONFIGS, paper.MODEL_PARALLEL):
        mesh = MeshShape(data=paper.DATA_PARALLEL, model=tp)
        seconds = timing.communication_seconds(
            paper.study_config(name, mesh), mesh, hw, paper.PAPER_GRADIENT_BYTES
        )
        # The ring's 126 steps of InfiniBand latency are the only other term (1.3 ms).
        assert seconds["data_axis"] == pytest.approx(
            windows[name]["node_bytes"] / hw.inter_node_bandwidth, abs=2e-3
        )
        inside = windows[name]["low"] <= hw.inter_node_bandwidth <= windows[name]["high"]
        assert inside == (name in ("gpt2_1.2b", "gpt2_4.2b")), name


def test_calibration_reproduces_the_constants():
    efficiency, overhead = paper.calibrate()
    assert efficiency == pytest.approx(timing.MATMUL_EFFICIENCY, rel=1e-3)
    assert overhead == pytest.approx(timing.LAYER_OVERHEAD_SECONDS, rel=1e-3)


def test_2021_weak_scaling_table_reproduced_within_5_points():
    """Narayanan et al. 2021, Table 1: 1.7B to 1T parameters on 32 to 3,072 A100s, tensor
    parallelism in a node and pipeline stages across nodes. One constant (the matmul
    efficiency) is fitted on the first row; every other row is the planner's prediction, within
    5 points of the paper's share of peak, and the step the planner prices carries the 1F1B
    bubble and the sends between stages."""
    assert paper2021.calibrate() == pytest.approx(timing.MATMUL_EFFICIENCY_2021, rel=1e-3)
    for row in paper2021.TABLE_1:
        assert abs(paper2021.predicted_percent(row) - row.percent) <= 5, row
    for page in ("README.md", "docs/concepts/planner.md"):  # side by side, as computed
        assert paper2021.table() in (ROOT / page).read_text(encoding="utf-8"), page
    big = paper2021.TABLE_1[-1]
    cfg = paper2021.row_config(big)
    parts = timing.step_time(cfg, big.mesh, paper2021.selene(), 2).parts
    assert parts["pipeline"] > 0
    assert timing.pipeline_ticks(cfg, big.mesh) == big.batch // big.dp + big.pp - 1
    # twice the microbatches of the same size: the ticks, not the time, double, as the 63 of
    # fill and drain stay
    m = big.batch // big.dp
    twice = with_values(cfg, {"train.batch_size": 2 * big.batch, "train.microbatches": 2 * m})
    longer = timing.compute_seconds(twice, big.mesh, paper2021.selene())
    assert longer["matmuls"] / parts["matmuls"] == pytest.approx(
        (2 * m + big.pp - 1) / (m + big.pp - 1), rel=1e-9
    )


def test_a_model_beyond_a_nodes_tensor_parallel_group_is_pipelined():
    """The 2021 paper's point: the 39.1B model's state does not fit a node's 8 A100s split
    over "model" alone with plain data parallelism, and the model axis across nodes is slow;
    the planner puts stages across the nodes and keeps the model axis inside one."""
    cfg = paper2021.row_config(paper2021.TABLE_1[4])
    plans = plan(cfg, 16, "a100-80g", schemes=("plain",))
    best = plans[0]
    assert best.fits and best.pipe > 1 and best.model <= 8
    assert best.links["model"] == "intra-node" and "pipe" in best.links
    flat = next(p for p in plans if p.fits and p.pipe == 1)
    assert flat.model == 16 and flat.links["model"] == "inter-node"
    assert flat.step_seconds > best.step_seconds


def test_best_plan_for_8_3b_on_8_v100s_is_model_parallel():
    """With the paper's data parallelism (no ZeRO / FSDP), the 8.3B model fits 8 V100s only
    split over "model"; the plans that do not fit say by how much."""
    plans = plan("gpt2_8.3b", 8, "v100-dgx2h", schemes=("plain",))
    best = plans[0]
    assert best.fits and best.model > 1 and best.data * best.model == 8
    # whole on one GPU: 8.3B x 16 bytes > 32 GiB
    assert not any(p.fits for p in plans if p.model == 1)
    least = min((p for p in plans if not p.fits), key=lambda p: p.memory["total"])
    over = (least.memory["total"] - least.device_bytes) / 2**30
    over_text = f"{over:.1f}" if over >= 1 else f"{over:.2f}"  # report.py's two precisions
    assert f"{over_text} GiB more than the 32.0 GiB" in why(least, [least])


def test_command_line_json_and_errors(tmp_path, capsys):
    out = cli("plan", "--config", "gpt2_1.2b", "--devices", "8", "--hardware", "h200", "--json")
    assert out.returncode == 0, out.stderr
    plans = json.loads(out.stdout)["plans"]
    assert plans[0]["fits"] and plans[0]["mesh"].startswith("data=")
    assert {"memory_bytes", "step_seconds", "tokens_per_s", "mfu", "scaling_efficiency"} <= set(
        plans[0]
    )
    toml = tmp_path / "gpus.toml"
    toml.write_text(
        "[tiny-gpu]\n"
        "peak_flops = 1e12\n"
        "memory_bytes = 1e9\n"
        "hbm_bandwidth = 1e11\n"
        "gpus_per_node = 4\n"
        "intra_node_bandwidth = 1e10\n"
        "inter_node_bandwidth = 1e9\n"
    )
    assert plan_main(["--config", "gpt2_8.3b", "--devices", "4", "--hardware", str(toml)]) == 0
    assert "No plan fits" in capsys.readouterr().out
    assert pick_hardware(str(toml)).gpus_per_node == 4
    toml.write_text("[bad]\npeak_flops = -1\n")
    for args in (
        ["--hardware", "tpu-v9"],
        ["--hardware", str(toml)],
        ["--devices", "0"],
        ["--config", "nope"],
        # (the last: at once)
        ["--schemes", "zero3"],
        ["--top", "0"],
        ["--devices", str(10**14)],
    ):
        assert plan_main(["--config", "tiny", "--devices", "8"] + args) == 2, args
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("error:"), (args, err)
    for devices in ("8", 8.0, True):  # from Python: a TypeError deep in the search before
        with pytest.raises(
            UserError, match=f"--devices must be an integer of at least 1, got {devices!r}"
        ):
            plan("tiny", devices, "h100-80g")


@pytest.mark.full
def test_ctrl_c_stops_the_planner_in_one_line():
    """Ctrl-C while megajax-plan searches (512 devices: a few seconds): one line and 128 + SIGINT,
    not a KeyboardInterrupt traceback."""
    p = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "megajax.plan",
            "--config",
            "gpt2_8.3b",
            "--devices",
            "512",
            "--hardware",
            "h100-80g",
        ],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    # (Python handles SIGINT from its start)
    while p.poll() is None and not handles_signal(p.pid, signal.SIGTERM):
        time.sleep(0.01)
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=120)
    assert (
        p.returncode == 128 + signal.SIGINT and err == "stopped by SIGINT: nothing was planned\n"
    ), err


def test_microbatches_cost_their_weight_traffic():
    """megajax's stack has no fixed cost per layer; what a microbatch adds is reading every weight
    and writing (accumulating) its gradient. By hand: splitting a batch in two adds exactly that
    traffic (the matmuls, the activations' passes and the scan's copies scale with the rows)."""
    hw = BUILTIN["h200"]
    one = load_config(
        "gpt2_355m", ["train.batch_size=16", "train.microbatches=1", "model.remat=none"]
    )
    two = with_values(one, {"train.microbatches": 2})
    t1, t2 = (timing.compute_seconds(c, MeshShape(), hw) for c in (one, two))
    shard = state_split(one, MeshShape()).model_shard
    extra = (
        (
            2 * (timing.WEIGHT_BYTES_PER_PARAM + timing.ACCUMULATE_BYTES_PER_PARAM)
            - timing.WEIGHT_BYTES_PER_PARAM
        )
        * shard
        / hw.hbm_bandwidth
    )
    assert t2["elementwise"] - t1["elementwise"] == pytest.approx(extra, rel=1e-9)
    assert (
        t2["matmuls"] == pytest.approx(t1["matmuls"], rel=1e-9)
        and t2["overhead"] == t1["overhead"] == 0
    )


def test_layer_programs_save_the_scans_copies_and_take_plain_data_parallelism():
    """train.layer_programs keeps each layer's activations in buffers of their own: by hand, the
    step is the scan's less its copies of the kept activations, and only plain data-parallel
    plans are made (asked for with ZeRO-1 or FSDP alone: one error line)."""
    hw = BUILTIN["h200"]
    scan = load_config(
        "gpt2_355m", ["train.batch_size=16", "train.microbatches=1", "model.remat=none"]
    )
    programs = with_values(scan, {"train.layer_programs": True})
    t_scan, t_programs = (timing.compute_seconds(c, MeshShape(), hw) for c in (scan, programs))
    copies = timing.SCAN_COPY_PASSES * kept_activation_bytes(scan, MeshShape()) / hw.hbm_bandwidth
    assert t_scan["elementwise"] - t_programs["elementwise"] == pytest.approx(copies, rel=1e-9)
    assert t_programs["matmuls"] == t_scan["matmuls"]
    found = plan("gpt2_355m", 8, "h200", ["train.layer_programs=true"])
    assert found and all(p.scheme == "plain" and p.layer_programs for p in found)
    assert "layer programs" in why(found[0], found)
    with pytest.raises(UserError, match="--schemes plain"):
        plan("gpt2_355m", 8, "h200", ["train.layer_programs=true"], schemes=("zero", "fsdp"))


def test_hardware_files_name_their_stack(tmp_path, capsys):
    gpu = (
        "peak_flops = 1e15\n"
        "memory_bytes = 8e10\n"
        "hbm_bandwidth = 3e12\n"
        "gpus_per_node = 8\n"
        "intra_node_bandwidth = 4e11\n"
        "inter_node_bandwidth = 4e11\n"
    )
    toml = tmp_path / "gpus.toml"
    toml.write_text(f'[ours]\n{gpu}[theirs]\n{gpu}stack = "megatron-2019"\n')
    ours, theirs = (pick_hardware(f"{toml}:{n}") for n in ("ours", "theirs"))
    assert (ours.stack, theirs.stack) == ("megajax", "megatron-2019")
    assert timing.stack_constants(theirs)[:2] == (
        timing.MATMUL_EFFICIENCY,
        timing.LAYER_OVERHEAD_SECONDS,
    )
    assert timing.stack_constants(ours).matmul_efficiency == timing.XLA_MATMUL_EFFICIENCY
    toml.write_text(f'[bad]\n{gpu}stack = "pytorch"\n')
    assert plan_main(["--config", "tiny", "--devices", "8", "--hardware", str(toml)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "stack must be one of megajax, megatron-2019" in err
    # not UTF-8: a UnicodeDecodeError traceback before
    toml.write_bytes(b'[ours]\nname = "caf\xe9"\n')
    assert plan_main(["--config", "tiny", "--devices", "8", "--hardware", str(toml)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"hardware file {toml} is not valid TOML" in err


@pytest.mark.parametrize(
    "line,message",
    [
        # before: a table of NaN, exit 0
        ("peak_flops = nan", "[gpu] peak_flops must be a finite number, got nan"),
        ("hbm_bandwidth = inf", "[gpu] hbm_bandwidth must be a finite number, got inf"),
        # before: ZeroDivisionError
        ("gpus_per_node = 0.5", "[gpu] gpus_per_node counts whole GPUs, got 0.5"),
        # before: ZeroDivisionError
        ("peak_flops = 1e-300", "[gpu] peak_flops = 1e-300 is outside 1e+09..1e+18"),
        ("inter_node_latency = 0.0", "[gpu] inter_node_latency = 0 is outside"),
        ("memory_bytes = 1e300", "[gpu] memory_bytes = 1e+300 is outside"),
    ],
)
def test_a_hardware_file_holds_finite_physical_numbers(tmp_path, capsys, line, message):
    """Every field finite, whole where it counts GPUs, and within bounds no accelerator is near;
    the JSON output is JSON (no bare NaN) because no such number reaches the arithmetic."""
    fields = {
        "peak_flops": "1e15",
        "memory_bytes": "8e10",
        "hbm_bandwidth": "3e12",
        "gpus_per_node": "8",
        "intra_node_bandwidth": "4e11",
        "inter_node_bandwidth": "4e11",
    }
    key, value = (s.strip() for s in line.split("="))
    fields[key] = value
    toml = tmp_path / "gpus.toml"
    toml.write_text("[gpu]\n" + "".join(f"{k} = {v}\n" for k, v in fields.items()))
    assert plan_main(["--config", "tiny", "--devices", "8", "--hardware", str(toml), "--json"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and message in err, err
    fields[key] = "8" if key == "gpus_per_node" else "1e-5" if "latency" in key else "1e12"
    toml.write_text("[gpu]\n" + "".join(f"{k} = {v}\n" for k, v in fields.items()))
    assert plan_main(["--config", "tiny", "--devices", "8", "--hardware", str(toml), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["plans"]


def test_builtin_hardware_cites_its_sources():
    assert {"v100-dgx2h", "a100-80g", "h100-80g", "h200", "t4"} <= set(BUILTIN)
    assert all(h.source for h in BUILTIN.values())


def test_plan_options_are_validated_copies():
    """The planner's variants are validated copies: the config it was given is untouched, and
    a combination the trainer would refuse is refused here too."""
    base = load_config("gpt2_355m")
    cfg = with_values(base, {"model.sequence_parallel": True, "train.shard_params": True})
    assert cfg.model.sequence_parallel and cfg.train.shard_params
    assert not base.model.sequence_parallel and not base.train.shard_params
    with pytest.raises(ConfigError, match="attention_dropout"):
        with_values(base, {"model.attention": "fused"})


def test_mesh_auto_keeps_every_device_on_data_unless_the_model_does_not_fit(monkeypatch):
    """`--mesh auto` is every device on "data" when the run fits a device, as it always was;
    when it does not, the fastest mesh the planner predicts to fit, with the run's options."""
    from megajax.plan.auto import auto_mesh, resolve_mesh
    from megajax.training import memory

    three, flat = 3 * 2**30, MeshShape(data=8)
    assert auto_mesh(load_config("tiny"), 8, three, "gpu") == (flat, None)
    cfg = load_config("gpt2_355m")
    assert memory_bytes(cfg, flat)["total"] > three
    mesh, why = auto_mesh(cfg, 8, three, "gpu")
    assert mesh.devices == 8 and mesh.data < 8
    assert memory_bytes(cfg, mesh)["total"] <= three
    assert MeshShape.parse(str(mesh), 8) == mesh  # the line names the mesh as --mesh takes it
    assert why.startswith("--mesh auto: every device on the data axis would need about")
    assert f"running {mesh}," in why
    # the same through train.py's and eval.py's --mesh, on this machine's 8 simulated devices
    monkeypatch.setattr(memory, "device_memory_bytes", lambda: three)
    assert resolve_mesh("auto", lambda: cfg) == auto_mesh(cfg, 8, three, "cpu")
    assert resolve_mesh("auto", lambda: cfg)[0] != flat
    assert resolve_mesh("data=2,model=4", lambda: cfg) == (MeshShape(data=2, model=4), None)
    monkeypatch.setattr(memory, "device_memory_bytes", lambda: 80 * 2**30)
    assert resolve_mesh("auto", lambda: cfg) == (flat, None)


# A mixture of experts at Mixtral's proportions, small enough to compile here: on an expert mesh
# with a capacity factor, dropless on data, expert and model together, and with full remat.
MOE_SMALL = [
    "model.num_layers=2",
    "model.hidden=512",
    "model.num_heads=8",
    "model.num_kv_heads=2",
    "model.ffn_hidden=1024",
    "model.seq_len=512",
    "model.max_positions=512",
    "train.batch_size=16",
    "train.microbatches=2",
    F32,
    "model.remat=none",
]
MOE_POINTS = [
    ("expert=4,model=2", ["model.moe_capacity_factor=1.25"]),
    ("data=2,expert=2,model=2", []),
    ("expert=8", ["model.remat=full"]),
    # ZeRO-1 on an expert mesh: the experts' state split over "data", the rest over both
    ("data=2,expert=2,model=2", ["train.shard_optimizer=true"]),
    ("data=2,expert=4", ["train.shard_optimizer=true", "model.moe_capacity_factor=1.25"]),
]


@pytest.mark.parametrize("spec,sets", tiered(MOE_POINTS, MOE_POINTS[0]))
def test_moe_memory_within_ten_percent_of_the_compiled_step(spec, sets):
    """Each device's E / ep experts and their state, and what a sparse layer keeps (the
    buffers and the experts' fc1 outputs: analytic.sparse_mlp_bytes) against the compiled
    step's peak."""
    cfg = load_config("mixtral_8x7b", MOE_SMALL + sets)
    mesh = make_mesh(spec, devices=jax.devices())
    compiled = step_memory(make_trainer(cfg, mesh).lower_step().compile())["step_peak_bytes"]
    predicted = memory_bytes(cfg, MeshShape.of(mesh), backend="cpu")["total"]
    assert predicted == pytest.approx(compiled, rel=MEMORY_TOLERANCE)


def dot_flops(jaxpr) -> int:
    """2 x the multiply-adds of every dot product a traced program runs (a scan's body times
    its length; shard_map's body per device)."""
    total = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            (contract, _), _ = eqn.params["dimension_numbers"]
            lhs = eqn.invars[0].aval.shape
            inner = math.prod(lhs[d] for d in contract)
            total += 2 * math.prod(eqn.outvars[0].aval.shape) * inner
        times = eqn.params.get("length", 1) if eqn.primitive.name == "scan" else 1
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                inner_jaxpr = getattr(sub, "jaxpr", sub)
                if hasattr(inner_jaxpr, "eqns"):
                    total += times * dot_flops(inner_jaxpr)
    return total


@pytest.mark.parametrize(
    "capacity,arch",
    [(0.0, []), (1.25, ["model.mlp=gelu", "model.bias=all", "model.moe_shared_gate=true"])],
)
def test_a_sparse_layers_matmuls_are_the_programs(capacity, arch):
    """The planner's matmuls of a mixture of experts as they run (each expert on its buffer
    slots: dropless, the row's length; with a capacity factor, its share) equal the dot
    products of the traced forward pass, attention, router, shared expert and output layer
    included; the model's FLOPs (what MFU counts: each token's k experts) are fewer by the
    empty slots."""
    from megajax.analytic import StepShape, head_matmul, layer_matmuls
    from megajax.tasks import task_for

    sets = [
        "model.moe_shared_experts=1",
        "model.attention_dropout=0.1",  # megajax's own core: every score computed
        f"model.moe_capacity_factor={capacity}",
        *arch,
    ]
    cfg = load_config("moe_tiny", sets)
    trainer = make_trainer(cfg, mesh_for("1x1"))
    params, _ = trainer.abstract_state()
    ids = jax.ShapeDtypeStruct((cfg.train.batch_size, cfg.model.seq_len), jnp.int32)
    traced = jax.make_jaxpr(lambda p, x: trainer.modeldef.bind(p)(x))(params, ids)
    x = StepShape.of(cfg, task_for(cfg), MeshShape(), dtype="float32")
    x = dataclasses.replace(x, rows=cfg.train.batch_size)
    layers = sum(mm.flops for mm in layer_matmuls(x, sparse=True))
    assert dot_flops(traced.jaxpr) == cfg.model.num_layers * layers + head_matmul(x).flops
    model = sum(mm.flops for mm in layer_matmuls(x, sparse=True, executed=False))
    slots, k = x.experts * x.expert_slots, x.experts_per_token
    assert model < layers and slots >= k * x.seq


def test_mixtral_is_planned_on_64_h100s_with_expert_axes_among_the_plans():
    """megajax-plan --config mixtral_8x7b --devices 64 --hardware h100-80g: a plan that fits;
    expert meshes among the candidates with every data-parallel scheme and with pipeline
    stages, each paying its all-to-alls; the MFU counts active FLOPs (the tokens' two experts
    of eight)."""
    plans = plan("mixtral_8x7b", 64, "h100-80g")
    assert plans[0].fits
    experts = [p for p in plans if p.mesh.expert > 1]
    assert {p.mesh.expert for p in experts} == {2, 4, 8}
    assert {p.scheme for p in experts} == {"plain", "zero", "fsdp"}
    assert any(p.mesh.pipe > 1 for p in experts)
    assert all(p.seconds["expert_axis"] > 0 for p in experts)
    assert all("expert_axis" not in p.seconds for p in plans if p.mesh.expert == 1)
    best, cfg = plans[0], load_config("mixtral_8x7b")
    active = step_flops(cfg, remat="none", executed=False)
    assert best.mfu == pytest.approx(
        active / 64 / best.step_seconds / BUILTIN["h100-80g"].peak_flops, rel=1e-9
    )
    assert active < step_flops(cfg, remat="none") / 3  # dropless: E / k = 4 times the work


@pytest.mark.parametrize(
    "scheme", tiered(["plain", "shard_optimizer", "shard_params"], "plain", "shard_optimizer")
)
def test_expert_mesh_volumes_are_the_audits(scheme):
    """On data=2,expert=2,model=2 the planner's volumes are what the audit finds compiled: the
    experts' gradients over "data" and the others' over "data" and "expert" (plain data
    parallelism once per microbatch, as it compiles; ZeRO-1 and FSDP once per step, and their
    parameters' gathers), the all-to-alls over "expert", and the model axis with the routing
    gradient's sums."""
    from megajax.plan.volumes import expert_axis_elements

    sets = ["train.batch_size=16", "train.microbatches=2"]
    cfg = load_config("moe_tiny", sets + ([f"train.{scheme}=true"] if scheme != "plain" else []))
    mesh = make_mesh("data=2,expert=2,model=2", devices=jax.devices())
    trainer, shape = make_trainer(cfg, mesh), MeshShape.of(mesh)
    audit = audit_hlo(trainer.lower_step().compile().as_text(), cfg, shape, trainer=trainer)
    sent, least = data_axis_sent(cfg, shape), audit.data_axis_minimum
    mb = 2 if scheme == "plain" else 1
    for name in ("gradients", "params", "regather"):
        assert sent[name] == pytest.approx(mb * least[name], rel=1e-12), name
    assert 0 < sent["expert_gradients"] < sent["gradients"]
    assert expert_axis_elements(cfg, shape) == audit.expert_axis_elements > 0
    assert sum(model_axis_elements(cfg, shape).values()) == audit.analytic_min_elements
