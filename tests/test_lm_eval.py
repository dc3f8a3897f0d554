"""lm-evaluation-harness in process (megajax/evaluation/harness.py) against the harness's own
`hf` model: tests/fixtures/lm_eval/hf_llama.json holds what `lm_eval --model hf` (PyTorch,
transformers) gives on the random Llama fixture for three local tasks of the three request
kinds (tests/make_lm_eval_fixtures.py, run by hand). megajax, on one device and on 2x4, gives
the same accuracies and exact matches, the perplexities within 1e-4, and each request's
log-likelihood within the float32 bound."""

from __future__ import annotations

import json
import math
import sys

import pytest
from helpers import ROOT, cli, tiered
from tolerances import assert_close

FIXTURES = ROOT / "tests" / "fixtures" / "lm_eval"
TASKS = "megajax_mc,megajax_ppl,megajax_gen"
EXACT = ("acc,none", "acc_norm,none", "exact_match,none")
PERPLEXITIES = ("word_perplexity,none", "byte_perplexity,none", "bits_per_byte,none")


@pytest.fixture(scope="module")
def reference():
    return json.loads((FIXTURES / "hf_llama.json").read_text())


@pytest.fixture(scope="module")
def llama(hf_imported):
    return hf_imported["llama"][1]


@pytest.mark.parametrize("mesh", tiered(["1x1", "2x4"], "2x4"))
def test_the_harness_gives_its_hf_models_numbers(llama, reference, mesh, tmp_path):
    out = tmp_path / "result.json"
    p = cli(
        "eval",
        *("--workdir", str(llama), "--task", "lm-eval", "--lm-eval-tasks", TASKS),
        *("--lm-eval-include", str(FIXTURES), "--mesh", mesh),
        *("--host-devices", str(math.prod(int(n) for n in mesh.split("x")))),
        *("--out", str(out)),
    )
    assert p.returncode == 0, p.stderr
    assert "|megajax_mc |" in p.stdout  # lm-eval's own table
    check_results(json.loads(out.read_text())["lm_eval"]["results"], reference)


def check_results(got, reference):
    assert sorted(got) == sorted(reference["results"])
    for task, want in reference["results"].items():
        for metric in EXACT:
            if metric in want:
                assert got[task][metric] == want[metric], (task, metric)
        for metric in PERPLEXITIES:
            if metric in want:
                assert got[task][metric] == pytest.approx(want[metric], rel=1e-4), (task, metric)


@pytest.mark.full
def test_two_processes_give_the_same_numbers(llama, reference, tmp_path):
    """eval.py over two processes (4 simulated devices each, one 2x4 mesh): every process runs
    the harness alike, the first writes lm-eval's results, the hf model's numbers again."""
    from test_multiprocess import two_processes

    out = tmp_path / "result.json"
    outs = two_processes(
        *("--workdir", str(llama), "--task", "lm-eval", "--lm-eval-tasks", TASKS),
        *("--lm-eval-include", str(FIXTURES), "--mesh", "2x4", "--out", str(out)),
        timeout=300,
        program="eval.py",
    )
    assert "|megajax_mc |" in outs[0][0] and "|megajax_mc |" not in outs[1][0]
    check_results(json.loads(out.read_text())["lm_eval"]["results"], reference)


def test_each_requests_response_is_the_hf_models(llama, reference):
    """Every request's log-likelihood (within float32's bound), greedy flag and generated text."""
    import lm_eval
    from conftest import mesh_for
    from lm_eval.tasks import TaskManager

    from megajax.evaluation.harness import make_lm
    from megajax.runs.workdir import load_workdir

    loaded = load_workdir(llama, mesh_for("1x1"))
    out = lm_eval.simple_evaluate(
        model=make_lm(loaded, 8),
        tasks=TASKS.split(","),
        task_manager=TaskManager(include_path=str(FIXTURES)),
        log_samples=True,
        torch_random_seed=None,
    )
    assert loaded.model.cfg.context == reference["max_length"]
    for task, want in reference["responses"].items():
        got = [s["filtered_resps"] for s in out["samples"][task]]
        assert len(got) == len(want)
        for g, w in zip(got, want):
            if task == "megajax_gen":
                assert g == w
                continue
            g, w = parts(g), parts(w)
            assert_close([x[0] for x in g], [x[0] for x in w], what=task)
            assert [x[1] for x in g] == [x[1] for x in w]


def parts(response) -> list[tuple[float, str | None]]:
    """A request's filtered response as (log-likelihood, greedy flag or None) per item."""
    return [
        (float(x[0]), str(x[1])) if isinstance(x, (list, tuple)) else (float(x), None)
        for x in response
    ]


def test_without_lm_eval_installed_one_line(llama, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "lm_eval", None)
    p = cli(
        "eval",
        *("--workdir", str(llama), "--task", "lm-eval", "--lm-eval-tasks", "megajax_mc"),
        *("--out", str(tmp_path / "r.json")),
    )
    assert p.returncode == 2 and "pip install 'lm_eval==" in p.stderr
    assert p.stderr.count("\n") == 1 and not (tmp_path / "r.json").exists()


@pytest.mark.parametrize(
    "args,words",
    [
        ([], "needs --lm-eval-tasks"),
        (["--lm-eval-tasks", "no_such_task", "--lm-eval-include", str(FIXTURES)], "no task"),
        (["--lm-eval-tasks", "megajax_mc", "--limit", "0"], "--limit must be"),
        (["--lm-eval-tasks", "megajax_mc", "--lm-eval-include", "/nonexistent"], "not a dir"),
        (["--lm-eval-tasks", "megajax_mc", "--data", "text:x"], "--data is for"),
    ],
)
def test_a_mistake_is_one_line(llama, args, words, tmp_path):
    p = cli(
        "eval",
        *("--workdir", str(llama), "--task", "lm-eval", *args),
        *("--out", str(tmp_path / "r.json")),
    )
    assert p.returncode == 2 and words in p.stderr and p.stderr.count("\n") == 1, p.stderr
