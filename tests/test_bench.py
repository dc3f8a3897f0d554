"""bench/gpu_check.py, the one-command GPU check, runs its whole path on the CPU (--smoke) so
that it cannot rot between the occasions a GPU is lent."""
import json
import subprocess
import sys

import pytest
from tolerances import BF16_ELEMENT, BF16_U

from test_train_cli import ROOT, env

sys.path.insert(0, str(ROOT / "bench"))
from gpu_check import ROWS  # noqa: E402


def test_gpu_check_smoke_writes_its_table(tmp_path):
    e = env()
    e["XLA_FLAGS"] += " --xla_force_host_platform_device_count=1"
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--smoke", "--out", str(tmp_path)],
                       capture_output=True, text=True, env=e, cwd=ROOT, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    assert result["smoke"] and result["backend"] == "cpu"
    assert [r["config"] for r in result["rows"]] == [row[0] for row in ROWS]
    assert [(r["remat"], r["attention"]) for r in result["rows"]] == [
        ("none", "fused"), ("none", "fused"), ("none", "megajax"), ("full", "fused"), ("none", "fused"), ("none", "fused")]
    check = result["attention_check"]      # the fused core (XLA's here) against megajax's, in bf16
    assert not check["cudnn_flash_attention"] and check["loss_rel_diff"] < BF16_U
    assert check["grad_max_rel_diff"] < 2 * BF16_ELEMENT   # two bf16 paths, each within BF16_ELEMENT
    for r in result["rows"]:
        assert r["fits"] and r["step_ms"] > 0 and r["tokens_per_s"] > 0 and r["peak_bytes"] > 0
        assert r["tokens_per_s"] == pytest.approx(r["batch"] * r["seq_len"] * 1000 / r["step_ms"], rel=1e-9)
        assert 3.0 < r["loss"] < 8.0            # ln(512) = 6.2 at initialisation: a real step ran
        assert r["predicted_ms"] > 0 and r["predicted_bytes"] > 0    # the planner's, for an H200
    table = (tmp_path / "gpu_check.md").read_text()
    assert table.count("| gpt2_") == len(ROWS) and "[smoke]" in table and "megajax-plan on h200" in table


def test_gpu_check_refuses_a_machine_without_gpus(tmp_path):
    e = env()
    e["XLA_FLAGS"] += " --xla_force_host_platform_device_count=1"
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--out", str(tmp_path)],
                       capture_output=True, text=True, env=e, cwd=ROOT, timeout=300)
    assert p.returncode == 2 and p.stderr.strip().startswith("error: jax sees no GPU")
    assert not (tmp_path / "gpu_check.json").exists()
