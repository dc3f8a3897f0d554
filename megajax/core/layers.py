"""Megatron's tensor-parallel building blocks as Flax NNX modules: the column-, row- and
vocab-parallel linear layers, with their LoRA adapters (lora.py). The norms are in norms.py, the
attention and MLP blocks built from these in attention.py and mlp.py, the layer in
transformer.py.

Each weight carries its PartitionSpec (from megajax/core/sharding.py) as NNX sharding metadata.
Inside a block, activations stay split over "model"; the single all-reduce per block is
`layout.reduce_to_replicated` in RowParallelLinear (g forward, f backward).
Norms, dropout and residual adds run duplicated on every device of the model axis.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from megajax.core import sharding as S
from megajax.core.lora import Adapter, low_rank, per_device
from megajax.core.loss import vocab_parallel_lookup
from megajax.core.ops import apply_dropout, keep_mask
from megajax.core.precision import Precision, logits_product, matmul


def param(init, spec, key, shape):
    """A float32 weight carrying its PartitionSpec as metadata. The sharding is applied by
    megajax itself (jit out_shardings when the model is built), not eagerly by Flax, which
    would need a global mesh."""
    return nnx.Param(
        nnx.with_partitioning(init, spec)(key, shape, jnp.float32), eager_sharding=False
    )


def dropout(x, rate: float, key, layout: S.Layout, spec):
    """Dropout whose mask depends only on the key and each element's global position: identical
    on every mesh, whether the rows are computed whole (GSPMD) or per data shard (the data-manual
    step of ZeRO / FSDP, where `layout.row_ids` offsets them)."""
    if key is None or rate == 0.0:
        return x
    return apply_dropout(
        x, layout.constrain(keep_mask(key, x.shape, rate, layout.row_ids(x.shape[0])), spec), rate
    )


class _Linear(nnx.Module):
    """W (d_in, d_out) and b (d_out,) split as the subclass's specs say, and the local x W.
    `use_bias` False: no b (Llama's layers).

    The three linear layers differ only in those specs and in what follows the local matmul:
    nothing (column), the all-reduce (row) or a replicated constraint."""

    KERNEL_SPEC: S.P
    BIAS_SPEC: S.P

    def __init__(
        self,
        d_in: int,
        d_out: int,
        *,
        layout: S.Layout,
        precision: Precision,
        std: float,
        rngs: nnx.Rngs,
        use_bias: bool = True,
        lora: Adapter | None = None,
    ):
        self.layout, self.precision = layout, precision
        self.kernel = param(
            nnx.initializers.normal(std), self.KERNEL_SPEC, rngs.params(), (d_in, d_out)
        )
        self.bias = (
            param(nnx.initializers.zeros, self.BIAS_SPEC, rngs.params(), (d_out,))
            if use_bias
            else None
        )
        self.lora = lora

    def weights(self):
        """(kernel, bias or None) as the matmul takes them."""
        return self.kernel[...], None if self.bias is None else self.bias[...]

    def adapter_weights(self):
        """LoRA's (A, B as the matmul takes it), or None without an adapter."""
        if self.lora is None:
            return None
        return self.lora.a_weight(), self.lora.b_of()

    def local_matmul(self, x, kernel=None):
        kernel = self.weights()[0] if kernel is None else kernel
        return matmul(
            x.astype(self.precision.compute),
            kernel,
            self.precision.matmul,
            self.precision.stacked_residuals,
        )

    def plus_bias(self, y, bias):
        return y if bias is None else y + bias.astype(self.precision.compute)


class ColumnParallelLinear(_Linear):
    """y = x W + b with W split by columns: each device computes out/tp features, no communication.
    With sequence parallelism x arrives split along the sequence and is all-gathered first
    (Megatron's f becomes an all-gather forward, a reduce-scatter backward)."""

    KERNEL_SPEC, BIAS_SPEC = S.COLUMN, S.COLUMN_BIAS

    def __init__(self, *args, regather: bool = True, **kwargs):
        super().__init__(*args, **kwargs)
        self.regather = regather  # False under full remat, which recomputes the gather anyway

    def __call__(self, x, key=None):
        kernel, bias = self.weights()
        adapter = self.adapter_weights()
        if self.layout.sequence_parallel or adapter is not None:
            y = self.manual_matmul(x, kernel, adapter, key)
        else:
            y = self.local_matmul(x, kernel)
        return self.layout.constrain(self.plus_bias(y, bias), S.ACT_COLUMN)

    def low_rank_of(self, x, a, b, keep):
        x = x if keep is None else apply_dropout(x, keep, self.lora.rate)
        return low_rank(x, per_device(a, self.layout), b, self.lora.scale, self.local_matmul)

    def manual_matmul(self, x, kernel, adapter=None, key=None):
        """The matmul in a shard_map: with sequence parallelism x arrives split along the sequence
        and is all-gathered first; an adapter reads the same input, its dropout mask drawn whole
        on each device (no second gather). Written out, an adapter's replicated A gets its
        partial gradients summed in the step's one reduction of A's gradient (over "data" and
        "model" at once) instead of an all-reduce of its own."""
        sp = self.layout.sequence_parallel

        def local(x, w, *adapter):
            # Without sequence parallelism x is the same on every device of "model", but typed
            # as varying there, as the product is: its gradient is then the one all-reduce of
            # Megatron's f, and an adapter's A gets its partial gradients summed together with
            # its data-axis reduction (not (x A)'s on their own, tokens x rank more numbers)
            x = _gather_sequence(x) if sp else jax.lax.pcast(x, S.MODEL, to="varying")
            x = x.astype(self.precision.compute)
            y = matmul(x, w, self.precision.matmul, self.precision.stacked_residuals)
            if not adapter:
                return y
            return y + self.low_rank_of(x, *adapter)

        # Checkpointed, as Megatron does: the backward pass keeps the (b, s/tp, h) shard and
        # all-gathers it again for the weight gradient, instead of keeping the whole sequence.
        # In a scanned stack; in unrolled layers XLA may merge the two gathers (jax 0.10's does),
        # which keeps the whole input as without the checkpoint.
        local = jax.checkpoint(local) if self.regather and sp else local
        specs = (self.layout.between_blocks, S.P(*S.COLUMN))
        if adapter is None:
            return self.layout.shard_map(local, specs, S.ACT_COLUMN)(x, kernel)
        keep = None
        if key is not None and self.lora.rate > 0:
            # x's global shape, each device drawing the whole mask of its rows
            keep = self.layout.constrain(
                keep_mask(key, x.shape, self.lora.rate, self.layout.row_ids(x.shape[0])),
                S.ACT_REPLICATED,
            )
        return self.layout.shard_map(
            local, (*specs, S.P(*S.REPLICATED_2D), S.P(*S.COLUMN), S.ACT_REPLICATED), S.ACT_COLUMN
        )(x, kernel, *adapter, keep)


class FusedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel weights from one input (SwiGLU's gate and up; grouped-query
    attention's queries and keys/values) as one matmul: each device's shards of them side by
    side, so the input is gathered once under sequence parallelism and its gradient is one
    partial sum. `parts`: (name, width, copies) each, a weight `{name}_kernel` (d_in, width)
    split by columns, or with copies > 1 replicated and each device taking its 1/copies of
    the model axis's share of it (grouped-query attention's key/value heads on a model axis
    larger than their count: every device holds the heads its queries read; the gradient sums
    over the copies). The output is (..., tp, sum of each device's widths)."""

    def __init__(
        self,
        d_in: int,
        parts,
        *,
        layout: S.Layout,
        precision: Precision,
        std: float,
        rngs: nnx.Rngs,
        use_bias: bool = True,
        regather: bool = True,
        lora: Adapter | None = None,
    ):
        self.layout, self.precision, self.regather = layout, precision, regather
        self.parts, self.lora = tuple(parts), lora
        for name, width, copies in self.parts:
            kernel_spec, bias_spec = (
                (S.REPLICATED_2D, S.REPLICATED_BIAS) if copies > 1 else (S.COLUMN, S.COLUMN_BIAS)
            )
            setattr(
                self,
                f"{name}_kernel",
                param(nnx.initializers.normal(std), kernel_spec, rngs.params(), (d_in, width)),
            )
            setattr(
                self,
                f"{name}_bias",
                param(nnx.initializers.zeros, bias_spec, rngs.params(), (width,))
                if use_bias
                else None,
            )

    def widths(self) -> list[int]:
        """Each part's columns on one device."""
        tp = self.layout.tp
        return [
            width // tp if copies == 1 else width * copies // tp for _, width, copies in self.parts
        ]

    def weights(self):
        kernels, biases = [], []
        for name, _, copies in self.parts:
            w, b = getattr(self, f"{name}_kernel")[...], getattr(self, f"{name}_bias")
            kernels.append(self._per_device(w, copies))
            biases.append(None if b is None else self._per_device(b[...], copies))
        # Each (.., tp, columns) piece is split over "model" on its tp axis: the concatenation
        # and the merge of (tp, columns) are local to each device.
        kernel = jnp.concatenate(kernels, axis=-1).reshape(kernels[0].shape[0], -1)
        bias = None if biases[0] is None else jnp.concatenate(biases, axis=-1).reshape(-1)
        kernel = self.layout.constrain(kernel, S.P(*S.COLUMN))
        return kernel, None if bias is None else self.layout.constrain(bias, S.P(*S.COLUMN_BIAS))

    def adapter_weights(self):
        """A, and the parts' B side by side per device as the kernels are (each part's B split
        or held in copies like its kernel)."""
        if self.lora is None:
            return None
        with jax.named_scope("lora_gradient"):  # a copied part's B: summed like the kernel's
            bs = [self._per_device(self.lora.b_of(name), copies) for name, _, copies in self.parts]
        b = jnp.concatenate(bs, axis=-1).reshape(self.lora.rank, -1)
        return self.lora.a_weight(), self.layout.constrain(b, S.P(*S.COLUMN))

    def _per_device(self, w, copies: int):
        """A weight's last axis as (tp, its columns on each device), split over "model" on tp:
        a split of its columns, or with `copies`, each of its width * copies / tp column groups
        repeated `copies` times (a broadcast: each device takes its slice of the replicated
        weight locally)."""
        lead, tp = w.shape[:-1], self.layout.tp
        if copies == 1:
            split = w.reshape(*lead, tp, -1)
        else:  # the scope names the backward pass's reduction of the copies, for the audit
            with jax.named_scope("kv_copies_gradient"):
                w = _gradient_replicated(w, self.layout)
                groups = w.reshape(*lead, tp // copies, 1, -1)
                split = jnp.broadcast_to(groups, (*lead, tp // copies, copies, groups.shape[-1]))
                split = split.reshape(*lead, tp, -1)
        return self.layout.constrain(split, S.P(*([None] * len(lead)), S.MODEL, None))

    def __call__(self, x, key=None):
        y = super().__call__(x, key)
        return self.layout.constrain(y.reshape(*y.shape[:-1], self.layout.tp, -1), S.ACT_HEADS)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _gradient_replicated(w, layout: S.Layout):
    """w, whose gradient is made whole on every device where it is computed: the copies' partial
    gradients summed over "model" in the layer's backward pass (XLA would otherwise keep them
    split until the update and gather the weight, its gradient and Adam's moments there)."""
    return w


def _gradient_replicated_fwd(w, layout):
    return w, None


def _gradient_replicated_bwd(layout, _, g):
    return (layout.constrain(g, S.P(*([None] * g.ndim))),)


_gradient_replicated.defvjp(_gradient_replicated_fwd, _gradient_replicated_bwd)


class RowParallelLinear(_Linear):
    """y = x W + b with W split by rows: partial sums all-reduced over "model", then the bias.
    With sequence parallelism they are reduce-scattered along the sequence instead (g becomes
    a reduce-scatter forward, an all-gather backward)."""

    KERNEL_SPEC, BIAS_SPEC = S.ROW, S.REPLICATED_BIAS

    def __call__(self, x, key=None):
        bias, adapter = self.weights()[1], self.adapter_weights()
        if adapter is not None:
            adapter = (*adapter, dropout(x, self.lora.rate, key, self.layout, S.ACT_COLUMN))
        if self.layout.sequence_parallel or adapter is not None:
            return self.plus_bias(self.manual_matmul(x, adapter), bias)
        return self.plus_bias(self.layout.reduce_to_replicated(self.local_matmul(x)), bias)

    def manual_matmul(self, x, adapter=None):
        """The matmul and its reduction in a shard_map: reduce-scattered along the sequence with
        sequence parallelism, else all-reduced. An adapter's partial product joins the layer's
        before that one reduction (left to XLA, (x A) would be all-reduced on its own)."""
        sp = self.layout.sequence_parallel

        def local(x, w, *adapter):
            y = matmul(
                x.astype(self.precision.compute),
                w,
                self.precision.matmul,
                self.precision.stacked_residuals,
            )
            if adapter:
                a, b, dropped = adapter
                y = y + low_rank(
                    dropped.astype(self.precision.compute),
                    a,
                    per_device(b, self.layout),
                    self.lora.scale,
                    self.local_matmul,
                )
            if not sp:
                with jax.named_scope("g_all_reduce"):
                    return jax.lax.psum(y, S.MODEL)
            with jax.named_scope("g_reduce_scatter"):
                return jax.lax.psum_scatter(y, S.MODEL, scatter_dimension=1, tiled=True)

        specs = (S.ACT_COLUMN, S.P(*S.ROW))
        out = self.layout.between_blocks
        if adapter is None:
            return self.layout.shard_map(local, specs, out)(x, self.kernel[...])
        return self.layout.shard_map(
            local, (*specs, S.P(*S.ROW), S.P(*S.REPLICATED_2D), S.ACT_COLUMN), out
        )(x, self.kernel[...], *adapter)


def _gather_sequence(x):
    """Inside a shard_map: (b, s/tp, h) -> (b, s, h), Megatron's f under sequence parallelism."""
    with jax.named_scope("f_all_gather"):
        return jax.lax.all_gather(x, S.MODEL, axis=1, tiled=True)


class ReplicatedLinear(_Linear):
    """y = x W + b with W whole on every device: for the small heads (BERT's MLM transform,
    pooler, classifiers), computed duplicated like LayerNorm, so they add no collective."""

    KERNEL_SPEC, BIAS_SPEC = S.REPLICATED_2D, S.REPLICATED_BIAS

    def __call__(self, x):
        y = self.plus_bias(self.local_matmul(x), self.weights()[1])
        return self.layout.constrain(y, S.P(S.DATA, *([None] * (y.ndim - 1))))


def _first_rows(init, drawn: int):
    """`init` for the first `drawn` rows, zeros after them."""

    def padded(key, shape, dtype=jnp.float32):
        x = init(key, (drawn, *shape[1:]), dtype)
        return jnp.pad(x, ((0, shape[0] - drawn),) + ((0, 0),) * (len(shape) - 1))

    return padded


class VocabParallelEmbedding(nnx.Module):
    """Token embedding split along the vocabulary; also the output layer (tied to the input
    embedding, or an untied one of the same shape and split)."""

    def __init__(
        self,
        rows: int,
        dim: int,
        *,
        layout: S.Layout,
        precision: Precision,
        std: float,
        rngs: nnx.Rngs,
        drawn: int | None = None,
    ):
        """`rows` of the table, the first `drawn` of them random (the rest, a model axis's extra
        padding, zeros: the same weights on every mesh; models/vocab_rows.py)."""
        self.layout, self.dtype = layout, precision.compute
        init = nnx.initializers.normal(std)
        if drawn is not None and drawn < rows:
            init = _first_rows(init, drawn)
        self.table = param(init, S.VOCAB, rngs.params(), (rows, dim))

    def __call__(self, ids):
        """Each device looks up the ids it owns (zeros elsewhere); one all-reduce sums them."""
        return vocab_parallel_lookup(self.table[...].astype(self.dtype), ids, self.layout)

    def attend(self, x, sequence_sharded: bool = False):
        """Vocab-parallel logits x E^T, float32, left split over "model" (never gathered).
        `sequence_sharded` x (b, s/tp, h) is all-gathered first, in the same shard_map, so the
        backward pass reduce-scatters x's gradient instead of all-reducing it."""
        if sequence_sharded:
            return self.gathered_attend(x)
        with jax.named_scope("logits"):
            logits = logits_product(x, self.table[...], self.dtype)
            return self.layout.constrain(logits, S.P(S.DATA, None, S.MODEL))

    def gathered_attend(self, x):
        def local(x, table):
            return logits_product(_gather_sequence(x), table, self.dtype)

        with jax.named_scope("logits"):
            return self.layout.shard_map(
                local, (S.ACT_SEQUENCE, S.P(*S.VOCAB)), S.P(S.DATA, None, S.MODEL)
            )(x, self.table[...])
