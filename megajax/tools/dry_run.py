"""`train.py --dry-run`: everything about a run that needs no weights, from the step compiled
for abstract inputs: sizes, per-device memory and the collective audit."""

from __future__ import annotations

import time

import jax

from megajax.config import Config
from megajax.core.precision import Precision
from megajax.core.sharding import DATA
from megajax.mesh_shape import MeshShape
from megajax.tasks import param_count
from megajax.tools.audit import audit_hlo
from megajax.tools.step_figures import step_figures
from megajax.training.memory import device_memory_bytes, gib, per_device_bytes, step_memory
from megajax.training.step import make_trainer


def dry_run_report(cfg: Config, mesh, out=print, costs: bool = False) -> dict:
    """Compile `cfg`'s train step on `mesh` abstractly (nothing allocated), print the report
    and return it as a dict. `costs`: also activation bytes and FLOPs
    (megajax/tools/step_figures.py)."""
    trainer = make_trainer(cfg, mesh)
    shape = MeshShape.of(trainer.mesh)
    params, opt = trainer.abstract_state()
    t0 = time.perf_counter()
    compiled = trainer.lower_step().compile()
    compile_s = time.perf_counter() - t0
    report = {
        "config": cfg.name,
        "params": param_count(cfg),
        "num_layers": cfg.model.num_layers,
        "mesh": shape.sizes(),
        "param_bytes_per_device": per_device_bytes(params),
        # float32: the accumulator, split like the parameters (ZeRO-1 reduce-scatters it once per
        # step); with LoRA the adapters' alone
        "gradient_bytes_per_device": per_device_bytes(trainer.trained(params)),
        "trained_params": sum(x.size for x in jax.tree.leaves(trainer.trained(params))),
        "optimizer_bytes_per_device": per_device_bytes(opt),
        "data_parallel": _scheme(cfg, trainer),
        "compile_s": compile_s,
        **step_memory(compiled),
        "device_bytes": device_memory_bytes(),
    }
    audit = audit_hlo(compiled.as_text(), cfg, shape, trainer=trainer)
    report["audit"] = audit.summary()
    if costs:
        report.update(step_figures(cfg, mesh, report.get("step_temp_bytes")))
    _print(report, cfg, out)
    out(audit.table())
    return report


def _scheme(cfg: Config, trainer) -> str:
    dp = trainer.data_parallel
    if dp is None:
        return "plain (parameters and optimizer state whole on every data shard)"
    what = (
        "FSDP: parameters, gradients and optimizer state"
        if cfg.train.shard_params
        else "ZeRO-1: optimizer state"
    )
    return f"{what} split over data; {dp.describe()}"


def _print(report: dict, cfg: Config, out):
    m, t = cfg.model, cfg.train
    out(
        f"dry run: {cfg.name}, {report['params']:,} parameters ({m.num_layers} layers, hidden "
        f"{m.hidden}, {m.num_heads} heads, seq {m.seq_len}, vocab {m.padded_vocab})"
    )
    if m.lora_rank:
        out(
            f"LoRA: rank {m.lora_rank} on {m.lora_targets}: {report['trained_params']:,} trained "
            "parameters, the rest frozen"
        )
    out(
        f"mesh {' '.join(f'{a}={n}' for a, n in report['mesh'].items())}; global batch "
        f"{t.batch_size} in {t.microbatches} microbatch(es); compute {Precision.of(m).name}, remat "
        f"{m.remat}"
    )
    if report["mesh"][DATA] > 1:
        out(f"data parallelism: {report['data_parallel']}")
    out(
        f"per device: params {gib(report['param_bytes_per_device'])}, gradients "
        f"{gib(report['gradient_bytes_per_device'])}, optimizer state "
        f"{gib(report['optimizer_bytes_per_device'])}"
        + (
            f", compiled step peak {gib(report['step_peak_bytes'])} (temporaries "
            f"{gib(report['step_temp_bytes'])})"
            if "step_peak_bytes" in report
            else ""
        )
    )
    if report.get("step_peak_bytes") and report["device_bytes"]:
        fits = report["step_peak_bytes"] <= report["device_bytes"]
        out(
            f"{'fits' if fits else 'does NOT fit'}: a device has {gib(report['device_bytes'])}"
            + ("" if fits else " (train.py would refuse this run)")
        )
    if "step_flops" in report:
        _print_costs(report, out)
    out(f"step compiled in {report['compile_s']:.1f}s\n")


def _print_costs(report: dict, out):
    """Activation bytes per sequence, compiled and modelled, and the step's FLOPs."""
    layers, dtype = report["num_layers"], report["modelled_activation_dtype"]
    model = f"modelled {gib(report['modelled_bytes_per_layer_and_sequence'] * layers)} in {dtype}"
    if dtype != "float32":
        model += (
            f" ({gib(report['modelled_float32_bytes_per_layer_and_sequence'] * layers)} in "
            "float32, as XLA:CPU keeps 16-bit activations)"
        )
    if "activation_bytes_per_sequence" in report:
        out(
            f"activations per sequence: {gib(int(report['activation_bytes_per_sequence']))} "
            f"compiled (step temporaries, slope over {report['sequences_per_microbatch']} more per "
            f"microbatch); the {layers} layers "
            f"{gib(int(report['activation_bytes_per_layer_and_sequence'] * layers))} compiled, "
            f"{model}"
        )
    else:
        out(f"activations per sequence: the {layers} layers {model}")
    out(
        f"step FLOPs per device: {report['step_flops']:.3e}, recomputation "
        f"{100 * report['recompute_overhead']:+.1f}% over none"
    )
