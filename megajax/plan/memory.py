"""Bytes one device holds for a train step, without a mesh or a compile.

Parameters, gradients and optimizer state come from the model's own shapes and partition
specs (megajax/models/registry.py) and the data axis's split of them (`sharding.data_sharded_spec`,
as ZeRO-1 and FSDP split them in megajax/training/data_parallel.py): the figures the dry run
prints, exactly. Activations come from the activation-memory model (megajax/analytic/)
and the step's other temporaries from what XLA's buffer assignment of the compiled step holds
at its peak:

  - float32 gradients: on an accelerator one copy, two with gradient accumulation (the
    microbatch's and the accumulator). XLA:GPU fuses the clipping's scale and Adam's update of
    each weight into one kernel that reads the gradient once (the H200's compiled step);
    XLA:CPU materialises the scaled gradients beside the raw ones, so it holds two copies
    even without accumulation (its buffer assignment). Split like the parameters under FSDP;
    ZeRO-1's step (not pipelined) accumulates one whole copy, its others are slices;
  - the activations the backward pass keeps, for every layer, for one microbatch;
  - at the backward pass's start, the larger of: one layer's backward working set (with full
    remat, its recomputed activations plus the 32-bit random bits its dropout masks are drawn
    from) and the vocab-parallel logits: float32 logits and their 16-bit gradient for 16-bit
    models on an accelerator (`precision.logits_product`), else float32 logits, their
    exponentials and their gradient (XLA:CPU's plan of gpt2_8.3b);
  - FSDP: one layer's gathered weights and the weights outside the layers, gathered (on a
    pipeline, with their gradients summed whole over the step: training/pipeline.py).

`backend="gpu"` (the default: the planner's hardware) predicts XLA:GPU's plan, checked against
the plans compiled on an H200 (tests/test_plan.py); `backend="cpu"` XLA:CPU's, checked against
the dry run's compiled peak at several points, in float32. (XLA:CPU of jax 0.10 computes
16-bit activations in float32 and keeps a 16-bit copy of the stacked checkpoints too; jax
0.12's keeps them 16-bit, as accelerators do, and as modelled here.)
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
from jax.sharding import PartitionSpec as P

from megajax import schedules
from megajax.analytic import DTYPE_BYTES, StepShape, activation_bytes_per_layer
from megajax.config import Config, ModelConfig
from megajax.core.attention import fused_attention
from megajax.core.moe import is_expert_weight
from megajax.core.precision import Precision
from megajax.core.sharding import DATA, EXPERT, MODEL, data_sharded_spec
from megajax.core.stack import layer_weight, read_by_backward
from megajax.mesh_shape import MeshShape
from megajax.models.registry import ModelDef, abstract_model, path_keys
from megajax.tasks import task_for

ADAM_MOMENTS = 2  # float32 first and second moments per parameter
BACKENDS = ("gpu", "cpu")
# optax's int32 step counts (Adam's and the schedule's); the loss scale's four scalars
OPTIMIZER_COUNTERS = 8 + 16


@dataclasses.dataclass(frozen=True)
class Weight:
    shape: tuple[int, ...]
    spec: P
    stacked: bool  # the scanned layers' stacked weights
    # kernels and LayerNorm scales: the backward pass reads them (FSDP gathers again)
    read_backward: bool
    expert: bool = False  # an expert's: split over "expert"


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
        in_layers = layer_weight(keys) is not None
        matrix = read_by_backward(keys)
        out.append(Weight(tuple(x.shape), spec, in_layers, matrix, is_expert_weight(keys)))
    return tuple(out)


def shard_elements(shape, spec, mesh: MeshShape, expert: bool = False) -> int:
    """A device's elements of a weight of `shape` split by `spec` (an expert's: and by the
    expert axis, which the spec of a mesh without one leaves out)."""
    n = math.prod(shape) // (mesh.expert if expert else 1)
    for entry in spec:
        for axis in entry if isinstance(entry, tuple) else (entry,):
            n //= {MODEL: mesh.model, DATA: mesh.data, EXPERT: mesh.expert}.get(axis, 1)
    return n


@dataclasses.dataclass
class StateSplit:
    """Elements of one device's model shard of the parameters, by how the data axis treats them."""

    model_shard: int = 0  # all of them (G in the audit's data-axis forms)
    split: int = 0  # those ZeRO/FSDP split over "data" (a dimension divides)
    whole: int = 0  # those no dimension of which divides: all-reduced whole
    layers: int = 0  # split and in the stacked layers (FSDP gathers them per layer)
    layers_read: int = 0  # of those, what the backward pass reads (FSDP gathers them again)
    params_local: int = 0  # elements of parameters a device stores (FSDP: its data slice)
    optimizer_local: int = 0  # elements of each Adam moment a device stores (ZeRO: its data slice)
    nonlayer_shard: int = 0  # model-shard elements outside the stacked layers
    experts: int = 0  # model-shard elements of expert weights (their gradients: over "data" only)


