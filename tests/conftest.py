"""8 simulated CPU devices for every test; must run before jax is imported.

Tolerances: every floating-point comparison in the suite follows one rule, written out in
tests/tolerances.py — a bound derived from the unit roundoff of the arithmetic it checks
(float32: 2^8 u of the compared quantity's scale; bfloat16 operands: 4 bf16 units element-wise
and 1 in norm; Adam's per-entry amplification of gradient errors), never a number that merely
passed on one machine. The suite must pass on any x86-64 or ARM CPU and pinned to one core
(`taskset -c 0 python -m pytest -q tests`), which changes XLA:CPU's kernels and summation order.
"""
import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path

# Tests compile hundreds of tiny programs and run each a few times: LLVM's optimisation of the
# generated CPU code costs more than it saves there (the whole suite runs ~40% faster at -O0).
# XLA's HLO passes (fusion, layouts, the collectives the audit reads) are unaffected; the
# processes the tests start inherit the flag (TEST_XLA_FLAGS), so their numbers stay comparable.
TEST_XLA_FLAGS = ("--xla_backend_optimization_level=0"
                  if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", "")
                  else "")
os.environ["XLA_FLAGS"] = " ".join(filter(None, (os.environ.get("XLA_FLAGS", ""), TEST_XLA_FLAGS,
                                                 "--xla_force_host_platform_device_count=8")))
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One XLA compilation cache for the session, inherited by the train.py / eval.py processes the
# tests start: the many short runs of the same tiny config compile each program once.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="megajax-tests-xla-")
    atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
# The glibc malloc settings train.py restarts itself with (megajax/host/env.py), for the
# pytest-xdist
# workers and the processes the tests start: glibc reads them when a process starts, and this
# module is imported before the workers are.
from megajax.host.env import tuned_env  # noqa: E402

os.environ.update(tuned_env(dict(os.environ)) or {})

import jax  # noqa: E402
import pytest  # noqa: E402

from megajax.config import Config, ModelConfig, TrainConfig  # noqa: E402
from megajax.core.mesh import make_mesh  # noqa: E402


def tiny_config(**model) -> Config:
    """A model every test mesh divides: 8 heads, hidden 64, ffn 256, vocab 100 -> 128."""
    fields = dict(num_layers=2, hidden=64, num_heads=8, seq_len=16, vocab_size=100,
                  vocab_multiple=128, hidden_dropout=0.1, attention_dropout=0.1)
    fields.update(model)
    return Config(model=ModelConfig(**fields),
                  train=TrainConfig(batch_size=8, lr=1e-2, warmup_steps=1, steps=10,
                                    min_lr=1e-3)).validate()


def mesh_for(spec: str):
    """A mesh over the first data*model devices, so 1x2 or 2x2 meshes also work on 8 devices."""
    d, m = (int(x) for x in spec.split("x"))
    return make_mesh(spec, devices=jax.devices()[: d * m])


@pytest.fixture(scope="session")
def devices():
    assert len(jax.devices()) == 8, "conftest must set XLA_FLAGS before jax is imported"
    return jax.devices()


def file_size_limited(*args: str, kib: int = 64) -> list[str]:
    """A Python command line (`python ARGS...`) in which no file may grow past `kib` KiB: a
    write fails as a full disk or a quota makes it fail (EFBIG), without needing either. The
    child sets the limit itself: forking a process that runs JAX's threads is unsafe."""
    code = ("import os, resource, sys; "
            f"resource.setrlimit(resource.RLIMIT_FSIZE, ({kib * 1024}, "
            f"resource.getrlimit(resource.RLIMIT_FSIZE)[1])); "
            "os.execv(sys.executable, [sys.executable] + sys.argv[1:])")
    return [sys.executable, "-c", code, *args]


def handles_signal(pid: int, sig: int) -> bool:
    """Whether process `pid` has installed its own handler for `sig` (Linux: /proc/PID/status),
    so that a test can signal a program once it is listening, without guessing a delay."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    return False


# The longest files first (CPU seconds on a 2-core machine, roughly): the two workers take files
# in collection order, one at a time, so a long file taken last would run alone at the end.
LONGEST_FIRST = ("test_train_cli", "test_docs_guides", "test_bert", "test_multiprocess",
                 "test_docs", "test_equivalence", "test_chat", "test_lora", "test_plan",
                 "test_bench", "test_memory_model", "test_llama_parallel", "test_eval",
                 "test_data_parallel", "test_blocked_attention")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))   # stable: tests keep order
