"""The closed forms of a train step, in one place: what one device computes (matmul FLOPs,
flops.py), keeps (activation bytes per layer, activations.py) and sends over each mesh axis
(collective elements, collectives.py), as functions of a `StepShape` (shape.py), the numbers
of a config, a mesh and a task.

Everything megajax predicts rather than measures is read from here: the collective audit's
minima (megajax/tools/audit.py), the planner's FLOPs, memory and volumes (megajax/plan/), the
log's MFU (megajax/training/mfu.py) and the dry run's modelled bytes
(megajax/tools/step_figures.py). A new kind of layer (another MLP, another attention) changes
the functions here, and every one of them follows.

FLOPs follow the paper (Shoeybi et al. 2019, appendix A): 96·B·s·l·h²·(1 + s/6h + V/16lh) with
full recomputation, 72·B·s·l·h²·(1 + s/6h + V/12lh) without. Activation bytes follow Korthikanti
et al. 2022, section 4, for megajax's layer (term by term there). Collective elements are
counted by each collective's result, as the audit reads them from the compiled program.
"""

from megajax.analytic.activations import activation_bytes_per_layer, sparse_mlp_bytes
from megajax.analytic.collectives import (
    data_axis_minimum,
    expert_axis_minimum,
    kv_copies_grad_elements,
    model_axis_elements,
    model_axis_minimum,
    regathered_elements,
    remat_extra_elements,
    replicated_grad_elements,
)
from megajax.analytic.flops import (
    Matmul,
    flops_per_token,
    head_matmul,
    layer_flops,
    layer_matmuls,
    paper_flops,
    recompute_passes,
    sparse_mlp_matmuls,
    step_flops,
)
from megajax.analytic.shape import (
    DATA_SCHEMES,
    DTYPE_BYTES,
    REMAT_MODES,
    StepShape,
    kv_copies,
    layer_params,
    moe_mlp_params,
)

__all__ = [
    "DATA_SCHEMES",
    "DTYPE_BYTES",
    "REMAT_MODES",
    "Matmul",
    "StepShape",
    "activation_bytes_per_layer",
    "data_axis_minimum",
    "expert_axis_minimum",
    "flops_per_token",
    "head_matmul",
    "kv_copies",
    "kv_copies_grad_elements",
    "layer_flops",
    "layer_matmuls",
    "layer_params",
    "model_axis_elements",
    "model_axis_minimum",
    "moe_mlp_params",
    "paper_flops",
    "recompute_passes",
    "regathered_elements",
    "remat_extra_elements",
    "replicated_grad_elements",
    "sparse_mlp_bytes",
    "sparse_mlp_matmuls",
    "step_flops",
]
