"""config.json <-> ModelConfig for the decoders of today: LlamaForCausalLM (Llama 2, 3, 3.1, 3.2),
MistralForCausalLM, Qwen2ForCausalLM and Qwen3ForCausalLM. All four are pre-norm GPTs with
RMSNorm, rotary positions, a SwiGLU MLP and grouped-query attention; they differ in biases
(Qwen2: q, k and v), QK-norm (Qwen3: model.qk_norm, with its own head dimension), rope theta and
scaling, and whether the output layer is tied.

Both spellings of the rotary settings are read: `rope_theta` with `rope_scaling` (the files the
models were released with) and transformers 5's `rope_parameters`. What megajax does not
implement is one line naming the option: another rope scaling (yarn, dynamic, longrope), a
Qwen2 whose sliding window covers some layers only (max_window_layers), biases Llama's files can
switch on (attention_bias, mlp_bias), another activation. A sliding window over every layer
(Mistral's `sliding_window`, Qwen2's `use_sliding_window`) is model.sliding_window.
"""

from __future__ import annotations

from megajax.errors import UserError

ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
}
# mixtures of experts: Mixtral's block_sparse_moe.experts.N.w1/w3/w2, Qwen's
# mlp.experts.N.gate_proj/up_proj/down_proj (Qwen2-MoE's with a gated shared expert)
MOE_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe")
# Qwen's files: a sliding window from layer max_window_layers on (use_sliding_window)
QWEN = ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe")
MODEL_TYPES = set(ARCHITECTURES.values())
# string / bool fields
WORDS = (
    "scan_layers",
    "norm",
    "positions",
    "rope_scaling",
    "mlp",
    "bias",
    "tie_embeddings",
    "qk_norm",
    "moe_norm_topk",
    "moe_router",
    "moe_shared_gate",
)
# the training length an import starts with (--set model.seq_len=N changes it)
DEFAULT_SEQ_LEN = 4096


def _rope(hf: dict) -> dict:
    """The rotary fields of a config, from either spelling."""
    params = dict(hf.get("rope_parameters") or {})
    legacy = hf.get("rope_scaling") or {}
    if not isinstance(params, dict) or not isinstance(legacy, dict):
        raise UserError("config.json's rope_parameters / rope_scaling must be objects")
    params = {**legacy, **params}
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    fields = dict(rope_theta=float(theta))
    if kind == "default":
        return dict(fields, rope_scaling="none")
    if kind == "linear":
        return dict(fields, rope_scaling="linear", rope_factor=float(params["factor"]))
    if kind == "llama3":
        return dict(
            fields,
            rope_scaling="llama3",
            rope_factor=float(params["factor"]),
            rope_low_freq_factor=float(params["low_freq_factor"]),
            rope_high_freq_factor=float(params["high_freq_factor"]),
            rope_original_context=int(params["original_max_position_embeddings"]),
        )
    raise UserError(
        f"config.json has rope scaling '{kind}', which megajax does not implement (it has default, "
        "linear and llama3)"
    )


def _window(model_type: str, hf: dict) -> int:
    """The sliding window every layer attends within (Mistral's `sliding_window`, Qwen2's with
    `use_sliding_window` from layer max_window_layers on, transformers' rule), or 0 (none).
    A window over some layers only is refused."""
    window = hf.get("sliding_window")
    if (
        not (model_type in ("mistral", "mixtral") or hf.get("use_sliding_window", False))
        or window is None
    ):
        return 0
    layers = hf["num_hidden_layers"]
    types = hf.get("layer_types") or (
        [
            "sliding_attention" if i >= hf.get("max_window_layers", 0) else "full_attention"
            for i in range(layers)
        ]
        if model_type in QWEN
        else ["sliding_attention"] * layers
    )
    if len(set(types)) > 1:
        sliding = types.count("sliding_attention")
        raise UserError(
            f"config.json slides its window (sliding_window = {window}) over {sliding} of its "
            f"{layers} layers (max_window_layers / layer_types): megajax slides it over every "
            "layer or none"
        )
    return int(window) if types and types[0] == "sliding_attention" else 0