def state_split(cfg: Config, mesh: MeshShape, experts: bool | None = None) -> StateSplit:
    """One device's shares of the state; with pipeline stages, of its stage's layers (the
    weights outside the stack on every stage). On an expert mesh ZeRO-1 and FSDP split the
    experts' weights over "data" and the others over "data" and "expert"
    (training/data_parallel.py); `experts` True or False: those weights only."""
    t, pp = cfg.train, mesh.pipe
    zero = (t.shard_optimizer or t.shard_params) and mesh.batch_shards > 1
    fsdp = t.shard_params and mesh.batch_shards > 1
    model_only = MeshShape(model=mesh.model, expert=mesh.expert)
    out = StateSplit()
    for w in weights(cfg.model):
        if experts is not None and w.expert != experts:
            continue
        local = shard_elements(w.shape, w.spec, model_only, w.expert) // (pp if w.stacked else 1)
        # (FSDP gathers a layer at a time, and stages split the layers: never their axis)
        over = DATA if w.expert or mesh.expert == 1 else (DATA, EXPERT)
        split = (
            data_sharded_spec(
                w.shape, w.spec, mesh, skip_leading=w.stacked and (fsdp or pp > 1), over=over
            )
            if zero
            else None
        )
        sliced = (
            local
            if split is None
            else shard_elements(w.shape, split, mesh, w.expert) // (pp if w.stacked else 1)
        )
        out.model_shard += local
        out.experts += local if w.expert else 0
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


def activation_dtype(cfg: Config) -> str:
    """What an accelerator keeps activations in ("auto" is 16-bit there)."""
    name = cfg.model.compute_dtype
    return "bfloat16" if name == "auto" else "float32" if name == "mixed" else name


def gradient_copies(cfg: Config, backend: str = "gpu") -> int:
    """Float32 gradient buffers at the step's peak (module docstring)."""
    return 2 if backend == "cpu" or cfg.train.microbatches > 1 else 1


def gradient_elements(cfg: Config, st: StateSplit, pipelined: bool, backend: str = "gpu") -> int:
    """Elements of the float32 gradient buffers at the step's peak: `gradient_copies` of a
    device's weights; ZeRO-1's data-manual step accumulates one whole copy and reduce-scatters
    it once into slices, so its other copies are slices (FSDP's are all slices already; a
    pipeline sums whole gradients over its ticks)."""
    copies = gradient_copies(cfg, backend)
    if cfg.train.shard_optimizer and not cfg.train.shard_params and not pipelined:
        return st.params_local + (copies - 1) * st.optimizer_local
    return copies * st.params_local


def logit_bytes(cfg: Config, backend: str = "gpu") -> int:
    """Bytes the loss holds per logit (module docstring)."""
    sixteen_bit = DTYPE_BYTES[activation_dtype(cfg)] == 2
    return 4 + 2 if backend != "cpu" and sixteen_bit else 3 * 4


def rows_per_microbatch(cfg: Config, mesh: MeshShape) -> int:
    """Sequences one data shard runs per microbatch (each RACE option is one)."""
    t = cfg.train
    return (
        mesh.rows_per_microbatch(t.batch_size, t.microbatches) * task_for(cfg).sequences_per_example
    )


def step_shape(cfg: Config, mesh: MeshShape, backend: str = "gpu", dtype: str | None = None):
    """The StepShape of one device on `backend`, with what the backend decides: the activations'
    dtype (`dtype` overrides it), recomputation, cuDNN's flash attention on GPUs (on the CPU
    "fused" is XLA's, which keeps its scores)."""
    m = cfg.model
    return StepShape.of(
        cfg,
        task_for(cfg),
        mesh,
        dtype=dtype or activation_dtype(cfg),
        recompute_norm_gelu=Precision.of(m).recompute_norm_gelu,
        fused_attention=backend != "cpu" and fused_attention(m, on="gpu"),
    )


def kept_activation_bytes(cfg: Config, mesh: MeshShape, backend: str = "gpu") -> int:
    """What the backward pass keeps, for every layer, for one microbatch."""
    x, sparse = step_shape(cfg, mesh, backend), sum(cfg.model.sparse_layers)
    dense = (cfg.model.num_layers - sparse) * activation_bytes_per_layer(x)
    return dense + (sparse and sparse * activation_bytes_per_layer(x, sparse=True))


