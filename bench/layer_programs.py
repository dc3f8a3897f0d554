#!/usr/bin/env python
"""The layer stack's forward and backward three ways, to measure what the scan's stacked
activations cost and whether one compiled program per layer avoids it.

    python bench/layer_programs.py [--config NAME] [--set KEY=VALUE ...] [--batch B]
                                   [--ways scan,unrolled,per_layer] [--reps 5]

  scan       jax.lax.scan over the stacked weights (model.scan_layers = true): one compiled
             layer, but the activations the backward pass needs are stacked over layers:
             zero-filled, written in and copied out again (docs/performance.md);
  unrolled   the layers inlined into one program (model.scan_layers = false): no copies, but
             the compile time grows with the depth;
  per_layer  a Python loop over two compiled programs, a layer's forward (which returns
             jax.vjp's pullback: its leaves are that layer's saved activations, separate buffers)
             and its backward (which writes the layer's weight gradients into the stacked
             gradients in place). One layer compiled, as with the scan, and nothing stacked.

Each way computes the same thing: the stack's output and, for a fixed output cotangent, the
gradients of its stacked weights and of its input, from the same weights (the scanned model's),
under the config's remat, dropout and precision. It prints each way's best and median time,
and how far each way's gradients are from the scan's. Without --config: bench/step_mfu.py's
mid-size model (8 layers, hidden 512, seq 512, batch 8), float32, one device.
"""

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

MID_SIZE = [
    "model.num_layers=8",
    "model.hidden=512",
    "model.num_heads=8",
    "model.seq_len=512",
    "model.vocab_size=256",
    "model.vocab_multiple=256",
    "model.hidden_dropout=0",
    "model.attention_dropout=0",
    "model.remat=none",
    "train.batch_size=8",
]
WAYS = ("scan", "unrolled", "per_layer")


def stack_gradients(cfg, mesh) -> tuple[dict, object]:
    """({way: fn(state, x, keys, ct) -> (grads of the stacked weights, grad of x)}, the stacked
    layers' state). `keys` are the layers' dropout keys (None: no dropout)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from megajax.core import sharding as S
    from megajax.core.precision import Precision
    from megajax.core.stack import LayerStack
    from megajax.core.transformer import TransformerLayer

    m = cfg.model
    layout = S.Layout.for_model(mesh, m)
    scan_cfg, loop_cfg = (dataclasses.replace(m, scan_layers=scan) for scan in (True, False))
    stack = LayerStack(scan_cfg, layout, Precision.of(scan_cfg), nnx.Rngs(params=0))
    _, state = nnx.split(stack.stacked)

    def layer_fn(model_cfg):
        """One layer as the model builds it for this kind of stack (Precision.of differs: a
        scanned layer saves some activations in the form a stacked buffer takes best)."""
        precision = Precision.of(model_cfg)
        graph = nnx.split(
            nnx.eval_shape(
                lambda: TransformerLayer(
                    model_cfg, layout=layout, precision=precision, rngs=nnx.Rngs(params=0)
                )
            )
        )[0]

        def layer(p, h, k):
            return nnx.merge(graph, p)(h, key=k)

        return jax.checkpoint(layer) if m.remat == "full" else layer

    scan_layer, layer = layer_fn(scan_cfg), layer_fn(loop_cfg)
    take = lambda tree, i: jax.tree.map(
        lambda a: jax.lax.dynamic_index_in_dim(a, i, keepdims=False), tree
    )  # noqa: E731
    key_at = lambda keys, i: None if keys is None else keys[i]  # noqa: E731

    def scanned(s, x, keys):
        def body(h, xs):
            p, k = xs
            return scan_layer(p, h, k), None

        return jax.lax.scan(body, x, (s, keys))[0]

    def unrolled(s, x, keys):
        for i in range(m.num_layers):
            x = layer(take(s, i), x, key_at(keys, i))
        return x

    def whole_program(stack):
        def grads(s, x, keys, ct):
            return jax.vjp(lambda s, x: stack(s, x, keys), s, x)[1](ct)

        return jax.jit(grads)

    @jax.jit
    def forward(s, i, h, keys):
        return jax.vjp(lambda p, h: layer(p, h, key_at(keys, i)), take(s, i), h)

    def backward(pullback, grads, i, g):
        dp, dh = pullback(g)
        return jax.tree.map(
            lambda a, d: jax.lax.dynamic_update_index_in_dim(a, d, i, 0), grads, dp
        ), dh

    backward = jax.jit(backward, donate_argnums=(1,))
    zeros = jax.jit(lambda s: jax.tree.map(jnp.zeros_like, s))

    def per_layer(s, x, keys, ct):
        pullbacks = []
        for i in range(m.num_layers):
            x, pullback = forward(s, i, x, keys)
            pullbacks.append(pullback)
        grads, g = zeros(s), ct
        for i in reversed(range(m.num_layers)):
            # each layer's activations freed as it goes
            grads, g = backward(pullbacks.pop(), grads, i, g)
        return grads, g

    return {
        "scan": whole_program(scanned),
        "unrolled": whole_program(unrolled),
        "per_layer": per_layer,
    }, state


def inputs(cfg, seed: int = 0):
    """The stack's input, an output cotangent and the layers' dropout keys (None without
    dropout)."""
    import jax

    from megajax.core.precision import Precision

    m = cfg.model
    shape = (cfg.train.batch_size, m.seq_len, m.hidden)
    dtype = Precision.of(m).compute
    kx, kc, kd = jax.random.split(jax.random.key(seed), 3)
    dropout = m.hidden_dropout > 0 or m.attention_dropout > 0
    return (
        jax.random.normal(kx, shape, dtype),
        jax.random.normal(kc, shape, dtype),
        jax.random.split(kd, m.num_layers) if dropout else None,
    )


def max_rel_diff(got, want) -> float:
    """The largest |got - want| of any leaf, relative to that leaf's largest |want|."""
    import jax
    import numpy as np

    got, want = (jax.tree.leaves(jax.device_get(t)) for t in (got, want))
    return max(
        float(np.abs(np.float64(a) - np.float64(b)).max() / max(np.abs(np.float64(b)).max(), 1e-30))
        for a, b in zip(got, want)
    )


