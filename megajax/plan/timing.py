"""Step time on given hardware: matmuls at an achievable fraction of peak that falls with the
size of each device's matrices, element-wise work at memory bandwidth, a fixed cost per layer,
and ring collectives on the link each mesh axis runs over. Nothing overlaps (Megatron-LM 2019
all-reduces the gradients after the backward pass; XLA overlaps some collectives, so this
errs slow).

What runs on the hardware (its `stack`) sets three constants:
  "megatron-2019", the paper's Megatron-LM (PyTorch, eager), two constants calibrated on two of
  the paper's figures (Shoeybi et al. 2019, section 5.1; megajax/plan/paper.py refits them,
  tests/test_plan.py keeps the table the rest predicts):
    MATMUL_EFFICIENCY       the fraction of peak a large matmul reaches: the 1.2B model's
                            39 TFLOP/s on one V100;
    LAYER_OVERHEAD_SECONDS  what a layer costs per microbatch besides its FLOPs and bytes
                            (kernel launches and synchronisation: PyTorch's eager mode ran some
                            200 kernels per layer and pass): the 8.3B model's 77% weak-scaling
                            efficiency on 8 GPUs.
  "megajax", megajax's compiled step (XLA on CUDA), one constant calibrated on one figure
  (megajax/plan/measured.py refits it, tests/test_plan.py checks the other H200 runs):
    XLA_MATMUL_EFFICIENCY   GPT-2 1.2B at batch 16 on one H200, 320.1 ms a step. No fixed cost
                            per layer: the GPU's stream is busy the whole compiled step (its
                            profile). A scanned stack also copies what it keeps for the backward
                            pass (SCAN_COPY_PASSES; not train.layer_programs, whose Python loop's
                            2L+4 dispatches a microbatch are taken to overlap the GPU's work:
                            not measured on a GPU yet), each microbatch reads the weights and writes
                            their gradients (WEIGHT_BYTES_PER_PARAM), and cuDNN's flash attention
                            keeps its scores on chip (no element-wise passes over them).
Every other constant is counted from megajax's layer or taken from the hardware.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

from megajax.analytic import DTYPE_BYTES, Matmul, recompute_passes
from megajax.config import Config
from megajax.core.attention import fused_attention
from megajax.hardware import Hardware
from megajax.mesh_shape import MeshShape
from megajax.moe_config import capacity
from megajax.plan.memory import (
    activation_dtype,
    kept_activation_bytes,
    rows_per_microbatch,
    state_split,
)
from megajax.plan.volumes import (
    data_axis_sent,
    expert_axis_elements,
    head_matmul,
    layer_matmuls,
    model_axis_elements,
)

MATMUL_EFFICIENCY = 0.5407  # calibrated: gpt2_1.2b on one V100, 39 TFLOP/s
# calibrated: gpt2_8.3b on 8 V100s, 77% of the 1.2B model's FLOP/s per GPU
LAYER_OVERHEAD_SECONDS = 7.72e-3
# calibrated: Narayanan et al. 2021's Table 1 on A100s, its 1.7B row (megajax/plan/paper2021.py)
MATMUL_EFFICIENCY_2021 = 0.7487
LAYER_OVERHEAD_SECONDS_2021 = 0.0  # none: fitted on the 1T row it comes out at zero
# calibrated: gpt2_1.2b on one H200, 320.1 ms (megajax/plan/measured.py)
XLA_MATMUL_EFFICIENCY = 0.6656
# A scan's kept activations: its stacked buffers zero-filled (a write), each layer's slice
# written in (a read and a write) and copied out in the backward pass (a read and a write):
# 54 of the 1.2B step's 320 ms on the H200.
SCAN_COPY_PASSES = 5
# A matmul with inner size k and n output columns per device runs at
# MATMUL_EFFICIENCY / ((1 + D/k)(1 + D/n)): tensor-core GEMM kernels compute 128 x 128 output
# tiles, and a dimension of one tile leaves half the kernel's pipeline idle.
HALF_EFFICIENCY_DIM = 128
# large ring collectives run at the link's rate (NCCL's bus bandwidth)
LINK_EFFICIENCY = 1.0
# Forward passes over memory per element, counted from megajax's layer: on the b·s·h stream
# (replicated over "model" unless sequence parallel) two LayerNorms (read, write), two
# bias-dropout-residual adds (two reads, a write, a mask); on the b·s·ffn/t MLP activations
# bias and GeLU (read, write); on the b·heads/t·s² scores scale, mask, softmax, dropout.
HIDDEN_PASSES, FFN_PASSES, SCORE_PASSES = 2 * 2 + 2 * 3.5, 2, 5
BACKWARD_PASSES = 2  # the backward pass moves twice the forward's bytes
# A sparse layer's buffers (core/moe.py): zero-filled (a write), the tokens added in (a read and
# a write), the results gathered back (a read)
DISPATCH_PASSES = 4
# Adam: read params, gradient, two moments; write params, two moments (float32)
OPTIMIZER_BYTES_PER_PARAM = 28
# megajax's stack: each microbatch reads every float32 weight in its forward and backward passes
# and writes its gradient (12 bytes a parameter), and with accumulation reads and writes the
# float32 accumulator too (8 more): what many small microbatches cost. The paper's stack has
# its fitted per-layer constant instead.
WEIGHT_BYTES_PER_PARAM, ACCUMULATE_BYTES_PER_PARAM = 12, 8


def sparse_passes(cfg: Config, rows: int, tp: int) -> float:
    """A sparse layer's MLP's forward element-wise traffic on one device (elements): the
    activation on each expert's buffer slots and the shared experts' (FFN_PASSES each), and
    the dispatch and combine on the buffers of `hidden` (DISPATCH_PASSES)."""
    m = cfg.model
    slots = (
        rows
        * m.num_experts
        * capacity(m.seq_len, m.moe_capacity_factor, m.experts_per_token, m.num_experts)
    )
    shared = rows * m.seq_len * m.moe_shared_ffn
    return FFN_PASSES * (slots * m.moe_ffn + shared) / tp + DISPATCH_PASSES * slots * m.hidden


class Stack(NamedTuple):
    matmul_efficiency: float
    layer_overhead_seconds: float  # per layer and microbatch
    scan_copy_passes: int  # over a scanned stack's kept activations
    weight_bytes: int  # per parameter and microbatch (without accumulation)
    accumulate_bytes: int  # per parameter and microbatch, with accumulation
    flash_attention: bool  # cuDNN's, where the model asks for the fused core
    # a pipeline's backward tick recomputes its stage's forward (megajax/training/pipeline.py)
    stage_recompute: bool = False


def stack_constants(hw: Hardware) -> Stack:
    """The constants of what runs on hw (read when called: megajax/plan/paper.py,
    paper2021.py and measured.py refit them)."""
    if hw.stack == "megatron-2019":
        return Stack(MATMUL_EFFICIENCY, LAYER_OVERHEAD_SECONDS, 0, 0, 0, False)
    if hw.stack == "megatron-2021":
        return Stack(MATMUL_EFFICIENCY_2021, LAYER_OVERHEAD_SECONDS_2021, 0, 0, 0, False)
    return Stack(
        XLA_MATMUL_EFFICIENCY,
        0.0,
        SCAN_COPY_PASSES,
        WEIGHT_BYTES_PER_PARAM,
        ACCUMULATE_BYTES_PER_PARAM,
        True,
        stage_recompute=True,
    )


def matmul_seconds(mm: Matmul, hw: Hardware) -> float:
    eff = stack_constants(hw).matmul_efficiency / (
        (1 + HALF_EFFICIENCY_DIM / mm.inner) * (1 + HALF_EFFICIENCY_DIM / mm.cols)
    )
    return mm.flops / (hw.peak_flops * eff)


def pipeline_ticks(cfg: Config, mesh: MeshShape) -> int:
    """Forward-and-backward ticks of a step: the microbatches, and with p stages the p - 1
    of the pipeline's fill and drain (GPipe and 1F1B alike: Narayanan et al. 2021, eq. 1)."""
    return cfg.train.microbatches + mesh.pipe - 1


