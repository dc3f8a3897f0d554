"""Where a run's records go besides metrics.jsonl: TensorBoard event files in WORKDIR/tensorboard/
for every run (tensorboardX: no TensorFlow), and Weights & Biases with train.tracker = "wandb".

Both take the records metrics.jsonl takes, as scalars named train/KEY and val/KEY, and the
resolved config. A resumed run appends: its first TensorBoard event purges every step after the
checkpoint it resumed from (TensorBoard's own rule for a restart), so a step the killed run logged
past its last checkpoint is not shown twice; W&B resumes the same run (its id kept in
WORKDIR/wandb/run_id), charted against the run's own step. Only process 0 writes.
"""

from __future__ import annotations

import json
import numbers
import os
import secrets
import time
from pathlib import Path

from megajax.errors import UserError
from megajax.files import write_atomic

TENSORBOARD_DIR = "tensorboard"
WANDB_DIR = "wandb"
TRACKERS = ("tensorboard", "wandb")


def check_tracker(tracker: str):
    """Refused before anything is written: W&B asked for but not installed."""
    if tracker == "wandb":
        try:
            import wandb  # noqa: F401
        except ImportError:
            raise UserError(
                "train.tracker = wandb needs the wandb package: pip install 'megajax[wandb]' (or "
                "pip install wandb)"
            ) from None


def scalar_name(key: str) -> str:
    """metrics.jsonl's keys as trackers group them: val_loss -> val/loss, loss -> train/loss."""
    return f"val/{key[4:]}" if key.startswith("val_") else f"train/{key}"


def scalars(record: dict) -> dict[str, float]:
    return {
        scalar_name(k): float(v)
        for k, v in record.items()
        if k != "step" and isinstance(v, numbers.Real) and not isinstance(v, bool)
    }


class EventFile:
    """One run's TensorBoard event file, written in the caller's thread. (tensorboardX's
    SummaryWriter hands each event to a queue drained by a thread of its own, and its flush()
    does not wait for the queue: a run killed just after a checkpoint lost the last records
    metrics.jsonl already held, its validation loss among them.)"""

    def __init__(self, logdir: Path, purge_step: int | None = None):
        from tensorboardX import summary
        from tensorboardX.event_file_writer import EventsWriter
        from tensorboardX.proto.event_pb2 import Event, SessionLog

        self._event, self._summary = Event, summary
        os.makedirs(logdir, exist_ok=True)
        # the process id in the name: two runs started in one second write two files
        self.writer = EventsWriter(str(Path(logdir) / "events"), f".{os.getpid()}")
        if purge_step is not None:  # TensorBoard hides what an earlier run wrote from here on
            start = SessionLog(status=SessionLog.START)
            self.writer.write_event(
                Event(step=purge_step, wall_time=time.time(), session_log=start)
            )

    def add(self, summary, step: int):
        self.writer.write_event(self._event(summary=summary, step=step, wall_time=time.time()))

    def scalars(self, values: dict[str, float], step: int):
        """The values at `step`, on disk when this returns."""
        for name, value in values.items():
            self.add(self._summary.scalar(name, value), step)
        self.writer.flush()

    def text(self, tag: str, text: str, step: int):
        self.add(self._summary.text(tag, text), step)
        self.writer.flush()

    def close(self):
        self.writer.close()


class Tracking:
    """TensorBoard (always) and W&B (train.tracker = "wandb") for one run; silent when not
    `enabled` (every process but the first). `start` is the step the run resumes from."""

    def __init__(
        self,
        workdir: Path,
        config: dict,
        start: int,
        tracker: str = "tensorboard",
        enabled: bool = True,
    ):
        self.tb = self.wandb = None
        if not enabled:
            return
        purge = start + 1 if start else None
        self.tb = EventFile(Path(workdir) / TENSORBOARD_DIR, purge_step=purge)
        self.tb.text("config", "```\n" + json.dumps(config, indent=2) + "\n```", start)
        if tracker == "wandb":
            self.wandb = _wandb_run(Path(workdir), config)

    def write(self, step: int, record: dict):
        values = scalars(record)
        if self.tb is not None:  # on disk now: a kill loses nothing already in metrics.jsonl
            self.tb.scalars(values, step)
        if self.wandb is not None:
            self.wandb.log({"step": step, **values})

    def close(self):
        if self.tb is not None:
            self.tb.close()
            self.tb = None
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None


def _wandb_run(workdir: Path, config: dict):
    """The workdir's W&B run, the same one again on resume. The project is $WANDB_PROJECT (or
    "megajax"); WANDB_MODE=offline keeps it on disk (wandb sync uploads it later)."""
    import wandb

    where = workdir / WANDB_DIR
    where.mkdir(parents=True, exist_ok=True)
    id_file = where / "run_id"
    run_id = id_file.read_text().strip() if id_file.is_file() else ""
    if not run_id:
        run_id = secrets.token_hex(4)  # W&B's own ids are 8 such characters
        write_atomic(id_file, run_id + "\n")
    run = wandb.init(
        project=os.environ.get("WANDB_PROJECT", "megajax"),
        name=workdir.name,
        id=run_id,
        resume="allow",
        dir=str(workdir),
        config=config,
        settings=wandb.Settings(silent=True),
    )
    # charted against the run's step, so a resumed run's steps may repeat a killed run's last few
    run.define_metric("step")
    for group in ("train/*", "val/*"):
        run.define_metric(group, step_metric="step")
    return run
