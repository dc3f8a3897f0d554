"""lm-evaluation-harness in this process: `eval.py --task lm-eval --lm-eval-tasks T1,T2`.

megajax's model behind lm-eval's `TemplateLM` (`MegajaxLM`), with lm-eval's own task
definitions, prompts, metrics and table (`simple_evaluate`). The three request kinds:
  loglikelihood           the continuation's summed log-probability and whether greedy decoding
                          gives it, each request a row (lm-eval truncates the context on the
                          left to the model's length, as its `hf` model does)
  loglikelihood_rolling   a document's log-probability over lm-eval's rolling windows (its
                          `get_rolling_token_windows`, the prefix token first)
  generate_until          greedy decoding through the KV cache until the task's `until`
                          strings or the end-of-text token, at most `max_gen_toks` tokens
Tokenized as lm-eval's `hf` model does with a Hugging Face tokenizer: the tokenizer's own
post-processor decides a BOS (Llama's adds one, GPT-2's does not), the prefix token is the BOS
or else the end-of-text token. The model's length is its context (model.seq_len, or
model.max_positions for rotary positions).
"""

from __future__ import annotations

import importlib

import jax
import jax.numpy as jnp
import numpy as np

from megajax.core.mesh import padded_batches
from megajax.data.chat import template_for
from megajax.errors import UserError
from megajax.models.generate import generate
from megajax.runs.workdir import is_main

try:  # an optional dependency: without it, --task lm-eval says how to install it
    import lm_eval
    from lm_eval import utils as lm_utils
    from lm_eval.api.model import TemplateLM
    from lm_eval.tasks import TaskManager
except ImportError:
    lm_eval = lm_utils = TaskManager = None
    TemplateLM = object

VERSION = "0.4.13"  # the lm_eval release megajax is tested with (requirements-test.txt)


def _import_lm_eval():
    """lm-eval is there (imported by this module, and importable now), or one line saying how
    to install it."""
    try:
        importlib.import_module("lm_eval")
        found = TemplateLM is not object
    except ImportError:
        found = False
    if not found:
        raise UserError(
            "--task lm-eval needs lm-evaluation-harness: pip install 'lm_eval=="
            f"{VERSION}' (or: pip install -e '.[lm-eval]')"
        )


def _bucket(n: int, ctx: int) -> int:
    """Rows padded to a few lengths (powers of two from 32), so that a task compiles a few
    programs, not one per request length."""
    size = 32
    while size < n:
        size *= 2
    return min(size, ctx)


@jax.jit
def _scores(model, tokens, targets):
    """Each target's log-probability and the greedy token at each position, whole on every
    device (and so in every process of a run over several)."""
    logits = model(tokens).astype(jnp.float32)
    logp = jax.nn.log_softmax(logits, axis=-1)
    picked = jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    out = picked, jnp.argmax(logits, -1).astype(jnp.int32)
    if model.layout.mesh is None:
        return out
    whole = jax.sharding.NamedSharding(model.layout.mesh, jax.sharding.PartitionSpec())
    return jax.lax.with_sharding_constraint(out, whole)


def make_lm(loaded, batch_size: int):
    """An lm-eval `TemplateLM` running `loaded`'s model (a load_workdir result)."""
    _import_lm_eval()
    return MegajaxLM(loaded, batch_size)


