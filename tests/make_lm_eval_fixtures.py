"""lm-evaluation-harness's own numbers for tests/test_lm_eval.py: `lm_eval --model hf` (its
HFLM, PyTorch and transformers) on the random Llama fixture (tests/fixtures/hf/llama), on the
three local tasks of tests/fixtures/lm_eval (multiple choice, rolling perplexity, generation).

Run by hand where PyTorch, transformers and lm_eval are installed (never by the test suite):

    python -m venv /tmp/hfenv && /tmp/hfenv/bin/pip install torch transformers lm_eval==0.4.13
    /tmp/hfenv/bin/python tests/make_lm_eval_fixtures.py

from the repository's root (the task files name their data relative to it). It writes
tests/fixtures/lm_eval/hf_llama.json: each task's metrics and each request's response (the
log-likelihoods and greedy flags, the generated text), in lm-eval's order.
"""

from __future__ import annotations

import json
from pathlib import Path

import lm_eval
import torch
from lm_eval.models.huggingface import HFLM
from lm_eval.tasks import TaskManager

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures" / "lm_eval"
TASKS = ["megajax_mc", "megajax_ppl", "megajax_gen"]


def main():
    torch.manual_seed(0)
    llama = str(ROOT / "tests" / "fixtures" / "hf" / "llama")
    lm = HFLM(pretrained=llama, dtype="float32", device="cpu")
    out = lm_eval.simple_evaluate(
        model=lm,
        tasks=TASKS,
        task_manager=TaskManager(include_path=str(FIXTURES)),
        log_samples=True,
    )
    record = {
        "lm_eval": lm_eval.__version__,
        "max_length": lm.max_length,
        "results": out["results"],
        "responses": {
            task: [s["filtered_resps"] for s in samples] for task, samples in out["samples"].items()
        },
    }
    (FIXTURES / "hf_llama.json").write_text(json.dumps(record, indent=1, default=str) + "\n")
    print(json.dumps(out["results"], indent=1))


if __name__ == "__main__":
    main()
