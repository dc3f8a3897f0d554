"""Throughput accounting for the log's MFU: model FLOPs per token (megajax/analytic/) and the
device's peak (the hardware table's, or a matmul rate measured on the CPU)."""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp

from megajax import analytic
from megajax.analytic import StepShape
from megajax.core.precision import Precision
from megajax.hardware import for_device
from megajax.tasks import task_for


def flops_per_token(cfg) -> float:
    """Model FLOPs per trained token (analytic.flops_per_token), the weights each token goes
    through counted by the run's task."""
    task, m = task_for(cfg), cfg.model
    shape, weights = StepShape.of(cfg, task), task.matmul_params_per_token(cfg)
    if not m.lora_rank:
        return analytic.flops_per_token(shape, weights)
    # LoRA: the frozen weights cost 4 (forward and input gradient, no weight gradient), the
    # adapters 6
    return (
        analytic.flops_per_token(shape, 0) + 4.0 * weights + 6.0 * m.num_layers * m.adapter_params
    )


@dataclasses.dataclass(frozen=True)
class Peak:
    tflops: float
    what: str  # for the log's first line: where the figure comes from


def device_peak(cfg=None, measure_cpu: bool = True) -> Peak | None:
    """The peak a device's MFU is measured against: on a GPU the hardware table's (megajax/
    hardware.py) dense 16-bit peak, or its float32 one for a run whose matmuls are float32; on
    the CPU a matmul rate measured in the run's matmul dtype. None: a device nobody measured."""
    dev = jax.devices()[0]
    matmul = Precision.of(cfg.model).matmul if cfg is not None else jnp.dtype(jnp.bfloat16)
    known = for_device(getattr(dev, "device_kind", ""))
    if known is not None:
        if matmul == jnp.float32:
            if not known.peak_flops_f32:
                return None
            return Peak(known.peak_flops_f32 / 1e12, f"{known.name} float32")
        return Peak(known.peak_flops / 1e12, f"{known.name} dense 16-bit")
    if dev.platform == "cpu" and measure_cpu:
        return Peak(measure_matmul_tflops(dtype=matmul), f"measured {matmul.name} matmul")
    return None


def measure_matmul_tflops(n: int = 1024, reps: int = 5, dtype=jnp.float32) -> float:
    """n x n matmul rate on one device, in TFLOP/s (the best of `reps`)."""
    a = jnp.ones((n, n), dtype, device=jax.devices()[0])
    f = jax.jit(lambda x: x @ x)
    f(a).block_until_ready()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        f(a).block_until_ready()
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best / 1e12
