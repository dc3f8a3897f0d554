"""Fine-tuning on conversations (chat: sources): the template rendering and assistant masks
against transformers, the loss on the assistant's tokens only, packed conversations each
attending to itself alone, and a tiny model that learns a chat file end to end."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ROOT, mesh_for, tiny_config
from flax import nnx
from helpers import cli, killed_after_checkpoint, long_run_env, losses, run, tiered
from tolerances import F32, assert_close

from megajax.core.blocked_attention import blocked_attention
from megajax.core.fused_attention import fused_attention_core
from megajax.data.chat import encode_conversation, prompt_ids, read_conversations, template_for
from megajax.data.chat_template import ChatTemplate
from megajax.data.packing import pack, target_weights
from megajax.data.tokenizer import ByteTokenizer, HFTokenizer
from megajax.errors import UserError
from megajax.models.registry import init_model

CHAT = ROOT / "tests" / "fixtures" / "chat"
REFERENCE = json.loads((CHAT / "reference.json").read_text())


@pytest.mark.parametrize("name", ["llama3", "chatml"])
def test_ids_and_assistant_masks_equal_transformers(name):
    """24 conversations (tests/make_chat_fixtures.py): the ids and the assistant mask of
    apply_chat_template(..., return_assistant_tokens_mask=True), and a generation prompt."""
    tok = HFTokenizer(CHAT / name / "tokenizer.json")
    template = template_for(tok)
    conversations = read_conversations(str(CHAT / "conversations.jsonl"))
    want = REFERENCE[name]["conversations"]
    assert len(conversations) == len(want) >= 20
    for c, ref in zip(conversations, want):
        ids, mask = encode_conversation(c, template, tok)
        assert ids.tolist() == ref["input_ids"], c.where
        assert mask.tolist() == ref["assistant_masks"], c.where
    messages = list(conversations[1].messages)[:-1]
    assert prompt_ids(messages, template, tok) == REFERENCE[name]["prompt_1"]


def test_a_template_without_generation_marks_is_split_by_its_prefixes():
    """The Llama 3-style template, its {% generation %} marks removed: each turn's span is the
    growth of the rendered text, the same tokens as the marked template's."""
    tok = HFTokenizer(CHAT / "llama3" / "tokenizer.json")
    marked = template_for(tok)
    plain = ChatTemplate(
        marked.source.replace("{% generation %}", "").replace("{% endgeneration %}", ""),
        marked.variables,
    )
    assert not plain.tagged
    for c, ref in zip(
        read_conversations(str(CHAT / "conversations.jsonl")), REFERENCE["llama3"]["conversations"]
    ):
        assert encode_conversation(c, plain, tok)[1].tolist() == ref["assistant_masks"]


def test_plain_template_masks_the_assistants_text_and_end_of_turn():
    """A tokenizer without a template (bytes): the documented plain one; the mask, counted by
    hand, covers each answer's bytes and its <|end|>; `all` covers every token."""
    c = read_conversations(str(CHAT / "conversations.jsonl"))[2]
    tok = ByteTokenizer()
    template = template_for(tok)
    text, _ = template.render(list(c.messages))
    ids, mask = encode_conversation(c, template, tok)
    assert bytes(ids.tolist()).decode() == text
    answers = [m["content"] + "<|end|>" for m in c.messages if m["role"] == "assistant"]
    assert mask.sum() == sum(len(a.encode()) for a in answers)
    marked = bytes(np.asarray(ids)[mask == 1].tolist()).decode()
    assert marked == "".join(answers)
    assert encode_conversation(c, template, tok, "all")[1].tolist() == [1] * len(ids)


@pytest.mark.parametrize(
    "line,says",
    [
        ("{not json", "not JSON"),
        ('{"messages": [{"content": "hi"}]}', "message 1 has no role"),
        ('{"messages": [{"role": "user"}]}', 'has no text "content"'),
        ('{"messages": [{"role": "user", "content": "hi"}]}', "no assistant turn"),
        ("[1, 2]", "a JSON object"),
    ],
)
def test_bad_conversation_lines_are_named_by_file_and_line(tmp_path, line, says):
    path = tmp_path / "c.jsonl"
    path.write_text('{"prompt": "a", "completion": "b"}\n\n' + line + "\n")
    with pytest.raises(UserError, match=f"{path}:3: .*{says}"):
        read_conversations(str(path))


