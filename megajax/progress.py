"""Progress display: a tqdm bar on a terminal, plain log lines otherwise (CI, files, pipes)."""

from __future__ import annotations

import sys

from tqdm import tqdm


class Progress:
    """Training steps (`update` with the step's record) or evaluated rows (`advance`). Disabled
    (on every process but the first) it shows nothing."""

    def __init__(
        self, total: int | None = None, start: int = 0, unit: str = "step", enabled: bool = True
    ):
        self.enabled = enabled
        self.bar = None
        if enabled and sys.stderr.isatty():
            self.bar = tqdm(total=total, initial=start, unit=unit, dynamic_ncols=True)

    def update(self, step: int, record: dict):
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.n = step
            self.bar.set_postfix(
                loss=f"{record['loss']:.4f}",
                tok_s=f"{record['tokens_per_sec']:,.0f}",
                **({"mfu": f"{100 * record['mfu']:.1f}%"} if "mfu" in record else {}),
                refresh=False,
            )
            self.bar.refresh()
        else:
            norm = (
                "skipped (overflow)"
                if record["grad_norm"] is None
                else f"{record['grad_norm']:.3f}"
            )
            print(
                f"step {step:>6}  loss {record['loss']:.4f}  lr {record['lr']:.2e}  grad_norm "
                f"{norm}  {record['tokens_per_sec']:,.0f} tok/s  "
                f"{record['step_time_s'] * 1000:.1f} ms/step  {record['tflops_per_device']:.3g} "
                "TFLOP/s/device"
                + (f"  MFU {100 * record['mfu']:.1f}%" if "mfu" in record else "")
                + "".join(
                    f"  {k} {record[k]:.3f}"
                    for k in ("mlm_accuracy", "sop_accuracy", "accuracy")
                    if k in record
                )
                + (  # a mixture of experts: its router losses and dropped share
                    f"  aux {record['moe/aux_loss']:.4f}  z {record['moe/z_loss']:.3f}  dropped "
                    f"{100 * record['moe/dropped']:.2f}%"
                    if "moe/aux_loss" in record
                    else ""
                )
                + (  # a blend: each component's samples so far
                    "  samples "
                    + " ".join(
                        f"{k.removeprefix('samples/')} {v:,}"
                        for k, v in record.items()
                        if k.startswith("samples/")
                    )
                    if any(k.startswith("samples/") for k in record)
                    else ""
                )
                + (
                    f"  loss_scale {record['loss_scale']:g} ({record['skipped_steps']} skipped)"
                    if "loss_scale" in record
                    else ""
                ),
                flush=True,
            )

    def advance(self, done: int, total: int):
        """`done` of `total` rows evaluated: the bar only (a log line per batch would be noise)."""
        if self.bar is not None:
            self.bar.total = total
            self.bar.n = done
            self.bar.refresh()
            if done >= total:
                self.close()

    def write(self, text: str):
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(text)
        else:
            print(text, flush=True)

    def close(self):
        if self.bar is not None:
            self.bar.close()
            self.bar = None
