#!/usr/bin/env python
"""Train a tensor-parallel GPT: `python train.py --help`."""
import sys

from megajax.cli import train_main

if __name__ == "__main__":
    sys.exit(train_main())
