"""What a train step does per device, in closed form: matmul FLOPs, element-wise traffic and
the elements each collective moves over each mesh axis.

The communication forms are the collective audit's (megajax/tools/audit.py: Megatron's
minimum over "model", with sequence parallelism's and remat's additions, and each data-parallel
scheme's minimum over "data"); tests/test_plan.py checks them equal to the audit's figures for
compiled steps. FLOPs follow the paper (Shoeybi et al. 2019, appendix A):
96·B·s·l·h²·(1 + s/6h + V/16lh) with full recomputation, 72·B·s·l·h²·(1 + s/6h + V/12lh) without.
"""
from __future__ import annotations

import dataclasses

from megajax.config import Config
from megajax.plan.memory import rows_per_microbatch, state_split
from megajax.tasks import task_for


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


def layer_matmuls(cfg: Config, dp: int, tp: int) -> list[Matmul]:
    """One layer's forward matmuls on one device for one microbatch: QKV and fc1 column-split,
    the output projection and fc2 row-split, the attention core split by heads."""
    m, b = cfg.model, rows_per_microbatch(cfg, dp)
    n, h, f, s, d = b * m.seq_len, m.hidden, m.ffn, m.seq_len, m.head_dim
    heads = b * m.num_heads // tp
    return [Matmul(n, h, 3 * h // tp), Matmul(n, h // tp, h), Matmul(n, h, f // tp), Matmul(n, f // tp, h),
            Matmul(s, d, s, heads), Matmul(s, s, d, heads)]


def head_matmul(cfg: Config, dp: int, tp: int) -> Matmul:
    """The tied vocab-parallel output layer, on the positions that reach it."""
    m = cfg.model
    rows = rows_per_microbatch(cfg, dp) * task_for(cfg).head_rows(cfg)
    return Matmul(rows, m.hidden, m.padded_vocab // tp)


def recompute_passes(remat: str) -> int:
    return 1 if remat == "full" else 0


def step_flops(cfg: Config, remat: str | None = None) -> float:
    """Matmul FLOPs of a whole train step (all devices): forward, backward (twice the forward)
    and what `remat` recomputes (full: each layer's forward; selective: the attention core)."""
    remat = cfg.model.remat if remat is None else remat
    layer = sum(mm.flops for mm in layer_matmuls(cfg, 1, 1))
    core = sum(mm.flops for mm in layer_matmuls(cfg, 1, 1)[4:])
    per_microbatch = cfg.model.num_layers * ((3 + recompute_passes(remat)) * layer
                                             + (core if remat == "selective" else 0))
    return cfg.train.microbatches * (per_microbatch + 3 * head_matmul(cfg, 1, 1).flops)


def paper_flops(cfg: Config, full_recompute: bool = True) -> float:
    """The paper's closed form (GPT, ffn = 4h), for comparison with `step_flops`."""
    m = cfg.model
    B, s, l, h, V = cfg.train.batch_size, m.seq_len, m.num_layers, m.hidden, m.padded_vocab
    if full_recompute:
        return 96 * B * s * l * h * h * (1 + s / (6 * h) + V / (16 * l * h))
    return 72 * B * s * l * h * h * (1 + s / (6 * h) + V / (12 * l * h))


def model_axis_elements(cfg: Config, dp: int, tp: int) -> dict[str, int]:
    """Elements per step and device over "model" by collective kind, each counted by its
    result as the audit counts them: Megatron's 4 all-reduces per layer (2 forward, 2 backward),
    the embedding's and the tied output layer's, and the fused loss's 3 b r numbers; full remat
    recomputes the attention block's. With sequence parallelism each all-reduce is an all-gather
    of b·s·h and a reduce-scatter to b·s·h/t, the backward pass gathers each block's input again,
    and the replicated parameters' gradients are all-reduced once per microbatch."""
    m, mb, task = cfg.model, cfg.train.microbatches, task_for(cfg)
    if tp == 1:
        return {"all-reduce": 0, "all-gather": 0, "reduce-scatter": 0}
    b, L, h, r = rows_per_microbatch(cfg, dp), m.num_layers, m.hidden, task.head_rows(cfg)
    bsh, full = b * m.seq_len * h, m.remat == "full"
    if not m.sequence_parallel:
        per = 4 * L * bsh + bsh + b * r * h + 3 * b * r + (L * bsh if full else 0)
        return {"all-reduce": mb * per, "all-gather": 0, "reduce-scatter": 0}
    if task.heads_read_rows:
        gather, scatter, reduce = b * (r + 1) * h, 0, b * r * h
    else:
        gather, scatter, reduce = (bsh, bsh // tp, 0) if r else (0, 0, 0)
    replicated = L * 6 * h + 2 * h + (m.seq_len + task.extra_embedding_rows) * h
    return {"all-gather": mb * ((4 + 2) * L * bsh + bsh + gather),
            "reduce-scatter": mb * (4 * L * bsh // tp + bsh // tp + scatter + (L * bsh // tp if full else 0)),
            "all-reduce": mb * (3 * b * r + reduce + replicated)}


def data_axis_sent(cfg: Config, dp: int, tp: int) -> dict[str, float]:
    """Elements each device sends over "data" per step (ring algorithms), in the audit's forms
    (`data_axis_minimum`): gradients, parameters (ZeRO's all-gather of the update, FSDP's
    gathers) and FSDP's gathers again for the backward pass. ZeRO-1 and FSDP compile to their
    minimum; plain data parallelism as GSPMD compiles it, all-reducing once per microbatch."""
    if dp == 1:
        return {"gradients": 0.0, "params": 0.0, "regather": 0.0}
    t, st = cfg.train, state_split(cfg, dp, tp)
    gather, reduce, mb = (dp - 1) / dp, 2 * (dp - 1) / dp, t.microbatches
    if not (t.shard_optimizer or t.shard_params):
        return {"gradients": mb * reduce * st.model_shard, "params": 0.0, "regather": 0.0}
    if not t.shard_params:
        return {"gradients": gather * st.split + reduce * st.whole, "params": gather * st.split, "regather": 0.0}
    return {"gradients": mb * gather * st.split + reduce * st.whole,
            "params": mb * gather * st.layers + gather * (st.split - st.layers),
            "regather": mb * gather * st.layers_read}
