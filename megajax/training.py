"""The training loop: data, sharded state, checkpoints, metrics, evaluation, sampling.

`train()` is what `python train.py` runs; every step is the compiled Trainer step from
megajax/train_step.py, and nothing here gathers weights to the host.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import signal
import sys
import time
from pathlib import Path

import jax
import numpy as np

from megajax.checkpoint import Checkpoints
from megajax.config import Config, load_config
from megajax.data import load_tokens
from megajax.distributed import agreed_stop, check_same_run, describe
from megajax.errors import UserError
from megajax.files import WorkdirLock
from megajax.metrics import MetricsLog, Progress, device_peak_tflops, flops_per_token, plot_workdir
from megajax.tokenizer import FILE as TOKENIZER_FILE
from megajax.tokenizer import load_tokenizer
from megajax.train_step import Trainer, make_trainer


class StopRequested:
    """SIGTERM or Ctrl-C. During start-up (reading data, compiling) nothing is at stake: stop at
    once with one line. Once training (`training = True`): finish the current step, save, and
    exit cleanly; further signals while that happens are noted, not obeyed, since interrupting
    the save would lose the very checkpoint they ask for (SIGKILL still ends it at once)."""

    def __init__(self):
        self.requested = None
        self.training = False
        self._old = {}

    def __enter__(self):
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                self._old[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread (e.g. some notebooks)
                pass
        return self

    def _handle(self, signum, frame):
        if not self.training:
            raise UserError(f"{signal.Signals(signum).name} during start-up: stopped before training any step")
        if self.requested is not None:
            print(f"{signal.Signals(signum).name}: already stopping; the checkpoint is being written",
                  file=sys.stderr, flush=True)
            return
        self.requested = signal.Signals(signum).name

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old)


@dataclasses.dataclass
class RunResult:
    workdir: Path
    final_step: int
    losses: dict[int, float]
    val_loss: float | None
    stopped_by: str | None = None
    sample: str | None = None


def _is_main() -> bool:
    return jax.process_index() == 0


def prepare_data(cfg: Config, workdir: Path, tokenizer_dir: Path | None = None):
    """Read and tokenize the run's data and fit the vocab. The tokenizer is reused from the
    workdir when resuming (or from `tokenizer_dir`, the pretrained workdir of a fine-tuning run).

    Returns a dataset: `.tokenizer`, `.describe()` and `.batches(split, cfg, sharding)`."""
    tok_dir = workdir if (workdir / TOKENIZER_FILE).exists() else tokenizer_dir
    tok = load_tokenizer(tok_dir) if tok_dir is not None else None
    m = cfg.model
    if m.kind == "bert" and m.task != "pretrain":
        from megajax.finetune import load_task_data

        if tok is None:
            raise UserError(f"fine-tuning ({m.task}) needs a tokenizer: start from a pretrained workdir "
                            f"with --init-from DIR")
        data = load_task_data(m.task, cfg.data.source, tok, cfg)
    elif m.kind == "bert":
        from megajax.bert_data import load_pretraining
        from megajax.data import source_text
        from megajax.tokenizer import make_tokenizer

        text = source_text(cfg.data.source)
        data = load_pretraining(text, tok or make_tokenizer(cfg.data.tokenizer, text), cfg)
    else:
        data = load_tokens(cfg.data.source, cfg.data.tokenizer, cfg.data.val_fraction, cfg.data.bin_dtype, tok)
    vocab = data.tokenizer.vocab_size
    if cfg.data.source.startswith("bin:"):
        top = int(max(np.max(data.train), np.max(data.val) if len(data.val) else 0))
        # Ids past the tokenizer are allowed for an untokenized file read with the default byte
        # tokenizer (the vocabulary grows to cover them), within reason: a uint16 file read as
        # uint32 has ids in the billions.
        if top >= vocab and (data.tokenizer.kind != "bytes" or top >= MAX_UNTOKENIZED_VOCAB):
            raise UserError(f"{cfg.data.source} has token id {top}, beyond the {data.tokenizer.kind} tokenizer's "
                            f"{vocab:,} ids: give the tokenizer that made it (--tokenizer), or check "
                            f"data.bin_dtype ({cfg.data.bin_dtype})")
        vocab = max(vocab, top + 1, cfg.model.vocab_size)
    cfg.model.vocab_size = vocab
    return data


MAX_UNTOKENIZED_VOCAB = 2 ** 20   # ids an untokenized bin: file may use before it looks misread


def check_same_tokenizer(cfg: Config, workdir: Path):
    """A workdir keeps the tokenizer it was started with (its ids are in the checkpoints):
    asking for another one on resume is refused rather than silently ignored."""
    saved = Path(workdir) / "config.json"
    if saved.is_file() and (Path(workdir) / TOKENIZER_FILE).is_file():
        before = load_config(str(saved)).data.tokenizer
        if before != cfg.data.tokenizer:
            raise UserError(f"{workdir} was trained with tokenizer '{before}', not '{cfg.data.tokenizer}': "
                            f"resume without --tokenizer (or with '{before}'), or use another --workdir")


# Fields a fine-tuning run takes from its pretrained workdir: they fix the weights' shapes.
PRETRAINED_SHAPE = ("kind", "num_layers", "hidden", "num_heads", "ffn_hidden", "seq_len", "vocab_size",
                    "vocab_multiple", "ln_placement", "ln_eps", "scan_layers")


def apply_init_from(cfg: Config, workdir: Path | None = None) -> Path | None:
    """With train.init_from, take the model's shape from that workdir's config (or, when this
    run is resuming, from its own saved config); return the pretrained workdir."""
    if not cfg.train.init_from:
        return None
    src = Path(cfg.train.init_from)
    own = Path(workdir) / "config.json" if workdir is not None else None
    resuming = own is not None and own.is_file() and (own.parent / "checkpoints").is_dir()
    if not resuming and not (src / "config.json").is_file():
        raise UserError(f"--init-from {src}: not a megajax workdir (no config.json)")
    pre = load_config(str(own if resuming else src / "config.json")).model
    if pre.kind != "bert" or cfg.model.kind != "bert":
        raise UserError(f"--init-from loads a BERT encoder; {src} holds a {pre.kind} model")
    for name in PRETRAINED_SHAPE:
        setattr(cfg.model, name, getattr(pre, name))
    return src


def init_from_pretrained(trainer: Trainer, params: dict, src: Path, out=print) -> dict:
    """Fresh params with every tensor that the pretrained workdir also has (the encoder and
    pooler) replaced by its checkpointed value, placed straight into this mesh's shardings."""
    from megajax.evaluation import load_workdir
    from megajax.model import ModelDef

    loaded = load_workdir(src, trainer.mesh)
    pre = {jax.tree_util.keystr(p): x for p, x in
           jax.tree_util.tree_flatten_with_path(ModelDef(loaded.model).params(loaded.model))[0]}
    taken, new = set(), set()

    def pick(path, x):
        name = jax.tree_util.keystr(path)
        top = name.split("'")[1]
        if name in pre and pre[name].shape == x.shape:
            taken.add(top)
            return pre[name]
        new.add(top)
        return x

    params = jax.tree_util.tree_map_with_path(pick, params)
    if _is_main():
        out(f"initialised from {src} (step {loaded.step}): {', '.join(sorted(taken))}; "
            f"new: {', '.join(sorted(new)) or 'nothing'}")
    return params


