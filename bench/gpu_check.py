#!/usr/bin/env python
"""The one-command GPU check: how fast the paper's one-GPU shapes train on this machine.

    python bench/gpu_check.py [--out DIR]      # a machine with NVIDIA GPUs and a CUDA-enabled jax
    python bench/gpu_check.py --smoke          # the same path on the CPU with tiny shapes, in
    seconds

It installs nothing and reaches no network. It prints the device, then checks the fused
attention core against megajax's own on this device (loss and gradients of a small GPT, and
whether the compiled program calls cuDNN's flash attention). Then, for each row below (the
paper's GPT-2 355M and 1.2B shapes and Llama 3.2 1B's at sequence 1024, bfloat16, one GPU: through
cuDNN's flash attention (which takes grouped-query heads as they are) without
attention dropout, and beside it the paper's attention dropout with megajax's own core, the
paper's full remat, the unrolled stack, the step as one program per layer (train.layer_programs)
and model.recompute_norm_gelu), it picks the first (remat, batch)
whose compiled step's memory plan fits the GPU, measures step time, tokens/s, model TFLOP/s,
MFU against the GPU's dense bf16 peak and peak memory, and writes DIR/gpu_check.json (after
every row, so a run cut short keeps what it measured) and DIR/gpu_check.md
(bench/gpu_bench.py's `measure` does the timing). Beside each row: what `megajax-plan`
predicts for it on this GPU's entry (H200, H100, A100), to check the planner's constants
(megajax/plan/measured.py records the runs they are fitted on). Last, the layer stack alone,
forward+backward, as a scan, as one compiled program per layer and unrolled
(bench/layer_programs.py), for the 355M and 1.2B shapes. Rows past --budget seconds are skipped.
On one H200 the first four rows of an earlier version took 107 s in all.
"""

import argparse
import json
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

# no attention dropout in cuDNN's kernel
FUSED = ["model.attention_dropout=0", "model.attention=fused"]
PAPER = ["model.attention=megajax"]  # megajax's own core, with the paper's attention dropout 0.1
FAST = [("none", 16), ("none", 8), ("full", 16), ("full", 8), ("full", 4)]
# (label, config, overrides, [(remat, global batch), ...] fastest first): the first that fits is
# measured.
# the scanned weights, one compiled program per layer
PROGRAMS = [*FUSED, "train.layer_programs=true"]
ROWS = [
    ("gpt2_355m", "gpt2_355m", FUSED, FAST),
    ("gpt2_1.2b", "gpt2_1.2b", FUSED, FAST),
    # Today's decoder at the paper's sequence length: GQA through cuDNN, SwiGLU, RoPE, RMSNorm.
    ("llama3.2_1b shape, seq 1024", "llama3.2_1b", [*FUSED, "model.seq_len=1024"], FAST),
    ("gpt2_1.2b, layer programs", "gpt2_1.2b", PROGRAMS, FAST),
    ("gpt2_355m, layer programs", "gpt2_355m", PROGRAMS, FAST),
    ("gpt2_1.2b, megajax attention core, dropout 0.1 (the paper's)", "gpt2_1.2b", PAPER, FAST),
    ("gpt2_1.2b, full remat (the paper's)", "gpt2_1.2b", FUSED, [("full", 16), ("full", 8)]),
    ("gpt2_355m, unrolled stack", "gpt2_355m", [*FUSED, "model.scan_layers=false"], FAST),
    (
        "gpt2_1.2b, LayerNorm and GeLU outputs recomputed",
        "gpt2_1.2b",
        [*FUSED, "model.recompute_norm_gelu=true"],
        FAST,
    ),
    (
        "gpt2_355m, float16 with dynamic loss scaling (V100/T4's precision)",
        "gpt2_355m",
        [*FUSED, "model.compute_dtype=float16"],
        FAST,
    ),
    # A mixture of experts with the dense row's active FLOPs: its MLP as 4 SwiGLU experts of
    # half the width, top-2 (MFU on active FLOPs; ~1.8B parameters, to fit one GPU with Adam).
    (
        "llama3.2_1b shape, 4 experts top-2 of half width, seq 1024",
        "llama3.2_1b",
        [
            *FUSED,
            "model.seq_len=1024",
            "model.num_experts=4",
            "model.experts_per_token=2",
            "model.moe_ffn_hidden=4096",
            "model.moe_norm_topk=true",
        ],
        FAST,
    ),
]
# The layer stack alone, forward+backward, three ways (bench/layer_programs.py): the scan, one
# program per layer, and the unrolled stack where its compile time is short.
STACKS = [("gpt2_355m", ("scan", "per_layer", "unrolled")), ("gpt2_1.2b", ("scan", "per_layer"))]
STACK_BATCH = 16
# --smoke: the same configs shrunk until a CPU runs them in seconds.
SMOKE = [
    "model.num_layers=2",
    "model.hidden=64",
    "model.num_heads=4",
    "model.seq_len=32",
    "model.vocab_size=512",
    "model.vocab_multiple=128",
]
SMOKE_MOE = ["model.moe_ffn_hidden=64"]  # half the smoke Llama's width
# 4 heads need fewer kv heads
SMOKE_ARCHITECTURE = {"llama3.2_1b": ["model.num_kv_heads=2", "model.ffn_hidden=128"]}
# The attention check's model: head dim 64 and sequence 256, shapes cuDNN's kernel takes.
CHECK = [
    "model.num_layers=2",
    "model.hidden=256",
    "model.num_heads=4",
    "model.seq_len=256",
    "model.vocab_size=1024",
    "model.vocab_multiple=128",
    "model.hidden_dropout=0",
    "model.attention_dropout=0",
    "model.remat=none",
    "train.batch_size=4",
    "train.microbatches=1",
]
FITS_FRACTION = 0.9  # of a device's memory: headroom for the runtime's own buffers


