"""eval.py / megajax-eval: the parser and the checks that need no model. What each --task
does is the table in megajax/evaluation/tasks.py."""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
from pathlib import Path

from megajax.cli.common import (
    Parser,
    add_distributed_args,
    bound_shutdown,
    exit_on_signal,
    fail,
    failed,
    given,
    guard_stdout,
    program_devices,
    set_host_devices,
    spec_paths,
    start_jax,
)
from megajax.errors import UserError
from megajax.files import write_atomic
from megajax.host.signals import STOP_SIGNALS

TASK_CHOICES = [
    "ppl",
    "wikitext",
    "lambada",
    "sample",
    "chat",
    "lm-eval",
    "mlm",
    "race",
    "mnli",
    "qqp",
]


def eval_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="eval.py",
        description="Evaluate or sample a train.py workdir (GPT or BERT) on any mesh.",
        epilog="examples:\n"
        "  python eval.py --workdir runs/default --task ppl --data text:notes.txt\n"
        "  python eval.py --workdir runs/gpt --task wikitext --data data/wikitext-2/test.txt\n"
        "  python eval.py --workdir runs/gpt --task lambada --data lambada_test.jsonl\n"
        "  python eval.py --workdir runs/default --task sample --prompt 'def main(' "
        "--host-devices 8 --mesh 2x4\n"
        "  python eval.py --workdir runs/sft --task chat --prompt 'Name a colour.'\n"
        "  python eval.py --workdir runs/bert_race --task race --data RACE",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--workdir",
        type=given,
        required=True,
        help="a train.py (or megajax-convert import) workdir",
    )
    p.add_argument("--task", required=True, choices=TASK_CHOICES, help="what to evaluate")
    p.add_argument(
        "--data",
        type=given,
        help="ppl: text:PATH | bin:PATH | megatron:PREFIX | PATH; wikitext: the .txt file; "
        "lambada: the .jsonl file; mlm: text:PATH | PATH | builtin | megatron:PREFIX; "
        "race/mnli/qqp: the task's directory; chat: a .jsonl file of conversations to answer "
        "(instead of --prompt)",
    )
    p.add_argument(
        "--split",
        help="race: dev | test (default test); mnli: dev_matched | dev_mismatched; qqp: dev",
    )
    p.add_argument(
        "--mesh",
        default="auto",
        help="any mesh, whatever the run was trained on: data=2,model=4 | 2x4 | auto (as train.py "
        "--mesh auto runs the workdir's config)",
    )
    p.add_argument(
        "--host-devices", type=int, help="simulate N devices on the CPU (before jax starts)"
    )
    p.add_argument("--step", type=int, help="checkpoint step (default: the latest)")
    p.add_argument("--out", type=given, help="JSON result file (default: WORKDIR/eval_TASK.json)")
    p.add_argument(
        "--stride",
        type=int,
        help="ppl, wikitext: overlapping-window stride (default 32, the paper's)",
    )
    p.add_argument("--batch-size", type=int, help="rows a step (default 8)")
    p.add_argument("--prompt", help="sample: the text to continue; chat: the user's message")
    p.add_argument(
        "--max-new-tokens",
        type=int,
        help="sample (default 200): streamed as generated, any number; Ctrl-C stops it, writing "
        "no result",
    )
    p.add_argument("--temperature", type=float, help="sample (default 0.8; 0 is greedy)")
    p.add_argument("--top-k", type=int, help="sample (default 40; 0 is no limit)")
    p.add_argument("--seed", type=int, help="sample (default 0)")
    p.add_argument(
        "--lm-eval-tasks", help="lm-eval: the harness's task names, comma-separated (T1,T2)"
    )
    p.add_argument(
        "--lm-eval-include", type=given, help="lm-eval: a directory of task YAML files of your own"
    )
    p.add_argument("--limit", type=int, help="lm-eval: at most N documents a task")
    p.add_argument("--num-fewshot", type=int, help="lm-eval: examples in each prompt")
    p.add_argument(
        "--apply-chat-template",
        action="store_true",
        default=None,
        help="lm-eval: render each prompt through the tokenizer's chat template",
    )
    add_distributed_args(p)
    return p


READS_DATA = tuple(task for task in TASK_CHOICES if task not in ("sample", "chat", "lm-eval"))
SAMPLES = ("sample", "chat")
# An argument only some tasks read -> (those tasks, its default). Given to another task it is
# refused (before: silently unused, e.g. --task wikitext --split dev scored the whole file).
TASK_ARGS = {
    "data": ((*READS_DATA, "chat"), None),
    "split": (("race", "mnli", "qqp"), None),
    "batch_size": ((*READS_DATA, "lm-eval"), 8),
    "stride": (("ppl", "wikitext"), 32),
    "prompt": (SAMPLES, ""),
    "max_new_tokens": (SAMPLES, 200),
    "temperature": (SAMPLES, 0.8),
    "top_k": (SAMPLES, 40),
    "seed": (SAMPLES, 0),
    "lm_eval_tasks": (("lm-eval",), None),
    "lm_eval_include": (("lm-eval",), None),
    "limit": (("lm-eval",), None),
    "num_fewshot": (("lm-eval",), None),
    "apply_chat_template": (("lm-eval",), False),
}


