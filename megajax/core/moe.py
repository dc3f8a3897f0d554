"""The mixture-of-experts MLP: a router choosing k of E expert MLPs for each token, the tokens
dispatched to per-expert buffers, one batched matmul per weight for all experts, and the results
combined weighted by the router; shared experts always on beside them.

Megatron's layout carries over: each expert's first weights are split by columns over "model"
and its last by rows (expert tensor parallelism), the shared experts likewise, and the partial
sums of all of them meet in the layer's one all-reduce (`g_all_reduce`), after the combine: the
model axis sees exactly the dense MLP's collective. The router runs in float32, duplicated on
every device of "model" like a LayerNorm. Everything runs in one shard_map, so each data shard
dispatches its own rows: a row's tokens compete only with each other for an expert's capacity,
which makes the dropped assignments (with a capacity factor) the same on every mesh.

Dispatch: each row has a buffer of `capacity` slots per expert; assignments take slots in
order of their rank (every token's first choice before any second choice, then by position),
GShard's priority. Dropless (model.moe_capacity_factor = 0) the capacity is the row's length,
the most tokens one expert can be given, and nothing is ever dropped: the result is the dense
loop over each token's experts (the suite's oracle).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from megajax.core import sharding as S
from megajax.core.layers import param
from megajax.core.precision import Precision
from megajax.model_config import ModelConfig
from megajax.moe_config import capacity

FC1 = "expert_fc1"  # the experts' fc1 outputs (SwiGLU: gate and up), kept for the backward pass
# what each sparse layer reports, per row of the batch (summed over its tokens)
STAT_NAMES = ("assigned", "probs", "z", "tokens", "dropped", "routed")


def route(logits, k: int, router: str, norm_topk: bool, bias=None):
    """(scores (.., E), chosen experts (.., k), their weights (.., k)) of float32 router logits.
    Ties go to the lower expert index (jax.lax.top_k's order), so routing is deterministic.
    `bias` (E,): added to the scores for the choice only (DeepSeek-V3's balancing)."""
    scores = jax.nn.softmax(logits, axis=-1) if router == "softmax" else jax.nn.sigmoid(logits)
    choice = scores if bias is None else scores + jax.lax.stop_gradient(bias)
    _, experts = jax.lax.top_k(choice, k)
    weights = jnp.take_along_axis(scores, experts, axis=-1)
    if norm_topk:
        weights = weights / weights.sum(-1, keepdims=True)
    return scores, experts, weights


def slots(experts, num_experts: int):
    """Each assignment's slot in its expert's buffer of its row, (b, s, k): assignments ranked
    by their choice (all first choices, then all second ...) then by position."""
    b, s, k = experts.shape
    ranked = experts.transpose(0, 2, 1).reshape(b, k * s)
    onehot = jax.nn.one_hot(ranked, num_experts, dtype=jnp.int32)
    taken = ((jnp.cumsum(onehot, axis=1) - 1) * onehot).sum(-1)
    return taken.reshape(b, k, s).transpose(0, 2, 1)


def expert_matmul(x, w, precision: Precision):
    """(E, t, i) @ (E, i, o) for every expert at once, operands in the matmul dtype,
    accumulated in float32 where that is wider, the result in the compute dtype."""
    dt = precision.matmul
    y = jnp.einsum(
        "eti,eio->eto",
        x.astype(dt),
        w.astype(dt),
        preferred_element_type=jnp.float32 if dt != precision.compute else None,
    )
    return y.astype(precision.compute)


class MoEBlock(nnx.Module):
    """Router, experts and shared experts of one sparse layer (module docstring)."""

    def __init__(self, cfg: ModelConfig, *, layout: S.Layout, precision: Precision, rngs):
        self.layout, self.precision = layout, precision
        self.k, self.router_kind, self.norm_topk = (
            cfg.experts_per_token,
            cfg.moe_router,
            cfg.moe_norm_topk,
        )
        self.num_experts, self.capacity_factor = cfg.num_experts, cfg.moe_capacity_factor
        self.gated, self.approximate_gelu = cfg.mlp == "swiglu", cfg.gelu == "tanh"
        e, h, f = cfg.num_experts, cfg.hidden, cfg.moe_ffn
        std, out_std = cfg.init_std, cfg.init_std / math.sqrt(2 * cfg.num_layers)
        normal, zeros = nnx.initializers.normal, nnx.initializers.zeros
        self.router = param(normal(std), S.REPLICATED_2D, rngs.params(), (h, e))
        # not trained by the optimizer: the step moves it (training/step.py, balance_router)
        self.router_bias = (
            param(zeros, S.REPLICATED_BIAS, rngs.params(), (e,))
            if cfg.moe_bias_update_rate
            else None
        )
        ins = ("gate", "up") if self.gated else ("fc1",)
        spec = layout.weight_spec  # "expert" where the mesh has the axis
        for name in ins:
            w = param(normal(std), spec(S.EXPERT_IN), rngs.params(), (e, h, f))
            setattr(self, f"{name}_experts", w)
        self.fc2_experts = param(normal(out_std), spec(S.EXPERT_OUT), rngs.params(), (e, f, h))
        biased = cfg.bias == "all"
        for name in ins:
            bias = param(zeros, spec(S.EXPERT_IN_BIAS), rngs.params(), (e, f)) if biased else None
            setattr(self, f"{name}_bias", bias)
        self.fc2_bias = (
            param(zeros, spec(S.EXPERT_OUT_BIAS), rngs.params(), (e, h)) if biased else None
        )
        fs = cfg.moe_shared_ffn
        shared = (
            {n: param(normal(std), S.COLUMN, rngs.params(), (h, fs)) for n in ins} if fs else {}
        )
        if fs:
            shared["fc2"] = param(normal(out_std), S.ROW, rngs.params(), (fs, h))
        self.shared = nnx.Dict(shared) if fs else None
        self.shared_gate = (
            param(normal(std), S.REPLICATED_2D, rngs.params(), (h, 1))
            if cfg.moe_shared_gate
            else None
        )

    def activation(self, parts):
        """GeLU of fc1's output, or silu(gate) * up."""
        if self.gated:
            gate, up = parts
            return jax.nn.silu(gate) * up
        return jax.nn.gelu(parts[0], approximate=self.approximate_gelu)

    def weights(self) -> dict:
        """Every weight the block's shard_map reads, by name."""
        names = ("gate", "up") if self.gated else ("fc1",)
        w = {f"{n}_experts": getattr(self, f"{n}_experts")[...] for n in names}
        w["fc2_experts"], w["router"] = self.fc2_experts[...], self.router[...]
        if self.router_bias is not None:
            w["router_bias"] = self.router_bias[...]
        if self.fc2_bias is not None:
            w.update({f"{n}_bias": getattr(self, f"{n}_bias")[...] for n in names})
        if self.shared is not None:
            w["shared"] = {n: v[...] for n, v in self.shared.items()}
        if self.shared_gate is not None:
            w["shared_gate"] = self.shared_gate[...]
        return w

    def specs(self, w: dict) -> dict:
        spec = lambda s: S.P(*self.layout.weight_spec(s))  # noqa: E731
        specs = {n: spec(S.EXPERT_IN) for n in w if n.endswith("_experts")}
        specs["fc2_experts"], specs["router"] = spec(S.EXPERT_OUT), S.P(*S.REPLICATED_2D)
        if "router_bias" in w:
            specs["router_bias"] = S.P(None)
        specs.update(
            {n: spec(S.EXPERT_IN_BIAS) for n in w if n.endswith("_bias") and n != "router_bias"}
        )
        if "shared" in w:
            specs["shared"] = {n: S.P(*(S.ROW if n == "fc2" else S.COLUMN)) for n in w["shared"]}
        if "shared_gate" in w:
            specs["shared_gate"] = S.P(*S.REPLICATED_2D)
        return specs

    def __call__(self, x, norm=None, key=None, token_weights=None):
        """(output (b, s, h) replicated over "model", this layer's routing statistics): a dict
        of STAT_NAMES, each summed over a row's tokens ((b, E) or (b,)), `token_weights` (b, s)
        weighting the tokens that the loss covers (None: all)."""
        del key  # experts have no adapters; dropout is the layer's
        h = x if norm is None else norm(x)
        if token_weights is None:
            token_weights = jnp.ones(h.shape[:2], jnp.float32)
        w = self.weights()
        stat_specs = {n: S.P(S.DATA, None) for n in ("assigned", "probs")}
        stat_specs.update({n: S.BATCH for n in ("z", "tokens", "dropped", "routed")})
        between = self.layout.between_blocks
        # Untyped inside the expert-manual step (training/data_parallel.py): typed, the
        # all-to-alls over the manual "expert" would hand the untyped step around it an
        # activation typed as varying over "expert". `local` casts explicitly for that.
        out, stats = self.layout.shard_map(
            self.local,
            (between, self.specs(w), S.TOKENS),
            (between, stat_specs),
            check_vma=S.EXPERT not in self.layout.manual,
        )(h, w, token_weights.astype(jnp.float32))
        if self.fc2_bias is not None:  # after the all-reduce: once, not once per device
            out = out + self.bias_after(h, w["router"], w.get("router_bias"))
        return self.layout.constrain(out, between), stats

    def bias_after(self, h, router_w, router_bias=None):
        """Σ_k weight_k · fc2_bias[expert_k]: the experts' output biases, weighted as their
        outputs are (outside the shard_map, replicated)."""
        _, experts, weights = route(
            h.astype(jnp.float32) @ router_w, self.k, self.router_kind, self.norm_topk, router_bias
        )
        keep = self.kept(experts, h.shape[1])
        b = jnp.take(self.fc2_bias[...], experts, axis=0)  # (b, s, k, h)
        return jnp.einsum("bsk,bskh->bsh", weights * keep, b).astype(h.dtype)

    def capacity(self, seq: int) -> int:
        return capacity(seq, self.capacity_factor, self.k, self.num_experts)

    def kept(self, experts, seq: int):
        return (slots(experts, self.num_experts) < self.capacity(seq)).astype(jnp.float32)

    def local(self, x, w, token_weights):
        """One device's rows and share of every expert: route, dispatch, the experts, combine,
        and the one all-reduce over "model". With sequence parallelism x arrives split along
        the sequence: all-gathered first and reduce-scattered back (Megatron's f and g there),
        the router's statistics taken on this device's part of the sequence and summed."""
        sp = self.layout.sequence_parallel
        if sp:
            with jax.named_scope("f_all_gather"):
                x = jax.lax.all_gather(x, S.MODEL, axis=1, tiled=True)
        b, s, hidden = x.shape
        logits = x.astype(jnp.float32) @ w["router"]  # (b, s, E), the same on every device
        scores, experts, weights = route(
            logits, self.k, self.router_kind, self.norm_topk, w.get("router_bias")
        )
        cap = self.capacity(s)
        slot = slots(experts, self.num_experts)
        keep = slot < cap
        if sp:  # every device has the whole sequence's routing: each counts its own part
            part = lambda a: jax.lax.dynamic_slice_in_dim(  # noqa: E731
                a, jax.lax.axis_index(S.MODEL) * (s // self.layout.tp), s // self.layout.tp, 1
            )
            local = (logits, scores, experts, keep, token_weights)
            stats = self.statistics(*map(part, local))
            stats = jax.lax.psum(stats, S.MODEL)
            xv = x.astype(self.precision.compute)
        else:
            stats = self.statistics(logits, scores, experts, keep, token_weights)
            # x is the same on every device of "model", typed varying as the experts' products
            # are: its gradient is then the one all-reduce of Megatron's f (the router's stays
            # local)
            xv = self.varying(x, sp).astype(self.precision.compute)
        rows = jnp.arange(b)[:, None, None]
        buffer = jnp.zeros((self.num_experts, b, cap, hidden), xv.dtype)
        tokens = jnp.broadcast_to(xv[:, :, None, :], (b, s, self.k, hidden))
        buffer = buffer.at[experts, rows, slot].add(tokens, mode="drop")
        y = self.run_experts(buffer, w)
        picked = y[experts, rows, jnp.minimum(slot, cap - 1)]  # (b, s, k, h)
        # The routing weights are the same on every device of "model", the products they scale
        # partial sums: their gradient is summed over "model" (b·s·k numbers), by this cast's
        # transpose (written out, so that the body is right untyped too)
        gate = self.varying((weights * keep).astype(picked.dtype), sp)
        out = jnp.einsum("bsk,bskh->bsh", gate, picked)
        if "shared" in w:
            out = out + self.shared_experts(xv, x, w, sp)
        if sp:
            with jax.named_scope("g_reduce_scatter"):
                return jax.lax.psum_scatter(out, S.MODEL, scatter_dimension=1, tiled=True), stats
        with jax.named_scope("g_all_reduce"):
            if S.EXPERT in self.layout.manual:
                return summed_untyped(out, self.layout.tp), stats
            return jax.lax.psum(out, S.MODEL), stats

    def run_experts(self, buffer, w):
        """The experts on their buffers, (E, b, capacity, h) -> the same shape of partial sums
        over "model". With an expert axis each device holds E / experts of them: the buffers go
        to their experts' devices and the results come back by one all-to-all each way (their
        transposes, the backward pass's two)."""
        ep = self.layout.experts
        if ep > 1:
            with jax.named_scope("dispatch_all_to_all"):
                buffer = jax.lax.all_to_all(buffer, S.EXPERT, 0, 1, tiled=True)
        e, rows, cap, hidden = buffer.shape
        flat = buffer.reshape(e, rows * cap, hidden)
        # the backward pass keeps the buffers and fc1's outputs, and recomputes the activation
        # from them (element-wise): what a sparse layer keeps is then known on every backend
        # (analytic.sparse_mlp_bytes), and it is the least its matmuls need
        ffn = jax.checkpoint(
            self.experts_ffn, policy=jax.checkpoint_policies.save_only_these_names(FC1)
        )
        y = ffn(flat, w).reshape(e, rows, cap, hidden)
        if ep > 1:
            with jax.named_scope("combine_all_to_all"):
                y = jax.lax.all_to_all(y, S.EXPERT, 1, 0, tiled=True)
        return y

    def varying(self, x, sp: bool):
        """x, the same on every device of "model", as varying there: its gradient is summed over
        "model" by this cast's transpose. With sequence parallelism the layer's input arrives
        all-gathered, varying already. Untyped (inside the expert-manual step), shard_map's own
        transpose sums the gradient of every input "model" replicates, x's (Megatron's f) and
        the router's weights' (h·E numbers, in place of the routing weights' b·s·k), so nothing
        is cast."""
        if sp or S.EXPERT in self.layout.manual:
            return x
        return jax.lax.pcast(x, S.MODEL, to="varying")

    def experts_ffn(self, flat, w):
        """Every expert's MLP on its (E, slots, h) buffer rows."""
        names = ("gate", "up") if self.gated else ("fc1",)
        parts = [expert_matmul(flat, w[f"{n}_experts"], self.precision) for n in names]
        if f"{names[0]}_bias" in w:
            parts = [p + w[f"{n}_bias"][:, None, :].astype(p.dtype) for p, n in zip(parts, names)]
        parts = [checkpoint_name(p, FC1) for p in parts]
        return expert_matmul(self.activation(parts), w["fc2_experts"], self.precision)

    def shared_experts(self, xv, x, w, sp: bool):
        """The always-on experts' partial output on this device (column, then row-parallel), times
        Qwen2-MoE's sigmoid gate if any (the same on every device: its gradient, b·s numbers,
        summed over "model")."""
        sw = w["shared"]
        names = ("gate", "up") if self.gated else ("fc1",)
        parts = [xv @ sw[n].astype(xv.dtype) for n in names]
        out = self.activation(parts) @ sw["fc2"].astype(xv.dtype)
        if "shared_gate" in w:
            gate = jax.nn.sigmoid(x.astype(jnp.float32) @ w["shared_gate"])
            out = out * self.varying(gate, sp).astype(out.dtype)
        return out

    def statistics(self, logits, scores, experts, keep, token_weights) -> dict:
        """Per row: the weighted assignments and router probabilities per expert, the weighted
        z-loss terms and tokens (the loss's tokens only), and the dropped assignments (all)."""
        wt = token_weights[..., None]
        probs = scores / scores.sum(-1, keepdims=True)  # a sigmoid router's scores, normalised
        chosen = jax.nn.one_hot(experts, self.num_experts, dtype=jnp.float32).sum(2)
        return {
            "assigned": (jax.lax.stop_gradient(chosen) * wt).sum(1),
            "probs": (probs * wt).sum(1),
            "z": (jax.nn.logsumexp(logits, axis=-1) ** 2 * token_weights).sum(1),
            "tokens": token_weights.sum(1),
            "dropped": (~keep).sum((1, 2)).astype(jnp.float32),
            "routed": jnp.full(keep.shape[:1], keep.shape[1] * keep.shape[2], jnp.float32),
        }


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def summed_untyped(x, tp: int):
    """Megatron's g in an untyped shard_map: the partial sums all-reduced over "model", and in
    the backward pass no collective. Untyped, shard_map hands the output's cotangent divided by
    the model axis's size (an output "model" replicates), and psum's transpose would sum it
    back, an all-reduce of b·s·h for nothing: each partial's cotangent is the whole one,
    that cotangent times tp (a power of two: exact)."""
    return jax.lax.psum(x, S.MODEL)


def _summed_fwd(x, tp):
    return jax.lax.psum(x, S.MODEL), None


def _summed_bwd(tp, _, g):
    return (g * tp,)


summed_untyped.defvjp(_summed_fwd, _summed_bwd)


def router_losses(stats: dict, cfg: ModelConfig, global_sum=lambda x: x) -> dict:
    """The auxiliary losses of a model's sparse layers from their statistics (each (layers, b,
    ...)), summed over layers: Switch's load balance E·Σ_e f_e·P_e (f_e: the share of the
    covered tokens' assignments that chose e; P_e: their mean router probability for e) and the
    z-loss mean(logsumexp(logits)²), over the tokens the loss covers.

    The counts are the whole batch's on every mesh (`global_sum` adds the other data shards'
    where each device has its rows); the terms that carry a gradient are this device's rows'
    share of them, as the cross-entropy is, so that the shards' shares add up to the loss."""
    local = {n: v.sum(1) for n, v in stats.items()}  # (layers, ...)
    tokens = jnp.maximum(global_sum(local["tokens"]), 1.0)
    f = global_sum(local["assigned"]) / (tokens[:, None] * cfg.experts_per_token)
    p = local["probs"] / tokens[:, None]
    balance = cfg.num_experts * (f * p).sum(-1)
    z = local["z"] / tokens
    metrics = {
        "moe/aux_loss": balance.sum(),
        "moe/z_loss": z.sum(),
        # the share of all assignments (padding's too) that found no slot
        "moe/dropped": local["dropped"].sum() / jnp.maximum(global_sum(local["routed"].sum()), 1),
    }
    if cfg.moe_bias_update_rate:  # each sparse layer's assignments per expert: this shard's
        metrics[LOAD] = local["assigned"]
    return metrics


# The metric that carries each sparse layer's assignments per expert to the step (not logged)
LOAD = "moe/load"


EXPERT_WEIGHTS = {
    f"{n}_{kind}" for n in ("gate", "up", "fc1", "fc2") for kind in ("experts", "bias")
}


def is_expert_weight(path: tuple) -> bool:
    """Whether a params path is an expert's weight (split over "expert" where the mesh has it)."""
    return bool(path) and path[-1] in EXPERT_WEIGHTS


def is_matrix(path: tuple) -> bool:
    """Whether a params path is a sparse layer's matrix, which its backward pass reads (FSDP
    gathers it again): the router, the experts', the shared experts' and their gate."""
    return bool(path) and (
        path[-1] in ("router", "shared_gate")
        or path[-1].endswith("_experts")
        or (len(path) > 1 and path[-2] == "shared")
    )


def is_router_bias(path: tuple) -> bool:
    """Whether a params path is a router's balancing bias (moved by the step, not trained)."""
    return bool(path) and path[-1] == "router_bias"


def balanced(bias, load, rate: float):
    """DeepSeek-V3's update of a router's bias (layers, E) from the step's assignments per
    expert (layers, E): up by `rate` for an expert given fewer than the mean, down for one
    given more. Only the signs count, so the sum over microbatches and its mean agree."""
    mean = load.mean(-1, keepdims=True)
    return bias + rate * jnp.sign(mean - load).astype(bias.dtype)
