"""python -m megajax.prepare: the corpus preparation's command line (megajax/cli/prepare.py)."""
import sys

from megajax.cli.prepare import prepare_main

sys.exit(prepare_main())
