"""The 2021 paper's weak-scaling table (Narayanan et al., "Efficient Large-Scale Language Model
Training on GPU Clusters Using Megatron-LM", Table 1), predicted by the planner's pipeline
model: GPT models from 1.7B to 1T parameters on up to 3,072 A100s of Selene (DGX A100 nodes,
8 GPUs on NVSwitch, 8 x 200 Gb/s HDR InfiniBand each), tensor parallelism inside a node,
pipeline stages across nodes, data parallelism over the rest; sequence 2048, vocabulary
51,200, mixed precision, activation recomputation, the 1F1B schedule. Microbatches of one
sequence (the table does not give them; one is what the paper's 1T runs use), so each data
replica runs B / d microbatches.

One constant of megajax/plan/timing.py's "megatron-2021" stack, the fraction of peak a large
matmul reaches, is fitted on the table's first row (CALIBRATED_ON); the other nine rows are
predictions. (A second, the 2019 stack's fixed cost per layer, fitted on the 1T row, comes
out at zero: it would slow the small models' many narrow layers, and the table shows them
no slower, so the 2021 stack has none.)
"""

from __future__ import annotations

import dataclasses

from megajax.analytic import paper_flops
from megajax.config import Config, ModelConfig, TrainConfig
from megajax.hardware import BUILTIN, Hardware
from megajax.mesh_shape import MeshShape
from megajax.plan import timing
from megajax.plan.paper import bisect
from megajax.plan.timing import step_time
from megajax.plan.volumes import step_shape

# Megatron-LM's all-reduce of fp16 gradients over the data axis
PAPER_GRADIENT_BYTES = 2


@dataclasses.dataclass(frozen=True)
class Row:
    billions: float
    heads: int
    hidden: int
    layers: int
    tp: int
    pp: int
    gpus: int
    batch: int
    tflops: float  # achieved per GPU, the paper's count (recomputation included)
    percent: int  # of the A100's 312 TFLOP/s

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp)

    @property
    def mesh(self) -> MeshShape:
        return MeshShape(data=self.dp, pipe=self.pp, model=self.tp)


TABLE_1 = (
    Row(1.7, 24, 2304, 24, 1, 1, 32, 512, 137, 44),
    Row(3.6, 32, 3072, 30, 2, 1, 64, 512, 138, 44),
    Row(7.5, 32, 4096, 36, 4, 1, 128, 512, 142, 46),
    Row(18.4, 48, 6144, 40, 8, 1, 256, 1024, 135, 43),
    Row(39.1, 64, 8192, 48, 8, 2, 512, 1536, 138, 44),
    Row(76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140, 45),
    Row(145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148, 47),
    Row(310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155, 50),
    Row(529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163, 52),
    Row(1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163, 52),
)
CALIBRATED_ON = (1.7,)


def selene() -> Hardware:
    """The paper's cluster: the built-in DGX A100 with the 2021 Megatron-LM's constants."""
    return dataclasses.replace(
        BUILTIN["a100-80g"], name="a100-selene", stack="megatron-2021", device_kinds=()
    )


def row_config(row: Row) -> Config:
    model = ModelConfig(
        num_layers=row.layers,
        hidden=row.hidden,
        num_heads=row.heads,
        seq_len=2048,
        vocab_size=51200,
        vocab_multiple=128,
        remat="full",
        compute_dtype="bfloat16",
        hidden_dropout=0.1,
        attention_dropout=0.1,
    )
    train = TrainConfig(batch_size=row.batch, microbatches=row.batch // row.dp)
    return Config(model=model, train=train).validate()


def predicted_tflops(row: Row) -> float:
    """Per-GPU TFLOP/s of the row's step as the planner times it, counted as the paper counts."""
    cfg = row_config(row)
    seconds = step_time(cfg, row.mesh, selene(), PAPER_GRADIENT_BYTES).seconds
    return paper_flops(row.batch, step_shape(cfg)) / row.gpus / seconds / 1e12


def predicted_percent(row: Row) -> float:
    return 100 * predicted_tflops(row) * 1e12 / selene().peak_flops


def table() -> str:
    """Markdown: the paper's Table 1 next to the planner's prediction of each row."""
    out = [
        "| parameters | t | p | GPUs | batch | paper TFLOP/s (% of peak) | planner |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in TABLE_1:
        note = " (calibrated)" if r.billions in CALIBRATED_ON else ""
        out.append(
            f"| {r.billions:g}B | {r.tp} | {r.pp} | {r.gpus:,} | {r.batch:,} | {r.tflops:.0f} "
            f"({r.percent}%) | {predicted_tflops(r):.0f} ({predicted_percent(r):.0f}%){note} |"
        )
    return "\n".join(out)


def calibrate() -> float:
    """MATMUL_EFFICIENCY_2021 that reproduces CALIBRATED_ON's row (the 1.7B model, no tensor or
    pipeline parallelism: its step is the matmuls and the elementwise passes)."""
    (first,) = (r for r in TABLE_1 if r.billions in CALIBRATED_ON)

    def gap(eff):
        timing.MATMUL_EFFICIENCY_2021 = eff
        return predicted_tflops(first) - first.tflops

    saved = timing.MATMUL_EFFICIENCY_2021
    try:
        return bisect(gap, 0.05, 1.0, steps=40)
    finally:
        timing.MATMUL_EFFICIENCY_2021 = saved
