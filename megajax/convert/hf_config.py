"""Hugging Face config.json <-> megajax ModelConfig for the supported architectures: GPT-2, BERT,
Megatron-BERT, and the decoders of today (Llama, Mistral, Qwen2, Qwen3, Mixtral, Qwen2-MoE,
Qwen3-MoE: hf_decoders.py).

Everything that shapes the computation comes from the HF config: sizes, position count,
norm epsilon, the activation, dropout rates, rotary positions and their scaling. Options megajax
does not implement (GPT-2's attention scaled by layer index, BERT's relative positions,
cross-attention, a window over some layers only, other rope scalings) are refused rather than
silently ignored.
"""

from __future__ import annotations

import dataclasses

from megajax.config import ModelConfig
from megajax.convert import hf_decoders
from megajax.errors import UserError
from megajax.shapes import TYPE_VOCAB

# HF architecture name -> (model_type, megajax kind, LayerNorm placement)
ARCHITECTURES = {
    "GPT2LMHeadModel": ("gpt2", "gpt", "pre"),
    "BertForPreTraining": ("bert", "bert", "post"),
    "MegatronBertForPreTraining": ("megatron-bert", "bert", "pre"),
    **{arch: (model_type, "gpt", "pre") for arch, model_type in hf_decoders.ARCHITECTURES.items()},
}
BY_MODEL_TYPE = {model_type: arch for arch, (model_type, _, _) in ARCHITECTURES.items()}
GELU = {"gelu": "exact", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh"}
GELU_NAME = {"exact": "gelu", "tanh": "gelu_new"}


def architecture(hf: dict) -> str:
    """The supported architecture an HF config describes, or a UserError naming what is
    supported."""
    names = list(hf.get("architectures") or [])
    if not names and hf.get("model_type") in BY_MODEL_TYPE:
        names = [BY_MODEL_TYPE[hf["model_type"]]]
    for name in names:
        if name in ARCHITECTURES:
            return name
    if not names and "model_type" not in hf:
        megajax = " (it is a megajax workdir's)" if isinstance(hf.get("model"), dict) else ""
        raise UserError(
            f"config.json names no architectures or model_type: not a Hugging Face model's{megajax}"
        )
    found = ", ".join(names) or f"model_type '{hf.get('model_type')}'"
    raise UserError(
        f"unsupported architecture {found}: megajax converts {', '.join(ARCHITECTURES)}"
    )


def _gelu(name) -> str:
    if name not in GELU:
        raise UserError(f"activation '{name}' is not supported (megajax has {', '.join(GELU)})")
    return GELU[name]


def _refuse(hf: dict, checks: dict):
    for key, (ok, why) in checks.items():
        if key in hf and not ok(hf[key]):
            raise UserError(
                f"config.json has {key} = {hf[key]!r}: {why}, which megajax does not implement"
            )


def model_config(
    hf: dict, base: ModelConfig | None = None, seq_len_given: bool = False
) -> tuple[str, ModelConfig]:
    """(model_type, ModelConfig) for an HF config dict; fields HF does not describe (padding
    multiple, precision, scan, remat; with rotary positions the training length, unless
    `seq_len_given`: seq_len is then base's) keep `base`'s values."""
    arch = architecture(hf)
    model_type, kind, placement = ARCHITECTURES[arch]
    base = base or ModelConfig()
    try:
        if model_type in hf_decoders.MODEL_TYPES:
            fields = hf_decoders.fields(model_type, hf, base.seq_len if seq_len_given else None)
        elif model_type == "gpt2":
            _refuse(
                hf,
                {
                    "scale_attn_weights": (bool, "unscaled attention"),
                    "scale_attn_by_inverse_layer_idx": (
                        lambda v: not v,
                        "attention scaled by layer index",
                    ),
                    "add_cross_attention": (lambda v: not v, "cross-attention"),
                },
            )
            fields = dict(
                num_layers=hf["n_layer"],
                hidden=hf["n_embd"],
                num_heads=hf["n_head"],
                ffn_hidden=hf.get("n_inner") or 0,
                seq_len=hf["n_positions"],
                ln_eps=hf.get("layer_norm_epsilon", 1e-5),
                gelu=_gelu(hf.get("activation_function", "gelu_new")),
                hidden_dropout=hf.get("resid_pdrop", 0.1),
                attention_dropout=hf.get("attn_pdrop", 0.1),
            )
        else:
            _refuse(
                hf,
                {
                    "type_vocab_size": (
                        lambda v: v == TYPE_VOCAB,
                        f"not {TYPE_VOCAB} segment types",
                    ),
                    "position_embedding_type": (lambda v: v == "absolute", "relative positions"),
                    "is_decoder": (lambda v: not v, "a decoder"),
                    "add_cross_attention": (lambda v: not v, "cross-attention"),
                },
            )
            fields = dict(
                num_layers=hf["num_hidden_layers"],
                hidden=hf["hidden_size"],
                num_heads=hf["num_attention_heads"],
                ffn_hidden=hf["intermediate_size"],
                seq_len=hf["max_position_embeddings"],
                ln_eps=hf.get("layer_norm_eps", 1e-12),
                gelu=_gelu(hf.get("hidden_act", "gelu")),
                hidden_dropout=hf.get("hidden_dropout_prob", 0.1),
                attention_dropout=hf.get("attention_probs_dropout_prob", 0.1),
            )
        fields.update(
            kind=kind,
            task="pretrain",
            ln_placement=placement,
            vocab_size=hf["vocab_size"],
            init_std=hf.get("initializer_range", 0.02),
        )
    except KeyError as e:
        raise UserError(f"config.json of a {arch} lacks '{e.args[0]}'") from None
    wrong = [
        f"{k} = {v!r}"
        for k, v in fields.items()
        if k not in ("kind", "task", "ln_placement", "gelu")
        and k not in hf_decoders.WORDS
        and not (isinstance(v, (int, float)) and not isinstance(v, bool))
    ]
    if wrong:
        raise UserError(f"config.json has values that are not numbers: {', '.join(wrong)}")
    cfg = dataclasses.replace(base, **fields)
    cfg.validate()
    return model_type, cfg


def export_architecture(cfg: ModelConfig) -> str:
    """The HF architecture a megajax model is written as."""
    if cfg.task != "pretrain":
        raise UserError(
            "only pretraining models export to Hugging Face; this one is fine-tuned for "
            f"'{cfg.task}'"
        )
    if cfg.kind == "gpt" and (decoder := hf_decoders.export_architecture(cfg)):
        return decoder
    if cfg.kind == "gpt":
        if cfg.ln_placement != "pre":
            raise UserError("a GPT with post-LayerNorm has no Hugging Face GPT-2 equivalent")
        return "GPT2LMHeadModel"
    return "BertForPreTraining" if cfg.ln_placement == "post" else "MegatronBertForPreTraining"


def hf_config(cfg: ModelConfig) -> dict:
    """The config.json `transformers` reads for a megajax model."""
    arch = export_architecture(cfg)
    model_type = ARCHITECTURES[arch][0]
    if model_type in hf_decoders.MODEL_TYPES:
        return hf_decoders.hf_config(arch, model_type, cfg)
    common = dict(
        architectures=[arch],
        model_type=model_type,
        vocab_size=cfg.vocab_size,
        initializer_range=cfg.init_std,
        tie_word_embeddings=True,
    )
    if model_type == "gpt2":
        return dict(
            common,
            n_layer=cfg.num_layers,
            n_embd=cfg.hidden,
            n_head=cfg.num_heads,
            n_inner=cfg.ffn_hidden or None,
            n_positions=cfg.seq_len,
            layer_norm_epsilon=cfg.ln_eps,
            activation_function=GELU_NAME[cfg.gelu],
            resid_pdrop=cfg.hidden_dropout,
            embd_pdrop=cfg.hidden_dropout,
            attn_pdrop=cfg.attention_dropout,
        )
    return dict(
        common,
        num_hidden_layers=cfg.num_layers,
        hidden_size=cfg.hidden,
        num_attention_heads=cfg.num_heads,
        intermediate_size=cfg.ffn,
        max_position_embeddings=cfg.seq_len,
        layer_norm_eps=cfg.ln_eps,
        hidden_act=GELU_NAME[cfg.gelu],
        hidden_dropout_prob=cfg.hidden_dropout,
        attention_probs_dropout_prob=cfg.attention_dropout,
        type_vocab_size=TYPE_VOCAB,
        position_embedding_type="absolute",
    )
