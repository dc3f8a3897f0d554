"""bench/gpu_check.py, the one-command GPU check, runs its whole path on the CPU (--smoke) so
that it cannot rot between the occasions a GPU is lent."""
import json
import subprocess
import sys

import pytest

from test_train_cli import ROOT, env


def test_gpu_check_smoke_writes_its_table(tmp_path):
    e = env()
    e["XLA_FLAGS"] += " --xla_force_host_platform_device_count=1"
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--smoke", "--out", str(tmp_path)],
                       capture_output=True, text=True, env=e, cwd=ROOT, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    assert result["smoke"] and result["backend"] == "cpu"
    assert [r["config"] for r in result["rows"]] == ["gpt2_355m", "gpt2_1.2b"]
    for r in result["rows"]:
        assert r["fits"] and r["step_ms"] > 0 and r["tokens_per_s"] > 0 and r["peak_bytes"] > 0
        assert r["tokens_per_s"] == pytest.approx(r["batch"] * r["seq_len"] * 1000 / r["step_ms"], rel=1e-9)
        assert 3.0 < r["loss"] < 8.0            # ln(512) = 6.2 at initialisation: a real step ran
    table = (tmp_path / "gpu_check.md").read_text()
    assert table.count("| gpt2_") == 2 and "[smoke]" in table


def test_gpu_check_refuses_a_machine_without_gpus(tmp_path):
    e = env()
    e["XLA_FLAGS"] += " --xla_force_host_platform_device_count=1"
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--out", str(tmp_path)],
                       capture_output=True, text=True, env=e, cwd=ROOT, timeout=300)
    assert p.returncode == 2 and p.stderr.strip().startswith("error: jax sees no GPU")
    assert not (tmp_path / "gpu_check.json").exists()
