"""Command lines of train.py and eval.py (also installed as megajax-train / megajax-eval).

jax is imported only after the arguments are read, so --host-devices can still set the
number of simulated CPU devices. User mistakes end as one line on stderr and exit code 2.
"""
from __future__ import annotations

import argparse
import math
import os
import signal
import sys
from pathlib import Path


def _set_host_devices(n: int | None):
    if n:
        flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
                 if not f.startswith("--xla_force_host_platform_device_count")]
        os.environ["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={n}"])


def _fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2


def _lost_peer(e: Exception):
    """In a multi-process run, a failed collective or barrier almost always means another
    process died: say so in one line and leave at once, without JAX's shutdown barrier
    (which would wait for the dead peer). Checkpoints already finalised stay valid."""
    import jax

    if jax.process_count() > 1:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        print(f"error: process {jax.process_index()} of {jax.process_count()}: {type(e).__name__}: {first} "
              f"(another process has probably died; completed checkpoints are intact)", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(1)


def train_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="train.py", description="Train a tensor-parallel GPT or BERT with megajax.",
        epilog="examples:\n  python train.py\n  python train.py --host-devices 8 --mesh 2x4\n"
               "  python train.py --config shakespeare_char --mesh model=2 --workdir runs/shakespeare\n"
               "  python train.py --config gpt2_8.3b --mesh model=8 --host-devices 8 --dry-run\n"
               "  python train.py --config bert_small --workdir runs/bert\n"
               "  python train.py --config finetune_race --init-from runs/bert --data RACE --workdir runs/bert_race",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="default", help="a name from configs/ or a path to a .toml/.json (default: default)")
    p.add_argument("--mesh", default="auto", help="data=2,model=4 | 2x4 | model=8 | auto (all devices on data)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field, e.g. --set model.num_layers=4 --set train.lr=3e-4")
    p.add_argument("--data", help="builtin | text:PATH[,PATH|GLOB] | bin:PATH | tfds:NAME[/CONFIG]")
    p.add_argument("--tokenizer", help="bytes | chars | hf:PATH/tokenizer.json | tiktoken:NAME")
    p.add_argument("--workdir", help="where checkpoints, metrics and the config go (default: runs/CONFIG)")
    p.add_argument("--init-from", metavar="DIR", help="BERT fine-tuning: start the encoder from this pretraining workdir")
    p.add_argument("--steps", type=int, help="total optimizer steps (train.steps)")
    p.add_argument("--host-devices", type=int, help="simulate N devices on the CPU")
    p.add_argument("--log-every", type=int)
    p.add_argument("--eval-every", type=int)
    p.add_argument("--save-every", type=int)
    p.add_argument("--sample-tokens", type=int, default=200, help="tokens to generate at the end (0: none)")
    p.add_argument("--dry-run", action="store_true",
                   help="compile abstractly; print sizes, per-device memory and the collective audit")
    _add_distributed_args(p)
    return p


def _add_distributed_args(p):
    g = p.add_argument_group("multi-process (jax.distributed; on SLURM/Open MPI/... detected automatically)")
    g.add_argument("--coordinator", help="HOST:PORT of process 0's coordination service")
    g.add_argument("--num-processes", type=int)
    g.add_argument("--process-id", type=int)
    g.add_argument("--heartbeat-timeout", type=int, default=60,
                   help="seconds after which a silent peer counts as dead (default 60)")


def _start_distributed(args):
    from megajax.distributed import initialize

    initialize(args.coordinator, args.num_processes, args.process_id, args.heartbeat_timeout)


class _Stopped(BaseException):   # not an Exception: nothing on the way may swallow it
    pass


def _stop_during_startup(signum, frame):
    raise _Stopped(f"{signal.Signals(signum).name} during start-up: stopped before training any step")


def train_main(argv=None) -> int:
    args = train_parser().parse_args(argv)
    _set_host_devices(args.host_devices)
    # Until train() takes over the signals (megajax/training.py), one stops the run with a line.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _stop_during_startup)
    try:
        return _train_main(args)
    except _Stopped as e:
        return _fail(str(e))


def _train_main(args) -> int:
    from megajax.config import load_config
    from megajax.errors import UserError
    from megajax.mesh import make_mesh
    from megajax.training import train

    try:
        _start_distributed(args)
        overrides = list(args.set)
        for flag, key in (("steps", "train.steps"), ("log_every", "train.log_every"),
                          ("eval_every", "train.eval_every"), ("save_every", "train.save_every"),
                          ("data", "data.source"), ("tokenizer", "data.tokenizer"), ("init_from", "train.init_from")):
            if getattr(args, flag) is not None:
                overrides.append(f"{key}={getattr(args, flag)}")
        cfg = load_config(args.config, overrides)
        try:
            mesh = make_mesh(args.mesh)
        except ValueError as e:
            raise UserError(str(e)) from None
        workdir = Path(args.workdir or Path("runs") / cfg.name)
        train(cfg, mesh, workdir, dry_run=args.dry_run, sample_tokens=args.sample_tokens)
    except UserError as e:
        return _fail(str(e))
    except Exception as e:  # noqa: BLE001
        _lost_peer(e)
        raise
    return 0


