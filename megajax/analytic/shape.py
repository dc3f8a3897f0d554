"""The numbers a closed form is a function of: `StepShape` (one device's view of a train step),
and the parameter counts of a layer."""

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
    expert_ffn: int = 0  # each expert's MLP width
    shared_ffn: int = 0  # the shared experts' width, all of them together
    shared_gate: bool = False  # their sigmoid gate (h x 1)
    # ZeRO-1/FSDP on an expert mesh: the step is manual over "data" and "expert", the sparse
    # layer's shard_map untyped inside it (core/moe.py, MoEBlock.varying)
    expert_manual: bool = False

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
            expert_ffn=m.moe_ffn if m.num_experts else 0,
            shared_ffn=m.moe_shared_ffn if m.num_experts else 0,
            shared_gate=m.moe_shared_gate,
            expert_manual=mesh.expert > 1 and (t.shard_optimizer or t.shard_params),
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
    qk_norm: bool = False,
) -> int:
    """Parameters of one transformer layer: the query, key and value projections (kv_heads of
    them for keys and values), the output projection, the MLP (SwiGLU: gate, up and down) and
    two norms (LayerNorm: scale and bias; RMSNorm: scale), and QK-norm's two scales of the head
    dimension. `bias`: all, none or qkv only."""
    h, f = hidden, ffn
    d = head_dim or hidden // heads
    qkv = (heads + 2 * (kv_heads or heads)) * d
    mlp_in = 2 * f if gated else f
    weights = h * qkv + heads * d * h + h * mlp_in + f * h
    biases = {"all": qkv + h + mlp_in + h, "qkv": qkv, "none": 0}[bias]
    return weights + biases + (4 if norm == "layernorm" else 2) * h + (2 * d if qk_norm else 0)


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
