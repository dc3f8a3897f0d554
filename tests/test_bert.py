"""BERT: equivalence with one device, Megatron's collectives, pre/post LayerNorm, masking
statistics, pretraining through train.py, and RACE / MNLI / QQP fine-tuning from it."""

import dataclasses
import json
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from bert_fixtures import write_corpus, write_mnli, write_qqp, write_race
from conftest import ROOT, mesh_for, tiny_config
from flax import nnx
from helpers import SHAKESPEARE, cli, env, exact_model_axis_elements, long_run_env, run, tiered
from tolerances import F32, assert_close, assert_tree_close

from megajax.config import ConfigError, load_config
from megajax.core.mesh import make_mesh
from megajax.data.bert_pretrain import PretrainBatches, Specials, choose_ngrams, load_pretraining
from megajax.data.finetune import Example, encode, load_task_data, read_task
from megajax.data.sentences import make_pairs, split_documents
from megajax.data.tokenizer import WordPieceTokenizer, load_tokenizer, make_tokenizer
from megajax.data.wordpiece import train_vocab
from megajax.errors import UserError
from megajax.evaluation.bert import evaluate_pretraining, evaluate_task
from megajax.models.registry import ModelDef
from megajax.runs.workdir import init_from_pretrained, load_workdir
from megajax.tools.audit import audit
from megajax.training.loop import train
from megajax.training.step import make_trainer

KEY = jax.random.key(3)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("bert")
    corpus, vocab = write_corpus(d)
    return {
        "dir": d,
        "corpus": corpus,
        "vocab": vocab,
        "tok": WordPieceTokenizer.from_file(vocab),
        "race": write_race(d / "RACE"),
        "mnli": write_mnli(d / "MNLI"),
        "qqp": write_qqp(d / "QQP"),
    }


def bert_config(tok, task="pretrain", **model):
    cfg = tiny_config(kind="bert", task=task, **model)
    cfg.model.vocab_size = tok.vocab_size  # 119 -> padded 128, divisible by 8
    return cfg


def pretrain_batch(files, cfg, sharding, step=0):
    data = load_pretraining(files["corpus"].read_text(), files["tok"], cfg)
    return PretrainBatches(data.train_pairs, cfg, data.specials, files["tok"], sharding)(step)


def task_batch(files, cfg, sharding):
    data = load_task_data(cfg.model.task, files[cfg.model.task], files["tok"], cfg)
    return data.batches("train", cfg, sharding)(0)


def metrics_and_grads(cfg, files, spec):
    trainer = make_trainer(cfg, mesh_for(spec))
    params, _ = trainer.init_state(seed=0)
    make = pretrain_batch if cfg.model.task == "pretrain" else task_batch
    batch = make(files, cfg, trainer.batch_sharding)
    (_, metrics), grads = jax.jit(jax.value_and_grad(trainer.objective, has_aux=True))(
        params, batch, KEY
    )
    # Predictions each accuracy averages over: the masked tokens (MLM) or the rows.
    counts = {
        "mlm_accuracy": int(np.sum(batch.get("mlm_weights", 0))),
        "sop_accuracy": cfg.train.batch_size,
        "accuracy": cfg.train.batch_size,
    }
    return (*jax.device_get((metrics, grads)), counts)


@pytest.mark.parametrize(
    "task,spec,sp",
    tiered(
        [
            ("pretrain", "2x4", False),
            ("pretrain", "1x8", False),
            ("race", "2x4", False),
            ("mnli", "1x8", False),
            ("pretrain", "2x4", True),
            ("race", "1x8", True),
            ("qqp", "2x4", True),
        ],
        ("pretrain", "2x4", False),
    ),
)
def test_bert_matches_single_device(files, task, spec, sp):
    """Loss, every metric and every gradient equal one device's (without sequence
    parallelism), dropout on; `sp`: the multi-device run is sequence parallel."""
    cfg = bert_config(files["tok"], task)
    ref_metrics, ref_grads, counts = metrics_and_grads(cfg, files, "1x1")
    metrics, grads, _ = metrics_and_grads(
        bert_config(files["tok"], task, sequence_parallel=sp), files, spec
    )
    assert set(metrics) == set(ref_metrics)
    # float32: losses and gradients within F32 of their scale; an accuracy may differ by one
    # prediction whose two best scores tie within rounding (tests/tolerances.py). RACE's
    # classifier bias has an exactly-zero gradient (the shift cancels in the softmax over
    # options): rounding noise, held to the whole gradient's scale.
    for k in ref_metrics:
        if "accuracy" in k:
            assert abs(metrics[k] - ref_metrics[k]) <= 1 / counts[k] + F32, k
        else:
            assert_close(metrics[k], ref_metrics[k], what=k)
    assert_tree_close(ref_grads, grads, what="gradient")
    expected = {"pretrain": {"loss", "mlm_loss", "sop_loss", "mlm_accuracy", "sop_accuracy"}}.get(
        task, {"loss", "accuracy"}
    )
    assert set(metrics) == expected