def plot_main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="megajax-plot", description="Draw WORKDIR/loss.png from metrics.jsonl")
    p.add_argument("workdir")
    p.add_argument("--out")
    args = p.parse_args(argv)
    from megajax.errors import UserError
    from megajax.metrics import plot_workdir

    try:
        print(plot_workdir(Path(args.workdir), args.out and Path(args.out)))
    except UserError as e:
        return _fail(str(e))
    return 0


def eval_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="eval.py", description="Evaluate or sample a train.py workdir (GPT or BERT) on any mesh.",
        epilog="examples:\n"
               "  python eval.py --workdir runs/default --task ppl --data text:notes.txt\n"
               "  python eval.py --workdir runs/gpt --task wikitext --data ../shared/data/wikitext-2/test.txt\n"
               "  python eval.py --workdir runs/gpt --task lambada --data lambada_test.jsonl\n"
               "  python eval.py --workdir runs/default --task sample --prompt 'def main(' --host-devices 8 --mesh 2x4\n"
               "  python eval.py --workdir runs/bert_race --task race --data RACE",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workdir", required=True)
    p.add_argument("--task", required=True, choices=["ppl", "wikitext", "lambada", "sample", "mlm", "race", "mnli", "qqp"])
    p.add_argument("--data", help="ppl: text:PATH | bin:PATH | PATH; wikitext: the .txt file; lambada: the .jsonl file; "
                                   "mlm: text:PATH | PATH | builtin; race/mnli/qqp: the task's directory")
    p.add_argument("--split", help="race: dev | test (default test); mnli: dev_matched | dev_mismatched; qqp: dev")
    p.add_argument("--mesh", default="auto")
    p.add_argument("--host-devices", type=int)
    p.add_argument("--step", type=int, help="checkpoint step (default: the latest)")
    p.add_argument("--out", help="JSON result file (default: WORKDIR/eval_TASK.json)")
    p.add_argument("--stride", type=int, default=32, help="overlapping-window stride (the paper: 32)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--prompt", default="", help="sample: the text to continue")
    p.add_argument("--max-new-tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-k", type=int, default=40)
    p.add_argument("--seed", type=int, default=0)
    _add_distributed_args(p)
    return p


def _check_eval_args(args):
    """Everything about eval.py's arguments that can be checked before loading a model."""
    from megajax.errors import UserError

    if args.task == "sample":
        if args.max_new_tokens < 1:
            raise UserError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
        if not (math.isfinite(args.temperature) and args.temperature >= 0):
            raise UserError(f"--temperature must be 0 (greedy) or positive, got {args.temperature}")
        if args.top_k < 0:
            raise UserError(f"--top-k must be 0 (no limit) or positive, got {args.top_k}")
    if args.batch_size < 1:
        raise UserError(f"--batch-size must be at least 1, got {args.batch_size}")
    out = Path(args.out) if args.out else None
    if out is not None and not (out.parent.is_dir() and os.access(out.parent, os.W_OK)):
        raise UserError(f"--out {out}: the directory {out.parent} does not exist or is not writable")


def eval_main(argv=None) -> int:
    args = eval_parser().parse_args(argv)
    _set_host_devices(args.host_devices)
    import json

    from megajax.errors import UserError
    from megajax.evaluation import run_task
    from megajax.mesh import make_mesh

    try:
        _check_eval_args(args)
        _start_distributed(args)
        try:
            mesh = make_mesh(args.mesh)
        except ValueError as e:
            raise UserError(str(e)) from None
        result = run_task(args, mesh)
    except UserError as e:
        return _fail(str(e))
    except Exception as e:  # noqa: BLE001
        _lost_peer(e)
        raise
    import jax

    from megajax.files import write_atomic

    if jax.process_index() == 0:
        out = Path(args.out) if args.out else Path(args.workdir) / f"eval_{args.task}.json"
        write_atomic(out, json.dumps(result, indent=2) + "\n")
        print(f"wrote {out}")
    return 0


def _command(main):
    """A program's entry point: first restart with the host settings of megajax/hostenv.py."""
    def run() -> int:
        from megajax.hostenv import restart_with_malloc_tuning

        restart_with_malloc_tuning()
        return main()
    return run


train_command = _command(train_main)   # python train.py, megajax-train
eval_command = _command(eval_main)     # python eval.py, megajax-eval
