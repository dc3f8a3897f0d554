"""The collective audit: compile a train step, read its HLO, and account for every collective.

Megatron's claim is that a tensor-parallel transformer layer needs exactly two all-reduces
over the model axis in the forward pass and two in the backward pass. `audit()` checks it
from the program XLA compiled (tools/hlo.py reads it) against the analytic minimum."""

from __future__ import annotations

import dataclasses
from collections import Counter, defaultdict

from megajax.analytic import (
    StepShape,
    expert_axis_minimum,
    model_axis_minimum,
    remat_extra_elements,
)
from megajax.core.sharding import DATA, EXPERT, MODEL, param_shardings
from megajax.mesh_shape import MeshShape
from megajax.tasks import task_for
from megajax.tools.data_axis import data_axis_minimum
from megajax.tools.hlo import Collective, parse_collectives, program_order, runs_of_scope
from megajax.tools.pipeline_audit import PipelineSends, pipeline_sends
from megajax.training.memory import per_device_elements
from megajax.training.step import make_trainer


@dataclasses.dataclass
class AuditResult:
    collectives: list[Collective]
    mesh: MeshShape
    # the step's numbers, for the closed forms (megajax/analytic/)
    shape: StepShape
    scanned: bool
    # one device's shard of every parameter: its gradient reduction over "data"
    gradient_shard_elements: int = 0
    # plain | zero (train.shard_optimizer) | fsdp (train.shard_params)
    data_scheme: str = "plain"
    # origin -> elements sent (ring) per step
    data_axis_minimum: dict = dataclasses.field(default_factory=dict)
    # a pipelined step's point-to-point sends (tools/pipeline_audit.py)
    pipeline: PipelineSends | None = None

    # The step's numbers under the names the table uses.
    num_layers = property(lambda self: self.shape.layers)
    # sequences per data shard per microbatch
    batch_local = property(lambda self: self.shape.rows)
    seq_len = property(lambda self: self.shape.seq)
    hidden = property(lambda self: self.shape.hidden)
    microbatches = property(lambda self: self.shape.microbatches)
    # positions per sequence through the output layer
    head_rows = property(lambda self: self.shape.head_rows)
    sequence_parallel = property(lambda self: self.shape.sequence_parallel)
    # the backward pass recomputes the forward's collectives
    remat = property(lambda self: self.shape.remat == "full")

    def select(self, **kw) -> list[Collective]:
        return [c for c in self.collectives if all(getattr(c, k) == v for k, v in kw.items())]

    def model_axis_layer_counts(self, kind: str = "all-reduce") -> dict[str, Counter]:
        """{layer: Counter((origin, direction) -> executions per microbatch)} of the model-axis
        collectives of `kind` that carry a block's activations (at least b s h / tp elements;
        the h-sized gradient reductions of sequence parallelism's LayerNorms are not counted)."""
        per, scanned = defaultdict(Counter), Counter()
        least = self.batch_local * self.seq_len * self.hidden // self.mesh.model
        for c in self.select(kind=kind, axis=MODEL):
            if c.origin in ("attention", "mlp") and c.elements >= least:
                if c.layer == "all":  # a scanned body (or a pipeline's), run for every layer
                    scanned[(c.origin, c.direction)] += c.count
                else:
                    per[c.layer][(c.origin, c.direction)] += c.count // self.microbatches
        for i in range(self.num_layers if scanned else 0):
            for key, n in scanned.items():
                per[str(i)][key] += n // (self.num_layers * self.microbatches)
        return dict(per)

    @property
    def analytic_min_elements(self) -> int:
        """Megatron's minimum per step and device (analytic.model_axis_minimum): without remat's
        recomputation and sequence parallelism's re-gathers, which the table adds."""
        return model_axis_minimum(self.shape)

    @property
    def regathered_elements(self) -> int:
        """Sequence parallelism's all-gathers of each block's input again in the backward pass
        (Megatron keeps only the shard, trading b·s·h of communication per block for memory):
        counted as they occur, since XLA may merge them with the forward's in an unrolled stack."""
        per = self.model_axis_layer_counts("all-gather")
        bsh = self.batch_local * self.seq_len * self.hidden
        return (
            self.microbatches
            * bsh
            * sum(n for c in per.values() for (_, d), n in c.items() if d == "recompute")
        )

    @property
    def remat_extra_elements(self) -> int:
        return remat_extra_elements(self.shape)

    @property
    def data_axis_gradient_elements(self) -> int:
        return sum(
            c.elements * c.count
            for c in self.collectives
            if c.axis == DATA and c.origin == "gradients"
        )

    def data_axis_sent(self, origin: str) -> int:
        """Elements each device sends over "data" per step for the collectives of `origin`,
        as ring algorithms move them: an all-reduce of E sends 2 (n-1)/n E, an all-gather
        (n-1)/n of its result, a reduce-scatter (n-1) times its result. A reduce-scatter plus
        an all-gather thus send what one all-reduce does."""
        # over both axes (LoRA's replicated factors) at the data axis's share
        origins = (origin, "adapter_gradients") if origin == "gradients" else (origin,)
        return round(
            sum(
                self._ring_factor(c) * c.elements * c.count / self._stages_counted(c)
                for c in self.collectives
                if self._data_parallel(c) and c.origin in origins
            )
        )

    def _data_parallel(self, c: Collective) -> bool:
        """Over "data", or on an expert mesh over "expert" too (a data axis for all but the
        experts)."""
        axes = set(c.axis.split("+"))
        return DATA in axes or (self.mesh.expert > 1 and axes == {EXPERT})

    def _ring_factor(self, c: Collective) -> float:
        n = self.mesh.data * (self.mesh.expert if EXPERT in c.axis.split("+") else 1)
        return {
            "all-reduce": 2 * (n - 1) / n,
            "all-gather": (n - 1) / n,
            "reduce-scatter": n - 1,
        }.get(c.kind, 1)

    def _stages_counted(self, c: Collective) -> int:
        """A pipeline's stage actions are counted summed over its stages (tools/hlo.py): a
        device runs 1/p of them."""
        return self.pipeline.stages if self.pipeline and "pipeline_stage" in c.op_name else 1

    @property
    def data_axis_min(self) -> float:
        return self.data_axis_minimum.get("gradients", 0) + self.data_axis_minimum.get("params", 0)

    @property
    def data_axis_regathered(self) -> int:
        """FSDP's gathers of a layer's weights again for the backward pass, counted as found
        (in an unrolled stack XLA may merge them with the forward's, keeping the weights)."""
        return round(
            sum(
                self._ring_factor(c) * c.elements * c.count / self._stages_counted(c)
                for c in self.collectives
                if self._data_parallel(c) and c.origin == "params" and c.direction == "recompute"
            )
        )

    @property
    def data_axis_ratio(self) -> float:
        """Gradient and parameter traffic over "data" against the scheme's minimum (with FSDP's
        re-gathers for the backward pass as found)."""
        least = self.data_axis_min + self.data_axis_regathered
        return (
            sum(self.data_axis_sent(o) for o in ("gradients", "params")) / least if least else 0.0
        )

    def data_axis_line(self) -> str:
        """Data parallelism's traffic against the minimum of its scheme (`data_axis_minimum`)."""
        grads, params = self.data_axis_sent("gradients"), self.data_axis_sent("params")
        least = round(self.data_axis_min)
        head = "data-axis elements sent per step and device (ring algorithms): "
        if self.data_scheme == "plain" and "expert_gradients" in self.data_axis_minimum:
            experts = round(self.data_axis_minimum["expert_gradients"])
            return head.replace("data-axis", "data- and expert-axis") + (
                f"gradients {grads:,} = {self.data_axis_ratio:.3f} x the minimum {least:,} (each "
                "gradient shard all-reduced once per step: the experts' over data, "
                f"{experts:,}, the other weights' over data and expert, {least - experts:,})"
            )
        if self.data_scheme == "plain":
            return (
                head + f"gradients {grads:,} = {self.data_axis_ratio:.3f} x the minimum {least:,} "
                "(each gradient shard all-reduced once per step; GSPMD reduces once per "
                f"microbatch, here {self.microbatches}, and the tied embedding's two contributions "
                "apart; train.shard_optimizer reduces once per step)"
            )
        if self.data_scheme == "zero":
            what = (
                "ZeRO-1: one reduce-scatter of the accumulated gradients and one all-gather of "
                "the updated parameters per step, the bytes of one all-reduce"
            )
        else:
            what = (
                "FSDP: per layer and microbatch an all-gather of its weights and a reduce-scatter "
                "of its gradients, the other weights gathered once per step"
                + (" and their gradients reduce-scattered once" if self.pipeline else "")
            )
            if self.data_axis_regathered:
                least += self.data_axis_regathered
                what += (
                    f"; with the {self.data_axis_regathered:,} of the weights the backward pass "
                    "gathers again, one layer at a time"
                )
        return (
            head + f"gradients {grads:,} + parameters {params:,} = {self.data_axis_ratio:.3f} x "
            f"the minimum {least:,} ({what})"
        )

    @property
    def model_axis_elements(self) -> int:
        """Elements over "model" but LoRA adapters' gradient sums (`adapter_gradient_elements`)."""
        return sum(
            c.elements * c.count
            for c in self.collectives
            if MODEL in c.axis and c.origin != "adapter_gradients"
        )

    @property
    def adapter_gradient_elements(self) -> int:
        """LoRA's replicated factors' gradients summed over "model" alone (core/lora.py)."""
        return sum(
            c.elements * c.count
            for c in self.collectives
            if c.axis == MODEL and c.origin == "adapter_gradients"
        )

    @property
    def ratio(self) -> float:
        """Model-axis elements over the analytic minimum of the scheme (tensor or sequence
        parallel)."""
        tp = self.mesh.model
        return self.model_axis_elements / self.analytic_min_elements if tp > 1 else 0.0

    def summary(self) -> dict:
        by = Counter()
        for c in self.collectives:
            by[(c.kind, c.axis, c.origin, c.direction)] += c.count
        return {
            "mesh": {DATA: self.mesh.data, MODEL: self.mesh.model},
            "per_layer_model_all_reduces": self._per_layer_dict("all-reduce"),
            "counts": {"/".join(k): n for k, n in sorted(by.items())},
            "model_axis_elements": self.model_axis_elements,
            "analytic_min_elements": self.analytic_min_elements,
            "ratio_to_megatron_min": round(self.ratio, 4),
            **(
                {
                    f"per_layer_model_{k.replace('-', '_')}s": self._per_layer_dict(k)
                    for k in ("all-gather", "reduce-scatter")
                }
                if self.sequence_parallel
                else {}
            ),
            "data_axis_gradient_elements": self.data_axis_gradient_elements,
            "data_axis_gradient_min_elements": self.gradient_shard_elements,
            "data_scheme": self.data_scheme,
            "data_axis_sent": {o: self.data_axis_sent(o) for o in ("gradients", "params")},
            "data_axis_min_sent": round(self.data_axis_min),
            "data_axis_regathered": self.data_axis_regathered,
            "data_axis_ratio": round(self.data_axis_ratio, 4),
            "non_all_reduce_on_model_axis": sum(
                c.count for c in self.collectives if MODEL in c.axis and c.kind != "all-reduce"
            ),
            **({"pipeline": self.pipeline.summary()} if self.pipeline else {}),
        }

    def _per_layer_dict(self, kind: str) -> dict:
        return {
            i: {f"{o}/{d}": n for (o, d), n in v.items()}
            for i, v in sorted(
                self.model_axis_layer_counts(kind).items(), key=lambda kv: int(kv[0])
            )
        }

    def table(self) -> str:
        """One row per activation collective; gradient and optimizer tensors summed per layer."""
        rows, grouped = [], {}
        for c in sorted(self.collectives, key=program_order):
            if c.origin in ("gradients", "params", "metrics", "optimizer"):
                key = (c.kind, c.axis, c.direction, c.origin, c.layer or "-")
                n, el, by, cnt = grouped.get(key, (0, 0, 0, c.count))
                grouped[key] = (n + 1, el + c.elements, by + c.bytes, cnt)
                continue
            rows.append(
                (
                    c.kind,
                    c.axis,
                    c.direction,
                    c.origin,
                    c.layer or "-",
                    f"{c.dtype}{list(c.shape)}",
                    f"{c.elements:,}",
                    f"{c.bytes:,}",
                    f"x{c.count}",
                )
            )
        for key, (n, el, by, cnt) in grouped.items():
            rows.append(key + (f"{n} tensors", f"{el:,}", f"{by:,}", f"x{cnt}"))
        head = ("kind", "axis", "pass", "origin", "layer", "shape", "elements", "bytes", "count")
        widths = [max(len(str(r[i])) for r in rows + [head]) for i in range(len(head))]
        fmt = lambda r: "  ".join(str(v).ljust(w) for v, w in zip(r, widths))  # noqa: E731
        lines = [fmt(head), fmt(["-" * w for w in widths])] + [fmt(r) for r in rows]
        lines.append("")
        if self.pipeline is not None:  # per layer: the stages' executions summed
            data = [self.data_axis_line()] if self.mesh.data > 1 and self.data_axis_minimum else []
            return "\n".join(
                lines
                + [self._per_layer_line(k) for k in self._kinds()]
                + self.pipeline.lines()
                + data
            )
        for kind in self._kinds():
            lines.append(self._per_layer_line(kind))
        scheme = "sequence-parallel " if self.sequence_parallel else ""
        if self.mesh.model > 1:
            lines.append(
                f"model-axis elements per step and device: {self.model_axis_elements:,} = "
                f"{self.ratio:.3f} x Megatron's {scheme}analytic minimum "
                f"{self.analytic_min_elements:,}"
            )
        else:
            lines.append(f"a model axis of one device: {self.model_axis_elements:,} elements sent")
        if self.mesh.batch_shards > 1 and self.data_axis_minimum:
            lines.append(self.data_axis_line())
        if self.mesh.expert > 1:
            lines.append(self.expert_axis_line())
        parts = []
        if self.regathered_elements:
            parts.append(
                "the block inputs all-gathered again for the backward pass "
                f"({self.regathered_elements:,} elements)"
            )
        if self.remat:
            what = "attention reduce-scatter" if self.sequence_parallel else "all-reduce"
            parts.append(
                f"remat's recomputed {what} per layer ({self.remat_extra_elements:,} elements)"
            )
        if parts:
            total = (
                self.analytic_min_elements + self.regathered_elements + self.remat_extra_elements
            )
            lines.append(
                f"with {' and '.join(parts)} the minimum is {total:,}: ratio "
                f"{self.model_axis_elements / total:.3f}"
            )
        return "\n".join(lines)

    @property
    def expert_axis_elements(self) -> int:
        """All-to-all elements over "expert" alone per step and device, by result."""
        return sum(
            c.elements * c.count
            for c in self.collectives
            if c.kind == "all-to-all" and c.axis == EXPERT
        )

    def expert_axis_line(self) -> str:
        want = expert_axis_minimum(self.shape)
        return (
            f"expert-axis all-to-all elements per step and device: {self.expert_axis_elements:,} "
            f"= {self.expert_axis_elements / max(want, 1):.3f} x the analytic {want:,} (2 "
            "forward and 2 backward per sparse layer, each of a row shard's expert buffers)"
        )

    def _kinds(self) -> tuple[str, ...]:
        return (
            ("all-gather", "reduce-scatter", "all-reduce")
            if self.sequence_parallel
            else ("all-reduce",)
        )

    def _per_layer_line(self, kind: str) -> str:
        per = self.model_axis_layer_counts(kind)
        count = lambda d: sorted(
            {sum(n for (o, dd), n in c.items() if dd == d) for c in per.values()} or {0}
        )  # noqa: E731
        if self.pipeline is not None:
            recompute = f", recomputed by the backward tick {count('recompute')}"
        elif self.remat:
            recompute = f", recomputed by remat {count('recompute')}"
        elif self.sequence_parallel and kind == "all-gather":
            recompute = f", again for the backward pass {count('recompute')}"
        else:
            recompute = ""
        return (
            f"model-axis {kind}s per layer{' and microbatch' if self.microbatches > 1 else ''}: "
            f"forward {count('forward')}, backward {count('backward')}{recompute} "
            f"({self.num_layers} layers{', scanned' if self.scanned else ''})"
        )

    def print(self):
        print(self.table())


