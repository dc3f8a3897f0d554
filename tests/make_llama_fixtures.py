"""Build the Llama-family fixtures of tests/test_llama.py: tiny random LlamaForCausalLM (grouped
query heads, untied, llama3 rope scaling; and a tied one with as many key/value heads as query
heads), MistralForCausalLM, Qwen2ForCausalLM (q/k/v biases) and Qwen3ForCausalLM (QK-norm, a
head dimension of its own) models saved with
`save_pretrained`, a byte-level BPE tokenizer.json with special tokens and a chat template,
and fixed inputs with what `transformers` computes for them: logits, the gradient of the mean
next-token loss for every weight, and 32 greedy tokens.

Run by hand, in an environment with PyTorch and transformers (never by the test suite):

    python -m venv /tmp/hfenv
    /tmp/hfenv/bin/pip install torch==2.13.0 transformers==5.25.0 safetensors numpy
    /tmp/hfenv/bin/python tests/make_llama_fixtures.py [NAME ...]

It rewrites the fixtures named, or all: tests/fixtures/hf/{llama,llama_tied,mistral,qwen2,
qwen3}/ and the sliding-window models {mistral,qwen2}_window/ (windows of 8 positions, 24-token
rows). The qwen3 fixture was made with torch 2.14.1, the others with 2.13.0.
Every weight is random (norm scales 1 + N(0, 0.1)), so a transposed, mis-ordered or
mis-rotated tensor cannot pass. The Mistral is saved in shards with their index, the Qwen2 in
bfloat16 (its references are computed from the rounded weights).

    /tmp/hfenv/bin/python tests/make_llama_fixtures.py --check EXPORTED_DIR NAME

loads a directory that `megajax-convert export` wrote from the imported fixture NAME with
`from_pretrained` and prints how far its logits are from the fixture's.
"""

import sys
from pathlib import Path

import numpy as np
import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_hf_fixtures import TEXT, randomize  # noqa: E402

OUT = Path(__file__).resolve().parent / "fixtures" / "hf"
SPECIAL = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|start_header_id|>{{ message['role'] "
    "}}<|end_header_id|>\n"
    "\n"
    "{{ message['content'] | trim }}<|eot_id|>{% endfor %}{% if add_generation_prompt "
    "%}<|start_header_id|>assistant<|end_header_id|>\n"
    "\n"
    "{% endif %}"
)
SHAPE = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=8,
    max_position_embeddings=64,
    rms_norm_eps=1e-5,
    attn_implementation="eager",
)


def tokenizer(out: Path):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok.train_from_iterator(
        [TEXT],
        trainers.BpeTrainer(vocab_size=320, special_tokens=SPECIAL, initial_alphabet=alphabet),
    )
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=SPECIAL[0], eos_token=SPECIAL[4]
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    return fast


