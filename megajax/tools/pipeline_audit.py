"""The pipeline's line of the audit: what a pipelined step (megajax/training/pipeline.py) sends
between stages, and its bubble, read from the compiled program.

Every tick of the schedule ends with two collective-permutes over "pipe", one forward and one
back, each of one microbatch's stage boundary (b·s·h, with sequence parallelism b·s·h/t): the
tick loop's trip count, read from the HLO, is the schedule's length, so the bubble (idle ticks
over busy ticks on each stage) comes from the program, not from the table that built it.
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
    ticks: int                 # executions of the forward send per step: the tick loop's trips
    forward_elements: int      # per send and device
    backward_elements: int
    boundary_elements: int     # a microbatch's activations at a stage boundary, per device
    embedding_elements: int    # the weights outside the stack, gradients summed over "pipe"

    @property
    def busy(self) -> int:
        """Ticks a stage runs an action in: a forward and a backward per chunk and microbatch."""
        return 2 * self.chunks * self.micro

    @property
    def bubble(self) -> float:
        return (self.ticks - self.busy) / self.busy

    @property
    def useful_sends(self) -> int:
        return self.chunks * self.micro

    def lines(self) -> list[str]:
        v = f" x {self.chunks} chunks" if self.chunks > 1 else ""
        formula = "(p-1)/(v m)" if self.chunks > 1 else "(p-1)/m"
        paper = (self.stages - 1) / (self.micro * self.chunks)
        per = self.boundary_elements
        return [
            f"pipeline: {self.stages} stages{v}, {self.schedule}, {self.micro} microbatches: "
            f"{self.ticks} ticks per step, each stage busy in {self.busy}: bubble "
            f"{self.bubble:.3f} = {formula} {paper:.3f}",
            f"pipeline sends per step and device: forward {self.ticks} x "
            f"{self.forward_elements:,} elements, backward {self.ticks} x "
            f"{self.backward_elements:,} ({self.forward_elements / per:.3f} x a microbatch's "
            f"stage boundary {per:,}); {self.useful_sends} of each carry a microbatch, the "
            f"other {self.ticks - self.useful_sends} ticks' carry zeros (the schedule runs in "
            f"lockstep)",
            f"pipeline: the weights outside the stack ({self.embedding_elements:,} elements per "
            f"device) have their gradients summed over pipe once per step (the tied embedding's "
            f"first and last stage)",
        ]

    def summary(self) -> dict:
        return {"stages": self.stages, "schedule": self.schedule, "microbatches": self.micro,
                "chunks": self.chunks, "ticks": self.ticks, "bubble": round(self.bubble, 6),
                "forward_send_elements": self.forward_elements,
                "backward_send_elements": self.backward_elements,
                "boundary_elements": self.boundary_elements,
                "embedding_gradient_elements": self.embedding_elements}


def pipeline_sends(collectives, pipeline, shape) -> PipelineSends:
    """The pipeline's sends among a compiled step's `collectives` (tools/hlo.py), for the
    trainer's `pipeline` and the step's `shape` (analytic.StepShape)."""
    over_pipe = [c for c in collectives if c.axis == PIPE]

    def sends(back: bool):
        found = [c for c in over_pipe if c.kind == "collective-permute"
                 and ("pipeline_send_back" in c.op_name) == back]
        return found[0] if found else None
    forward, backward = sends(False), sends(True)
    grads = sum(c.elements for c in over_pipe if "pipeline_gradient_sum" in c.op_name)
    seq = shape.seq // (shape.tp if shape.sequence_parallel else 1)
    return PipelineSends(
        pipeline.p, pipeline.table.schedule, pipeline.m, pipeline.v,
        forward.count if forward else 0, forward.elements if forward else 0,
        backward.elements if backward else 0, shape.rows * seq * shape.hidden, grads)
