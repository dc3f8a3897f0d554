"""Command lines of train.py and eval.py (also installed as megajax-train / megajax-eval).

jax is imported only after the arguments are read, so --host-devices can still set the
number of simulated CPU devices. User mistakes end as one line on stderr and exit code 2.
"""
from __future__ import annotations

import argparse
import os
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


def train_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="train.py", description="Train a tensor-parallel GPT with megajax.",
        epilog="examples:\n  python train.py\n  python train.py --host-devices 8 --mesh 2x4\n"
               "  python train.py --config shakespeare_char --mesh model=2 --workdir runs/shakespeare\n"
               "  python train.py --config gpt2_8.3b --mesh model=8 --host-devices 8 --dry-run",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="default", help="a name from configs/ or a path to a .toml/.json (default: default)")
    p.add_argument("--mesh", default="auto", help="data=2,model=4 | 2x4 | model=8 | auto (all devices on data)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field, e.g. --set model.num_layers=4 --set train.lr=3e-4")
    p.add_argument("--data", help="builtin | text:PATH[,PATH|GLOB] | bin:PATH | tfds:NAME[/CONFIG]")
    p.add_argument("--tokenizer", help="bytes | chars | hf:PATH/tokenizer.json | tiktoken:NAME")
    p.add_argument("--workdir", help="where checkpoints, metrics and the config go (default: runs/CONFIG)")
    p.add_argument("--steps", type=int, help="total optimizer steps (train.steps)")
    p.add_argument("--host-devices", type=int, help="simulate N devices on the CPU")
    p.add_argument("--log-every", type=int)
    p.add_argument("--eval-every", type=int)
    p.add_argument("--save-every", type=int)
    p.add_argument("--sample-tokens", type=int, default=200, help="tokens to generate at the end (0: none)")
    p.add_argument("--dry-run", action="store_true",
                   help="compile abstractly; print sizes, per-device memory and the collective audit")
    return p


def train_main(argv=None) -> int:
    args = train_parser().parse_args(argv)
    _set_host_devices(args.host_devices)
    from megajax.config import load_config
    from megajax.errors import UserError
    from megajax.mesh import make_mesh
    from megajax.training import train

    try:
        overrides = list(args.set)
        for flag, key in (("steps", "train.steps"), ("log_every", "train.log_every"),
                          ("eval_every", "train.eval_every"), ("save_every", "train.save_every"),
                          ("data", "data.source"), ("tokenizer", "data.tokenizer")):
            if getattr(args, flag) is not None:
                overrides.append(f"{key}={getattr(args, flag)}")
        cfg = load_config(args.config, overrides)
        try:
            mesh = make_mesh(args.mesh)
        except ValueError as e:
            raise UserError(str(e)) from None
        workdir = Path(args.workdir or Path("runs") / cfg.name)
        result = train(cfg, mesh, workdir, dry_run=args.dry_run, sample_tokens=args.sample_tokens)
    except UserError as e:
        return _fail(str(e))
    if getattr(result, "stopped_by", None):
        return 0
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
