"""Collective elements per step and device over "model", "expert" and "data", each counted by its
result, as the audit reads them from the compiled program."""

from __future__ import annotations

from megajax.analytic.shape import DATA_SCHEMES, StepShape


def replicated_grad_elements(x: StepShape) -> int:
    """Sequence parallelism's gradient reductions of replicated parameters (partial sums on each
    sequence shard): per layer two norms (LayerNorm's scale and bias, RMSNorm's scale) and two
    row-parallel biases (if any), one more norm, the position (if learned) and extra embedding
    tables. Without it every device holds whole activations and computes these gradients whole:
    nothing to reduce. A frozen base (LoRA) has none (the adapters': core/lora.py)."""
    if not x.sequence_parallel or x.frozen_base:
        return 0
    norm = x.replicated_norm_params * x.hidden
    per_layer = 2 * norm + (2 * x.hidden if x.row_biases else 0)
    positions = x.seq if x.learned_positions else 0
    return x.layers * per_layer + norm + (positions + x.extra_embedding_rows) * x.hidden


def kv_copies_grad_elements(x: StepShape) -> dict[str, int]:
    """Grouped-query attention on a model axis larger than its key/value heads: each device holds
    a copy of the key/value weight (hidden x 2 · kv heads · head_dim) and computes the gradient
    of its head's columns; per layer and microbatch the copies of each head's gradient are summed
    (an all-reduce of hidden x 2 · head_dim) and the heads gathered (hidden x 2 · kv · head_dim)."""
    if x.kv_copies == 1 or x.frozen_base:  # frozen: no gradient to sum
        return {"all-reduce": 0, "all-gather": 0}
    one_head = x.layers * x.hidden * 2 * x.head_dim
    return {"all-reduce": one_head, "all-gather": one_head * x.kv}


def model_axis_elements(x: StepShape) -> dict[str, int]:
    """Elements per step and device over "model" by collective kind, each counted by its result:
    Megatron's 4 all-reduces per layer (2 forward, 2 backward), the embedding's and the
    output layer's, and the fused loss's 3 b r numbers; grouped-query attention's copied
    key/value gradients (kv_copies_grad_elements); full remat recomputes the attention
    block's. With sequence parallelism each all-reduce is an all-gather of b·s·h and a
    reduce-scatter to b·s·h/t, the backward pass gathers each block's input again (2 per layer),
    and the replicated parameters' gradients are all-reduced once per microbatch. The heads'
    input: GPT gathers the whole sequence into the output layer (b·s·h, reduce-scattered back);
    BERT's heads take their rows (b·(r+1)·h with [CLS]) and the output layer's backward
    all-reduces b·r·h. On a model axis of one nothing is sent."""
    if x.tp == 1:
        return {"all-reduce": 0, "all-gather": 0, "reduce-scatter": 0}
    return _model_axis_forms(x)