def pick(name: str, overrides, options, mesh, smoke: bool):
    """(config, its compiled step) of the first option whose step fits, or (None, why)."""
    from megajax.config import load_config
    from megajax.training.memory import device_memory_bytes, step_memory
    from megajax.training.step import make_trainer

    limit = device_memory_bytes()
    why = "no option"
    for remat, batch in options:
        cfg = load_config(
            name,
            [
                f"train.batch_size={batch}",
                "train.microbatches=1",
                f"model.remat={remat}",
                *overrides,
                *(SMOKE + SMOKE_ARCHITECTURE.get(name, []) if smoke else []),
                *(SMOKE_MOE if smoke and any("num_experts" in o for o in overrides) else []),
            ],
        )
        # layer programs: an estimate, first programs compiled
        compiled = make_trainer(cfg, mesh).compiled_step()
        peak = step_memory(compiled).get("step_peak_bytes")
        if peak is None or limit is None or peak <= FITS_FRACTION * limit:
            return cfg, compiled
        why = f"needs {peak / 2**30:.1f} GiB with remat {remat}, batch {batch}"
    return None, why


def check_attention(mesh) -> dict:
    """Loss and gradients of a small bf16 GPT through the fused core against megajax's own core
    on this device: the largest difference of each, relative to its scale, and whether the
    fused program calls cuDNN's flash attention."""
    import jax
    import numpy as np
    from layer_programs import max_rel_diff

    from megajax.config import load_config
    from megajax.training.step import make_trainer

    results = {}
    for attention in ("megajax", "fused"):
        cfg = load_config("gpt2_355m", [*CHECK, f"model.attention={attention}"])
        tr = make_trainer(cfg, mesh)
        params, _ = tr.init_state(seed=0)
        batch = jax.device_put(
            tr.task.synthetic_batch(cfg, 4, np.random.default_rng(0)), tr.batch_sharding
        )
        compiled = jax.jit(tr.gradients).lower(params, batch, jax.random.key(1)).compile()
        metrics, grads = jax.device_get(compiled(params, batch, jax.random.key(1)))
        results[attention] = (
            float(metrics["loss"]),
            jax.tree.leaves(grads),
            "cudnn$fmha" in compiled.as_text(),
        )
    (loss0, g0, _), (loss1, g1, cudnn) = results["megajax"], results["fused"]
    rel = max_rel_diff(g1, g0)
    return {
        "cudnn_flash_attention": cudnn,
        "loss_megajax": loss0,
        "loss_fused": loss1,
        "loss_rel_diff": abs(loss1 - loss0) / abs(loss0),
        "grad_max_rel_diff": rel,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=".", help="directory for gpu_check.json and gpu_check.md")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument(
        "--budget",
        type=float,
        default=420,
        help="seconds after which the remaining rows are skipped",
    )
    p.add_argument(
        "--smoke", action="store_true", help="tiny shapes on whatever devices jax has (the CPU)"
    )
    a = p.parse_args()
    start = time.perf_counter()
    import jax

    from megajax.cli.common import fail, start_jax
    from megajax.core.mesh import make_mesh
    from megajax.errors import UserError
    from megajax.training.mfu import device_peak

    try:
        start_jax()  # JAX_PLATFORMS=cuda with a jax built without CUDA: one line
    except UserError as e:
        return fail(str(e))
    devices = jax.devices()
    print(
        f"jax {jax.__version__} on {platform.node()}: {len(devices)} x {devices[0].device_kind} "
        f"({jax.default_backend()})",
        flush=True,
    )
    if jax.default_backend() != "gpu" and not a.smoke:
        print(
            "error: jax sees no GPU here (install a CUDA-enabled jax, or try the path with "
            "--smoke)",
            file=sys.stderr,
        )
        return 2
    mesh = make_mesh("model=1", devices=devices[:1])
    a.hardware = planner_hardware(devices[0].device_kind, a.smoke)
    result = {
        "device": devices[0].device_kind,
        "backend": jax.default_backend(),
        "jax": jax.__version__,
        "planner_hardware": a.hardware,
        "bf16_peak_tflops": getattr(device_peak(measure_cpu=False), "tflops", None),
        "smoke": a.smoke,
        "rows": [],
    }
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    try:
        result["attention_check"] = check_attention(mesh)
    except Exception as e:  # reported, and the speed rows still run
        result["attention_check"] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
    print(json.dumps(result["attention_check"]), flush=True)
    for label, name, overrides, options in ROWS:
        if time.perf_counter() - start > a.budget:
            row = {
                "config": label,
                "fits": None,
                "why": f"skipped: past the {a.budget:.0f} s budget",
            }
        else:
            row = measure_row(label, name, overrides, options, mesh, a, result["bf16_peak_tflops"])
        result["rows"].append(row)
        print(json.dumps(row), flush=True)
        (out / "gpu_check.json").write_text(json.dumps(result, indent=1) + "\n")
    result["stacks"] = []
    for name, ways in STACKS:
        if time.perf_counter() - start > a.budget:
            row = {"config": name, "why": f"skipped: past the {a.budget:.0f} s budget"}
        else:
            row = measure_stack(name, ways, mesh, a.smoke)
        result["stacks"].append(row)
        print(json.dumps(row), flush=True)
        (out / "gpu_check.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / "gpu_check.md").write_text(markdown(result))
    print(markdown(result))
    return 0


def measure_row(label, name, overrides, options, mesh, a, peak) -> dict:
    """One row: the first option that fits, measured; an error is the row's result, not the run's
    end."""
    from gpu_bench import measure

    from megajax.core.attention import fused_attention
    from megajax.core.sharding import Layout
    from megajax.tasks import param_count

    try:
        cfg, compiled = pick(name, overrides, options, mesh, a.smoke)
        if cfg is None:
            return {"config": label, "fits": False, "why": compiled}
        m = cfg.model
        return {
            "config": label,
            "fits": True,
            "params": param_count(cfg),
            "remat": m.remat,
            "batch": cfg.train.batch_size,
            "seq_len": m.seq_len,
            "dtype": m.compute_dtype,
            "attention": "fused" if fused_attention(m, Layout(mesh)) else "megajax",
            "attention_dropout": m.attention_dropout,
            **measure(cfg, mesh, 2 if a.smoke else a.steps, peak, compiled),
            **predicted(cfg, a.hardware),
        }
    except Exception as e:  # out of memory and the like: reported in the row, the next row runs
        return {
            "config": label,
            "fits": None,
            "why": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}",
        }


