"""eval.py: WikiText detokenization and overlapping windows, LAMBADA scoring, sampling with a
KV cache; results on a 2x4 mesh equal those on one device."""

import argparse
import json
import math
import os
import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ROOT, handles_signal, mesh_for, tiny_config
from flax import nnx
from helpers import cli, long_run_env, run
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from tolerances import F32

from megajax.cli.eval import check_eval_args, eval_parser
from megajax.config import load_config
from megajax.core.mesh import padded_rows
from megajax.data.tokens import EvalWindows, load_tokens
from megajax.errors import UserError
from megajax.evaluation import tasks as eval_tasks
from megajax.evaluation.lambada import evaluate_lambada
from megajax.evaluation.scoring import perplexity_of_tokens, stride_windows
from megajax.evaluation.wikitext import evaluate_wikitext, original_token_count, wikitext_detokenize
from megajax.models.generate import generate
from megajax.models.registry import init_model
from megajax.prepare import Settings, prepare
from megajax.runs.workdir import load_workdir


def greedy_by_recomputation(model, prompt_tokens, max_new_tokens: int) -> np.ndarray:
    """Reference decoder: the full forward pass over the whole sequence for every new token.
    The sequence lives in one fixed-length buffer (one compiled shape): attention is causal,
    so the tokens not yet written after position p cannot change the logits at p."""
    seq = np.atleast_2d(np.asarray(prompt_tokens, dtype=np.int32))
    rows, n = seq.shape
    if n + max_new_tokens > model.cfg.seq_len:
        raise ValueError(
            f"{n} + {max_new_tokens} tokens do not fit the context of {model.cfg.seq_len}"
        )
    buf = np.zeros((rows, n + max_new_tokens), np.int32)
    buf[:, :n] = seq
    buf = buf[padded_rows(rows, model.layout.shape)]
    fwd = jax.jit(lambda m, x, p: jnp.argmax(m(x)[:, p], -1).astype(jnp.int32))
    for p in range(n, n + max_new_tokens):
        buf[:, p] = np.asarray(fwd(model, buf, p - 1))
    return buf[:rows, n:]


WIKITEXT = ROOT / "data" / "wikitext-2" / "test.txt"
SHAKESPEARE = ROOT / "data" / "tinyshakespeare.txt"


def test_detokenizer_on_fragments():
    assert wikitext_detokenize(" \n = Robert Boulter = \n") == "\n= Robert Boulter =\n"
    assert (
        wikitext_detokenize("a guest @-@ starring role , in 2 @,@ 000 and 1 @.@ 5 m .")
        == "a guest-starring role, in 2,000 and 1.5 m ."
    )
    assert wikitext_detokenize("\n = = Career = = \n") == "\n== Career ==\n"
    assert (
        wikitext_detokenize('the film ( 2004 ) and " Ace " ; then')
        == 'the film (2004) and "Ace"; then'
    )
    assert wikitext_detokenize("the actor 's role : it") == "the actor's role: it"
    assert wikitext_detokenize("the players ' union") == "the players' union"


def test_original_token_count_matches_the_paper():
    assert original_token_count(WIKITEXT.read_text(encoding="utf-8")) == 245_566


@pytest.mark.parametrize(
    "n,seq,stride",
    [
        (1000, 64, 32),
        (65, 64, 32),
        (64, 64, 32),
        (10, 64, 32),
        (1000, 64, 64),
        (777, 50, 7),
        (2, 8, 1),
    ],
)
def test_stride_windows_score_every_token_once(n, seq, stride):
    seen = np.zeros(n, int)
    for start, first in stride_windows(n, seq, stride):
        end = min(start + seq, n - 1)
        assert start <= first <= end and first - start <= seq
        if start > 0:
            assert first >= start + seq - stride  # context of at least seq - stride tokens
        seen[first + 1 : end + 1] += 1  # target j predicts token j+1
    assert seen[0] == 0 and np.all(seen[1:] == 1)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """200 steps of the tiny GPT: a process of its own running -O1 code (helpers.long_run_env)."""
    wd = tmp_path_factory.mktemp("evalrun")
    run(
        "--config",
        "tiny",
        "--data",
        f"text:{SHAKESPEARE}",
        "--steps",
        "200",
        "--log-every",
        "200",
        "--eval-every",
        "200",
        "--save-every",
        "200",
        "--set",
        "model.seq_len=64",
        "--host-devices",
        "1",
        "--mesh",
        "1x1",
        "--sample-tokens",
        "0",
        "--workdir",
        wd,
        env=long_run_env(),
    )
    return wd


