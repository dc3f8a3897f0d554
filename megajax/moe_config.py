"""The mixture-of-experts fields of the [model] table checked against each other (the fields
themselves are ModelConfig's, model_config.py): one line per mistake."""

from __future__ import annotations

import math

# the numeric fields, num_experts first
MOE_FIELDS = (
    "num_experts",
    "experts_per_token",
    "moe_ffn_hidden",
    "moe_shared_experts",
    "moe_shared_ffn_hidden",
    "moe_aux_loss",
    "moe_z_loss",
    "moe_bias_update_rate",
    "moe_capacity_factor",
    "moe_layer_freq",
    "moe_first_dense_layers",
)
ROUTERS = ("softmax", "sigmoid")


def mlp_trait(cfg) -> str:
    """A config's MLP for its one-line description: "SwiGLU 11008", or its experts'."""
    kind = "SwiGLU" if cfg.mlp == "swiglu" else "GeLU"
    if not cfg.num_experts:
        return f"{kind} {cfg.ffn}"
    shared = f" + {cfg.moe_shared_ffn} shared" if cfg.moe_shared_experts else ""
    return f"{cfg.num_experts} {kind} experts of {cfg.moe_ffn}{shared}, top-{cfg.experts_per_token}"


def capacity(seq: int, factor: float, k: int, num_experts: int) -> int:
    """Slots per expert in a row of `seq` tokens: the row's length when dropless (`factor` 0: no
    expert can be given more), else factor x seq x k / E rounded up (at most seq)."""
    if not factor:
        return seq
    return max(1, min(seq, math.ceil(factor * seq * k / num_experts)))


def sparse_layers(cfg) -> tuple[bool, ...]:
    """For each layer of a ModelConfig, whether its MLP is a mixture of experts: layer i (from 0)
    when i >= moe_first_dense_layers and (i + 1) % moe_layer_freq == 0."""
    return tuple(
        cfg.num_experts > 0
        and i >= cfg.moe_first_dense_layers
        and (i + 1) % max(cfg.moe_layer_freq, 1) == 0
        for i in range(cfg.num_layers)
    )


def moe_problem(cfg, defaults) -> str | None:
    """What is wrong with a ModelConfig's mixture-of-experts fields, or None. `defaults`: a
    ModelConfig of the defaults (a dense model sets none of the fields)."""
    for name in MOE_FIELDS:
        if getattr(cfg, name) < 0:
            return f"model.{name} must not be negative, got {getattr(cfg, name)}"
    if cfg.num_experts == 0:
        changed = [
            n
            for n in (*MOE_FIELDS[1:], "moe_shared_gate", "moe_router", "moe_norm_topk")
            if getattr(cfg, n) != getattr(defaults, n)
        ]
        if changed:
            return (
                f"model.{changed[0]} configures a mixture of experts: set model.num_experts (it "
                "is 0, a dense model)"
            )
        return None
    if cfg.moe_router not in ROUTERS:
        return f"model.moe_router must be softmax or sigmoid, got '{cfg.moe_router}'"
    if not 1 <= cfg.experts_per_token <= cfg.num_experts:
        return (
            f"model.experts_per_token must be 1 to model.num_experts ({cfg.num_experts}), got "
            f"{cfg.experts_per_token}"
        )
    if cfg.moe_layer_freq < 1 or not any(sparse_layers(cfg)):
        return (
            f"model.moe_layer_freq ({cfg.moe_layer_freq}) and model.moe_first_dense_layers "
            f"({cfg.moe_first_dense_layers}) leave no sparse layer among model.num_layers "
            f"({cfg.num_layers})"
        )
    if cfg.moe_shared_gate and not cfg.moe_shared_experts:
        return "model.moe_shared_gate gates shared experts: set model.moe_shared_experts"
    if cfg.kind != "gpt":
        return "mixtures of experts (model.num_experts) are for GPT decoders"
    if cfg.scan_layers and not all(sparse_layers(cfg)):
        return (
            "a scanned stack runs one layer body: with dense layers among the sparse ones "
            "(model.moe_layer_freq, model.moe_first_dense_layers) set model.scan_layers = false"
        )
    if cfg.lora_rank and {"fc1", "fc2"} & set(cfg.named_lora_targets):
        return (
            "LoRA adapts the attention of a mixture of experts, whose experts stay frozen: set "
            'model.lora_targets = "qkv,out"'
        )
    return None
