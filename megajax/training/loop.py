"""The training loop: what `python train.py` runs.

    train()            = validate()          every check, before anything is written (and the
                                             compiled step's memory against the devices')
                       + restore_or_init()   the newest intact checkpoint, or fresh weights
                       + the steps           the compiled Trainer step (megajax/training/step.py)
                       + finish()            loss curve, a sample

Nothing here gathers weights to the host; a StepLogger (megajax/training/logger.py) reads each
step's metrics.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from pathlib import Path

import jax
import numpy as np

from megajax.config import Config, in_python_terms
from megajax.core.sharding import Layout
from megajax.errors import UserError
from megajax.evaluation.chat import answer_ids
from megajax.files import WorkdirLock
from megajax.host.distributed import agreed_stop, check_same_run
from megajax.host.signals import StopRequested
from megajax.mesh_shape import MeshShape
from megajax.models.generate import generate
from megajax.models.registry import ModelDef, abstract_model
from megajax.runs.checkpoint import Checkpoints
from megajax.runs.metrics import plot_workdir
from megajax.runs.spec import RunSpec
from megajax.runs.tracking import check_tracker
from megajax.runs.workdir import (
    check_layout,
    check_same_blend,
    check_same_tokenizer,
    has_checkpoints,
    init_from_pretrained,
    is_main,
    run_tokenizer,
    run_vocab_size,
    write_run_files,
)
from megajax.tasks import Task, task_for
from megajax.training.logger import StepLogger
from megajax.training.memory import check_step_fits
from megajax.training.profiling import StepTrace
from megajax.training.step import Trainer, build_trainer


@dataclasses.dataclass
class RunResult:
    workdir: Path
    final_step: int
    losses: dict[int, float]
    val_loss: float | None
    stopped_by: str | None = None
    sample: str | None = None
    profile: Path | None = None  # --profile's trace (megajax/tools/profile.py reads it)


@dataclasses.dataclass
class Run:
    """A run that passed every check: its final config, data, trainer and batches."""

    cfg: Config
    workdir: Path
    task: Task
    data: object
    trainer: Trainer
    train_batches: object
    val_batches: object | None
    pretrained: Path | None


def train(
    cfg: Config | RunSpec,
    mesh=None,
    workdir: Path | None = None,
    *,
    sample_tokens: int = 200,
    out=print,
    profile: tuple[int, int] | None = None,
) -> RunResult:
    """Train `cfg` on `mesh` in `workdir`, resuming from its newest intact checkpoint; or the
    run a command line resolved (a RunSpec, taken as it is). `out` receives each line of the
    log (None: no log; metrics.jsonl is written either way). `profile` = (first, last): trace
    those steps with jax.profiler (RunResult.profile)."""
    try:
        if isinstance(cfg, RunSpec):
            if mesh is not None or workdir is not None:
                raise ValueError("train(run_spec) takes the spec's mesh and workdir: give no other")
            spec = cfg
        else:
            if mesh is None or workdir is None:
                raise ValueError("train(cfg, mesh, workdir): give the mesh and the workdir")
            spec = RunSpec.resolve(cfg, mesh, workdir)
        return _train(spec, sample_tokens, out, profile)
    except UserError as e:
        if StopRequested.command_line:
            raise
        raise type(e)(in_python_terms(str(e))) from None  # ConfigError stays one


def _train(spec: RunSpec, sample_tokens: int, out, profile) -> RunResult:
    quiet = out is None  # no log at all: not the step lines either
    workdir, out = spec.workdir, out or (lambda *lines, **kwargs: None)
    # checked now, not when the sample is due at the end of the run
    if isinstance(sample_tokens, bool) or not isinstance(sample_tokens, int) or sample_tokens < 0:
        raise ValueError(
            f"sample_tokens must be an integer >= 0 (0: no sample), got {sample_tokens!r}"
        )
    # signal handlers and the workdir lock, released however train() ends
    with contextlib.ExitStack() as held:
        stop = held.enter_context(StopRequested())
        run = validate(spec, sample_tokens)
        if profile and profile[1] > run.cfg.train.steps:
            raise UserError(
                f"--profile {profile[0]}:{profile[1]} ends after the run's last step, "
                f"{run.cfg.train.steps}"
            )
        if is_main():  # one run per workdir; taken before its checkpoints are read
            held.enter_context(WorkdirLock(workdir))
        t0 = time.perf_counter()
        step_fn = run.trainer.compiled_step()  # for the task's batch layout; nothing allocated yet
        check_step_fits(step_fn)  # (with train.layer_programs this compiles the first programs)
        compile_s = time.perf_counter() - t0
        ckpts = Checkpoints(workdir, keep=run.cfg.train.keep_checkpoints)
        start, params, opt_state = restore_or_init(run, ckpts, out)
        write_run_files(run.cfg, workdir, run.data.tokenizer)  # only now, with every check passed
        logger = StepLogger(run, ckpts, start, out, quiet)
        held.callback(logger.tracking.close)  # however the run ends, its event files complete
        logger.announce(compile_s)
        trace = StepTrace(profile, workdir, is_main(), step_fn, start or 0, out)
        held.callback(trace.stop)
        stop.start_training()
        with logger.watchdog:  # a frozen peer: one line, not the runtime's abort
            step, params, stopped_by = _steps(
                run, logger, ckpts, stop, step_fn, params, opt_state, start or 0, trace
            )
        logger.close()
        ckpts.close()
        result = finish(run, logger, step, params, stopped_by, sample_tokens, out, stop)
        result.profile = trace.dir
        return result


def validate(spec: RunSpec, sample_tokens: int = 0) -> Run:
    """Every check of a resolved run before anything is written: the config against the
    workdir and the other processes, the data, the sizes against the mesh. Returns the Run,
    whose final config has its vocabulary size set here, and only here, from the data."""
    cfg, mesh, workdir, pretrained = spec.cfg, spec.mesh, spec.workdir, spec.pretrained
    check_layout(workdir)
    task = task_for(cfg)
    if (
        cfg.model.lora_rank
        and pretrained is None
        and not cfg.train.random_base
        and not has_checkpoints(workdir)
    ):
        raise UserError(
            "LoRA trains adapters on a frozen base: give the pretrained base with --init-from DIR "
            "(--set train.random_base=true adapts random weights)"
        )
    check_tracker(cfg.train.tracker)
    # Everything the processes' collectives depend on, before the first one: a mesh of another
    # shape or device order, or a sample of another length, would leave them waiting on each other.
    check_same_run(
        {
            "config": cfg.to_dict(),
            "workdir": str(workdir),
            "sample_tokens": sample_tokens,
            "mesh": {"axes": dict(mesh.shape), "devices": mesh.device_ids.tolist()},
        }
    )
    check_same_tokenizer(cfg, workdir)
    check_same_blend(cfg, workdir)
    data = task.load_data(cfg, run_tokenizer(workdir, pretrained))
    vocab = run_vocab_size(cfg, pretrained, data.vocab_size)
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=vocab))
    trainer = build_trainer(cfg, mesh)  # checks sizes against the mesh: ConfigError
    sharding = trainer.batch_sharding
    # the batches: a UserError if the data is too short for one
    return Run(
        cfg,
        workdir,
        task,
        data,
        trainer,
        data.batches("train", cfg, sharding),
        data.batches("val", cfg, sharding),
        pretrained,
    )


def restore_or_init(run: Run, ckpts: Checkpoints, out) -> tuple[int | None, dict, object]:
    """(step, params, optimizer state) of the newest checkpoint that reads back, or (None,
    fresh state): new weights, with --init-from's encoder when fine-tuning."""
    target_p, target_o = run.trainer.checkpoint_target()
    # an older megajax's optimizer state, upgraded to this mesh's shapes: where they are the
    # checkpoint's (a model axis that divides the padded vocabulary)
    m = run.trainer.cfg.model
    legacy = (
        run.trainer.legacy_opt_state()
        if m.vocab_rows(MeshShape.of(run.trainer.mesh)) == m.padded_vocab
        else None
    )
    found = ckpts.restore_newest_intact(
        lambda s: ckpts.restore(s, target_p, target_o, legacy),
        warn=out if is_main() else lambda _: None,
    )
    if found is not None:
        step, (params, opt_state, _) = found
        return (step, *run.trainer.from_checkpoint(params, opt_state))
    params, opt_state = run.trainer.init_state()
    if run.pretrained is not None:
        layers_order = run.trainer.stored(params, inverse=True)[0]
        params = run.trainer.stored(
            init_from_pretrained(run.trainer, layers_order, run.pretrained, out)
        )[0]
    return None, params, opt_state


