"""The vocabulary's rows on a mesh and in a checkpoint.

The embedding (and an untied output layer, and BERT's MLM bias) has model.padded_vocab rows:
the vocabulary rounded up to model.vocab_multiple, whatever the mesh, so that a checkpoint is
the same on every mesh. A model axis that does not divide those rows (3, 5, 6, 7 with the
default 1024) holds a few more, zeros that are never a token (their logits are masked:
core/loss.mask_padded_vocab), as Megatron-LM pads for its tensor-parallel size: `ModelConfig.
vocab_rows`. Here the trees of weights and optimizer state move between the two: `for_mesh`
after a checkpoint is read, `for_checkpoint` before one is written. On a mesh that divides the
padded vocabulary both are the identity.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

# the leaves whose first dimension is the vocabulary (paths as jax.tree_util.keystr ends them)
VOCAB_LEAVES = ("['embed']['table']", "['output_layer']['table']", "['mlm_bias']")


def is_vocab_leaf(path) -> bool:
    name = jax.tree_util.keystr(path)
    return any(name.endswith(leaf) or name.endswith(leaf + ".value") for leaf in VOCAB_LEAVES)


def _resized(x, rows: int):
    if x.shape[0] >= rows:
        return x[:rows]
    return jnp.pad(x, ((0, rows - x.shape[0]),) + ((0, 0),) * (x.ndim - 1))


def checkpoint_target(abstract, padded_vocab: int):
    """An abstract tree (ShapeDtypeStructs with this mesh's shardings) as the checkpoint holds
    it: the vocabulary leaves with padded_vocab rows, read whole along the vocabulary (a model
    axis that does not divide the rows cannot split them)."""

    def leaf(path, x):
        if not is_vocab_leaf(path) or x.shape[0] == padded_vocab:
            return x
        spec = P(None, *x.sharding.spec[1:])
        return jax.ShapeDtypeStruct(
            (padded_vocab, *x.shape[1:]), x.dtype, sharding=NamedSharding(x.sharding.mesh, spec)
        )

    return jax.tree_util.tree_map_with_path(leaf, abstract)


def for_mesh(tree, abstract):
    """A tree read with `checkpoint_target(abstract, ...)`, its vocabulary leaves padded to the
    rows (and shardings) of `abstract`: the zeros padding is never a token."""
    if not _differs(tree, abstract):
        return tree
    return jax.jit(
        lambda t: jax.tree_util.tree_map_with_path(
            lambda p, x, a: _resized(x, a.shape[0]) if is_vocab_leaf(p) else x, t, abstract
        ),
        out_shardings=jax.tree.map(lambda a: a.sharding, abstract),
    )(tree)


def for_checkpoint(tree, padded_vocab: int):
    """A tree on the mesh as a checkpoint keeps it: the vocabulary leaves cut to padded_vocab
    rows (the rows past them are zeros this mesh added)."""
    if not _differs(tree, None, padded_vocab):
        return tree

    def sharding(p, x):
        if not is_vocab_leaf(p) or x.shape[0] == padded_vocab:
            return x.sharding
        return NamedSharding(x.sharding.mesh, P(None, *x.sharding.spec[1:]))

    return jax.jit(
        lambda t: jax.tree_util.tree_map_with_path(
            lambda p, x: _resized(x, padded_vocab) if is_vocab_leaf(p) else x, t
        ),
        out_shardings=jax.tree_util.tree_map_with_path(sharding, tree),
    )(tree)


def _differs(tree, abstract, padded_vocab: int | None = None) -> bool:
    """Whether a vocabulary leaf of `tree` has other rows than `abstract`'s (or padded_vocab)."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    wanted = jax.tree.leaves(abstract) if abstract is not None else [None] * len(leaves)
    return any(
        is_vocab_leaf(p) and x.shape[0] != (padded_vocab if a is None else a.shape[0])
        for (p, x), a in zip(leaves, wanted)
    )
