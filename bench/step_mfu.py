#!/usr/bin/env python
"""Train-step speed and MFU of a mid-size GPT on one device, against a measured matmul peak.

    python bench/step_mfu.py [--layers 8 --hidden 512 --heads 8 --seq 512 --batch 8] [--host-devices N --mesh SPEC]

Prints step time, tokens/s, model TFLOP/s per device and MFU = model FLOP/s / peak, where the
peak is the best rate of a large float32 matmul measured in the same run, plus where the time
goes (forward, forward+backward, optimizer) for the scanned and the unrolled layer stack.
"""
import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def timed(fn, *args, reps=3):
    import jax

    jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - t)
    return best


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--mesh", default="1x1")
    p.add_argument("--host-devices", type=int)
    p.add_argument("--reps", type=int, default=3)
    a = p.parse_args()
    if a.host_devices:
        os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={a.host_devices}"
    import jax
    import jax.numpy as jnp

    from megajax.config import Config, ModelConfig, TrainConfig
    from megajax.core.mesh import make_mesh
    from megajax.tasks import param_count
    from megajax.training.metrics import flops_per_token, measure_matmul_tflops
    from megajax.training.step import make_trainer

    peak = max(measure_matmul_tflops(2048, reps=5), measure_matmul_tflops(1024, reps=5))
    mesh = make_mesh(a.mesh, devices=jax.devices()[:1] if a.mesh == "1x1" else None)
    print(f"device: {jax.devices()[0].device_kind} x{mesh.devices.size}, mesh {dict(mesh.shape)}; "
          f"measured float32 matmul peak {peak * 1000:.0f} GFLOP/s per device")
    for scan in (True, False):
        cfg = Config(model=ModelConfig(num_layers=a.layers, hidden=a.hidden, num_heads=a.heads, seq_len=a.seq,
                                       vocab_size=256, vocab_multiple=256, hidden_dropout=0.0,
                                       attention_dropout=0.0, scan_layers=scan),
                     train=TrainConfig(batch_size=a.batch, steps=100))
        tr = make_trainer(cfg, mesh)
        params, opt = tr.init_state()
        tokens = jax.device_put(jax.random.randint(jax.random.key(0), (a.batch, a.seq + 1), 0, 256),
                                tr.batch_sharding)
        loss = jax.jit(lambda p, t: tr.loss_fn(p, t, None))
        grad = jax.jit(jax.grad(lambda p, t: tr.loss_fn(p, t, None)))
        g = grad(params, tokens)
        upd = jax.jit(lambda g, o, p: tr.tx.update(g, o, p))
        step = tr.jit_step(donate=False)
        t_fwd, t_grad = timed(loss, params, tokens, reps=a.reps), timed(grad, params, tokens, reps=a.reps)
        t_opt = timed(upd, g, opt, params, reps=a.reps)
        t_step = timed(lambda: step(params, opt, tokens, jnp.int32(1)), reps=a.reps)
        tokens_per_step = a.batch * a.seq
        flops = flops_per_token(cfg) * tokens_per_step / mesh.devices.size
        print(f"\n{'scanned' if scan else 'unrolled'} stack: {a.layers} layers, hidden {a.hidden}, seq {a.seq}, "
              f"batch {a.batch}, {param_count(cfg) / 1e6:.1f}M params, "
              f"{flops_per_token(cfg) / 1e6:.0f} MFLOP/token")
        print(f"  step {t_step * 1000:.0f} ms | {tokens_per_step / t_step:,.0f} tokens/s | "
              f"{flops / t_step / 1e12 * 1000:.0f} GFLOP/s per device | MFU {flops / t_step / 1e12 / peak:.2f}")
        print(f"  forward {t_fwd * 1000:.0f} ms, forward+backward {t_grad * 1000:.0f} ms "
              f"(backward/forward {(t_grad - t_fwd) / t_fwd:.2f}; ideal 2.0), optimizer {t_opt * 1000:.0f} ms")


if __name__ == "__main__":
    main()
