"""The closed forms of a train step, in one place: what one device computes (matmul FLOPs),
keeps (activation bytes per layer) and sends over each mesh axis (collective elements), as
functions of a `StepShape`, the numbers of a config, a mesh and a task.

Everything megajax predicts rather than measures is read from here: the collective audit's
minima (megajax/tools/audit.py), the planner's FLOPs, memory and volumes (megajax/plan/), the
log's MFU (megajax/training/mfu.py) and the dry run's modelled bytes
(megajax/tools/step_figures.py). A new kind of layer (another MLP, another attention) changes
the functions here, and every one of them follows.

FLOPs follow the paper (Shoeybi et al. 2019, appendix A): 96·B·s·l·h²·(1 + s/6h + V/16lh) with
full recomputation, 72·B·s·l·h²·(1 + s/6h + V/12lh) without. Activation bytes follow Korthikanti
et al. 2022, section 4, for megajax's layer (term by term below). Collective elements are
counted by each collective's result, as the audit reads them from the compiled program.
"""

from __future__ import annotations

import dataclasses

from megajax.mesh_shape import MeshShape
from megajax.moe_config import capacity

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
REMAT_MODES = ("none", "selective", "full")
DATA_SCHEMES = ("plain", "zero", "fsdp")


@dataclasses.dataclass(frozen=True)
class StepShape:
    """One device's view of a train step: per microbatch, `rows` sequences of `seq` tokens on
    its data shard, the layer's sizes, the model axis `tp`, and what the task's heads read."""

    layers: int
    rows: int
    seq: int
    hidden: int
    heads: int
    ffn: int
    head_dim: int
    vocab: int  # padded
    tp: int = 1
    microbatches: int = 1
    head_rows: int = 0  # positions per sequence through the output layer (GPT: seq)
    heads_read_rows: bool = False  # the heads take their rows (BERT), not the whole sequence (GPT)
    # replicated embedding rows besides the positions (BERT's token types)
    extra_embedding_rows: int = 0
    sequence_parallel: bool = False
    remat: str = "none"
    kv_heads: int = 0  # grouped-query attention's key/value heads (0: heads)
    gated: bool = False  # SwiGLU: gate and up, each ffn wide
    rms_norm: bool = False  # RMSNorm (a scale, one statistic a row), not LayerNorm (two each)
    row_biases: bool = True  # the row-parallel layers' biases (replicated)
    learned_positions: bool = True
    frozen_base: bool = False  # LoRA: only the adapters have gradients
    # What the activation model needs beyond the sizes: how the device keeps activations
    dtype: str = "bfloat16"  # the activations' dtype there
    hidden_dropout: bool = True
    attention_dropout: bool = True
    recompute_norm_gelu: bool = False  # megajax/core/precision.py
    fused_attention: bool = False  # cuDNN's flash attention (one softmax statistic a query)
    sparse_layers: int = 0  # mixture-of-experts layers (core/moe.py)
    experts_per_token: int = 0  # their top-k
    experts: int = 0  # their experts
    expert_slots: int = 0  # each expert's buffer slots in a row (moe_config.capacity)
    ep: int = 1  # the expert axis

    @classmethod
    def of(cls, cfg, task, mesh: MeshShape = MeshShape(), **device) -> "StepShape":
        """A config's step on one device of `mesh` (its stages aside: a stage runs the same
        layer); `task` is megajax.tasks.task_for(cfg). `device`: the fields a backend decides
        (dtype, recompute_norm_gelu, fused_attention), which megajax/plan/memory.py fills."""
        m, t = cfg.model, cfg.train
        rows = mesh.rows_per_microbatch(t.batch_size, t.microbatches)
        return cls(
            layers=m.num_layers,
            rows=rows * task.sequences_per_example,
            seq=m.seq_len,
            hidden=m.hidden,
            heads=m.num_heads,
            ffn=m.ffn,
            head_dim=m.head_dim,
            vocab=m.padded_vocab,
            tp=mesh.model,
            microbatches=t.microbatches,
            head_rows=task.head_rows(cfg),
            heads_read_rows=task.heads_read_rows,
            extra_embedding_rows=task.extra_embedding_rows,
            sequence_parallel=m.sequence_parallel,
            remat=m.remat,
            kv_heads=m.kv_heads,
            gated=m.mlp == "swiglu",
            rms_norm=m.norm == "rmsnorm",
            row_biases=m.bias == "all",
            learned_positions=m.positions == "learned",
            frozen_base=m.lora_rank > 0,
            hidden_dropout=m.hidden_dropout > 0,
            attention_dropout=m.attention_dropout > 0,
            sparse_layers=sum(m.sparse_layers),
            experts_per_token=m.experts_per_token if m.num_experts else 0,
            experts=m.num_experts,
            expert_slots=capacity(
                m.seq_len, m.moe_capacity_factor, m.experts_per_token, max(m.num_experts, 1)
            ),
            ep=mesh.expert,
            **device,
        )

    @property
    def bsh(self) -> int:
        return self.rows * self.seq * self.hidden

    @property
    def replicated_norm_params(self) -> int:
        """Per norm: LayerNorm's scale and bias, RMSNorm's scale."""
        return 1 if self.rms_norm else 2

    @property
    def kv(self) -> int:
        return self.kv_heads or self.heads

    @property
    def kv_copies(self) -> int:
        """Devices holding each key/value head."""
        return kv_copies(self.heads, self.kv, MeshShape(model=self.tp))

    @property
    def qkv_columns(self) -> int:
        """One device's columns of the query, key and value projection."""
        return (self.heads + 2 * self.kv * self.kv_copies) * self.head_dim // self.tp


