#!/usr/bin/env python
"""Train-step speed and MFU of a mid-size GPT on one device, against a measured matmul peak.

    python bench/step_mfu.py [--layers 8 --hidden 512 --heads 8 --seq 512 --batch 8]
    [--host-devices N --mesh SPEC]
                             [--dtypes float32,mixed] [--rounds 6] [--compile-layers 4,48]
                             [--profile DIR] [--dropout 0.1] [--remat none|selective|full]

Prints step time, tokens/s, model TFLOP/s per device and MFU = model FLOP/s / peak, where the
peak is the best rate of a large matmul of the same precision measured in the same run (float32;
for `mixed`, bfloat16 operands with float32 accumulation, as its matmuls run), plus where the
time goes (forward, forward+backward, optimizer) for the scanned and the unrolled layer stack,
and the step of the scanned weights run as one compiled program per layer (`train.layer_programs`),
each one's step against the unrolled one's, each timed alone, and again with the two
run in turn (`--rounds` each), and the MFU of the Llama shape of the same size (RMSNorm, rotary
positions, SwiGLU, a quarter of the key/value heads, untied) against the GPT shape's. In turn both
see the same minutes of a shared VM, but XLA:CPU's unrolled step runs slower when another program
runs between its steps (docs/performance.md: up to 1.2x), so that ratio flatters the scan. Last,
how long the train step takes to compile at two depths. With --profile DIR it also traces one
forward+backward call of each stack (jax.profiler, Perfetto JSON under DIR; on the CPU with
XLA's per-op trace events turned on) and prints the time by kind of op (megajax/tools/
profile.py, as train.py --profile does): where the scanned stack spends what the unrolled one
does not. Like train.py it restarts
itself once with megajax/host/env.py's glibc malloc settings; MEGAJAX_MALLOC_TUNING=0 measures
without them.
"""

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


STACKS = {
    "scanned": "scanned stack",
    "unrolled": "unrolled stack",
    "programs": "layer programs (train.layer_programs: the scanned weights, one program per layer)",
}


def timed(fn, *args, reps=3):
    import jax

    jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - t)
    return best


def alternating_ratio(scanned, unrolled, rounds: int) -> str:
    """The two steps run in turn, so that both see the same machine: on a shared VM the speed
    drifts by 10-25% between minutes, more than the difference being measured."""
    import statistics

    import jax

    times = {scanned: [], unrolled: []}
    for _ in range(rounds):
        for fn in (scanned, unrolled):
            t = time.perf_counter()
            jax.block_until_ready(fn())
            times[fn].append(time.perf_counter() - t)
    med = {fn: statistics.median(ts) for fn, ts in times.items()}
    return (
        f"{med[scanned] / med[unrolled]:.3f} (medians of {rounds} rounds, "
        f"{med[scanned] * 1000:.0f} / {med[unrolled] * 1000:.0f} ms; best "
        f"{min(times[scanned]) / min(times[unrolled]):.3f})"
    )


def matmul_peak(dtype: str) -> float:
    """The best TFLOP/s of n x n matmuls (n = 1024, 2048) in the precision `dtype` runs them."""
    import jax
    import jax.numpy as jnp

    from megajax.training.mfu import measure_matmul_tflops

    if dtype == "float32":
        return max(measure_matmul_tflops(2048, reps=5), measure_matmul_tflops(1024, reps=5))
    best = 0.0
    for n in (1024, 2048):
        a = jnp.ones((n, n), jnp.bfloat16)
        f = jax.jit(lambda x: jnp.matmul(x, x, preferred_element_type=jnp.float32))
        best = max(best, 2 * n**3 / timed(f, a, reps=5) / 1e12)
    return best


def profile(fn, args, trace_dir: str) -> str:
    """Trace one call of jitted `fn` and say where its time went by kind of op
    (megajax/tools/profile.py, as train.py --profile does)."""
    import jax

    from megajax.tools.profile import by_kind_line, newest, time_by_kind

    text = fn.lower(*args).compile().as_text()
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
        jax.block_until_ready(fn(*args))
    run = newest(trace_dir, "*.trace.json.gz").parent
    (run / "step.hlo.txt").write_text(text, encoding="utf-8")
    return by_kind_line(time_by_kind(run))