def compute_seconds(cfg: Config, mesh: MeshShape, hw: Hardware) -> dict[str, float]:
    """Per device and step: matmuls, element-wise memory traffic and the optimizer update. With
    pp stages each device runs L / pp layers a microbatch, and the step takes as many ticks as
    `pipeline_ticks`, each as long as the last stage's (its layers and the output layer)."""
    m, mb = cfg.model, cfg.train.microbatches
    tp, pp = mesh.model, mesh.pipe
    ticks, layers = pipeline_ticks(cfg, mesh), m.num_layers // pp
    stack = stack_constants(hw)
    # forward, backward (2), the recomputed forward; megajax's pipeline recomputes each stage's
    # forward in its backward tick on top of the model's own remat
    passes = 3 + recompute_passes(m.remat) + (pp > 1 and stack.stage_recompute)
    sparse = sum(m.sparse_layers) // pp
    layer_seconds = 0.0
    for kind, count in ((False, layers - sparse), (True, sparse)):
        mms = layer_matmuls(cfg, mesh, kind) if count else []
        layer_seconds += count * passes * sum(matmul_seconds(mm, hw) for mm in mms)
        if m.remat == "selective":  # the attention core, the last two
            layer_seconds += count * sum(matmul_seconds(mm, hw) for mm in mms[-2:])
    matmuls = ticks * (layer_seconds + 3 * matmul_seconds(head_matmul(cfg, mesh), hw))
    act = DTYPE_BYTES[activation_dtype(cfg)]
    b, s, h = rows_per_microbatch(cfg, mesh), m.seq_len, m.hidden
    stream = b * s * h // (tp if m.sequence_parallel else 1)
    on_chip = stack.flash_attention and fused_attention(m, on="gpu")  # scores never reach memory
    scores = 0 if on_chip else b * m.num_heads // tp * s * s
    attention = HIDDEN_PASSES * stream + SCORE_PASSES * scores
    dense = FFN_PASSES * b * s * m.ffn // tp
    forward = (layers - sparse) * (attention + dense) + sparse * (
        attention + sparse_passes(cfg, b, tp)
    )
    total = forward * (passes - 2 + BACKWARD_PASSES)
    if m.remat == "selective":
        total += layers * SCORE_PASSES * scores
    elementwise = ticks * total * act / hw.hbm_bandwidth
    # the layer programs keep them in buffers of their own
    if m.scan_layers and not cfg.train.layer_programs:
        elementwise += (
            ticks
            * stack.scan_copy_passes
            * kept_activation_bytes(cfg, mesh)
            // pp
            / hw.hbm_bandwidth
        )
    local = state_split(cfg, mesh)
    per_param = stack.weight_bytes + (stack.accumulate_bytes if mb > 1 else 0)
    elementwise += ticks * per_param * local.model_shard / hw.hbm_bandwidth
    optimizer = OPTIMIZER_BYTES_PER_PARAM * local.optimizer_local / hw.hbm_bandwidth
    overhead = ticks * layers * stack.layer_overhead_seconds
    return {
        "matmuls": matmuls,
        "elementwise": elementwise,
        "optimizer": optimizer,
        "overhead": overhead,
    }