def build(
    name: str,
    config_cls,
    model_cls,
    seed: int,
    dtype=torch.float32,
    shard: str | None = None,
    seq: int = 16,
    experts: str | None = None,
    **fields,
):
    """`experts`: a mixture of experts' layout in the saved files (mixtral | qwen3_moe), whose
    routers are scaled up (clear choices) and whose routing margins are checked."""
    out = OUT / name
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*"):
        old.unlink()
    tok = tokenizer(out)
    cfg = config_cls(
        vocab_size=len(tok),
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        **SHAPE,
        **fields,
    )
    torch.manual_seed(seed)
    model = randomize(model_cls(cfg), seed)
    noise = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # every norm's scale (the final one too): 1 + noise, each its own
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=noise))
            if experts and pname.endswith("mlp.gate.weight"):  # the router: logits of O(1)
                p.mul_(3.0)
    model = model.to(dtype)
    model.save_pretrained(
        out, safe_serialization=True, **({"max_shard_size": shard} if shard else {})
    )
    # The references: float32 on the weights as saved, loaded again (a model cast in place also
    # casts its rotary frequencies, which from_pretrained computes in float32).
    model = model_cls.from_pretrained(out, dtype=torch.float32, attn_implementation="eager").eval()
    g = np.random.default_rng(seed)
    ids = g.integers(0, cfg.vocab_size, (2, seq))
    out_ = model(torch.tensor(ids), labels=torch.tensor(ids))
    out_.loss.backward()
    grads = {
        f"grad/{k}": v
        for n, p in model.named_parameters()
        for k, v in saved_names(n, p.grad.numpy(), experts).items()
    }
    if experts:
        check_routing_margins(model, ids, cfg.num_experts_per_tok, name)
    with torch.no_grad():
        prompt = torch.tensor(g.integers(0, cfg.vocab_size, (1, 6)))
        gen = model.generate(
            prompt,
            max_new_tokens=32,
            do_sample=False,
            pad_token_id=0,
            eos_token_id=None,
            output_scores=True,
            return_dict_in_generate=True,
        )
    gaps = [np.diff(np.sort(s[0].numpy())[-2:])[0] for s in gen.scores]
    assert min(gaps) > 1e-4, f"{name}: a greedy step is a near tie ({min(gaps)}): pick another seed"
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "Call me Ishmael."}], tokenize=True, add_generation_prompt=True
    )
    # a BatchEncoding in transformers 5
    chat = chat["input_ids"] if hasattr(chat, "keys") else chat
    np.savez_compressed(
        out / "reference.npz",
        ids=ids,
        logits=out_.logits.detach().numpy(),
        loss=out_.loss.detach().numpy(),
        prompt=prompt.numpy(),
        greedy=gen.sequences[:, prompt.shape[1] :].numpy(),
        chat_ids=np.array(chat),
        **grads,
    )


def saved_names(name: str, x: np.ndarray, experts: str | None) -> dict:
    """A parameter (or its gradient) under the names the saved files hold: transformers 5 keeps
    a layer's experts fused, (E, 2 f, h) gate and up and (E, h, f) down, and saves them one
    tensor per expert (Mixtral's w1 / w3 / w2 under block_sparse_moe, Qwen3-MoE's gate_proj /
    up_proj / down_proj)."""
    if not experts or ".mlp." not in name:
        return {name: x}
    layer, rest = name.split(".mlp.", 1)
    base = f"{layer}.block_sparse_moe" if experts == "mixtral" else f"{layer}.mlp"
    gate, up, down = (
        ("w1", "w3", "w2") if experts == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    )
    if rest == "gate.weight":
        return {f"{base}.gate.weight": x}
    if rest == "experts.gate_up_proj":
        f = x.shape[1] // 2
        return {
            f"{base}.experts.{e}.{w}.weight": part
            for e in range(x.shape[0])
            for w, part in ((gate, x[e, :f]), (up, x[e, f:]))
        }
    if rest == "experts.down_proj":
        return {f"{base}.experts.{e}.{down}.weight": x[e] for e in range(x.shape[0])}
    return {name: x}  # a dense layer's MLP, Qwen2-MoE's shared expert and its gate


def check_routing_margins(model, ids, k: int, name: str):
    """Every token's k-th and (k+1)-th router logits apart by more than roundoff could move
    them, in every layer: otherwise another implementation may choose another expert."""
    with torch.no_grad():
        logits = model(torch.tensor(ids), output_router_logits=True).router_logits
    for layer in logits:
        top = layer.float().topk(k + 1, -1).values
        gap = (top[..., k - 1] - top[..., k]).min().item()
        assert gap > 1e-3, f"{name}: a routing near-tie ({gap}): pick another seed"


def check_export(exported: str, name: str):
    ref = np.load(OUT / name / "reference.npz")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        exported, torch_dtype=torch.float32
    ).eval()
    with torch.no_grad():
        got = model(torch.tensor(ref["ids"])).logits.numpy()
    print(
        f"{type(model).__name__}: largest logit difference {np.abs(got - ref['logits']).max():.3g}"
    )