def fields(model_type: str, hf: dict, seq_len: int | None) -> dict:
    """ModelConfig fields for a Llama-family config.json (`seq_len`: the training length asked
    for, or None for the default)."""
    if hf.get("hidden_act", "silu") != "silu":
        raise UserError(
            f"config.json has hidden_act = {hf['hidden_act']!r}: megajax's SwiGLU uses silu"
        )
    for option in ("attention_bias", "mlp_bias"):
        if model_type in ("llama", "qwen3", "qwen3_moe") and hf.get(option):
            raise UserError(
                f"config.json has {option} = true: biases on the attention's output projection "
                "or the MLP, which megajax's bias patterns (all, none, qkv) do not include"
            )
    heads, hidden = hf["num_attention_heads"], hf["hidden_size"]
    context = hf["max_position_embeddings"]
    head_dim = hf.get("head_dim") or hidden // heads
    return dict(
        num_layers=hf["num_hidden_layers"],
        hidden=hidden,
        num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        kv_channels=0 if head_dim * heads == hidden else head_dim,
        ffn_hidden=hf["intermediate_size"],
        max_positions=context,
        seq_len=seq_len or min(context, DEFAULT_SEQ_LEN),
        ln_eps=hf.get("rms_norm_eps", 1e-6),
        norm="rmsnorm",
        positions="rope",
        mlp="swiglu",
        sliding_window=_window(model_type, hf),
        bias="qkv" if model_type == "qwen2" or _qkv_bias(model_type, hf) else "none",
        qk_norm=model_type in ("qwen3", "qwen3_moe"),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        hidden_dropout=0.0,
        attention_dropout=hf.get("attention_dropout", 0.0),
        **_rope(hf),
        **(_experts(model_type, hf) if model_type in MOE_TYPES else {}),
    )


def _experts(model_type: str, hf: dict) -> dict:
    """A mixture of experts' fields: softmax routing over E experts (the chosen k renormalised:
    Mixtral's softmax over its top k, Qwen's norm_topk_prob), Qwen's dense layers and
    Qwen2-MoE's gated shared expert. HF adds the router's balancing loss only with
    output_router_logits, and megajax likewise."""
    if hf.get("router_jitter_noise"):
        raise UserError(
            f"config.json has router_jitter_noise = {hf['router_jitter_noise']}: noise on the "
            "router's inputs while training, which megajax does not implement"
        )
    experts = hf.get("num_experts") or hf.get("num_local_experts")
    mixtral = model_type == "mixtral"
    dense_first, every = _sparse_pattern(hf)
    shared = hf.get("shared_expert_intermediate_size", 0) if model_type == "qwen2_moe" else 0
    # a scanned stack runs one kind of layer: a file with dense ones runs unrolled
    mixed = {"scan_layers": False} if dense_first or every > 1 else {}
    return dict(
        **mixed,
        moe_layer_freq=every,
        moe_first_dense_layers=dense_first,
        moe_shared_experts=int(shared > 0),
        moe_shared_ffn_hidden=shared,
        moe_shared_gate=shared > 0,
        num_experts=experts,
        experts_per_token=hf["num_experts_per_tok"],
        moe_ffn_hidden=hf["intermediate_size"] if mixtral else hf["moe_intermediate_size"],
        moe_norm_topk=mixtral or bool(hf.get("norm_topk_prob", False)),
        moe_router="softmax",
        moe_aux_loss=float(hf.get("router_aux_loss_coef", 0.0))
        if hf.get("output_router_logits")
        else 0.0,
    )


def _qkv_bias(model_type: str, hf: dict) -> bool:
    """Qwen2-MoE's attention has q, k and v biases unless its qkv_bias says otherwise."""
    return model_type == "qwen2_moe" and bool(hf.get("qkv_bias", True))


def _sparse_pattern(hf: dict) -> tuple[int, int]:
    """(the first layers dense, every how many layers sparse) of a Qwen file's mlp_only_layers
    and decoder_sparse_step (megajax's moe_first_dense_layers and moe_layer_freq); dense layers
    elsewhere are refused."""
    dense = sorted(hf.get("mlp_only_layers") or [])
    every = int(hf.get("decoder_sparse_step", 1) or 1)
    if dense != list(range(len(dense))):
        raise UserError(
            f"config.json's mlp_only_layers = {dense} makes layers dense after sparse ones: "
            "megajax's dense layers come first (model.moe_first_dense_layers)"
        )
    return len(dense), every


def export_architecture(cfg) -> str | None:
    """The HF decoder a megajax GPT with these fields is written as, None for a GPT-2, or a
    UserError for a mixture no HF architecture has."""
    llama_like = (cfg.norm, cfg.positions, cfg.mlp) == ("rmsnorm", "rope", "swiglu")
    if (
        (cfg.norm, cfg.positions, cfg.mlp, cfg.bias, cfg.tie_embeddings)
        == ("layernorm", "learned", "gelu", "all", True)
        and cfg.kv_heads == cfg.num_heads
        and not cfg.kv_channels
        and not cfg.qk_norm
    ):
        return None
    if not llama_like or cfg.bias == "all" or cfg.ln_placement != "pre":
        raise UserError(
            f"no Hugging Face architecture has this model's mixture (norm {cfg.norm}, positions "
            f"{cfg.positions}, mlp {cfg.mlp}, bias {cfg.bias}, {cfg.ln_placement}-norm): GPT-2 is "
            "layernorm + learned + gelu with all biases, Llama/Qwen2 rmsnorm + rope + swiglu"
        )
    if cfg.num_experts:
        return _moe_architecture(cfg)
    if cfg.qk_norm:
        if cfg.bias != "none":
            raise UserError(
                f"no Hugging Face architecture has QK-norm with model.bias = {cfg.bias}: Qwen3 "
                "has QK-norm and no biases"
            )
        return "Qwen3ForCausalLM"
    if cfg.bias == "qkv":
        return "Qwen2ForCausalLM"
    # Llama has no sliding window; Mistral is Llama with one
    return "MistralForCausalLM" if cfg.sliding_window else "LlamaForCausalLM"


