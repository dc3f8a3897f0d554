"""Host-process settings that only work if they are there when the process starts.

XLA:CPU gives every execution of a compiled program fresh blocks for its temporaries and outputs
(36 MiB of temporaries for configs/shakespeare_char.toml's step, 1.9 GiB for bench/step_mfu.py's
8-layer model). With glibc's defaults every such block is a fresh mmap, unmapped when freed, so
every step page-faults its whole working memory in again, 4 KiB at a time: 630,000 faults per
step of bench/step_mfu.py's model, a quarter of shakespeare_char's step time. Three settings:

- mmap_threshold and trim_threshold (1 GiB): blocks below 1 GiB that the main thread allocates
  come from the heap and stay there when freed, to be reused by the next step
  (shakespeare_char: 22.1 -> 16.3 ms/step).
- hugetlb=1 (glibc 2.35+; older versions ignore it): the blocks glibc still maps fresh get 2 MiB
  transparent huge pages, where /sys/kernel/mm/transparent_hugepage/enabled is `madvise` or
  `always`: 512 times fewer faults. Those are the blocks above 1 GiB, and every block of 64 MiB
  or more that one of XLA's worker threads allocates (most of a step's): a thread's own arena
  serves those with a fresh mmap whatever the thresholds say. bench/step_mfu.py's model:
  630,000 -> 10,000-24,000 faults per step.

glibc.malloc.arena_max=1 would put the worker threads' blocks in the heap too (no faults at
all), but every thread then shares one malloc lock, and XLA's compiler, which allocates from
several threads, took 50% longer (bench/step_mfu.py's 4-layer step: 2.0 -> 3.0-3.8 s) for a
step at most 5% faster.

glibc reads these settings once, at start-up (`mallopt` cannot raise the mmap threshold past
32 MiB), so the command-line programs restart themselves once with them in GLIBC_TUNABLES. In a
notebook or your own script, start Python with them set:

    T=glibc.malloc.mmap_threshold=1073741824:glibc.malloc.trim_threshold=1073741824
    export GLIBC_TUNABLES=$T:glibc.malloc.hugetlb=1

The cost: up to 1 GiB freed in large blocks stays with the process instead of going back to the
OS. MEGAJAX_MALLOC_TUNING=0 turns the restart off.
"""

from __future__ import annotations

import os
import platform
import sys

MALLOC_TUNABLES = {
    "glibc.malloc.mmap_threshold": "1073741824",
    "glibc.malloc.trim_threshold": "1073741824",
    "glibc.malloc.hugetlb": "1",
}


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


def open_standard_streams():
    """Put /dev/null on any of descriptors 0, 1, 2 that the program was started without
    (`train.py >&-`, `2>&-`, some daemon launchers). Python then has None for sys.stdout and
    crashed at its first print, and worse, the next file opened takes the free descriptor: a
    checkpoint or metrics file would receive whatever the runtime writes to stdout or stderr."""
    for fd, name, mode in ((0, "stdin", "r"), (1, "stdout", "w"), (2, "stderr", "w")):
        try:
            os.fstat(fd)
        except OSError:
            null = os.open(os.devnull, os.O_RDWR)
            if null != fd:
                os.dup2(null, fd)
                os.close(null)
        if getattr(sys, name) is None:
            setattr(sys, name, open(fd, mode, buffering=1 if mode == "w" else -1, closefd=False))


def restart_with_malloc_tuning():
    """Re-execute this program (same PID, arguments and interpreter flags) with the malloc
    tunables, once. Only for a program's entry point: it replaces the running process."""
    open_standard_streams()
    if sys.platform != "linux" or platform.libc_ver()[0] != "glibc":
        return
    env = tuned_env(dict(os.environ))
    if env is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, sys.orig_argv, env)
