"""Throughput accounting (model FLOPs, device peak), metrics.jsonl and the loss-curve picture."""
from __future__ import annotations

import io
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from megajax import analytic
from megajax.analytic import StepShape
from megajax.errors import UserError
from megajax.files import parse_jsonl, read_jsonl, write_atomic
from megajax.tasks import task_for

# Dense bf16 peak TFLOP/s per device, for MFU where nothing was measured.
KNOWN_PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L4": 121.0, "A10": 125.0,
                     "V100": 125.0, "T4": 65.0, "L40S": 362.0, "RTX 4090": 165.0, "TPU v4": 275.0, "TPU v5e": 197.0}
# (V100 and T4: float16, which their tensor cores take instead of bfloat16)


def flops_per_token(cfg) -> float:
    """Model FLOPs per trained token (analytic.flops_per_token), the weights each token goes
    through counted by the run's task."""
    task = task_for(cfg)
    return analytic.flops_per_token(StepShape.of(cfg, task), task.matmul_params_per_token(cfg))


def device_peak_tflops(measure_cpu: bool = True) -> float | None:
    """The device's bf16 peak from a table, or a measured float32 matmul rate on the CPU."""
    dev = jax.devices()[0]
    kind = getattr(dev, "device_kind", "")
    for name, peak in KNOWN_PEAK_TFLOPS.items():
        if name.lower() in kind.lower():
            return peak
    if dev.platform == "cpu" and measure_cpu:
        return measure_matmul_tflops()
    return None


def measure_matmul_tflops(n: int = 1024, reps: int = 5) -> float:
    """float32 n x n matmul rate on one device, in TFLOP/s (the best of `reps`)."""
    a = jnp.ones((n, n), jnp.float32, device=jax.devices()[0])
    f = jax.jit(lambda x: x @ x)
    f(a).block_until_ready()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        f(a).block_until_ready()
        best = min(best, time.perf_counter() - t)
    return 2 * n ** 3 / best / 1e12


class MetricsLog:
    """Appends one JSON object per line to WORKDIR/metrics.jsonl (process 0 only)."""

    def __init__(self, workdir: Path, enabled: bool = True):
        self.path = Path(workdir) / "metrics.jsonl"
        self.enabled = enabled

    def write(self, record: dict):
        if self.enabled:
            with self.path.open("a", encoding="utf-8") as f:
                f.write(json.dumps(record) + "\n")

    def truncate_after(self, step: int):
        """Drop records past `step` (left by a run that died after its last checkpoint) and a
        last line cut short by a kill; the file is replaced atomically, and only if needed."""
        if not self.enabled or not self.path.exists():
            return
        text = self.path.read_text(encoding="utf-8", errors="replace")
        keep = [r for r in parse_jsonl(text) if r.get("step", 0) <= step]
        lines = [line for line in text.splitlines() if line.strip()]
        if len(keep) != len(lines) or (text and not text.endswith("\n")):
            write_atomic(self.path, "".join(json.dumps(r) + "\n" for r in keep))


def picture_format(out: Path) -> str:
    """The format --out's suffix names (png, pdf, svg, jpg, ...); png without a suffix."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    kinds = FigureCanvasAgg.get_supported_filetypes()
    kind = out.suffix.lower().removeprefix(".") or "png"
    if kind not in kinds:
        raise UserError(f"{out}: matplotlib writes no '{out.suffix}' picture; end the name in "
                        + ", ".join(f".{k}" for k in sorted(kinds)))
    return kind


def plot_workdir(workdir: Path, out: Path | None = None) -> Path:
    """Draw train (and validation) loss against step from WORKDIR/metrics.jsonl into a picture:
    WORKDIR/loss.png, or `out` in the format its suffix names."""
    import matplotlib   # optional and slow to import: only for the picture

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(workdir) / "metrics.jsonl"
    if not path.is_file():
        raise UserError(f"no metrics.jsonl in {workdir}")
    if out is not None and (Path(out).is_dir() or not Path(out).parent.is_dir()):
        raise UserError(f"{out}: give the picture's file name, in a directory that exists")
    out = Path(out) if out else Path(workdir) / "loss.png"
    kind = picture_format(out)
    records = read_jsonl(path)
    train = [(r["step"], r["loss"]) for r in records if "loss" in r]
    val = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
    if not train and not val:
        raise UserError(f"{path} holds no loss yet: a run logs one every train.log_every steps")
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    if train:
        ax.plot(*zip(*train), label="train loss", lw=1.2)
    if val:
        ax.plot(*zip(*val), "o-", label="validation loss", lw=1.2)
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title(Path(workdir).name)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    picture = io.BytesIO()   # drawn in memory: a signal while drawing leaves no file behind
    try:
        fig.savefig(picture, format=kind)
    finally:
        plt.close(fig)
    write_atomic(out, picture.getvalue())     # never a half-written picture
    return out
