"""The [model] table of a config: a transformer's shape and architecture, and its validation.

One ModelConfig describes GPT-2 and BERT (2019) and the decoders of today (Llama, Mistral,
Qwen2): RMSNorm, rotary positions, SwiGLU, grouped-query attention, untied output layers and
their bias patterns are fields here, each validated with every other.
"""

from __future__ import annotations

import dataclasses
import math

from megajax.analytic import REMAT_MODES, layer_params, moe_mlp_params
from megajax.errors import UserError
from megajax.mesh_shape import MeshShape
from megajax.moe_config import mlp_trait, moe_problem, sparse_layers
from megajax.shapes import MODEL_TASKS


class ConfigError(UserError, ValueError):
    """A mistake in a config file or override that the user can fix."""


# model.remat was a boolean once: true and false still mean "full" and "none"
REMAT_ALIASES = {True: "full", False: "none", "true": "full", "false": "none"}
ROPE_SCALINGS = ("none", "linear", "llama3")
# the layers LoRA adapts (core/lora.py): the attention's qkv and out, the MLP's fc1 and fc2
LORA_TARGETS = ("qkv", "out", "fc1", "fc2")
# The fields of today's decoders: with the sizes they fix a model's weights and its function, so
# a workdir's model (--init-from) and an imported checkpoint decide them, never an override.
ARCHITECTURE = (
    "norm",
    "positions",
    "rope_theta",
    "rope_scaling",
    "rope_factor",
    "rope_low_freq_factor",
    "rope_high_freq_factor",
    "rope_original_context",
    "max_positions",
    "mlp",
    "num_kv_heads",
    "kv_channels",
    "bias",
    "tie_embeddings",
    "sliding_window",
    "qk_norm",
    # a mixture of experts' shape and routing (its loss coefficients and capacity are the run's)
    "num_experts",
    "experts_per_token",
    "moe_ffn_hidden",
    "moe_shared_experts",
    "moe_shared_ffn_hidden",
    "moe_shared_gate",
    "moe_router",
    "moe_norm_topk",
    "moe_layer_freq",
    "moe_first_dense_layers",
    "moe_bias_update_rate",
)


def one_of(section_config, section: str, **choices):
    for name, allowed in choices.items():
        if getattr(section_config, name) not in allowed:
            raise ConfigError(
                f"{section}.{name} must be {', '.join(allowed[:-1])} or {allowed[-1]}, got "
                f"'{getattr(section_config, name)}'"
            )


def swiglu_ffn(hidden: int) -> int:
    """SwiGLU's default width: two thirds of 4h (the same matmul FLOPs as a GeLU MLP of 4h),
    rounded up to a multiple of 256 (Llama's rule)."""
    return 256 * math.ceil(8 * hidden / 3 / 256)