@pytest.mark.full
@pytest.mark.parametrize(
    "task,spec,mode,sp",
    [("pretrain", "2x4", "shard_params", False), ("race", "4x2", "shard_optimizer", True)],
)
def test_bert_sharded_data_parallel_matches_plain(files, task, spec, mode, sp):
    """ZeRO-1 / FSDP run the model on each data shard's rows: the MLM loss is still normalised by
    the masked tokens of the whole batch, RACE's options keep their dropout masks; two
    microbatches, dropout on. Metrics and gradients as the plain data-parallel step's."""

    def config(**train):
        cfg = bert_config(files["tok"], task, sequence_parallel=sp)
        return dataclasses.replace(
            cfg, train=dataclasses.replace(cfg.train, microbatches=2, **train)
        )

    make = pretrain_batch if task == "pretrain" else task_batch
    out = []
    for cfg in (config(), config(**{mode: True})):
        trainer = make_trainer(cfg, mesh_for(spec))
        params, _ = trainer.init_state(seed=0)
        batch = make(files, cfg, trainer.batch_sharding)
        out.append(jax.device_get(jax.jit(trainer.gradients)(params, batch, KEY)))
    (ref_metrics, ref_grads), (metrics, grads) = out
    # One flipped prediction moves the mean of the 2 microbatch accuracies by 1 / (2 n_j), n_j
    # the predictions microbatch j averages over (rows j, j+2, ...).
    rows = np.asarray(
        jax.device_get(batch["mlm_weights"] if task == "pretrain" else batch["label"])
    )
    fewest = {
        "mlm_accuracy": min(int(np.sum(rows[j::2])) for j in range(2)) if task == "pretrain" else 0,
        "sop_accuracy": cfg.train.batch_size // 2,
        "accuracy": cfg.train.batch_size // 2,
    }
    assert set(metrics) == set(ref_metrics)
    # an accuracy may flip one prediction tied within rounding (tests/tolerances.py)
    for k in ref_metrics:
        if "accuracy" in k:
            assert abs(metrics[k] - ref_metrics[k]) <= 1 / (2 * max(fewest[k], 1)) + F32, k
        else:
            assert_close(metrics[k], ref_metrics[k], what=k)
    assert_tree_close(ref_grads, grads, what="gradient")


@pytest.mark.parametrize(
    "task,spec,scan",
    tiered(
        [("pretrain", "2x4", True), ("pretrain", "1x8", False), ("race", "2x4", True)],
        ("pretrain", "2x4", True),
    ),
)
def test_bert_has_megatrons_collectives(files, task, spec, scan):
    """2 forward + 2 backward model-axis all-reduces per layer, the embedding's forward one,
    and (pretraining) the tied MLM output layer's backward one and the fused loss's three on
    the masked positions only; the replicated heads add none."""
    cfg = bert_config(files["tok"], task, scan_layers=scan)
    mesh = mesh_for(spec)
    r = audit(cfg, mesh)
    b, s, h = cfg.train.batch_size // mesh.shape["data"], cfg.model.seq_len, cfg.model.hidden
    rows = b * (4 if task == "race" else 1)
    for i, counts in r.model_axis_layer_counts().items():
        assert counts == {
            ("attention", "forward"): 1,
            ("mlp", "forward"): 1,
            ("attention", "backward"): 1,
            ("mlp", "backward"): 1,
        }, i
    assert sorted(r.model_axis_layer_counts()) == ["0", "1"]
    model_ars = r.select(kind="all-reduce", axis="model")
    extras = sorted(
        (c.origin, c.direction, c.elements, c.count)
        for c in model_ars
        if c.origin not in ("attention", "mlp", "optimizer")
    )
    want = [("embedding", "forward", rows * s * h, 1)]
    if task == "pretrain":
        p = r.head_rows
        assert p == 3  # ceil(0.15 * 16)
        want += [("logits", "backward", b * p * h, 1)] + [("loss", "forward", b * p, 1)] * 3
    assert extras == sorted(want)
    assert {c.kind for c in r.collectives} == {"all-reduce"}
    for c in r.select(axis="data"):  # gradients, and the scalar means of loss and metrics
        assert c.origin == "gradients" or c.shape == (), c
    assert r.ratio == pytest.approx(1.0, abs=0.005)


