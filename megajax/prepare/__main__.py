"""python -m megajax.prepare: the corpus preparation's command line (megajax/cli/prepare.py)."""

from megajax.cli import prepare_command

prepare_command()
