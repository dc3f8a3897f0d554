"""megajax-plan / python -m megajax plan: how to run a config on N devices, before renting them."""

from __future__ import annotations

import argparse
import json

from megajax.cli.common import Parser, exit_on_signal, fail, failed, given, guard_stdout
from megajax.errors import UserError
from megajax.hardware import BUILTIN


def plan_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="megajax-plan",
        description="Predict memory, step time, MFU and scaling for every way to run a config on "
        "N devices, the fastest plan that fits first. Nothing is compiled.",
        epilog="examples:\n"
        "  megajax-plan --config gpt2_8.3b --devices 512 --hardware v100-dgx2h\n"
        "  megajax-plan --config gpt2_1.2b --devices 8 --hardware h200 --json\n"
        "  megajax-plan --config gpt2_8.3b --devices 64 --hardware my_gpus.toml:my-gpu --baseline "
        "gpt2_1.2b",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--config",
        type=given,
        default="default",
        help="a name from configs/ or a path to a .toml/.json",
    )
    p.add_argument("--devices", type=int, required=True, help="how many GPUs")
    p.add_argument(
        "--hardware",
        default="h100-80g",
        help=f"{' | '.join(BUILTIN)}, or FILE.toml[:NAME] (default: h100-80g)",
    )
    p.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field"
    )
    p.add_argument(
        "--baseline",
        help="the config whose one-device run scaling efficiency is measured against (default: "
        "this config)",
    )
    p.add_argument(
        "--schemes",
        default="plain,zero,fsdp",
        help="data-parallel schemes to consider: plain, zero (ZeRO-1), fsdp (default: all three)",
    )
    p.add_argument("--top", type=int, default=10, help="plans to print (default 10)")
    p.add_argument("--json", action="store_true", help='print {"plans": [...]}, best first')
    return p


def plan_main(argv=None) -> int:
    guard_stdout()
    args = plan_parser().parse_args(argv)
    # jax (for the model's shapes) is imported only now, as every command line does.
    from megajax.config import load_config
    from megajax.plan import pick_hardware, plan
    from megajax.plan.report import render

    try:
        if args.top < 1:
            raise UserError(f"--top must be at least 1, got {args.top}")
        hw = pick_hardware(args.hardware)
        cfg = load_config(args.config, args.set)
        found = plan(
            cfg,
            args.devices,
            hw,
            baseline=args.baseline,
            schemes=tuple(s.strip() for s in args.schemes.split(",") if s.strip()),
        )
    except UserError as e:
        return fail(str(e))
    except Exception as e:  # noqa: BLE001  (out of memory: one line; a bug: raised)
        return failed(e, "plan fewer --devices or --schemes")
    if args.json:
        # allow_nan=False: the output is JSON (no bare NaN), or this raises: a bug, not a table
        print(
            json.dumps(
                {
                    "config": cfg.name,
                    "devices": args.devices,
                    "hardware": hw.name,
                    "plans": [p.to_json() for p in found],
                },
                indent=1,
                allow_nan=False,
            )
        )
    else:
        print(render(cfg, args.devices, hw, found, args.top))
    return 0


def plan_command() -> int:
    """megajax-plan: nothing runs on a device, so no restart for the host's allocator settings,
    and the shapes it reads need no accelerator: JAX's CPU backend, whatever JAX_PLATFORMS names
    (a GPU node's setting, or a jax installed without that backend), so that it plans anywhere."""
    import jax  # (python -m megajax.plan has imported it already; no backend has started)

    jax.config.update("jax_platforms", "cpu")
    exit_on_signal("stopped by {signal}: nothing was planned")  # Ctrl-C: one line, not a traceback
    return plan_main()
