"""Activation memory of one transformer layer on one device, before anything is compiled: the
model of Korthikanti et al. 2022 (section 4) for megajax's layer, in pure Python.

For 16-bit activations with dropout it is the paper's, term for term (bytes per layer):
    tensor parallel              s·b·h·(10 + 24/t + 5·a·s/(h·t))
    + sequence parallel          s·b·h/t·(34 + 5·a·s/h)
    + selective recomputation    s·b·h/t·34            (the a·s² attention core recomputed)
    full recomputation           s·b·h·2 (/t with sequence parallelism): the layer's input only
and in general, with `act` bytes per activation (4 for float32) and 1 byte per dropout mask:
    LayerNorm inputs 2·act, the QKV and fc1 inputs 2·act (sequence parallel: their shards,
    all-gathered again in the backward pass), the two hidden dropout masks 2: (4·act + 2)·s·b·h,
    split over t only with sequence parallelism;
    q, k, v, the attention output and fc1's output and GeLU's, split over t: act·s·b·(4h + 2·ffn)/t;
    the attention core (softmax output, its dropout mask and result): (2·act + 1)·b·heads·s²/t;
    LayerNorm's float32 mean and 1/std: 16 bytes a row.
With `model.recompute_norm_gelu` a scanned stack that keeps its activations, with plain
matmuls (`Precision.recompute_norm_gelu`: not "mixed", not full remat), keeps less: the backward
pass recomputes the LayerNorms' outputs (the QKV and fc1 inputs) and GeLU's output from the
block inputs and fc1's output, so it keeps (2·act + 2)·s·b·h between blocks,
act·s·b·(4h + ffn)/t inside and no LayerNorm statistics.
These are the residuals megajax keeps (megajax/core/ops.py keeps LayerNorm and softmax to
these; `tests/test_memory_model.py` checks the sum against XLA's compiled buffers); float32
on the CPU without attention dropout keeps no attention core either (blocked_attention.py
recomputes the probabilities, as selective recomputation would, for speed). Not
counted: parameters, gradients, optimizer state, the embedding and logits (outside the layers),
and on XLA:CPU, which stores 16-bit activations as float32, the weights' per-layer copies.
"""
from __future__ import annotations

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
REMAT_MODES = ("none", "selective", "full")


def activation_bytes_per_layer(*, b: int, s: int, h: int, heads: int, tp: int = 1, ffn: int | None = None,
                               sequence_parallel: bool = False, remat: str = "none", dtype: str = "bfloat16",
                               hidden_dropout: bool = True, attention_dropout: bool = True,
                               recompute_norm_gelu: bool = False, fused_attention: bool = False) -> int:
    """Bytes one device keeps for one layer's backward pass, for b sequences of s tokens
    (`recompute_norm_gelu`: LayerNorm's and GeLU's outputs recomputed, as above; `fused_attention`:
    cuDNN's flash attention, which keeps one float32 softmax statistic a query and head)."""
    if remat not in REMAT_MODES:
        raise ValueError(f"remat must be one of {REMAT_MODES}, got {remat!r}")
    act, ffn = DTYPE_BYTES[dtype], 4 * h if ffn is None else ffn
    sp = tp if sequence_parallel else 1          # what the between-blocks tensors are split by
    if remat == "full":
        return s * b * h * act // sp
    kept_inputs, kept_ffn, stats = (2, 1, 0) if recompute_norm_gelu else (4, 2, 2 * 2 * 4 * s * b // sp)
    between = (kept_inputs * act + (2 if hidden_dropout else 0)) * s * b * h // sp + stats
    inside = act * s * b * (4 * h + kept_ffn * ffn) // tp
    core = 0 if remat == "selective" else (act + (act + 1 if attention_dropout else 0)) * b * heads * s * s // tp
    core = 4 * b * heads * s // tp if fused_attention else core
    return between + inside + core


def paper_bytes_per_layer(*, b: int, s: int, h: int, heads: int, tp: int = 1, sequence_parallel: bool = False,
                          remat: str = "none") -> float:
    """The paper's closed forms (16-bit activations, dropout, ffn = 4h), for comparison."""
    sbh, a, t = s * b * h, heads, tp
    if remat == "full":
        return 2 * sbh / (t if sequence_parallel else 1)
    core = 0 if remat == "selective" else 5 * a * s / h
    if sequence_parallel:
        return sbh / t * (34 + core)
    return sbh * (10 + 24 / t + core / t)