class MegajaxLM(TemplateLM):
    def __init__(self, loaded, batch_size: int):
        super().__init__()
        self.model, self.tok, self.rows = loaded.model, loaded.tokenizer, batch_size
        self.template = template_for(self.tok)
        self.ctx = int(self.model.cfg.context)

    @property
    def eot_token_id(self) -> int:
        eos = getattr(self.tok, "eos_id", None)
        return int(eos) if eos is not None else 0

    @property
    def prefix_token_id(self) -> int:
        bos = getattr(self.tok, "bos_id", None)
        return int(bos) if bos is not None else self.eot_token_id

    @property
    def max_length(self) -> int:
        return self.ctx

    @property
    def max_gen_toks(self) -> int:
        return 256

    @property
    def tokenizer_name(self) -> str:
        return f"megajax-{getattr(self.tok, 'kind', 'tokenizer')}"

    def tok_encode(self, string: str, add_special_tokens=None, **kwargs) -> list[int]:
        hf = self.tok.tok if getattr(self.tok, "kind", "") == "hf" else None
        if hf is None:  # bytes, chars, tiktoken: no post-processor adds anything
            return list(self.tok.encode(string))
        special = True if add_special_tokens is None else bool(add_special_tokens)
        bos = self.tok.bos_id
        if add_special_tokens is None and bos is not None:
            if string.startswith(self.tok.decode([bos])):
                special = False
        return list(hf.encode(string, add_special_tokens=special).ids)

    def tok_decode(self, ids) -> str:
        return self.tok.decode(list(ids))

    def chat_template(self, chat_template=False) -> str:
        return self.template.source if chat_template else ""

    def apply_chat_template(self, chat_history, add_generation_prompt=True) -> str:
        """The tokenizer's chat template (or megajax's plain one), as chat fine-tuning and
        eval.py --task chat render it."""
        try:
            return self.template.render(chat_history, add_generation_prompt=add_generation_prompt)[
                0
            ]
        except ValueError as e:
            raise UserError(str(e)) from None

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs):
        rows = [
            ((list(context) + list(continuation))[-(self.ctx + 1) :], len(continuation))
            for _, context, continuation in requests
        ]
        out = [None] * len(rows)
        order = sorted(range(len(rows)), key=lambda i: -len(rows[i][0]))
        for idx, real in padded_batches(len(order), self.rows, self.model.layout.shape):
            picked = [order[i] for i in idx]
            for j, score in _scored_batch(self.model, [rows[i] for i in picked], self.ctx, real):
                out[picked[j]] = score
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        windows, owner = [], []
        for r, req in enumerate(requests):
            (string,) = req.args
            for w in map(
                lm_utils.make_disjoint_window,
                lm_utils.get_rolling_token_windows(
                    token_list=self.tok_encode(string),
                    prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length,
                    context_len=1,
                ),
            ):
                windows.append((None, *w))
                owner.append(r)
        total = [0.0] * len(requests)
        for r, (logp, _) in zip(owner, self._loglikelihood_tokens(windows) if windows else []):
            total[r] += logp
        return total

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        return [self._generate_one(*req.args) for req in requests]

    def _generate_one(self, context: str, kwargs) -> str:
        """Greedy decoding until one of the `until` strings (or the end of text), at most
        `max_gen_toks` tokens, the text cut before the first of them."""
        kwargs = dict(kwargs or {})
        until = kwargs.pop("until", None) or []
        until = [until] if isinstance(until, str) else list(until)
        eot = self.tok_decode([self.eot_token_id])
        until = [u for u in until + [eot] if u]
        n = int(kwargs.pop("max_gen_toks", self.max_gen_toks))
        prompt = self.tok_encode(context)[-max(self.ctx - n, 1) :]
        new: list[int] = []
        generate(
            self.model,
            np.asarray([prompt], np.int32),
            n,
            temperature=0.0,
            eos_id=self.eot_token_id,
            emit=lambda tokens: new.append(int(tokens[0])),
            stopped=lambda: any(u in self.tok_decode(new) for u in until),
        )
        text = self.tok_decode(new)
        for u in until:
            text = text.split(u)[0]
        return text


def _scored_batch(model, rows, ctx: int, real):
    """(row's place in the batch, (summed log-probability of its continuation, whether greedy
    decoding gives it)) for each real row of a batch of (tokens, continuation length) rows."""
    length = _bucket(max(len(whole) - 1 for whole, _ in rows), ctx)
    tokens = np.zeros((len(rows), length), np.int32)
    targets = np.zeros((len(rows), length), np.int32)
    for j, (whole, _) in enumerate(rows):
        tokens[j, : len(whole) - 1] = whole[:-1]
        targets[j, : len(whole) - 1] = whole[1:]
    logp, greedy = jax.device_get(_scores(model, tokens, targets))
    for j in np.flatnonzero(real):
        n_in, n_cont = len(rows[j][0]) - 1, rows[j][1]
        span = slice(n_in - n_cont, n_in)
        yield (
            int(j),
            (
                float(logp[j, span].astype(np.float64).sum()),
                bool(np.all(greedy[j, span] == targets[j, span])),
            ),
        )


def lm_eval_task(args, loaded, progress):
    """eval.py --task lm-eval: lm-eval's `simple_evaluate` on the workdir's model; (result, None)
    after printing lm-eval's own table."""
    _import_lm_eval()
    tasks = [t for t in (args.lm_eval_tasks or "").split(",") if t]
    if not tasks:
        raise UserError("--task lm-eval needs --lm-eval-tasks T1[,T2...]")
    manager = TaskManager(include_path=args.lm_eval_include) if args.lm_eval_include else None
    known = set((manager or TaskManager()).all_tasks)
    unknown = [t for t in tasks if t not in known]
    if unknown:
        where = f" (nor in {args.lm_eval_include})" if args.lm_eval_include else ""
        raise UserError(f"lm-eval has no task {', '.join(unknown)}{where}")
    lm = make_lm(loaded, args.batch_size)
    results = lm_eval.simple_evaluate(
        model=lm,
        tasks=tasks,
        num_fewshot=args.num_fewshot,
        limit=args.limit,
        task_manager=manager,
        apply_chat_template=args.apply_chat_template,
        torch_random_seed=None,  # lm-eval's other seeds its command's defaults; no PyTorch
    )
    if is_main():  # every process runs the harness alike (the same batches, in the same order)
        print(lm_utils.make_table(results))
    keep = {
        k: results[k] for k in ("results", "versions", "n-shot", "higher_is_better") if k in results
    }
    return {"lm_eval": keep, "lm_eval_version": lm_eval.__version__}, None
