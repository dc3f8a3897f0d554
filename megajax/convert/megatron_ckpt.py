"""Megatron-LM's own GPT checkpoints (torch format) as megajax params and config.

Megatron-LM saves one file per tensor-parallel rank and pipeline stage:

    DIR/latest_checkpointed_iteration.txt          the newest iteration, or "release"
    DIR/iter_0000100/mp_rank_00/model_optim_rng.pt  (release/mp_rank_00/... for a release)
    DIR/iter_0000100/mp_rank_00_001/...            tensor rank 0, pipeline stage 1, where there are
    stages

each a torch.save dict with "args" (the run's argparse Namespace: the sizes), "checkpoint_version"
and "model", the rank's shard of the state dict, read here with megajax/convert/torch_pickle.py.
The shards are joined as Megatron split them: column-parallel weights (QKV, fc1, the vocabulary)
along their output rows, row-parallel ones (the attention output, fc2) along their input columns;
LayerNorms, position embeddings and row-parallel biases are the same on every rank (checked).
Pipeline stages are joined first, each numbering its layers from 0.

Two namings are read: megatron-core's (`decoder.layers.N.self_attention.linear_qkv`, what
Megatron-LM has written since its models moved to megatron-core) and the earlier one
(`language_model.encoder.layers.N.self_attention.query_key_value`, `transformer` and
`attention` in the oldest). The fused QKV rows are ordered (head, q|k|v, head_dim) from
checkpoint version 2 on, megajax's own column order; versions 0 and 1 ordered them (q|k|v, head,
head_dim) and (head, head_dim, q|k|v) within each rank, and are put in that order first.

megatron-core's Llama-style GPTs are read too: RMSNorm, rotary positions (with its llama3
scaling, `use_rope_scaling`, or linear interpolation), SwiGLU (each rank's fc1 rows are its
slice of the gate, then its slice of up), grouped-query attention (the QKV rows of each query
group: its query heads, then one key and one value head) and an untied output layer.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from pathlib import Path

import numpy as np

from megajax.config import Config, ModelConfig
from megajax.convert import hf_weights, torch_pickle
from megajax.convert.hf import check_shapes, import_base, save_step0, workdir_spec
from megajax.convert.megatron_args import model_config
from megajax.data.tokenizer import fixed_tokenizer
from megajax.errors import UserError
from megajax.files import staged_directory
from megajax.runs.workdir import CONFIG_FILE

FILE = "model_optim_rng.pt"
# megajax name <- the suffix after "layers.N." in each naming: (megatron-core, earlier)
LAYER_NAMES = {
    "ln1": ("input_layernorm", "input_layernorm"),
    "attention.qkv": ("self_attention.linear_qkv", "self_attention.query_key_value"),
    "attention.out": ("self_attention.linear_proj", "self_attention.dense"),
    "ln2": ("pre_mlp_layernorm", "post_attention_layernorm"),
    "mlp.fc1": ("mlp.linear_fc1", "mlp.dense_h_to_4h"),
    "mlp.fc2": ("mlp.linear_fc2", "mlp.dense_4h_to_h"),
}
# megatron-core with Transformer Engine fuses each LayerNorm into the linear layer after it.
TE_NORMS = {"ln1": "self_attention.linear_qkv.layer_norm_", "ln2": "mlp.linear_fc1.layer_norm_"}
TOP_NAMES = {
    "embed.table": (
        "embedding.word_embeddings.weight",
        "language_model.embedding.word_embeddings.weight",
    ),
    "pos": (
        "embedding.position_embeddings.weight",
        "language_model.embedding.position_embeddings.weight",
    ),
    "ln_f": ("decoder.final_layernorm", "language_model.encoder.final_layernorm"),
}
COLUMN, ROW = ("attention.qkv", "mlp.fc1"), ("attention.out", "mlp.fc2")


RANK_DIR = re.compile(r"mp_rank_(\d+)(?:_(\d+))?")
LAYER_KEY = re.compile(r"^((?:decoder|language_model\.(?:encoder|transformer))\.layers\.)(\d+)\.")


def rank_files(directory: Path) -> tuple[list[list[Path]], str]:
    """The newest iteration's files (or `directory` itself, an iteration's directory or one
    file): for each tensor-parallel rank, its pipeline stages' files in order; and a name for
    that iteration."""
    directory = Path(directory)
    if directory.is_file():
        return [[directory]], directory.name
    tracker = directory / "latest_checkpointed_iteration.txt"
    if tracker.is_file():
        it = tracker.read_text().strip()
        directory = directory / (
            "release" if it == "release" else f"iter_{int(it):07d}" if it.isdigit() else it
        )
    found = {}
    for path in directory.glob(f"mp_rank_*/{FILE}"):
        match = RANK_DIR.fullmatch(path.parent.name)
        if match is None:
            raise UserError(
                f"{path.parent} is an expert-parallel rank (mp_rank_TT_PPP_EEE): megajax reads "
                "dense GPTs"
            )
        found[int(match.group(1)), int(match.group(2) or 0)] = path
    if not found:
        if any(directory.glob("*.distcp")) or (directory / "metadata.json").is_file():
            raise UserError(
                f"{directory} is a torch_dist (distributed) checkpoint; megajax reads "
                "Megatron-LM's torch format: convert it with Megatron-LM's --ckpt-convert-format "
                "torch"
            )
        raise UserError(
            f"no mp_rank_*/{FILE} in {directory}: not a Megatron-LM checkpoint directory"
        )
    tp, pp = (max(k[i] for k in found) + 1 for i in (0, 1))
    missing = [
        f"mp_rank_{t:02d}" + (f"_{s:03d}" if pp > 1 else "")
        for t in range(tp)
        for s in range(pp)
        if (t, s) not in found
    ]
    if missing:
        raise UserError(f"{directory} lacks {', '.join(missing[:3])}: an incomplete checkpoint")
    return [[found[t, s] for s in range(pp)] for t in range(tp)], directory.name


def read_ranks(ranks: list[list[Path]]) -> tuple[dict, float, list[dict]]:
    """(args as a dict, checkpoint version, each tensor-parallel rank's model state dict, its
    pipeline stages joined)."""
    shards, args, version = [], None, None
    for stages in ranks:
        parts = []
        for f in stages:
            ckpt = torch_pickle.load(f)
            if isinstance(ckpt, dict) and "model0" in ckpt:
                raise UserError(
                    f"{f} holds interleaved (virtual) pipeline stages: megajax reads one model per "
                    "stage"
                )
            if not (
                isinstance(ckpt, dict)
                and isinstance(ckpt.get("model"), dict)
                and isinstance(ckpt.get("args"), argparse.Namespace)
            ):
                raise UserError(
                    f"{f} is not a Megatron-LM checkpoint (no 'model' state dict and 'args' "
                    "Namespace)"
                )
            parts.append({k: v for k, v in ckpt["model"].items() if not k.endswith("_extra_state")})
            args, version = vars(ckpt["args"]), float(ckpt.get("checkpoint_version", 0))
        shards.append(_join_stages(parts))
    tp, pp = args.get("tensor_model_parallel_size", 1), args.get("pipeline_model_parallel_size", 1)
    if (tp, pp) != (len(ranks), len(ranks[0])):
        raise UserError(
            f"the checkpoint was saved with tensor parallelism {tp} and pipeline parallelism {pp} "
            f"but has {len(ranks)} x {len(ranks[0])} rank files"
        )
    return args, version, shards


def _join_stages(stages: list[dict]) -> dict:
    """One tensor-parallel rank's pipeline stages as one state dict: each stage numbers its
    layers from 0, so each is offset by the layers of the stages before it. The last stage's
    copy of the embedding (output_layer.weight) is checked against the first's with the rest."""
    joined, offset = {}, 0
    for stage in stages:
        count = 0
        for name, tensor in stage.items():
            if match := LAYER_KEY.match(name):
                count = max(count, int(match.group(2)) + 1)
                name = f"{match.group(1)}{offset + int(match.group(2))}.{name[match.end() :]}"
            joined[name] = tensor
        offset += count
    return joined