def _model_axis_forms(x: StepShape) -> dict[str, int]:
    b, L, h, r, t, bsh, mb = x.rows, x.layers, x.hidden, x.head_rows, x.tp, x.bsh, x.microbatches
    full, kv = x.remat == "full", kv_copies_grad_elements(x)
    if not x.sequence_parallel:
        per = (
            4 * L * bsh + bsh + b * r * h + 3 * b * r + (L * bsh if full else 0) + kv["all-reduce"]
        )
        # a sparse layer's routing weights scale outputs each device holds a partial sum of: their
        # gradient, b·s·k numbers, is summed over "model" in the backward pass (core/moe.py);
        # inside the expert-manual step the router's weights' gradient instead (h·E, and the
        # shared experts' gate's h)
        routing = (
            h * (x.experts + x.shared_gate) if x.expert_manual else b * x.seq * x.experts_per_token
        )
        per += x.sparse_layers * routing
        return {"all-reduce": mb * per, "all-gather": mb * kv["all-gather"], "reduce-scatter": 0}
    if x.heads_read_rows:
        gather, scatter, reduce = b * (r + 1) * h, 0, b * r * h
    else:
        gather, scatter, reduce = (bsh, bsh // t, 0) if r else (0, 0, 0)
    embedding_grad = 0 if x.frozen_base else bsh  # the gather for its table's gradient
    return {
        "all-gather": mb * ((4 + 2) * L * bsh + embedding_grad + gather + kv["all-gather"]),
        "reduce-scatter": mb
        * (4 * L * bsh // t + bsh // t + scatter + (L * bsh // t if full else 0)),
        "all-reduce": mb * (3 * b * r + reduce + replicated_grad_elements(x) + kv["all-reduce"]),
    }


def expert_axis_minimum(x: StepShape) -> int:
    """All-to-all elements over "expert" per step and device, each counted by its result: per
    sparse layer and microbatch, 2 forward and 2 backward, each of the row shard's buffers,
    rows x E x slots x h (dropless, slots = the row's length: E/k times the k·h numbers of
    each token; with a capacity factor c, about c times them). None on an expert axis of one."""
    if x.ep == 1 or not x.sparse_layers:
        return 0
    per = x.rows * x.experts * x.expert_slots * x.hidden
    return x.microbatches * x.sparse_layers * 4 * per


def regathered_elements(x: StepShape) -> int:
    """Sequence parallelism's all-gathers of each block's input again in the backward pass
    (Megatron keeps only the shard, trading b·s·h of communication per block for memory)."""
    return x.microbatches * 2 * x.layers * x.bsh if x.sequence_parallel else 0


def remat_extra_elements(x: StepShape) -> int:
    """What full remat recomputes per layer: the layer's forward collectives but the last (its
    output is the next checkpoint): Megatron's attention all-reduce (b·s·h), or with sequence
    parallelism the attention block's reduce-scatter (b·s·h/t; its all-gathers serve as the
    backward pass's re-gathers)."""
    if x.remat != "full":
        return 0
    return x.microbatches * x.layers * (x.bsh // x.tp if x.sequence_parallel else x.bsh)


def model_axis_minimum(x: StepShape) -> int:
    """Megatron's minimum over "model" per step and device (Korthikanti et al.'s with sequence
    parallelism), without remat's recomputation and the backward pass's re-gathers, which
    `remat_extra_elements` and `regathered_elements` add."""
    return sum(_model_axis_forms(x).values()) - regathered_elements(x) - remat_extra_elements(x)


# --- communication over "data" ----------------------------------------------------------------
def data_axis_minimum(
    scheme: str,
    n: int,
    microbatches: int,
    split: int,
    whole: int,
    layers: int = 0,
    layers_read: int = 0,
    outside_once: bool = False,
) -> dict[str, float]:
    """Elements each device sends over "data" per step (ring algorithms) at the minimum of its
    data-parallel scheme, from the elements of its model shard of the parameters: `split` over
    "data" by ZeRO/FSDP (a dimension divides), `whole` (none does), and of the split ones those
    in the stacked `layers` and the `layers_read` by the backward pass:
      plain  every gradient all-reduced once per step: 2 (n-1)/n G;
      zero   the split part reduce-scattered and all-gathered once, the rest all-reduced;
      fsdp   per microbatch the layers' split weights gathered and every split gradient
             reduce-scattered; the other split weights gathered once per step; `regather`:
             the gathers again of the weights the backward pass reads, per layer and microbatch;
             `outside_once` (a pipeline's, which sums the gradients of the weights outside the
             layers over its ticks): those reduce-scattered once per step too."""
    if scheme not in DATA_SCHEMES:
        raise ValueError(
            f"a data-parallel scheme is one of {', '.join(DATA_SCHEMES)}, got {scheme!r}"
        )
    if n == 1:
        return {"gradients": 0.0, "params": 0.0, "regather": 0.0}
    gather, reduce, mb = (n - 1) / n, 2 * (n - 1) / n, microbatches
    if scheme == "plain":
        return {"gradients": reduce * (split + whole), "params": 0.0, "regather": 0.0}
    if scheme == "zero":
        return {
            "gradients": gather * split + reduce * whole,
            "params": gather * split,
            "regather": 0.0,
        }
    outside = gather * (split - layers) * (1 if outside_once else mb)
    return {
        "gradients": mb * gather * layers + outside + reduce * whole,
        "params": mb * gather * layers + gather * (split - layers),
        "regather": mb * gather * layers_read,
    }
