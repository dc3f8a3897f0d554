"""Hugging Face state dicts <-> megajax params, for GPT-2, BERT, Megatron-BERT and the Llama
family (Llama, Mistral, Qwen2, Qwen3) with its mixtures of experts (Mixtral, Qwen2-MoE, Qwen3-MoE).

Each architecture is a table of rules: an HF tensor name (with `{i}` for the layer index)
and the megajax parameter it becomes, through one of a few forms. The traps live in the forms:
  linear      torch.nn.Linear stores (out, in); megajax kernels are (in, out): transposed.
              GPT-2's Conv1D already stores (in, out): its rules use `as_is`.
  vocab_rows  megajax pads the vocabulary (50257 -> 51200): zero rows added, and cut on export.
  qkv         megajax's fused QKV columns are ordered (head, q|k|v, head_dim), so that a
              column shard over "model" holds whole heads; GPT-2's c_attn is [q | k | v] and
              BERT keeps three Linear layers. Interleaved on import, separated on export.
  kv          grouped-query attention's key/value kernel is ordered (kv head, k|v, head_dim)
              likewise; its queries are a plain column-parallel kernel.
  experts     a mixture of experts' files hold one Linear per expert; megajax one (E, in, out)
              weight for them all.
A tied output layer is the input embedding: an HF file that carries its own copy
(lm_head.weight, cls.predictions.decoder.weight) must hold the same values. Llama's
rotary layout (rotate_half) is megajax's, so q and k need no permutation.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from megajax.config import ModelConfig
from megajax.errors import UserError
from megajax.progress import Progress

# megajax names under this prefix are per layer, stacked (or listed) under "layers"
LAYER = "layer."


@dataclasses.dataclass(frozen=True)
class Rule:
    hf: tuple[str, ...]  # one HF name, or three (q, k, v) for BERT's separate projections
    ours: str  # dotted megajax path; "layer.*" per layer
    # as_is | linear | vocab_rows | qkv_fused | qkv_linear | qkv_bias | kv_linear | kv_bias |
    # experts
    form: str = "as_is"
    layers: str = "all"  # a per-layer rule's layers: all | dense | sparse (mixtures of experts)


def _rules(*rows) -> list[Rule]:
    return [
        Rule((hf,) if isinstance(hf, str) else tuple(hf), ours, *form) for hf, ours, *form in rows
    ]


def _norm(hf: str, ours: str, scale="weight", shift="bias"):
    return [(f"{hf}.{scale}", f"{ours}.scale"), (f"{hf}.{shift}", f"{ours}.bias")]


def _dense(hf: str, ours: str, form="linear"):
    return [(f"{hf}.weight", f"{ours}.kernel", form), (f"{hf}.bias", f"{ours}.bias")]


GPT2 = _rules(
    ("wte.weight", "embed.table", "vocab_rows"),
    ("wpe.weight", "pos"),
    *_norm("ln_f", "ln_f"),
    *_norm("h.{i}.ln_1", "layer.ln1"),
    *_norm("h.{i}.ln_2", "layer.ln2"),
    ("h.{i}.attn.c_attn.weight", "layer.attention.qkv.kernel", "qkv_fused"),
    ("h.{i}.attn.c_attn.bias", "layer.attention.qkv.bias", "qkv_fused"),
    *_dense("h.{i}.attn.c_proj", "layer.attention.out", "as_is"),
    *_dense("h.{i}.mlp.c_fc", "layer.mlp.fc1", "as_is"),
    *_dense("h.{i}.mlp.c_proj", "layer.mlp.fc2", "as_is"),
)

_ATTN = "bert.encoder.layer.{i}.attention"
_QKV = [
    (
        tuple(f"{_ATTN}.self.{p}.weight" for p in ("query", "key", "value")),
        "layer.attention.qkv.kernel",
        "qkv_linear",
    ),
    (
        tuple(f"{_ATTN}.self.{p}.bias" for p in ("query", "key", "value")),
        "layer.attention.qkv.bias",
        "qkv_bias",
    ),
]
_BERT_COMMON = [
    ("bert.embeddings.word_embeddings.weight", "embed.table", "vocab_rows"),
    ("bert.embeddings.position_embeddings.weight", "pos"),
    ("bert.embeddings.token_type_embeddings.weight", "types"),
    *_QKV,
    *_dense(f"{_ATTN}.output.dense", "layer.attention.out"),
    *_dense("bert.encoder.layer.{i}.intermediate.dense", "layer.mlp.fc1"),
    *_dense("bert.encoder.layer.{i}.output.dense", "layer.mlp.fc2"),
    *_dense("bert.pooler.dense", "pooler"),
    *_dense("cls.predictions.transform.dense", "mlm_dense"),
    *_norm("cls.predictions.transform.LayerNorm", "mlm_ln"),
    ("cls.predictions.bias", "mlm_bias", "vocab_rows"),
    *_dense("cls.seq_relationship", "sop"),
]
# The original BERT: LayerNorm after the embeddings and after each residual add.
BERT = _rules(
    *_BERT_COMMON,
    *_norm("bert.embeddings.LayerNorm", "ln_embed"),
    *_norm(f"{_ATTN}.output.LayerNorm", "layer.ln1"),
    *_norm("bert.encoder.layer.{i}.output.LayerNorm", "layer.ln2"),
)
# The paper's BERT: LayerNorm at each sublayer's input and once at the end, none after the
# embeddings.
MEGATRON_BERT = _rules(
    *_BERT_COMMON,
    *_norm(f"{_ATTN}.ln", "layer.ln1"),
    *_norm("bert.encoder.layer.{i}.ln", "layer.ln2"),
    *_norm("bert.encoder.ln", "ln_f"),
)


def llama_rules(cfg: ModelConfig, arch: str = "llama") -> list[Rule]:
    """LlamaForCausalLM / MistralForCausalLM / Qwen2ForCausalLM (Qwen2: q, k, v biases) /
    Qwen3ForCausalLM (QK-norm's two scales)."""
    attn, mlp = "model.layers.{i}.self_attn", "model.layers.{i}.mlp"
    qkv = lambda suffix: tuple(f"{attn}.{p}_proj.{suffix}" for p in "qkv")  # noqa: E731
    biases = cfg.bias == "qkv"
    if cfg.kv_heads == cfg.num_heads:
        rows = [(qkv("weight"), "layer.attention.qkv.kernel", "qkv_linear")]
        rows += [(qkv("bias"), "layer.attention.qkv.bias", "qkv_bias")] * biases
    else:
        rows = [
            (f"{attn}.q_proj.weight", "layer.attention.qkv.q_kernel", "linear"),
            (qkv("weight")[1:], "layer.attention.qkv.kv_kernel", "kv_linear"),
        ]
        rows += [
            (f"{attn}.q_proj.bias", "layer.attention.qkv.q_bias"),
            (qkv("bias")[1:], "layer.attention.qkv.kv_bias", "kv_bias"),
        ] * biases
    rows += [
        ("model.embed_tokens.weight", "embed.table", "vocab_rows"),
        ("model.norm.weight", "ln_f.scale"),
        ("model.layers.{i}.input_layernorm.weight", "layer.ln1.scale"),
        ("model.layers.{i}.post_attention_layernorm.weight", "layer.ln2.scale"),
        (f"{attn}.o_proj.weight", "layer.attention.out.kernel", "linear"),
    ]
    dense = "dense" if cfg.num_experts else "all"
    rows += [
        (f"{mlp}.gate_proj.weight", "layer.mlp.fc1.gate_kernel", "linear", dense),
        (f"{mlp}.up_proj.weight", "layer.mlp.fc1.up_kernel", "linear", dense),
        (f"{mlp}.down_proj.weight", "layer.mlp.fc2.kernel", "linear", dense),
    ]
    rows += _expert_rules(cfg, arch) if cfg.num_experts else []
    rows += [
        (f"{attn}.q_norm.weight", "layer.attention.q_norm.scale"),
        (f"{attn}.k_norm.weight", "layer.attention.k_norm.scale"),
    ] * cfg.qk_norm
    rows += [("lm_head.weight", "head.table", "vocab_rows")] * (not cfg.tie_embeddings)
    return _rules(*rows)


def _expert_rules(cfg: ModelConfig, arch: str) -> list:
    """A sparse layer's router and experts, each expert's tensor its own in the files (Mixtral:
    block_sparse_moe.experts.N.w1 / w3 / w2; Qwen's: mlp.experts.N.gate_proj / up_proj /
    down_proj), megajax's one (E, in, out) weight per kind; Qwen2-MoE's shared expert and its
    sigmoid gate."""
    mixtral = arch == "mixtral"
    block = "model.layers.{i}." + ("block_sparse_moe" if mixtral else "mlp")
    names = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    ours = ("gate_experts", "up_experts", "fc2_experts")
    rows = [(f"{block}.gate.weight", "layer.mlp.router", "linear", "sparse")]
    for name, mine in zip(names, ours):
        hf = tuple(f"{block}.experts.{e}.{name}.weight" for e in range(cfg.num_experts))
        rows.append((hf, f"layer.mlp.{mine}", "experts", "sparse"))
    if cfg.moe_shared_experts:
        shared = f"{block}.shared_expert"
        rows += [
            (f"{shared}.{name}.weight", f"layer.mlp.shared.{mine}", "linear", "sparse")
            for name, mine in zip(("gate_proj", "up_proj", "down_proj"), ("gate", "up", "fc2"))
        ]
        rows.append((f"{shared}_gate.weight", "layer.mlp.shared_gate", "linear", "sparse"))
    return rows


RULES = {
    "gpt2": GPT2,
    "bert": BERT,
    "megatron-bert": MEGATRON_BERT,
    "llama": llama_rules,
    "mistral": llama_rules,
    "qwen2": llama_rules,
    "qwen3": llama_rules,
    "mixtral": llama_rules,
    "qwen2_moe": llama_rules,
    "qwen3_moe": llama_rules,
}
# HF names that are another name for a tensor a rule reads (tied or duplicated): checked equal.
ALIASES = {
    "gpt2": {"lm_head.weight": "wte.weight"},
    "bert": {
        "cls.predictions.decoder.weight": "bert.embeddings.word_embeddings.weight",
        "cls.predictions.decoder.bias": "cls.predictions.bias",
    },
}
ALIASES["megatron-bert"] = ALIASES["bert"]
for _arch in ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe"):
    # a tied model's copy, if saved
    ALIASES[_arch] = {"lm_head.weight": "model.embed_tokens.weight"}


def rules_for(arch: str, cfg: ModelConfig) -> list[Rule]:
    rules = RULES[arch]
    return rules(cfg, arch) if callable(rules) else rules


# Buffers some HF files carry that are not weights.
IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias", "embeddings.position_ids")
PREFIX = {"gpt2": "transformer."}  # GPT2LMHeadModel's; a bare GPT2Model file has none


# --- forms ------------------------------------------------------------------------------------
def finite(name: str, array: np.ndarray) -> np.ndarray:
    """`array`, or one line naming the checkpoint's tensor that holds a NaN or an infinity: a
    model that starts from one would only ever compute NaN."""
    if not np.isfinite(array).all():
        bad = int(np.size(array) - np.isfinite(array).sum())
        raise UserError(
            f"the checkpoint's tensor '{name}' holds {bad} non-finite value{'s' * (bad > 1)} (NaN "
            f"or infinity) of {np.size(array)}: damaged or diverged weights, not imported"
        )
    return array


def _interleave(*parts, heads: int):
    """(..., w) x n -> (..., w * n) with columns ordered (head, part, head_dim): q|k|v, or k|v."""
    x = np.stack(parts, axis=-2)  # (..., n, w)
    x = x.reshape(*x.shape[:-1], heads, x.shape[-1] // heads)  # (..., n, heads, d)
    return np.swapaxes(x, -3, -2).reshape(*parts[0].shape[:-1], len(parts) * parts[0].shape[-1])


def _separate(x, heads: int, n: int = 3):
    w = x.shape[-1] // n
    x = np.swapaxes(x.reshape(*x.shape[:-1], heads, n, w // heads), -3, -2)  # (..., n, heads, d)
    return tuple(x[..., j, :, :].reshape(*x.shape[:-3], w) for j in range(n))


def to_ours(form: str, tensors: list, cfg: ModelConfig) -> np.ndarray:
    if form == "as_is":
        return tensors[0]
    if form == "linear":
        return tensors[0].T
    if form == "experts":  # one (out, in) Linear per expert -> (E, in, out)
        return np.stack([t.T for t in tensors])
    if form == "vocab_rows":
        x = tensors[0]
        return np.concatenate([x, np.zeros((cfg.padded_vocab - x.shape[0], *x.shape[1:]), x.dtype)])
    if form == "qkv_fused":
        return _interleave(*np.split(tensors[0], 3, axis=-1), heads=cfg.num_heads)
    if form in ("qkv_linear", "kv_linear"):
        return _interleave(
            *(t.T for t in tensors), heads=cfg.num_heads if form == "qkv_linear" else cfg.kv_heads
        )
    # qkv_bias, kv_bias
    return _interleave(*tensors, heads=cfg.num_heads if form == "qkv_bias" else cfg.kv_heads)


def to_hf(form: str, x: np.ndarray, cfg: ModelConfig) -> list:
    if form == "as_is":
        return [x]
    if form == "linear":
        return [np.ascontiguousarray(x.T)]
    if form == "experts":
        return [np.ascontiguousarray(e.T) for e in x]
    if form == "vocab_rows":
        return [x[: cfg.vocab_size]]
    if form == "qkv_fused":
        return [np.concatenate(_separate(x, cfg.num_heads), axis=-1)]
    heads, n = (cfg.num_heads, 3) if form.startswith("qkv") else (cfg.kv_heads, 2)
    if form in ("qkv_linear", "kv_linear"):
        return [np.ascontiguousarray(t.T) for t in _separate(x, heads, n)]
    return [np.ascontiguousarray(t) for t in _separate(x, heads, n)]  # qkv_bias, kv_bias


# --- whole state dicts -------------------------------------------------------------------------
def _expand(rule: Rule, cfg: ModelConfig):
    """(HF names, megajax name, layer index or None) for each instance of a rule (a dense or
    sparse layer's rule: on those layers only)."""
    if not rule.ours.startswith(LAYER):
        return [(rule.hf, rule.ours, None)]
    sparse = cfg.sparse_layers
    return [
        (tuple(n.format(i=i) for n in rule.hf), rule.ours, i)
        for i in range(cfg.num_layers)
        if rule.layers == "all" or (rule.layers == "sparse") == sparse[i]
    ]


def _strip_prefix(tensors: dict, arch: str) -> tuple[dict, str]:
    """The tensors without the architecture's name prefix, and the prefix they had ("" if
    none)."""
    prefix = PREFIX.get(arch)
    if prefix and any(k.startswith(prefix) for k in tensors):
        return {k.removeprefix(prefix): v for k, v in tensors.items()}, prefix
    return dict(tensors), ""


def from_hf(arch: str, tensors: dict, cfg: ModelConfig) -> dict:
    """An HF state dict (name -> array) as a megajax params dict for `cfg` (scanned or not)."""
    tensors, prefix = _strip_prefix(tensors, arch)  # messages name tensors as the file does
    flat, per_layer, used = {}, [{} for _ in range(cfg.num_layers)], set()
    sources = [{} for _ in range(cfg.num_layers)]  # per layer: name -> [(HF tensor, shape)]
    todo = [(rule, e) for rule in rules_for(arch, cfg) for e in _expand(rule, cfg)]
    shown = Progress(unit="tensor")  # a bar on a terminal: a 70B model converts for minutes
    for done, (rule, (names, ours, i)) in enumerate(todo):
        shown.advance(done, len(todo))
        missing = [n for n in names if n not in tensors]
        if missing:
            raise UserError(
                f"the checkpoint has no tensor '{missing[0]}' (a {arch} model with "
                f"{cfg.num_layers} layers needs it)"
            )
        arrays = [finite(n, np.asarray(tensors[n], np.float32)) for n in names]
        if rule.form == "vocab_rows" and arrays[0].shape[0] != cfg.vocab_size:
            raise UserError(
                f"'{names[0]}' has {arrays[0].shape[0]} rows but config.json's vocab_size is "
                f"{cfg.vocab_size}"
            )
        try:
            value = to_ours(rule.form, arrays, cfg)
        except ValueError:
            raise UserError(
                f"'{names[0]}' has shape {arrays[0].shape}, which config.json's sizes do not give"
            ) from None
        (flat if i is None else per_layer[i])[ours.removeprefix(LAYER)] = value
        if i is not None:
            sources[i][ours.removeprefix(LAYER)] = [
                (prefix + n, a.shape) for n, a in zip(names, arrays)
            ]
        used.update(names)
    shown.close()
    _refuse_odd_layers(per_layer, sources)
    for alias, target in ALIASES[arch].items():
        if alias in tensors and alias not in used:
            if not np.array_equal(
                np.asarray(tensors[alias], np.float32), np.asarray(tensors[target], np.float32)
            ):
                raise UserError(
                    f"'{alias}' differs from '{target}': megajax ties the output layer to the "
                    "input embedding, and this checkpoint does not"
                )
            used.add(alias)
    extra = sorted(k for k in tensors if k not in used and not k.endswith(IGNORED_SUFFIXES))
    if extra:
        raise UserError(
            f"the checkpoint has tensors a {arch} pretraining model does not: "
            f"{', '.join(extra[:4])}{' ...' if len(extra) > 4 else ''}"
        )
    return nest(flat, per_layer, cfg.scan_layers)


def _refuse_odd_layers(per_layer: list[dict], sources: list[dict]):
    """Every layer's tensors have the shapes of the others' (the layers are stacked): one that
    does not is named, with its shape and the shape most layers give it."""
    for name in sorted({n for layer in per_layer for n in layer}):  # (dense layers: no experts)
        held = [i for i, layer in enumerate(per_layer) if name in layer]
        shapes = [per_layer[i][name].shape for i in held]
        usual = max(set(shapes), key=lambda s: (shapes.count(s), s == shapes[0]))
        odd = next((i for i, shape in zip(held, shapes) if shape != usual), None)
        if odd is not None:
            pairs = list(zip(sources[odd][name], sources[held[shapes.index(usual)]][name]))
            (tensor, shape), (other, expected) = next(
                ((a, b) for a, b in pairs if a[1] != b[1]), pairs[0]
            )
            raise UserError(
                f"'{tensor}' has shape {shape}, where '{other}' has {expected}: the layers of a "
                "checkpoint have the same shapes"
            )


def to_hf_tensors(arch: str, params: dict, cfg: ModelConfig) -> dict:
    """A megajax params dict (numpy) as an HF state dict, under the names HF saves."""
    flat, per_layer = _flatten(params, cfg)
    out = {}
    for rule in rules_for(arch, cfg):
        for names, ours, i in _expand(rule, cfg):
            source = flat if i is None else per_layer[i]
            for name, x in zip(names, to_hf(rule.form, source[ours.removeprefix(LAYER)], cfg)):
                out[PREFIX.get(arch, "") + name] = np.ascontiguousarray(x, np.float32)
    return out


def _set(tree: dict, dotted: str, value):
    *parents, leaf = dotted.split(".")
    for p in parents:
        tree = tree.setdefault(p, {})
    tree[leaf] = value


def nest(flat: dict, per_layer: list[dict], scan: bool) -> dict:
    tree: dict = {}
    for name, x in flat.items():
        _set(tree, name, x)
    if scan:
        for name in per_layer[0]:
            _set(tree, f"layers.stacked.{name}", np.stack([layer[name] for layer in per_layer]))
    else:
        for i, layer in enumerate(per_layer):
            for name, x in layer.items():
                _set(tree, f"layers.layers.{i}.{name}", x)
    return tree


def _leaves(tree: dict, prefix: str = ""):
    for k, v in tree.items():
        if isinstance(v, dict):
            yield from _leaves(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}", v


def _flatten(params: dict, cfg: ModelConfig) -> tuple[dict, list[dict]]:
    flat, per_layer = {}, [{} for _ in range(cfg.num_layers)]
    for name, x in _leaves(params):
        if name.startswith("layers.stacked."):
            for i in range(cfg.num_layers):
                per_layer[i][name.removeprefix("layers.stacked.")] = np.asarray(x[i])
        elif name.startswith("layers.layers."):
            i, rest = name.removeprefix("layers.layers.").split(".", 1)
            per_layer[int(i)][rest] = np.asarray(x)
        else:
            flat[name] = np.asarray(x)
    return flat, per_layer
