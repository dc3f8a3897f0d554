#!/usr/bin/env python
"""nanoGPT's shakespeare-char baseline through megajax's training loop, on one device.

    python bench/shakespeare_char.py [--mesh 1x1] [--host-devices N] [--steps 2000] [--set
    KEY=VALUE ...]

Prints the median training throughput (tokens/s, compile and evaluation excluded) and the
final validation loss over the whole held-out split. Targets: val loss <= 1.89 after 2000
steps; >= 40,000 tokens/s. bench/nanogpt_reference.py runs the PyTorch reference.
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--mesh", default="1x1")
    p.add_argument("--host-devices", type=int)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--data", default=str(ROOT / "data" / "tinyshakespeare.txt"))
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="config override, e.g. --set model.compute_dtype=float32 to compare",
    )
    a = p.parse_args()
    # as train.py does: restart once so that XLA:CPU's step temporaries are reused
    # (megajax/host/env.py)
    import runpy

    runpy.run_path(str(ROOT / "megajax" / "host" / "env.py"))["restart_with_malloc_tuning"]()
    if a.host_devices:
        os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={a.host_devices}"
    import jax

    from megajax.config import load_config
    from megajax.core.mesh import make_mesh
    from megajax.training.loop import train

    cfg = load_config(
        "shakespeare_char",
        [
            f"data.source=text:{a.data}",
            f"train.steps={a.steps}",
            "train.log_every=50",
            f"train.eval_every={a.steps}",
            f"train.save_every={a.steps}",
            *a.set,
        ],
    )
    mesh = make_mesh(a.mesh, devices=jax.devices()[:1] if a.mesh == "1x1" else None)
    with tempfile.TemporaryDirectory() as wd:
        result = train(cfg, mesh, Path(wd), sample_tokens=300, out=lambda s: print(s, flush=True))
        records = [json.loads(x) for x in (Path(wd) / "metrics.jsonl").read_text().splitlines()]
    speeds = [r["tokens_per_sec"] for r in records if "tokens_per_sec" in r and r["step"] > 50]
    print(
        "\n"
        f"shakespeare_char on {dict(mesh.shape)} ({jax.devices()[0].platform}): median "
        f"{statistics.median(speeds):,.0f} tokens/s; final val loss {result.val_loss:.4f} after "
        f"{result.final_step} steps"
    )


if __name__ == "__main__":
    main()
