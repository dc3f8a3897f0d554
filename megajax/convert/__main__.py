"""python -m megajax.convert: the converter's command line (megajax/cli/convert.py)."""
import sys

from megajax.cli.convert import convert_main

sys.exit(convert_main())
