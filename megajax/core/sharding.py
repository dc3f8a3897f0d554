"""Every PartitionSpec megajax uses, in one place.

Weights (Megatron-LM, Shoeybi et al. 2019, section 3):
  column-parallel kernel  (in, out)  -> (None, "model")   QKV, MLP fc1
  row-parallel kernel     (in, out)  -> ("model", None)   attention out, MLP fc2
  vocab-parallel table    (V, h)     -> ("model", None)   input embedding = tied output layer
  LayerNorm, position embeddings, row-parallel biases     -> replicated

Activations are batch-sharded over "data" and replicated over "model" between blocks (or,
with sequence parallelism, split over "model" along the sequence: Korthikanti et al. 2022);
inside a block the hidden features of column-parallel outputs are split over "model".

The collectives come from exactly two places:
  * `Layout.reduce_to_replicated` after each row-parallel matmul (Megatron's g: all-reduce
    forward; its transpose, Megatron's f, is the all-reduce of the backward pass); with
    sequence parallelism, the shard_map'd gather before each column-parallel matmul and
    reduce-scatter after each row-parallel one (megajax/core/layers.py: all-gather forward,
    reduce-scatter backward, and the reverse);
  * the shard_map'd vocab-parallel embedding lookup and cross-entropy (megajax/core/loss.py);
  * with sequence parallelism, `Layout.take_rows`: the rows BERT's heads read (one all-reduce).

Over "data" (megajax/training/step.py): GSPMD reduces the gradients, unless the optimizer state
or the parameters are sharded over "data" too (ZeRO-1 / FSDP). Then the gradient computation
runs under a shard_map that is manual over "data" (`DATA in Layout.manual`: the activation specs
here lose their "data" entry, each device sees its own rows) and the data-axis collectives are
written out: `Layout.gather_weights` (FSDP's per-layer all-gather; its transpose is the
gradients' reduce-scatter) and the step's one reduce-scatter of the accumulated gradients.
`data_sharded_spec` says which dimension of each weight "data" splits.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import traverse_util
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

# The mesh axes' names (megajax/mesh_shape.py): every other module imports them from here
from megajax.mesh_shape import DATA, EXPERT, LAYOUT, MODEL, PIPE, MeshShape

AXES = (DATA, MODEL)
# Pipeline parallelism's stages (Narayanan et al. 2021): the outermost axis, as Megatron-LM
# puts its stages across nodes. A mesh has it only when it has more than one stage, so a run
# without a pipeline is the two-axis program it always was.
PIPE_AXES = LAYOUT

# Parameter specs as tuples, the form Flax NNX stores in a Variable's sharding metadata.
COLUMN = (None, MODEL)
COLUMN_BIAS = (MODEL,)
ROW = (MODEL, None)
REPLICATED_BIAS = (None,)
VOCAB = (MODEL, None)
VOCAB_BIAS = (MODEL,)  # BERT's MLM output bias, split like the logits
REPLICATED_2D = (None, None)
# A mixture of experts' stacked expert weights (core/moe.py): the experts split over "expert"
# when the mesh has that axis (`Layout.experts`), each expert's MLP split over "model" as the
# dense one is (expert tensor parallelism).
EXPERT_IN = (EXPERT, None, MODEL)  # (experts, in, out): column-parallel fc1 / gate / up
EXPERT_OUT = (EXPERT, MODEL, None)  # (experts, in, out): row-parallel fc2
EXPERT_IN_BIAS = (EXPERT, MODEL)  # (experts, out)
EXPERT_OUT_BIAS = (EXPERT, None)  # (experts, out)

# Activation specs.
ACT_REPLICATED = P(DATA, None, None)  # (batch, seq, hidden) between blocks
# (batch, seq/tp, hidden) between blocks, sequence parallel
ACT_SEQUENCE = P(DATA, MODEL, None)
# (batch, seq, features/tp) after a column-parallel matmul
ACT_COLUMN = P(DATA, None, MODEL)
ACT_HEADS = P(DATA, None, MODEL, None)  # (batch, seq, heads/tp, head_dim)
ATTN_SCORES = P(DATA, MODEL, None, None)  # (batch, heads/tp, q, k)
TOKENS = P(DATA, None)  # (batch, seq) token ids, per-token losses
BATCH = P(DATA)  # any batch array: rows over "data", the rest whole
# (batch, heads/tp, max_len, head_dim): split like the heads
KV_CACHE = P(DATA, MODEL, None, None)


def is_megajax_mesh(mesh) -> bool:
    """The axes ("data", "model"), "pipe" and "expert" in their places when the mesh has
    them (mesh_shape.LAYOUT), all Auto: the only mesh a Layout takes (core.mesh.as_mesh turns
    a user's into one)."""
    names = tuple(mesh.axis_names)
    in_place = names == tuple(a for a in LAYOUT if a in names) and set(names) <= set(LAYOUT)
    return (
        in_place
        and set(AXES) <= set(names)
        and all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)
    )