def measure_stack(name: str, ways, mesh, smoke: bool) -> dict:
    """The config's layer stack alone (bf16, no remat, fused attention, batch STACK_BATCH):
    forward+backward time each way, and each way's gradients against the scan's."""
    from layer_programs import inputs, max_rel_diff, stack_gradients, time_ways

    from megajax.config import load_config

    try:
        cfg = load_config(
            name,
            [
                *FUSED,
                "model.remat=none",
                f"train.batch_size={STACK_BATCH}",
                "train.microbatches=1",
                *(SMOKE if smoke else []),
            ],
        )
        fns, state = stack_gradients(cfg, mesh)
        x, ct, keys = inputs(cfg)
        args = (state, x, keys, ct)
        reference = fns["scan"](*args)
        diffs = {w: max_rel_diff(fns[w](*args), reference) for w in ways if w != "scan"}
        del reference
        times = time_ways(fns, args, ways, reps=2 if smoke else 5)
        return {
            "config": name,
            "batch": STACK_BATCH,
            "seq_len": cfg.model.seq_len,
            "best_ms": {w: t[0] * 1000 for w, t in times.items()},
            "median_ms": {w: t[1] * 1000 for w, t in times.items()},
            "grad_rel_diff": diffs,
        }
    except Exception as e:  # out of memory and the like: reported, the run goes on
        return {"config": name, "why": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}


