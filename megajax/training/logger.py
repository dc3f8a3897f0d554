"""What a run logs and keeps track of, step by step: each step's metrics read on the host a log
interval at a time and checked (a loss or gradient norm that is not finite, or a loss spike
past a uniform guess's, stops the run as diverged, and the checkpoint whose weights gave it is
set aside), written to metrics.jsonl with throughput
and MFU, shown as progress, and the checkpoints the run saved."""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from typing import TYPE_CHECKING

import jax

from megajax.core.mesh import mesh_sizes
from megajax.errors import UserError
from megajax.host.distributed import Watchdog, describe
from megajax.progress import Progress
from megajax.runs.checkpoint import Checkpoints
from megajax.runs.metrics import MetricsLog
from megajax.runs.tracking import Tracking
from megajax.runs.workdir import is_main
from megajax.tasks import param_count
from megajax.training.mfu import device_peak, flops_per_token

if TYPE_CHECKING:
    from megajax.training.loop import Run


def fatal_non_finite(m: dict) -> list[tuple[str, float]]:
    """The step's metrics that stop the run: the loss is computed before the update, the
    gradient norm from what updates the weights, so either one not finite means the weights
    after the step are not either. With float16's loss scaling, gradients that overflowed skip
    the update instead (the weights stay finite) and lower the scale; at a scale of 1 or less
    the run has diverged."""
    bad = [(k, float(m[k])) for k in ("loss", "grad_norm") if not math.isfinite(float(m[k]))]
    if [k for k, _ in bad] == ["grad_norm"] and float(m.get("loss_scale", 0.0)) > 1.0:
        return []
    return bad


SPIKE_WINDOW = 20


def loss_spike(loss: float, before, factor: float, chance: float) -> float | None:
    """The median a finite loss spiked over, if it is a divergence: above `factor` times the
    median of the losses `before` it (up to SPIKE_WINDOW steps of this run) and above the loss of
    a uniform guess, `chance` (ln V for a language model). Both, because a run that learns goes
    far below chance, where a jump is noise to ride out; a loss back above chance after a spike
    is a model unlearning (an lr of 1e6 gives 1e15), and training on from it gives nothing."""
    if not factor or not before:
        return None
    median = statistics.median(before)
    return median if loss > factor * median and loss > chance else None