def memory_bytes(cfg: Config, mesh: MeshShape, backend: str = "gpu") -> dict:
    """Per-device bytes of the train step by kind, and their total: the compiled step's peak.
    With pipeline stages (training/pipeline.py): the stage's layers' state, and as kept
    activations the stage inputs its schedule holds (1F1B: at most p microbatches, GPipe: m),
    with one microbatch's activations of its layers while a backward tick recomputes them."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    m, t = cfg.model, cfg.train
    dp, tp, pp = mesh.data, mesh.model, mesh.pipe
    st, task, x = state_split(cfg, mesh), task_for(cfg), step_shape(cfg, mesh, backend)
    b, s, h, L = x.rows, m.seq_len, m.hidden, m.num_layers
    working = 0
    # A layer's backward pass with its recomputed activations (and the random bits its dropout
    # masks come from): full remat's, and any pipeline's backward tick, whose stage holds one
    # microbatch's activations only, so this transient is no longer small beside them.
    if m.remat == "full" or pp > 1:
        random_bits = 4 * (
            b * m.num_heads // tp * s * s * (m.attention_dropout > 0)
            + 2 * b * s * h * (m.hidden_dropout > 0)
        )
        sparse = bool(sum(m.sparse_layers))  # a sparse layer's, the larger
        working = activation_bytes_per_layer(x, remat="none", sparse=sparse) + random_bits
    logits = logit_bytes(cfg, backend) * b * task.head_rows(cfg) * m.padded_vocab // tp
    gathered = 0
    if t.shard_params and dp > 1:
        gathered = 4 * (st.layers // (L // pp) + st.nonlayer_shard)
        if pp > 1:  # a pipeline sums those weights' gradients whole over its ticks
            gathered += 4 * st.nonlayer_shard
    kept = kept_activation_bytes(cfg, mesh, backend)
    if pp > 1:
        slots = pipeline_slots(cfg, mesh)
        boundary = b * s * h // (tp if m.sequence_parallel else 1) * DTYPE_BYTES[x.dtype]
        working += kept // pp  # the backward tick's stage, one microbatch
        kept = slots * boundary
    out = {
        "params": 4 * st.params_local,
        "gradients": 4 * gradient_elements(cfg, st, pp > 1, backend),
        "optimizer": 4 * ADAM_MOMENTS * st.optimizer_local + OPTIMIZER_COUNTERS,
        "activations": kept,
        "working": max(working, logits) + gathered,
    }
    out["total"] = sum(out.values())
    return out


def pipeline_slots(cfg: Config, mesh: MeshShape) -> int:
    """Stage inputs and incoming gradients a stage of the run's schedule holds at most."""
    t = cfg.train
    return _slots(t.pipeline_schedule, mesh, t.microbatches, t.pipeline_chunks)


@functools.lru_cache(maxsize=None)
def _slots(schedule: str, mesh: MeshShape, micro: int, chunks: int) -> int:
    if schedule != "interleaved":  # the tables' closed forms (tests/test_plan.py)
        return (micro if schedule == "gpipe" else min(mesh.pipe, micro)) + 1
    table = schedules.build(schedule, mesh.pipe, micro, chunks)
    return table.act_slots + table.grad_slots


# The planner's prediction is within a few percent of the compiled peak (tests/test_plan.py);
# a run predicted to need this many times what a device has is refused before the compile,
# which for such sizes takes minutes (XLA folding (seq, seq) attention masks).
FAR_TOO_BIG = 4.0


def far_too_big(cfg: Config, mesh: MeshShape, backend: str, device_bytes: int | None) -> str | None:
    """A line refusing a step the planner predicts to need FAR_TOO_BIG times what a device has,
    or None (then the compiled step's own figure decides)."""
    if not device_bytes:
        return None
    need = memory_bytes(cfg, mesh, "cpu" if backend == "cpu" else "gpu")
    if need["total"] <= FAR_TOO_BIG * device_bytes:
        return None
    parts = ", ".join(f"{k} {v / 2**30:,.1f}" for k, v in need.items() if k != "total" and v)
    return (
        f"the train step would need about {need['total'] / 2**30:,.0f} GiB per device (the "
        f"planner's figure, GiB: {parts}), {need['total'] / device_bytes:,.0f} times the "
        f"{device_bytes / 2**30:,.1f} GiB a device has here: refused before compiling. Lower "
        "train.batch_size or model.seq_len, raise train.microbatches, set model.remat, or use a "
        "larger model axis (megajax-plan finds a way to run it)"
    )