def check_context_mesh():
    """megajax's arrays carry shardings on Auto mesh axes, and jax refuses them inside a
    `jax.set_mesh(m)` whose m has Explicit axes (jax.make_mesh's default): say so in one line
    instead of the first jax operation's error. An Auto context mesh is fine."""
    types = jax.sharding.get_abstract_mesh().axis_types
    if any(t == jax.sharding.AxisType.Explicit for t in types):
        raise ValueError(
            "megajax cannot run inside jax.set_mesh(mesh) of a mesh with Explicit axes "
            "(jax.make_mesh's default): call it outside that block, or make the mesh with "
            "megajax.make_mesh"
        )


PURPOSES = ("train", "inference")


@dataclasses.dataclass(frozen=True)
class Layout:
    """The mesh a model runs on. Hashable, so Flax NNX keeps it as static module metadata."""

    mesh: Mesh | None = None
    sequence_parallel: bool = False
    # The mesh axes the code runs manual over (inside a shard_map): "data" in the train step of
    # ZeRO/FSDP (arrays are this device's rows; with "expert" too on an expert mesh, where it is
    # one more data axis and each device holds its own experts), "pipe" in the pipelined step
    # (one stage's layers). The model axis is never manual here: its collectives are GSPMD's
    # or this module's.
    manual: frozenset = frozenset()
    # FSDP: (path inside a layer, (dimension split, the weight's model-axis spec, the axes it is
    # split over: "data", or "data" and "expert" for a weight that is not an expert's)) of every
    # layer weight that is.
    fsdp_layer_dims: tuple = ()

    @classmethod
    def for_model(cls, mesh: Mesh | None, cfg, purpose: str = "train", **options) -> "Layout":
        """The layout a model of `cfg` (a ModelConfig) runs with on `mesh`, for `purpose`: the one
        place where the config's sequence parallelism becomes the activations' specs; modules
        read only the layout. Inference (evaluation, sampling, decoding) runs the same weights
        without it: a decoded token cannot be split over the model axis. `options`: the
        train step's `manual` axes and FSDP's `fsdp_layer_dims`."""
        if purpose not in PURPOSES:
            raise ValueError(f"a layout's purpose is one of {', '.join(PURPOSES)}, got {purpose!r}")
        return cls(mesh, sequence_parallel=cfg.sequence_parallel and purpose == "train", **options)

    def __post_init__(self):
        object.__setattr__(self, "manual", frozenset(self.manual))
        if not self.manual <= {DATA, PIPE, EXPERT} or (EXPERT in self.manual) > (
            DATA in self.manual
        ):
            raise ValueError(
                f"a Layout is manual over data (and expert beside it) and pipe only, got "
                f"{set(self.manual)}"
            )
        if self.mesh is not None and not is_megajax_mesh(self.mesh):
            raise ValueError(
                f"a Layout needs a mesh with Auto axes {AXES}, got {self.mesh.axis_names} "
                f"({self.mesh.axis_types}): pass it through megajax.core.mesh.as_mesh"
            )

    @property
    def between_blocks(self) -> P:
        """The activations' spec between blocks (LayerNorm, dropout, residuals run on it)."""
        return ACT_SEQUENCE if self.sequence_parallel else ACT_REPLICATED

    @property
    def shape(self) -> MeshShape:
        """The mesh's axis sizes (all 1 without a mesh)."""
        return MeshShape() if self.mesh is None else MeshShape.of(self.mesh)

    @property
    def tp(self) -> int:
        return 1 if self.mesh is None else self.mesh.shape[MODEL]

    @property
    def pp(self) -> int:
        """Pipeline stages (1: the mesh has no pipe axis)."""
        return 1 if self.mesh is None else self.mesh.shape.get(PIPE, 1)

    @property
    def dp(self) -> int:
        """The shards of a batch's rows: "data" and "expert"."""
        return 1 if self.mesh is None else self.mesh.shape[DATA] * self.experts

    @property
    def experts(self) -> int:
        """The expert axis's devices (1: the mesh has none)."""
        return 1 if self.mesh is None else self.mesh.shape.get(EXPERT, 1)

    def weight_spec(self, spec: tuple) -> tuple:
        """A weight's spec on this mesh: "expert" dropped when the mesh has no such axis."""
        return tuple(None if e == EXPERT and self.experts == 1 else e for e in spec)

    def check_tokens(self, ids, positions: int | None = None):
        """What a model's input needs, as a ValueError a caller can read, not shard_map's or NaN
        positions (jax's lookup past the table fills them): a (batch, seq) integer array whose
        rows split over "data" (and whose sequence over "model" with sequence parallelism), no
        longer than the model's `positions` (learned position embeddings have seq_len rows)."""
        check_context_mesh()
        if ids.ndim != 2 or not jnp.issubdtype(ids.dtype, jnp.integer):
            raise ValueError(
                f"token ids must be a (batch, seq) integer array, got {ids.dtype} "
                f"{tuple(ids.shape)}"
            )
        if DATA not in self.manual and ids.shape[0] % self.dp:
            raise ValueError(
                f"a batch of {ids.shape[0]} rows does not split over the data axis ({self.dp}): "
                f"give a multiple of {self.dp} rows (megajax.core.mesh.padded_rows pads one)"
            )
        if self.sequence_parallel and ids.shape[1] % self.tp:
            raise ValueError(
                f"a sequence of {ids.shape[1]} tokens does not split over the model axis "
                f"({self.tp}), which sequence parallelism splits it over"
            )
        if positions is not None and ids.shape[1] > positions:
            raise ValueError(
                f"a sequence of {ids.shape[1]} tokens is longer than the model's {positions} "
                "positions (model.seq_len)"
            )

    def sharding(self, spec) -> NamedSharding:
        return NamedSharding(self.mesh, self.spec(spec if isinstance(spec, P) else P(*spec)))

    @property
    def data_axes(self) -> str | tuple[str, ...]:
        """The manual axes a batch's rows are split over: "data", and "expert" beside it."""
        return (DATA, EXPERT) if EXPERT in self.manual else DATA

    def spec(self, spec: P) -> P:
        """An activation's (or, for a shard_map, a weight's) spec as this layout writes it:
        rows over "data" and "expert" when the mesh has both; without the axes that are manual
        already."""
        if DATA in self.manual:
            return without_axes(spec, self.manual - {PIPE})
        if self.experts > 1:
            return P(*((DATA, EXPERT) if e == DATA else e for e in spec))
        return spec

    def constrain(self, x, spec: P):
        """Pin an activation's layout so XLA cannot choose a costlier one."""
        if self.mesh is None:
            return x
        if self.manual:  # the context's mesh, where some axes are manual
            return jax.lax.with_sharding_constraint(x, self.spec(spec))
        return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, self.spec(spec)))

    def shard_map(self, fn, in_specs, out_specs, check_vma: bool = True):
        """`fn` manual over the model axis (and over "data" too, unless it already is).
        `check_vma` False: untyped inside the data-manual step (which is untyped itself), for a
        body that casts to varying over "model" wherever its gradient needs the sum."""

        def strip(specs):
            return jax.tree.map(self.spec, specs, is_leaf=lambda x: isinstance(x, P))

        if DATA in self.manual:
            return jax.shard_map(
                fn,
                in_specs=strip(in_specs),
                out_specs=strip(out_specs),
                axis_names={MODEL},
                check_vma=check_vma,
            )
        if PIPE in self.manual:
            axes = {DATA, MODEL} | ({EXPERT} if self.experts > 1 else set())
            return jax.shard_map(
                fn, in_specs=strip(in_specs), out_specs=strip(out_specs), axis_names=axes
            )
        return jax.shard_map(
            fn, mesh=self.mesh, in_specs=strip(in_specs), out_specs=strip(out_specs)
        )

    def global_sum(self, x):
        """A batch total (a loss's normaliser): local rows summed over "data" (and "expert")
        when it is manual."""
        return jax.lax.psum(x, self.data_axes) if DATA in self.manual else x

    def row_ids(self, n: int):
        """The global index of each of an array's n leading rows: the same row gets the same
        dropout mask whether it is computed whole or on a data shard."""
        rows = jnp.arange(n)
        return rows + jax.lax.axis_index(self.data_axes) * n if DATA in self.manual else rows

    def gather_weights(self, weights: dict):
        """FSDP, inside a layer: all-gather over "data" the layer weights split over it (a nested
        dict as `nnx.to_pure_dict` gives). The layer's remat policy (`drop_data_gathers`) drops
        the gathered copies, so the backward pass gathers them again; the transpose of each
        gather is its gradient's reduce-scatter."""
        dims = dict(self.fsdp_layer_dims)
        if not dims:
            return weights
        flat = traverse_util.flatten_dict(weights)
        for path, (dim, spec, over) in dims.items():
            flat[path] = gather_over_data(flat[path], dim, spec, over)
        return traverse_util.unflatten_dict(flat)

    def reduce_to_replicated(self, partial_sum):
        """Megatron's g: sum the row-parallel partial results over "model" (one all-reduce).

        The result is replicated over "model", so the transpose in the backward pass is the
        identity here and the matching all-reduce appears at the column-parallel input (f).
        """
        with jax.named_scope("g_all_reduce"):
            return self.constrain(partial_sum, ACT_REPLICATED)

    def take_rows(self, x, positions):
        """x (b, s, h) at `positions` (b, r) -> (b, r, h), replicated over "model".

        With sequence parallelism x is split along the sequence: each device picks the rows it
        holds and zeros the rest, and one all-reduce of b·r·h completes them (BERT reads the
        masked positions and [CLS], far fewer than the b·s·h an all-gather would move). The
        sum has one non-zero term, so it is exact in any dtype; the backward pass needs no
        collective, since each device's rows take their own share of the cotangent.
        """
        if not self.sequence_parallel:
            return jnp.take_along_axis(x, positions[..., None], axis=1)

        def local(x, positions):
            n = x.shape[1]
            offset = positions - jax.lax.axis_index(MODEL) * n
            picked = jnp.take_along_axis(x, jnp.clip(offset, 0, n - 1)[..., None], axis=1)
            mine = ((offset >= 0) & (offset < n))[..., None]
            with jax.named_scope("rows_all_reduce"):
                return jax.lax.psum(jnp.where(mine, picked, jnp.zeros_like(picked)), MODEL)

        return self.shard_map(local, (ACT_SEQUENCE, TOKENS), ACT_REPLICATED)(x, positions)


