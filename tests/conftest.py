"""8 simulated CPU devices for every test; must run before jax is imported.

Tolerances: every floating-point comparison in the suite follows one rule, written out in
tests/tolerances.py — a bound derived from the unit roundoff of the arithmetic it checks
(float32: 2^8 u of the compared quantity's scale; bfloat16 operands: 4 bf16 units element-wise
and 1 in norm; Adam's per-entry amplification of gradient errors), never a number that merely
passed on one machine. The suite must pass on any x86-64 or ARM CPU and pinned to one core
(`taskset -c 0 python -m pytest -q tests`), which changes XLA:CPU's kernels and summation order.
"""

import atexit
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from importlib import metadata
from pathlib import Path


def xla_cache_dir() -> str:
    """XLA's compilation cache for the suite, inherited by the processes the tests start (the many
    short runs of the same tiny config compile each program once). On a developer's machine it
    outlives the run, under the user's cache directory and keyed by the jax and jaxlib versions,
    so that the next run skips most compiles; MEGAJAX_TEST_XLA_CACHE=tmp (what .ci/run sets)
    keeps it for one run only, a path puts it there. At most XLA_CACHE_BYTES: jax evicts the
    least recently used programs beyond that."""
    where = os.environ.get("MEGAJAX_TEST_XLA_CACHE", "")
    if where == "tmp":
        path = tempfile.mkdtemp(prefix="megajax-tests-xla-")
        atexit.register(shutil.rmtree, path, ignore_errors=True)
        return path
    versions = "-".join(f"{name}{metadata.version(name)}" for name in ("jax", "jaxlib"))
    base = (
        Path(where)
        if where
        else Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "megajax" / "tests"
    )
    path = base / f"xla-{versions}"
    path.mkdir(parents=True, exist_ok=True)
    return str(path)


def xla_accepts(flag: str, cache: Path) -> bool:
    """Whether this jaxlib's XLA knows `flag` (an unknown one aborts it): asked once a version, by
    starting jax in a process of its own; the answer is kept beside the compilation cache."""
    answers = cache / "xla_flags.json"
    known = json.loads(answers.read_text()) if answers.is_file() else {}
    if flag not in known:
        env = {**os.environ, "XLA_FLAGS": flag, "JAX_PLATFORMS": "cpu"}
        known[flag] = (
            subprocess.run(
                [sys.executable, "-c", "import jax; jax.devices()"], env=env, capture_output=True
            ).returncode
            == 0
        )
        cache.mkdir(parents=True, exist_ok=True)  # (a cache directory jax has not made yet)
        staged = answers.with_name(f"{answers.name}.{os.getpid()}")
        staged.write_text(json.dumps(known))
        os.replace(staged, answers)
    return known[flag]


# The suite compiles hundreds of tiny programs and runs most a few steps: compiling them is most
# of its time. LLVM's -O0 compiles them fastest (the full tier takes 1.5x as long at -O1), and
# XLA:CPU's older elemental emitters (jaxlib 0.10; later versions have only the fusion emitters
# that replaced them) faster again. XLA's HLO passes, which decide the fusions, layouts and the
# collectives the audit reads, are the same. The processes the tests start inherit the flags
# (TEST_XLA_FLAGS), so their numbers stay comparable with the tests'; the few that train for
# hundreds of steps run -O1 code (helpers.LONG_RUN_ENV), a 300-step run in a third of the time.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", xla_cache_dir())
LEGACY_EMITTERS = "--xla_cpu_use_fusion_emitters=false"
given = os.environ.get("XLA_FLAGS", "")
TEST_XLA_FLAGS = " ".join(
    ([] if "xla_backend_optimization_level" in given else ["--xla_backend_optimization_level=0"])
    + (
        [LEGACY_EMITTERS]
        if "xla_cpu_use_fusion_emitters" not in given
        and xla_accepts(LEGACY_EMITTERS, Path(os.environ["JAX_COMPILATION_CACHE_DIR"]))
        else []
    )
)
os.environ["XLA_FLAGS"] = " ".join(
    filter(
        None,
        (
            os.environ.get("XLA_FLAGS", ""),
            TEST_XLA_FLAGS,
            "--xla_force_host_platform_device_count=8",
        ),
    )
)
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Nothing in the suite downloads: lm-eval's datasets and hub read local files only
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
XLA_CACHE_BYTES = 4 * 2**30
os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(XLA_CACHE_BYTES))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
# The glibc malloc settings train.py restarts itself with (megajax/host/env.py), for the
# pytest-xdist workers and the processes the tests start: glibc reads them when a process
# starts, and this module is imported before the workers are.
from megajax.host.env import tuned_env  # noqa: E402

