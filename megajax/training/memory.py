"""What a compiled step needs in memory, and what the devices have: a run whose step cannot
fit is refused before anything is written or allocated."""

from __future__ import annotations

import math
import os

import jax

from megajax.errors import UserError


def step_memory(compiled) -> dict:
    """The compiled step's own accounting of its buffers per device (empty on backends that
    give none). The peak counts arguments and outputs once where they alias (donation)."""
    mem = compiled.memory_analysis()
    if mem is None:
        return {}
    return {
        "step_argument_bytes": int(mem.argument_size_in_bytes),
        "step_temp_bytes": int(mem.temp_size_in_bytes),
        "step_output_bytes": int(mem.output_size_in_bytes),
        "step_alias_bytes": int(mem.alias_size_in_bytes),
        "step_peak_bytes": int(
            mem.argument_size_in_bytes
            + mem.output_size_in_bytes
            - mem.alias_size_in_bytes
            + mem.temp_size_in_bytes
        ),
    }


def per_device_elements(tree) -> int:
    """Elements one device holds of a tree of sharded ShapeDtypeStructs (or arrays)."""
    return sum(math.prod(x.sharding.shard_shape(x.shape)) for x in jax.tree.leaves(tree))


def per_device_bytes(tree) -> int:
    """Bytes one device holds of a tree of sharded ShapeDtypeStructs (or arrays)."""
    return sum(
        math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(tree)
    )


def device_memory_bytes() -> int | None:
    """Memory one local device may use: an accelerator's own limit, or, for CPU devices (which
    share the host's memory), the host's physical memory divided among them."""
    dev = jax.local_devices()[0]
    stats = dev.memory_stats() if hasattr(dev, "memory_stats") else None
    if stats and stats.get("bytes_limit"):
        return int(stats["bytes_limit"])
    if dev.platform == "cpu" and hasattr(os, "sysconf"):
        try:
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError):
            return None
        return total // jax.local_device_count()
    return None


def gib(b: int) -> str:
    if b >= 2**30:
        return f"{b / 2**30:.2f} GiB"
    return f"{b / 2**20:.1f} MiB" if b >= 2**20 else f"{b / 2**10:.1f} KiB"


def check_step_fits(compiled):
    """UserError if the step's peak per device exceeds what a device has: it could only die
    later of memory, after the workdir was written."""
    peak = step_memory(compiled).get("step_peak_bytes")
    limit = device_memory_bytes()
    if peak is None or limit is None or peak <= limit:
        return
    raise UserError(
        f"the compiled train step needs {gib(peak)} per device, more than the {gib(limit)} a "
        "device has here: lower train.batch_size or model.seq_len, raise train.microbatches, set "
        'model.remat = "selective" or "full", or use a larger model axis (--dry-run shows the '
        "figures)"
    )
