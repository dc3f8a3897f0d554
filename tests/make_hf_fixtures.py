"""Build the Hugging Face fixtures of tests/test_convert.py: tiny random GPT2LMHeadModel,
BertForPreTraining and MegatronBertForPreTraining models, saved with `save_pretrained`, their
tokenizers (GPT-2's vocab.json + merges.txt, BERT's vocab.txt, Megatron-BERT's tokenizer.json)
and fixed inputs with the reference outputs `transformers` computes for them.

Run by hand, in an environment with PyTorch and transformers (never by the test suite, whose
environment has neither):

    python -m venv /tmp/hfenv
    /tmp/hfenv/bin/pip install torch==2.13.0 transformers==5.25.0 safetensors numpy
    /tmp/hfenv/bin/python tests/make_hf_fixtures.py

It rewrites tests/fixtures/hf/{gpt2,bert,megatron_bert}/ (about 0.5 MB in all). Every weight,
bias and LayerNorm parameter is random, so a transposed or mis-ordered tensor cannot pass.

    /tmp/hfenv/bin/python tests/make_hf_fixtures.py --check EXPORTED_DIR NAME

loads a directory that `megajax-convert export` wrote from the imported fixture NAME with
`from_pretrained` and `AutoTokenizer`, and prints how far its outputs are from the fixture's.
"""

import sys
from pathlib import Path

import numpy as np
import torch
import transformers
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

OUT = Path(__file__).resolve().parent / "fixtures" / "hf"
TEXT = """It is a truth universally acknowledged, that a single man in possession of a good fortune,
must be in want of a wife. However little known the feelings or views of such a man may be on his
first entering a neighbourhood, this truth is so well fixed in the minds of the surrounding
families, that he is considered the rightful property of some one or other of their daughters.
Call me Ishmael. Some years ago, never mind how long precisely, having little or no money in my
purse, and nothing particular to interest me on shore, I thought I would sail about a little and
see the watery part of the world. The quick brown fox jumps over the lazy dog; 0123456789!"""
SAMPLE = "A single man, in want of a WATERY fortune: 42 foxes!"


