"""The command-line programs: train.py / megajax-train, eval.py / megajax-eval, megajax-plot,
megajax-plan, megajax-convert, megajax-prepare.
Importing this package does not import jax (see megajax/cli/common.py). megajax-plot is
megajax.cli.plot, not imported here, so that `python -m megajax.cli.plot` runs it cleanly."""

from megajax.cli.common import command
from megajax.cli.convert import convert_main
from megajax.cli.eval import eval_main
from megajax.cli.plan import plan_command, plan_main
from megajax.cli.prepare import prepare_main
from megajax.cli.train import train_main

train_command = command(train_main)  # python train.py, megajax-train
eval_command = command(eval_main)  # python eval.py, megajax-eval
# megajax-convert, python -m megajax.convert
convert_command = command(convert_main, restart=False)
# megajax-prepare, python -m megajax.prepare
prepare_command = command(prepare_main, restart=False)

__all__ = [
    "convert_command",
    "convert_main",
    "prepare_command",
    "eval_command",
    "eval_main",
    "plan_command",
    "plan_main",
    "prepare_main",
    "train_command",
    "train_main",
]