def _steps(
    run: Run,
    logger: StepLogger,
    ckpts: Checkpoints,
    stop: StopRequested,
    step_fn,
    params,
    opt_state,
    start: int,
    trace: StepTrace,
):
    """Train until train.steps or an agreed stop; returns (last step, params, the signal that
    stopped it)."""
    t = run.cfg.train
    eval_fn = run.trainer.jit_eval()
    step = start
    while step < t.steps:
        trace.before(step + 1)
        params, opt_state, m = step_fn(params, opt_state, run.train_batches(step), np.int32(step))
        step += 1
        if hasattr(run.train_batches, "metrics"):  # a blend: each component's samples so far
            m = {**m, **run.train_batches.metrics(step)}
            for line in run.train_batches.new_epochs(step) if is_main() else ():
                logger.progress.write(line)
        trace.after(step, m)
        logger.add(step, m)
        logged = step % t.log_every == 0 or step == t.steps or step == start + 1
        if logged:
            logger.log(step)
        if run.val_batches is not None and (step % t.eval_every == 0 or step == t.steps):
            logger.log_eval(step, evaluate(eval_fn, params, run.val_batches, t.eval_batches))
        # read once (a signal may arrive at any moment), agreed by all
        stopping = agreed_stop(stop.requested)
        if step % t.save_every == 0 or step == t.steps or stopping:
            if not logged:
                logger.flush(step)  # never save weights from a step whose loss was not finite
            # the save before this one: orbax finishes it first
            logger.save_failed(ckpts.failed_save(block=True))
            logger.saved(
                step,
                ckpts.save(
                    step,
                    *run.trainer.natural(params, opt_state),
                    {"step": step, "config": run.cfg.name},
                ),
            )
        else:
            logger.save_failed(ckpts.failed_save())  # a background save that failed: known at once
            if step % t.eval_every == 0:
                logger.restart_clock(step)  # throughput excludes evaluation
        if stopping:
            return step, params, stopping
    return step, params, None


