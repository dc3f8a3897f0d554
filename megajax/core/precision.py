"""The precision policy (which dtype for what) and the 2-D matmul every linear layer runs.

`model.compute_dtype = "mixed"` keeps activations, LayerNorm and the loss in float32 but feeds
the matmuls bfloat16 operands with float32 accumulation (what PyTorch's autocast does on CPU).
On XLA:CPU that is the path to the bfloat16 matrix units (AMX / AVX512-BF16): a bf16 x bf16 ->
f32 matmul runs ~2.7x faster than float32 on a Sapphire Rapids core.

XLA:CPU's fast library (YNNPACK) only takes row-major (m, k) x (k, n) matmuls. The backward
pass needs x^T g and g W^T; left to JAX's autodiff, XLA folds those transposes into the
matmul's dimension numbers, finds it cannot hand the result to the library, and silently runs
it in float32 (plus conversions). So the mixed matmul has its own VJP that keeps bfloat16
copies of x^T and W^T, made row-major in a way XLA cannot fold back (see `_row_major_t`).

A scanned stack that keeps its activations for the backward pass writes each saved one into a
(layers, ...) buffer, and XLA:CPU fuses a transpose into that write as a slow strided loop
(686 ms of a 4.1 s forward+backward, `bench/step_mfu.py --profile`). There the VJP keeps x
as it is and transposes the incoming gradient instead, dW = (g^T x)^T: the same FLOPs, a
gradient-sized transpose in the backward pass and a weight-sized one after it. It keeps x's
bfloat16 copy as uint16 bits (`_as_bits`: XLA:CPU would widen the bf16 write into the stacked
buffer to a float32 rewrite of the whole buffer, per layer). Either VJP keeps the weight
itself, not a bf16 W^T: a scanned stack's weight is the scan's own input, which JAX hands to
the backward pass as it is instead of stacking a copy per layer. A plain 16-bit matmul of a
float32 weight (`compute_dtype = "bfloat16"`, the GPU default) does the same: its cast is
checkpointed, so the backward pass casts the weight again instead of keeping its 16-bit copy.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Precision:
    """Parameters (and optimizer state, LayerNorm, the loss) stay `param`; activations run in
    `compute`; the linear layers' matmul operands are `matmul`, accumulating in float32 when
    that is lower than `compute`. Resolved once per model, handed to every module with the
    layout. Hashable, so Flax NNX keeps it as static module metadata."""

    param: jnp.dtype
    compute: jnp.dtype
    matmul: jnp.dtype
    stacked_residuals: bool = False  # a scanned stack that saves activations (no full remat)
    # model.recompute_norm_gelu: the backward pass recomputes LayerNorm's and GeLU's outputs
    # (element-wise, from arrays it keeps anyway: the block's input, fc1's output) instead of
    # keeping them. In a scanned stack each kept array is written into a (layers, ...) buffer,
    # zero-filled first and copied out again (on an H200, 54 of GPT-2 1.2B's 320 ms); this keeps
    # a third fewer bytes. Off by default until a GPU measures it: on the CPU the copies are
    # cheap and the recomputed tanh is not (float32 scanned step: 3.2-3.3 s against 3.15-3.2 s).
    # Only with plain matmuls: the mixed matmul's custom VJP would be recomputed, matmul and all.
    recompute_norm_gelu: bool = False

    @classmethod
    def of(cls, model_cfg, backend: str | None = None) -> "Precision":
        """From `model.compute_dtype`: auto is bfloat16 on GPU/TPU (float16 on a GPU whose tensor
        cores lack bfloat16, with loss scaling: training/loss_scale.py), float32 on the CPU; mixed
        is float32 activations with bfloat16 matmul operands."""
        name = model_cfg.compute_dtype
        if name == "auto":
            name = "bfloat16" if (backend or jax.default_backend()) in ("gpu", "tpu") else "float32"
            if backend is None and name == "bfloat16" and not _device_has_bfloat16():
                name = "float16"
        compute = jnp.dtype(jnp.float32 if name == "mixed" else name)
        matmul_dtype = jnp.dtype(jnp.bfloat16) if name == "mixed" else compute
        stacked = model_cfg.scan_layers and model_cfg.remat != "full"
        return cls(
            jnp.dtype(jnp.float32),
            compute,
            matmul_dtype,
            stacked,
            stacked and model_cfg.recompute_norm_gelu and matmul_dtype == compute,
        )

    @property
    def name(self) -> str:
        if self.matmul != self.compute:
            return "mixed (bf16 matmuls, f32 activations)"
        return (
            "float16 (dynamic loss scaling)" if self.compute == jnp.float16 else self.compute.name
        )


def _device_has_bfloat16() -> bool:
    """False on NVIDIA GPUs before compute capability 8.0 (V100, T4: the paper's GPUs, Colab's
    free one), whose tensor cores take float16 only: XLA would run bfloat16 matmuls in float32."""
    capability = getattr(jax.devices()[0], "compute_capability", None)
    try:
        return capability is None or float(capability) >= 8.0
    except (TypeError, ValueError):
        return True


def matmul(x, w, dtype, stacked_residuals: bool = False):
    """(..., i) @ (i, o) as one 2-D matmul over all leading rows.

    `dtype` is the operand dtype. Equal to x's dtype: a plain matmul in that dtype. Lower
    (bfloat16 for float32 x): bf16 operands, float32 accumulation, a result in x's dtype.
    The 2-D form also keeps the weight gradient a plain 2-D matmul, which XLA:CPU runs
    several times faster than a dot contracting over two dimensions. `stacked_residuals` picks
    the VJP that saves x untransposed (module docstring), on XLA:CPU only.
    """
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if jnp.dtype(dtype) == x.dtype:
        plain = lambda x2, w: jnp.dot(x2, w.astype(dtype))  # noqa: E731
        if w.dtype != dtype:
            # Checkpointed, the backward pass casts the float32 weight again instead of keeping
            # autodiff's 16-bit copy, which a scan would stack for every layer (GPT-2 1.2B in
            # bf16: 2.1 GiB, zero-filled, written and read back each step); a scan's weight is
            # its own input, which reaches the backward pass unstacked. The dot is not redone.
            plain = jax.checkpoint(plain, prevent_cse=False)
        y = plain(x2, w)
    else:
        keep_x = stacked_residuals and jax.default_backend() == "cpu"
        x2, w_alike = _vary_alike(x2, w)
        y = _mixed_matmul(x2, w_alike, jnp.dtype(dtype), w.dtype, keep_x)
    return y.reshape(*lead, w.shape[-1])


def _varying(a) -> frozenset:
    mat = getattr(jax.typeof(a), "mat", None)
    return frozenset(mat.varying) if mat is not None else frozenset()


def _vary_alike(x, w):
    """x and w over the same varying mesh axes. Inside shard_map (sequence parallelism) x varies
    over "data" and w does not: a plain dot broadcasts w implicitly and autodiff sums its
    gradient back over "data", but a custom VJP must return a gradient of w's own type, so the
    broadcast (and with it that sum) happens here, outside the VJP. Elsewhere a no-op."""
    vx, vw = _varying(x), _varying(w)
    if vx - vw:
        w = jax.lax.pcast(w, tuple(sorted(vx - vw)), to="varying")
    if vw - vx:
        x = jax.lax.pcast(x, tuple(sorted(vw - vx)), to="varying")
    return x, w


def _dot(a, b, out_dtype):
    return jnp.dot(a, b, preferred_element_type=out_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _mixed_matmul(x, w, dtype, w_dtype, keep_x):
    return _dot(x.astype(dtype), w.astype(dtype), x.dtype)


def _mixed_fwd(x, w, dtype, w_dtype, keep_x):
    x16 = x.astype(dtype)
    y = _dot(x16, w.astype(dtype), x.dtype)
    return y, (_as_bits(x16) if keep_x else _row_major_t(x16, dtype), w)


def _mixed_bwd(dtype, w_dtype, keep_x, residuals, g):
    """dx = g W^T and dW = x^T g, each a row-major bf16 matmul accumulating in float32. With
    `keep_x` (a scanned stack's saved x, untransposed) dW = (g^T x)^T instead; the barriers keep
    XLA from folding a transpose into that matmul's operands or result (XLA:CPU would then run
    it in float32, or not at all: its plain dot has no bf16 x bf16 -> f32)."""
    x_saved, w = residuals
    g16, w_t = g.astype(dtype), _row_major_t(w, dtype)
    if not keep_x:
        return _dot(g16, w_t, g.dtype), _dot(x_saved, g16, w_dtype)
    x_saved = _from_bits(x_saved, dtype)
    dw_t = _dot(_row_major_t(g16, dtype), row_major(x_saved), w_dtype)
    return _dot(g16, w_t, g.dtype), _row_major_t(jax.lax.optimization_barrier(dw_t), w_dtype)


_mixed_matmul.defvjp(_mixed_fwd, _mixed_bwd)


def _as_bits(a):
    """A 16-bit float residual as uint16 bits. XLA:CPU widens a bfloat16 dynamic-update-slice to
    float32 (its float normalization), and a scan that saves a bf16 residual per layer then
    rewrites its whole stacked (layers, ...) buffer at every layer instead of one slice: time
    quadratic in depth. The integer write stays an in-place slice."""
    return jax.lax.bitcast_convert_type(a, jnp.uint16)


def _from_bits(a, dtype):
    return jax.lax.bitcast_convert_type(a, dtype)


def row_major(a):
    """a as its own row-major array (see `_row_major_t`); XLA:CPU only."""
    if jax.default_backend() != "cpu":
        return a
    return jax.lax.optimization_barrier(jax.lax.reduce_max(a[None], (0,)))


def _row_major_t(a, dtype):
    """a^T in `dtype`, as its own row-major array that XLA will not fold into a dot.

    Only XLA:CPU needs this; elsewhere the plain transpose is best (GPU matmuls take
    transposed operands for free). On the CPU two things get in the way, each handled here:
    a transpose is born with a column-major layout (seen by the pass that decides which
    matmuls stay bfloat16), so it goes through a one-element reduction, which gets a fresh
    row-major layout; and XLA folds any transpose feeding a dot into the dot, which the
    optimization barrier prevents (XLA:CPU removes barriers only after that folding).
    """
    return row_major(a.T.astype(dtype))


def logits_product(x, table, dtype):
    """x E^T, (b, s, h) x (v, h) -> float32 (b, s, v) logits, with `dtype` operands and the
    logits' gradient taken in `dtype` (`low_precision_product`): left to autodiff, at GPT-2
    1.2B's shapes its two backward matmuls ran as float32 (tf32) GEMMs, 17.8 ms of a 352 ms H200
    step against ~6.5 ms in bfloat16."""
    x, table = _vary_alike(x, table)
    return low_precision_product("bsh,vh->bsv", x, table, jnp.dtype(dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 3))
def low_precision_product(spec: str, a, b, dtype):
    """einsum(spec, a, b) on `dtype` operands into a float32 result, whose backward pass takes the
    cotangent in `dtype` too, as Megatron-LM's half-precision logits and attention scores have
    it: autodiff would run both backward products on float32 operands (off a GPU's bf16 matrix
    units, twice the bytes). Each gradient accumulates in float32, then takes its operand's
    dtype. In float32 it is autodiff's. `spec` names every index of the result in one operand
    or the other, so the gradients are einsums of the same indices."""
    return jnp.einsum(spec, a.astype(dtype), b.astype(dtype), preferred_element_type=jnp.float32)


def _low_precision_fwd(spec, a, b, dtype):
    return low_precision_product(spec, a, b, dtype), (a, b)


def _low_precision_bwd(spec, dtype, residuals, g):
    a, b = residuals
    (a_idx, b_idx), out_idx = spec.split("->")[0].split(","), spec.split("->")[1]
    g, a16, b16 = (t.astype(dtype) for t in (g, a, b))
    da = jnp.einsum(f"{out_idx},{b_idx}->{a_idx}", g, b16, preferred_element_type=jnp.float32)
    db = jnp.einsum(f"{out_idx},{a_idx}->{b_idx}", g, a16, preferred_element_type=jnp.float32)
    return da.astype(a.dtype), db.astype(b.dtype)


low_precision_product.defvjp(_low_precision_fwd, _low_precision_bwd)
