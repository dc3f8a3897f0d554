"""A run's metrics.jsonl (appended by process 0, read back across kills and resumes) and its
loss-curve picture (megajax-plot)."""

from __future__ import annotations

import io
import json
from pathlib import Path

from megajax.errors import UserError
from megajax.files import parse_jsonl, read_jsonl, text_lines, write_atomic


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
        lines = [line for line in text_lines(text) if line.strip()]
        if len(keep) != len(lines) or (text and not text.endswith("\n")):
            write_atomic(self.path, "".join(json.dumps(r) + "\n" for r in keep))


def picture_format(out: Path) -> str:
    """The format --out's suffix names (png, pdf, svg, jpg, ...); png without a suffix."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    kinds = FigureCanvasAgg.get_supported_filetypes()
    kind = out.suffix.lower().removeprefix(".") or "png"
    if kind not in kinds:
        raise UserError(
            f"{out}: matplotlib writes no '{out.suffix}' picture; end the name in "
            + ", ".join(f".{k}" for k in sorted(kinds))
        )
    return kind


def plot_workdir(workdir: Path, out: Path | None = None) -> Path:
    """Draw train (and validation) loss against step from WORKDIR/metrics.jsonl into a picture:
    WORKDIR/loss.png, or `out` in the format its suffix names."""
    import matplotlib  # optional and slow to import: only for the picture

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
    picture = io.BytesIO()  # drawn in memory: a signal while drawing leaves no file behind
    try:
        fig.savefig(picture, format=kind)
    finally:
        plt.close(fig)
    write_atomic(out, picture.getvalue())  # never a half-written picture
    return out