def test_a_template_that_fails_names_the_conversation_and_train_writes_nothing(tmp_path):
    tok_dir = tmp_path / "tok"
    tok_dir.mkdir()
    (tok_dir / "tokenizer.json").write_bytes((CHAT / "llama3" / "tokenizer.json").read_bytes())
    (tok_dir / "chat_template.jinja").write_text(
        "{% if messages[0]['role'] == 'system' %}{{ raise_exception('no system turns') }}{% endif "
        "%}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    )
    data = tmp_path / "c.jsonl"
    data.write_text(
        '{"prompt": "a", "completion": "b"}\n'
        '{"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}, '
        '{"role": "assistant", "content": "x"}]}\n'
    )
    wd = tmp_path / "run"
    p = run(
        "--config",
        "tiny",
        "--data",
        f"chat:{data}",
        "--tokenizer",
        f"hf:{tok_dir / 'tokenizer.json'}",
        "--workdir",
        str(wd),
        check=False,
    )
    assert p.returncode == 2, p.stderr
    assert (
        p.stderr.strip()
        .splitlines()[-1]
        .endswith(
            f"{data}:2: {tok_dir / 'chat_template.jinja'} fails to render it: no system turns"
        )
    )
    assert not wd.exists()


def test_packing_and_target_weights_by_hand():
    examples = [
        (np.array([5, 6, 7]), np.array([0, 1, 1])),
        (np.array([8, 9]), np.array([1, 1])),
        (np.array([1, 2, 3, 4]), np.array([0, 0, 1, 1])),
    ]
    p = pack(examples, 6)
    assert p.tokens.tolist() == [[5, 6, 7, 8, 9, 0], [1, 2, 3, 4, 0, 0]]
    assert p.segments.tolist() == [[1, 1, 1, 2, 2, 0], [1, 1, 1, 1, 0, 0]]
    # targets 6 and 7 of the first conversation, 9 of the second (not 8: it starts a new one)
    assert target_weights(p.segments, p.mask).tolist() == [[1, 1, 0, 1, 0], [0, 1, 1, 0, 0]]


def _packed_batch(rows=8, length=33, seed=0):
    """Conversations of 3..14 tokens packed in `rows` rows, each alone in a row too."""
    rng = np.random.default_rng(seed)
    examples = []
    while len(examples) < 5 * rows:
        n = int(rng.integers(3, 15))
        examples.append((rng.integers(1, 100, n), (rng.random(n) < 0.6).astype(np.int8)))
    packed = pack(examples, length)
    packed = type(packed)(*(t[:rows] for t in (packed.tokens, packed.segments, packed.mask)))
    return packed, examples[: int(packed.segments.max(1).sum())]


# (compiled: one program, not one per operation)
_token_losses = nnx.jit(lambda model, x, y, segments: model.token_losses(x, y, segments=segments))


def _per_conversation_losses(model, tokens, segments, mask):
    """Each segment's summed target losses, in row order."""
    w = target_weights(segments, mask)
    losses = (
        np.asarray(
            _token_losses(
                model,
                jnp.asarray(tokens[:, :-1]),
                jnp.asarray(tokens[:, 1:]),
                jnp.asarray(segments[:, :-1]),
            )
        )
        * w
    )
    return [
        float(losses[r][segments[r, :-1] == s].sum())
        for r in range(len(tokens))
        for s in range(1, segments[r].max() + 1)
    ]


@pytest.mark.parametrize(
    "mesh,sp,kind",
    tiered(
        [
            ("1x1", False, "gpt"),
            ("2x4", False, "llama"),
            ("1x8", False, "gpt"),
            ("2x4", True, "llama"),
        ],
        ("2x4", False, "llama"),
    ),
)
def test_each_packed_conversation_has_its_loss_alone(devices, mesh, sp, kind):
    """Learned positions (GPT-2) and rotary ones (Llama: RMSNorm, SwiGLU, 8 query and 2 KV
    heads): a conversation packed with others has the loss it has alone in a row."""
    extra = (
        dict(
            norm="rmsnorm",
            positions="rope",
            mlp="swiglu",
            num_kv_heads=2,
            bias="none",
            tie_embeddings=False,
        )
        if kind == "llama"
        else {}
    )
    cfg = tiny_config(
        seq_len=32, hidden_dropout=0.0, attention_dropout=0.0, sequence_parallel=sp, **extra
    ).model
    model = init_model(cfg, mesh_for(mesh), seed=3)
    packed, used = _packed_batch()
    singles = [pack([e], 33) for e in used]
    tokens, segments, mask = (
        np.concatenate([getattr(s, f) for s in singles]) for f in ("tokens", "segments", "mask")
    )
    tokens, segments, mask = (
        np.pad(t, ((0, -len(t) % 8), (0, 0))) for t in (tokens, segments, mask)
    )
    want = _per_conversation_losses(model, tokens, segments, mask)
    got = _per_conversation_losses(model, packed.tokens, packed.segments, packed.mask)
    assert len(got) == len(used)
    assert_close(got, want, F32, what=f"{mesh} sp={sp}")


def test_targets_outside_the_mask_get_exactly_zero_gradient(devices):
    """2x4: the loss's gradient with respect to the final hidden states is exactly 0 at every
    position whose target the mask leaves out (the user's turns, padding, a conversation's
    first token), and nonzero where it counts."""
    cfg = tiny_config(seq_len=32, hidden_dropout=0.0, attention_dropout=0.0).model
    model = init_model(cfg, mesh_for("2x4"), seed=1)
    packed, _ = _packed_batch()
    tokens, segments = jnp.asarray(packed.tokens), jnp.asarray(packed.segments[:, :-1])
    weights = jnp.asarray(target_weights(packed.segments, packed.mask))
    h = nnx.jit(lambda m: m.hidden_states(tokens[:, :-1], segments=segments))(model)

    def loss(h):
        from megajax.core.loss import vocab_parallel_cross_entropy

        logits = model.output_layer.attend(h)
        losses = vocab_parallel_cross_entropy(logits, tokens[:, 1:], model.layout, cfg.vocab_size)
        return jnp.where(weights > 0, losses * weights, 0.0).sum() / weights.sum()

    g = np.abs(np.asarray(jax.jit(jax.grad(loss))(h))).max(-1)
    w = np.asarray(weights)
    assert (w == 0).sum() > 50 and (w == 1).sum() > 50
    assert np.all(g[w == 0] == 0.0)
    assert np.all(g[w == 1] > 0.0)


def test_blocked_and_fused_cores_attend_within_segments():
    """The CPU's blocked core (tiled, causal) and the fused core (jax.nn.dot_product_attention)
    with segment ids equal a hand-written masked softmax: causal and same-segment."""
    rng = np.random.default_rng(0)
    b, h, s, d = 2, 4, 512, 8
    q, k, v = (jnp.asarray(rng.standard_normal((b, h, s, d)), jnp.float32) for _ in range(3))
    segments = np.repeat(np.arange(1, 9), s // 8)[None].repeat(b, 0)
    segments[1, 300:] = 0  # a padded tail is a segment of its own
    seg = jnp.asarray(segments, jnp.int32)
    scores = jnp.einsum("bhqd,bhkd->bhqk", q, k) / np.sqrt(d)
    keep = (np.arange(s)[:, None] >= np.arange(s)[None]) & (
        segments[:, None, :, None] == segments[:, None, None, :]
    )
    want = jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(jnp.where(keep, scores, -1e30), -1), v)
    blocked = blocked_attention(q, k, v, seg, causal=True, scale=1 / np.sqrt(d))
    fused = fused_attention_core(q, k, v, seg, causal=True, scale=1 / np.sqrt(d), platform="cpu")
    assert_close(blocked, want, F32, what="blocked")
    assert_close(fused, want, F32, what="fused")
    g_want = jax.grad(
        lambda q: (
            jnp.einsum(
                "bhqk,bhkd->bhqd",
                jax.nn.softmax(
                    jnp.where(keep, jnp.einsum("bhqd,bhkd->bhqk", q, k) / np.sqrt(d), -1e30), -1
                ),
                v,
            )
            ** 2
        ).sum()
    )(q)
    g_blocked = jax.grad(
        lambda q: (blocked_attention(q, k, v, seg, causal=True, scale=1 / np.sqrt(d)) ** 2).sum()
    )(q)
    assert_close(g_blocked, g_want, F32, what="blocked gradient")


def _chat_batch(cfg, packed):
    return {
        "tokens": packed.tokens,
        "segments": packed.segments,
        "loss_mask": target_weights(packed.segments, packed.mask),
    }


@pytest.mark.parametrize(
    "mesh,sets",
    tiered(
        [("2x4", {"shard_optimizer": True}), ("1x8", {"shard_params": True})],
        ("2x4", {"shard_optimizer": True}),
    ),
)
def test_three_steps_on_conversations_equal_one_device(devices, mesh, sets):
    """The masked, packed objective through the sharded step (ZeRO-1 on 2x4, FSDP on 1x8,
    where each data shard normalises by the global count of targets): 1x1's losses."""
    import dataclasses

    from megajax.training.step import make_trainer

    def losses_on(mesh, **train):
        cfg = tiny_config(seq_len=32, hidden_dropout=0.0, attention_dropout=0.0)
        cfg = dataclasses.replace(
            cfg,
            train=dataclasses.replace(cfg.train, **train),
            data=dataclasses.replace(cfg.data, source="chat:x.jsonl"),
        )
        trainer = make_trainer(cfg, mesh_for(mesh))
        params, opt = trainer.init_state()
        step = trainer.jit_step(donate=False)
        out = []
        for i in range(3):
            packed, _ = _packed_batch(seed=i)
            batch = jax.device_put(_chat_batch(cfg, packed), trainer.batch_sharding)
            params, opt, m = step(params, opt, batch, np.int32(i))
            out.append(float(m["loss"]))
        return out

    want = losses_on("1x1")
    assert_close(losses_on(mesh, **sets), want, F32, what=mesh)


LEARN_ARGS = [
    "--config",
    "tiny",
    "--host-devices",
    "2",
    "--mesh",
    "1x2",
    "--sample-tokens",
    "0",
    "--steps",
    "300",
    "--log-every",
    "1",
    "--eval-every",
    "1000",
    "--set",
    "model.seq_len=160",
    "--set",
    "model.hidden_dropout=0",
    "--set",
    "model.attention_dropout=0",
    "--set",
    "data.val_fraction=0.01",
    "--set",
    "train.min_lr=3e-3",
]


def learn_file(path):
    """32 short conversations to learn by heart (each answer follows from its prompt): single
    and two-turn, system turns, and prompt/completion records."""
    words = ["apple", "river", "cloud", "stone", "lamp", "garden", "violin", "tiger"]
    rng = np.random.default_rng(0)
    lines = []
    for i in range(32):
        a, b = rng.choice(words, 2, replace=False)
        if i % 4 == 0:
            lines.append({"prompt": f"Spell {a} ({i}).", "completion": " ".join(a)})
            continue
        m = [{"role": "system", "content": "Be terse."}] if i % 3 == 0 else []
        m += [
            {"role": "user", "content": f"Rhyme {a}, {i}?"},
            {"role": "assistant", "content": f"{a}-{b} {i}"},
        ]
        if i % 2:
            m += [{"role": "user", "content": "Again."}, {"role": "assistant", "content": b}]
        lines.append({"messages": m})
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


@pytest.fixture(scope="module")
def learned(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat")
    data = learn_file(root / "learn.jsonl")
    wd = root / "run"
    # A process of its own, as the killed run that resumes to its losses below: XLA:CPU's last
    # bits depend on how many devices its process simulates (2 of this process's 8 are not 2).
    # 300 steps: -O1 code (helpers.long_run_env), for both.
    p = run(
        *LEARN_ARGS,
        "--data",
        f"chat:{data}",
        "--workdir",
        str(wd),
        "--save-every",
        "50",
        timeout=400,
        env=long_run_env(),
    )
    return data, wd, losses(wd), p


@pytest.mark.full
def test_a_tiny_model_learns_32_conversations(learned):
    data, wd, got, p = learned
    assert "32 conversations packed in" in p.stdout
    assert np.mean([got[s] for s in range(281, 301)]) < 0.05 < got[1]
    # it answers a training prompt with the answer it learned, stopping at the end of turn
    first = json.loads(data.read_text().splitlines()[1])["messages"]
    q = cli(
        "eval",
        "--workdir",
        wd,
        "--task",
        "chat",
        "--prompt",
        first[0]["content"],
        "--temperature",
        "0",
        "--host-devices",
        "8",
        "--mesh",
        "1x8",
    )
    assert q.returncode == 0, q.stderr
    result = json.loads((wd / "eval_chat.json").read_text())
    assert result["answer"] == first[1]["content"] and first[1]["content"] in q.stdout
    # a file of conversations: each cut after its last user turn (the second line's "Again."),
    # and answered
    asked = data.parent / "ask.jsonl"
    asked.write_text(
        data.read_text().splitlines()[1]
        + "\n"
        + json.dumps({"prompt": json.loads(data.read_text().splitlines()[0])["prompt"]})
        + "\n"
    )
    q = cli(
        "eval",
        "--workdir",
        wd,
        "--task",
        "chat",
        "--data",
        asked,
        "--temperature",
        "0",
        "--host-devices",
        "1",
        "--mesh",
        "1x1",
        "--out",
        data.parent / "answers.json",
    )
    assert q.returncode == 0, q.stderr
    answers = json.loads((data.parent / "answers.json").read_text())["answers"]
    assert [a["answer"] for a in answers] == [
        first[-1]["content"],
        json.loads(data.read_text().splitlines()[0])["completion"],
    ]  # (line 2's last question)


@pytest.mark.full
def test_resume_after_sigkill_logs_the_same_losses(learned, tmp_path):
    """Killed after its checkpoint at step 20 and run again: the first 60 steps of the learning
    run, bitwise (the learning rate is constant after warmup, so 60 steps are a prefix of 200)."""
    data, _, ref, _ = learned
    wd = tmp_path / "killed"
    args = [
        *LEARN_ARGS,
        "--data",
        f"chat:{data}",
        "--workdir",
        str(wd),
        "--save-every",
        "20",
        "--steps",
        "60",
    ]
    killed_after_checkpoint(args, wd, 20, timeout=300, environ=long_run_env())
    p = run(*args, timeout=400, env=long_run_env())
    assert "resuming from step" in p.stdout
    assert losses(wd) == {s: ref[s] for s in range(1, 61)}  # every step, bitwise


def test_prepared_conversations_equal_the_templates_ids_and_resume(tmp_path, monkeypatch):
    """megajax-prepare --chat, its files cut into one-line units and stopped after a few: the
    same command resumes, and the splits hold transformers' ids and masks, in order (the last
    fifth held out); train.py reads the directory as it reads the file."""
    import megajax.prepare.chat as prep
    import megajax.prepare.units as units
    from megajax.data.prepared import load_conversations

    monkeypatch.setattr(units, "UNIT_BYTES", 200)
    calls, real = [], prep._run_unit

    def stop_after_three(job):
        if len(calls) == 3:
            raise KeyboardInterrupt
        calls.append(job[0])
        return real(job)

    monkeypatch.setattr(prep, "_run_unit", stop_after_three)
    args = (
        [str(CHAT / "conversations.jsonl")],
        tmp_path / "d",
        f"hf:{CHAT / 'llama3' / 'tokenizer.json'}",
        0.2,
    )
    with pytest.raises(KeyboardInterrupt):
        prep.prepare_chat(*args, workers=1, say=lambda _: None)
    assert not (tmp_path / "d" / "meta.json").exists()
    said = []
    monkeypatch.setattr(prep, "_run_unit", real)
    prep.prepare_chat(*args, workers=1, say=said.append)
    assert said and said[0].startswith("resuming: 3 of ")
    train, val, _ = load_conversations(tmp_path / "d", None)
    assert (len(train), len(val)) == (20, 4)
    for (ids, mask), ref in zip(train + val, REFERENCE["llama3"]["conversations"]):
        assert ids.tolist() == ref["input_ids"] and mask.tolist() == ref["assistant_masks"]
    import dataclasses

    from megajax.tasks import task_for

    cfg = tiny_config(seq_len=192)
    cfg = dataclasses.replace(
        cfg,
        data=dataclasses.replace(cfg.data, source=f"chat:{tmp_path / 'd'}", tokenizer="hf:unused"),
    )
    data = task_for(cfg).load_data(cfg)
    assert data.describe().startswith("24 conversations packed in") and data.val.rows >= 1
    assert int(data.train.segments.max(1).sum()) == 20


def test_a_bad_line_stops_the_preparation_naming_it(tmp_path):
    data = tmp_path / "c.jsonl"
    data.write_text(
        '{"prompt": "a", "completion": "b"}\n'
        '{"messages": [{"role": "user", "content": "no answer"}]}\n'
    )
    p = cli("prepare", data, "--chat", "--out", tmp_path / "d")
    assert p.returncode == 2
    assert (
        p.stderr.strip() == f"error: {data}:2: the conversation has no assistant turn to learn from"
    )
    assert not (tmp_path / "d" / "meta.json").exists()
    assert not (tmp_path / "d" / ".partial").exists()


def test_held_out_conversations_without_a_target_are_refused_not_scored(tmp_path):
    """A short conversation and one whose answer model.seq_len cuts away, one of them held out:
    held out, the cut one would give a validation loss over no target, 0.0 (perplexity 1.0); it
    is refused instead. (Kept for training, it leaves the other check: nothing to learn from.)"""
    from megajax.tasks import task_for

    short = {"prompt": "a", "completion": "b"}
    long = {"prompt": "x" * 80, "completion": "y"}
    refusals = []
    for n, order in enumerate(([short, long], [long, short])):
        data = tmp_path / f"c{n}.jsonl"
        data.write_text("".join(json.dumps(c) + "\n" for c in order))
        cfg = tiny_config(seq_len=32)
        cfg = dataclasses.replace(
            cfg,
            data=dataclasses.replace(
                cfg.data,
                source=f"chat:{data}",
                tokenizer="chars",
                val_fraction=0.5,
                chat_overflow="truncate",
            ),
        )
        with pytest.raises(UserError) as e:
            task_for(cfg).load_data(cfg)
        refusals.append(str(e.value))
        if "held-out" not in str(e.value):
            assert "leaves no target token to learn from" in str(e.value)
            continue
        assert str(e.value) == (
            f"chat:{data}'s 1 held-out conversation(s) keep no target token at model.seq_len 32 "
            "(their assistant turns were truncated away): raise model.seq_len, or hold none out "
            "(data.val_fraction = 0)"
        )
        p = run(
            "--config",
            "tiny",
            "--data",
            f"chat:{data}",
            "--tokenizer",
            "chars",
            "--set",
            "model.seq_len=32",
            "--set",
            "data.val_fraction=0.5",
            "--set",
            "data.chat_overflow=truncate",
            "--workdir",
            tmp_path / "w",
            check=False,
        )
        assert p.returncode == 2 and p.stderr == f"error: {e.value}\n", p.stderr
        assert not (tmp_path / "w").exists()
    assert sum("held-out" in r for r in refusals) == 1


def test_a_validation_of_no_target_is_no_number():
    """The rule under every task whose loss has a mask (training/loop.evaluate): a batch whose
    loss has no target is left out of the means; none with a target is an error."""
    from megajax.training.loop import evaluate

    batches = {
        0: {"loss": 2.0, "targets": 3},
        1: {"loss": 0.0, "targets": 0},
        2: {"loss": 4.0, "targets": 1},
    }
    assert evaluate(lambda p, b: dict(batches[b]), None, lambda i: i, 3) == {"loss": 3.0}
    with pytest.raises(UserError, match="hold no target token, so no validation loss"):
        evaluate(lambda p, b: {"loss": 0.0, "targets": 0}, None, lambda i: i, 3)
    # a task without a mask: every batch counts
    assert evaluate(lambda p, b: {"loss": float(b)}, None, lambda i: i, 3) == {"loss": 1.0}


@pytest.mark.parametrize(
    "expression, says",
    [
        ("{{ 1 / 0 }}", "ZeroDivisionError: "),
        ("{{ 10.0 ** 400 }}", "OverflowError: "),
        ("{{ none_such.attr }}", "'none_such' is undefined"),
    ],
)
def test_a_template_that_raises_anything_is_one_line(tmp_path, expression, says):
    template = ChatTemplate(
        expression + "{% for m in messages %}{{ m['content'] }}{% endfor %}", origin="t.jinja"
    )
    with pytest.raises(ValueError, match=f"t.jinja fails to render it: .*{says}"):
        template.render([{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}])


@pytest.mark.parametrize("separator", ["\u2028", "\u2029", "\u0085"])
def test_json_lines_are_split_at_newlines_alone(tmp_path, separator):
    """A JSON string may hold U+2028, U+2029 or U+0085 raw (str.splitlines would end a line
    there): every reader of JSON lines reads the line whole."""
    from megajax.evaluation.chat import conversations_to_answer
    from megajax.evaluation.lambada import lambada_examples
    from megajax.files import parse_jsonl
    from megajax.prepare.units import Unit, tokenize_unit

    said = f"first{separator}second"
    data = tmp_path / "c.jsonl"
    data.write_text(
        json.dumps({"prompt": said, "completion": "ok"}, ensure_ascii=False)
        + "\n"
        + json.dumps({"prompt": "b", "completion": "c"})
        + "\r\n",
        encoding="utf-8",
    )
    assert separator in data.read_text(encoding="utf-8")
    conversations = read_conversations(str(data))
    assert [c.messages[0]["content"] for c in conversations] == [said, "b"]
    assert [m[0]["content"] for m in conversations_to_answer(str(data))] == [said, "b"]
    assert [r["prompt"] for r in parse_jsonl(data.read_text(encoding="utf-8"))] == [said, "b"]
    tok = ByteTokenizer()
    ids, docs = tokenize_unit(
        Unit(str(data), "jsonl", 0, data.stat().st_size, False),
        tok,
        [],
        "prompt",
        np.dtype(np.int32),
    )
    assert docs == 2 and tok.decode(ids.tolist()) == said + "b"
    lambada = tmp_path / "l.jsonl"
    lambada.write_text(
        json.dumps({"text": f"one{separator}two three"}, ensure_ascii=False) + "\n",
        encoding="utf-8",
    )
    assert len(lambada_examples(lambada, tok, 64)) == 1
    p = cli(
        "prepare", data, "--chat", "--out", tmp_path / "d", "--workers", "1", "--val-fraction", "0"
    )
    assert p.returncode == 0, p.stderr


def test_answering_a_file_that_is_not_utf8_is_one_line(tmp_path):
    from megajax.evaluation.chat import conversations_to_answer

    data = tmp_path / "latin1.jsonl"
    data.write_bytes('{"prompt": "caf\xe9"}\n'.encode("latin-1"))
    with pytest.raises(UserError, match=r"latin1.jsonl is not UTF-8 text \(byte 15: b'\\xe9'\)"):
        conversations_to_answer(str(data))
