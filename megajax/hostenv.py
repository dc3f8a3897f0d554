"""Host-process settings that only work if they are there when the process starts.

XLA:CPU gives every execution of a compiled step one block for its temporaries (36 MiB for
configs/shakespeare_char.toml). glibc serves a block that large with a fresh mmap and unmaps it
when it is freed, so every step page-faults its whole working memory in again: a quarter of a
small model's step time on the CPU (22.1 -> 16.3 ms/step for shakespeare_char). Raising glibc's
mmap and trim thresholds keeps such blocks in the heap, to be reused by the next step.

glibc reads these settings once, at start-up (`mallopt` cannot raise the mmap threshold past
32 MiB), so the command-line programs restart themselves once with them in GLIBC_TUNABLES. In a
notebook or your own script, start Python with them set:

    GLIBC_TUNABLES=glibc.malloc.mmap_threshold=1073741824:glibc.malloc.trim_threshold=1073741824

The cost: up to 1 GiB freed in large blocks stays with the process instead of going back to the
OS. MEGAJAX_MALLOC_TUNING=0 turns the restart off.
"""
from __future__ import annotations

import os
import platform
import sys

MALLOC_TUNABLES = {"glibc.malloc.mmap_threshold": "1073741824", "glibc.malloc.trim_threshold": "1073741824"}


def tuned_env(env: dict) -> dict | None:
    """`env` with the malloc tunables added to GLIBC_TUNABLES, or None if there is nothing to add
    (already there, set by the user to other values, or turned off)."""
    if env.get("MEGAJAX_MALLOC_TUNING", "1") == "0":
        return None
    current = env.get("GLIBC_TUNABLES", "")
    names = {item.split("=", 1)[0] for item in current.split(":") if item}
    missing = [f"{k}={v}" for k, v in MALLOC_TUNABLES.items() if k not in names]
    if not missing:
        return None
    return {**env, "GLIBC_TUNABLES": ":".join(([current] if current else []) + missing)}


def restart_with_malloc_tuning():
    """Re-execute this program (same PID, arguments and interpreter flags) with the malloc
    tunables, once. Only for a program's entry point: it replaces the running process."""
    if sys.platform != "linux" or platform.libc_ver()[0] != "glibc":
        return
    env = tuned_env(dict(os.environ))
    if env is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, sys.orig_argv, env)
