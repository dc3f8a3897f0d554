"""Orbax checkpoints of (params, optimizer state) plus a small JSON record.

Arrays are saved with their shardings and restored straight into the shardings of the
current mesh, whatever mesh wrote them: no conversion step.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
import traceback
import warnings
from pathlib import Path

import jax
import orbax.checkpoint as ocp

from megajax.errors import UserError, first_line, os_error_code
from megajax.files import remove_until_gone


class _ReportedSaveFailures(logging.Filter):
    """orbax logs a failed background save with its traceback, from each of its threads, and a
    damaged checkpoint's metadata as it reads it; megajax reports both itself, in one line
    (Checkpoints.failed_save, Checkpoints.restore_newest_intact), so those records are dropped."""

    MARKS = (
        "in background save thread",
        "Save Finalize thread",
        "_SignalingThread.run() raised an exception",
        "Failed to read Metadata file",
    )

    def filter(self, record) -> bool:
        return not any(mark in record.getMessage() for mark in self.MARKS)


def _quiet_orbax():
    """orbax logs through absl at INFO; only errors are worth a user's screen, and not the save
    failures megajax reports itself. Done when checkpoints are first used, not at import."""
    absl_log = logging.getLogger("absl")
    absl_log.setLevel(logging.ERROR)
    if not any(isinstance(f, _ReportedSaveFailures) for f in absl_log.filters):
        absl_log.addFilter(_ReportedSaveFailures())
    if not getattr(threading.excepthook, "_megajax", False):
        threading.excepthook = _orbax_threads_reported(threading.excepthook)


def _orbax_threads_reported(previous):
    """An exception that ends one of orbax's own threads (a save's writer that could not start
    another thread on a full address space, a commit on a full disk) is printed by Python as
    "Exception in thread ..." with its traceback, and whether one is depends on which thread met
    the failure first. orbax hands the same failure to the waiting save (wait_until_finished),
    which megajax reports in one line; so an exception raised inside orbax's code in a thread
    other than the main one is dropped, and every other goes to `previous`."""

    def hook(args):
        frames = traceback.extract_tb(args.exc_traceback) if args.exc_traceback is not None else []
        if not any(f"{os.sep}orbax{os.sep}" in frame.filename for frame in frames):
            previous(args)

    hook._megajax = True
    return hook


def _quiet_abandoned_io(workdir: Path):
    """A failed orbax restore or save leaves tensorstore reads or writes of this workdir in
    flight, each failing in turn after the first failure, which megajax reports in one line.
    Theirs surface later, outside any caller: as "... exception was never retrieved" from
    asyncio's logger, and, as their coroutines are collected or the loop closed, through
    sys.unraisablehook ("Event loop is closed", or the read's own error) and as "coroutine ...
    was never awaited" warnings. They say nothing the one line has not said: drop exactly those
    (the asyncio ones only when they name a file of this workdir; megajax itself has no
    coroutines), and pass everything else on."""
    asyncio_log = logging.getLogger("asyncio")
    if not any(isinstance(f, _AbandonedIO) and f.root == str(workdir) for f in asyncio_log.filters):
        asyncio_log.addFilter(_AbandonedIO(str(workdir)))
    warnings.filterwarnings(
        "ignore", message="coroutine .* was never awaited", category=RuntimeWarning
    )
    previous = sys.unraisablehook
    if getattr(previous, "_megajax", False):
        return

    def hook(unraisable):
        exc, code = unraisable.exc_value, getattr(unraisable.object, "cr_code", None)
        if isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed":
            return
        if code is not None and f"{os.sep}orbax{os.sep}" in code.co_filename:
            return
        previous(unraisable)

    hook._megajax = True
    sys.unraisablehook = hook


class _AbandonedIO(logging.Filter):
    def __init__(self, root: str):
        super().__init__()
        self.root = root

    def filter(self, record) -> bool:
        message = record.getMessage()
        return not (
            " exception was never retrieved" in message.split("\n", 1)[0] and self.root in message
        )


MAX_RELISTS = 20  # a reader re-lists the steps when the trainer removes the one it reads


def _first_line(e: Exception) -> str:
    """One line for a failed read or write. tensorstore names the operating system's reason
    (a full disk, a lost file system) only at the end of a long message: it goes first."""
    # an OSError's own message says it
    code = None if isinstance(e, OSError) else os_error_code(e)
    reason = f"{os.strerror(code)}; " if code else ""
    # which prints a method's repr
    line = first_line(e, 1000).split(" See full TensorStore details")[0]
    return f"{reason}{type(e).__name__}: {line[: 160 if code else 200]}"


def _leaf_paths(tree) -> set[str]:
    """Every array's path, in a form an abstract pytree and orbax's metadata of it share (on
    disk a NamedTuple's fields are dict keys)."""

    def name(key) -> str:
        return str(next((getattr(key, a) for a in ("key", "name", "idx") if hasattr(key, a)), key))

    leaves = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: hasattr(x, "shape"))[0]
    return {"/".join(name(k) for k in path) for path, _ in leaves}


def _one_writer_per_array():
    """orbax's default off GPUs splits each replicated array's write over its replicas
    (replica-parallel), slicing it with a program compiled for each array's shape: saving a
    small model's 30 arrays on 8 CPU devices took 11 s of compiling against 0.1 s written by one
    replica. It pays where the replicas are processes on other hosts, each writing its part;
    in one process, that process writes every part anyway."""
    parallel = jax.process_count() > 1
    handler = ocp.type_handlers.get_type_handler(jax.Array)
    if getattr(handler, "megajax_replica_parallel", None) != parallel:
        handler = ocp.type_handlers.ArrayHandler(use_replica_parallel=parallel)
        handler.megajax_replica_parallel = parallel
        ocp.type_handlers.register_type_handler(jax.Array, handler, override=True)


class Checkpoints:
    def __init__(
        self, directory: Path, keep: int = 3, async_save: bool = True, writer: bool = True
    ):
        """`writer`: the run that holds the workdir's lock (it also removes what a killed save
        left half-written); an evaluation reading the workdir passes False and changes nothing."""
        _quiet_orbax()
        _one_writer_per_array()
        self.directory = Path(directory).absolute() / "checkpoints"
        # before any read or write: failures can outrun the except
        _quiet_abandoned_io(self.directory.parent)
        self.in_flight = None  # the step being written in the background
        self.manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=keep,
                enable_async_checkpointing=async_save,
                create=writer,
                cleanup_tmp_directories=writer,
            ),
            # Named handlers let a fresh manager read what an earlier process wrote.
            # Weights and optimizer state are separate items, so evaluation reads only the weights.
            item_handlers={
                "params": ocp.StandardCheckpointHandler(),
                "opt_state": ocp.StandardCheckpointHandler(),
                "meta": ocp.JsonCheckpointHandler(),
            },
        )

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self.manager.all_steps())

    def save(self, step: int, params, opt_state, meta: dict) -> tuple[int, str] | None:
        """Start writing `step` in the background; (step, why) if it could not start. Collect
        the save before with `failed_save(block=True)` first: orbax finishes it before this one."""
        try:
            self._check_directory()
            self.manager.save(
                step,
                args=ocp.args.Composite(
                    params=ocp.args.StandardSave(params),
                    opt_state=ocp.args.StandardSave(opt_state),
                    meta=ocp.args.JsonSave(meta),
                ),
                force=True,
            )
            self.in_flight = step
        except Exception as e:  # noqa: BLE001  (OS errors, orbax's own)
            return step, _first_line(e)
        return None

    def _check_directory(self):
        """orbax creates each step's directory in one background thread while the others wait
        for it: if that fails (the checkpoints directory removed, replaced by a file, made
        read-only while the run went on), they wait out a five-minute timeout. So the
        directory is checked, and made again if it is gone, before a save starts."""
        if jax.process_index() == 0 and not self.directory.exists():
            self.directory.mkdir(parents=True)
        if not self.directory.is_dir() or not os.access(self.directory, os.W_OK | os.X_OK):
            raise OSError(f"{self.directory} is not a writable directory")

    def failed_save(self, block: bool = False) -> tuple[int, str] | None:
        """(step, why) if the background save has finished and failed (a full disk, a lost
        file system), else None. Without `block` it never waits: None while the save runs.
        What a failed save wrote is removed: it is incomplete, and on a full disk it holds
        the space the next save needs."""
        if self.in_flight is None or (not block and self.manager.is_saving_in_progress()):
            return None
        step, self.in_flight = self.in_flight, None
        try:
            self.manager.wait_until_finished()
        except Exception as e:  # noqa: BLE001
            self.settle()
            self._remove_partial(step)
            return step, _first_line(e)
        return None

    def _remove_partial(self, step: int):
        """tensorstore may still finish writes it had begun when the save failed, making the
        directory again (what still remains after that, the next run's start removes:
        cleanup_tmp_directories)."""
        if jax.process_index() == 0:
            for partial in self.directory.glob(f"{step}.orbax-checkpoint-tmp*"):
                remove_until_gone(partial)

    def wait(self):
        self.manager.wait_until_finished()

    def settle(self, timeout: float = 60.0):
        """After a failed save, let its other background writers run out before the process
        exits: once the interpreter shuts down they could not schedule their last steps and
        would print tracebacks about it."""
        deadline = time.monotonic() + timeout
        for thread in threading.enumerate():
            if (
                type(thread).__name__ == "_SignalingThread"
                and thread is not threading.current_thread()
            ):
                # threading's own join: orbax's raises the thread's exception, already reported
                threading.Thread.join(thread, max(0.0, deadline - time.monotonic()))

    def check_shapes(self, step: int, abstract_params):
        """Raise UserError naming every parameter whose saved shape differs from the model's."""
        saved = self.manager.item_metadata(step)["params"]
        want = {
            jax.tree_util.keystr(p): tuple(x.shape)
            for p, x in jax.tree_util.tree_flatten_with_path(abstract_params)[0]
        }
        have = {
            jax.tree_util.keystr(p): tuple(x.shape)
            for p, x in jax.tree_util.tree_flatten_with_path(saved)[0]
        }
        diffs = [
            f"{k} {have.get(k)} in the checkpoint vs {v} now"
            for k, v in want.items()
            if have.get(k) != v
        ]
        diffs += [f"{k} only in the checkpoint" for k in have if k not in want]
        if diffs:
            more = f" (and {len(diffs) - 3} more)" if len(diffs) > 3 else ""
            raise UserError(
                f"checkpoint step {step} in {self.directory} has another model shape: "
                + "; ".join(diffs[:3])
                + more
            )

    def restore(self, step: int, abstract_params, abstract_opt_state, legacy: tuple | None = None):
        """(params, optimizer state, meta) of `step`. `legacy`: (the abstract optimizer state an
        older megajax saved, a function making today's of it); an optimizer state of any other
        form is the user's mistake (another optimizer), raised as a UserError, not damage."""
        self.check_shapes(step, abstract_params)
        saved = _leaf_paths(self.manager.item_metadata(step)["opt_state"])
        target, convert = abstract_opt_state, None
        if legacy is not None and saved == _leaf_paths(legacy[0]):
            target, convert = legacy
        elif saved != _leaf_paths(abstract_opt_state):
            diff = sorted(saved ^ _leaf_paths(abstract_opt_state))
            raise UserError(
                f"checkpoint step {step} in {self.directory} holds another optimizer's state than "
                f"this run's ({len(diff)} entries differ, e.g. {diff[0]})"
            )
        out = self.manager.restore(
            step,
            args=ocp.args.Composite(
                params=ocp.args.StandardRestore(abstract_params),
                opt_state=ocp.args.StandardRestore(target),
                meta=ocp.args.JsonRestore(),
            ),
        )
        opt_state = out["opt_state"] if convert is None else convert(out["opt_state"])
        return out["params"], opt_state, out["meta"]

    def restore_newest_intact(self, restore, warn, set_aside: bool = True):
        """`restore(step)` of the newest step that reads back. A step that fails to read (a
        truncated array file, a missing manifest: a disk or a kill that orbax's commit did not
        cover) is skipped with one warning line and the one before is tried; a training run
        (`set_aside`) also moves it to WORKDIR/damaged/STEP, kept for the user and out of the
        way of the next save of that step. A step that vanished while it was read, or has a
        newer one since, is no damage: the run training in this workdir removed it
        (train.keep_checkpoints) as a reader (eval.py, megajax-convert export) read it, and the
        steps are listed again. Returns
        (step, restore's result) or None if there is no checkpoint; raises UserError if none
        reads back. A checkpoint of another model shape is the user's mistake, not damage: that
        error is raised as it is."""
        damaged: list[int] = []
        for _ in range(MAX_RELISTS):
            listed = self.all_steps()
            steps = [s for s in sorted(listed, reverse=True) if s not in damaged]
            for step in steps:
                try:
                    return step, restore(step)
                except UserError:
                    raise
                except Exception as e:  # noqa: BLE001  (orbax, tensorstore and OS errors alike)
                    if self._superseded(step, listed):
                        break
                    damaged.append(step)
                    where = f"moved to {self.set_aside(step)}" if set_aside else "left in place"
                    warn(
                        f"warning: checkpoint step {step} cannot be read ({_first_line(e)}); "
                        f"{where}; trying the one before"
                    )
            else:
                break
        if damaged or steps:
            raise UserError(
                f"none of the checkpoints in {self.directory} can be read (steps "
                f"{', '.join(map(str, sorted(set(damaged + steps), reverse=True)))})"
            )
        return None

    def _superseded(self, step: int, listed: list[int]) -> bool:
        """Whether `step` is gone or going since the steps were `listed`: orbax removes an old
        step (its directory lingers, half empty, while it goes) once a newer one is complete."""
        self.manager.reload()
        now = self.all_steps()
        return (
            not (self.directory / str(step)).is_dir() or step not in now or max(now) > max(listed)
        )

    def set_aside(self, step: int, why: str = "damaged") -> Path:
        """Move a damaged (or diverged) step out of orbax's way, to WORKDIR/WHY/STEP (so that a
        later save of that step can happen, and a resume does not start from it)."""
        target = self.directory.parent / why / str(step)
        if jax.process_index() == 0:
            target.parent.mkdir(exist_ok=True)
            if target.exists():
                target = target.with_name(f"{step}.{len(list(target.parent.iterdir()))}")
            os.replace(self.directory / str(step), target)
        self.manager.reload()
        return target

    def restore_params(self, step: int, abstract_params):
        """Only the weights (for evaluation): the optimizer state is not read."""
        self.check_shapes(step, abstract_params)
        out = self.manager.restore(
            step,
            args=ocp.args.Composite(
                params=ocp.args.StandardRestore(abstract_params), meta=ocp.args.JsonRestore()
            ),
        )
        return out["params"], out["meta"]

    def close(self):
        self.manager.wait_until_finished()
        self.manager.close()
