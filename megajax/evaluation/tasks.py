"""What each `eval.py --task` does: a table of small functions, each (args, loaded workdir,
progress) -> (result dict, table rows), and the workdir tasks it accepts."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import numpy as np

from megajax.data.bert_pretrain import load_pretraining, pretraining_from_documents
from megajax.data.megatron import sentence_documents
from megajax.data.prepared import load_pairs
from megajax.data.sentences import Specials
from megajax.data.sources import source_text
from megajax.data.tokens import load_tokens
from megajax.errors import UserError
from megajax.evaluation.bert import evaluate_pretraining, evaluate_task
from megajax.evaluation.chat import answer, conversations_to_answer
from megajax.evaluation.lambada import evaluate_lambada
from megajax.evaluation.scoring import perplexity_of_tokens
from megajax.evaluation.wikitext import evaluate_wikitext
from megajax.mesh_shape import MeshShape
from megajax.models.generate import generate
from megajax.progress import Progress
from megajax.runs.spec import RunSpec
from megajax.runs.workdir import Loaded, is_main, load_workdir, refuse_run_file
from megajax.specs import DataSpec, is_blend
from megajax.tasks import task_for


def data_source(arg: str) -> DataSpec:
    """--data as train.py reads it (builtin, text:, bin:, megatron:, tfds:), or a bare path: a text
    file. A blend is scored one source at a time (train.py reports each one's validation loss)."""
    if is_blend(arg):
        raise UserError(
            f"--data '{arg}' is a blend: eval.py scores one source at a time (give one of them)"
        )
    return DataSpec.of(arg, bare_path_is_text=True)


def ppl(args, loaded: Loaded, progress):
    source = data_source(args.data)
    data = load_tokens(
        source, val_fraction=0.0, bin_dtype=loaded.cfg.data.bin_dtype, tokenizer=loaded.tokenizer
    )
    # A corpus prepared by megajax-prepare: its held-out split, the one train.py's val_loss reads.
    tokens, split = (data.val, "val") if data.prepared else (data.train, None)
    if len(tokens) < 2:
        lacks = "no held-out split (prepared with --val-fraction 0)" if split else "under 2 tokens"
        raise UserError(f"{source} has {lacks}: nothing to score")
    if int(np.max(tokens)) >= loaded.cfg.model.vocab_size:
        raise UserError(
            f"{source} has token id {int(np.max(tokens))}, beyond the model's vocabulary of "
            f"{loaded.cfg.model.vocab_size:,} (another tokenizer, or data.bin_dtype?)"
        )
    r = perplexity_of_tokens(loaded.model, tokens, args.stride, args.batch_size, progress)
    if split is not None:
        r["split"] = split
    return r, [
        *([("split", f"{split} (held out by megajax-prepare)")] if split else []),
        ("tokens scored", r["tokens"]),
        ("loss", r["loss"]),
        ("perplexity", r["ppl"]),
    ]


def wikitext(args, loaded: Loaded, progress):
    r = evaluate_wikitext(
        loaded.model, loaded.tokenizer, Path(args.data), args.stride, args.batch_size, progress
    )
    return r, [
        ("subword tokens T", r["tokens"]),
        ("original tokens T_o", r["original_tokens"]),
        ("loss per token", r["loss"]),
        ("perplexity", r["ppl"]),
        ("adjusted perplexity exp(L/T_o), the paper's", r["adjusted_ppl"]),
        ("adjusted perplexity exp(L/(T_o-1)), Megatron's script", r["adjusted_ppl_megatron"]),
    ]


def lambada(args, loaded: Loaded, progress):
    r = evaluate_lambada(loaded.model, loaded.tokenizer, Path(args.data), args.batch_size, progress)
    return r, [
        ("passages", r["passages"]),
        ("correct", r["correct"]),
        ("accuracy", r["accuracy"]),
        ("mean target loss", r["mean_target_loss"]),
    ]


def sample(args, loaded: Loaded, progress):
    """The completion is printed as it is generated (any --max-new-tokens shows its text from the
    first token on; Ctrl-C stops it, writing no result), and written whole at the end."""
    prompt = loaded.tokenizer.encode(args.prompt) or [0]
    stream = Stream(loaded.tokenizer, args.prompt, enabled=is_main())
    new = generate(
        loaded.model,
        np.asarray([prompt]),
        args.max_new_tokens,
        args.temperature,
        args.top_k,
        jax.random.key(args.seed),
        eos_id=loaded.tokenizer.eos_id,
        emit=stream.add,
    )
    text = loaded.tokenizer.decode(new[0])
    stream.close(text)
    return {"prompt": args.prompt, "completion": text, "tokens": new[0].tolist()}, None


class Stream:
    """A sample's text on stdout as its tokens come. Each token's text is the growth of the whole
    decoded text, held back while it ends in an unfinished character (a byte-level tokenizer's
    first byte of a multi-byte one decodes as U+FFFD until the rest arrives)."""

    def __init__(self, tokenizer, prompt: str, enabled: bool):
        self.tokenizer, self.enabled, self.tokens, self.shown = tokenizer, enabled, [], ""
        if enabled:
            print(prompt, end="", flush=True)

    def add(self, tokens: np.ndarray):
        self.tokens.append(int(tokens[0]))
        text = self.tokenizer.decode(self.tokens)
        if self.enabled and text.startswith(self.shown) and not text.endswith("\ufffd"):
            print(text[len(self.shown) :], end="", flush=True)
            self.shown = text

    def close(self, text: str):
        if self.enabled:
            print(text[len(self.shown) :] if text.startswith(self.shown) else "", flush=True)


def chat(args, loaded: Loaded, progress):
    """The assistant's answer to --prompt (streamed), or to each conversation of --data."""
    key = jax.random.key(args.seed)
    if args.prompt:
        stream = Stream(loaded.tokenizer, "", enabled=is_main())
        r = answer(
            loaded.model,
            loaded.tokenizer,
            [{"role": "user", "content": args.prompt}],
            args.max_new_tokens,
            args.temperature,
            args.top_k,
            key,
            emit=stream.add,
        )
        stream.close(loaded.tokenizer.decode(r["tokens"]))
        return {"prompt": args.prompt, **r}, None
    answers, asked = [], conversations_to_answer(args.data)
    for i, messages in enumerate(asked):
        r = answer(
            loaded.model,
            loaded.tokenizer,
            messages,
            args.max_new_tokens,
            args.temperature,
            args.top_k,
            jax.random.fold_in(key, i),
        )
        answers.append({"messages": messages, **r})
        progress(i + 1, len(asked))
    rows = [(f"answer {i + 1}", a["answer"][:60]) for i, a in enumerate(answers)]
    return {"answers": answers}, rows


def mlm(args, loaded: Loaded, progress):
    source = data_source(args.data)
    cfg = dataclasses.replace(
        loaded.cfg, data=dataclasses.replace(loaded.cfg.data, val_fraction=0.0)
    )
    # a megajax-prepare --pairs corpus: its held-out pairs, the ones train.py's val_* read
    if source.kind == "pairs":
        pairs, split = load_pairs(Path(source.arg), loaded.tokenizer, cfg.model.seq_len)[1], "val"
        if not len(pairs):
            raise UserError(
                f"{source.arg} has no held-out pairs (prepared with --val-fraction 0): nothing to "
                "score"
            )
    elif source.kind == "megatron":  # a Megatron-LM dataset with --split-sentences: all of it
        docs = sentence_documents(source.arg, loaded.tokenizer, str(source))
        pairs, split = pretraining_from_documents(docs, loaded.tokenizer, cfg).train_pairs, None
    else:
        pairs, split = (
            load_pretraining(source_text(source), loaded.tokenizer, cfg).train_pairs,
            None,
        )
    r = evaluate_pretraining(
        loaded.model, pairs, cfg, Specials.of(loaded.tokenizer), loaded.tokenizer, args.batch_size
    )
    if split is not None:
        r["split"] = split
    return r, [
        *([("split", f"{split} (held out by megajax-prepare)")] if split else []),
        ("sentence pairs", r["pairs"]),
        ("masked tokens", r["masked_tokens"]),
        ("MLM loss", r["mlm_loss"]),
        ("MLM accuracy", r["mlm_accuracy"]),
        ("SOP loss", r["sop_loss"]),
        ("SOP accuracy", r["sop_accuracy"]),
    ]


def fine_tuned(args, loaded: Loaded, progress):
    split = args.split or ("test" if args.task == "race" else "dev")
    r = evaluate_task(
        loaded.model, args.task, Path(args.data), split, loaded.tokenizer, args.batch_size
    )
    rows = [("split", split), ("examples", r["examples"]), ("accuracy", r["accuracy"])]
    rows += [
        (f"accuracy ({lvl}, {r[f'examples_{lvl}']})", r[f"accuracy_{lvl}"])
        for lvl in ("middle", "high")
        if f"accuracy_{lvl}" in r
    ]
    return r, rows


def lm_eval_task(args, loaded: Loaded, progress):
    """lm-evaluation-harness in this process; its imports (datasets, pandas: seconds) only
    for this task."""
    from megajax.evaluation.harness import lm_eval_task as run_harness

    return run_harness(args, loaded, progress)


GPT = ("gpt", "a GPT workdir")
# eval.py --task -> (the training task its workdir must hold, what to call it, the function)
EVAL_TASKS = {
    "ppl": (*GPT, ppl),
    "wikitext": (*GPT, wikitext),
    "lambada": (*GPT, lambada),
    "sample": (*GPT, sample),
    "chat": (*GPT, chat),
    "lm-eval": (*GPT, lm_eval_task),
    "mlm": ("bert", "a pretrained BERT workdir", mlm),
    **{
        name: (name, f"a BERT workdir fine-tuned on {name}", fine_tuned)
        for name in ("race", "mnli", "qqp")
    },
}


def run_task(args, run: RunSpec) -> tuple[dict, bool]:
    """What `eval.py` does for args.task on the resolved `run` (the workdir's config, the
    mesh): prints a short table; returns the full result and whether this process writes it."""
    if args.out:
        refuse_run_file(Path(args.out))
    mesh = run.mesh
    loaded = load_workdir(run.workdir, mesh, args.step, cfg=run.cfg)
    needs, what, run = EVAL_TASKS[args.task]
    m = loaded.cfg.model
    if task_for(loaded.cfg).name != needs:
        raise UserError(
            f"--task {args.task} needs {what}; {args.workdir} holds {m.kind} ({m.task})"
        )
    main = is_main()
    result, rows = run(args, loaded, Progress(unit="row", enabled=main).advance)
    refuse_non_finite(result, loaded, args)
    head = {
        "task": args.task,
        "workdir": str(args.workdir),
        "step": loaded.step,
        "mesh": MeshShape.of(mesh).sizes(),
    }
    if main and rows is not None:  # a sample has printed itself as it went
        print(table([("step", loaded.step), *rows]))
    return {**head, **result}, main


def refuse_non_finite(result: dict, loaded: Loaded, args):
    """A NaN or infinite metric is no result: the weights diverged (or overflow in their compute
    dtype on this data). One line naming the checkpoint, and no result file."""
    bad = {k: v for k, v in result.items() if isinstance(v, float) and not np.isfinite(v)}
    if bad:
        listed = ", ".join(f"{k} {v}" for k, v in bad.items())
        raise UserError(
            f"checkpoint step {loaded.step} of {args.workdir} gives {listed} on this data: its "
            "weights diverged or overflow; no result written (an earlier checkpoint: --step)"
        )


def table(rows: list[tuple[str, object]]) -> str:
    width = max(len(k) for k, _ in rows)
    fmt = lambda v: (
        f"{v:,.4f}" if isinstance(v, float) else f"{v:,}" if isinstance(v, int) else str(v)
    )  # noqa: E731
    return "\n".join(f"{k.ljust(width)}  {fmt(v)}" for k, v in rows)