def evaluate(eval_fn, params, val_batches, max_batches: int) -> dict:
    """Mean of every metric over the validation batches (at most train.eval_batches). A batch
    whose masked loss has no target has no loss (its 0 is no measurement) and is left out; a
    validation set with no target at all is an error, never a perfect score."""
    if hasattr(val_batches, "results"):  # a blend: each component's, and their weighted mean
        return val_batches.results(lambda part: evaluate(eval_fn, params, part, max_batches))
    n = getattr(val_batches, "num_batches", max_batches)
    results = jax.device_get([eval_fn(params, val_batches(i)) for i in range(n)])
    results = [r for r in results if r.pop("targets", 1) > 0]
    if not results:
        raise UserError(
            "the validation batches hold no target token, so no validation loss: give held-out "
            "data with targets, or set data.val_fraction = 0 for no validation"
        )
    return {k: float(np.mean([r[k] for r in results])) for k in results[0]}


def finish(
    run: Run,
    logger: StepLogger,
    step: int,
    params,
    stopped_by: str | None,
    sample_tokens: int,
    out,
    stop: StopRequested,
) -> RunResult:
    result = RunResult(run.workdir, step, logger.losses, logger.val_loss, stopped_by)
    main = is_main()
    if stopped_by:
        if main:
            out(
                f"{stopped_by}: saved a checkpoint at step {step} in {run.workdir}; run the same "
                "command again to resume"
            )
        return result
    if main:
        try:
            curve = f"; loss curve {plot_workdir(run.workdir)}"
        except OSError as e:  # a full disk: the run is saved, only its picture is missing
            curve = f"; no loss curve ({e.strerror})"
        except UserError:  # no loss logged yet (a run resumed at its last step, metrics off)
            curve = ""
        final = f", final train loss {logger.losses[step]:.4f}" if step in logger.losses else ""
        out(
            f"done: {step} steps{final}"
            + (f", val loss {logger.val_loss:.4f}" if logger.val_loss is not None else "")
            + curve
        )
    # every process takes part: the model is sharded over all
    if sample_tokens and run.task.sample_after_training:
        # One process may stop its sample on a signal: the run is saved. (Several may not: the
        # others would wait for it in the sample's collectives.)
        stop.sampling = jax.process_count() == 1
        result.sample = sample_text(
            run.trainer, params, run.data, sample_tokens, stopped=stop.sample_stopped
        )
        if stop.sample_stopped():
            out(
                f"{stop.requested}: stopped the sample; the run is complete, its last checkpoint "
                f"at step {step}"
            )
        if main:
            out("sample:\n" + result.sample)
    return result


def sample_text(
    trainer: Trainer,
    params,
    data,
    n_tokens: int,
    temperature: float = 0.8,
    top_k: int = 40,
    stopped=None,
) -> str:
    layout = Layout.for_model(trainer.mesh, trainer.cfg.model, "inference")
    model = ModelDef(abstract_model(trainer.cfg.model, layout)).bind(
        trainer.stored(params, inverse=True)[0]
    )
    key = jax.random.key(trainer.cfg.train.seed)
    if getattr(data, "sample_prompt", None):  # conversations: the assistant's answer
        r = answer_ids(
            model,
            data.tokenizer,
            data.sample_prompt,
            n_tokens,
            temperature,
            top_k,
            key,
            stopped=stopped,
        )
        return r["prompt"] + r["answer"]
    prompt = np.asarray(data.val[:16] if len(data.val) >= 16 else data.train[:16], dtype=np.int32)
    new = generate(
        model,
        prompt[None],
        n_tokens,
        temperature,
        top_k,
        key,
        eos_id=data.tokenizer.eos_id,
        stopped=stopped,
    )
    return data.tokenizer.decode(prompt) + data.tokenizer.decode(new[0])