def time_ways(fns: dict, args, ways, reps: int) -> dict:
    """{way: (best s, median s)}, the ways run in turn `reps` times after one warm-up call each,
    so that all see the same minutes of a shared machine."""
    import jax

    times = {w: [] for w in ways}
    for w in ways:
        jax.block_until_ready(fns[w](*args))
    for _ in range(reps):
        for w in ways:
            t = time.perf_counter()
            jax.block_until_ready(fns[w](*args))
            times[w].append(time.perf_counter() - t)
    return {w: (min(ts), statistics.median(ts)) for w, ts in times.items()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", help="a config name or path (default: step_mfu's mid-size model)")
    p.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="config overrides"
    )
    p.add_argument("--batch", type=int, help="train.batch_size (the stack's batch)")
    p.add_argument("--ways", default=",".join(WAYS))
    p.add_argument("--reps", type=int, default=5)
    a = p.parse_args()
    ways = [w for w in a.ways.split(",") if w]
    if unknown := [w for w in ways if w not in WAYS]:
        p.error(f"unknown way {unknown[0]!r}: choose from {', '.join(WAYS)}")
    from megajax.host.env import restart_with_malloc_tuning

    restart_with_malloc_tuning()  # as train.py does (docs/performance.md: the glibc settings)
    import jax

    from megajax.config import load_config
    from megajax.core.mesh import make_mesh

    overrides = (
        ([] if a.config else MID_SIZE)
        + a.set
        + ([f"train.batch_size={a.batch}"] if a.batch else [])
    )
    cfg = load_config(a.config or "default", overrides)
    mesh = make_mesh("model=1", devices=jax.devices()[:1])
    fns, state = stack_gradients(cfg, mesh)
    x, ct, keys = inputs(cfg)
    args = (state, x, keys, ct)
    m = cfg.model
    print(
        f"{jax.devices()[0].device_kind}: {m.num_layers} layers, hidden {m.hidden}, seq "
        f"{m.seq_len}, batch {cfg.train.batch_size}, {m.compute_dtype}, remat {m.remat}, attention "
        f"{m.attention}"
    )
    reference = fns["scan"](*args) if "scan" in ways else None
    for w in ways:
        if w != "scan" and reference is not None:
            print(
                f"  {w}: gradients {max_rel_diff(fns[w](*args), reference):.1e} from the scan's "
                "(relative to scale)"
            )
    for w, (best, median) in time_ways(fns, args, ways, a.reps).items():
        print(
            f"  {w:9s} forward+backward: best {best * 1000:.1f} ms, median {median * 1000:.1f} ms"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