def drop_data_gathers(prim, *_, **params) -> bool:
    """A remat policy: save whatever autodiff would, but the results of all-gathers over "data"
    (FSDP's gathered weights; the policy also reaches into a shard_map's body), which the
    backward pass then gathers again. (`save_anything_except_these_names` on a named copy
    would save the gather's own output in its place.)"""
    if prim.name != "all_gather":
        return True
    axes = params.get("axis_name")
    return DATA not in (axes if isinstance(axes, (tuple, list)) else (axes,))


def gather_over_data(x, dim: int, spec: tuple, over=DATA):
    """FSDP's gather of a weight split over "data" along `dim`, inside the data-manual step; its
    transpose reduce-scatters the gradient back into the slices.

    A weight split over "model" too is gathered per model shard (under GSPMD a data-axis
    collective there would first gather its operand over "model"); a weight the model axis
    replicates is gathered directly (per model shard, the transpose would add a reduction
    over "model" that its gradient does not need). `over`: the axes it is split over ("data",
    or "data" and "expert" on an expert mesh for a weight that is not an expert's); `spec`
    names no manual axis."""

    def gather(x):
        with jax.named_scope("fsdp_all_gather"):
            return jax.lax.all_gather(x, over, axis=dim, tiled=True)

    if MODEL not in spec:
        return gather(x)
    return jax.shard_map(
        gather, in_specs=P(*spec), out_specs=P(*spec), axis_names={MODEL}, check_vma=False
    )(x)


