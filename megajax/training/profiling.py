"""`--profile START:STOP`: a jax.profiler trace of training steps START..STOP (as the log numbers
them), written where TensorBoard's profile plugin finds it (WORKDIR/tensorboard/plugins/profile/
TIME/, with a Perfetto trace beside it) together with the compiled step's HLO text, which
megajax/tools/profile.py reads to say where the time went. Process 0 traces."""

from __future__ import annotations

from pathlib import Path

import jax

from megajax.errors import UserError
from megajax.runs.tracking import TENSORBOARD_DIR

HLO_FILE = "step.hlo.txt"


def parse_window(text: str | None) -> tuple[int, int] | None:
    """'4:6' -> (4, 6); None stays None."""
    if text is None:
        return None
    ends = text.split(":")
    try:
        window = (int(ends[0]), int(ends[-1])) if len(ends) <= 2 else None
    except ValueError:
        window = None
    if window is None or not 1 <= window[0] <= window[1]:
        raise UserError(
            "--profile takes START:STOP, the first and last step to trace (1 <= START <= STOP, "
            f"e.g. 4:6), got {text!r}"
        )
    return window


class StepTrace:
    """Starts the trace before step `window[0]` runs and stops it once step `window[1]` is done."""

    def __init__(
        self, window: tuple[int, int] | None, workdir: Path, enabled: bool, step_fn, start: int, out
    ):
        self.window, self.step_fn, self.tracing, self.dir = window, step_fn, False, None
        self.root = Path(workdir) / TENSORBOARD_DIR
        if window and start >= window[0]:
            if enabled:
                out(
                    f"--profile {window[0]}:{window[1]}: nothing traced, the run resumes at step "
                    f"{start}"
                )
            self.window = None
        if not enabled:
            self.window = None

    def before(self, step: int):
        """`step`: the number the step about to run will be logged as."""
        if self.window and step == self.window[0]:
            jax.profiler.start_trace(str(self.root), create_perfetto_trace=True)
            self.tracing = True

    def after(self, step: int, metrics):
        if self.tracing and step == self.window[1]:
            self.stop(metrics)

    def stop(self, metrics=None):
        if not self.tracing:
            return
        jax.block_until_ready(metrics)
        jax.profiler.stop_trace()
        self.tracing = False
        runs = sorted(
            (self.root / "plugins" / "profile").iterdir(), key=lambda p: p.stat().st_mtime
        )
        self.dir = runs[-1]
        text = getattr(self.step_fn, "as_text", None)  # one compiled program (not layer_programs)
        if text is not None:
            (self.dir / HLO_FILE).write_text(text(), encoding="utf-8")
