"""Evaluation as the paper measures it: WikiText perplexity with overlapping windows and
detokenized input, LAMBADA last-word accuracy, perplexity of any text, and sampling.

Everything runs on the mesh the user asks for, whatever mesh trained the checkpoint.
"""
from __future__ import annotations

import dataclasses
import json
import math
import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from megajax.checkpoint import Checkpoints
from megajax.config import FINETUNE_TASKS, Config, load_config
from megajax.data import read_utf8
from megajax.errors import UserError
from megajax.model import ModelDef, abstract_model
from megajax.sharding import Layout, param_shardings
from megajax.tokenizer import Tokenizer, load_tokenizer


# --- loading a workdir ------------------------------------------------------------------

@dataclasses.dataclass
class Loaded:
    cfg: Config
    model: object
    tokenizer: Tokenizer
    step: int


def load_workdir(workdir: Path, mesh, step: int | None = None) -> Loaded:
    """The resolved config, tokenizer and checkpointed weights of a train.py workdir, on `mesh`."""
    workdir = Path(workdir)
    if not (workdir / "config.json").is_file():
        raise UserError(f"{workdir} is not a megajax workdir (no config.json)")
    cfg = load_config(str(workdir / "config.json"))
    cfg.model.check_mesh(mesh.shape["model"])
    tokenizer = load_tokenizer(workdir)
    if not (workdir / "checkpoints").is_dir():
        raise UserError(f"no checkpoint in {workdir / 'checkpoints'}")
    ckpts = Checkpoints(workdir)
    steps = ckpts.all_steps()
    if not steps:
        raise UserError(f"no checkpoint in {workdir / 'checkpoints'}")
    if step is not None and step not in steps:
        raise UserError(f"no checkpoint for step {step} in {workdir}; have {sorted(steps)}")
    modeldef = ModelDef(abstract_model(cfg.model, Layout(mesh)))
    target = modeldef.abstract_sharded_params(param_shardings(mesh, modeldef.specs()))
    if step is not None:
        params, _ = ckpts.restore_params(step, target)
    else:   # the newest one that reads back, as train.py resumes
        step, (params, _) = ckpts.restore_newest_intact(lambda s: ckpts.restore_params(s, target),
                                                        warn=lambda line: print(line, file=sys.stderr),
                                                        set_aside=False)
    ckpts.close()
    return Loaded(cfg, modeldef.bind(params), tokenizer, step)


# --- scoring token windows ---------------------------------------------------------------

def stride_windows(n_tokens: int, seq_len: int, stride: int) -> list[tuple[int, int]]:
    """(start, first_scored) pairs: window i covers tokens[start : start+seq_len+1] and scores
    the targets (predictions of token j+1) j in [first_scored, start+seq_len). The first window
    scores all of its targets, later ones only the `stride` new ones, so every token after the
    first is scored exactly once, with as much context as fits (Megatron's overlapping eval)."""
    if not 0 < stride <= seq_len:
        raise UserError(f"stride must be in 1..{seq_len}, got {stride}")
    n_targets = n_tokens - 1
    if n_targets <= 0:
        return []
    count = max(math.ceil((n_targets - seq_len) / stride), 0) + 1
    windows = []
    for i in range(count):
        start = i * stride
        windows.append((start, start if i == 0 else start + seq_len - stride))
    return windows


def _forward_fn(model):
    @jax.jit
    def losses_and_argmax(m, tokens, targets):
        logits = m(tokens)
        return m.token_losses(tokens, targets), jnp.argmax(logits, -1).astype(jnp.int32)
    return losses_and_argmax


def dp_batch_size(batch_size: int, dp: int) -> int:
    """The batch size rounded down to a multiple of the data axis (at least one row per shard)."""
    return max(dp, batch_size - batch_size % dp)


def padded_batches(n: int, batch_size: int, dp: int):
    """(row indices, 0/1 real-row weights) of batches covering n rows; the last batch repeats
    the final row to keep every batch the same, data-divisible size."""
    batch_size = dp_batch_size(batch_size, dp)
    for start in range(0, n, batch_size):
        rows = np.arange(start, start + batch_size)
        yield np.minimum(rows, n - 1), (rows < n).astype(np.float32)