def train(cfg: Config, mesh, workdir: Path, *, dry_run: bool = False, sample_tokens: int = 200,
          out=print) -> RunResult | dict:
    with contextlib.ExitStack() as held:     # signal handlers and the workdir lock, released however train() ends
        stop = held.enter_context(StopRequested())
        return _train(cfg, mesh, workdir, held, stop, dry_run, sample_tokens, out)


def _train(cfg: Config, mesh, workdir: Path, held: contextlib.ExitStack, stop: StopRequested, dry_run: bool,
           sample_tokens: int, out) -> RunResult | dict:
    workdir = Path(workdir)
    main = _is_main()
    pretrained = apply_init_from(cfg, workdir)
    if dry_run:
        return dry_run_report(cfg, mesh, out=out)

    check_same_run({"config": cfg.to_dict(), "workdir": str(workdir)})
    ckpt_dir_exists = (workdir / "checkpoints").exists()
    check_same_tokenizer(cfg, workdir)
    data = prepare_data(cfg, workdir, tokenizer_dir=pretrained)
    trainer = make_trainer(cfg, mesh)   # checks sizes against the mesh: ConfigError
    train_batches = data.batches("train", cfg, trainer.batch_sharding)   # data too short: UserError
    val_batches = data.batches("val", cfg, trainer.batch_sharding)
    t = cfg.train
    if main:     # one run per workdir; taken before its checkpoints are read
        held.enter_context(WorkdirLock(workdir))
    ckpts = Checkpoints(workdir, keep=t.keep_checkpoints)
    start_step, params, opt_state = 0, None, None
    latest = None
    if ckpt_dir_exists:
        abstract_p, abstract_o = trainer.abstract_state()
        found = ckpts.restore_newest_intact(lambda s: ckpts.restore(s, abstract_p, abstract_o),
                                            warn=out if main else lambda _: None)
        if found is not None:
            latest, (params, opt_state, _) = found
            start_step = latest
    # Only now, with every check passed, write into the workdir.
    workdir.mkdir(parents=True, exist_ok=True)
    if main:
        cfg.save(workdir / "config.json")
        if not (workdir / TOKENIZER_FILE).exists():
            data.tokenizer.save(workdir)
    metrics = MetricsLog(workdir, enabled=main)
    metrics.truncate_after(start_step)
    if params is None:
        params, opt_state = trainer.init_state()
        if pretrained is not None:
            params = init_from_pretrained(trainer, params, pretrained, out)

    t0 = time.perf_counter()
    step_fn = trainer.jit_step().lower(params, opt_state, train_batches(start_step), np.int32(0)).compile()
    eval_fn = trainer.jit_eval()
    compile_s = time.perf_counter() - t0
    tokens_per_step = t.batch_size * cfg.model.tokens_per_example
    flops = flops_per_token(cfg) * tokens_per_step / mesh.devices.size
    peak = device_peak_tflops() if main else None
    if main:
        n = cfg.model.param_count()
        out(f"megajax: {cfg.name} | {n / 1e6:.2f}M params | mesh data={mesh.shape['data']} "
            f"model={mesh.shape['model']} on {mesh.devices.size} {jax.devices()[0].platform} device(s) | "
            f"{data.describe()} | step compiled in {compile_s:.1f}s"
            + (f" | {describe()}" if describe() else "")
            + (f" | resuming from step {start_step}" if start_step else ""))

    def evaluate() -> dict:
        """Mean of every metric over the validation batches (at most train.eval_batches)."""
        n = getattr(val_batches, "num_batches", t.eval_batches)
        results = jax.device_get([eval_fn(params, val_batches(i)) for i in range(n)])
        return {k: float(np.mean([r[k] for r in results])) for k in results[0]}

    if start_step >= t.steps and main:
        out(f"the checkpoint in {workdir} is at step {start_step}, train.steps is {t.steps}: nothing to train "
            f"(raise --steps to continue)")
    losses: dict[int, float] = {}
    pending = []          # (step, metrics on device) not yet checked on the host
    last_log = (start_step, time.perf_counter())
    last_saved = start_step if latest is not None else None   # the newest checkpoint on disk
    val_loss = None
    progress = Progress(t.steps, start_step, enabled=main)

    def flush(step):
        nonlocal last_log
        fetched = jax.device_get([m for _, m in pending])
        for (s, _), m in zip(pending, fetched):
            # The loss is computed before the update, the gradient norm from what updates the
            # weights: either one not finite means the weights after step s are not either.
            bad = [(k, float(m[k])) for k in ("loss", "grad_norm") if not math.isfinite(float(m[k]))]
            if bad:
                progress.close()
                ckpts.wait()
                what = " and ".join(f"{'gradient norm' if k == 'grad_norm' else k} {v}" for k, v in bad)
                good = (f"last good checkpoint: step {last_saved} in {workdir / 'checkpoints'}"
                        if last_saved is not None else "no checkpoint was saved before it")
                raise UserError(f"{what} at step {s}; stopped, nothing of step {s} or later saved; {good}")
            losses[s] = float(m["loss"])
        pending.clear()
        now = time.perf_counter()
        n_steps = max(step - last_log[0], 1)
        dt = (now - last_log[1]) / n_steps
        last_log = (step, now)
        m = fetched[-1]
        record = {"step": step, "loss": float(m["loss"]), "lr": float(m["lr"]),
                  "grad_norm": float(m["grad_norm"]), "tokens_per_sec": tokens_per_step / dt,
                  "step_time_s": dt, "tflops_per_device": flops / dt / 1e12}
        record.update({k: float(v) for k, v in m.items() if k not in record})  # BERT: mlm_loss, sop_accuracy, ...
        if peak:
            record["mfu"] = record["tflops_per_device"] / peak
        metrics.write(record)
        return record

    stopped_by = None
    stop.training = True
    step = start_step
    while step < t.steps:
        batch = train_batches(step)
        params, opt_state, m = step_fn(params, opt_state, batch, np.int32(step))
        step += 1
        pending.append((step, m))
        if len(pending) > 1:
            # At most two steps in flight: the host keeps one step ahead of the devices.
            # Deeper queues gain nothing and can deadlock XLA:CPU's simulated devices,
            # whose collectives rendezvous on a shared thread pool.
            pending[-2][1]["loss"].block_until_ready()
        logged = False
        if step % t.log_every == 0 or step == t.steps or step == start_step + 1:
            progress.update(step, flush(step))
            logged = True
        if val_batches is not None and (step % t.eval_every == 0 or step == t.steps):
            val = evaluate()
            val_loss = val["loss"]
            record = {"step": step, "val_loss": val_loss}
            if cfg.model.kind == "gpt":
                record["val_ppl"] = math.exp(min(val_loss, 50))
            record.update({f"val_{k}": v for k, v in val.items() if k != "loss"})
            metrics.write(record)
            progress.write(f"step {step:>6}  " + "  ".join(
                f"{k} {v:.4f}" for k, v in record.items() if k != "step"))
        stopping = agreed_stop(stop.requested)  # read once (a signal may arrive at any moment), agreed by all
        if step % t.save_every == 0 or step == t.steps or stopping:
            if not logged:
                flush(step)  # never save weights from a step whose loss was not finite
            ckpts.save(step, params, opt_state, {"step": step, "config": cfg.name})
            last_saved = step
            last_log = (step, time.perf_counter())  # throughput excludes saving
        elif step % t.eval_every == 0:
            last_log = (step, time.perf_counter())  # and evaluation
        if stopping:
            stopped_by = stopping
            break
    progress.close()
    ckpts.wait()
    ckpts.close()
    result = RunResult(workdir, step, losses, val_loss, stopped_by)
    if stopped_by:
        if main:
            out(f"{stopped_by}: saved a checkpoint at step {step} in {workdir}; "
                f"run the same command again to resume")
        return result
    if main:
        png = plot_workdir(workdir)
        final = f", final train loss {losses[step]:.4f}" if step in losses else ""
        out(f"done: {step} steps{final}"
            + (f", val loss {val_loss:.4f}" if val_loss is not None else "") + f"; loss curve {png}")
    if sample_tokens and cfg.model.kind == "gpt":  # every process takes part: the model is sharded over all of them
        result.sample = sample_text(trainer, params, data, sample_tokens)
        if main:
            out("sample:\n" + result.sample)
    return result


