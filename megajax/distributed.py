"""Multi-process runs on JAX's own multi-controller runtime (jax.distributed).

One process per host (or per GPU); every process runs the same program over the global mesh
and feeds only its own rows of each batch. On the CPU, collectives between processes go
through gloo, so several processes on one machine can try this out.
"""
from __future__ import annotations

import os

import jax

from megajax.errors import UserError

# Environment variables by which JAX's cluster detection recognises a multi-process launch.
_CLUSTER_ENV = ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "JAX_COORDINATOR_ADDRESS",
                "MEGASCALE_COORDINATOR_ADDRESS", "TPU_WORKER_HOSTNAMES")


def on_cluster() -> bool:
    for var in _CLUSTER_ENV:
        value = os.environ.get(var)
        if value and (not value.isdigit() or int(value) > 1):
            return True
    return False


def initialize(coordinator: str | None = None, num_processes: int | None = None, process_id: int | None = None,
               heartbeat_timeout_s: int = 60) -> bool:
    """Start jax.distributed when asked (or when a cluster launcher is detected). Returns whether it did.

    A process that loses a peer learns it from the coordination service's heartbeat within
    about `heartbeat_timeout_s` seconds, or at once from a failed collective, and exits.
    """
    explicit = any(v is not None for v in (coordinator, num_processes, process_id))
    if not explicit and not on_cluster():
        return False
    if explicit and None in (coordinator, num_processes, process_id):
        raise UserError("--coordinator, --num-processes and --process-id go together")
    if explicit and not 0 <= process_id < num_processes:
        raise UserError(f"--process-id must be in 0..{num_processes - 1}, got {process_id}")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    try:
        jax.distributed.initialize(coordinator, num_processes, process_id,
                                   heartbeat_timeout_seconds=heartbeat_timeout_s,
                                   initialization_timeout=max(heartbeat_timeout_s, 60))
    except Exception as e:  # unreachable coordinator, timeouts
        raise UserError(f"jax.distributed.initialize failed: {str(e).splitlines()[0]}") from None
    return True


def describe() -> str:
    if jax.process_count() == 1:
        return ""
    return f"process {jax.process_index()}/{jax.process_count()}, {jax.local_device_count()} local devices"
