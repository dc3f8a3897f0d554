"""Every way to run a config on N devices, predicted and ranked: meshes (data, pipeline stages,
experts and model, the model axis dividing heads, hidden and ffn, the stages the layers, the
expert axis a mixture's experts), microbatch
sizes for the config's global batch, recomputation, sequence parallelism and the data axis's
scheme (plain, ZeRO-1, FSDP). The fastest plan that fits comes first."""

from __future__ import annotations

import dataclasses
import itertools
import numbers

from megajax.config import Config, load_config, with_values
from megajax.errors import UserError
from megajax.hardware import Hardware, pick_hardware
from megajax.mesh_shape import MeshShape
from megajax.plan.memory import memory_bytes
from megajax.plan.timing import axis_links, step_time
from megajax.plan.volumes import step_flops

SCHEMES = {
    "plain": {},
    "zero": {"train.shard_optimizer": True},
    "fsdp": {"train.shard_params": True},
}


@dataclasses.dataclass
class Plan:
    mesh: MeshShape
    microbatches: int
    remat: str
    sequence_parallel: bool
    scheme: str
    memory: dict  # bytes per device by kind, and "total"
    device_bytes: float
    seconds: dict  # step time by part
    tokens_per_s: float
    tflops_per_device: float  # the FLOPs the paper counts (recomputation included) per second
    mfu: float  # model FLOPs (no recomputation) per second over the peak
    scaling_efficiency: float = 0.0
    links: dict = dataclasses.field(default_factory=dict)
    layer_programs: bool = False  # train.layer_programs (as the config asks: not searched)

    @property
    def data(self) -> int:
        return self.mesh.data

    @property
    def model(self) -> int:
        return self.mesh.model

    @property
    def pipe(self) -> int:
        """Pipeline stages (the 1F1B schedule)."""
        return self.mesh.pipe

    @property
    def fits(self) -> bool:
        return self.memory["total"] <= self.device_bytes

    @property
    def step_seconds(self) -> float:
        return sum(self.seconds.values())

    @property
    def options(self) -> dict:
        return {
            "microbatches": self.microbatches,
            "remat": self.remat,
            "sequence_parallel": self.sequence_parallel,
            "data_scheme": self.scheme,
            "layer_programs": self.layer_programs,
        }

    def to_json(self) -> dict:
        return {
            "mesh": str(self.mesh),
            "options": self.options,
            "fits": self.fits,
            "memory_bytes": self.memory,
            "device_bytes": self.device_bytes,
            "step_seconds": {**self.seconds, "total": self.step_seconds},
            "links": self.links,
            "tokens_per_s": self.tokens_per_s,
            "tflops_per_device": self.tflops_per_device,
            "mfu": self.mfu,
            "scaling_efficiency": self.scaling_efficiency,
        }


def model_sizes(cfg: Config, devices: int) -> list[int]:
    m = cfg.model
    widths = (m.num_heads, m.hidden, m.ffn)
    if m.num_experts:  # each expert's MLP (and the shared experts') split like the dense one
        widths += (m.moe_ffn, m.moe_shared_ffn)
    # t divides the heads: O(heads)
    return [
        t
        for t in range(1, min(devices, m.num_heads) + 1)
        if devices % t == 0 and all(x % t == 0 for x in widths)
    ]


def expert_sizes(cfg: Config, devices: int) -> list[int]:
    """The expert axes a mixture of experts may have on `devices`: those dividing its experts."""
    experts = cfg.model.num_experts
    return [
        e for e in range(1, min(devices, experts) + 1) if devices % e == 0 and experts % e == 0
    ] or [1]


