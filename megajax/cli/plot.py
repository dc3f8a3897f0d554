"""megajax-plot / python -m megajax plot WORKDIR: redraw a run's loss curve from its
metrics.jsonl."""

from __future__ import annotations

import sys
from pathlib import Path

from megajax.cli.common import Parser, exit_on_signal, fail, failed, given, guard_stdout
from megajax.errors import UserError


def plot_parser() -> Parser:
    p = Parser(prog="megajax-plot", description="Draw WORKDIR/loss.png from metrics.jsonl")
    p.add_argument("workdir", type=given, help="a run's workdir (its metrics.jsonl)")
    p.add_argument(
        "--out",
        type=given,
        help="the picture (default WORKDIR/loss.png); its suffix picks the format: .png, .pdf, "
        ".svg, .jpg, ...",
    )
    return p


def plot_main(argv=None) -> int:
    guard_stdout()
    args = plot_parser().parse_args(argv)
    # imports jax: after the arguments, as everywhere
    from megajax.runs.metrics import plot_workdir
    from megajax.runs.workdir import refuse_run_file

    try:
        if args.out:
            refuse_run_file(Path(args.out), may_write=("loss.png",))
        print(plot_workdir(Path(args.workdir), args.out and Path(args.out)))
    except UserError as e:
        return fail(str(e))
    except Exception as e:  # noqa: BLE001  (a full disk: one line; a bug: raised)
        return failed(e, "close other programs")
    return 0


def plot_command() -> int:
    """megajax-plot: a signal ends it in one line; the picture appears whole (os.replace) or not at
    all."""
    exit_on_signal("stopped by {signal}: the picture is written whole or not at all")
    return plot_main()


if __name__ == "__main__":  # from a checkout, without pip install
    sys.exit(plot_command())
