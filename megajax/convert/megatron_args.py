"""A Megatron-LM run's arguments (the argparse Namespace each checkpoint file holds) as megajax's
ModelConfig: sizes, GeLU form, dropout, and megatron-core's Llama-style options (RMSNorm, rotary
positions and their scaling, SwiGLU, query groups, bias patterns, an untied output layer). What
megajax does not implement is refused in one line naming the argument."""

from __future__ import annotations

import dataclasses

from megajax.config import ModelConfig
from megajax.errors import UserError


def _rotary(args: dict) -> dict:
    """The rotary fields of a run's arguments (rope positions only)."""
    for key, ok, what in (
        ("rotary_percent", lambda v: v in (None, 1.0), "1.0"),
        ("rotary_interleaved", lambda v: not v, "false (rotate_half pairs)"),
    ):
        if not ok(args.get(key)):
            raise UserError(
                f"the checkpoint's run has {key} = {args[key]!r}; megajax implements {what}"
            )
    fields = dict(positions="rope", rope_theta=float(args.get("rotary_base") or 10000))
    if args.get("use_rope_scaling"):  # megatron-core's Llama 3.1 rule, its constants fixed
        return dict(
            fields,
            rope_scaling="llama3",
            rope_factor=float(args.get("rope_scaling_factor") or 8.0),
            rope_low_freq_factor=1.0,
            rope_high_freq_factor=4.0,
            rope_original_context=8192,
        )
    if args.get("rotary_seq_len_interpolation_factor"):
        return dict(
            fields,
            rope_scaling="linear",
            rope_factor=float(args["rotary_seq_len_interpolation_factor"]),
        )
    return fields


def _architecture(args: dict) -> dict:
    """ModelConfig fields for the run's norm, positions, MLP, attention groups, biases and head."""
    kinds = {
        "position_embedding_type": ("learned_absolute", "rope"),
        "normalization": ("LayerNorm", "RMSNorm"),
    }
    for key, allowed in kinds.items():
        if args.get(key, allowed[0]) not in allowed:
            raise UserError(
                f"the checkpoint's run has {key} = {args[key]!r}; megajax implements "
                f"{' and '.join(allowed)}"
            )
    fields = _rotary(args) if args.get("position_embedding_type") == "rope" else {}
    bias = (
        "all"
        if args.get("add_bias_linear", True)
        else "qkv"
        if args.get("add_qkv_bias")
        else "none"
    )
    groups = args.get("num_query_groups") if args.get("group_query_attention") else None
    return dict(
        fields,
        norm="rmsnorm" if args.get("normalization") == "RMSNorm" else "layernorm",
        mlp="swiglu" if args.get("swiglu") else "gelu",
        bias=bias,
        num_kv_heads=groups or 0,
        tie_embeddings=not args.get("untie_embeddings_and_output_weights"),
    )


def model_config(args: dict, vocab_size: int, base: ModelConfig) -> ModelConfig:
    """megajax's GPT for a Megatron-LM run's arguments; what megajax does not implement is
    refused."""
    refuse = {
        "apply_residual_connection_post_layernorm": "residuals taken after the LayerNorm",
        "qk_layernorm": "LayerNorm of queries and keys",
        "num_experts": "mixture of experts",
    }
    for key, what in refuse.items():
        if args.get(key):
            raise UserError(
                f"the checkpoint's run has {key} = {args[key]!r} ({what}), which megajax does not "
                "implement"
            )
    architecture = _architecture(args)
    missing = [
        k
        for k in ("num_layers", "hidden_size", "num_attention_heads", "max_position_embeddings")
        if not isinstance(args.get(k), int)
    ]
    if missing:
        raise UserError(
            f"the checkpoint's arguments lack {', '.join(missing)}: not a Megatron-LM GPT run's"
        )
    h, heads = args["hidden_size"], args["num_attention_heads"]
    kv_channels = (
        args.get("kv_channels") if args.get("kv_channels") not in (None, h // heads) else 0
    )
    tanh = (
        args.get("bias_gelu_fusion")
        or args.get("bias_activation_fusion")
        or args.get("openai_gelu")
    ) and not args.get("onnx_safe")
    cfg = dataclasses.replace(
        base,
        kind="gpt",
        task="pretrain",
        ln_placement="pre",
        num_layers=args["num_layers"],
        hidden=h,
        num_heads=heads,
        ffn_hidden=args.get("ffn_hidden_size") or 4 * h,
        seq_len=args["max_position_embeddings"],
        vocab_size=vocab_size,
        ln_eps=args.get("layernorm_epsilon", 1e-5),
        gelu="tanh" if tanh else "exact",
        hidden_dropout=args.get("hidden_dropout", 0.1),
        attention_dropout=args.get("attention_dropout", 0.1),
        init_std=args.get("init_method_std", 0.02),
        kv_channels=kv_channels,
        max_positions=args["max_position_embeddings"]
        if architecture.get("positions") == "rope"
        else 0,
        **architecture,
    )
    cfg.validate()
    return cfg
