#!/usr/bin/env python
"""The reference for bench/shakespeare_char.py: nanoGPT's model and training loop in PyTorch.

    pip install torch numpy     # not a megajax dependency; only this script needs it
    python bench/nanogpt_reference.py [--seeds 0,1,2] [--bias] [--steps 2000]

nanoGPT's model.py and train.py cut to what its shakespeare-char "macbook" run uses
(4 layers, 4 heads, width 128, context 64, batch 12, lr 1e-3 with 100 warmup steps and
cosine decay to 1e-4, AdamW beta2 0.99, weight decay 0.1 on 2-D weights, clip 1.0, no
dropout, Tiny Shakespeare split 90/10). nanoGPT has no biases by default; `--bias` adds
them to the linear layers and LayerNorms as GPT-2 (and megajax) have them.

For each seed it prints tokens/s and the validation loss two ways: nanoGPT's estimate (the
mean over 200 random batches) and megajax's (every window of the split once; see
megajax/data.py EvalWindows), so the two implementations can be compared on one protocol.
"""

import argparse
import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

try:
    import numpy as np
    import torch
    import torch.nn as nn
    from torch.nn import functional as F
except ImportError:
    print(
        "error: bench/nanogpt_reference.py needs PyTorch (pip install torch numpy)", file=sys.stderr
    )
    sys.exit(2)

N_LAYER, N_HEAD, N_EMBD, BLOCK, BATCH = 4, 4, 128, 64, 12
LR, MIN_LR, WARMUP, BETAS, WEIGHT_DECAY, CLIP = 1e-3, 1e-4, 100, (0.9, 0.99), 0.1, 1.0


class LayerNorm(nn.Module):
    def __init__(self, dim, bias):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim)) if bias else None

    def forward(self, x):
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, 1e-5)


class Block(nn.Module):
    def __init__(self, bias):
        super().__init__()
        self.ln_1, self.ln_2 = LayerNorm(N_EMBD, bias), LayerNorm(N_EMBD, bias)
        self.c_attn = nn.Linear(N_EMBD, 3 * N_EMBD, bias=bias)
        self.attn_proj = nn.Linear(N_EMBD, N_EMBD, bias=bias)
        self.c_fc = nn.Linear(N_EMBD, 4 * N_EMBD, bias=bias)
        self.mlp_proj = nn.Linear(4 * N_EMBD, N_EMBD, bias=bias)

    def attn(self, x):
        b, t, c = x.shape
        q, k, v = (
            z.view(b, t, N_HEAD, c // N_HEAD).transpose(1, 2)
            for z in self.c_attn(x).split(c, dim=2)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.attn_proj(y.transpose(1, 2).contiguous().view(b, t, c))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x))))


class GPT(nn.Module):
    def __init__(self, vocab, bias):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, N_EMBD), nn.Embedding(BLOCK, N_EMBD)
        self.blocks = nn.ModuleList([Block(bias) for _ in range(N_LAYER)])
        self.ln_f = LayerNorm(N_EMBD, bias)
        for name, p in self.named_parameters():  # nanoGPT's _init_weights
            if p.dim() == 2:
                proj = name.endswith(("attn_proj.weight", "mlp_proj.weight"))
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * N_LAYER) if proj else 0.02)
            elif name.endswith(".bias"):
                nn.init.zeros_(p)

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        logits = self.ln_f(x) @ self.wte.weight.T  # tied output embedding
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))


def lr_at(it, steps):  # nanoGPT's get_lr
    if it < WARMUP:
        return LR * (it + 1) / (WARMUP + 1)
    coeff = 0.5 * (1.0 + math.cos(math.pi * (it - WARMUP) / (steps - WARMUP)))
    return MIN_LR + coeff * (LR - MIN_LR)


def run(seed, train, val, vocab, steps, bias, eval_batches):
    torch.manual_seed(1337 + seed)

    def batch(data, starts):
        x = torch.stack(
            [torch.from_numpy(data[i : i + BLOCK + 1].astype(np.int64)) for i in starts]
        )
        return x[:, :-1], x[:, 1:]

    def random_batch(data):
        return batch(data, torch.randint(len(data) - BLOCK, (BATCH,)).tolist())

    model = GPT(vocab, bias)
    params = list(model.parameters())
    opt = torch.optim.AdamW(
        [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": WEIGHT_DECAY},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ],
        lr=LR,
        betas=BETAS,
    )
    x, y = random_batch(train)
    t0 = time.perf_counter()
    for it in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(it, steps)
        loss = model(x, y)
        x, y = random_batch(train)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
    tokens_per_s = steps * BATCH * BLOCK / (time.perf_counter() - t0)
    with torch.no_grad():
        estimate = np.mean([model(*random_batch(val)).item() for _ in range(eval_batches)])
        n_windows = (len(val) - 1) // BLOCK
        count = max(1, min(eval_batches, n_windows // BATCH)) * BATCH
        starts = np.arange(count) * n_windows // count * BLOCK
        sweep = np.mean(
            [model(*batch(val, starts[i : i + BATCH])).item() for i in range(0, count, BATCH)]
        )
    return tokens_per_s, estimate, sweep


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", default="0")
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument(
        "--bias", action="store_true", help="biases in the linear layers and LayerNorms, as GPT-2"
    )
    p.add_argument("--eval-batches", type=int, default=200)
    p.add_argument("--data", default=str(ROOT / "data" / "tinyshakespeare.txt"))
    a = p.parse_args()
    if not Path(a.data).is_file():
        print(f"error: data file not found: {a.data}", file=sys.stderr)
        sys.exit(2)
    text = Path(a.data).read_text(encoding="utf-8")
    stoi = {c: i for i, c in enumerate(sorted(set(text)))}
    data = np.array([stoi[c] for c in text], dtype=np.uint16)
    # megajax's split; nanoGPT's differs by < 1 token
    n_val = int(len(data) * 0.1)
    train, val = data[: len(data) - n_val], data[len(data) - n_val :]
    results = []
    for seed in map(int, a.seeds.split(",")):
        tps, estimate, sweep = run(seed, train, val, len(stoi), a.steps, a.bias, a.eval_batches)
        results.append((estimate, sweep))
        print(
            f"seed {seed}: {tps:,.0f} tokens/s; val loss {estimate:.4f} ({a.eval_batches} random "
            f"batches), {sweep:.4f} (disjoint windows spread over the split)",
            flush=True,
        )
    if len(results) > 1:
        est, swp = np.array(results).T
        print(
            f"mean over {len(results)} seeds: {est.mean():.4f} ± {est.std(ddof=1):.4f} (random "
            f"batches), {swp.mean():.4f} ± {swp.std(ddof=1):.4f} (disjoint windows)"
        )


if __name__ == "__main__":
    main()
