#!/usr/bin/env python
"""Train a tensor-parallel GPT: `python train.py --help`."""

import runpy
from pathlib import Path

if __name__ == "__main__":
    # Before megajax (and jax) is imported: may restart this process once (megajax/host/env.py).
    runpy.run_path(str(Path(__file__).resolve().parent / "megajax" / "host" / "env.py"))[
        "restart_with_malloc_tuning"
    ]()
    from megajax.cli import train_main
    from megajax.cli.common import end

    end(train_main())  # exits, bounded however its threads end
