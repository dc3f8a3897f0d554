"""Bytes one device holds for a train step, without a mesh or a compile.

Parameters, gradients and optimizer state come from the model's own shapes and partition
specs (megajax/models/registry.py) and the data axis's split of them (`sharding.data_sharded_spec`,
as ZeRO-1 and FSDP split them in megajax/training/data_parallel.py): the figures the dry run
prints, exactly. Activations come from the activation-memory model (megajax/memory_model.py)
and the step's other temporaries from what XLA's buffer assignment of the compiled step holds
at its peak (read from XLA's memory-usage report of gpt2_8.3b; tests/test_plan.py checks the
total against the dry run's compiled peak at several points):

  - two float32 copies of the gradients (the microbatch's and the accumulator), split like the
    parameters under FSDP;
  - the activations the backward pass keeps, for every layer, for one microbatch;
  - at the backward pass's start, the larger of: one layer's backward working set (with full
    remat, its recomputed activations plus the 32-bit random bits its dropout masks are drawn
    from) and the vocab-parallel logits (float32: logits, their exponentials and gradient);
  - FSDP: one layer's gathered weights and the weights outside the layers, gathered.
XLA:CPU of jax 0.10 computes 16-bit activations in float32 and keeps a 16-bit copy of the
stacked checkpoints too: `cpu=True` models that, to compare with its dry runs (jax 0.12's
XLA:CPU keeps them 16-bit, as accelerators do).
"""
from __future__ import annotations

import dataclasses
import math

import jax
from jax.sharding import PartitionSpec as P

from megajax.config import Config, ModelConfig
from megajax.core.layers import fused_attention
from megajax.core.precision import Precision
from megajax.core.sharding import DATA, MODEL, data_sharded_spec
from megajax.memory_model import DTYPE_BYTES, activation_bytes_per_layer
from megajax.models.registry import ModelDef, abstract_model, path_keys
from megajax.tasks import task_for

ADAM_MOMENTS = 2          # float32 first and second moments per parameter
GRADIENT_COPIES = 2       # the microbatch's float32 gradients and the accumulator
LOGIT_COPIES = 3          # float32 logits, their exponentials, their gradient
OPTIMIZER_COUNTERS = 8    # optax's int32 step counts (Adam's and the schedule's)


@dataclasses.dataclass(frozen=True)
class Weight:
    shape: tuple[int, ...]
    spec: P
    stacked: bool         # the scanned layers' stacked weights
    read_backward: bool   # kernels and LayerNorm scales: the backward pass reads them (FSDP gathers again)


def weights(model_cfg: ModelConfig) -> tuple[Weight, ...]:
    """Every parameter's shape and model-axis spec (eval_shape: nothing allocated)."""
    key = repr(model_cfg)
    if key not in _WEIGHTS:
        _WEIGHTS[key] = _read_weights(model_cfg)
    return _WEIGHTS[key]


_WEIGHTS: dict[str, tuple[Weight, ...]] = {}


def _read_weights(model_cfg: ModelConfig) -> tuple[Weight, ...]:
    md = ModelDef(abstract_model(model_cfg, None))
    shapes = jax.tree_util.tree_flatten_with_path(md.abstract_params())[0]
    specs = jax.tree.leaves(md.specs(), is_leaf=lambda x: isinstance(x, P))
    out = []
    for (path, x), spec in zip(shapes, specs):
        keys = path_keys(path)
        out.append(Weight(tuple(x.shape), spec, keys[0] == "layers", keys[-1] in ("kernel", "scale")))
    return tuple(out)


def shard_elements(shape, spec, dp: int, tp: int) -> int:
    n = math.prod(shape)
    for entry in spec:
        for axis in entry if isinstance(entry, tuple) else (entry,):
            n //= {MODEL: tp, DATA: dp}.get(axis, 1)
    return n