@pytest.mark.full
@pytest.mark.parametrize(
    "task,spec", tiered([("pretrain", "2x4"), ("mnli", "1x8")], ("pretrain", "2x4"))
)
def test_bert_sequence_parallel_collectives(files, task, spec):
    """Sequence-parallel BERT: GPT's all-gather + reduce-scatter around each block, and no
    gather of the sequence for the heads: one all-reduce of the rows they read ([CLS] and,
    pretraining, the masked positions) out of the shards; the tied output layer's backward
    all-reduce of the masked rows; the fused loss. The total is the sequence-parallel
    analytic minimum to the element, with post-LayerNorm's embedding LayerNorm too."""

    for placement in ("pre", "post"):
        cfg = bert_config(files["tok"], task, sequence_parallel=True, ln_placement=placement)
        mesh = mesh_for(spec)
        r = audit(cfg, mesh)
        t, L = mesh.shape["model"], cfg.model.num_layers
        b, s, h = cfg.train.batch_size // mesh.shape["data"], cfg.model.seq_len, cfg.model.hidden
        # (+ 2 all-gathers again in a scanned stack's backward)
        for kind in ("all-gather", "reduce-scatter"):
            want = 4 + 2 * (kind == "all-gather" and cfg.model.scan_layers)
            assert all(sum(c.values()) == want for c in r.model_axis_layer_counts(kind).values()), (
                kind
            )
        assert r.model_axis_layer_counts("all-reduce") == {}
        p = r.head_rows
        outside = sorted(
            (c.kind, c.origin, c.direction, c.elements)
            for c in r.collectives
            if c.axis == "model" and c.layer == "" and c.origin in ("embedding", "logits", "loss")
        )
        want = [
            ("all-gather", "embedding", "backward", b * s * h),
            ("reduce-scatter", "embedding", "forward", b * s * h // t),
            ("all-reduce", "logits", "forward", b * (p + 1) * h),
        ]
        if task == "pretrain":
            want += [("all-reduce", "logits", "backward", b * p * h)] + [
                ("all-reduce", "loss", "forward", b * p)
            ] * 3
        assert outside == sorted(want), placement
        pair = b * s * h + b * s * h // t
        # LNs, row biases, one more LN, positions, types
        replicated_grads = L * 6 * h + 2 * h + (s + 2) * h
        heads = b * (p + 1) * h + b * p * h + 3 * b * p
        assert r.analytic_min_elements == (4 * L + 1) * pair + heads + replicated_grads
        # each block's input, again for the backward pass
        regather = 2 * L * b * s * h
        assert (
            r.regathered_elements == regather
            and exact_model_axis_elements(r) == r.analytic_min_elements + regather
        )
        assert f"the minimum is {r.analytic_min_elements + regather:,}: ratio 1.000" in r.table()


@pytest.mark.full
def test_pre_and_post_layernorm_differ_and_both_train(files):
    losses, params = {}, {}
    for placement in ("pre", "post"):
        cfg = bert_config(
            files["tok"], ln_placement=placement, hidden_dropout=0.0, attention_dropout=0.0
        )
        trainer = make_trainer(cfg, mesh_for("1x1"))
        p, o = trainer.init_state(seed=0)
        params[placement] = set(p)
        step = trainer.jit_step()
        batch = pretrain_batch(files, cfg, trainer.batch_sharding)
        losses[placement] = []
        for i in range(25):  # one fixed batch: the loss must fall
            p, o, m = step(p, o, batch, jnp.int32(i))
            losses[placement].append(float(m["loss"]))
    assert params["pre"] - params["post"] == {"ln_f"} and params["post"] - params["pre"] == {
        "ln_embed"
    }
    # different computations from the same weights
    assert abs(losses["pre"][0] - losses["post"][0]) > 1e-3
    for placement, ls in losses.items():
        assert np.mean(ls[-5:]) < 0.6 * np.mean(ls[:3]), (placement, ls)


def test_sentence_pairs_are_consecutive_text(files):
    text = "One two three. Four five six! Seven eight?\n\nNine ten. Eleven.\n\nLonely."
    docs = split_documents(text)
    assert docs == [
        ["One two three.", "Four five six!", "Seven eight?"],
        ["Nine ten.", "Eleven."],
        ["Lonely."],
    ]
    tok = files["tok"]
    ids = [[tok.encode(s) for s in d] for d in split_documents(files["corpus"].read_text())]
    for seq_len in (5, 16, 32):  # 5: one token of A and one of B
        pairs = make_pairs(ids, seq_len, seed=0)
        assert len(pairs) > 200
        for a, b in pairs:
            assert a and b and len(a) + len(b) <= seq_len - 3
    # Shorter had numpy's "low >= high" traceback (pretraining) or an IndexError (fine-tuning).
    for seq_len in (2, 4):
        with pytest.raises(UserError, match=f"need model.seq_len of at least 5, got {seq_len}"):
            make_pairs(ids, seq_len, seed=0)
        with pytest.raises(UserError, match=f"need model.seq_len of at least 5, got {seq_len}"):
            encode([Example(["One two three."], ["Four five six!"], 0)], tok, seq_len)
    pairs = make_pairs(ids, 64, seed=0)  # no truncation at 64: A + B is a run of whole sentences
    docs_flat = [[t for s in d for t in s] for d in ids]
    assert all(any(a + b == d for d in docs_flat) for a, b in pairs[:50])


@pytest.fixture(scope="module")
def pieces():
    """Tiny Shakespeare with a WordPiece vocabulary small enough that many words are split into
    `##` pieces, so whole-word masking has something to keep whole."""
    text = SHAKESPEARE.read_text(encoding="utf-8")[:100_000]
    return WordPieceTokenizer.train(text, 300), text


def _words(ids: np.ndarray, n: int, sep: int, vocab: list[str]) -> np.ndarray:
    """Word number of each position of [CLS] A [SEP] B [SEP] (-1 for the specials), from the
    vocabulary's text: a word is a token and the `##` tokens right after it."""
    word, current = np.full(len(ids), -1), -1
    for i in range(1, n - 1):
        if ids[i] == sep:
            continue
        if current < 0 or word[i - 1] < 0 or not vocab[ids[i]].startswith("##"):
            current += 1
        word[i] = current
    return word


@pytest.mark.parametrize("masking", ["whole_word", "token"])
def test_masking_statistics(pieces, masking):
    """15% of the non-special tokens are predicted; of those 80% [MASK], 10% random, 10% kept.
    Whole-word masking (Megatron's, the default) never masks part of a word; per-token masking
    does."""
    tok, text = pieces
    cfg = bert_config(tok, seq_len=64)
    cfg.data.masking = masking
    data = load_pretraining(text, tok, cfg)
    batches = PretrainBatches(data.train_pairs, cfg, data.specials, tok, None)
    sp = data.specials
    n_cand = n_pred = n_mask = n_kept = n_swapped = partial = whole_multi = 0
    rows = 2000
    for row in range(rows):
        e = batches.example(0, row)
        n = int(e["mask"].sum())
        w = e["mlm_weights"].astype(bool)
        pos, orig = e["mlm_positions"][w], e["mlm_ids"][w]
        specials = {0, n - 1, int(np.flatnonzero(e["tokens"][:n] == sp.sep)[0])}
        assert (
            not specials & set(pos.tolist())
            and (pos < n).all()
            and len(set(pos.tolist())) == len(pos)
        )
        assert not np.isin(orig, [sp.cls, sp.sep, sp.pad, sp.mask]).any()
        ids = e["tokens"].copy()
        ids[pos] = orig
        word = _words(ids, n, sp.sep, tok.vocab)
        for k in np.unique(word[pos]):
            in_word = np.flatnonzero(word == k)
            masked = np.isin(in_word, pos).sum()
            partial += int(masked < len(in_word))
            whole_multi += int(masked == len(in_word) > 1)
        n_cand += n - 3
        n_pred += len(pos)
        n_mask += int((e["tokens"][pos] == sp.mask).sum())
        n_kept += int((e["tokens"][pos] == orig).sum())
        n_swapped += int(e["sop_label"])
    if masking == "whole_word":
        assert partial == 0 and whole_multi > 100
    else:
        assert partial > 100  # the check above can fail
    # Binomial counts over thousands of draws: the bounds are about 4 standard errors.
    assert n_pred / n_cand == pytest.approx(0.15, abs=0.01)
    assert n_mask / n_pred == pytest.approx(0.8, abs=0.02)
    # "kept" also counts the random replacements that happen to draw the same token (1/vocab)
    assert n_kept / n_pred == pytest.approx(0.1, abs=0.015)
    assert (n_pred - n_mask - n_kept) / n_pred == pytest.approx(0.1, abs=0.015)
    assert n_swapped / rows == pytest.approx(0.5, abs=0.05)
    # A batch is a pure function of (seed, step), whatever rows a process builds.
    whole = batches.rows(7, slice(0, 8))
    part = PretrainBatches(data.train_pairs, cfg, data.specials, tok, None).rows(7, slice(2, 5))
    for k in whole:
        np.testing.assert_array_equal(whole[k][2:5], part[k])


def test_ngram_spans_follow_megatrons_distribution():
    """Span lengths of 1, 2, 3 words drawn with probability proportional to 1/n (6/11, 3/11,
    2/11): the first span of a row is the draw itself (nothing is covered yet, the budget fits
    3 one-token words). Every span is a run of consecutive whole words."""
    words = [[2 * i, 2 * i + 1] if i % 3 == 0 else [2 * i] for i in range(100)]
    first = []
    for seed in range(4000):
        spans = choose_ngrams(words, budget=30, max_ngram=3, rng=np.random.default_rng(seed))
        assert sum(map(len, spans)) <= 30 and len({q for s in spans for q in s}) == sum(
            map(len, spans)
        )
        for span in spans:
            starts = [k for k, w in enumerate(words) if w[0] == span[0]]
            assert len(starts) == 1
            k, j = starts[0], 0
            while j < len(span):
                assert span[j : j + len(words[k])] == words[k]
                j, k = j + len(words[k]), k + 1
        k = next(k for k, w in enumerate(words) if w[0] == spans[0][0])
        first.append(
            next(m for m in (1, 2, 3) if sum(len(w) for w in words[k : k + m]) == len(spans[0]))
        )
    share = np.bincount(first, minlength=4)[1:] / len(first)
    # 4000 draws: one standard error is at most 0.008; 0.04 is 5 of them (the last two start
    # words, 2% of draws, can only take shorter spans).
    np.testing.assert_allclose(share, np.array([6, 3, 2]) / 11, atol=0.04)


def test_wordpiece_vocab_file(files, tmp_path):
    tok = files["tok"]
    assert [tok.token_id(t) for t in ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")] == [
        0,
        1,
        2,
        3,
        4,
    ]
    assert tok.decode(tok.encode("First the Fox saw the ball.")) == "first the fox saw the ball."
    trained = WordPieceTokenizer.train(files["corpus"].read_text(), vocab_size=200)
    assert (
        trained.vocab[:5] == ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
        and "finally" in trained.vocab
    )
    tok.save(tmp_path)
    again = load_tokenizer(tmp_path)
    assert (
        again.vocab == tok.vocab and (tmp_path / "vocab.txt").read_text().splitlines() == tok.vocab
    )
    # The same WordPiece as a Hugging Face tokenizer.json serves BERT too.
    tok.tok.save(str(tmp_path / "tokenizer.json"))
    hf = make_tokenizer(f"hf:{tmp_path / 'tokenizer.json'}")
    assert Specials.of(hf) == Specials.of(tok) and hf.encode("the fox saw.") == tok.encode(
        "the fox saw."
    )
    with pytest.raises(ConfigError, match="model.task must be one of"):
        load_config("bert_tiny", ["model.task=squad"])


def test_wordpiece_training_is_reproducible_across_processes(tmp_path):
    """The same corpus and size give a byte-identical vocab.txt in separate processes, whatever
    the hash seed and thread count (the `tokenizers` trainer gave a different one each run)."""
    script = (
        "import sys; from megajax.data.tokenizer import WordPieceTokenizer; "
        "WordPieceTokenizer.train(open(sys.argv[1]).read()[:300_000], 1000).save(sys.argv[2])"
    )
    files = []
    for seed, threads in (("1", "1"), ("2", "2")):
        out = tmp_path / seed
        out.mkdir()
        subprocess.run(
            [sys.executable, "-c", script, str(SHAKESPEARE), str(out)],
            check=True,
            cwd=ROOT,
            env={**env(), "PYTHONHASHSEED": seed, "RAYON_NUM_THREADS": threads},
        )
        files.append((out / "vocab.txt").read_bytes())
    assert files[0] == files[1] and len(files[0].splitlines()) == 1000


def test_wordpiece_merges_by_hand():
    """Pairs by count ('##u ##g' 5, then 'h ##ug' 4, '##u ##n' 2), ties by the tokens' text."""
    vocab = train_vocab("Hug hug hug pug pun bun hugs", 20, ("[PAD]", "[UNK]"))
    assert vocab == [
        "[PAD]",
        "[UNK]",
        "b",
        "g",
        "h",
        "n",
        "p",
        "s",
        "u",
        "##g",
        "##n",
        "##s",
        "##u",
        "##ug",
        "hug",
        "##un",
        "bun",
        "hugs",
        "pug",
        "pun",
    ]


def test_task_files_and_encoding(files, tmp_path):
    """Published layouts read as documented; pairs laid out as [CLS] A [SEP] B [SEP], the
    article truncated at its end, an option filling the question's blank."""
    tok = files["tok"]
    race = read_task("race", files["race"], "test")
    assert len(race) == 30 and {e.group for e in race} == {"middle", "high"}
    # "... about _ ."
    blank = next(e for e in race if e.second[0].startswith("the story is about"))
    assert (
        all("_" not in t and t.endswith(" .") for t in blank.second) and len(set(blank.second)) == 4
    )
    # option appended
    plain = next(e for e in race if e.second[0].startswith("which one is it ?"))
    assert (
        all(t.startswith("which one is it ? ") for t in plain.second)
        and len(set(plain.second)) == 4
    )
    long = Example(
        ["first the cat saw the ball near the stone with the rope"] * 4,
        [f"which one is it ? {o}" for o in ("apple", "hammer", "saw", "rake")],
        0,
        "high",
    )
    arrays = encode([long], tok, seq_len=16)
    assert arrays["tokens"].shape == (1, 4, 16) and arrays["label"].tolist() == [0]
    row = arrays["tokens"][0, 1].tolist()
    sp = Specials.of(tok)
    question = tok.encode("which one is it ? hammer")
    article = tok.encode(long.first[0])[: 16 - 3 - len(question)]
    assert row == [sp.cls, *article, sp.sep, *question, sp.sep]
    assert arrays["types"][0, 1].tolist() == [0] * (len(article) + 2) + [1] * (len(question) + 1)
    assert arrays["mask"][0].sum() == 4 * 16
    mnli = read_task("mnli", files["mnli"], "dev")
    assert len(mnli) == 60 and {e.label for e in mnli} == {0, 1, 2}
    bad = tmp_path / "QQP"
    bad.mkdir()
    (bad / "dev.tsv").write_text(
        "id\tqid1\tqid2\tquestion1\tquestion2\tis_duplicate\n"
        "1\t1\t2\twhat?\twhy?\t1\n"
        "2\t3\t4\tbroken row\n"
        "3\t5\t6\ta\tb\t0\n"
    )
    assert [e.label for e in read_task("qqp", bad, "dev")] == [1, 0]


RACE_DAMAGE = {
    # no answers
    "not a RACE file": {"article": "a", "questions": ["q"], "options": [["a", "b", "c", "d"]]},
    "equally long lists": {
        "article": "a",
        "questions": ["q", "r"],
        "options": [["a", "b", "c", "d"]],
        "answers": ["A"],
    },
    "needs 4 options": {"article": "a", "questions": ["q"], "options": ["abcd"], "answers": ["A"]},
    "an answer A-D, got 'E'": {
        "article": "a",
        "questions": ["q"],
        "options": [["a", "b", "c", "d"]],
        "answers": ["E"],
    },
    "an answer A-D, got 1": {
        "article": "a",
        "questions": ["q"],
        "options": [["a", "b", "c", "d"]],
        "answers": [1],
    },
    "is not UTF-8 text": b'{"article": "caf\xe9"}',
}


@pytest.mark.parametrize("message", RACE_DAMAGE)
def test_task_files_of_another_layout_are_one_line(tmp_path, message):
    """Before: KeyError, ValueError, TypeError or UnicodeDecodeError tracebacks, or questions
    silently dropped (zip stopped at the shortest list)."""
    split = tmp_path / "RACE" / "dev" / "high"
    split.mkdir(parents=True)
    doc = RACE_DAMAGE[message]
    (split / "1.txt").write_bytes(doc if isinstance(doc, bytes) else json.dumps(doc).encode())
    with pytest.raises(UserError, match=re.escape(message)):
        read_task("race", tmp_path / "RACE", "dev")
    (tmp_path / "QQP").mkdir()
    (tmp_path / "QQP" / "dev.tsv").write_bytes(
        b"question1\tquestion2\tis_duplicate\ncaf\xe9\tb\t1\n"
    )
    with pytest.raises(UserError, match="dev.tsv is not UTF-8 text"):
        read_task("qqp", tmp_path / "QQP", "dev")


# --- train.py / eval.py end to end ------------------------------------------------------


@pytest.fixture(scope="module")
def pretrained(files):
    """A tiny BERT pretrained through train.py on the fixture corpus (2x2 mesh)."""
    workdir = files["dir"] / "pretrained"
    run(
        "--config",
        "bert_tiny",
        "--data",
        f"text:{files['corpus']}",
        "--tokenizer",
        f"wordpiece:{files['vocab']}",
        "--set",
        "model.seq_len=32",
        "--set",
        "train.batch_size=32",
        "--set",
        "train.lr=2e-3",
        "--set",
        "train.warmup_steps=20",
        "--set",
        "train.eval_batches=4",
        "--steps",
        "150",
        "--log-every",
        "10",
        "--eval-every",
        "50",
        "--host-devices",
        "4",
        "--mesh",
        "2x2",
        "--workdir",
        str(workdir),
        env=long_run_env(),
    )  # 150 steps: -O1 code
    return workdir


@pytest.mark.full
def test_pretraining_lowers_mlm_and_sop_losses(pretrained):
    records = [json.loads(line) for line in (pretrained / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "mlm_loss" in r]
    val = [r for r in records if "val_mlm_loss" in r]
    assert {"mlm_loss", "sop_loss", "mlm_accuracy", "sop_accuracy", "tokens_per_sec", "mfu"} <= set(
        train[0]
    )
    # step 1: the untrained model
    first = lambda k: train[0][k]  # noqa: E731
    last = lambda k: np.mean([r[k] for r in train[-3:]])  # noqa: E731
    # ~ chance: ln V, ln 2
    assert first("mlm_loss") > 0.8 * np.log(128) and first("sop_loss") > 0.6
    assert last("mlm_loss") < 0.5 * first("mlm_loss")
    assert last("sop_loss") < 0.5 * first("sop_loss")
    assert val[-1]["val_sop_accuracy"] > 0.9 and val[-1]["val_mlm_accuracy"] > 0.4
    assert (pretrained / "vocab.txt").is_file()


@pytest.mark.full
def test_init_from_restores_the_encoder_exactly(pretrained, files):
    cfg = load_config("finetune_qqp", [f"train.init_from={pretrained}"])
    from megajax.runs.workdir import with_pretrained_shape

    cfg, _ = with_pretrained_shape(cfg)
    assert (cfg.model.seq_len, cfg.model.hidden, cfg.model.vocab_size) == (
        32,
        64,
        files["tok"].vocab_size,
    )
    mesh = mesh_for("2x2")  # not the mesh it was trained on
    trainer = make_trainer(cfg, mesh)
    fresh, _ = trainer.init_state()
    fresh_cls = np.asarray(fresh["classifier"]["kernel"])
    params = init_from_pretrained(trainer, fresh, pretrained, out=lambda *a: None)
    loaded = load_workdir(pretrained, mesh)
    pre = ModelDef(loaded.model).params(loaded.model)
    encoder = {k for k in pre if k not in ("mlm_dense", "mlm_ln", "mlm_bias", "sop")}
    assert encoder == set(params) - {"classifier"}
    for k in encoder:
        for a, b in zip(jax.tree.leaves(pre[k]), jax.tree.leaves(params[k])):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_array_equal(np.asarray(params["classifier"]["kernel"]), fresh_cls)


@pytest.mark.full
def test_mlm_evaluation(pretrained, files):
    """eval.py --task mlm: exact totals over every pair, equal to the training objective on
    one batch of the same examples; and through the CLI on another mesh."""
    loaded = load_workdir(pretrained, mesh_for("1x1"))
    data = load_pretraining(files["corpus"].read_text(), loaded.tokenizer, loaded.cfg)
    pairs = data.val_pairs[:20]
    got = evaluate_pretraining(
        loaded.model, pairs, loaded.cfg, data.specials, loaded.tokenizer, batch_size=8
    )  # 8 + 8 + 4 real rows
    builder = PretrainBatches(pairs, loaded.cfg, data.specials, loaded.tokenizer, None)
    examples = [
        builder.encode(p, np.random.default_rng([loaded.cfg.train.seed, 2, i]))
        for i, p in enumerate(pairs)
    ]
    batch = {k: jnp.asarray(np.stack([e[k] for e in examples])) for k in examples[0]}
    _, want = nnx.jit(lambda model: model.objective(batch))(loaded.model)
    for k in ("mlm_loss", "mlm_accuracy", "sop_loss", "sop_accuracy"):
        assert got[k] == pytest.approx(float(want[k]), rel=1e-5), k
    assert got["pairs"] == 20 and got["masked_tokens"] == int(batch["mlm_weights"].sum())
    e = cli(
        "eval",
        "--workdir",
        pretrained,
        "--task",
        "mlm",
        "--data",
        files["corpus"],
        "--host-devices",
        "8",
        "--mesh",
        "2x4",
    )
    assert e.returncode == 0, e.stderr
    result = json.loads((pretrained / "eval_mlm.json").read_text())
    assert result["pairs"] > 250 and result["sop_accuracy"] > 0.9 and result["mlm_accuracy"] > 0.4


@pytest.mark.full
def test_finetune_race_through_the_cli(pretrained, files):
    workdir = files["dir"] / "race"
    p = run(
        "--config",
        "finetune_race",
        "--init-from",
        str(pretrained),
        "--data",
        str(files["race"]),
        "--set",
        "train.batch_size=8",
        "--set",
        "train.lr=1e-3",
        "--set",
        "train.warmup_steps=10",
        "--steps",
        "80",
        "--log-every",
        "20",
        "--eval-every",
        "80",
        "--set",
        "train.eval_batches=2",
        "--host-devices",
        "2",
        "--mesh",
        "1x2",
        "--workdir",
        str(workdir),
    )
    assert "initialised from" in p.stdout and "new: classifier" in p.stdout
    e = cli(
        "eval",
        "--workdir",
        workdir,
        "--task",
        "race",
        "--data",
        files["race"],
        "--host-devices",
        "8",
        "--mesh",
        "2x4",
    )
    assert e.returncode == 0, e.stderr
    result = json.loads((workdir / "eval_race.json").read_text())
    assert result["split"] == "test" and result["examples"] == 30
    assert result["accuracy"] > 0.6  # chance: 0.25
    assert result["examples_middle"] + result["examples_high"] == 30 and "accuracy_high" in result


@pytest.mark.full
@pytest.mark.parametrize("task,chance", [("mnli", 1 / 3), ("qqp", 1 / 2)])
def test_finetune_sentence_pairs(pretrained, files, task, chance):
    cfg = load_config(
        f"finetune_{task}",
        [
            f"train.init_from={pretrained}",
            f"data.source={files[task]}",
            "train.batch_size=16",
            "train.lr=5e-4",
            "train.warmup_steps=10",
            "train.steps=100",
            "train.log_every=50",
            "train.eval_every=100",
            "train.eval_batches=2",
        ],
    )
    workdir = files["dir"] / task
    mesh = mesh_for("1x2")
    train(cfg, mesh, workdir, out=None)  # no log (it was a TypeError)
    loaded = load_workdir(workdir, mesh)
    result = evaluate_task(loaded.model, task, files[task], "dev", loaded.tokenizer)
    assert result["examples"] == 60
    assert result["accuracy"] > chance + 0.3, result


@pytest.mark.full
def test_bert_user_errors(pretrained, files, tmp_path):
    p = run(
        "--config",
        "bert_tiny",
        "--tokenizer",
        "bytes",
        "--data",
        f"text:{files['corpus']}",
        "--workdir",
        str(tmp_path / "w"),
        check=False,
    )
    assert (
        p.returncode == 2
        and "BERT needs a tokenizer with" in p.stderr
        and "Traceback" not in p.stderr
    )
    p = run(
        "--config",
        "finetune_race",
        "--data",
        str(files["race"]),
        "--workdir",
        str(tmp_path / "x"),
        check=False,
    )
    assert p.returncode == 2 and "--init-from" in p.stderr
    p = run(
        "--config",
        "finetune_race",
        "--init-from",
        str(pretrained),
        "--data",
        str(tmp_path / "nope"),
        "--workdir",
        str(tmp_path / "y"),
        check=False,
    )
    assert p.returncode == 2 and "race data directory not found" in p.stderr
    e = cli("eval", "--workdir", pretrained, "--task", "race", "--data", files["race"])
    assert e.returncode == 2 and "fine-tuned on race" in e.stderr


@pytest.mark.full
@pytest.mark.parametrize("task", ["pretrain", "race"])
def test_pipelined_bert_matches_one_device(files, task):
    """Two stages of BERT's layers (pipe=2,model=4, 1F1B over 4 microbatches): the padding mask
    and the heads on the last stage (MLM and SOP, or RACE's four choices), the embedding with its
    token types on the first: one device's metrics and gradients."""
    cfg = bert_config(files["tok"], task)
    cfg.train.microbatches = 4
    cfg = cfg.validate()
    make = pretrain_batch if task == "pretrain" else task_batch
    results = []
    for mesh in (mesh_for("1x1"), make_mesh("pipe=2,model=4")):
        trainer = make_trainer(cfg, mesh)
        params, _ = trainer.init_state(seed=0)
        batch = make(files, cfg, trainer.batch_sharding)
        results.append(jax.device_get(jax.jit(trainer.gradients)(params, batch, KEY)))
    (want_metrics, want), (got_metrics, got) = results
    # an accuracy may differ by one prediction where two scores tie within rounding
    # (tests/tolerances.py); each microbatch's is a mean over its own predictions
    # (microbatch j: rows j, j + 4, ...)
    fewest = {
        "mlm_accuracy": min(int(np.sum(np.asarray(batch["mlm_weights"])[j::4])) for j in range(4))
        if "mlm_weights" in batch
        else 1,
        "sop_accuracy": 8 // 4,
        "accuracy": 8 // 4,
    }
    for name, value in want_metrics.items():
        if name.endswith("accuracy"):
            assert abs(got_metrics[name] - value) <= 1 / (4 * fewest[name]) + 1e-6, name
        else:
            assert_close(got_metrics[name], value, what=name)
    assert_tree_close(want, got, what="gradient")
