#!/usr/bin/env python
"""Train-step speed of the paper's GPT-2 (and, with --configs, BERT) configs on the GPUs of this
machine.

    python bench/gpu_bench.py [--configs gpt2_355m,gpt2_1.2b,...] [--mesh model=8] [--batch 8]
    [--out bench_gpu.md] python bench/gpu_bench.py --configs bert_336m,bert_1.3b,bert_3.9b --batch
    16 python bench/gpu_bench.py --configs gpt2_1.2b --batch 16 --set model.remat=none --json
    runs.jsonl --profile prof

For each config that fits: step time, tokens/s, model TFLOP/s per device and MFU against the
GPU's dense bf16 peak (the hardware table, megajax/hardware.py, or --peak-tflops). Configs that do
not fit in memory are reported as such. Writes a Markdown table; `--set` overrides every config,
`--json` appends each result as a line, `--profile` traces two steps (kernel times on the GPU's
streams, with the compiled program whose op names they carry).
"""

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def synthetic_batch(trainer, step: int):
    """Random ids in the task's batch layout (megajax/tasks/): the step's speed does not depend on
    the text."""
    import jax
    import numpy as np

    arrays = trainer.task.synthetic_batch(
        trainer.cfg, trainer.cfg.train.batch_size, np.random.default_rng(step)
    )
    return jax.device_put(arrays, trainer.batch_sharding)


def measure(
    cfg, mesh, steps: int, peak_tflops: float | None, compiled=None, profile_to=None
) -> dict:
    """One config's train step on `mesh`: compile (or take `compiled`, the trainer's
    `compiled_step()`), one warm-up step, then `steps` timed steps. Peak memory per
    device: the runtime's count where it keeps one (GPUs: the process's peak so far, so
    an earlier, larger step counts too), else XLA's plan (`planned_bytes`, this step's own)."""
    import jax
    import numpy as np

    from megajax.training.memory import step_memory
    from megajax.training.mfu import flops_per_token
    from megajax.training.step import make_trainer

    tr = make_trainer(cfg, mesh)
    # the donated step, compiled once (or the layer programs)
    step = compiled or tr.compiled_step()
    planned = step_memory(step).get("step_peak_bytes")
    params, opt = tr.init_state()
    batches = [synthetic_batch(tr, i) for i in range(steps + 1)]
    params, opt, m = step(params, opt, batches[0], np.int32(0))
    jax.block_until_ready(m)
    t = time.perf_counter()
    for i in range(steps):
        params, opt, m = step(params, opt, batches[i + 1], np.int32(i + 1))
    jax.block_until_ready(m)
    dt = (time.perf_counter() - t) / steps
    if profile_to:
        profile(step, params, opt, batches[0], Path(profile_to))
    stats = mesh.devices.flat[0].memory_stats() or {}
    tokens = cfg.train.batch_size * tr.task.tokens_per_example(cfg)
    tflops = flops_per_token(cfg) * tokens / dt / 1e12 / mesh.size
    return {
        "step_ms": dt * 1000,
        "tokens_per_s": tokens / dt,
        "tflops_per_device": tflops,
        "mfu": tflops / peak_tflops if peak_tflops else None,
        "loss": float(m["loss"]),
        "planned_bytes": planned,
        "peak_bytes": int(stats.get("peak_bytes_in_use") or planned or 0),
        "peak_source": "runtime" if stats.get("peak_bytes_in_use") else "compiled plan",
    }


def profile(step, params, opt, batch, path: Path):
    """A trace of two more steps (XLA's kernels on the GPU's streams, Perfetto's JSON) to
    PATH.trace.json.gz, and the compiled program, whose op names the kernels carry, to
    PATH.hlo.txt."""
    import glob
    import shutil
    import tempfile

    import jax
    import numpy as np

    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d, create_perfetto_trace=True):
            for i in range(2):
                params, opt, m = step(params, opt, batch, np.int32(100 + i))
            jax.block_until_ready(m)
        shutil.copy(
            max(glob.glob(d + "/**/*.trace.json.gz", recursive=True)), f"{path}.trace.json.gz"
        )
    if hasattr(step, "as_text"):  # one program (the layer programs are many)
        Path(f"{path}.hlo.txt").write_text(step.as_text())


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--configs", default="gpt2_355m,gpt2_1.2b,gpt2_2.5b,gpt2_4.2b,gpt2_8.3b")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="config override, for every config",
    )
    p.add_argument("--label", default="", help="names this run in --json's lines")
    p.add_argument("--json", help="append one JSON line per config to this file")
    p.add_argument(
        "--profile",
        help="trace two steps of each config to PROFILE-<config>.trace.json.gz (+ .hlo.txt)",
    )
    p.add_argument("--mesh", default=None, help="default: all GPUs on the model axis")
    p.add_argument(
        "--batch", type=int, default=8, help="global batch (sequences of the config's length)"
    )
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--peak-tflops", type=float)
    p.add_argument("--out", default="bench_gpu.md")
    a = p.parse_args()
    import jax

    from megajax.config import load_config
    from megajax.core.mesh import make_mesh
    from megajax.tasks import param_count
    from megajax.training.mfu import device_peak

    n = jax.device_count()
    mesh = make_mesh(a.mesh or f"model={n}")
    known = device_peak(measure_cpu=False)
    peak = a.peak_tflops or (known.tflops if known else None)
    kind = jax.devices()[0].device_kind
    rows = [
        "| config | params | mesh | batch x seq | step (ms) | tokens/s | TFLOP/s/device | MFU |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name in a.configs.split(","):
        cfg = load_config(name, [f"train.batch_size={a.batch}", "train.microbatches=1", *a.set])
        try:
            r = measure(cfg, mesh, a.steps, peak, profile_to=a.profile and f"{a.profile}-{name}")
        except Exception as e:  # out of memory and the like: report and go on
            msg = str(e).splitlines()[0][:80]
            rows.append(
                f"| {name} | {param_count(cfg) / 1e9:.2f}B | {dict(mesh.shape)} | - | - | - | - | "
                f"{msg} |"
            )
            print(rows[-1], flush=True)
            continue
        if a.json:
            with open(a.json, "a") as f:
                f.write(json.dumps({"label": a.label, "config": name, "set": a.set, **r}) + "\n")
        mfu = f"{r['mfu']:.2f}" if r["mfu"] is not None else "n/a"
        rows.append(
            f"| {name} | {param_count(cfg) / 1e9:.2f}B | {dict(mesh.shape)} | "
            f"{a.batch}x{cfg.model.seq_len} | {r['step_ms']:.0f} | {r['tokens_per_s']:,.0f} | "
            f"{r['tflops_per_device']:.1f} | {mfu} |"
        )
        print(rows[-1], flush=True)
    text = (
        f"GPU benchmark on {n} x {kind} (bf16 peak {peak} TFLOP/s per device)\n\n"
        + "\n".join(rows)
        + "\n"
    )
    Path(a.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