@dataclasses.dataclass
class StateSplit:
    """Elements of one device's model shard of the parameters, by how the data axis treats them."""
    model_shard: int = 0      # all of them (G in the audit's data-axis forms)
    split: int = 0            # those ZeRO/FSDP split over "data" (a dimension divides)
    whole: int = 0            # those no dimension of which divides: all-reduced whole
    layers: int = 0           # split and in the stacked layers (FSDP gathers them per layer)
    layers_read: int = 0      # of those, what the backward pass reads (FSDP gathers them again)
    params_local: int = 0     # elements of parameters a device stores (FSDP: its data slice)
    optimizer_local: int = 0  # elements of each Adam moment a device stores (ZeRO: its data slice)
    nonlayer_shard: int = 0   # model-shard elements outside the stacked layers


def state_split(cfg: Config, dp: int, tp: int) -> StateSplit:
    t = cfg.train
    zero, fsdp = (t.shard_optimizer or t.shard_params) and dp > 1, t.shard_params and dp > 1
    out = StateSplit()
    for w in weights(cfg.model):
        local = shard_elements(w.shape, w.spec, 1, tp)
        split = data_sharded_spec(w.shape, w.spec, dp, tp, skip_leading=w.stacked and fsdp) if zero else None
        sliced = local if split is None else shard_elements(w.shape, split, dp, tp)
        out.model_shard += local
        out.params_local += sliced if fsdp else local
        out.optimizer_local += sliced
        out.nonlayer_shard += 0 if w.stacked else local
        if split is None:
            out.whole += local
            continue
        out.split += local
        if w.stacked:
            out.layers += local
            out.layers_read += local if (w.read_backward or cfg.model.remat == "full") else 0
    return out


def activation_dtype(cfg: Config, cpu: bool = False) -> str:
    """What an accelerator keeps activations in ("auto" is 16-bit there); XLA:CPU: float32."""
    name = cfg.model.compute_dtype
    name = "bfloat16" if name == "auto" else "float32" if name == "mixed" else name
    return "float32" if cpu else name


def memory_bytes(cfg: Config, dp: int, tp: int, cpu: bool = False) -> dict:
    """Per-device bytes of the train step by kind, and their total: the compiled step's peak."""
    m, t = cfg.model, cfg.train
    st, task = state_split(cfg, dp, tp), task_for(cfg)
    b = t.batch_size // t.microbatches // dp * task.sequences_per_example
    s, h, L = m.seq_len, m.hidden, m.num_layers
    kw = dict(b=b, s=s, h=h, heads=m.num_heads, tp=tp, ffn=m.ffn, sequence_parallel=m.sequence_parallel,
              dtype=activation_dtype(cfg, cpu), hidden_dropout=m.hidden_dropout > 0,
              attention_dropout=m.attention_dropout > 0,
              recompute_norm_gelu=Precision.of(m).recompute_norm_gelu,
              # cuDNN's flash attention, on GPUs (on the CPU "fused" is XLA's, which keeps its scores)
              fused_attention=not cpu and fused_attention(m, on="gpu"))
    kept = L * activation_bytes_per_layer(remat=m.remat, **kw)
    if cpu and m.remat == "full" and DTYPE_BYTES[activation_dtype(cfg)] == 2:
        kept += kept // 2                      # the 16-bit copy of the float32 checkpoints
    working = 0
    if m.remat == "full":
        random_bits = 4 * (b * m.num_heads // tp * s * s * (m.attention_dropout > 0)
                           + 2 * b * s * h * (m.hidden_dropout > 0))
        working = activation_bytes_per_layer(remat="none", **kw) + random_bits
    logits = LOGIT_COPIES * 4 * b * task.head_rows(cfg) * m.padded_vocab // tp
    gathered = 0
    if t.shard_params and dp > 1:
        gathered = 4 * (st.layers // L + st.nonlayer_shard)
    out = {"params": 4 * st.params_local, "gradients": 4 * GRADIENT_COPIES * st.params_local,
           "optimizer": 4 * ADAM_MOMENTS * st.optimizer_local + OPTIMIZER_COUNTERS, "activations": kept,
           "working": max(working, logits) + gathered}
    out["total"] = sum(out.values())
    return out
