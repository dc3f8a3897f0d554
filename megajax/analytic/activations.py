"""Activation bytes per layer and device (Korthikanti et al. 2022, section 4, for megajax's
layer)."""

from __future__ import annotations

from megajax.analytic.shape import DTYPE_BYTES, REMAT_MODES, StepShape


def activation_bytes_per_layer(x: StepShape, remat: str | None = None, sparse: bool = False) -> int:
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
    recomputes the probabilities). `sparse`: a mixture-of-experts layer (sparse_mlp_bytes) in
    place of the MLP's fc1 and activation outputs. Not counted: parameters, gradients, optimizer
    state, the embedding and logits (outside the layers)."""
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
    mlp = sparse_mlp_bytes(x) if sparse else act * s * b * kept_ffn * ffn // tp
    inside = act * s * b * (2 * width + kv) // tp + mlp
    mask = act + 1 if x.attention_dropout else 0
    core = 0 if remat == "selective" else (act + mask) * b * heads * s * s // tp
    core = 4 * b * heads * s // tp if x.fused_attention else core
    return between + inside + core


def sparse_mlp_bytes(x: StepShape) -> int:
    """What a sparse layer's MLP keeps for the backward pass on one device (core/moe.py): the
    float32 router logits and scores (b·s·E each) and the router's float32 input where the
    activations are narrower; the experts' buffers, E·b·slots of them (each device's E / ep
    experts on ep row shards' buffers), each with its h inputs and the experts' fc1 outputs
    (SwiGLU: gate and up) split over "model", the activation recomputed from them; the k
    results each token gathers back (b·s·k·h); the shared experts' as a dense MLP's."""
    b, s, h, tp, act = x.rows, x.seq, x.hidden, x.tp, DTYPE_BYTES[x.dtype]
    kept_ffn = 2 if x.gated else 1
    slots = b * x.experts * x.expert_slots
    router = 2 * 4 * b * s * x.experts + (4 * b * s * h if act < 4 else 0)
    experts = act * slots * (h + kept_ffn * x.expert_ffn // tp)
    shared = act * b * s * (kept_ffn + 1) * x.shared_ffn // tp
    return router + experts + act * b * s * x.experts_per_token * h + shared