def ring_seconds(
    kind: str, elements: float, nbytes: int, n: int, bandwidth: float, latency: float, calls: int
) -> float:
    """A ring collective over n devices: an all-reduce sends 2 (n-1)/n of its elements, an
    all-gather (n-1)/n of its result, a reduce-scatter (n-1) times its result."""
    if n == 1 or elements == 0:
        return 0.0
    factor = {
        "all-reduce": 2 * (n - 1) / n,
        "all-gather": (n - 1) / n,
        "reduce-scatter": n - 1,
        "sent": 1.0,
    }[kind]
    steps = 2 * (n - 1) if kind == "all-reduce" else n - 1
    return factor * elements * nbytes / (bandwidth * LINK_EFFICIENCY) + calls * steps * latency


def axis_links(mesh: MeshShape, hw: Hardware) -> dict[str, tuple[float, float, str]]:
    """(bandwidth per device, latency, which link) for each axis. The model axis is placed
    within a node when it fits; the data axis spans nodes when the mesh does, its ring crossing
    each node once, so the groups that share a node share its network adapters; pipeline
    stages (the outermost axis) are nodes apart once a stage fills a node, every device of a
    stage sending its share of the boundary through its node's adapters."""
    g, dp, tp, pp, ep = hw.gpus_per_node, mesh.data, mesh.model, mesh.pipe, mesh.expert
    intra = (hw.intra_node_bandwidth, hw.intra_node_latency, "intra-node")
    inter_share = hw.inter_node_bandwidth / g
    model = intra if tp <= g else (inter_share, hw.inter_node_latency, "inter-node")
    # "expert" sits between "data" and "model"; for all but the experts it is one more data axis
    links = {"model": model, "data": ring_link(dp * ep, tp, hw)}
    if ep > 1:
        links["expert"] = ring_link(ep, tp, hw)
    if pp > 1:
        links["pipe"] = (
            intra if dp * tp * pp <= g else (inter_share, hw.inter_node_latency, "inter-node")
        )
    return links


