#!/usr/bin/env python
"""Evaluate or sample a train.py workdir: `python eval.py --help`."""

import runpy
from pathlib import Path

if __name__ == "__main__":
    # Before megajax (and jax) is imported: may restart this process once (megajax/host/env.py).
    runpy.run_path(str(Path(__file__).resolve().parent / "megajax" / "host" / "env.py"))[
        "restart_with_malloc_tuning"
    ]()
    from megajax.cli import eval_main
    from megajax.cli.common import end

    end(eval_main())  # exits, bounded however its threads end