def check_eval_args(args):
    """Everything about eval.py's arguments that can be checked before loading a model; the
    arguments of TASK_ARGS take their defaults here."""
    for name, (tasks, default) in TASK_ARGS.items():
        if getattr(args, name) is not None and args.task not in tasks:
            raise UserError(
                f"--{name.replace('_', '-')} is for --task {', '.join(tasks)}; --task {args.task} "
                "does not use it"
            )
        if getattr(args, name) is None:
            setattr(args, name, default)
    if args.task == "chat" and bool(args.prompt) == bool(args.data):
        raise UserError(
            "--task chat answers --prompt TEXT or the conversations of --data FILE.jsonl: give "
            "one of them"
        )
    if args.task in SAMPLES:
        if args.max_new_tokens < 1:
            raise UserError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
        if not (math.isfinite(args.temperature) and args.temperature >= 0):
            raise UserError(f"--temperature must be 0 (greedy) or positive, got {args.temperature}")
        if args.top_k < 0:
            raise UserError(f"--top-k must be 0 (no limit) or positive, got {args.top_k}")
        if not 0 <= args.seed < 2**31:
            raise UserError(f"--seed must be in 0..2^31-1, got {args.seed}")
    if args.task == "lm-eval":
        if not args.lm_eval_tasks:
            raise UserError("--task lm-eval needs --lm-eval-tasks T1[,T2...]")
        for name in ("limit", "num_fewshot"):
            value = getattr(args, name)
            if value is not None and value < (1 if name == "limit" else 0):
                raise UserError(
                    f"--{name.replace('_', '-')} must be at least "
                    f"{1 if name == 'limit' else 0}, got {value}"
                )
        include = args.lm_eval_include
        if include is not None and not Path(include).is_dir():
            raise UserError(f"--lm-eval-include {include}: not a directory")
    if args.batch_size < 1:
        raise UserError(f"--batch-size must be at least 1, got {args.batch_size}")
    out = Path(args.out) if args.out else None
    if out is not None and not (out.parent.is_dir() and os.access(out.parent, os.W_OK | os.X_OK)):
        raise UserError(
            f"--out {out}: the directory {out.parent} does not exist or is not writable"
        )
    workdir = Path(args.workdir)
    # where the result goes: checked before anything runs
    result = out or workdir / f"eval_{args.task}.json"
    if out is None and workdir.is_dir() and not os.access(workdir, os.W_OK | os.X_OK):
        raise UserError(
            f"{workdir} is not writable, and the result goes to {result} by default: give --out "
            "elsewhere"
        )
    if out is not None and out.is_dir():
        raise UserError(f"--out {out} is a directory: give the JSON file's path")
    _refuse_replacing_data(result, args.data)
    if args.task in READS_DATA and not args.data:
        raise UserError(f"--task {args.task} needs --data")


def _refuse_replacing_data(out: Path, data: str | None):
    """The result must not replace what --data reads: the file itself, or a file in its directory
    (RACE, GLUE). It would be read whole, then replaced by the JSON."""
    if not (data and out.exists()):
        return
    kind, paths = spec_paths(data)
    if kind == "megatron:":  # PREFIX names PREFIX.bin and PREFIX.idx
        paths = [
            f"{p.removesuffix('.bin').removesuffix('.idx')}{end}"
            for p in paths
            for end in (".bin", ".idx")
        ]
    for path in map(Path, filter(None, paths)):
        if not path.exists():
            continue
        if out.samefile(path) or (path.is_dir() and path.resolve() in out.resolve().parents):
            raise UserError(
                f"--out {out} would replace the data it evaluates ({path}): give another file"
            )


def eval_main(argv=None) -> int:
    guard_stdout()
    args = eval_parser().parse_args(argv)
    set_host_devices(args.host_devices)
    # it appears whole at the end, or not at all
    exit_on_signal("stopped by {signal}: no result was written")
    return bound_shutdown(_evaluate(args))


def _evaluate(args) -> int:
    try:
        check_eval_args(args)
        start_jax(args)
        args.devices = program_devices(args.host_devices)
        # jax is imported only now, with --host-devices in XLA_FLAGS (megajax/cli/common.py).
        from megajax.evaluation.tasks import run_task

        result, is_main = run_task(args, _resolve(args))
        if is_main:
            out = Path(args.out) if args.out else Path(args.workdir) / f"eval_{args.task}.json"
            write_atomic(out, json.dumps(result, indent=2) + "\n")
            for sig in STOP_SIGNALS:  # written: a signal now ends it as usual
                signal.signal(sig, signal.SIG_DFL)
            print(f"wrote {out}")
    except UserError as e:
        return fail(str(e))
    except Exception as e:  # noqa: BLE001
        return failed(e, "lower --batch-size, or use a larger model axis (--mesh)")
    return 0


def _resolve(args):
    """The run to evaluate, resolved once: the workdir's config, and --mesh as train.py resolves
    it ("auto" is the mesh train.py --mesh auto runs that config on: every device on "data"
    when it fits there)."""
    from megajax.core.mesh import make_mesh
    from megajax.plan.auto import resolve_mesh
    from megajax.runs.spec import RunSpec
    from megajax.runs.workdir import workdir_config

    cfg = workdir_config(Path(args.workdir))
    try:
        shape, why = resolve_mesh(args.mesh, lambda: cfg, args.devices)
        run = RunSpec(cfg, make_mesh(shape, args.devices), Path(args.workdir))
    except ValueError as e:
        raise UserError(str(e)) from None
    if why:
        print(f"megajax: {why}", file=sys.stderr, flush=True)
    return run