def ring_link(size: int, stride: int, hw: Hardware) -> tuple[float, float, str]:
    """(bandwidth per device, latency, which link) of a ring of `size` devices `stride` apart:
    within a node when it fits, else crossing each node once, the rings that share a node
    sharing its network adapters."""
    g = hw.gpus_per_node
    if size * stride <= g:
        return (hw.intra_node_bandwidth, hw.intra_node_latency, "intra-node")
    per_node = max(1, g // stride)  # devices of one ring in a node
    return (hw.inter_node_bandwidth / g * per_node, hw.inter_node_latency, "inter-node")


def communication_seconds(
    cfg: Config, mesh: MeshShape, hw: Hardware, gradient_bytes: int = 4
) -> dict[str, float]:
    """Per device and step: the model axis's activation collectives (in the compute dtype), the
    data axis's gradient and parameter traffic (float32 in megajax: `gradient_bytes`) and the
    pipeline's sends (each tick one forward and one back, a microbatch's stage boundary split
    over the model axis's devices, as Megatron-LM's scatter/gather sends it)."""
    m, mb = cfg.model, cfg.train.microbatches
    dp, tp, pp = mesh.data, mesh.model, mesh.pipe
    links = axis_links(mesh, hw)
    bw, lat, _ = links["model"]
    act = DTYPE_BYTES[activation_dtype(cfg)]
    # a stage's share of the step's model-axis traffic, for each of its ticks
    share = pipeline_ticks(cfg, mesh) / mb / pp
    calls = share * (mb * (4 + recompute_passes(m.remat)) * m.num_layers + 2 * mb)
    model = sum(
        ring_seconds(kind, share * e, act, tp, bw, lat, calls)
        for kind, e in model_axis_elements(cfg, mesh).items()
    )
    bw, lat, _ = links["data"]
    sent = data_axis_sent(cfg, mesh, once_per_step=hw.stack != "megajax")
    ep = mesh.expert
    experts = {k: sent.get(f"expert_{k}", 0.0) for k in ("gradients", "params", "regather")}
    others = sent["gradients"] + sent["regather"] - experts["gradients"] - experts["regather"]
    data = ring_seconds("sent", others, gradient_bytes, dp * ep, bw, lat, 1)
    data += ring_seconds("sent", sent["params"] - experts["params"], 4, dp * ep, bw, lat, 1)
    if ep > 1:  # the experts' over "data" alone: rings ep x tp devices apart
        bw, lat, _ = ring_link(dp, ep * tp, hw)
        moved = experts["gradients"] + experts["regather"]
        data += ring_seconds("sent", moved, gradient_bytes, dp, bw, lat, 1)
        data += ring_seconds("sent", experts["params"], 4, dp, bw, lat, 1)
    out = {"model_axis": model, "data_axis": data}
    if ep > 1:  # each all-to-all keeps 1/ep of its buffer on the device
        bw, lat, _ = links["expert"]
        calls = 4 * mb * sum(m.sparse_layers) / pp  # a stage's layers
        moved = expert_axis_elements(cfg, mesh) * (ep - 1) / ep / pp
        out["expert_axis"] = ring_seconds("sent", moved, act, ep, bw, lat, calls)
    if pp > 1:
        bw, lat, _ = links["pipe"]
        boundary = rows_per_microbatch(cfg, mesh) * m.seq_len * m.hidden / tp * act
        out["pipeline"] = 2 * pipeline_ticks(cfg, mesh) * (boundary / bw + lat)
    return out


@dataclasses.dataclass
class StepTime:
    parts: dict[str, float]

    @property
    def seconds(self) -> float:
        return sum(self.parts.values())


def step_time(cfg: Config, mesh: MeshShape, hw: Hardware, gradient_bytes: int = 4) -> StepTime:
    return StepTime(
        {**compute_seconds(cfg, mesh, hw), **communication_seconds(cfg, mesh, hw, gradient_bytes)}
    )