def _moe_architecture(cfg) -> str:
    """Qwen3MoeForCausalLM (QK-norm), Qwen2MoeForCausalLM (a gated shared expert) or
    MixtralForCausalLM, or one line naming what the nearest of them needs."""
    arch = (
        "Qwen3MoeForCausalLM"
        if cfg.qk_norm
        else "Qwen2MoeForCausalLM"
        if cfg.moe_shared_experts
        else "MixtralForCausalLM"
    )
    mixtral, qwen2 = arch.startswith("Mixtral"), arch.startswith("Qwen2")
    needs = (
        ("model.bias (none)", cfg.bias != "none" and not (qwen2 and cfg.bias == "qkv")),
        ("model.moe_router (softmax)", cfg.moe_router != "softmax"),
        ("model.moe_bias_update_rate (0)", cfg.moe_bias_update_rate > 0),
        ("model.moe_shared_experts (0)", cfg.moe_shared_experts > 0 and not qwen2),
        ("model.moe_shared_gate (true)", qwen2 and not cfg.moe_shared_gate),
        ("model.moe_norm_topk (true)", mixtral and not cfg.moe_norm_topk),
        ("model.moe_layer_freq (1)", mixtral and cfg.moe_layer_freq != 1),
        ("model.moe_first_dense_layers (0)", mixtral and cfg.moe_first_dense_layers > 0),
    )
    differs = [what for what, wrong in needs if wrong]
    if differs:
        raise UserError(
            "no Hugging Face architecture megajax writes has this mixture of experts: "
            f"{arch} needs {', '.join(differs)}"
        )
    return arch


def _moe_config(model_type: str, cfg) -> dict:
    if model_type == "mixtral":
        return dict(
            num_local_experts=cfg.num_experts,
            num_experts_per_tok=cfg.experts_per_token,
            router_aux_loss_coef=cfg.moe_aux_loss,
            output_router_logits=False,
            router_jitter_noise=0.0,
        )
    out = dict(
        moe_intermediate_size=cfg.moe_ffn,
        num_experts=cfg.num_experts,
        num_experts_per_tok=cfg.experts_per_token,
        norm_topk_prob=cfg.moe_norm_topk,
        decoder_sparse_step=cfg.moe_layer_freq,
        mlp_only_layers=list(range(cfg.moe_first_dense_layers)),
        router_aux_loss_coef=cfg.moe_aux_loss,
        output_router_logits=False,
    )
    if model_type == "qwen2_moe":
        out.update(shared_expert_intermediate_size=cfg.moe_shared_ffn, qkv_bias=cfg.bias == "qkv")
    return out


def hf_config(arch: str, model_type: str, cfg) -> dict:
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling == "linear":
        rope.update(rope_type="linear", factor=cfg.rope_factor)
    elif cfg.rope_scaling == "llama3":
        rope.update(
            rope_type="llama3",
            factor=cfg.rope_factor,
            low_freq_factor=cfg.rope_low_freq_factor,
            high_freq_factor=cfg.rope_high_freq_factor,
            original_max_position_embeddings=cfg.rope_original_context,
        )
    scaling = (
        None
        if rope["rope_type"] == "default"
        else {k: v for k, v in rope.items() if k != "rope_theta"}
    )
    return dict(
        architectures=[arch],
        model_type=model_type,
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden,
        # Mixtral's is its experts' width
        intermediate_size=cfg.moe_ffn if model_type == "mixtral" else cfg.ffn,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.kv_heads,
        head_dim=cfg.head_dim,
        max_position_embeddings=cfg.context,
        rms_norm_eps=cfg.ln_eps,
        hidden_act="silu",
        initializer_range=cfg.init_std,
        tie_word_embeddings=cfg.tie_embeddings,
        attention_dropout=cfg.attention_dropout,
        rope_theta=cfg.rope_theta,
        rope_scaling=scaling,
        rope_parameters=rope,
        torch_dtype="float32",
        **(
            {
                "use_sliding_window": bool(cfg.sliding_window),
                "max_window_layers": 0,
                "sliding_window": cfg.sliding_window or None,
            }
            if model_type in QWEN
            else {"sliding_window": cfg.sliding_window or None}
            if model_type in ("mistral", "mixtral")
            else {"attention_bias": False, "mlp_bias": False}
        ),
        **({"attention_bias": False} if model_type in ("qwen3", "qwen3_moe") else {}),
        **(_moe_config(model_type, cfg) if model_type in MOE_TYPES else {}),
    )