def meshes(cfg: Config, devices: int, pipelines: bool = True) -> list[MeshShape]:
    """The meshes of `devices` a plan may have: a model axis dividing heads, hidden and ffn,
    pipeline stages dividing the layers and the devices left (`pipelines`: whether stages are
    considered; a pipeline runs with a scanned stack: core/mesh.py's rules), and for a
    mixture of experts an expert axis dividing the experts."""
    staged = pipelines and cfg.model.scan_layers and not cfg.train.layer_programs
    return [
        MeshShape(data=devices // tp // p // e, pipe=p, expert=e, model=tp)
        for tp in model_sizes(cfg, devices)
        for p in range(1, (cfg.model.num_layers if staged else 1) + 1)
        if cfg.model.num_layers % p == 0 and (devices // tp) % p == 0
        for e in expert_sizes(cfg, devices // tp // p)
    ]


def candidates(cfg: Config, devices: int, schemes=tuple(SCHEMES), pipelines: bool = True):
    """(mesh, microbatches, remat, sequence parallel, scheme) for every valid plan
    (train.layer_programs runs with plain data parallelism only, a pipeline too; `pipelines`:
    whether stages are considered, which the 2019 Megatron-LM had not)."""
    batch = cfg.train.batch_size
    if cfg.train.layer_programs:
        schemes = [s for s in schemes if s == "plain"]
    for mesh in meshes(cfg, devices, pipelines):
        if batch % mesh.batch_shards:
            continue
        per_shard = batch // mesh.batch_shards
        for rows in (r for r in range(1, per_shard + 1) if per_shard % r == 0):
            for remat, sp, scheme in itertools.product(
                ("none", "selective", "full"), (False, True), schemes
            ):
                # ZeRO-1 and FSDP split over "data" (and "expert", for all but the experts)
                if (sp and (mesh.model == 1 or cfg.model.seq_len % mesh.model)) or (
                    scheme != "plain" and mesh.batch_shards == 1
                ):
                    continue
                yield mesh, per_shard // rows, remat, sp, scheme


def evaluate(cfg: Config, mesh: MeshShape, hw: Hardware, gradient_bytes: int = 4) -> Plan:
    """One plan: `cfg` (with the plan's options set) on `mesh` of `hw`'s devices."""
    m, t = cfg.model, cfg.train
    scheme = "fsdp" if t.shard_params else "zero" if t.shard_optimizer else "plain"
    seconds = step_time(cfg, mesh, hw, gradient_bytes).parts
    total = sum(seconds.values())
    n = mesh.devices
    return Plan(
        mesh,
        t.microbatches,
        m.remat,
        m.sequence_parallel,
        scheme,
        memory_bytes(cfg, mesh),
        hw.memory_bytes,
        seconds,
        t.batch_size * m.seq_len / total,
        step_flops(cfg) / n / total / 1e12,
        step_flops(cfg, remat="none", executed=False) / n / total / hw.peak_flops,
        links={axis: link for axis, (_, _, link) in axis_links(mesh, hw).items()},
        layer_programs=t.layer_programs,
    )


def plans(
    cfg: Config, devices: int, hw: Hardware, baseline: Config | None = None, schemes=tuple(SCHEMES)
) -> list[Plan]:
    """Every valid plan, the fastest that fits first, then those that do not fit, least over first.
    `schemes`: the data-parallel schemes to consider (plain, zero, fsdp)."""
    if isinstance(devices, bool) or not isinstance(devices, numbers.Integral) or devices < 1:
        raise UserError(f"--devices must be an integer of at least 1, got {devices!r}")
    unknown = sorted(set(schemes) - set(SCHEMES))
    if unknown or not schemes:
        raise UserError(
            f"unknown data-parallel scheme(s) {', '.join(unknown) or '(none)'}: use "
            f"{', '.join(SCHEMES)}"
        )
    if cfg.train.layer_programs and "plain" not in schemes:
        raise UserError(
            "train.layer_programs works with plain data parallelism only: plan it with --schemes "
            "plain"
        )
    found = []
    for mesh, mb, remat, sp, scheme in candidates(
        cfg, devices, schemes, hw.stack != "megatron-2019"
    ):
        c = with_values(
            cfg,
            {
                "train.microbatches": mb,
                "model.remat": remat,
                "model.sequence_parallel": sp,
                **SCHEMES[scheme],
            },
        )
        found.append(evaluate(c, mesh, hw))
    if not found:
        raise UserError(
            f"no mesh of {devices} devices fits {cfg.name}: the model axis must divide heads "
            f"({cfg.model.num_heads}), hidden and ffn, and the data axis the global batch "
            f"({cfg.train.batch_size})"
        )
    reference = best_single_device(baseline or cfg, hw)
    for p in found:
        # model FLOP/s per device, recomputation aside
        p.scaling_efficiency = p.mfu / reference.mfu
    return sorted(
        found, key=lambda p: (not p.fits, -p.tokens_per_s if p.fits else p.memory["total"])
    )


def best_single_device(cfg: Config, hw: Hardware) -> Plan:
    """The reference for scaling efficiency: the config on one device, its fastest plan that
    fits, or when none does its fastest plan as if the device's memory were unlimited."""
    one = [
        evaluate(
            with_values(cfg, {"train.microbatches": mb, "model.remat": remat}), MeshShape(), hw
        )
        for _, mb, remat, _, _ in candidates(
            with_values(cfg, {"model.sequence_parallel": False}), 1
        )
    ]
    return sorted(one, key=lambda p: (not p.fits, -p.tokens_per_s))[0]


def plan(
    config: str | Config,
    devices: int,
    hardware: Hardware | str,
    overrides: list[str] | None = None,
    baseline: str | Config | None = None,
    schemes=tuple(SCHEMES),
) -> list[Plan]:
    """The Python API: the plans for a config name (or Config) on `devices` of `hardware` (a
    Hardware or a name / TOML path), best first."""
    cfg = load_config(config, overrides) if isinstance(config, str) else config.validate()
    base = load_config(baseline) if isinstance(baseline, str) else baseline
    hw = pick_hardware(hardware) if isinstance(hardware, str) else hardware
    return plans(cfg, devices, hw, base, schemes)
