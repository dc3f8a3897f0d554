"""The bench scripts run their whole path on the CPU at tiny shapes, so that they cannot rot:
bench/gpu_check.py (--smoke) between the occasions a GPU is lent, bench/step_mfu.py."""

import json
import subprocess
import sys

import jax
import pytest
from conftest import ROOT, mesh_for, tiny_config
from helpers import env
from tolerances import BF16_ELEMENT, BF16_U, F32, assert_tree_close

sys.path.insert(0, str(ROOT / "bench"))
import record  # noqa: E402
from gpu_check import ROWS, STACKS  # noqa: E402
from layer_programs import inputs, stack_gradients  # noqa: E402


@pytest.mark.full
def test_gpu_check_smoke_writes_its_table(tmp_path):
    e = env()
    e["XLA_FLAGS"] += " --xla_force_host_platform_device_count=1"
    p = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--smoke", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        env=e,
        cwd=ROOT,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    assert result["smoke"] and result["backend"] == "cpu"
    assert [r["config"] for r in result["rows"]] == [row[0] for row in ROWS]
    assert all(r["fits"] for r in result["rows"]), [r.get("why") for r in result["rows"]]
    assert [(r["remat"], r["attention"]) for r in result["rows"]] == [
        ("none", "fused"),
        ("none", "fused"),
        ("none", "fused"),
        ("none", "fused"),
        ("none", "fused"),
        ("none", "megajax"),
        ("full", "fused"),
        ("none", "fused"),
        ("none", "fused"),
        ("none", "fused"),
        ("none", "fused"),
    ]
    check = result["attention_check"]  # the fused core (XLA's here) against megajax's, in bf16
    assert not check["cudnn_flash_attention"] and check["loss_rel_diff"] < BF16_U
    # two bf16 paths, each within BF16_ELEMENT
    assert check["grad_max_rel_diff"] < 2 * BF16_ELEMENT
    for r in result["rows"]:
        assert r["fits"] and r["step_ms"] > 0 and r["tokens_per_s"] > 0 and r["peak_bytes"] > 0
        assert r["tokens_per_s"] == pytest.approx(
            r["batch"] * r["seq_len"] * 1000 / r["step_ms"], rel=1e-9
        )
        assert 3.0 < r["loss"] < 8.0  # ln(512) = 6.2 at initialisation: a real step ran
        if "experts" not in r["config"]:  # the planner's, for an H200 (dense models only)
            assert r["predicted_ms"] > 0 and r["predicted_bytes"] > 0
    assert [r["config"] for r in result["stacks"]] == [name for name, _ in STACKS]
    for r, (_, ways) in zip(result["stacks"], STACKS):
        assert set(r["best_ms"]) == set(ways) and min(r["best_ms"].values()) > 0
        # the same bf16 layer, run another way
        assert r["grad_rel_diff"]["per_layer"] < BF16_ELEMENT
    table = (tmp_path / "gpu_check.md").read_text()
    rows = table.count("| gpt2_") + table.count("| llama3.2_1b")
    assert (
        rows == len(ROWS) + len(STACKS) and "[smoke]" in table and "megajax-plan on h200" in table
    )


@pytest.mark.full
@pytest.mark.parametrize("remat", ["none", "full"])
def test_layer_programs_ways_give_the_scans_gradients(remat):
    """bench/layer_programs.py's three ways compute one thing: with dropout, the stacked weights'
    and the input's gradients of the unrolled stack and of one program per layer equal the
    scan's."""
    cfg = tiny_config(num_layers=3, remat=remat)
    fns, state = stack_gradients(cfg, mesh_for("1x1"))
    x, ct, keys = inputs(cfg)
    assert keys is not None and keys.shape == (3,)
    want = fns["scan"](state, x, keys, ct)
    assert float(jax.numpy.abs(want[1]).max()) > 0
    for way in ("unrolled", "per_layer"):
        assert_tree_close(want, fns[way](state, x, keys, ct), F32, what=way)


def test_gpu_check_refuses_a_machine_without_gpus(tmp_path):
    e = env()
    e["XLA_FLAGS"] += " --xla_force_host_platform_device_count=1"
    p = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        env=e,
        cwd=ROOT,
        timeout=300,
    )
    assert p.returncode == 2 and p.stderr.strip().startswith("error: jax sees no GPU")
    assert not (tmp_path / "gpu_check.json").exists()


@pytest.mark.full
def test_step_mfu_runs_with_the_papers_dropout_and_remat():
    """bench/step_mfu.py's whole path at tiny shapes: both stacks, with dropout (its forward and
    backward timings draw the masks too) and full remat."""
    e = env()
    e["XLA_FLAGS"] += " --xla_force_host_platform_device_count=1"
    p = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "step_mfu.py"),
            "--layers",
            "2",
            "--hidden",
            "64",
            "--heads",
            "4",
            "--seq",
            "32",
            "--batch",
            "2",
            "--dtypes",
            "float32",
            "--rounds",
            "1",
            "--reps",
            "1",
            "--compile-layers",
            "2,4",
            "--dropout",
            "0.1",
            "--remat",
            "full",
        ],
        capture_output=True,
        text=True,
        env=e,
        cwd=ROOT,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    for stack in ("scanned stack", "unrolled stack", "layer programs"):
        assert f"float32, {stack}" in p.stdout and p.stdout.count("2 layers, hidden 64") == 3
    assert p.stdout.count("backward/forward") == 2 and p.stdout.count("| MFU") == 3
    assert "Llama 4 heads / 1 kv" in p.stdout and "Llama / GPT MFU, run in turn" in p.stdout
    assert "x 8 experts top-2" in p.stdout and "MoE / Llama MFU (active FLOPs)" in p.stdout
    assert (
        "scanned / unrolled train step" in p.stdout and "programs / unrolled train step" in p.stdout
    )
    assert "compile, scanned train step (float32): 2 layers" in p.stdout
    # what bench/record.py reads of it: the MFUs and their ratio, backward/forward, Llama / GPT
    mfu = [float(line.rsplit("MFU ", 1)[1]) for line in p.stdout.splitlines() if "| MFU" in line]
    row = record.figures(p.stdout)
    assert (row["scanned MFU"], row["unrolled MFU"]) == (mfu[0], mfu[1])
    if mfu[1]:  # (two decimals of a tiny model's MFU may be 0.00)
        assert row["scanned / unrolled"] == mfu[0] / mfu[1]
    assert 0 < row["backward / forward"] and 0 < row["Llama / GPT"]