def data_sharded_spec(
    shape, spec: P, mesh: MeshShape, skip_leading: bool = False, over=DATA
) -> P | None:
    """`spec` with `over` ("data", or "data" and "expert") added on the largest dimension it
    leaves whole and those axes of `mesh` divide (ties: the first), or None when there is none:
    ZeRO's split of optimizer state and FSDP's of parameters, on top of the model axis's (a
    model axis of size 1 leaves every dimension whole). `skip_leading`: never the stacked
    layers' axis (a layer would then live on one device, gathered whole each step)."""
    data_size = mesh.data * (mesh.expert if over != DATA else 1)
    model_size = mesh.model
    entries = list(spec) + [None] * (len(shape) - len(spec))
    whole = (None, MODEL) if model_size == 1 else (None,)
    free = [
        d
        for d in range(len(shape))
        if entries[d] in whole and shape[d] % data_size == 0 and not (skip_leading and d == 0)
    ]
    if data_size == 1 or not free:
        return None
    d = max(free, key=lambda i: (shape[i], -i))
    entries[d] = over
    return P(*entries)


def without_axes(spec, axes) -> P:
    """`spec` with the mesh axes `axes` taken out (for a shard_map inside one manual over
    them)."""

    def keep(e):
        if isinstance(e, tuple):
            kept = tuple(a for a in e if a not in axes)
            return kept if len(kept) > 1 else (kept[0] if kept else None)
        return None if e in axes else e

    return P(*(keep(e) for e in spec))


def rows_axes(mesh) -> str | tuple[str, ...]:
    """The mesh axes a batch's rows split over: "data", and "expert" where the mesh has it
    (for everything but the experts, one more data axis)."""
    return (DATA, EXPERT) if EXPERT in mesh.axis_names else DATA


def param_shardings(mesh: Mesh, specs):
    """NamedShardings for a pytree of PartitionSpecs (as given by `nnx.get_partition_spec`)."""
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))