# --- the state dict -----------------------------------------------------------------------------
def _normalized(shard: dict) -> dict:
    """The earliest Megatron-LM names (`transformer`, `attention`) as the later ones."""
    out = {}
    for k, v in shard.items():
        if k.startswith("language_model."):
            k = k.replace("language_model.transformer.", "language_model.encoder.").replace(
                ".attention.", ".self_attention."
            )
        out[k] = v
    return out


def _naming(shard: dict) -> int:
    if any(k.startswith("decoder.layers.") for k in shard):
        return 0
    if any(k.startswith("language_model.encoder.layers.") for k in shard):
        return 1
    bert = any(k.startswith(("lm_head.", "binary_head.")) for k in shard)
    raise UserError(
        "the checkpoint's model is "
        + (
            "a BERT: megajax imports Megatron-LM GPT checkpoints (BERT ones through Hugging "
            "Face's MegatronBertForPreTraining)"
            if bert
            else "not a Megatron-LM GPT"
        )
    )


class _Shards:
    """The ranks' state dicts, joined tensor by tensor as Megatron split them."""

    def __init__(self, shards: list[dict], version: float, heads: int):
        self.shards = [_normalized(s) for s in shards]
        self.version, self.heads, self.used = version, heads, set()

    def has(self, name: str) -> bool:
        return name in self.shards[0]

    def unused(self) -> list[str]:
        return sorted(set(self.shards[0]) - self.used)

    def _arrays(self, name: str) -> list[np.ndarray]:
        self.used.add(name)
        missing = [i for i, s in enumerate(self.shards) if name not in s]
        if missing:
            raise UserError(f"the checkpoint has no tensor '{name}' (rank {missing[0]})")
        values = [s[name] for s in self.shards]
        if not all(isinstance(v, torch_pickle.Tensor) for v in values):
            raise UserError(f"'{name}' in the checkpoint is not a tensor")
        return [hf_weights.finite(name, np.asarray(v.numpy(), np.float32)) for v in values]

    def same(self, name: str) -> np.ndarray:
        arrays = self._arrays(name)
        if any(not np.array_equal(a, arrays[0]) for a in arrays[1:]):
            raise UserError(
                f"'{name}' differs between the tensor-parallel ranks: the checkpoint is damaged"
            )
        return arrays[0]

    def joined(self, name: str, axis: int, qkv: bool = False) -> np.ndarray:
        arrays = self._arrays(name)
        if qkv:
            arrays = [self._qkv_rows(a) for a in arrays]
        return np.concatenate(arrays, axis=axis)

    def _qkv_rows(self, a: np.ndarray) -> np.ndarray:
        """One rank's fused QKV rows in (head, q|k|v, head_dim) order, whatever the version."""
        if self.version >= 2:
            return a
        local = self.heads // len(self.shards)
        split = (3, local, -1) if self.version < 1 else (local, -1, 3)
        x = a.reshape(*split, *a.shape[1:])
        x = np.moveaxis(x, 0, 1) if self.version < 1 else np.moveaxis(x, 2, 1)
        return x.reshape(a.shape)