def _compute_name(m) -> str:
    return "mixed (bf16 matmuls, f32 activations)" if m.compute_dtype == "mixed" else m.dtype.name


def sample_text(trainer: Trainer, params, data, n_tokens: int, temperature: float = 0.8, top_k: int = 40) -> str:
    from megajax.generate import generate

    model = trainer.modeldef.bind(params)
    prompt = np.asarray(data.val[:16] if len(data.val) >= 16 else data.train[:16], dtype=np.int32)
    new = generate(model, prompt[None], n_tokens, temperature, top_k, jax.random.key(trainer.cfg.train.seed),
                   eos_id=data.tokenizer.eos_id)
    return data.tokenizer.decode(prompt) + data.tokenizer.decode(new[0])


def dry_run_report(cfg: Config, mesh, out=print) -> dict:
    """Everything about a run that needs no weights: sizes, per-device memory, collectives."""
    from megajax.audit import audit_hlo

    trainer = make_trainer(cfg, mesh)
    params, opt = trainer.abstract_state()

    def per_device_bytes(tree):
        return sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(tree))

    t0 = time.perf_counter()
    compiled = trainer.lower_step().compile()
    compile_s = time.perf_counter() - t0
    mem = compiled.memory_analysis()
    report = {
        "config": cfg.name, "params": cfg.model.param_count(),
        "mesh": {"data": mesh.shape["data"], "model": mesh.shape["model"]},
        "param_bytes_per_device": per_device_bytes(params),
        "optimizer_bytes_per_device": per_device_bytes(opt),
        "compile_s": compile_s,
    }
    if mem is not None:
        report.update({
            "step_argument_bytes": int(mem.argument_size_in_bytes),
            "step_temp_bytes": int(mem.temp_size_in_bytes),
            "step_output_bytes": int(mem.output_size_in_bytes),
            "step_alias_bytes": int(mem.alias_size_in_bytes),
            "step_peak_bytes": int(mem.argument_size_in_bytes + mem.output_size_in_bytes
                                   - mem.alias_size_in_bytes + mem.temp_size_in_bytes),
        })
    audit = audit_hlo(compiled.as_text(), cfg, (mesh.shape["data"], mesh.shape["model"]))
    report["audit"] = audit.summary()
    def gib(b):
        return f"{b / 2**30:.2f} GiB" if b >= 2**30 else f"{b / 2**20:.1f} MiB"
    out(f"dry run: {cfg.name}, {report['params']:,} parameters "
        f"({cfg.model.num_layers} layers, hidden {cfg.model.hidden}, {cfg.model.num_heads} heads, "
        f"seq {cfg.model.seq_len}, vocab {cfg.model.padded_vocab})")
    out(f"mesh data={mesh.shape['data']} model={mesh.shape['model']}; global batch {cfg.train.batch_size} "
        f"in {cfg.train.microbatches} microbatch(es); compute {_compute_name(cfg.model)}, remat {cfg.model.remat}")
    out(f"per device: params {gib(report['param_bytes_per_device'])}, "
        f"optimizer state {gib(report['optimizer_bytes_per_device'])}"
        + (f", compiled step peak {gib(report['step_peak_bytes'])} "
           f"(temporaries {gib(report['step_temp_bytes'])})" if "step_peak_bytes" in report else ""))
    out(f"step compiled in {compile_s:.1f}s\n")
    out(audit.table())
    return report
