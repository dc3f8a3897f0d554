"""The package's shape, as megajax/__init__.py describes it: layers whose imports only point
down, small modules and functions, and no import done inside a function except where a
comment says why (optional heavy packages; the command lines' deferral of jax)."""

import ast
import re
import subprocess
import sys

from conftest import ROOT

PACKAGE = ROOT / "megajax"
# Lowest first; a module may import from its own layer and the ones before it.


def documented_layers() -> list[tuple[str, ...]]:
    """The layer table of docs/architecture.md, lowest first: the one statement of the rule."""
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    table = text.split("## Layers", 1)[1].split("## ", 1)[0]
    rows = [line for line in table.splitlines() if re.match(r"\| \d+ \|", line)]
    return [tuple(re.findall(r"`(\w+)`", row.split("|")[2].split("(")[0])) for row in rows]


LAYERS = documented_layers()
# Imports inside functions that are there on purpose (module -> what it imports there).
DEFERRED = {
    "cli.common": {"jax", "megajax.host.distributed"},
    "cli.train": {
        "megajax.core.mesh",
        "megajax.tools.dry_run",
        "megajax.training.loop",
        "megajax.runs.workdir",
        "megajax.runs.spec",
        "megajax.tasks",
        "megajax.training.profiling",
        "megajax.tools.profile",
        "jax",
        "megajax.core.sharding",
        "megajax.plan.memory",
        "megajax.training.memory",
        "megajax.plan.auto",
    },
    "cli.plot": {"megajax.runs.metrics", "megajax.runs.workdir"},
    "cli.eval": {
        "megajax.evaluation.tasks",
        "megajax.core.mesh",
        "megajax.plan.auto",
        "megajax.runs.spec",
        "megajax.runs.workdir",
    },
    "cli.plan": {"jax", "megajax.config", "megajax.plan", "megajax.plan.report"},
    "cli.convert": {"megajax.convert"},
    "cli.prepare": {"megajax.prepare"},
    "data.sources": {"tensorflow_datasets"},
    "host.xla_cache": {"jax._src"},  # jax's own compiler, on the one jaxlib it patches
    "runs.tracking": {
        "tensorboardX",
        "tensorboardX.event_file_writer",
        "tensorboardX.proto.event_pb2",
        "wandb",
    },
    "__main__": {"megajax.cli", "megajax.cli.plot"},  # the tool asked for, only
    "runs.metrics": {"matplotlib", "matplotlib.pyplot", "matplotlib.backends.backend_agg"},
    # lm-evaluation-harness (datasets, pandas: seconds to import) for --task lm-eval only
    "evaluation.tasks": {"megajax.evaluation.harness"},
}


def modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        name = ".".join(path.relative_to(PACKAGE).with_suffix("").parts).removesuffix(".__init__")
        yield name, path, ast.parse(path.read_text())


def layer(module: str) -> int:
    # `python -m megajax.X`: an entry point, like the command lines
    if module.endswith("__main__"):
        return len(LAYERS) - 1
    top = module.split(".")[0]
    return next(i for i, names in enumerate(LAYERS) if top in names)


# In ruff's layout (one argument a line once a call is too long for one): a module one reads in a
# sitting, a function one reads on a screen.
MODULE_LINES, FUNCTION_LINES = 450, 80


def test_modules_and_functions_are_small():
    for name, path, tree in modules():
        assert len(path.read_text().splitlines()) <= MODULE_LINES, name
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                assert lines <= FUNCTION_LINES, f"{name}.{node.name}"


def test_imports_point_down_and_stay_at_the_top():
    for name, _, tree in modules():
        if name == "":  # megajax/__init__.py: the lazy public API
            continue
        in_function = {
            id(n)
            for f in ast.walk(tree)
            if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
            for n in ast.walk(f)
        }
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            targets = (
                [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module]
            )
            if id(node) in in_function:
                assert set(targets) <= DEFERRED.get(name, set()), (
                    f"{name} imports {targets} inside a function"
                )
            for target in targets:
                if target.startswith("megajax."):
                    assert layer(target.removeprefix("megajax.")) <= layer(name), (
                        f"{name} imports {target}"
                    )