def kv_copies(heads: int, kv_heads: int, mesh: MeshShape) -> int:
    """On how many devices of the model axis each key/value head lives: 1 when the axis divides
    them (or there is no grouping), else axis / key/value heads (each device its queries' head)."""
    tp = mesh.model
    return tp // kv_heads if kv_heads < heads and tp > kv_heads else 1


def layer_params(
    hidden: int,
    ffn: int,
    *,
    heads: int = 1,
    kv_heads: int | None = None,
    head_dim: int | None = None,
    gated: bool = False,
    bias: str = "all",
    norm: str = "layernorm",
) -> int:
    """Parameters of one transformer layer: the query, key and value projections (kv_heads of
    them for keys and values), the output projection, the MLP (SwiGLU: gate, up and down) and
    two norms (LayerNorm: scale and bias; RMSNorm: scale). `bias`: all, none or qkv only."""
    h, f = hidden, ffn
    d = head_dim or hidden // heads
    qkv = (heads + 2 * (kv_heads or heads)) * d
    mlp_in = 2 * f if gated else f
    weights = h * qkv + heads * d * h + h * mlp_in + f * h
    biases = {"all": qkv + h + mlp_in + h, "qkv": qkv, "none": 0}[bias]
    return weights + biases + (4 if norm == "layernorm" else 2) * h


def moe_mlp_params(
    hidden: int,
    expert_ffn: int,
    experts: int,
    *,
    shared_ffn: int = 0,
    shared_gate: bool = False,
    gated: bool = False,
    bias: str = "all",
) -> tuple[int, int]:
    """(all, one expert's) parameters of a mixture-of-experts MLP: the router (h x E), E
    experts (each an MLP of expert_ffn, with biases when `bias` is all), the shared experts
    (shared_ffn wide in all, no biases) and their gate (h)."""
    h, f = hidden, expert_ffn
    mlp_in = 2 * f if gated else f
    expert = h * mlp_in + f * h + (mlp_in + h if bias == "all" else 0)
    shared = (3 if gated else 2) * h * shared_ffn + (h if shared_gate else 0)
    return h * experts + experts * expert + shared, expert


