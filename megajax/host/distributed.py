"""Multi-process runs on JAX's own multi-controller runtime (jax.distributed).

One process per host (or per GPU); every process runs the same program over the global mesh
and feeds only its own rows of each batch. On the CPU, collectives between processes go
through gloo, so several processes on one machine can try this out.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import threading
import time

import jax
import numpy as np
from jax.experimental import multihost_utils

from megajax.errors import UserError, first_line

# Environment variables by which JAX's cluster detection recognises a multi-process launch.
_CLUSTER_ENV = (
    "SLURM_NTASKS",
    "OMPI_COMM_WORLD_SIZE",
    "PMI_SIZE",
    "JAX_COORDINATOR_ADDRESS",
    "MEGASCALE_COORDINATOR_ADDRESS",
    "TPU_WORKER_HOSTNAMES",
)


def on_cluster() -> bool:
    for var in _CLUSTER_ENV:
        value = os.environ.get(var)
        if value and (not value.isdigit() or int(value) > 1):
            return True
    return False


def initialize(
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    heartbeat_timeout_s: int = 60,
) -> bool:
    """Start jax.distributed when asked (or when a cluster launcher is detected). Returns whether
    it did.

    A process that loses a peer learns it from the coordination service's heartbeat within
    about `heartbeat_timeout_s` seconds, or at once from a failed collective, and exits.
    """
    if heartbeat_timeout_s < 1:  # refused also where unused, as every other mistaken argument is
        raise UserError(f"--heartbeat-timeout must be at least 1 second, got {heartbeat_timeout_s}")
    explicit = any(v is not None for v in (coordinator, num_processes, process_id))
    if not explicit and not on_cluster():
        return False
    if explicit and None in (coordinator, num_processes, process_id):
        raise UserError("--coordinator, --num-processes and --process-id go together")
    if explicit and not (
        coordinator.rpartition(":")[0] and coordinator.rpartition(":")[2].isdigit()
    ):
        raise UserError(
            f"--coordinator must be HOST:PORT (e.g. 127.0.0.1:1234), got '{coordinator}'"
        )
    if explicit and num_processes < 1:
        raise UserError(f"--num-processes must be at least 1, got {num_processes}")
    if explicit and not 0 <= process_id < num_processes:
        raise UserError(f"--process-id must be in 0..{num_processes - 1}, got {process_id}")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    native_stdout_to_devnull()
    global _HEARTBEAT_S
    _HEARTBEAT_S = heartbeat_timeout_s
    timeout = max(heartbeat_timeout_s, 60)
    # A peer that never starts makes the runtime abort the process (C++, exit 134) when the
    # timeout expires; a moment before that, say so in one line and leave.
    watchdog = threading.Timer(timeout - 2, _give_up_waiting, (timeout, num_processes))
    watchdog.daemon = True
    watchdog.start()
    try:
        # The runtime's own check gets three times the time: it aborts from C++, so the Watchdog
        # below, which says the same in one line, must come first.
        jax.distributed.initialize(
            coordinator,
            num_processes,
            process_id,
            heartbeat_timeout_seconds=3 * heartbeat_timeout_s,
            initialization_timeout=timeout,
        )
    except Exception as e:  # unreachable coordinator, timeouts
        raise UserError(f"jax.distributed.initialize failed: {first_line(e)}") from None
    finally:
        watchdog.cancel()
    return True


def native_stdout_to_devnull():
    """Gloo prints "[Gloo] Rank 1 is connected to 3 peer ranks..." from C++ straight to file
    descriptor 1, on every process, each time it connects a group. Python's stdout moves to a copy
    of that descriptor and the descriptor itself to /dev/null, so that only megajax's own lines
    are printed, and only by process 0 (errors, on stderr, are untouched)."""
    sys.stdout.flush()
    copy = os.dup(1)
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    os.close(null)
    stream = os.fdopen(
        copy, "w", buffering=1, encoding=sys.stdout.encoding or "utf-8", errors="backslashreplace"
    )
    if hasattr(sys.stdout, "_stream"):  # cli.common's guard around a closed pipe
        sys.stdout._stream = stream
    else:
        sys.stdout = stream


def _give_up_waiting(timeout: int, num_processes):
    print(
        f"error: not all {num_processes or ''} processes joined within {timeout} s (is every "
        "process started, with the same --coordinator?)",
        file=sys.stderr,
        flush=True,
    )
    os._exit(2)


_HEARTBEAT_S: int | None = None  # the runtime's heartbeat timeout, once initialize() started it


def bound_shutdown(status: int):
    """At exit the runtime waits at a barrier for every process. A peer that ended without it
    (killed after the run ended, say) holds this one there until the runtime's heartbeat check
    aborts it from C++ (exit 134, a stack dump, three heartbeat timeouts after the peer's end)
    though its run finished and saved. A while before that, leave with the run's own status."""
    if _HEARTBEAT_S and jax.process_count() > 1:
        # Said now: once the shutdown has begun, JAX no longer answers questions about processes.
        line = (
            f"warning: process {jax.process_index()} of {jax.process_count()}: the other processes "
            f"did not reach the shutdown within {2 * _HEARTBEAT_S} s (one probably ended without "
            f"it); leaving with the run's status {status}"
        )
        timer = threading.Timer(2 * _HEARTBEAT_S, _stuck_at_shutdown, (line, status))
        timer.daemon = True
        timer.start()


def _stuck_at_shutdown(line: str, status: int):
    print(line, file=sys.stderr, flush=True)
    os._exit(status)


class Watchdog:
    """A frozen peer (stopped, swapped out, a hung host) leaves this process waiting in a
    collective, and the runtime's heartbeat check then aborts it from C++ (exit 134, a stack
    dump) within its heartbeat timeout (set to three times --heartbeat-timeout) of the peer
    stopping. This says so in one line first: when no step, evaluation or save has finished for 0.8
    of
    --heartbeat-timeout (and for 5 times the slowest interval seen, so a slow step is never
    mistaken for a frozen peer), it exits.
    Only in multi-process runs; `beat()` marks progress."""

    def __init__(self):
        self.limit = 0.8 * _HEARTBEAT_S if jax.process_count() > 1 and _HEARTBEAT_S else None
        self.last, self.slowest, self.beats, self.done = time.monotonic(), 0.0, 0, threading.Event()

    def __enter__(self):
        if self.limit:
            self.last = time.monotonic()
            threading.Thread(target=self._watch, name="megajax-watchdog", daemon=True).start()
        return self

    def beat(self):
        now = time.monotonic()
        if self.beats:  # the first interval holds one-off start-up work
            self.slowest = max(self.slowest, now - self.last)
        self.last, self.beats = now, self.beats + 1

    def _watch(self):
        while not self.done.wait(0.5):
            stalled = time.monotonic() - self.last
            if stalled > self.limit and stalled > 5 * self.slowest:
                print(
                    f"error: process {jax.process_index()} of {jax.process_count()}: no progress "
                    f"for {stalled:.0f} s, waiting on the other processes: one has probably frozen "
                    "or died (completed checkpoints are intact)",
                    file=sys.stderr,
                    flush=True,
                )
                os._exit(1)

    def __exit__(self, *exc):
        self.done.set()


# -- agreement between processes (each call is a collective: every process makes it) -------

# Stop reasons by number; SIGPIPE: process 0's stdout closed (signals.py). New ones go at the end.
_SIGNALS = (None, "SIGTERM", "SIGINT", "SIGPIPE", "SIGHUP", "SIGUSR1", "SIGUSR2", "SIGXCPU")


def agreed_stop(local: str | None) -> str | None:
    """The stop decision of the whole run: a signal that reached any process stops all of
    them at the same step (one that reached only one process would leave the others waiting
    in the next collective forever)."""
    if jax.process_count() == 1:
        return local
    codes = np.asarray(multihost_utils.process_allgather(np.int32(_SIGNALS.index(local))))
    return next((_SIGNALS[int(c)] for c in codes.ravel() if c), None)


def check_same_run(settings: dict):
    """Every process must run the same resolved config (and workdir): otherwise they disagree
    later about when to save or evaluate and wait for each other forever. Names the first
    setting that differs."""
    if jax.process_count() == 1:
        return
    flat = _flatten(settings)
    keys = sorted(flat)
    digest = np.asarray(
        [
            int.from_bytes(
                hashlib.sha256(json.dumps(flat[k], default=str).encode()).digest()[:4], "little"
            )
            & 0x7FFFFFFF
            for k in keys
        ],
        np.int32,
    )
    sizes = np.asarray(multihost_utils.process_allgather(np.int32(len(keys)))).ravel()
    if len(set(sizes.tolist())) > 1:
        raise UserError(f"the processes run different megajax versions ({sizes.tolist()} settings)")
    everyone = np.asarray(multihost_utils.process_allgather(digest)).reshape(len(sizes), len(keys))
    for i, key in enumerate(keys):
        differ = [p for p in range(len(sizes)) if everyone[p, i] != everyone[0, i]]
        if differ:
            raise UserError(
                f"process {differ[0]} has a different {key} than process 0 (this one's: "
                f"{flat[key]!r}); start every process with the same command"
            )


def _flatten(tree: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def describe() -> str:
    if jax.process_count() == 1:
        return ""
    return (
        f"process {jax.process_index()}/{jax.process_count()}, {jax.local_device_count()} local "
        "devices"
    )