os.environ.update(tuned_env(dict(os.environ)) or {})

# A suite started under nohup still survives a hang-up, but the processes the tests start see
# SIGHUP as a terminal's do (the signal tests' subject): a handler that does nothing, unlike
# nohup's SIG_IGN, is reset to the default in a program the suite executes.
if signal.getsignal(signal.SIGHUP) == signal.SIG_IGN:
    signal.signal(signal.SIGHUP, lambda signum, frame: None)

import jax  # noqa: E402
import pytest  # noqa: E402

# The backend starts now, with the 8 devices: a program called in this process (helpers.cli)
# sets XLA_FLAGS for its --host-devices, which must not reach a backend that starts after it.
assert jax.device_count() == 8, "conftest must set XLA_FLAGS before jax is imported"

from megajax.config import Config, ModelConfig, TrainConfig  # noqa: E402
from megajax.core.mesh import make_mesh  # noqa: E402


def tiny_config(**model) -> Config:
    """A model every test mesh divides: 8 heads, hidden 64, ffn 256, vocab 100 -> 128."""
    fields = dict(
        num_layers=2,
        hidden=64,
        num_heads=8,
        seq_len=16,
        vocab_size=100,
        vocab_multiple=128,
        hidden_dropout=0.1,
        attention_dropout=0.1,
    )
    fields.update(model)
    return Config(
        model=ModelConfig(**fields),
        train=TrainConfig(batch_size=8, lr=1e-2, warmup_steps=1, steps=10, min_lr=1e-3),
    ).validate()


def mesh_for(spec: str):
    """A mesh over the first data*model devices, so 1x2 or 2x2 meshes also work on 8 devices."""
    d, m = (int(x) for x in spec.split("x"))
    return make_mesh(spec, devices=jax.devices()[: d * m])


@pytest.fixture(scope="session")
def devices():
    assert len(jax.devices()) == 8, "conftest must set XLA_FLAGS before jax is imported"
    return jax.devices()


def built_once(tmp_path_factory, name: str, build) -> Path:
    """The directory `build(path)` makes, built once for the whole test run however many
    pytest-xdist workers ask for it: the first builds it under a lock, the others wait for it
    and reuse it. The tests only read it; one that changes a workdir copies it first."""
    import fcntl

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the run's directory, which the workers' own are in
    path = root / name
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (root / f"{name}.built").exists():
            shutil.rmtree(path, ignore_errors=True)
            build(path)
            (root / f"{name}.built").touch()
    return path


@pytest.fixture(scope="session")
def trained_gpt(tmp_path_factory):
    """The suite's tiny trained GPT: an uninterrupted 16-step train.py run on 2x4 (character-level
    Tiny Shakespeare, checkpoints and validation at steps 8 and 16) that the resumed, moved and
    damaged runs must reproduce, and that evaluation and conversion read. (workdir, {step: loss},
    what train.py printed)."""
    from helpers import BASE, losses, run

    def build(path: Path):
        p = run(
            *BASE,
            "--mesh",
            "2x4",
            "--workdir",
            path,
            "--steps",
            "16",
            "--save-every",
            "8",
            "--eval-every",
            "8",
        )
        (path.parent / f"{path.name}.stdout").write_text(p.stdout)

    wd = built_once(tmp_path_factory, "trained_gpt", build)
    return wd, losses(wd), (wd.parent / f"{wd.name}.stdout").read_text()


