"""train.py / megajax-train."""

from __future__ import annotations

import argparse
import signal
from pathlib import Path

from megajax.cli.common import (
    Parser,
    add_distributed_args,
    bound_shutdown,
    fail,
    failed,
    given,
    guard_stdout,
    program_devices,
    set_host_devices,
    start_jax,
    stop_during_startup,
)
from megajax.config import FLAG_KEYS, load_config
from megajax.errors import UserError
from megajax.host.signals import STOP_SIGNALS, StopRequested, stdout_closed


def train_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="train.py",
        description="Train a tensor-parallel GPT, BERT or Llama-family model with megajax, or "
        "fine-tune one.",
        epilog="examples:\n"
        "  python train.py\n"
        "  python train.py --host-devices 8 --mesh 2x4\n"
        "  python train.py --config shakespeare_char --mesh model=2 --host-devices 2 --workdir "
        "runs/shakespeare\n"
        "  python train.py --config gpt2_8.3b --mesh model=8 --host-devices 8 --dry-run\n"
        "  python train.py --config bert_small --workdir runs/bert\n"
        "  python train.py --config finetune_race --init-from runs/bert --data RACE --workdir "
        "runs/bert_race",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--config",
        type=given,
        default="default",
        help="a name from configs/ or a path to a .toml/.json (default: default)",
    )
    p.add_argument(
        "--mesh",
        default="auto",
        help="data=2,model=4 | 2x4 | model=8 | data=2,pipe=2,model=2 (pipeline stages) | "
        "data=2,expert=4 (a mixture of experts' experts split over 4 devices) | auto "
        "(all devices on data; if the model does not fit there, the fastest mesh megajax-plan "
        "predicts to fit)",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config field, e.g. --set model.num_layers=4 --set train.lr=3e-4",
    )
    p.add_argument(
        "--data",
        type=given,
        help="builtin | text:PATH[,PATH|GLOB] | bin:PATH | bin:DIR | pairs:DIR | megatron:PREFIX "
        "| tfds:NAME[/CONFIG] | chat:FILE.jsonl[,FILE|GLOB] | chat:DIR | 'W1 SPEC1 W2 SPEC2 ...' "
        "(a weighted blend of token sources); fine-tuning: the task's directory (data.source)",
    )
    p.add_argument(
        "--tokenizer",
        type=given,
        help="bytes | chars | hf:PATH/tokenizer.json | hf:DIR | tiktoken:NAME | "
        "wordpiece:PATH/vocab.txt | wordpiece[:SIZE] (data.tokenizer)",
    )
    p.add_argument(
        "--workdir",
        type=given,
        help="where checkpoints, metrics and the config go (default: runs/CONFIG)",
    )
    p.add_argument(
        "--init-from",
        type=given,
        metavar="DIR",
        help="start from this workdir's weights (BERT fine-tuning: its encoder; a GPT: all of "
        "them; e.g. one made by megajax-convert import)",
    )
    _add_loop_args(p)
    add_distributed_args(p)
    return p


def _add_loop_args(p):
    """The loop's flags: steps, what to log and save when, a sample, a profile, a dry run."""
    p.add_argument("--steps", type=int, help="total optimizer steps (train.steps)")
    p.add_argument(
        "--host-devices", type=int, help="simulate N devices on the CPU (before jax starts)"
    )
    p.add_argument("--log-every", type=int, help="steps between log lines (train.log_every)")
    p.add_argument("--eval-every", type=int, help="steps between validations (train.eval_every)")
    p.add_argument("--save-every", type=int, help="steps between checkpoints (train.save_every)")
    p.add_argument(
        "--sample-tokens",
        type=int,
        help="GPT: tokens to generate at the end (default 200; 0: none)",
    )
    p.add_argument(
        "--profile",
        metavar="START:STOP",
        help="trace steps START..STOP with jax.profiler into WORKDIR/tensorboard (TensorBoard's "
        "profile tab, Perfetto) and print where their time went",
    )
    p.add_argument(
        "--tracker",
        choices=("tensorboard", "wandb"),
        help="train.tracker: TensorBoard event files in WORKDIR/tensorboard (always), and W&B too "
        "with wandb (pip install 'megajax[wandb]')",
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="compile abstractly; print sizes, per-device memory and the collective audit",
    )
    p.add_argument(
        "--costs",
        action="store_true",
        help="with --dry-run: compile variants of the step too, for activation bytes per sequence "
        "and per layer (compiled and modelled) and the step's FLOPs with recomputation's share",
    )