def score_windows(model, rows: list[tuple[np.ndarray, np.ndarray]], batch_size: int, progress=None):
    """Run (tokens, score_mask) rows of length seq_len+1 through the model in batches.
    Returns per-row (summed loss of scored targets, count, per-target losses, argmax)."""
    seq_len = model.cfg.seq_len
    batch_size = dp_batch_size(batch_size, model.layout.dp)
    fn = _forward_fn(model)
    out = []
    for i in range(0, len(rows), batch_size):
        chunk = rows[i:i + batch_size]
        n = len(chunk)
        pad = batch_size - n
        toks = np.zeros((batch_size, seq_len + 1), np.int32)
        for j, (t, _) in enumerate(chunk):
            toks[j, :len(t)] = t
        toks[n:] = toks[0] if pad else toks[n:]
        losses, argmax = jax.device_get(fn(model, toks[:, :-1], toks[:, 1:]))
        for j, (t, mask) in enumerate(chunk):
            m = np.zeros(seq_len, bool)
            m[:len(mask)] = mask
            out.append((float(losses[j][m].astype(np.float64).sum()), int(m.sum()), losses[j], argmax[j]))
        if progress:
            progress(min(i + batch_size, len(rows)), len(rows))
    return out


def perplexity_of_tokens(model, tokens: np.ndarray, stride: int, batch_size: int, progress=None) -> dict:
    seq_len = model.cfg.seq_len
    rows = []
    for start, first in stride_windows(len(tokens), seq_len, stride):
        t = np.asarray(tokens[start:start + seq_len + 1], np.int32)
        mask = np.zeros(len(t) - 1, bool)
        mask[first - start:] = True
        rows.append((t, mask))
    scored = score_windows(model, rows, batch_size, progress)
    total = sum(s[0] for s in scored)
    count = sum(s[1] for s in scored)
    return {"loss_sum": total, "tokens": count, "loss": total / count, "ppl": math.exp(total / count),
            "windows": len(rows), "stride": stride}


# --- WikiText --------------------------------------------------------------------------

def wikitext_detokenize(text: str) -> str:
    """Undo WikiText's word-level tokenization (as the paper did for GPT-2 evaluation)."""
    text = text.replace("s '", "s'")
    text = re.sub(r"/' [0-9]/", r"/'[0-9]/", text)
    text = text.replace(" @-@ ", "-").replace(" @,@ ", ",").replace(" @.@ ", ".")
    for p in (":", ";", ".", "!", "?", ","):
        text = text.replace(f" {p} ", f"{p} ")
    text = re.sub(r"\(\s*([^\)]*?)\s*\)", r"(\1)", text)
    text = re.sub(r"\[\s*([^\]]*?)\s*\]", r"[\1]", text)
    text = re.sub(r"{\s*([^}]*?)\s*}", r"{\1}", text)
    text = re.sub(r"\"\s*([^\"]*?)\s*\"", r'"\1"', text)
    text = re.sub(r"'\s*([^']*?)\s*'", r"'\1'", text)
    text = text.replace("= = = =", "====").replace("= = =", "===").replace("= =", "==")
    text = text.replace(" " + chr(176) + " ", chr(176))
    text = text.replace(" \n", "\n").replace("\n ", "\n")
    text = text.replace(" N ", " 1 ")
    text = text.replace(" 's", "'s")
    return text


def original_token_count(raw: str) -> int:
    """T_o: word-level tokens of the original file, counted as the paper (Megatron) does."""
    return len(raw.strip().split(" "))


def evaluate_wikitext(loaded: Loaded, path: Path, stride: int = 32, batch_size: int = 8, progress=None) -> dict:
    path = Path(path)
    if not path.is_file():
        raise UserError(f"WikiText file not found: {path}")
    raw = read_utf8(path)
    if not raw.strip():
        raise UserError(f"WikiText file {path} is empty")
    t_o = original_token_count(raw)
    tokens = np.asarray(loaded.tokenizer.encode(wikitext_detokenize(raw)), np.int32)
    r = perplexity_of_tokens(loaded.model, tokens, stride, batch_size, progress)
    # The paper divides by T_o; Megatron-LM's evaluation script by T_o - 1 (it counts the
    # predictions, one fewer than the words): both, so either kind of figure can be compared.
    r.update({"original_tokens": t_o, "adjusted_ppl": math.exp(r["loss_sum"] / t_o),
              "adjusted_ppl_megatron": math.exp(r["loss_sum"] / (t_o - 1)), "file": str(path)})
    return r


# --- LAMBADA ---------------------------------------------------------------------------