# The Llama shape of the same size: RMSNorm, rotary positions, SwiGLU (Llama's width rule),
# a quarter as many key/value heads as query heads, no biases, an untied output layer.
LLAMA = dict(norm="rmsnorm", positions="rope", mlp="swiglu", bias="none", tie_embeddings=False)


def model_config(
    a,
    layers: int,
    scan: bool,
    dtype: str,
    layer_programs: bool = False,
    llama: bool = False,
    moe: bool = False,
    capacity: float = 0.0,
):
    """The bench's GPT shape; `llama`: the Llama shape of the same size; `moe`: that with its
    MLP as 8 experts of half its width, top-2 (the same active FLOPs a token), dropless or with
    `capacity` as model.moe_capacity_factor."""
    from megajax.config import Config, ModelConfig, TrainConfig
    from megajax.model_config import swiglu_ffn

    arch = dict(LLAMA, num_kv_heads=max(a.heads // 4, 1)) if llama or moe else {}
    if moe:
        arch.update(
            num_experts=8,
            experts_per_token=2,
            moe_ffn_hidden=swiglu_ffn(a.hidden) // 2,
            moe_capacity_factor=capacity,
        )
    return Config(
        model=ModelConfig(
            num_layers=layers,
            hidden=a.hidden,
            num_heads=a.heads,
            seq_len=a.seq,
            vocab_size=256,
            vocab_multiple=256,
            hidden_dropout=a.dropout,
            attention_dropout=a.dropout,
            scan_layers=scan,
            compute_dtype=dtype,
            remat=a.remat,
            **arch,
        ),
        train=TrainConfig(batch_size=a.batch, steps=100, layer_programs=layer_programs),
    ).validate()


def architecture_rows(a, mesh, dtype: str, peak: float):
    """MFU of the GPT shape, of the Llama shape of the same size and of that shape as a mixture
    of 8 experts, top-2, with the same active FLOPs, dropless and with a capacity factor of 1
    (scanned stack; MFU on active FLOPs: dropless runs each expert on the row's length of slots,
    4 times the active FLOPs), each
    step timed alone and the GPT and Llama ones then run in turn (`--rounds`): SwiGLU,
    grouped-query attention and rotary positions should cost no more per model FLOP than GeLU,
    multi-head attention and a position table; routing and dispatch not much more."""
    import jax

    from megajax.training.mfu import flops_per_token
    from megajax.training.step import make_trainer

    runs = {}
    for name in ("GPT", "Llama", "MoE", "MoE c1"):
        moe = name.startswith("MoE")
        capacity = 1.0 if name == "MoE c1" else 0.0
        cfg = model_config(
            a, a.layers, True, dtype, llama=name == "Llama", moe=moe, capacity=capacity
        )
        tr = make_trainer(cfg, mesh)
        params, opt = tr.init_state()
        tokens = jax.device_put(
            jax.random.randint(jax.random.key(0), (a.batch, a.seq + 1), 0, 256), tr.batch_sharding
        )
        flops = flops_per_token(cfg) * a.batch * a.seq / mesh.devices.size
        step = stepper(tr, params, opt, tokens)
        runs[name] = (step, flops, timed(step, reps=a.reps))
        m = cfg.model
        experts = (
            f" x {m.num_experts} experts top-{m.experts_per_token}, "
            + (f"capacity {m.moe_capacity_factor:g}" if m.moe_capacity_factor else "dropless")
            if m.num_experts
            else ""
        )
        print(
            f"  {name:5s} {m.num_heads} heads / {m.kv_heads} kv, "
            f"ffn {m.moe_ffn if m.num_experts else m.ffn}{experts} ({m.mlp}), {m.norm}, "
            f"{m.positions}: step {runs[name][2] * 1000:.0f} ms, {flops_per_token(cfg) / 1e6:.0f} "
            f"MFLOP/token, MFU {flops / runs[name][2] / 1e12 / peak:.3f}"
        )
    (gpt, gpt_flops, gpt_t), (llama, llama_flops, llama_t) = runs["GPT"], runs["Llama"]
    print(
        f"  Llama / GPT MFU, each timed alone: {(llama_flops / llama_t) / (gpt_flops / gpt_t):.3f}"
    )
    ratios = [
        f"{label} {(runs[n][1] / runs[n][2]) / (llama_flops / llama_t):.3f}"
        for n, label in (("MoE", "dropless"), ("MoE c1", "capacity 1"))
    ]
    print(f"  MoE / Llama MFU (active FLOPs), each timed alone: {', '.join(ratios)}")
    if a.rounds:
        import statistics

        times = {gpt: [], llama: []}
        for _ in range(a.rounds):
            for fn in times:
                t = time.perf_counter()
                jax.block_until_ready(fn())
                times[fn].append(time.perf_counter() - t)
        ratio = (llama_flops / statistics.median(times[llama])) / (
            gpt_flops / statistics.median(times[gpt])
        )
        print(f"  Llama / GPT MFU, run in turn (medians of {a.rounds} rounds): {ratio:.3f}")


def stepper(tr, params, opt, tokens):
    """A no-argument call of one train step. The single program runs undonated on the same state
    each time; the layer programs donate theirs, so their state is carried from call to call."""
    import jax.numpy as jnp

    if not tr.cfg.train.layer_programs:
        step = tr.jit_step(donate=False)
        return lambda: step(params, opt, tokens, jnp.int32(1))
    step, state = tr.compiled_step(), [params, opt]

    def run():
        state[0], state[1], metrics = step(state[0], state[1], tokens, jnp.int32(1))
        return metrics

    return run


def compile_seconds(a, mesh, layers: int, scan: bool, dtype: str) -> float:
    from megajax.training.step import make_trainer

    lowered = make_trainer(model_config(a, layers, scan, dtype), mesh).lower_step()
    t = time.perf_counter()
    lowered.compile()
    return time.perf_counter() - t


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument(
        "--dropout", type=float, default=0.0, help="hidden and attention dropout (the paper's: 0.1)"
    )
    p.add_argument("--remat", default="none", choices=("none", "selective", "full"))
    p.add_argument("--mesh", default="1x1")
    p.add_argument("--host-devices", type=int)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument(
        "--rounds",
        type=int,
        default=6,
        help="rounds of the scanned and unrolled steps run in turn, for their ratio (0: skip)",
    )
    p.add_argument("--dtypes", default="float32,mixed", help="model.compute_dtype values to run")
    p.add_argument(
        "--compile-layers", default="4,48", help="depths whose train-step compile time is reported"
    )
    p.add_argument(
        "--profile",
        metavar="DIR",
        help="trace one forward+backward call per stack into DIR and print the time by kind of "
        "compiled op",
    )
    a = p.parse_args()
    if a.rounds < 0:
        p.error(f"--rounds must be 0 (skip) or more, got {a.rounds}")
    # as train.py does: restart once with glibc settings that keep each step's large blocks in the
    # heap instead of page-faulting them in afresh (megajax/host/env.py; MEGAJAX_MALLOC_TUNING=0:
    # off)
    from megajax.host.env import restart_with_malloc_tuning

    restart_with_malloc_tuning()
    flags = [os.environ.get("XLA_FLAGS", "")]
    if a.host_devices:
        flags.append(f"--xla_force_host_platform_device_count={a.host_devices}")
    if a.profile:
        flags.append("--xla_cpu_enable_xprof_traceme=true")  # XLA:CPU's per-op trace events
    os.environ["XLA_FLAGS"] = " ".join(f for f in flags if f)
    import jax

    from megajax.core.mesh import make_mesh
    from megajax.tasks import param_count
    from megajax.training.mfu import flops_per_token
    from megajax.training.step import make_trainer

    mesh = make_mesh(a.mesh, devices=jax.devices()[:1] if a.mesh == "1x1" else None)
    dtypes = a.dtypes.split(",")
    peaks = {d: matmul_peak(d) for d in dtypes}
    print(
        f"device: {jax.devices()[0].device_kind} x{mesh.devices.size}, mesh {dict(mesh.shape)}; "
        "measured matmul peak per device: "
        + ", ".join(f"{d} {p * 1000:.0f} GFLOP/s" for d, p in peaks.items())
        + f"; GLIBC_TUNABLES={os.environ.get('GLIBC_TUNABLES', '(none)')}"
    )
    steps, alone = {}, {}
    for dtype, stack in ((d, s) for d in dtypes for s in STACKS):
        peak = peaks[dtype]
        cfg = model_config(
            a, a.layers, stack != "unrolled", dtype, layer_programs=stack == "programs"
        )
        tr = make_trainer(cfg, mesh)
        params, opt = tr.init_state()
        tokens = jax.device_put(
            jax.random.randint(jax.random.key(0), (a.batch, a.seq + 1), 0, 256), tr.batch_sharding
        )
        key = jax.random.key(0) if a.dropout else None  # no key: no dropout
        tokens_per_step = a.batch * a.seq
        flops = flops_per_token(cfg) * tokens_per_step / mesh.devices.size
        print(
            "\n"
            f"{dtype}, {STACKS[stack]}: {a.layers} layers, hidden {a.hidden}, seq {a.seq}, batch "
            f"{a.batch}, {param_count(cfg) / 1e6:.1f}M params, {flops_per_token(cfg) / 1e6:.0f} "
            "MFLOP/token"
        )
        steps[dtype, stack] = stepper(tr, params, opt, tokens)
        t_step = alone[dtype, stack] = timed(steps[dtype, stack], reps=a.reps)
        print(
            f"  step {t_step * 1000:.0f} ms | {tokens_per_step / t_step:,.0f} tokens/s | "
            f"{flops / t_step / 1e12 * 1000:.0f} GFLOP/s per device | MFU "
            f"{flops / t_step / 1e12 / peak:.2f}"
        )
        # its forward and backward are the same layer programs, called in turn
        if stack == "programs":
            continue
        loss = jax.jit(lambda p, t: tr.loss_fn(p, t, key))
        grad = jax.jit(jax.grad(lambda p, t: tr.loss_fn(p, t, key)))
        g = grad(params, tokens)
        upd = jax.jit(lambda g, o, p: tr.tx.update(g, o, p))
        t_fwd, t_grad = (
            timed(loss, params, tokens, reps=a.reps),
            timed(grad, params, tokens, reps=a.reps),
        )
        t_opt = timed(upd, g, opt, params, reps=a.reps)
        print(
            f"  forward {t_fwd * 1000:.0f} ms, forward+backward {t_grad * 1000:.0f} ms "
            f"(backward/forward {(t_grad - t_fwd) / t_fwd:.2f}; ideal 2.0), optimizer "
            f"{t_opt * 1000:.0f} ms"
        )
        if a.profile:
            where = os.path.join(a.profile, f"{dtype}_{stack}")
            print(f"  forward+backward by op kind: {profile(grad, (params, tokens), where)}")
    print(f"\n{dtypes[0]}, scanned stack, architectures of one size:")
    architecture_rows(a, mesh, dtypes[0], peaks[dtypes[0]])
    for dtype in dtypes:
        for other in ("scanned", "programs"):
            print(
                "\n"
                f"{dtype}, {other} / unrolled train step, each timed alone: "
                f"{alone[dtype, other] / alone[dtype, 'unrolled']:.3f}"
            )
            if a.rounds:
                print(
                    "  run in turn: "
                    f"{alternating_ratio(steps[dtype, other], steps[dtype, 'unrolled'], a.rounds)}"
                )
    depths = [int(x) for x in a.compile_layers.split(",") if x]
    for scan in (True, False) if depths else ():
        times = [compile_seconds(a, mesh, n, scan, dtypes[0]) for n in depths]
        print(
            f"\ncompile, {'scanned' if scan else 'unrolled'} train step ({dtypes[0]}): "
            + ", ".join(f"{n} layers {t:.2f} s" for n, t in zip(depths, times))
            + (f" (ratio {times[-1] / times[0]:.2f})" if len(times) > 1 else "")
        )


if __name__ == "__main__":
    main()
