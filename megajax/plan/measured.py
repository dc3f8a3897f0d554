"""megajax's train steps measured on GPUs: what the planner's "megajax" stack is calibrated on
and checked against (tests/test_plan.py).

One H200 SXM 141GB, the image's jax 0.11.2 with CUDA 13 and flax 0.12.10, `python
bench/gpu_check.py` at commit 3b01b7a: bfloat16, seq 1024, hidden dropout 0.1, one device, one
microbatch. `step_ms` is the step's time, `plan_gib` XLA's memory plan of the compiled step.
Later commits dropped the bf16 weight copies a scanned stack kept (2 bytes a layer parameter:
2.1 GiB at 1.2B) and halved the dropout masks' random-number work, so these plans and steps
are, if anything, above what the current code compiles and runs.
"""

from __future__ import annotations

import dataclasses

from megajax.config import Config, load_config
from megajax.hardware import BUILTIN
from megajax.mesh_shape import MeshShape
from megajax.plan import timing

FUSED = ("model.attention_dropout=0", "model.attention=fused")  # cuDNN's flash attention


@dataclasses.dataclass(frozen=True)
class Run:
    config: str
    overrides: tuple[str, ...]
    step_ms: float
    plan_gib: float | None  # None: not recorded

    def cfg(self) -> Config:
        return load_config(
            self.config, ["model.compute_dtype=bfloat16", "train.microbatches=1", *self.overrides]
        )


H200 = (
    Run("gpt2_355m", (*FUSED, "train.batch_size=16", "model.remat=none"), 110.5, 22.93),
    Run("gpt2_1.2b", (*FUSED, "train.batch_size=16", "model.remat=none"), 320.1, 56.55),
    Run(
        "gpt2_1.2b",
        ("model.attention=megajax", "train.batch_size=8", "model.remat=none"),
        269.4,
        62.79,
    ),
    Run("gpt2_1.2b", (*FUSED, "train.batch_size=16", "model.remat=full"), 348.6, 22.77),
    Run(
        "gpt2_355m",
        (*FUSED, "train.batch_size=16", "model.remat=none", "model.scan_layers=false"),
        91.5,
        None,
    ),
)
CALIBRATED_ON = H200[1]


def predicted_ms(run: Run) -> float:
    return timing.step_time(run.cfg(), MeshShape(), BUILTIN["h200"]).seconds * 1000


def calibrate() -> float:
    """The XLA_MATMUL_EFFICIENCY that reproduces CALIBRATED_ON's step. Matmul time is inversely
    proportional to it and nothing else depends on it, so the step is a / efficiency + rest."""
    parts = timing.step_time(CALIBRATED_ON.cfg(), MeshShape(), BUILTIN["h200"]).parts
    rest_ms = 1000 * (sum(parts.values()) - parts["matmuls"])
    return (
        timing.XLA_MATMUL_EFFICIENCY * 1000 * parts["matmuls"] / (CALIBRATED_ON.step_ms - rest_ms)
    )
