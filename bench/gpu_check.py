#!/usr/bin/env python
"""The one-command GPU check: how fast the paper's one-GPU shapes train on this machine.

    python bench/gpu_check.py [--out DIR]      # a machine with NVIDIA GPUs and a CUDA-enabled jax
    python bench/gpu_check.py --smoke          # the same path on the CPU with tiny shapes, in seconds

It installs nothing and reaches no network. It prints the device, then for the paper's GPT-2
355M and 1.2B shapes (bfloat16, one GPU) picks the first (remat, batch) that the compiled step's
memory plan fits in the GPU's memory, measures step time, tokens/s, model TFLOP/s, MFU against
the GPU's dense bf16 peak and peak memory, and writes DIR/gpu_check.json and DIR/gpu_check.md
(bench/gpu_bench.py's `measure` does the timing). Under 8 minutes on one H100/H200.
"""
import argparse
import json
import platform
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

# (config, [(remat, global batch), ...] fastest first): the first whose step fits is measured.
PLANS = [("gpt2_355m", [("none", 8), ("selective", 8), ("full", 8), ("full", 4)]),
         ("gpt2_1.2b", [("selective", 8), ("full", 8), ("full", 4), ("full", 2)])]
# --smoke: the same configs shrunk until a CPU runs them in seconds.
SMOKE = ["model.num_layers=2", "model.hidden=128", "model.num_heads=4", "model.seq_len=64",
         "model.vocab_size=512", "model.vocab_multiple=128"]
FITS_FRACTION = 0.9   # of a device's memory: headroom for the runtime's own buffers


def pick(name: str, options, mesh, smoke: bool):
    """(config, its compiled step) of the first option whose step fits, or (None, why)."""
    from megajax.config import load_config
    from megajax.training.memory import device_memory_bytes, step_memory
    from megajax.training.step import make_trainer

    limit = device_memory_bytes()
    why = "no option"
    for remat, batch in options:
        cfg = load_config(name, [f"train.batch_size={batch}", "train.microbatches=1", f"model.remat={remat}",
                                 *(SMOKE if smoke else [])])
        compiled = make_trainer(cfg, mesh).lower_step().compile()
        peak = step_memory(compiled).get("step_peak_bytes")
        if peak is None or limit is None or peak <= FITS_FRACTION * limit:
            return cfg, compiled
        why = f"needs {peak / 2**30:.1f} GiB with remat {remat}, batch {batch}"
    return None, why


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=".", help="directory for gpu_check.json and gpu_check.md")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--smoke", action="store_true", help="tiny shapes on whatever devices jax has (the CPU)")
    a = p.parse_args()
    import jax

    from gpu_bench import measure
    from megajax.core.mesh import make_mesh
    from megajax.tasks import param_count
    from megajax.training.metrics import device_peak_tflops

    devices = jax.devices()
    print(f"jax {jax.__version__} on {platform.node()}: {len(devices)} x {devices[0].device_kind} "
          f"({jax.default_backend()})", flush=True)
    if jax.default_backend() != "gpu" and not a.smoke:
        print("error: jax sees no GPU here (install a CUDA-enabled jax, or try the path with --smoke)",
              file=sys.stderr)
        return 2
    mesh = make_mesh("model=1", devices=devices[:1])
    peak = device_peak_tflops(measure_cpu=False)
    rows = []
    for name, options in PLANS:
        cfg, compiled = pick(name, options, mesh, a.smoke)
        row = {"config": name, "params": param_count(cfg) if cfg else None}
        if cfg is None:
            rows.append({**row, "fits": False, "why": compiled})
        else:
            rows.append({**row, "fits": True, "remat": cfg.model.remat, "batch": cfg.train.batch_size,
                         "seq_len": cfg.model.seq_len, "dtype": cfg.model.compute_dtype,
                         **measure(cfg, mesh, 2 if a.smoke else a.steps, peak, compiled)})
        print(json.dumps(rows[-1]), flush=True)
    result = {"device": devices[0].device_kind, "backend": jax.default_backend(), "jax": jax.__version__,
              "bf16_peak_tflops": peak, "smoke": a.smoke, "rows": rows}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / "gpu_check.md").write_text(markdown(result))
    print(markdown(result))
    return 0


def markdown(result: dict) -> str:
    lines = [f"GPU check on {result['device']} (jax {result['jax']}, bf16 peak "
             f"{result['bf16_peak_tflops'] or 'unknown'} TFLOP/s){' [smoke]' if result['smoke'] else ''}", "",
             "| config | remat | batch x seq | step (ms) | tokens/s | TFLOP/s | MFU | peak memory |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in result["rows"]:
        if not r["fits"]:
            lines.append(f"| {r['config']} | does not fit: {r['why']} | | | | | | |")
            continue
        mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "n/a"
        lines.append(f"| {r['config']} | {r['remat']} | {r['batch']}x{r['seq_len']} | {r['step_ms']:.1f} | "
                     f"{r['tokens_per_s']:,.0f} | {r['tflops_per_device']:.1f} | {mfu} | "
                     f"{r['peak_bytes'] / 2**30:.2f} GiB ({r['peak_source']}) |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