def audit(cfg, mesh, verbose: bool = False) -> AuditResult:
    """Compile `cfg`'s train step on `mesh` (abstractly: no weights allocated) and audit it."""
    trainer = make_trainer(cfg, mesh)
    hlo = trainer.lower_step().compile().as_text()
    return audit_hlo(hlo, cfg, MeshShape.of(trainer.mesh), verbose=verbose, trainer=trainer)


def audit_hlo(hlo: str, cfg, mesh: MeshShape, verbose: bool = False, trainer=None) -> AuditResult:
    """The audit of a compiled step on a mesh of that shape."""
    # (each RACE option is a sequence of its own: StepShape.of counts sequences)
    piped = trainer is not None and trainer.pipeline is not None
    collectives = parse_collectives(hlo, mesh, trainer.pipeline.switch_runs() if piped else None)
    shape = StepShape.of(cfg, task_for(cfg), mesh)
    result = AuditResult(collectives, mesh, shape, cfg.model.scan_layers)
    if mesh.pipelined:
        result.pipeline = pipeline_sends(
            collectives, trainer.pipeline, shape, runs_of_scope(hlo, "pipeline_stage"), mesh.devices
        )
    if trainer is not None:
        result.gradient_shard_elements = per_device_elements(
            trainer.trained(
                trainer.modeldef.abstract_sharded_params(
                    param_shardings(trainer.mesh, trainer.modeldef.specs())
                )
            )
        )
        result.data_scheme, result.data_axis_minimum = data_axis_minimum(trainer)
    if verbose:
        result.print()
    return result
