"""The pipeline's line of the audit: what a pipelined step (megajax/training/pipeline.py) sends
between stages, and its bubble, read from the compiled program.

Every tick of the schedule ends with a collective-permute over "pipe" each way, between the
stages that have a microbatch's stage boundary (b·s·h, with sequence parallelism b·s·h/t) to
pass on at that tick: a switch over the tick's pattern of stage pairs. Summed over the
patterns' runs and pairs, the step sends m·(p·v − 1) boundaries each way, every one a
microbatch crossing a boundary between (virtual) stages, the minimum. The tick loop's trip
count, read from the HLO, is the schedule's length, so the bubble (idle ticks over busy ticks
on each stage) comes from the program, not from the table that built it.
"""

from __future__ import annotations

import dataclasses

from megajax.core.sharding import PIPE


@dataclasses.dataclass
class PipelineSends:
    stages: int
    schedule: str
    micro: int
    chunks: int
    ticks: int  # the tick loop's trips
    forward_elements: int  # per send, one device's
    backward_elements: int
    forward_sent: int  # elements sent per step, summed over the devices of a stage group
    backward_sent: int
    boundary_elements: int  # a microbatch's activations at a stage boundary, per device
    embedding_elements: int  # the weights outside the stack, gradients summed over "pipe"

    @property
    def busy(self) -> int:
        """Ticks a stage runs an action in: a forward and a backward per chunk and microbatch."""
        return 2 * self.chunks * self.micro

    @property
    def bubble(self) -> float:
        return (self.ticks - self.busy) / self.busy

    @property
    def minimum(self) -> int:
        """Each way, every microbatch crosses each of the p·v − 1 boundaries between virtual
        stages once: its boundary's elements, per device."""
        return self.micro * (self.stages * self.chunks - 1) * self.boundary_elements

    def ratio(self, back: bool = False) -> float:
        sent = self.backward_sent if back else self.forward_sent
        return sent / self.minimum if self.minimum else 0.0

    def lines(self) -> list[str]:
        v = f" x {self.chunks} chunks" if self.chunks > 1 else ""
        formula = "(p-1)/(v m)" if self.chunks > 1 else "(p-1)/m"
        paper = (self.stages - 1) / (self.micro * self.chunks)
        boundaries = self.stages * self.chunks - 1
        return [
            f"pipeline: {self.stages} stages{v}, {self.schedule}, {self.micro} microbatches: "
            f"{self.ticks} ticks per step, each stage busy in {self.busy}: bubble "
            f"{self.bubble:.3f} = {formula} {paper:.3f}",
            "pipeline sends per step (elements, one device of each stage): forward "
            f"{self.forward_sent:,} = {self.ratio():.3f} x, backward {self.backward_sent:,} = "
            f"{self.ratio(back=True):.3f} x the minimum {self.minimum:,} ({self.micro} "
            f"microbatches x {boundaries} stage boundaries x {self.boundary_elements:,}); each "
            f"send {self.forward_elements:,} elements",
            f"pipeline: the weights outside the stack ({self.embedding_elements:,} elements per "
            "device) have their gradients summed over pipe once per step (the tied embedding's "
            "first and last stage)",
        ]

    def summary(self) -> dict:
        return {
            "stages": self.stages,
            "schedule": self.schedule,
            "microbatches": self.micro,
            "chunks": self.chunks,
            "ticks": self.ticks,
            "bubble": round(self.bubble, 6),
            "forward_send_elements": self.forward_elements,
            "backward_send_elements": self.backward_elements,
            "forward_sent": self.forward_sent,
            "backward_sent": self.backward_sent,
            "send_minimum": self.minimum,
            "boundary_elements": self.boundary_elements,
            "embedding_gradient_elements": self.embedding_elements,
        }


def pipeline_sends(collectives, pipeline, shape, ticks: int, devices: int) -> PipelineSends:
    """The pipeline's sends among a compiled step's `collectives` (tools/hlo.py), for the
    trainer's `pipeline`, the step's `shape` (analytic.StepShape), the tick loop's `ticks` and
    the mesh's `devices`."""
    over_pipe = [c for c in collectives if c.axis == PIPE]
    groups = devices // pipeline.p  # (data, model) positions: each has its own stage pairs

    def sends(back: bool):
        return [
            c
            for c in over_pipe
            if c.kind == "collective-permute" and ("pipeline_send_back" in c.op_name) == back
        ]

    def sent(found):
        return sum(c.elements * c.count * c.pairs for c in found) // groups

    forward, backward = sends(False), sends(True)
    grads = sum(c.elements for c in over_pipe if "pipeline_gradient_sum" in c.op_name)
    seq = shape.seq // (shape.tp if shape.sequence_parallel else 1)
    return PipelineSends(
        pipeline.p,
        pipeline.table.schedule,
        pipeline.m,
        pipeline.v,
        ticks,
        forward[0].elements if forward else 0,
        backward[0].elements if backward else 0,
        sent(forward),
        sent(backward),
        shape.rows * seq * shape.hidden,
        grads,
    )
