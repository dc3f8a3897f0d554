#!/usr/bin/env python
"""Evaluate or sample a train.py workdir: `python eval.py --help`."""
import sys

from megajax.cli import eval_main

if __name__ == "__main__":
    sys.exit(eval_main())