class StepLogger:
    """Each step's metrics, read on the host a log interval at a time: checked (a step whose
    loss or gradient norm is not finite stops the run before it can be saved), written to
    metrics.jsonl with throughput and MFU, and shown as progress."""

    def __init__(self, run: Run, ckpts: Checkpoints, start: int | None, out, quiet: bool = False):
        cfg, mesh = run.cfg, run.trainer.mesh
        self.run, self.ckpts, self.out, self.main = run, ckpts, out, is_main()
        self.start = start or 0
        # checkpoints on disk (the last may be in flight)
        self.saves = [] if start is None else [start]
        self.pending = []  # (step, metrics on device) not yet read
        self.losses: dict[int, float] = {}
        self.recent = deque(maxlen=SPIKE_WINDOW)  # this run's last losses
        self.chance = run.task.chance_loss(cfg)
        self.val_loss = None
        self.tokens_per_step = cfg.train.batch_size * run.task.tokens_per_example(cfg)
        self.flops = flops_per_token(cfg) * self.tokens_per_step / mesh.devices.size
        self.peak = device_peak(cfg) if self.main else None
        self.metrics = MetricsLog(run.workdir, enabled=self.main)
        self.metrics.truncate_after(self.start)
        self.tracking = Tracking(
            run.workdir, cfg.to_dict(), self.start, cfg.train.tracker, enabled=self.main
        )
        self.progress = Progress(cfg.train.steps, self.start, enabled=self.main and not quiet)
        self.watchdog = Watchdog()
        self.restart_clock(self.start)

    def announce(self, compile_s: float):
        """The run's header line, once the step is compiled; the throughput clock starts here."""
        cfg, mesh, start = self.run.cfg, self.run.trainer.mesh, self.start
        self.restart_clock(start)
        if not self.main:
            return
        self.out(
            f"megajax: {cfg.name} | {param_count(cfg) / 1e6:.2f}M params | mesh "
            + " ".join(f"{a}={n}" for a, n in mesh_sizes(mesh).items())
            + f" on {mesh.devices.size} {jax.devices()[0].platform} device(s) | "
            f"{self.run.data.describe()} | step compiled in {compile_s:.1f}s"
            + (f" | {describe()}" if describe() else "")
            + (
                f" | MFU against {self.peak.tflops:.3g} TFLOP/s per device ({self.peak.what})"
                if self.peak
                else " | MFU: no peak known for this device"
            )
            + (f" | resuming from step {start}" if start else "")
        )
        if start >= cfg.train.steps:
            self.out(
                f"the checkpoint in {self.run.workdir} is at step {start}, train.steps is "
                f"{cfg.train.steps}: nothing to train (raise --steps to continue)"
            )

    def add(self, step: int, metrics):
        self.watchdog.beat()
        self.pending.append((step, metrics))
        if len(self.pending) > 1:
            # At most two steps in flight: the host keeps one step ahead of the devices.
            # Deeper queues gain nothing and can deadlock XLA:CPU's simulated devices,
            # whose collectives rendezvous on a shared thread pool.
            self.pending[-2][1]["loss"].block_until_ready()

    def log(self, step: int):
        self.progress.update(step, self.flush(step))

    def flush(self, step: int) -> dict:
        """Read the pending steps, check them, and write the record of `step`."""
        fetched = jax.device_get([m for _, m in self.pending])
        for (s, _), m in zip(self.pending, fetched):
            self._check_finite(s, m)
            self.losses[s] = float(m["loss"])
        self.pending.clear()
        dt = (time.perf_counter() - self.clock[1]) / max(step - self.clock[0], 1)
        self.restart_clock(step)
        m = fetched[-1]
        record = {
            "step": step,
            "loss": float(m["loss"]),
            "lr": float(m["lr"]),
            "grad_norm": float(m["grad_norm"]),
            "tokens_per_sec": self.tokens_per_step / dt,
            "step_time_s": dt,
            "tflops_per_device": self.flops / dt / 1e12,
        }
        # BERT: mlm_loss, sop_accuracy, ...
        record.update({k: float(v) for k, v in m.items() if k not in record})
        for k in record:  # a blend's counts
            if k.startswith(("samples/", "epoch/")):
                record[k] = int(record[k])
        # float16: a skipped step's norm is not finite, and JSON has no inf
        if "skipped_steps" in record:
            record["skipped_steps"] = int(record["skipped_steps"])
            record["grad_norm"] = (
                record["grad_norm"] if math.isfinite(record["grad_norm"]) else None
            )
        if self.peak:
            record["mfu"] = record["tflops_per_device"] / self.peak.tflops
        self.write(record)
        return record

    def write(self, record: dict):
        """One record to metrics.jsonl, TensorBoard and (if asked) W&B."""
        self.metrics.write(record)
        self.tracking.write(record["step"], record)

    def _check_finite(self, step: int, m: dict):
        bad = fatal_non_finite(m)
        loss = float(m["loss"])
        spiked = (
            None
            if bad
            else loss_spike(loss, self.recent, self.run.cfg.train.spike_factor, self.chance)
        )
        if not bad and spiked is None:
            self.recent.append(loss)
            return
        scale = float(m.get("loss_scale", 0.0))
        self.progress.close()
        self._forget(self.ckpts.failed_save(block=True))
        what = " and ".join(f"{'gradient norm' if k == 'grad_norm' else k} {v}" for k, v in bad)
        if spiked is not None:
            what = (
                f"loss {loss:.4g}, over train.spike_factor {self.run.cfg.train.spike_factor:g} x "
                f"the median {spiked:.4g} of the {len(self.recent)} step(s) before and over a "
                f"uniform guess's {self.chance:.4g}: diverged"
            )
        if scale:
            what += f" (float16, loss scale {scale:g})"
        raise UserError(
            f"{what} at step {step}; stopped, nothing of step {step} or later saved; "
            f"{self._diverged_set_aside(step)}"
        )

    def _diverged_set_aside(self, step: int) -> str:
        """Step `step`'s loss was computed from the weights saved as step - 1: those weights are
        the ones that diverged, however finite they are, and a resume from them fails again. That
        checkpoint (if saved) moves to WORKDIR/diverged/, so that the same command resumes from the
        newest one whose weights gave a good loss, which the line names."""
        where = self.run.workdir / "checkpoints"
        self.ckpts.manager.reload()
        moved = ""
        if step - 1 in self.ckpts.all_steps():
            moved = (
                f"checkpoint step {step - 1}, the weights step {step} started from, moved to "
                f"{self.ckpts.set_aside(step - 1, 'diverged')}; "
            )
        self.saves = [s for s in self.saves if s != step - 1]
        good = [s for s in self.ckpts.all_steps() if s < step - 1]
        return moved + (
            f"last good checkpoint: step {max(good)} in {where}"
            if good
            else "no checkpoint from before the divergence is left"
        )

    def log_eval(self, step: int, val: dict):
        self.watchdog.beat()
        self.val_loss = val["loss"]
        record = {"step": step, "val_loss": self.val_loss, **self.run.task.val_extras(val)}
        # a blend's components: val/NAME/loss
        record.update(
            {
                f"val/{k.removeprefix('blend/')}" if k.startswith("blend/") else f"val_{k}": v
                for k, v in val.items()
                if k != "loss"
            }
        )
        self.write(record)
        self.progress.write(
            f"step {step:>6}  "
            + "  ".join(f"{k} {v:.4f}" for k, v in record.items() if k != "step")
        )

    def saved(self, step: int, failure: tuple[int, str] | None):
        """A save of `step` started, unless `failure` says it could not."""
        self.watchdog.beat()
        if failure is None:
            self.saves.append(step)
        self.save_failed(failure)
        self.restart_clock(step)  # throughput excludes saving

    def save_failed(self, failure: tuple[int, str] | None, last: bool = False):
        """One line for a failed save. Training goes on only while an older checkpoint is intact;
        after the last step there is nothing to go on with: the run fails, naming that one."""
        if failure is None:
            return
        self._forget(failure)
        step, why = failure
        where = self.run.workdir / "checkpoints"
        intact = (
            f"step {self.saves[-1]} in {where} is intact"
            if self.saves
            else "no checkpoint of this run is intact"
        )
        if last or not self.saves:
            self.progress.close()
            self.ckpts.settle()
            raise UserError(f"saving step {step} failed ({why}); {intact}")
        self.progress.write(
            f"warning: saving step {step} failed ({why}); {intact}: training goes on"
        )

    def _forget(self, failure: tuple[int, str] | None):
        if failure is not None:
            self.saves = [s for s in self.saves if s != failure[0]]

    def restart_clock(self, step: int):
        self.clock = (step, time.perf_counter())

    def close(self):
        try:
            self.save_failed(self.ckpts.failed_save(block=True), last=True)
        finally:
            self.progress.close()
            self.tracking.close()
