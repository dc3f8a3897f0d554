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
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

DATA, MODEL = "data", "model"             # the mesh axes: every other module imports these names
AXES = (DATA, MODEL)

# Parameter specs as tuples, the form Flax NNX stores in a Variable's sharding metadata.
COLUMN = (None, MODEL)
COLUMN_BIAS = (MODEL,)
ROW = (MODEL, None)
REPLICATED_BIAS = (None,)
VOCAB = (MODEL, None)
VOCAB_BIAS = (MODEL,)                      # BERT's MLM output bias, split like the logits
REPLICATED_2D = (None, None)

# Activation specs.
ACT_REPLICATED = P(DATA, None, None)       # (batch, seq, hidden) between blocks
ACT_SEQUENCE = P(DATA, MODEL, None)        # (batch, seq/tp, hidden) between blocks, sequence parallel
ACT_COLUMN = P(DATA, None, MODEL)          # (batch, seq, features/tp) after a column-parallel matmul
ACT_HEADS = P(DATA, None, MODEL, None)     # (batch, seq, heads/tp, head_dim)
ATTN_SCORES = P(DATA, MODEL, None, None)   # (batch, heads/tp, q, k)
TOKENS = P(DATA, None)                     # (batch, seq) token ids, per-token losses
BATCH = P(DATA)                            # any batch array: rows over "data", the rest whole
KV_CACHE = P(DATA, MODEL, None, None)      # (batch, heads/tp, max_len, head_dim): split like the heads


@dataclasses.dataclass(frozen=True)
class Layout:
    """The mesh a model runs on. Hashable, so Flax NNX keeps it as static module metadata."""

    mesh: Mesh | None = None
    sequence_parallel: bool = False

    @property
    def between_blocks(self) -> P:
        """The activations' spec between blocks (LayerNorm, dropout, residuals run on it)."""
        return ACT_SEQUENCE if self.sequence_parallel else ACT_REPLICATED

    @property
    def tp(self) -> int:
        return 1 if self.mesh is None else self.mesh.shape[MODEL]

    @property
    def dp(self) -> int:
        return 1 if self.mesh is None else self.mesh.shape[DATA]

    def sharding(self, spec) -> NamedSharding:
        return NamedSharding(self.mesh, spec if isinstance(spec, P) else P(*spec))

    def constrain(self, x, spec: P):
        """Pin an activation's layout so XLA cannot choose a costlier one."""
        if self.mesh is None:
            return x
        return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, spec))

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
        return jax.shard_map(local, mesh=self.mesh, in_specs=(ACT_SEQUENCE, TOKENS), out_specs=ACT_REPLICATED)(
            x, positions)


def param_shardings(mesh: Mesh, specs):
    """NamedShardings for a pytree of PartitionSpecs (as given by `nnx.get_partition_spec`)."""
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                        is_leaf=lambda x: isinstance(x, P))
