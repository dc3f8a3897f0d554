#!/usr/bin/env python
"""Train-step speed of the paper's GPT-2 (and, with --configs, BERT) configs on the GPUs of this machine.

    python bench/gpu_bench.py [--configs gpt2_355m,gpt2_1.2b,...] [--mesh model=8] [--batch 8] [--out bench_gpu.md]
    python bench/gpu_bench.py --configs bert_336m,bert_1.3b,bert_3.9b --batch 16

For each config that fits: step time, tokens/s, model TFLOP/s per device and MFU against the
GPU's dense bf16 peak (megajax.training.metrics.KNOWN_PEAK_TFLOPS, or --peak-tflops). Configs that do
not fit in memory are reported as such. Writes a Markdown table.
"""
import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def synthetic_batch(trainer, step: int):
    """Random ids in the task's batch layout (megajax/tasks/): the step's speed does not depend on the text."""
    import jax
    import numpy as np

    arrays = trainer.task.synthetic_batch(trainer.cfg, trainer.cfg.train.batch_size, np.random.default_rng(step))
    return jax.device_put(arrays, trainer.batch_sharding)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--configs", default="gpt2_355m,gpt2_1.2b,gpt2_2.5b,gpt2_4.2b,gpt2_8.3b")
    p.add_argument("--mesh", default=None, help="default: all GPUs on the model axis")
    p.add_argument("--batch", type=int, default=8, help="global batch (sequences of the config's length)")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--peak-tflops", type=float)
    p.add_argument("--out", default="bench_gpu.md")
    a = p.parse_args()
    import jax
    import numpy as np

    from megajax.config import load_config
    from megajax.core.mesh import make_mesh
    from megajax.tasks import param_count
    from megajax.training.metrics import device_peak_tflops, flops_per_token
    from megajax.training.step import make_trainer

    n = jax.device_count()
    mesh = make_mesh(a.mesh or f"model={n}")
    peak = a.peak_tflops or device_peak_tflops(measure_cpu=False)
    kind = jax.devices()[0].device_kind
    rows = ["| config | params | mesh | batch x seq | step (ms) | tokens/s | TFLOP/s/device | MFU |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name in a.configs.split(","):
        cfg = load_config(name, [f"train.batch_size={a.batch}", "train.microbatches=1"])
        try:
            tr = make_trainer(cfg, mesh)
            params, opt = tr.init_state()
            step = tr.jit_step()
            batches = [synthetic_batch(tr, i) for i in range(a.steps + 1)]
            params, opt, m = step(params, opt, batches[0], np.int32(0))
            jax.block_until_ready(m)
            t = time.perf_counter()
            for i in range(a.steps):
                params, opt, m = step(params, opt, batches[i + 1], np.int32(i + 1))
            jax.block_until_ready(m)
            dt = (time.perf_counter() - t) / a.steps
        except Exception as e:  # out of memory and the like: report and go on
            msg = str(e).splitlines()[0][:80]
            rows.append(f"| {name} | {param_count(cfg) / 1e9:.2f}B | {dict(mesh.shape)} | - | - | - | - | {msg} |")
            print(rows[-1], flush=True)
            continue
        tok = a.batch * tr.task.tokens_per_example(cfg)
        tflops = flops_per_token(cfg) * tok / dt / 1e12 / n
        mfu = f"{tflops / peak:.2f}" if peak else "n/a"
        rows.append(f"| {name} | {param_count(cfg) / 1e9:.2f}B | {dict(mesh.shape)} | {tok // cfg.model.seq_len}x{cfg.model.seq_len} "
                    f"| {dt * 1000:.0f} | {tok / dt:,.0f} | {tflops:.1f} | {mfu} |")
        print(rows[-1], flush=True)
        del params, opt
    text = f"GPU benchmark on {n} x {kind} (bf16 peak {peak} TFLOP/s per device)\n\n" + "\n".join(rows) + "\n"
    Path(a.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
