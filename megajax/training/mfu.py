"""Throughput accounting for the log's MFU: model FLOPs per token (megajax/analytic.py) and the
device's peak (a table of accelerators, or a matmul rate measured on the CPU)."""
from __future__ import annotations

import time

import jax
import jax.numpy as jnp

from megajax import analytic
from megajax.analytic import StepShape
from megajax.tasks import task_for

# Dense bf16 peak TFLOP/s per device, for MFU where nothing was measured.
KNOWN_PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L4": 121.0, "A10": 125.0,
                     "V100": 125.0, "T4": 65.0, "L40S": 362.0, "RTX 4090": 165.0, "TPU v4": 275.0,
                     "TPU v5e": 197.0}
# (V100 and T4: float16, which their tensor cores take instead of bfloat16)


def flops_per_token(cfg) -> float:
    """Model FLOPs per trained token (analytic.flops_per_token), the weights each token goes
    through counted by the run's task."""
    task, m = task_for(cfg), cfg.model
    shape, weights = StepShape.of(cfg, task), task.matmul_params_per_token(cfg)
    if not m.lora_rank:
        return analytic.flops_per_token(shape, weights)
    # LoRA: the frozen weights cost 4 (forward and input gradient, no weight gradient), the
    # adapters 6
    return (analytic.flops_per_token(shape, 0) + 4.0 * weights
            + 6.0 * m.num_layers * m.adapter_params)


def device_peak_tflops(measure_cpu: bool = True) -> float | None:
    """The device's bf16 peak from a table, or a measured float32 matmul rate on the CPU."""
    dev = jax.devices()[0]
    kind = getattr(dev, "device_kind", "")
    for name, peak in KNOWN_PEAK_TFLOPS.items():
        if name.lower() in kind.lower():
            return peak
    if dev.platform == "cpu" and measure_cpu:
        return measure_matmul_tflops()
    return None


def measure_matmul_tflops(n: int = 1024, reps: int = 5) -> float:
    """float32 n x n matmul rate on one device, in TFLOP/s (the best of `reps`)."""
    a = jnp.ones((n, n), jnp.float32, device=jax.devices()[0])
    f = jax.jit(lambda x: x @ x)
    f(a).block_until_ready()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        f(a).block_until_ready()
        best = min(best, time.perf_counter() - t)
    return 2 * n ** 3 / best / 1e12