@pytest.fixture(scope="module")
def wikitext_slice(tmp_path_factory):
    path = tmp_path_factory.mktemp("wt") / "slice.txt"
    path.write_text(WIKITEXT.read_text(encoding="utf-8")[:6000], encoding="utf-8")
    return path


def test_adjusted_perplexity_from_independent_sums(workdir, wikitext_slice):
    loaded = load_workdir(workdir, mesh_for("1x1"))
    r = evaluate_wikitext(loaded.model, loaded.tokenizer, wikitext_slice, stride=32)
    raw = wikitext_slice.read_text(encoding="utf-8")
    t_o = len(raw.strip().split(" "))
    tokens = np.asarray(loaded.tokenizer.encode(wikitext_detokenize(raw)), np.int32)
    # Independent: score token j+1 given the (up to) 64 tokens before it, one forward pass each
    # window.
    seq, total = loaded.cfg.model.seq_len, 0.0
    fwd = jax.jit(
        lambda m, x: jax.nn.log_softmax(m(x).astype(jnp.float32)[..., : m.cfg.vocab_size])
    )
    for j in range(1, len(tokens)):  # token j is predicted at position j-1 of the window holding it
        start = 0 if j <= seq else ((j - seq - 1) // 32 + 1) * 32
        window = tokens[start : start + seq]
        if len(window) < seq:
            window = np.pad(window, (0, seq - len(window)))
        logp = np.asarray(fwd(loaded.model, jnp.asarray(window[None])))[0]
        total -= float(logp[j - 1 - start, tokens[j]])
    assert r["tokens"] == len(tokens) - 1 and r["original_tokens"] == t_o
    assert r["loss_sum"] == pytest.approx(total, rel=F32)
    # exp turns the loss sum's relative error F32 into F32 * (loss per word) of the perplexity.
    for key, words in (("adjusted_ppl", t_o), ("adjusted_ppl_megatron", t_o - 1)):
        assert r[key] == pytest.approx(
            math.exp(total / words), rel=F32 * max(1.0, total / words)
        ), key
    assert r["ppl"] == pytest.approx(
        math.exp(total / (len(tokens) - 1)), rel=F32 * max(1.0, r["loss"])
    )


def _lambada_fixture(loaded, path: Path):
    """Passages whose last word is the model's own greedy continuation (when it starts with a
    space) and passages ending in a word it would not produce; then the expected outcome of
    each by an independent forward pass over the whole passage."""
    tok, vocab = loaded.tokenizer, loaded.cfg.model.vocab_size
    seq = loaded.cfg.model.seq_len
    fwd = jax.jit(lambda m, x: m(x)[0, :, :vocab].argmax(-1))

    def greedy_next(ids):  # one compiled shape: right padding cannot change a causal prediction
        window = np.zeros(seq, np.int32)
        window[: len(ids)] = ids
        return int(np.asarray(fwd(loaded.model, jnp.asarray(window[None])))[len(ids) - 1])

    rng = np.random.default_rng(0)
    text = " ".join(SHAKESPEARE.read_text().split())
    made, wrong, lines = 0, 0, []
    for _ in range(500):
        if made == 3 and wrong == 3:
            break
        start = int(rng.integers(0, len(text) - 400))
        # stripped, as the reader strips a passage (a leading space would shift its tokens)
        context = text[start : start + 40].rsplit(" ", 1)[0].strip()
        ids = tok.encode(context)
        word = [greedy_next(ids)]
        if tok.decode(word) != " ":
            if wrong < 3:
                lines.append({"text": context + " qzxv"})
                wrong += 1
            continue
        while len(word) < 8:
            nxt = greedy_next(ids + word)
            if tok.decode([nxt]).isspace():
                break
            word.append(nxt)
        if made < 3 and len(word) > 1:
            lines.append({"text": context + tok.decode(word)})
            made += 1
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    expected = []
    for x in lines:
        ctx, _, w = x["text"].rpartition(" ")
        c, t = tok.encode(ctx), tok.encode(" " + w)
        window = np.zeros(seq, np.int32)
        window[: len(c) + len(t) - 1] = (c + t)[:-1]
        pred = np.asarray(fwd(loaded.model, jnp.asarray(window[None])))[
            len(c) - 1 : len(c) + len(t) - 1
        ]
        expected.append(bool(np.all(pred == np.asarray(t))))
    return expected


def test_lambada_target_is_split_at_the_last_run_of_any_whitespace(tmp_path):
    """As Megatron does: a newline (or tab, or several spaces) before the last word still makes
    that word alone the target, and the context loses its trailing whitespace."""
    from megajax.data.tokenizer import make_tokenizer
    from megajax.evaluation.lambada import lambada_examples

    tok = make_tokenizer("bytes")
    texts = [
        "he said to her\nfarewell",
        "the cat sat on the\t\tmat",
        "one two  three",
        "plain last word",
    ]
    path = tmp_path / "lambada.jsonl"
    path.write_text("\n".join(json.dumps({"text": t}) for t in texts) + "\n")
    got = lambada_examples(path, tok, seq_len=64)
    want = [
        ("he said to her", "farewell"),
        ("the cat sat on the", "mat"),
        ("one two", "three"),
        ("plain last", "word"),
    ]
    assert [(tok.decode(c), tok.decode(t)) for c, t in got] == [(c, " " + w) for c, w in want]


@pytest.mark.parametrize(
    "line,message",
    [
        ('{"text": 5}', "must be a passage of at least two words"),
        ('{"text": ""}', "must be a passage of at least two words"),
        ('{"passage": "a b"}', 'expected a JSON object with a "text" field'),
        ("not json", 'expected a JSON object with a "text" field'),
    ],
)
def test_malformed_lambada_lines_name_the_line(tmp_path, line, message):
    from megajax.data.tokenizer import make_tokenizer
    from megajax.errors import UserError
    from megajax.evaluation.lambada import lambada_examples

    path = tmp_path / "lambada.jsonl"
    path.write_text(json.dumps({"text": "a good passage"}) + "\n" + line + "\n")
    with pytest.raises(UserError, match=f"lambada.jsonl:2: .*{re.escape(message)}"):
        lambada_examples(path, make_tokenizer("bytes"), seq_len=64)


@pytest.mark.parametrize(
    "args,message",
    [
        (["--task", "sample", "--max-new-tokens", "0"], "--max-new-tokens must be at least 1"),
        (
            ["--task", "sample", "--temperature", "-1"],
            "--temperature must be 0 (greedy) or positive",
        ),
        (
            ["--task", "sample", "--temperature", "nan"],
            "--temperature must be 0 (greedy) or positive",
        ),
        (["--task", "sample", "--top-k", "-3"], "--top-k must be 0 (no limit) or positive"),
        (
            ["--task", "ppl", "--out", "/nonexistent/dir/r.json"],
            "the directory /nonexistent/dir does not exist",
        ),
        # before: found after the eval
        (["--task", "ppl", "--out", "TMP"], "is a directory: give the JSON file's path"),
    ],
)
def test_eval_arguments_are_checked_before_loading(tmp_path, capsys, args, message):
    from megajax.cli import eval_main

    args = [str(tmp_path) if a == "TMP" else a for a in args]
    assert eval_main(["--workdir", str(tmp_path / "absent"), *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err


def test_empty_wikitext_file_is_refused(workdir, tmp_path):
    from megajax.errors import UserError

    (tmp_path / "empty.txt").write_text("\n \n")
    with pytest.raises(UserError, match="is empty"):
        loaded = load_workdir(workdir, mesh_for("1x1"))
        evaluate_wikitext(loaded.model, loaded.tokenizer, tmp_path / "empty.txt")


def test_lambada_scoring_matches_independent_argmax(workdir, tmp_path):
    loaded = load_workdir(workdir, mesh_for("1x1"))
    path = tmp_path / "lambada.jsonl"
    expected = _lambada_fixture(loaded, path)
    assert True in expected and False in expected
    r = evaluate_lambada(loaded.model, loaded.tokenizer, path)
    assert r["per_passage_correct"] == expected
    assert r["accuracy"] == pytest.approx(np.mean(expected)) and r["passages"] == 6


def test_training_validation_is_the_splits_own_loss(workdir):
    """The training loop's validation sweep scores exactly the targets that eval.py's windows
    of stride seq_len score: over a split it covers, the two means agree."""
    loaded = load_workdir(workdir, mesh_for("1x1"))
    data = load_tokens(f"text:{SHAKESPEARE}", "chars", tokenizer=loaded.tokenizer)
    seq, bs = loaded.cfg.model.seq_len, 8
    split = np.asarray(data.val[: 5 * bs * seq + 1])  # room for exactly 5 batches of windows
    windows = EvalWindows(
        split, seq, bs, max_batches=100, sharding=NamedSharding(mesh_for("1x1"), P("data", None))
    )
    assert windows.num_batches == 5
    batch_loss = nnx.jit(lambda m, b: m.loss(b[:, :-1], b[:, 1:]))
    sweep = np.mean([float(batch_loss(loaded.model, windows(i))) for i in range(5)])
    ref = perplexity_of_tokens(loaded.model, split, stride=seq, batch_size=bs)
    assert ref["tokens"] == 5 * bs * seq
    assert sweep == pytest.approx(ref["loss"], rel=F32)


def test_results_on_2x4_equal_1x1(workdir, wikitext_slice, tmp_path):
    one, many = load_workdir(workdir, mesh_for("1x1")), load_workdir(workdir, mesh_for("2x4"))
    a, b = (
        evaluate_wikitext(one.model, one.tokenizer, wikitext_slice),
        evaluate_wikitext(many.model, many.tokenizer, wikitext_slice),
    )
    assert a["tokens"] == b["tokens"] and a["loss_sum"] == pytest.approx(b["loss_sum"], rel=F32)
    tokens = np.asarray(one.tokenizer.encode(SHAKESPEARE.read_text()[:3000]), np.int32)
    pa, pb = (
        perplexity_of_tokens(one.model, tokens, 64, 8),
        perplexity_of_tokens(many.model, tokens, 64, 8),
    )
    assert pa["ppl"] == pytest.approx(pb["ppl"], rel=F32 * max(1.0, pb["loss"]))
    path = tmp_path / "l.jsonl"
    _lambada_fixture(one, path)
    la, lb = (
        evaluate_lambada(one.model, one.tokenizer, path),
        evaluate_lambada(many.model, many.tokenizer, path),
    )
    assert la["per_passage_correct"] == lb["per_passage_correct"]
    assert la["mean_target_loss"] == pytest.approx(lb["mean_target_loss"], rel=F32)


def test_greedy_past_the_context_slides_a_window(workdir):
    """Past the learned positions (64 here) each new token is predicted from the last 64 tokens,
    recomputed: the same tokens as a full forward pass over that window, step by step."""
    loaded = load_workdir(workdir, mesh_for("1x1"))
    model, ctx = loaded.model, loaded.model.cfg.seq_len
    prompt = np.asarray(
        loaded.tokenizer.encode(SHAKESPEARE.read_text(encoding="utf-8")[:200])[: ctx - 4], np.int32
    )
    got = generate(model, prompt[None], 20, temperature=0)[0]
    fwd = jax.jit(lambda m, x, p: jnp.argmax(m(x)[:, p], -1).astype(jnp.int32))
    seq = list(prompt)
    for _ in range(20):
        window = np.zeros((1, ctx), np.int32)
        last = seq[-ctx:]
        window[0, : len(last)] = last
        seq.append(int(fwd(model, window, len(last) - 1)[0]))
    np.testing.assert_array_equal(got, seq[len(prompt) :])


def test_a_context_of_one_token_generates_from_the_last_token():
    """seq_len 1 (a bigram model): the prompt is cut to its last token (before, a slice [-0:]
    kept all of it and the cache write failed), each next token predicted from the one before."""
    model = init_model(
        tiny_config(seq_len=1, hidden_dropout=0.0, attention_dropout=0.0).model,
        mesh_for("1x1"),
        seed=3,
    )
    got = generate(model, np.asarray([[5, 17, 42]], np.int32), 6, temperature=0)[0]
    step = jax.jit(lambda m, t: jnp.argmax(m(jnp.full((1, 1), t, jnp.int32))[0, 0]))
    want = [42]
    for _ in range(6):
        want.append(int(step(model, want[-1])))
    np.testing.assert_array_equal(got, want[1:])
    assert (
        str(eval_tasks.data_source("builtin")) == "builtin"
        and str(eval_tasks.data_source("a.txt")) == "text:a.txt"
    )


@pytest.mark.full
def test_generate_takes_what_it_can_use_and_names_what_it_cannot():
    """Zero new tokens is an empty (b, 0) (it was one token), a top_k past the vocabulary is the
    whole vocabulary (as eval.py's --top-k); a prompt jax would fail on or silently embed as
    zeros (an id past the vocabulary), a NaN temperature and a BERT are each one ValueError."""
    model = init_model(tiny_config(seq_len=8).model, mesh_for("1x1"), seed=3)
    assert generate(model, [5, 6], 0).shape == (1, 0)
    greedy = generate(model, [5, 6], 4, temperature=0)
    # a notebook's setting: the cache's update indices were int64 and int32
    with jax.enable_x64(True):
        np.testing.assert_array_equal(generate(model, [5, 6], 4, temperature=0), greedy)
    np.testing.assert_array_equal(
        generate(model, [5, 6], 3, temperature=1.0, top_k=10**6, rng=jax.random.key(1)),
        generate(model, [5, 6], 3, temperature=1.0, top_k=None, rng=jax.random.key(1)),
    )
    for args, kwargs, message in [
        (([], 3), {}, r"integers with t >= 1, got float64 \(1, 0\)"),
        (([[1.5, 2.0]], 3), {}, "integers with t >= 1, got float64"),
        (([5, 100], 3), {}, r"ids must lie in \[0, 100\), the model's vocabulary; got 5..100"),
        (([5, -1], 3), {}, "ids must lie in"),
        (([5], -1), {}, "max_new_tokens must be an integer >= 0, got -1"),
        (([5], 2.5), {}, "max_new_tokens must be an integer"),
        (([5], 3), {"temperature": float("nan")}, "temperature must be a finite number >= 0"),
        (([5], 3), {"top_k": -2}, "top_k must be >= 0"),
    ]:
        with pytest.raises(ValueError, match=message):
            generate(model, *args, **kwargs)
    bert = init_model(load_config("bert_tiny", ["model.num_layers=1"]).model, mesh_for("1x1"))
    with pytest.raises(ValueError, match="generate continues text with a GPT; this is a BERT"):
        generate(bert, [5], 3)
    # A sequence-parallel model decodes as the same weights without it (one token cannot be
    # split over "model"); before, every call was "a sequence of 1 tokens does not split".
    sp, plain = (
        init_model(tiny_config(seq_len=8, sequence_parallel=on).model, mesh_for("1x2"), seed=3)
        for on in (True, False)
    )
    np.testing.assert_array_equal(
        generate(sp, [[5, 6, 7], [1, 2, 3]], 9, temperature=0),
        generate(plain, [[5, 6, 7], [1, 2, 3]], 9, temperature=0),
    )


@pytest.mark.parametrize("spec", ["1x1", "2x4"])
def test_kv_cache_greedy_equals_recomputation(workdir, spec):
    loaded = load_workdir(workdir, mesh_for(spec))
    prompt = np.asarray(
        [
            loaded.tokenizer.encode("ROMEO:\nWhat light"),
            loaded.tokenizer.encode("KING HENRY:\nNow!!"),
        ],
        np.int32,
    )  # a batch of two equal-length prompts
    cached = generate(loaded.model, prompt, 30, temperature=0)
    reference = greedy_by_recomputation(loaded.model, prompt, 30)
    np.testing.assert_array_equal(cached, reference)
    assert len(set(cached.ravel().tolist())) > 1  # not one repeated token


def test_eval_cli_sample_and_errors(workdir, tmp_path):
    def run(*args):
        return cli("eval", "--workdir", workdir, *args, "--host-devices", "8")

    p = run(
        "--task",
        "sample",
        "--prompt",
        "ROMEO:",
        "--max-new-tokens",
        "20",
        "--mesh",
        "2x4",
        "--out",
        str(tmp_path / "s.json"),
    )
    assert p.returncode == 0, p.stderr
    r = json.loads((tmp_path / "s.json").read_text())
    assert (
        r["mesh"] == {"data": 2, "model": 4}
        and len(r["tokens"]) == 20
        and p.stdout.startswith("ROMEO:")
    )
    for args, msg in (
        (["--task", "wikitext", "--data", "/nope.txt"], "WikiText file not found"),
        (["--task", "lambada"], "needs --data"),
        (["--task", "ppl", "--data", "x", "--mesh", "3x3"], "needs 9"),
        (["--task", "sample", "--step", "7"], "no checkpoint for step 7"),
        (["--task", "sample", "--seed", str(10**20)], "--seed must be in 0..2^31-1"),
    ):
        p = run(*args)
        assert p.returncode == 2 and msg in p.stderr and "Traceback" not in p.stderr, (
            args,
            p.stderr,
        )


# while JAX starts, and while the model loads or compiles
@pytest.mark.full
@pytest.mark.parametrize("after", [0.0, 1.0])
def test_sigterm_stops_an_evaluation_in_one_line_and_writes_nothing(workdir, tmp_path, after):
    """Before: killed by the signal (status 143, not a word). Then, raising from the handler:
    swallowed while JAX started (the evaluation ran on) or a crash at exit (SIGSEGV). eval.py
    now says so in one line and leaves at once; its result file appears whole or not at all."""
    out = tmp_path / "never.json"
    p = subprocess.Popen(
        [
            sys.executable,
            str(ROOT / "eval.py"),
            "--workdir",
            str(workdir),
            "--task",
            "sample",
            "--max-new-tokens",
            "1000000",
            "--out",
            str(out),
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    # once eval.py handles it
    while p.poll() is None and not handles_signal(p.pid, signal.SIGTERM):
        time.sleep(0.01)
    time.sleep(after)
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=120)
    assert (
        p.returncode == 128 + signal.SIGTERM
        and err == "stopped by SIGTERM: no result was written\n"
    ), err
    assert not out.exists()


@pytest.mark.full
def test_a_sample_of_any_length_streams_its_text_and_ctrl_c_stops_it(workdir, tmp_path):
    """--max-new-tokens 1000000000 ran with no output until the end (hours). The text now
    appears as it is generated, and Ctrl-C stops it in one line, writing no result."""
    out = tmp_path / "never.json"
    p = subprocess.Popen(
        [
            sys.executable,
            str(ROOT / "eval.py"),
            "--workdir",
            str(workdir),
            "--task",
            "sample",
            "--prompt",
            "ROMEO:",
            "--max-new-tokens",
            "1000000000",
            "--out",
            str(out),
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    shown, deadline = b"", time.time() + 120
    try:
        while len(shown) < len("ROMEO:") + 30 and time.time() < deadline and p.poll() is None:
            if select.select([p.stdout], [], [], 1.0)[0]:
                shown += os.read(p.stdout.fileno(), 4096)
    finally:
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=120)
    assert shown.startswith(b"ROMEO:") and len(shown) >= len("ROMEO:") + 30, shown
    assert (
        p.returncode == 128 + signal.SIGINT and err == b"stopped by SIGINT: no result was written\n"
    ), err
    assert not out.exists()


def test_ppl_of_a_prepared_corpus_scores_its_held_out_split(workdir, tmp_path):
    """`--task ppl --data bin:DIR` of a megajax-prepare corpus scored its train split before
    (what the model was trained on, not what train.py's val_loss reads); now its val split."""
    text = tmp_path / "play.txt"
    text.write_text(SHAKESPEARE.read_text(encoding="utf-8")[:20000], encoding="utf-8")
    out = tmp_path / "corpus"
    prepare([str(text)], out, Settings(str(workdir), 0.25), workers=1, say=lambda *a: None)
    loaded = load_workdir(workdir, mesh_for("1x1"))
    r, lines = eval_tasks.ppl(
        argparse.Namespace(data=f"bin:{out}", stride=32, batch_size=8), loaded, None
    )
    meta = json.loads((out / "meta.json").read_text())
    val = np.fromfile(out / "val.bin", meta["dtype"])
    assert (
        r["split"] == "val" and r["tokens"] == len(val) - 1 == meta["splits"]["val"]["tokens"] - 1
    )
    ref = perplexity_of_tokens(loaded.model, val, stride=32, batch_size=8)
    assert r["loss"] == ref["loss"] and lines[0] == ("split", "val (held out by megajax-prepare)")


def test_the_result_never_replaces_the_data_it_evaluates_and_no_argument_goes_unused(tmp_path):
    """`--out` (or the default WORKDIR/eval_TASK.json) naming the --data file, through any
    spelling or link, or an existing file in a RACE/GLUE directory: before, eval.py read the
    data, then replaced it with its JSON. A new file beside the data, or no --data, is fine."""
    text, race = tmp_path / "wiki.txt", tmp_path / "RACE"
    text.write_text("data")
    (race / "test" / "high").mkdir(parents=True)
    (race / "test" / "high" / "1.txt").write_text("{}")
    (tmp_path / "link.txt").symlink_to(text)
    for end in (".bin", ".idx"):  # a Megatron-LM dataset: megatron:PREFIX names both
        (tmp_path / f"corpus_text_document{end}").write_bytes(b"")
    argv = ["--workdir", str(tmp_path), "--task"]
    for task, data, out in [
        ("wikitext", str(text), str(tmp_path / "link.txt")),
        ("ppl", f"text:{text}", str(text)),
        ("ppl", f"bin:{tmp_path}/../{tmp_path.name}/wiki.txt", str(text)),
        ("race", str(race), str(race / "test" / "high" / "1.txt")),
        ("wikitext", str(tmp_path / "eval_wikitext.json"), None),
        (
            "ppl",
            f"megatron:{tmp_path / 'corpus_text_document'}",
            str(tmp_path / "corpus_text_document.idx"),
        ),
        (
            "mlm",
            f"megatron:{tmp_path / 'corpus_text_document.bin'}",
            str(tmp_path / "corpus_text_document.bin"),
        ),
    ]:
        if out is None:
            (tmp_path / "eval_wikitext.json").write_text("{}")
        with pytest.raises(UserError, match="would replace the data it evaluates"):
            check_eval_args(
                eval_parser().parse_args(
                    [*argv, task, "--data", data, *(["--out", out] if out else [])]
                )
            )
    for task, extra, message in [
        (
            "wikitext",
            ["--split", "dev"],
            "--split is for --task race, mnli, qqp; --task wikitext does not use it",
        ),
        (
            "wikitext",
            ["--prompt", "x"],
            "--prompt is for --task sample, chat; --task wikitext does not",
        ),
        (
            "lambada",
            ["--stride", "8"],
            "--stride is for --task ppl, wikitext; --task lambada does not",
        ),
        ("sample", ["--data", str(text)], "--data is for --task ppl, wikitext, lambada, mlm, race"),
        (
            "ppl",
            ["--data", str(text), "--top-k", "0"],
            "--top-k is for --task sample, chat; --task ppl does not",
        ),
        ("chat", [], "--task chat answers --prompt TEXT or the conversations of --data"),
        ("chat", ["--prompt", "x", "--data", str(text)], "give one of them"),
    ]:
        with pytest.raises(UserError, match=message):  # before: silently unused
            check_eval_args(eval_parser().parse_args([*argv, task, *extra]))
    args = eval_parser().parse_args([*argv, "sample", "--seed", "3"])
    check_eval_args(args)  # the defaults, where a task reads them
    assert (args.seed, args.top_k, args.temperature, args.max_new_tokens, args.prompt) == (
        3,
        40,
        0.8,
        200,
        "",
    )
    for task, data, out in [
        ("wikitext", str(text), str(tmp_path / "new.json")),
        ("race", str(race), str(race / "r.json")),
        ("sample", None, str(text)),
        ("ppl", "builtin", str(text)),
    ]:
        check_eval_args(
            eval_parser().parse_args(
                [*argv, task, *(["--data", data] if data else []), "--out", out]
            )
        )
    assert text.read_text() == "data"