def lambada_examples(path: Path, tokenizer: Tokenizer, seq_len: int):
    """(context tokens, target tokens) per passage. The target is the last word, split off at the
    last run of any whitespace (a newline too), and the context is stripped, as Megatron does."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"LAMBADA file not found: {path}")
    examples = []
    for n, line in enumerate(read_utf8(path).splitlines(), 1):
        if not line.strip():
            continue
        try:
            text = json.loads(line)["text"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise UserError(f"{path}:{n}: expected a JSON object with a \"text\" field") from None
        if not isinstance(text, str) or len(text.split()) < 2:
            raise UserError(f"{path}:{n}: \"text\" must be a passage of at least two words, got {text!r:.60}")
        text = text.strip()
        *context, word = text.rsplit(None, 1)
        context = context[0] if context else ""
        ctx, tgt = tokenizer.encode(context), tokenizer.encode(" " + word)
        keep = seq_len + 1 - len(tgt)
        examples.append((ctx[-keep:] if len(ctx) > keep else ctx, tgt))
    if not examples:
        raise UserError(f"{path} has no passages")
    return examples


def evaluate_lambada(loaded: Loaded, path: Path, batch_size: int = 8, progress=None) -> dict:
    """Accuracy: a passage counts only if every target token is the argmax (teacher forcing)."""
    examples = lambada_examples(path, loaded.tokenizer, loaded.cfg.model.seq_len)
    rows = []
    for ctx, tgt in examples:
        t = np.asarray(ctx + tgt, np.int32)
        mask = np.zeros(len(t) - 1, bool)
        mask[len(ctx) - 1:] = True
        rows.append((t, mask))
    scored = score_windows(loaded.model, rows, batch_size, progress)
    correct = []
    for (t, mask), (_, _, _, argmax) in zip(rows, scored):
        idx = np.nonzero(mask)[0]
        correct.append(bool(np.all(argmax[idx] == t[idx + 1])))
    loss = sum(s[0] for s in scored) / sum(s[1] for s in scored)
    return {"accuracy": float(np.mean(correct)), "correct": int(np.sum(correct)), "passages": len(rows),
            "mean_target_loss": loss, "per_passage_correct": correct, "file": str(path)}


# --- the eval.py tasks -------------------------------------------------------------------

def _progress(enabled: bool):

    if not enabled or not sys.stderr.isatty():
        return None
    from tqdm import tqdm

    bar = tqdm(unit="row", dynamic_ncols=True)

    def update(done, total):
        bar.total = total
        bar.n = done
        bar.refresh()
        if done >= total:
            bar.close()
    return update


def _table(rows: list[tuple[str, object]]) -> str:
    width = max(len(k) for k, _ in rows)
    fmt = lambda v: f"{v:,.4f}" if isinstance(v, float) else f"{v:,}" if isinstance(v, int) else str(v)  # noqa: E731
    return "\n".join(f"{k.ljust(width)}  {fmt(v)}" for k, v in rows)


def evaluate_pretraining(model, pairs, cfg, specials, tokenizer, batch_size: int = 16) -> dict:
    """A pretrained BERT's MLM loss and accuracy over the masked tokens and SOP loss and
    accuracy over the pairs: each pair once, with a fixed masking and order (seeded by its
    index), summed exactly over padded batches."""
    from megajax.bert_data import PretrainBatches

    builder = PretrainBatches(pairs, cfg, specials, tokenizer, None, "eval")
    sharding = model.layout.sharding(jax.sharding.PartitionSpec("data"))
    outputs = jax.jit(lambda m, batch: m.pretrain_outputs(batch))
    sums = dict(mlm_loss=0.0, mlm_hits=0.0, masked=0.0, sop_loss=0.0, sop_hits=0.0)
    for idx, real in padded_batches(len(pairs), batch_size, model.layout.dp):
        examples = [builder.encode(pairs[i], np.random.default_rng([cfg.train.seed, 2, int(i)])) for i in idx]
        batch = {k: np.stack([e[k] for e in examples]) for k in examples[0]}
        out = jax.device_get(outputs(model, {k: jax.device_put(v, sharding) for k, v in batch.items()}))
        w = batch["mlm_weights"] * real[:, None]
        sums["mlm_loss"] += float((out["mlm_losses"] * w).sum())
        sums["mlm_hits"] += float((out["mlm_hits"] * w).sum())
        sums["masked"] += float(w.sum())
        sums["sop_loss"] += float((out["sop_losses"] * real).sum())
        sums["sop_hits"] += float((out["sop_hits"] * real).sum())
    n = len(pairs)
    return {"pairs": n, "masked_tokens": int(sums["masked"]),
            "mlm_loss": sums["mlm_loss"] / sums["masked"], "mlm_accuracy": sums["mlm_hits"] / sums["masked"],
            "sop_loss": sums["sop_loss"] / n, "sop_accuracy": sums["sop_hits"] / n}


def run_task(args, mesh, out=print) -> dict:
    """What `eval.py` does for args.task; prints a short table, returns the full result."""
    from megajax.data import load_tokens
    from megajax.generate import generate

    loaded = load_workdir(Path(args.workdir), mesh, args.step)
    main = jax.process_index() == 0
    head = {"task": args.task, "workdir": str(args.workdir), "step": loaded.step,
            "mesh": {"data": mesh.shape["data"], "model": mesh.shape["model"]}}
    progress = _progress(main)
    m = loaded.cfg.model
    if args.task in FINETUNE_TASKS:
        if m.kind != "bert" or m.task != args.task:
            raise UserError(f"--task {args.task} needs a BERT workdir fine-tuned on {args.task}; "
                            f"{args.workdir} holds {m.kind} ({m.task})")
    elif args.task == "mlm":
        if m.kind != "bert" or m.task != "pretrain":
            raise UserError(f"--task mlm needs a pretrained BERT workdir; {args.workdir} holds {m.kind} ({m.task})")
    elif m.kind != "gpt":
        raise UserError(f"--task {args.task} needs a GPT workdir; {args.workdir} holds {m.kind} ({m.task})")
    if args.task != "sample" and not args.data:
        raise UserError(f"--task {args.task} needs --data")
    if args.task == "mlm":
        from megajax.bert_data import load_pretraining
        from megajax.data import source_text

        source = args.data if ":" in args.data or args.data == "builtin" else f"text:{args.data}"
        cfg = dataclasses.replace(loaded.cfg, data=dataclasses.replace(loaded.cfg.data, val_fraction=0.0))
        data = load_pretraining(source_text(source), loaded.tokenizer, cfg)
        r = evaluate_pretraining(loaded.model, data.train_pairs, cfg, data.specials,
                                 loaded.tokenizer, args.batch_size)
        rows = [("sentence pairs", r["pairs"]), ("masked tokens", r["masked_tokens"]),
                ("MLM loss", r["mlm_loss"]), ("MLM accuracy", r["mlm_accuracy"]),
                ("SOP loss", r["sop_loss"]), ("SOP accuracy", r["sop_accuracy"])]
    elif args.task in FINETUNE_TASKS:
        from megajax.finetune import evaluate_task

        split = args.split or ("test" if args.task == "race" else "dev")
        r = evaluate_task(loaded.model, args.task, Path(args.data), split, loaded.tokenizer, args.batch_size)
        rows = [("split", split), ("examples", r["examples"]), ("accuracy", r["accuracy"])]
        rows += [(f"accuracy ({lvl}, {r[f'examples_{lvl}']})", r[f"accuracy_{lvl}"])
                 for lvl in ("middle", "high") if f"accuracy_{lvl}" in r]
    elif args.task == "ppl":
        source = args.data if ":" in args.data else f"text:{args.data}"
        data = load_tokens(source, "bytes", 0.0, loaded.cfg.data.bin_dtype, tokenizer=loaded.tokenizer)
        if int(np.max(data.train)) >= loaded.cfg.model.vocab_size:
            raise UserError(f"{source} has token id {int(np.max(data.train))}, beyond the model's vocabulary "
                            f"of {loaded.cfg.model.vocab_size:,} (another tokenizer, or data.bin_dtype?)")
        r = perplexity_of_tokens(loaded.model, data.train, args.stride, args.batch_size, progress)
        rows = [("tokens scored", r["tokens"]), ("loss", r["loss"]), ("perplexity", r["ppl"])]
    elif args.task == "wikitext":
        r = evaluate_wikitext(loaded, Path(args.data), args.stride, args.batch_size, progress)
        rows = [("subword tokens T", r["tokens"]), ("original tokens T_o", r["original_tokens"]),
                ("loss per token", r["loss"]), ("perplexity", r["ppl"]),
                ("adjusted perplexity exp(L/T_o), the paper's", r["adjusted_ppl"]),
                ("adjusted perplexity exp(L/(T_o-1)), Megatron's script", r["adjusted_ppl_megatron"])]
    elif args.task == "lambada":
        r = evaluate_lambada(loaded, Path(args.data), args.batch_size, progress)
        rows = [("passages", r["passages"]), ("correct", r["correct"]), ("accuracy", r["accuracy"]),
                ("mean target loss", r["mean_target_loss"])]
    else:
        prompt = loaded.tokenizer.encode(args.prompt) or [0]
        new = generate(loaded.model, np.asarray([prompt]), args.max_new_tokens, args.temperature,
                       min(args.top_k, loaded.cfg.model.vocab_size) or None, jax.random.key(args.seed),
                       eos_id=loaded.tokenizer.eos_id)
        text = loaded.tokenizer.decode(new[0])
        r = {"prompt": args.prompt, "completion": text, "tokens": new[0].tolist()}
        if main:
            out(args.prompt + text)
        return {**head, **r}
    if main:
        out(_table([("step", loaded.step), *rows]))
    return {**head, **r}