def train_main(argv=None) -> int:
    guard_stdout(on_close=stdout_closed, to_stderr=True)  # `train.py | head`: stop and save
    args = train_parser().parse_args(argv)
    set_host_devices(args.host_devices)
    # Until train() takes over the signals (megajax/host/signals.py), one stops the run with a line.
    for sig in STOP_SIGNALS:
        signal.signal(sig, stop_during_startup)
    StopRequested.command_line = True
    status = 1
    try:
        status = _train_main(args)
        return status
    finally:
        # The exit status is decided. Python resets its own handlers to the default (die) while
        # the interpreter shuts down, and the multi-process runtime's shutdown at exit waits for
        # the peers: a signal then (a preemption reaching this node after the other) would end
        # the process by signal instead of with its status; a peer that never comes, by abort.
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)
        bound_shutdown(status)


def _train_main(args) -> int:
    try:
        if args.sample_tokens is not None and args.sample_tokens < 0:
            raise UserError(f"--sample-tokens must be 0 (none) or more, got {args.sample_tokens}")
        # Before jax is imported (a second or two): a mistake in the config is reported at once.
        overrides = list(args.set) + [
            f"{key}={getattr(args, flag)}"
            for flag, key in FLAG_KEYS
            if getattr(args, flag) is not None
        ]
        asked = load_config(args.config, overrides)
        # jax is imported only now, with --host-devices in XLA_FLAGS (megajax/cli/common.py).
        from megajax.core.mesh import make_mesh
        from megajax.plan.auto import resolve_mesh
        from megajax.runs.spec import RunSpec
        from megajax.runs.workdir import refuse_overridden_shape, with_pretrained_shape
        from megajax.tools.dry_run import dry_run_report
        from megajax.training.loop import train
        from megajax.training.profiling import parse_window

        workdir = Path(args.workdir or Path("runs") / asked.name)
        window = parse_window(args.profile)
        if window and args.dry_run:
            raise UserError("--profile traces a run's steps; a --dry-run runs none")
        # the config with a pretrained workdir's shape and tokenizer: its config read once, here
        cfg, pretrained = with_pretrained_shape(asked, workdir)
        refuse_overridden_shape(asked, cfg, overrides)
        start_jax(args)
        try:
            devices = program_devices(args.host_devices)
            shape, why = resolve_mesh(args.mesh, lambda: cfg, devices)
            # the run, resolved once: training checks none of it again
            run = RunSpec(cfg, make_mesh(shape, devices), workdir, pretrained)
        except ValueError as e:
            raise UserError(str(e)) from None
        if why:
            print(f"megajax: {why}", flush=True)
        if not args.dry_run:
            refuse_far_too_big(run)
        if args.dry_run:
            dry_run_report(run.cfg, run.mesh, costs=args.costs)
        elif args.costs:
            raise UserError("--costs goes with --dry-run")
        else:
            # handles the signals itself
            result = train(
                run, profile=window, sample_tokens=_sample_tokens(args.sample_tokens, cfg)
            )
            if result.profile is not None:
                from megajax.tools.profile import by_kind_line, time_by_kind

                steps = window[1] - window[0] + 1
                print(
                    f"profile of steps {window[0]}-{window[1]} in {result.profile} (tensorboard "
                    f"--logdir {workdir / 'tensorboard'}); per step, by kind: "
                    f"{by_kind_line(time_by_kind(result.profile), steps)}"
                )
    except UserError as e:
        return fail(str(e))
    except Exception as e:  # noqa: BLE001
        return failed(
            e,
            "lower train.batch_size or model.seq_len, raise train.microbatches, set model.remat, "
            "or use a larger model axis (checkpoints already saved are intact)",
        )
    return 0


def refuse_far_too_big(run):
    """Sizes far beyond the devices are refused at once, not after minutes of compiling."""
    import jax

    from megajax.core.mesh import check_fits
    from megajax.plan.memory import far_too_big
    from megajax.training.memory import device_memory_bytes

    cfg, shape = run.cfg, run.shape
    try:
        check_fits(cfg, shape)
    except UserError:
        return  # train() says what is wrong with it, in its order
    why = far_too_big(cfg, shape, jax.default_backend(), device_memory_bytes())
    if why:
        raise UserError(why)


def _sample_tokens(given: int | None, cfg) -> int:
    """--sample-tokens, 200 by default; a number of tokens for a run that writes no sample (a
    BERT) is refused, not silently unused."""
    from megajax.tasks import task_for

    if given and not task_for(cfg).sample_after_training:
        raise UserError(
            "--sample-tokens is for a GPT run, which ends with a sample; this run trains a "
            f"{cfg.model.kind} ({cfg.model.task}), which writes none"
        )
    return 200 if given is None else given