def test_command_lines_import_jax_only_after_their_flags():
    code = (
        "import sys, megajax.cli, megajax; print(sorted(m for m in ('jax', 'flax', 'optax') if m "
        "in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True
    )
    assert out.stdout.strip() == "[]"


def test_eval_task_choices_are_the_table():
    """eval.py's --task choices (its parser cannot import jax) are exactly the tasks of the
    table."""
    from megajax.cli.eval import TASK_CHOICES
    from megajax.evaluation.tasks import EVAL_TASKS

    assert sorted(TASK_CHOICES) == sorted(EVAL_TASKS)


def test_no_file_reads_data_from_beside_the_checkout():
    """A plain clone must pass the suite and run every documented command: nothing the project
    ships may name a data directory beside the checkout (the pattern is split so that this file
    does not name it either)."""
    beside = ("..", "/", "shared")
    needles = ("".join(beside), '"' + beside[2] + '" / "data"', beside[2] + "/data/")
    tracked = subprocess.run(
        ["git", "ls-files", "-z"], capture_output=True, text=True, cwd=ROOT, check=True
    )
    offenders = []
    for name in filter(None, tracked.stdout.split("\0")):
        path = ROOT / name
        if "fixtures" in path.parts or not path.is_file():
            continue
        text = path.read_bytes().decode("utf-8", errors="replace")
        offenders += [f"{name}: {n}" for n in needles if n in text]
    assert not offenders


def test_the_closed_forms_have_one_home():
    """FLOPs, activation bytes and collective elements are written once, in megajax/analytic/:
    the audit's minima, the planner, the log's MFU and the dry run's modelled bytes import it,
    and no other module writes the paper's FLOP constants or a layer's 4 b s h."""
    importers = set()
    for name, path, tree in modules():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module in ("megajax.analytic", "megajax"):
                if node.module == "megajax.analytic" or any(
                    a.name == "analytic" for a in node.names
                ):
                    importers.add(name)
        if name.split(".")[0] != "analytic":
            text = path.read_text()
            assert not re.search(r"\b(96|72) \* B\b|4 \* L \* bsh|12\.0 \* m\.num_layers", text), (
                name
            )
    assert {
        "tools.audit",
        "plan.volumes",
        "plan.memory",
        "plan.timing",
        "training.mfu",
        "tools.step_figures",
    } <= importers, importers


def test_data_and_tokenizer_specs_are_parsed_in_one_place():
    """A source or tokenizer spec ("text:a.txt", "hf:DIR") is split into kind and argument only
    by megajax/specs.py; every other module takes its DataSpec or TokenizerSpec."""
    splitting = [
        name
        for name, path, _ in modules()
        if name != "specs" and '.partition(":")' in path.read_text()
    ]
    assert splitting == []


def test_sequence_parallelism_is_read_from_the_config_in_one_place():
    """Layout.for_model turns model.sequence_parallel (and the purpose: training or inference)
    into the layout; every module reads the layout's flag. Besides it, only the mesh's size
    check reads the config's (the planner and the audit's analytic model describe a config)."""
    readers = {}
    for name, path, _ in modules():
        if name.split(".")[0] in ("core", "models", "tasks", "training", "evaluation", "data"):
            found = re.findall(r"(\w+)\.sequence_parallel\b", path.read_text())
            if [owner for owner in found if owner not in ("layout", "self")]:
                readers[name] = sorted(set(found))
    assert readers == {"core.sharding": ["cfg", "self"], "core.mesh": ["m"]}, readers


def test_first_line_of_any_exception():
    from megajax.errors import first_line

    assert first_line(ValueError("\n  bad thing \nmore")) == "bad thing"
    assert first_line(OSError()) == "OSError"
    assert first_line(RuntimeError("x" * 500), 10) == "x" * 10
