"""The suite's rule for tolerances: every bound follows from the precision of the path it
checks, never from what happened to pass on one machine.

Two results that are mathematically equal but computed in another order (another mesh,
another process layout, microbatches, another CPU's kernels, thread count or vector width)
differ by rounding alone. For a sum of K terms in any order, the error is at most
gamma_K ~ K * u times the sum of the terms' magnitudes (Higham, "Accuracy and Stability of
Numerical Algorithms", Thm 3.5), where u is the unit roundoff of the arithmetic:

- float32: u = 2^-24. The test models contract over at most 256 terms (their ffn width), so
  one matmul is within 2^8 u of its scale; chains of them add errors of that size in random
  directions, so F32 = 2^8 u (1.5e-5) relative to the scale of the compared array (its
  largest magnitude) bounds every float32 comparison across meshes.
- mixed precision (bfloat16 operands, float32 accumulation): a last-bit difference in a
  float32 partial sum can flip the bfloat16 rounding of a downstream operand, which moves
  it by one bfloat16 ulp = 2u with u = 2^-8. Element-wise, results agree within BF16_ELEMENT =
  4 u of the array's scale (an operand flip, doubled for the forward and backward matmul it
  feeds); in norm, within BF16_NORM = 1 u of the array's norm (flips are rare and of both
  signs). A wrong or missing collective changes results by O(1) of their scale and fails both.
- float16 activations (u = 2^-11): gradients through a float16 model against float32's, in
  norm, within a few dozen u (a few roundings per layer and pass, in random directions);
  stated where used (tests/test_loss_scale.py).
- Adam divides a gradient by its own running magnitude, so a gradient error delta on an
  entry of size |g| moves the update by ~delta / |g| of the learning rate, at most ~2 lr per
  step (a sign flip): `adam_tolerance` turns the gradient bound into a per-entry parameter
  bound instead of skipping small-gradient entries.
- Counts and integers (parameter counts, collective counts, token ids, masks, batches made by
  NumPy's and JAX's counter-based generators) are platform-independent: compared exactly.
- Statistics of random draws (masking rates, initialisation std): bounds of about 4 standard
  errors of the estimate, stated where used; the draws themselves are seeded.
- A discrete metric (an accuracy) computed from float32 scores may flip where two scores tie
  within rounding; such metrics may differ by one example.
"""

from __future__ import annotations

import jax
import numpy as np

F32_U = 2.0**-24
BF16_U = 2.0**-8
F16_U = 2.0**-11
F32 = 2**8 * F32_U  # ~1.5e-5
BF16_ELEMENT = 4 * BF16_U  # ~1.6e-2 of the array's scale
BF16_NORM = BF16_U  # ~3.9e-3 of the array's norm


def assert_close(got, want, tol: float = F32, scale: float | None = None, what: str = ""):
    """|got - want| <= tol * scale element-wise, scale defaulting to max |want|."""
    want = np.asarray(want, np.float64)
    got = np.asarray(got, np.float64)
    scale = float(np.abs(want).max()) if scale is None else scale
    np.testing.assert_allclose(got, want, rtol=0, atol=tol * scale, err_msg=what)


def assert_tree_close(want, got, tol: float = F32, what: str = "", norm_tol: float | None = None):
    """Every leaf within tol of its own scale. A leaf that is zero up to rounding (below tol
    of the whole tree's scale: a gradient that vanishes by symmetry, say) is rounding noise of
    the others, so it is held to the tree's scale instead of its own."""
    flat_want = jax.tree_util.tree_flatten_with_path(want)[0]
    flat_got = jax.tree.leaves(got)
    assert len(flat_want) == len(flat_got)
    tree_scale = max(float(np.abs(np.asarray(x)).max()) for _, x in flat_want)
    for (path, x), y in zip(flat_want, flat_got):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        scale = float(np.abs(x).max())
        if scale < tol * tree_scale:
            scale = tree_scale
        name = f"{what} {jax.tree_util.keystr(path)}"
        assert_close(y, x, tol, scale, name)
        if norm_tol is not None:
            assert np.linalg.norm(y - x) <= norm_tol * np.linalg.norm(x), name


def adam_tolerance(
    grad: np.ndarray, grad_scale: float, lr: float, steps: int, tol: float = F32
) -> np.ndarray:
    """Per-entry bound on parameters after `steps` Adam updates from gradients known within
    tol * grad_scale: each step moves an entry by lr * (relative error of its gradient), at
    most 2 lr. Entries with large gradients get tight bounds, vanishing ones lr-sized."""
    rel = tol * grad_scale / np.maximum(np.abs(np.asarray(grad, np.float64)), 1e-30)
    return steps * lr * np.minimum(2.0, rel)