if __name__ == "__main__":
    if sys.argv[1:2] == ["--check"]:
        check_export(*sys.argv[2:4])
        sys.exit(0)
    llama3 = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
    }
    builds = {
        "llama": lambda: build(
            "llama",
            transformers.LlamaConfig,
            transformers.LlamaForCausalLM,
            11,
            num_key_value_heads=2,
            tie_word_embeddings=False,
            rope_theta=500000.0,
            rope_scaling=llama3,
        ),
        "llama_tied": lambda: build(
            "llama_tied",
            transformers.LlamaConfig,
            transformers.LlamaForCausalLM,
            12,
            num_key_value_heads=8,
            tie_word_embeddings=True,
            rope_theta=10000.0,
        ),
        "mistral": lambda: build(
            "mistral",
            transformers.MistralConfig,
            transformers.MistralForCausalLM,
            15,
            shard="60KB",
            num_key_value_heads=4,
            tie_word_embeddings=False,
            rope_theta=1000000.0,
            sliding_window=None,
        ),
        "qwen2": lambda: build(
            "qwen2",
            transformers.Qwen2Config,
            transformers.Qwen2ForCausalLM,
            14,
            dtype=torch.bfloat16,
            num_key_value_heads=2,
            tie_word_embeddings=False,
            rope_theta=1000000.0,
            use_sliding_window=False,
        ),
        # Qwen3: QK-norm, and a head dimension (16) that is not hidden / heads (8)
        "qwen3": lambda: build(
            "qwen3",
            transformers.Qwen3Config,
            transformers.Qwen3ForCausalLM,
            18,
            num_key_value_heads=2,
            head_dim=16,
            tie_word_embeddings=False,
            rope_theta=1000000.0,
            use_sliding_window=False,
        ),
        # Mixtures of experts: Mixtral (4 experts, top-2, grouped-query attention) and
        # Qwen3-MoE (QK-norm, 8 experts of width 32, top-2, the chosen weights renormalised)
        "mixtral": lambda: build(
            "mixtral",
            transformers.MixtralConfig,
            transformers.MixtralForCausalLM,
            19,
            experts="mixtral",
            num_key_value_heads=2,
            num_local_experts=4,
            num_experts_per_tok=2,
            tie_word_embeddings=False,
            rope_theta=1000000.0,
        ),
        # Qwen2-MoE: q/k/v biases, its first layer dense (mlp_only_layers), 4 experts of width
        # 32 beside a shared expert of 48 under its sigmoid gate, top-2 not renormalised
        "qwen2_moe": lambda: build(
            "qwen2_moe",
            transformers.Qwen2MoeConfig,
            transformers.Qwen2MoeForCausalLM,
            21,
            experts="qwen2_moe",
            num_key_value_heads=2,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            mlp_only_layers=[0],
            norm_topk_prob=False,
            tie_word_embeddings=False,
            rope_theta=1000000.0,
            use_sliding_window=False,
        ),
        "qwen3_moe": lambda: build(
            "qwen3_moe",
            transformers.Qwen3MoeConfig,
            transformers.Qwen3MoeForCausalLM,
            20,
            experts="qwen3_moe",
            num_key_value_heads=2,
            head_dim=16,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            tie_word_embeddings=False,
            rope_theta=1000000.0,
        ),
        # Sliding windows of 8 positions over every layer: 24-token rows and 32 greedy tokens
        # after a 6-token prompt reach well past them.
        "mistral_window": lambda: build(
            "mistral_window",
            transformers.MistralConfig,
            transformers.MistralForCausalLM,
            16,
            seq=24,
            num_key_value_heads=4,
            tie_word_embeddings=False,
            rope_theta=10000.0,
            sliding_window=8,
        ),
        "qwen2_window": lambda: build(
            "qwen2_window",
            transformers.Qwen2Config,
            transformers.Qwen2ForCausalLM,
            17,
            seq=24,
            num_key_value_heads=2,
            tie_word_embeddings=False,
            rope_theta=10000.0,
            use_sliding_window=True,
            sliding_window=8,
            max_window_layers=0,
        ),
    }
    names = sys.argv[1:] or list(builds)  # the fixtures named, or all
    for name in names:
        builds[name]()
    print(
        f"transformers {transformers.__version__}, torch {torch.__version__}:",
        ", ".join(
            f"{p.relative_to(OUT)} {p.stat().st_size // 1024} KiB"
            for name in names
            for p in sorted((OUT / name).glob("*"))
            if p.is_file()
        ),
    )
