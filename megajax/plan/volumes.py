"""The planner's FLOPs and collective volumes: the closed forms of megajax/analytic.py for a
config on a dp x tp mesh. Plain data parallelism is counted as GSPMD compiles it, all-reducing
the gradients once per microbatch, not at the audit's minimum of once per step;
tests/test_plan.py checks every form against what the audit reads from compiled steps.
"""
from __future__ import annotations

from megajax import analytic
from megajax.analytic import Matmul, StepShape
from megajax.config import Config
from megajax.plan.memory import state_split
from megajax.tasks import task_for


def step_shape(cfg: Config, dp: int = 1, tp: int = 1) -> StepShape:
    return StepShape.of(cfg, task_for(cfg), dp, tp)


def layer_matmuls(cfg: Config, dp: int, tp: int) -> list[Matmul]:
    return analytic.layer_matmuls(step_shape(cfg, dp, tp))


def head_matmul(cfg: Config, dp: int, tp: int) -> Matmul:
    return analytic.head_matmul(step_shape(cfg, dp, tp))


def step_flops(cfg: Config, remat: str | None = None) -> float:
    """Matmul FLOPs of a whole train step (all devices)."""
    return analytic.step_flops(step_shape(cfg), remat)


def paper_flops(cfg: Config, full_recompute: bool = True) -> float:
    return analytic.paper_flops(cfg.train.batch_size, step_shape(cfg), full_recompute)


def model_axis_elements(cfg: Config, dp: int, tp: int) -> dict[str, int]:
    return analytic.model_axis_elements(step_shape(cfg, dp, tp))


def data_axis_sent(cfg: Config, dp: int, tp: int, pp: int = 1,
                   once_per_step: bool = False) -> dict[str, float]:
    """Elements each device sends over "data" per step (ring algorithms), in the audit's forms
    (with pp stages, for its stage's weights). `once_per_step`: plain data parallelism
    all-reduces the accumulated gradients once (Megatron-LM), not once per microbatch."""
    t, st = cfg.train, state_split(cfg, dp, tp, pp)
    scheme = "fsdp" if t.shard_params else "zero" if t.shard_optimizer else "plain"
    sent = analytic.data_axis_minimum(scheme, dp, t.microbatches, st.split, st.whole, st.layers,
                                      st.layers_read, outside_once=pp > 1)
    if scheme == "plain" and not once_per_step:
        sent["gradients"] *= t.microbatches
    return sent