def to_params(shards: list[dict], version: float, cfg: ModelConfig) -> tuple[dict, list[dict]]:
    """(top-level params, each layer's params) under megajax's names, float32."""
    s = _Shards(shards, version, cfg.num_heads)
    naming = _naming(s.shards[0])
    prefix = ("decoder.layers.{i}.", "language_model.encoder.layers.{i}.")[naming]
    top = {ours: names[naming] for ours, names in TOP_NAMES.items()}
    table = s.joined(top["embed.table"], 0)
    if table.shape[0] < cfg.vocab_size:
        raise UserError(
            f"the tokenizer has {cfg.vocab_size} tokens but the checkpoint's embedding only "
            f"{table.shape[0]} rows"
        )
    pad = np.zeros((cfg.padded_vocab - cfg.vocab_size, table.shape[1]), np.float32)
    flat = {
        "embed.table": np.concatenate([table[: cfg.vocab_size], pad]),
        "ln_f.scale": s.same(f"{top['ln_f']}.weight"),
    }
    if cfg.positions == "learned":
        flat["pos"] = s.same(top["pos"])
    if cfg.norm == "layernorm":
        flat["ln_f.bias"] = s.same(f"{top['ln_f']}.bias")
    outputs = (
        "output_layer.weight",
        "language_model.output_layer.weight",
        "word_embeddings_for_head.weight",
    )
    if not cfg.tie_embeddings:
        name = next((o for o in outputs if s.has(o)), outputs[0])
        flat["head.table"] = np.concatenate([s.joined(name, 0)[: cfg.vocab_size], pad])
    # A tied run's output layer copy of the embedding, where it keeps one (the last pipeline
    # stage's).
    for output in outputs if cfg.tie_embeddings else ():
        if s.has(output) and not np.array_equal(
            s.joined(output, 0)[: cfg.vocab_size], table[: cfg.vocab_size]
        ):
            raise UserError(
                f"'{output}' differs from the input embedding, and the run's arguments tie them"
            )
    layers = [_layer(s, prefix.format(i=i), naming, cfg) for i in range(cfg.num_layers)]
    if extra := s.unused():
        raise UserError(
            "the checkpoint has tensors megajax's GPT does not: "
            f"{', '.join(extra[:4])}{' ...' if len(extra) > 4 else ''}"
        )
    return flat, layers