# --- FLOPs ---------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Matmul:
    """One matmul a device runs per layer (or for the head) per microbatch: rows x inner x cols,
    `count` of them (the attention core: one per head and sequence)."""

    rows: int
    inner: int
    cols: int
    count: int = 1

    @property
    def flops(self) -> int:
        return 2 * self.rows * self.inner * self.cols * self.count


def layer_matmuls(x: StepShape) -> list[Matmul]:
    """One layer's forward matmuls on one device for one microbatch: QKV and fc1 (SwiGLU: gate
    and up) column-split, the output projection and fc2 row-split, the attention core (the last
    two) split by heads. Grouped-query attention projects fewer keys and values (each device its
    copy of the ones its queries read, when the model axis outnumbers them)."""
    n, h, f, s, d, t = x.rows * x.seq, x.hidden, x.ffn, x.seq, x.head_dim, x.tp
    heads = x.rows * x.heads // t
    fc1 = (2 if x.gated else 1) * f // t
    return [
        Matmul(n, h, x.qkv_columns),
        Matmul(n, x.heads * d // t, h),
        Matmul(n, h, fc1),
        Matmul(n, f // t, h),
        Matmul(s, d, s, heads),
        Matmul(s, s, d, heads),
    ]


def head_matmul(x: StepShape) -> Matmul:
    """The tied vocab-parallel output layer, on the positions that reach it."""
    return Matmul(x.rows * x.head_rows, x.hidden, x.vocab // x.tp)


def recompute_passes(remat: str) -> int:
    return 1 if remat == "full" else 0


def step_flops(x: StepShape, remat: str | None = None) -> float:
    """Matmul FLOPs of a train step on the devices `x` describes (tp = 1 and every row: the
    whole step): forward, backward (twice the forward) and what `remat` recomputes (full: each
    layer's forward; selective: the attention core)."""
    remat = x.remat if remat is None else remat
    mms = layer_matmuls(x)
    layer, core = sum(mm.flops for mm in mms), sum(mm.flops for mm in mms[4:])
    per_microbatch = x.layers * (
        (3 + recompute_passes(remat)) * layer + (core if remat == "selective" else 0)
    )
    return x.microbatches * (per_microbatch + 3 * head_matmul(x).flops)


def paper_flops(batch: int, x: StepShape, full_recompute: bool = True) -> float:
    """The paper's closed form (GPT, ffn = 4h), for comparison with `step_flops`."""
    B, s, L, h, V = batch, x.seq, x.layers, x.hidden, x.vocab
    if full_recompute:
        return 96 * B * s * L * h * h * (1 + s / (6 * h) + V / (16 * L * h))
    return 72 * B * s * L * h * h * (1 + s / (6 * h) + V / (12 * L * h))


def flops_per_token(x: StepShape, matmul_params_per_token: float) -> float:
    """Model FLOPs per trained token (forward + backward, no remat): 6 per weight a token goes
    through in a matmul (the task counts them: the tied embedding as GPT's output layer, BERT's
    output layer on the masked positions only) plus the attention scores and weighted sum,
    12 · layers · seq · heads · head_dim (the hidden size for GPT-2's and BERT's heads)."""
    return 6.0 * matmul_params_per_token + 12.0 * x.layers * x.seq * x.heads * x.head_dim


# --- communication over "model" ----------------------------------------------------------------
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
        # gradient, b·s·k numbers, is summed over "model" in the backward pass (core/moe.py)
        per += x.sparse_layers * b * x.seq * x.experts_per_token
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


# --- activation memory -------------------------------------------------------------------------
def activation_bytes_per_layer(x: StepShape, remat: str | None = None) -> int:
    """Bytes one device keeps for one layer's backward pass, for a microbatch of `x`: b = x.rows
    sequences of s = x.seq tokens, h = x.hidden, a = x.heads, t = x.tp (`remat` overrides x.remat).

    For 16-bit activations with dropout it is the paper's, term for term (bytes per layer):
        tensor parallel              s·b·h·(10 + 24/t + 5·a·s/(h·t))
        + sequence parallel          s·b·h/t·(34 + 5·a·s/h)
        + selective recomputation    s·b·h/t·34            (the a·s² attention core recomputed)
        full recomputation           s·b·h·2 (/t with sequence parallelism): the layer's input only
    and in general, with `act` bytes per activation (4 for float32) and 1 byte per dropout mask:
    LayerNorm inputs 2·act, the QKV and fc1 inputs 2·act (sequence parallel: their shards,
    all-gathered again in the backward pass), the two hidden dropout masks 2: (4·act + 2)·s·b·h,
    split over t only with sequence parallelism; q, k, v, the attention output and fc1's output
    and GeLU's, split over t: act·s·b·(4h + 2·ffn)/t; the attention core (softmax output, its
    dropout mask and result): (2·act + 1)·b·heads·s²/t; LayerNorm's float32 mean and 1/std: 16
    bytes a row. `recompute_norm_gelu` (a scanned stack of plain matmuls, not "mixed", not full
    remat: megajax/core/precision.py): the backward pass recomputes the LayerNorms' outputs and
    GeLU's from the block inputs and fc1's output, so it keeps (2·act + 2)·s·b·h between blocks,
    act·s·b·(4h + ffn)/t inside and no LayerNorm statistics. `fused_attention`: cuDNN's flash
    attention keeps one float32 softmax statistic a query and head instead of the core.
    Today's decoders: `head_dim` x `heads` replaces h for q, k, v and the attention output;
    grouped-query attention (`kv_heads`) keeps only its key/value heads for the fused core
    (megajax's core repeats them to every query head, as multi-head attention keeps them);
    SwiGLU (`gated`) keeps fc1's 2·ffn (gate and up) and the product's ffn; RMSNorm keeps one
    statistic a row instead of LayerNorm's two.
    These are the residuals megajax keeps (megajax/core/ops.py keeps LayerNorm and softmax to
    these; tests/test_memory_model.py checks the sum against XLA's compiled buffers); float32 on
    the CPU without attention dropout keeps no attention core either (blocked_attention.py
    recomputes the probabilities). Not counted: parameters, gradients, optimizer state, the
    embedding and logits (outside the layers)."""
    remat = x.remat if remat is None else remat
    if remat not in REMAT_MODES:
        raise ValueError(f"remat must be one of {REMAT_MODES}, got {remat!r}")
    b, s, h, heads, tp, ffn = x.rows, x.seq, x.hidden, x.heads, x.tp, x.ffn
    act = DTYPE_BYTES[x.dtype]
    sp = tp if x.sequence_parallel else 1  # what the between-blocks tensors are split by
    if remat == "full":
        return s * b * h * act // sp
    norm_stats = x.replicated_norm_params * 4 * s * b // sp  # float32, per norm
    kept_inputs, kept_ffn, stats = (2, 1, 0) if x.recompute_norm_gelu else (4, 2, 2 * norm_stats)
    kept_ffn += 1 if x.gated else 0  # gate and up, where GeLU has one input
    between = (kept_inputs * act + (2 if x.hidden_dropout else 0)) * s * b * h // sp + stats
    width = heads * x.head_dim
    # megajax's core repeats the key/value heads to every query head; the fused one does not
    kv = 2 * x.kv * x.kv_copies * x.head_dim if x.fused_attention else 2 * width
    inside = act * s * b * (2 * width + kv + kept_ffn * ffn) // tp
    mask = act + 1 if x.attention_dropout else 0
    core = 0 if remat == "selective" else (act + mask) * b * heads * s * s // tp
    core = 4 * b * heads * s // tp if x.fused_attention else core
    return between + inside + core
