"""python -m megajax.convert: the converter's command line (megajax/cli/convert.py)."""

from megajax.cli import convert_command

convert_command()