@dataclasses.dataclass(slots=True)  # slots: a misspelt field set from Python is an error
class ModelConfig:
    kind: str = "gpt"  # gpt | bert
    # pretrain (GPT: next token; BERT: MLM + SOP) | BERT: race | mnli | qqp (shapes.py)
    task: str = "pretrain"
    num_layers: int = 4  # transformer layers
    hidden: int = 256  # the model width h
    num_heads: int = 4  # attention (query) heads; split over the model axis
    ffn_hidden: int = 0  # 0 -> 4 * hidden
    seq_len: int = 256  # training sequence length (and learned positions' rows)
    vocab_size: int = 256  # the tokenizer's size; padded below
    # padded vocab = vocab_size rounded up to this (50257 -> 51200)
    vocab_multiple: int = 1024
    hidden_dropout: float = 0.1  # after attention and MLP, and on embeddings
    attention_dropout: float = 0.1  # on the attention probabilities
    ln_placement: str = "pre"  # pre (GPT-2, the paper's BERT) | post (original BERT)
    ln_eps: float = 1e-5  # LayerNorm's / RMSNorm's epsilon
    init_std: float = 0.02  # normal init; output layers scaled by 1/sqrt(2L)
    # auto (16-bit on GPU/TPU, float32 on CPU) | float32 | bfloat16 | float16 | mixed (bfloat16
    # matmul operands, float32 accumulation and activations)
    compute_dtype: str = "auto"
    # tanh (Megatron-LM's fused bias-GeLU and openai_gelu, GPT-2) | exact (erf; HF's BERT)
    gelu: str = "tanh"
    # none | selective (recompute the attention core: scores, softmax, dropout, probabilities x
    # values) | full (recompute each layer); true/false: full/none
    remat: str = "none"
    scan_layers: bool = True  # one compiled layer body, looped: compile time flat in depth
    # a scanned stack without full remat recomputes LayerNorm's and GeLU's outputs in the
    # backward pass instead of keeping them: a third fewer bytes (not "mixed")
    recompute_norm_gelu: bool = False
    # between blocks, activations split over "model" along the sequence (Korthikanti et al.
    # 2022); model.seq_len must divide by the model axis
    sequence_parallel: bool = False
    norm: str = "layernorm"  # layernorm | rmsnorm (Llama, Mistral, Qwen2); epsilon: ln_eps
    # learned (a table of seq_len rows) | rope (rotary, on each device's heads)
    positions: str = "learned"
    rope_theta: float = 10000.0  # rope: the base of the rotary frequencies
    # none | linear (positions / rope_factor) | llama3 (Llama 3.1's long-context rule: low
    # frequencies / rope_factor, high ones kept, a smooth blend between over wavelengths
    # relative to rope_original_context)
    rope_scaling: str = "none"
    rope_factor: float = 1.0  # the rope_scaling rule's factor (linear and llama3)
    # llama3: wavelengths above rope_original_context / rope_low_freq_factor are divided
    rope_low_freq_factor: float = 1.0
    # llama3: wavelengths below rope_original_context / rope_high_freq_factor are kept
    rope_high_freq_factor: float = 4.0
    rope_original_context: int = 8192  # the context the rope_factor rule is relative to
    # rope: the longest sequence the model is made for (HF's max_position_embeddings; sampling
    # stops there); 0 -> seq_len
    max_positions: int = 0
    # a query attends to itself and the sliding_window - 1 positions before it (Mistral's,
    # Qwen2's use_sliding_window); 0: to every position before it
    sliding_window: int = 0
    # gelu | swiglu (silu(x Wg) * (x Wu), then Wd; ffn_hidden 0 -> swiglu_ffn)
    mlp: str = "gelu"
    # key/value heads: 0 -> num_heads; fewer: grouped-query (1: multi-query)
    num_kv_heads: int = 0
    # the head dimension: 0 -> hidden / num_heads (Megatron-LM's name)
    kv_channels: int = 0
    # the layers' linear biases: all (GPT-2, BERT) | none (Llama, Mistral) | qkv (Qwen2: the
    # query, key and value projections only)
    bias: str = "all"
    # the output layer is the input embedding (GPT-2) or its own weight
    tie_embeddings: bool = True
    # Qwen3's QK-norm: an RMSNorm over each head's queries and keys before rotary positions
    qk_norm: bool = False
    # the attention core: megajax (its own; core/blocked_attention.py on the CPU without
    # attention dropout) | fused (jax.nn.dot_product_attention: cuDNN's flash attention on
    # NVIDIA GPUs, XLA elsewhere; no attention dropout) | auto (fused on GPUs where it can)
    attention: str = "auto"
    # LoRA adapters (core/lora.py): rank 0 is none; with them only the adapters are trained
    lora_rank: int = 0
    lora_alpha: float = 16.0  # the adapters' scale is lora_alpha / lora_rank (PEFT's)
    lora_dropout: float = 0.0  # on the adapters' input, as PEFT's lora_dropout
    # the adapted layers, among qkv, out (attention's), fc1 (SwiGLU: gate and up), fc2
    lora_targets: str = "qkv,out,fc1,fc2"
    # a mixture of experts' experts in each sparse layer (core/moe.py); 0: a dense model
    num_experts: int = 0
    experts_per_token: int = 2  # the experts the router chooses for each token (top-k)
    moe_ffn_hidden: int = 0  # each expert's MLP width; 0 -> ffn_hidden's
    moe_shared_experts: int = 0  # always-on experts beside the routed ones (Qwen2-MoE, DeepSeek)
    # the shared experts' width, all together; 0 -> moe_shared_experts x moe_ffn_hidden
    moe_shared_ffn_hidden: int = 0
    moe_shared_gate: bool = False  # the shared experts' output times sigmoid(x Wg) (Qwen2-MoE)
    moe_router: str = "softmax"  # softmax | sigmoid: the router's scores from its logits
    # the chosen k scores renormalised to sum to 1 (Mixtral's softmax over the top k; Qwen's
    # norm_topk_prob)
    moe_norm_topk: bool = False
    moe_aux_loss: float = 0.0  # Switch's load-balancing loss, this coefficient, each sparse layer
    moe_z_loss: float = 0.0  # the router's z-loss (ST-MoE), this coefficient, each sparse layer
    # DeepSeek-V3's auxiliary-loss-free balance: a per-expert bias added to the scores for the
    # choice only, moved by this rate once per step toward the experts given fewer tokens
    moe_bias_update_rate: float = 0.0
    # each expert's tokens per row at most moe_capacity_factor x tokens x k / experts, the
    # assignments past that dropped (counted: moe/dropped); 0: dropless, none ever dropped
    moe_capacity_factor: float = 0.0
    # layer i (from 0) is sparse when (i + 1) % moe_layer_freq == 0 (Qwen2-MoE's
    # decoder_sparse_step) and i >= moe_first_dense_layers
    moe_layer_freq: int = 1
    moe_first_dense_layers: int = 0  # the first layers dense whatever moe_layer_freq (DeepSeek's)

    @property
    def ffn(self) -> int:
        return self.ffn_hidden or (
            swiglu_ffn(self.hidden) if self.mlp == "swiglu" else 4 * self.hidden
        )

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden // self.num_heads

    @property
    def context(self) -> int:
        """The longest sequence the model takes: its position table, or with rotary positions
        max_positions (seq_len is then only the training length)."""
        return max(self.max_positions, self.seq_len) if self.positions == "rope" else self.seq_len

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads

    @property
    def padded_vocab(self) -> int:
        """The vocabulary's rows in a checkpoint, on every mesh: vocab_size rounded up to
        vocab_multiple."""
        return int(math.ceil(self.vocab_size / self.vocab_multiple) * self.vocab_multiple)

    def vocab_rows(self, mesh: MeshShape) -> int:
        """The rows the model axis of `mesh` holds: padded_vocab, padded further when the axis
        does not divide it (models/vocab_rows.py)."""
        return -(-self.padded_vocab // mesh.model) * mesh.model

    def validate(self):
        self.remat = REMAT_ALIASES.get(self.remat, self.remat)
        if self.remat not in REMAT_MODES:
            raise ConfigError(
                "model.remat must be none, selective or full (true/false: full/none), got "
                f"{self.remat!r}"
            )
        if self.kind not in MODEL_TASKS:
            raise ConfigError(
                f"model.kind must be one of {', '.join(MODEL_TASKS)}, got '{self.kind}'"
            )
        if self.task not in MODEL_TASKS[self.kind]:
            other = [k for k, tasks in MODEL_TASKS.items() if self.task in tasks]
            hint = f'; it is a {other[0]} task: set model.kind = "{other[0]}"' if other else ""
            raise ConfigError(
                f"model.task must be one of {', '.join(MODEL_TASKS[self.kind])} for model.kind = "
                f"\"{self.kind}\", got '{self.task}'{hint}"
            )
        one_of(
            self,
            "model",
            ln_placement=("pre", "post"),
            gelu=("exact", "tanh"),
            attention=("auto", "megajax", "fused"),
            compute_dtype=("auto", "float32", "bfloat16", "float16", "mixed"),
            norm=("layernorm", "rmsnorm"),
            positions=("learned", "rope"),
            rope_scaling=ROPE_SCALINGS,
            mlp=("gelu", "swiglu"),
            bias=("all", "none", "qkv"),
        )
        for name in (
            "num_layers",
            "hidden",
            "num_heads",
            "seq_len",
            "vocab_size",
            "vocab_multiple",
            "ln_eps",
            "init_std",
        ):
            if getattr(self, name) <= 0:
                raise ConfigError(f"model.{name} must be positive, got {getattr(self, name)}")
        if self.hidden % self.num_heads and not self.kv_channels:
            raise ConfigError(
                f"model.hidden={self.hidden} is not divisible by model.num_heads={self.num_heads}: "
                "set model.kv_channels, the head dimension"
            )
        self.validate_architecture()
        for name in ("hidden_dropout", "attention_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ConfigError(f"model.{name} must be in [0, 1), got {getattr(self, name)}")
        if self.ffn_hidden < 0:
            raise ConfigError(
                f"model.ffn_hidden must be 0 (4 x hidden) or positive, got {self.ffn_hidden}"
            )
        self.validate_lora()
        self.validate_moe()
        if self.attention == "fused" and self.attention_dropout:
            raise ConfigError(
                'model.attention = "fused" has no attention dropout: set '
                f"model.attention_dropout=0 (it is {self.attention_dropout}) or model.attention = "
                '"megajax"'
            )

    def validate_lora(self):
        if self.lora_rank < 0 or self.lora_alpha <= 0 or not 0.0 <= self.lora_dropout < 1.0:
            raise ConfigError(
                "model.lora_rank must be 0 (no adapters) or positive, lora_alpha positive and "
                f"lora_dropout in [0, 1); got {self.lora_rank}, {self.lora_alpha}, "
                f"{self.lora_dropout}"
            )
        targets = self.named_lora_targets
        unknown = [t for t in targets if t not in LORA_TARGETS]
        if unknown or (self.lora_rank and not targets):
            raise ConfigError(
                f"model.lora_targets names layers among {', '.join(LORA_TARGETS)} "
                f"(comma-separated), got {self.lora_targets!r}"
            )

    def validate_moe(self):
        """The mixture-of-experts fields, each against the others (moe_config.py)."""
        if (problem := moe_problem(self, ModelConfig())) is not None:
            raise ConfigError(problem)

    @property
    def moe_ffn(self) -> int:
        """Each expert's width."""
        return self.moe_ffn_hidden or self.ffn

    @property
    def moe_shared_ffn(self) -> int:
        """The shared experts' width, all of them together (0: none)."""
        return self.moe_shared_ffn_hidden or self.moe_shared_experts * self.moe_ffn

    @property
    def sparse_layers(self) -> tuple[bool, ...]:
        """For each layer, whether its MLP is a mixture of experts."""
        return sparse_layers(self)

    def validate_architecture(self):
        """The fields of today's decoders, each against the others."""
        for name in ("num_kv_heads", "kv_channels", "max_positions", "sliding_window"):
            if getattr(self, name) < 0:
                raise ConfigError(
                    f"model.{name} must be 0 (the default) or positive, got {getattr(self, name)}"
                )
        if self.num_heads % self.kv_heads:
            raise ConfigError(
                f"model.num_heads={self.num_heads} is not divisible by "
                f"model.num_kv_heads={self.kv_heads}: each key/value head serves a whole group of "
                "query heads"
            )
        gpt_only = (self.positions != "learned", not self.tie_embeddings, self.qk_norm)
        if self.kind != "gpt" and (any(gpt_only) or self.norm != "layernorm"):
            raise ConfigError(
                'model.positions = "rope", model.norm = "rmsnorm", model.qk_norm and '
                "model.tie_embeddings = false are for GPT-style decoders; model.kind = "
                f'"{self.kind}" learns its positions, normalises with LayerNorm and ties its '
                "output layer"
            )
        if self.positions == "rope":
            if self.head_dim % 2:
                raise ConfigError(
                    "rotary positions rotate pairs of features: the head dimension "
                    f"({self.head_dim}) must be even"
                )
            if self.rope_theta <= 1:
                raise ConfigError(
                    f"model.rope_theta must be greater than 1, got {self.rope_theta:g}"
                )
        elif self.rope_scaling != "none":
            raise ConfigError(
                f'model.rope_scaling = "{self.rope_scaling}" scales rotary positions: set '
                'model.positions = "rope" (or model.rope_scaling = "none")'
            )
        if self.rope_scaling != "none" and self.rope_factor < 1:
            raise ConfigError(f"model.rope_factor must be at least 1, got {self.rope_factor:g}")
        if self.rope_scaling == "llama3" and not (
            0 < self.rope_low_freq_factor < self.rope_high_freq_factor
            and self.rope_original_context > 0
        ):
            raise ConfigError(
                "llama3 rope scaling needs 0 < model.rope_low_freq_factor "
                f"({self.rope_low_freq_factor:g}) < model.rope_high_freq_factor "
                f"({self.rope_high_freq_factor:g}) and model.rope_original_context > 0 "
                f"({self.rope_original_context})"
            )

    def describe(self) -> str:
        """One line: the kind, its architecture and sizes."""
        traits = [f"{self.ln_placement}-{'RMSNorm' if self.norm == 'rmsnorm' else 'LayerNorm'}"]
        traits += ["rotary positions"] * (self.positions == "rope") + [mlp_trait(self)] * (
            self.mlp == "swiglu" or self.num_experts > 0
        )
        traits += ["QK-norm"] * self.qk_norm + ["untied output layer"] * (not self.tie_embeddings)
        heads = f"{self.num_heads} heads" + (
            f" / {self.kv_heads} key-value" if self.kv_heads < self.num_heads else ""
        )
        return (
            f"{self.kind} ({', '.join(traits)}), {self.num_layers} layers, hidden {self.hidden}, "
            f"{heads}, vocabulary {self.vocab_size} (padded to {self.padded_vocab}), "
            f"{self.context} positions"
        )

    @property
    def lora_target_list(self) -> tuple[str, ...]:
        """The adapted layers (none without model.lora_rank)."""
        return self.named_lora_targets if self.lora_rank else ()

    @property
    def named_lora_targets(self) -> tuple[str, ...]:
        """The layers model.lora_targets names, comma-separated."""
        return tuple(t.strip() for t in self.lora_targets.split(",") if t.strip())

    @property
    def adapter_params(self) -> int:
        """LoRA parameters of one layer: rank x (d_in + d_out) for each adapted layer (a fused
        layer's parts share A, each has its B); 0 without adapters."""
        h, d = self.hidden, self.head_dim
        shapes = {
            "qkv": (h, (self.num_heads + 2 * self.kv_heads) * d),
            "out": (self.num_heads * d, h),
            "fc1": (h, 2 * self.ffn if self.mlp == "swiglu" else self.ffn),
            "fc2": (self.ffn, h),
        }
        return sum(self.lora_rank * sum(shapes[t]) for t in self.lora_target_list)

    @property
    def layer_params(self) -> int:
        return self._layer_params(self.ffn)

    def _layer_params(self, ffn: int) -> int:
        """A layer's parameters with a dense MLP of width `ffn` (analytic.layer_params)."""
        return layer_params(
            self.hidden,
            ffn,
            heads=self.num_heads,
            kv_heads=self.kv_heads,
            head_dim=self.head_dim,
            gated=self.mlp == "swiglu",
            bias=self.bias,
            norm=self.norm,
            qk_norm=self.qk_norm,
        )

    @property
    def params_per_layer(self) -> tuple[int, ...]:
        """Each layer's parameters (a sparse layer's router, experts and shared experts in place
        of the dense MLP)."""
        return tuple(
            self._moe_layer(active=False) if sparse else self.layer_params
            for sparse in self.sparse_layers
        )

    @property
    def active_layer_params(self) -> float:
        """The weights one token goes through in the layers, summed over them: a sparse layer's
        router, its k experts and the shared experts (what MFU counts, as the anchors do)."""
        return float(
            sum(
                self._moe_layer(active=True) if sparse else self.layer_params
                for sparse in self.sparse_layers
            )
        )

    def _moe_layer(self, active: bool) -> int:
        # the layer without its MLP: no dense MLP's output bias either
        attention = self._layer_params(0) - (self.hidden if self.bias == "all" else 0)
        total, expert = moe_mlp_params(
            self.hidden,
            self.moe_ffn,
            self.num_experts,
            shared_ffn=self.moe_shared_ffn,
            shared_gate=self.moe_shared_gate,
            gated=self.mlp == "swiglu",
            bias=self.bias,
        )
        if active:
            total -= (self.num_experts - self.experts_per_token) * expert
        return attention + total
