"""Matmul FLOPs: one device's matmuls per layer, a step's FLOPs, the paper's formula, model FLOPs
per token."""

from __future__ import annotations

import dataclasses

from megajax.analytic.shape import StepShape


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


def layer_matmuls(x: StepShape, sparse: bool = False, executed: bool = True) -> list[Matmul]:
    """One layer's forward matmuls on one device for one microbatch: QKV and fc1 (SwiGLU: gate
    and up) column-split, the output projection and fc2 row-split, the attention core (the last
    two) split by heads. Grouped-query attention projects fewer keys and values (each device its
    copy of the ones its queries read, when the model axis outnumbers them). `sparse`: a
    mixture-of-experts layer's MLP in place of fc1 and fc2 (`sparse_mlp_matmuls`)."""
    n, h, f, s, d, t = x.rows * x.seq, x.hidden, x.ffn, x.seq, x.head_dim, x.tp
    heads = x.rows * x.heads // t
    fc1 = (2 if x.gated else 1) * f // t
    mlp = sparse_mlp_matmuls(x, executed) if sparse else [Matmul(n, h, fc1), Matmul(n, f // t, h)]
    return [
        Matmul(n, h, x.qkv_columns),
        Matmul(n, x.heads * d // t, h),
        *mlp,
        Matmul(s, d, s, heads),
        Matmul(s, s, d, heads),
    ]


def sparse_mlp_matmuls(x: StepShape, executed: bool = True) -> list[Matmul]:
    """A sparse layer's MLP on one device (core/moe.py): the router (replicated over "model"),
    the experts and the shared experts (split over "model" as a dense MLP) with their gate.
    `executed`: what runs, each of the device's E / ep experts on the buffers of the ep row
    shards it serves, rows x slots each (dropless: slots = the row's length, E / k times the
    tokens' k assignments), and the combine; else the model's FLOPs, the k experts of each
    token (what MFU counts)."""
    n, h, f, t = x.rows * x.seq, x.hidden, x.expert_ffn, x.tp
    width = 2 if x.gated else 1
    rows, count = (
        (x.ep * x.rows * x.expert_slots, x.experts // x.ep)
        if executed
        else (n * x.experts_per_token, 1)
    )
    out = [
        Matmul(n, h, x.experts),
        Matmul(rows, h, width * f // t, count),
        Matmul(rows, f // t, h, count),
    ]
    if x.shared_ffn:
        out += [Matmul(n, h, width * x.shared_ffn // t), Matmul(n, x.shared_ffn // t, h)]
        out += [Matmul(n, h, 1)] * x.shared_gate
    if executed:  # the combine, each token's k results weighted (and with biases, again for
        # the experts' output biases after the all-reduce, the router run again for them)
        out += [Matmul(n, x.experts_per_token, h)]
        if x.row_biases:
            out += [Matmul(n, h, x.experts), Matmul(n, x.experts_per_token, h)]
    return out


def layer_flops(x: StepShape, remat: str, executed: bool = True) -> float:
    """Forward, backward and recomputed matmul FLOPs of the layers for one microbatch (the
    sparse layers' as `executed`)."""
    total = 0.0
    for sparse, count in ((False, x.layers - x.sparse_layers), (True, x.sparse_layers)):
        if not count:
            continue
        mms = layer_matmuls(x, sparse, executed)
        layer, core = sum(mm.flops for mm in mms), sum(mm.flops for mm in mms[-2:])
        total += count * (
            (3 + recompute_passes(remat)) * layer + (core if remat == "selective" else 0)
        )
    return total


def head_matmul(x: StepShape) -> Matmul:
    """The tied vocab-parallel output layer, on the positions that reach it."""
    return Matmul(x.rows * x.head_rows, x.hidden, x.vocab // x.tp)


def recompute_passes(remat: str) -> int:
    return 1 if remat == "full" else 0


def step_flops(x: StepShape, remat: str | None = None, executed: bool = True) -> float:
    """Matmul FLOPs of a train step on the devices `x` describes (tp = 1 and every row: the
    whole step): forward, backward (twice the forward) and what `remat` recomputes (full: each
    layer's forward; selective: the attention core). `executed`: a sparse layer's experts as
    they run on their buffers; else as the model counts them (sparse_mlp_matmuls)."""
    remat = x.remat if remat is None else remat
    return x.microbatches * (layer_flops(x, remat, executed) + 3 * head_matmul(x).flops)


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