def randomize(model, seed: int):
    """Non-trivial values everywhere: weights N(0, 0.1), biases N(0, 0.1), LayerNorm scales 1 +
    N(0, 0.1)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g) * 0.1
            p.copy_(
                1.0 + noise
                if ("ln" in name.lower() or "layernorm" in name.lower()) and name.endswith("weight")
                else noise
            )
    return model.eval()


def gpt2():
    out = OUT / "gpt2"
    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], initial_alphabet=alphabet
    )
    tok.train_from_iterator([TEXT], trainer)
    # vocab.json + merges.txt, as GPT-2 ships them
    tok.model.save(str(out))
    hf_tok = transformers.GPT2Tokenizer(str(out / "vocab.json"), str(out / "merges.txt"))
    cfg = transformers.GPT2Config(
        vocab_size=tok.get_vocab_size(),
        n_positions=32,
        n_embd=32,
        n_layer=2,
        n_head=8,
        activation_function="gelu_new",
        layer_norm_epsilon=1e-5,
        bos_token_id=tok.token_to_id("<|endoftext|>"),
        eos_token_id=tok.token_to_id("<|endoftext|>"),
    )
    model = randomize(transformers.GPT2LMHeadModel(cfg), 1)
    model.save_pretrained(out, safe_serialization=True)
    g = np.random.default_rng(0)
    ids = g.integers(0, cfg.vocab_size, (2, 16))
    with torch.no_grad():
        o = model(torch.tensor(ids), output_hidden_states=True)
        prompt = torch.tensor(g.integers(0, cfg.vocab_size, (1, 6)))
        gen = model.generate(
            prompt,
            max_new_tokens=10,
            do_sample=False,
            pad_token_id=0,
            output_scores=True,
            return_dict_in_generate=True,
        )
    gaps = [np.diff(np.sort(s[0].numpy())[-2:])[0] for s in gen.scores]
    assert min(gaps) > 1e-3, f"a greedy step is a near tie ({min(gaps)}): pick another prompt"
    np.savez_compressed(
        out / "reference.npz",
        ids=ids,
        logits=o.logits.numpy(),
        hidden=o.hidden_states[-1].numpy(),
        prompt=prompt.numpy(),
        greedy=gen.sequences[:, prompt.shape[1] :].numpy(),
        sample_ids=np.array(hf_tok.encode(SAMPLE)),
    )


def wordpiece(vocab_size: int, lowercase: bool) -> Tokenizer:
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=lowercase)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.train_from_iterator(
        [TEXT],
        trainers.WordPieceTrainer(
            vocab_size=vocab_size, special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
        ),
    )
    return tok


def bert(name: str, model_cls, config_cls, seed: int, lowercase: bool, vocab_pad: int):
    out = OUT / name
    out.mkdir(parents=True, exist_ok=True)
    tok = wordpiece(220, lowercase)
    tok.model.save(str(out))  # vocab.txt
    assert len((out / "vocab.txt").read_text().splitlines()) == tok.get_vocab_size()
    if name == "bert":
        hf_tok = transformers.BertTokenizer(str(out / "vocab.txt"), do_lower_case=lowercase)
        hf_tok.save_pretrained(out)
        # this one is read from vocab.txt + tokenizer_config.json
        (out / "tokenizer.json").unlink(missing_ok=True)
    else:
        vocab = {t: i for i, t in enumerate((out / "vocab.txt").read_text().splitlines())}
        hf_tok = transformers.BertTokenizerFast(vocab=vocab, do_lower_case=lowercase)
        # tokenizer.json (read first) + its config
        hf_tok.save_pretrained(out)
    # The model's vocabulary may be larger than the tokenizer's (Megatron pads it): vocab_pad rows
    # more.
    cfg = config_cls(
        vocab_size=tok.get_vocab_size() + vocab_pad,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=8,
        intermediate_size=72,
        max_position_embeddings=32,
        hidden_act="gelu",
        layer_norm_eps=1e-12,
    )
    model = randomize(model_cls(cfg), seed)
    model.save_pretrained(out, safe_serialization=True)
    g = np.random.default_rng(seed)
    ids = g.integers(0, cfg.vocab_size, (2, 16))
    types = np.zeros_like(ids)
    types[:, 9:] = 1
    mask = np.ones_like(ids)
    mask[1, 11:] = 0
    with torch.no_grad():
        o = model(
            torch.tensor(ids),
            attention_mask=torch.tensor(mask),
            token_type_ids=torch.tensor(types),
            output_hidden_states=True,
        )
        hidden = model.bert(
            torch.tensor(ids), attention_mask=torch.tensor(mask), token_type_ids=torch.tensor(types)
        ).last_hidden_state
    np.savez_compressed(
        out / "reference.npz",
        ids=ids,
        types=types,
        mask=mask,
        mlm_logits=o.prediction_logits.numpy(),
        sentence_logits=o.seq_relationship_logits.numpy(),
        hidden=hidden.numpy(),
        sample_ids=np.array(hf_tok.encode(SAMPLE, add_special_tokens=False)),
    )


def check_export(exported: str, name: str):
    ref = np.load(OUT / name / "reference.npz")
    model = transformers.AutoModelForPreTraining.from_pretrained(exported).eval()
    tok = transformers.AutoTokenizer.from_pretrained(exported)
    with torch.no_grad():
        if name == "gpt2":
            got, want = model(torch.tensor(ref["ids"])).logits.numpy(), ref["logits"]
        else:
            got = model(
                torch.tensor(ref["ids"]),
                attention_mask=torch.tensor(ref["mask"]),
                token_type_ids=torch.tensor(ref["types"]),
            ).prediction_logits.numpy()
            want = ref["mlm_logits"]
    same_ids = tok.encode(SAMPLE, add_special_tokens=False) == ref["sample_ids"].tolist()
    print(
        f"{type(model).__name__}: largest logit difference {np.abs(got - want).max():.3g}; "
        f"{type(tok).__name__} ids {'equal' if same_ids else 'DIFFER'}"
    )


if __name__ == "__main__":
    if sys.argv[1:2] == ["--check"]:
        check_export(*sys.argv[2:4])
        sys.exit(0)
    torch.manual_seed(0)
    gpt2()
    bert(
        "bert",
        transformers.BertForPreTraining,
        transformers.BertConfig,
        2,
        lowercase=True,
        vocab_pad=0,
    )
    bert(
        "megatron_bert",
        transformers.MegatronBertForPreTraining,
        transformers.MegatronBertConfig,
        3,
        lowercase=False,
        vocab_pad=36,
    )
    print(
        f"transformers {transformers.__version__}, torch {torch.__version__}:",
        ", ".join(
            f"{p.relative_to(OUT)} {p.stat().st_size // 1024} KiB"
            for p in sorted(OUT.rglob("*"))
            if p.is_file()
        ),
    )
