"""What a model's id arrays must hold. Out of range, jax's lookups do not fail: the
vocab-parallel embedding gives zeros for an id past the padded vocabulary, a position or
token-type table gives NaN rows. Checked where the ids are concrete (an eager call from
Python); inside a compiled step they are tracers, and the data pipelines check their ids."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def check_ids(what: str, ids, high: int, shape: tuple | None = None):
    """`ids` an integer array (of `shape`, when given) with every value in [0, high)."""
    if shape is not None and tuple(ids.shape) != tuple(shape):
        raise ValueError(
            f"{what} must have the token ids' shape {tuple(shape)}, got {tuple(ids.shape)}"
        )
    if not jnp.issubdtype(ids.dtype, jnp.integer):
        raise ValueError(f"{what} must be integers, got {ids.dtype}")
    if (
        isinstance(ids, jax.core.Tracer)
        or not getattr(ids, "is_fully_addressable", True)
        or not ids.size
    ):
        return
    # numpy's min and max: inside a trace (ids a constant in it) jnp's are traced
    host = np.asarray(ids)
    low, top = int(host.min()), int(host.max())
    if low < 0 or top >= high:
        raise ValueError(f"{what} must be in [0, {high}), got values from {low} to {top}")