def planner_hardware(device_kind: str, smoke: bool) -> str | None:
    """The planner's entry for this GPU (megajax/hardware.py), to print its prediction beside
    each row; with --smoke the H200's, so that the path runs."""
    from megajax.hardware import for_device

    known = for_device(device_kind)
    return known.name if known else "h200" if smoke else None


def predicted(cfg, hardware: str | None) -> dict:
    """What `megajax-plan` predicts for the row's config on one such GPU: step time and memory
    (nothing for a mixture of experts, which the planner does not model yet)."""
    if hardware is None or cfg.model.num_experts:
        return {}
    from megajax.mesh_shape import MeshShape
    from megajax.plan import BUILTIN
    from megajax.plan.memory import memory_bytes
    from megajax.plan.timing import step_time

    return {
        "predicted_ms": 1000 * step_time(cfg, MeshShape(), BUILTIN[hardware]).seconds,
        "predicted_bytes": memory_bytes(cfg, MeshShape())["total"],
    }


def markdown(result: dict) -> str:
    check = result["attention_check"]
    if "error" in check:
        checked = f"Fused attention core: the check failed ({check['error']})."
    else:
        checked = (
            "Fused attention core: cuDNN flash attention "
            f"{'called' if check['cudnn_flash_attention'] else 'not called'}; against megajax's "
            f"core, loss {check['loss_rel_diff']:.1e} and gradients "
            f"{check['grad_max_rel_diff']:.1e} apart (relative to their scale, bf16)."
        )
    peak = result["bf16_peak_tflops"] or "unknown"
    smoke = " [smoke]" if result["smoke"] else ""
    lines = [
        f"GPU check on {result['device']} (jax {result['jax']}, bf16 peak {peak} TFLOP/s){smoke}",
        "",
        checked,
        "",
        "| config | remat | batch x seq | step (ms) | tokens/s | TFLOP/s | MFU | peak memory "
        f"(plan) | megajax-plan on {result.get('planner_hardware') or 'n/a'} |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in result["rows"]:
        if not r["fits"]:
            lines.append(
                f"| {r['config']} | {'does not fit: ' if r['fits'] is False else ''}{r['why']} | | "
                "| | | | | |"
            )
            continue
        mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "n/a"
        plan = (
            f"{r['predicted_ms']:.4g} ms, {r['predicted_bytes'] / 2**30:.2f} GiB"
            if "predicted_ms" in r
            else "n/a"
        )
        lines.append(
            f"| {r['config']} | {r['remat']} | {r['batch']}x{r['seq_len']} | {r['step_ms']:.1f} | "
            f"{r['tokens_per_s']:,.0f} | {r['tflops_per_device']:.1f} | {mfu} | {memory(r)} | "
            f"{plan} |"
        )
    if result.get("stacks"):
        lines += [
            "",
            "The layer stack alone, forward+backward (bench/layer_programs.py; best of the runs, "
            "ms):",
            "",
            "| config | batch x seq | scan | one program per layer | unrolled | per-layer / scan "
            "| gradients vs the scan's |",
            "| --- | --- | --- | --- | --- | --- | --- |",
        ]
        for r in result["stacks"]:
            if "best_ms" not in r:
                lines.append(f"| {r['config']} | {r['why']} | | | | | |")
                continue
            ms = r["best_ms"]
            cell = lambda w: f"{ms[w]:.1f}" if w in ms else "n/a"  # noqa: E731
            diff = ", ".join(f"{w} {d:.1e}" for w, d in r["grad_rel_diff"].items())
            lines.append(
                f"| {r['config']} | {r['batch']}x{r['seq_len']} | {cell('scan')} | "
                f"{cell('per_layer')} | {cell('unrolled')} | {ms['per_layer'] / ms['scan']:.3f} | "
                f"{diff} |"
            )
    return "\n".join(lines) + "\n"


def memory(row: dict) -> str:
    """XLA's plan for this row's step, and the runtime's peak where it keeps one (on GPUs the
    process's peak so far: a larger earlier row shows through)."""
    plan = f"{row['planned_bytes'] / 2**30:.2f} GiB" if row.get("planned_bytes") else "n/a"
    return plan + (
        f" (runtime peak so far {row['peak_bytes'] / 2**30:.2f})"
        if row["peak_source"] == "runtime"
        else ""
    )


if __name__ == "__main__":
    sys.exit(main())