def _layer(s: _Shards, prefix: str, naming: int, cfg: ModelConfig) -> dict:
    out = {}
    for ours in ("ln1", "ln2"):
        norm = prefix + LAYER_NAMES[ours][naming] + "."
        if not s.has(norm + "weight") and s.has(prefix + TE_NORMS[ours] + "weight"):
            norm = prefix + TE_NORMS[ours]  # Transformer Engine's fused LayerNorm
        out[f"{ours}.scale"] = s.same(norm + "weight")
        if cfg.norm == "layernorm":
            out[f"{ours}.bias"] = s.same(norm + "bias")
    for ours in COLUMN + ROW:
        name = prefix + LAYER_NAMES[ours][naming]
        column, qkv = ours in COLUMN, ours == "attention.qkv"
        biased = cfg.bias == "all" or (cfg.bias == "qkv" and qkv)
        if ours == "mlp.fc1" and cfg.mlp == "swiglu":
            out.update(_gated(s, name, biased))
            continue
        kernel = s.joined(f"{name}.weight", 0 if column else 1, qkv)
        bias = (
            None
            if not biased
            else s.joined(f"{name}.bias", 0, qkv)
            if column
            else s.same(f"{name}.bias")
        )
        if qkv and cfg.kv_heads < cfg.num_heads:
            out.update(_grouped_qkv(kernel, bias, cfg))
            continue
        out[f"{ours}.kernel"] = kernel.T
        if biased:
            out[f"{ours}.bias"] = bias
        # add_bias_linear = False in a GPT-2: a zero bias is the same layer
        elif cfg.bias == "all":
            out[f"{ours}.bias"] = np.zeros(kernel.shape[0], np.float32)
    return out


def _gated(s: _Shards, name: str, biased: bool) -> dict:
    """SwiGLU's fc1: each rank's rows are its slice of the gate, then its slice of up."""
    out = {}
    for suffix, ours in (("weight", "kernel"), ("bias", "bias")):
        if ours == "bias" and not biased:
            continue
        halves = [np.split(a, 2, axis=0) for a in s._arrays(f"{name}.{suffix}")]
        gate, up = (np.concatenate([h[i] for h in halves], axis=0) for i in (0, 1))
        out[f"mlp.fc1.gate_{ours}"], out[f"mlp.fc1.up_{ours}"] = (
            (gate.T, up.T) if ours == "kernel" else (gate, up)
        )
    return out


def _grouped_qkv(kernel: np.ndarray, bias, cfg: ModelConfig) -> dict:
    """Megatron's QKV rows per query group (its query heads, one key, one value head) as
    megajax's query kernel and (kv head, k|v, head_dim) key/value kernel."""
    groups, d = cfg.kv_heads, cfg.head_dim
    per = cfg.num_heads // groups
    out = {}
    for ours, x in (("kernel", kernel), ("bias", bias)):
        if x is None:
            continue
        rows = x.reshape(groups, per + 2, d, *x.shape[1:])
        q, kv = rows[:, :per].reshape(-1, *x.shape[1:]), rows[:, per:].reshape(-1, *x.shape[1:])
        out[f"attention.qkv.q_{ours}"], out[f"attention.qkv.kv_{ours}"] = (
            (q.T, kv.T) if ours == "kernel" else (q, kv)
        )
    return out


def import_megatron(
    directory, workdir, tokenizer: str, overrides: list[str] | None = None
) -> Config:
    """Write a megajax workdir holding the newest (or given) Megatron-LM GPT checkpoint in
    `directory`, with `tokenizer` (the index records none); returns its config."""
    directory, workdir = Path(directory), Path(workdir).absolute()
    files, iteration = rank_files(directory)
    args, version, shards = read_ranks(files)
    tok = fixed_tokenizer(
        None,
        tokenizer,
        f"--tokenizer {tokenizer} is built from a corpus: give the one the checkpoint was trained "
        "with (tiktoken:gpt2 for Megatron's GPT2BPETokenizer, hf:PATH, wordpiece:PATH/vocab.txt)",
    )
    base = import_base(overrides, "the checkpoint's arguments")
    model = model_config(args, tok.vocab_size, base.model)
    cfg = dataclasses.replace(
        base, model=model, name=f"{directory.resolve().name}-{iteration}"
    ).validate()
    flat, layers = to_params(shards, version, model)
    params = hf_weights.nest(flat, layers, model.scan_layers)
    check_shapes(params, cfg)
    with staged_directory(workdir, "--workdir") as tmp:
        tok.save(tmp)
        cfg = dataclasses.replace(
            cfg, data=dataclasses.replace(cfg.data, tokenizer=workdir_spec(tok, workdir, tokenizer))
        )
        cfg.save(tmp / CONFIG_FILE)
        save_step0(tmp, cfg, params, source=str(files[0][0].parent.parent))
    return cfg
