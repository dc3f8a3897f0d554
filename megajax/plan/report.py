"""The planner's table for people, and the sentence that says why the first plan is first."""

from __future__ import annotations

from megajax.config import Config
from megajax.hardware import Hardware
from megajax.plan.search import Plan

GIB = 2**30


def _gib(b: float) -> str:
    return f"{b / GIB:.1f}" if b >= GIB else f"{b / GIB:.2f}"


def _options(p: Plan) -> str:
    parts = [f"mb {p.microbatches}", f"remat {p.remat}"]
    if p.sequence_parallel:
        parts.append("SP")
    if p.scheme != "plain":
        parts.append(p.scheme.upper() if p.scheme == "fsdp" else "ZeRO-1")
    if p.layer_programs:
        parts.append("layer programs")
    if p.pipe > 1:
        parts.append(f"1F1B, bubble {(p.pipe - 1) / p.microbatches:.2f}")
    return ", ".join(parts)


def why(best: Plan, plans: list[Plan]) -> str:
    """One sentence: what makes the first plan the first."""
    if not best.fits:
        over = best.memory["total"] - best.device_bytes
        return (
            f"No plan fits: the smallest, {best.mesh} ({_options(best)}), needs "
            f"{_gib(best.memory['total'])} GiB per device, {_gib(over)} GiB more than the "
            f"{_gib(best.device_bytes)} GiB a device has; use more devices or a smaller batch per "
            "microbatch."
        )
    fitting = [p for p in plans if p.fits]
    cheaper = [p for p in plans if not p.fits and p.step_seconds < best.step_seconds]
    parts = [
        f"{best.mesh} with {_options(best)} is the fastest of {len(fitting)} plans that fit "
        f"({_gib(best.memory['total'])} of {_gib(best.device_bytes)} GiB per device)"
    ]
    if best.model > 1:
        parts.append(f"its model axis runs over {best.links['model']} links")
    if best.pipe > 1:
        parts.append(f"its {best.pipe} pipeline stages send over {best.links['pipe']} links")
    if cheaper:
        c = min(cheaper, key=lambda p: p.step_seconds)
        parts.append(
            f"{c.mesh} ({_options(c)}) would be {best.step_seconds / c.step_seconds:.2f}x faster "
            f"but needs {_gib(c.memory['total'])} GiB"
        )
    return "; ".join(parts) + "."


HEADER = (
    "mesh",
    "options",
    "params",
    "grads",
    "optim",
    "activ",
    "total GiB",
    "fits",
    "step s",
    "compute",
    "model-ax",
    "data-ax",
    "pipe",
    "tokens/s",
    "TFLOP/s",
    "MFU",
    "scaling",
)


def header(experts: bool) -> tuple:
    """The columns; a mixture of experts' table has the expert axis's all-to-alls after
    the data axis's."""
    if not experts:
        return HEADER
    at = HEADER.index("data-ax") + 1
    return HEADER[:at] + ("expert-ax",) + HEADER[at:]


def row(p: Plan, experts: bool = False) -> tuple:
    s = p.seconds
    compute = s["matmuls"] + s["elementwise"] + s["optimizer"] + s["overhead"]
    fits = "yes" if p.fits else f"no (+{_gib(p.memory['total'] - p.device_bytes)})"
    return (
        p.mesh,
        _options(p),
        _gib(p.memory["params"]),
        _gib(p.memory["gradients"]),
        _gib(p.memory["optimizer"]),
        _gib(p.memory["activations"] + p.memory["working"]),
        _gib(p.memory["total"]),
        fits,
        f"{p.step_seconds:.3f}",
        f"{compute:.3f}",
        f"{s['model_axis']:.3f}",
        f"{s['data_axis']:.3f}",
        *([f"{s.get('expert_axis', 0.0):.3f}"] if experts else []),
        f"{s.get('pipeline', 0.0):.3f}",
        f"{p.tokens_per_s:,.0f}",
        f"{p.tflops_per_device:.1f}",
        f"{100 * p.mfu:.1f}%",
        f"{100 * p.scaling_efficiency:.0f}%",
    )


# Whose step the times are of (megajax/plan/timing.py)
STACK_NOTE = {
    "megajax": "megajax's compiled step (constants fitted on an H200)",
    "megatron-2019": "the paper's Megatron-LM (constants fitted on its DGX-2H figures)",
    "megatron-2021": "the 2021 Megatron-LM (constant fitted on its Table 1, A100s)",
}


def render(cfg: Config, devices: int, hw: Hardware, plans: list[Plan], top: int = 10) -> str:
    m = cfg.model
    lines = [
        f"megajax-plan: {cfg.name} ({m.num_layers} layers, hidden {m.hidden}, {m.num_heads} heads, "
        f"seq {m.seq_len}, global batch {cfg.train.batch_size}) on {devices} x {hw.name} "
        f"({hw.peak_flops / 1e12:.0f} TFLOP/s, {_gib(hw.memory_bytes)} GiB, {hw.gpus_per_node} per "
        "node)",
        why(plans[0], plans),
        "",
    ]
    shown = plans[:top]
    too_big = [p for p in plans[top:] if not p.fits]
    if all(p.fits for p in shown) and too_big:
        shown.append(too_big[0])  # the plan that fits least badly: what more would cost
    experts = bool(m.num_experts)
    table = [header(experts)] + [row(p, experts) for p in shown]
    widths = [max(len(str(r[i])) for r in table) for i in range(len(table[0]))]
    for r in table[:1] + [tuple("-" * w for w in widths)] + table[1:]:
        lines.append(
            "  ".join(
                str(v).rjust(w) if i > 1 else str(v).ljust(w)
                for i, (v, w) in enumerate(zip(r, widths))
            )
        )
    lines.append(
        "\n"
        f"{len(plans)} plans, {sum(p.fits for p in plans)} fit. Memory per device in GiB (activ: "
        "activations and the step's working set); step time without overlap, "
        f"{STACK_NOTE[hw.stack]}; TFLOP/s counts recomputation (the paper's count)"
        + (
            " and the experts' buffer slots as they run, MFU neither (each token's "
            f"{m.experts_per_token} experts of {m.num_experts}: active FLOPs)"
            if experts
            else ", MFU does not"
        )
        + "; scaling: model FLOP/s per device over the reference run's on one device (the config's "
        "fastest one-device plan)."
    )
    return "\n".join(lines)
