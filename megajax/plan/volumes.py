"""The planner's FLOPs and collective volumes: the closed forms of megajax/analytic/ for a
config on a mesh. Plain data parallelism is counted as GSPMD compiles it, all-reducing
the gradients once per microbatch, not at the audit's minimum of once per step;
tests/test_plan.py checks every form against what the audit reads from compiled steps.
"""

from __future__ import annotations

from megajax import analytic
from megajax.analytic import Matmul, StepShape
from megajax.config import Config
from megajax.mesh_shape import MeshShape
from megajax.plan.memory import state_split
from megajax.tasks import task_for


def step_shape(cfg: Config, mesh: MeshShape = MeshShape()) -> StepShape:
    return StepShape.of(cfg, task_for(cfg), mesh)


def layer_matmuls(cfg: Config, mesh: MeshShape, sparse: bool = False) -> list[Matmul]:
    return analytic.layer_matmuls(step_shape(cfg, mesh), sparse)


def head_matmul(cfg: Config, mesh: MeshShape) -> Matmul:
    return analytic.head_matmul(step_shape(cfg, mesh))


def step_flops(cfg: Config, remat: str | None = None, executed: bool = True) -> float:
    """Matmul FLOPs of a whole train step (all devices); `executed`: a mixture of experts' as
    its buffers run them, else as the model counts them (its tokens' k experts: MFU's)."""
    return analytic.step_flops(step_shape(cfg), remat, executed)


def paper_flops(cfg: Config, full_recompute: bool = True) -> float:
    return analytic.paper_flops(cfg.train.batch_size, step_shape(cfg), full_recompute)


def model_axis_elements(cfg: Config, mesh: MeshShape) -> dict[str, int]:
    return analytic.model_axis_elements(step_shape(cfg, mesh))


def expert_axis_elements(cfg: Config, mesh: MeshShape) -> int:
    return analytic.expert_axis_minimum(step_shape(cfg, mesh))


def data_axis_sent(cfg: Config, mesh: MeshShape, once_per_step: bool = False) -> dict[str, float]:
    """Elements each device sends over "data" per step (ring algorithms), in the audit's forms
    (with pp stages, for its stage's weights). `once_per_step`: plain data parallelism
    all-reduces the accumulated gradients once (Megatron-LM), not once per microbatch. On an
    expert mesh the experts' state goes over "data" (`expert_gradients`, `expert_params`,
    `expert_regather` of the totals), the others' over "data" and "expert"."""
    t = cfg.train
    scheme = "fsdp" if t.shard_params else "zero" if t.shard_optimizer else "plain"

    def least(st, n):
        return analytic.data_axis_minimum(
            scheme,
            n,
            t.microbatches,
            st.split,
            st.whole,
            st.layers,
            st.layers_read,
            outside_once=mesh.pipelined,
        )

    if mesh.expert == 1:
        sent = least(state_split(cfg, mesh), mesh.data)
    else:
        others = least(state_split(cfg, mesh, experts=False), mesh.data * mesh.expert)
        experts = least(state_split(cfg, mesh, experts=True), mesh.data)
        sent = {k: others[k] + experts[k] for k in others}
        sent.update({f"expert_{k}": v for k, v in experts.items()})
    if scheme == "plain" and not once_per_step:
        sent = {k: v * t.microbatches if "gradients" in k else v for k, v in sent.items()}
    return sent