# Settings of the Hugging Face fixtures' imports: float32 throughout, and the vocabulary padded to
# a multiple of 128 (300 -> 384, 320 -> 384), which every test mesh divides.
HF_IMPORT_SETTINGS = ["model.compute_dtype=float32", "model.vocab_multiple=128"]
HF_NAMES = (
    "gpt2",
    "bert",
    "megatron_bert",
    "llama",
    "llama_tied",
    "mistral",
    "qwen2",
    "qwen3",
    "mixtral",
    "qwen2_moe",
    "qwen3_moe",
    "mistral_window",
    "qwen2_window",
)


@pytest.fixture(scope="session")
def hf_imported(tmp_path_factory) -> dict:
    """{name: (its imported config, its workdir)} for each tests/fixtures/hf/ model, imported once
    for the test run with HF_IMPORT_SETTINGS (megajax.convert.import_hf)."""
    from megajax.config import load_config
    from megajax.convert import import_hf

    def build(path: Path):
        for name in HF_NAMES:
            import_hf(ROOT / "tests" / "fixtures" / "hf" / name, path / name, HF_IMPORT_SETTINGS)

    root = built_once(tmp_path_factory, "hf_imported", build)
    return {name: (load_config(str(root / name / "config.json")), root / name) for name in HF_NAMES}


def file_size_limited(*args: str, kib: int = 64) -> list[str]:
    """A Python command line (`python ARGS...`) in which no file may grow past `kib` KiB: a
    write fails as a full disk or a quota makes it fail (EFBIG), without needing either. The
    child sets the limit itself: forking a process that runs JAX's threads is unsafe."""
    code = (
        f"import os, resource, sys; resource.setrlimit(resource.RLIMIT_FSIZE, ({kib * 1024}, "
        "resource.getrlimit(resource.RLIMIT_FSIZE)[1])); os.execv(sys.executable, "
        "[sys.executable] + sys.argv[1:])"
    )
    return [sys.executable, "-c", code, *args]


def handles_signal(pid: int, sig: int) -> bool:
    """Whether process `pid` has installed its own handler for `sig` (Linux: /proc/PID/status),
    so that a test can signal a program once it is listening, without guessing a delay."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    return False


# The two tiers (docs/testing.md): the default run takes every feature family once; `--full`
# adds the cases marked `full` (every mesh x schedule grid, every docs command, every signal
# case), what .ci/run runs.
def pytest_addoption(parser):
    parser.addoption(
        "--full",
        action="store_true",
        help="megajax's full tier: the default tests and those marked `full`",
    )


# Seconds each test took in a full run on a 2-core machine (scripts/test_durations.py writes
# them): pytest-xdist's workers take whole files in collection order, so the files go longest
# first (by what the selected tests of each take), and no long file is left to run alone at
# the end. A test not listed yet counts as DEFAULT_SECONDS.
DURATIONS = ROOT / "tests" / "durations.json"
DEFAULT_SECONDS = 2.0


def pytest_collection_modifyitems(config, items):
    if not config.getoption("--full"):
        extra = [item for item in items if item.get_closest_marker("full")]
        if extra:
            config.hook.pytest_deselected(items=extra)
            items[:] = [item for item in items if not item.get_closest_marker("full")]
    seconds = json.loads(DURATIONS.read_text()) if DURATIONS.is_file() else {}
    per_file: dict[str, float] = {}
    for item in items:
        per_file[item.path.name] = per_file.get(item.path.name, 0.0) + seconds.get(
            item.nodeid, DEFAULT_SECONDS
        )
    items.sort(key=lambda item: -per_file[item.path.name])  # stable: tests keep their order
