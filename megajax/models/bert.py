"""BERT from the same tensor-parallel layers as GPT: bidirectional attention, token +
position + token-type embeddings, and the heads of each task.

`ln_placement = "pre"` is the Megatron paper's rearrangement (LayerNorm at each sublayer's
input, one final LayerNorm), the only form that keeps improving past 336M parameters;
"post" is the original BERT (LayerNorm after each residual add and after the embeddings).

Tasks (`model.task`):
  pretrain   masked-LM + sentence-order prediction. The MLM output layer is tied to the
             vocab-parallel input embedding and its loss is the fused vocab-parallel
             cross-entropy, evaluated only at the masked positions.
  mnli, qqp  sentence-pair classification on the pooled [CLS] vector (3 and 2 classes).
  race       multiple choice: each of the 4 options is encoded with its article and question,
             scored by a 1-output head on the pooled vector, softmax over the options.
The heads are small and replicated over the model axis, so BERT has exactly GPT's
collectives: 2 all-reduces forward and 2 backward per layer, plus the embedding, the tied
output layer and the loss (pretraining only). With sequence parallelism the heads read only
their rows ([CLS] and the masked positions) out of the sequence shards: one all-reduce of
b·r·h instead of GPT's all-gather of the whole sequence.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from megajax.core import sharding as S
from megajax.core.layers import ReplicatedLinear, VocabParallelEmbedding, dropout, param
from megajax.core.loss import vocab_parallel_cross_entropy
from megajax.core.mesh import single_device_mesh
from megajax.core.norms import LayerNorm
from megajax.core.precision import Precision
from megajax.core.stack import LayerStack
from megajax.models.inputs import check_ids
from megajax.shapes import NUM_CLASSES, TYPE_VOCAB


class BERT(nnx.Module):
    def __init__(self, cfg, layout: S.Layout | None = None, *, rngs: nnx.Rngs):
        # sequence parallelism: the layout's
        layout = layout or S.Layout.for_model(single_device_mesh(), cfg)
        precision = Precision.of(cfg)
        self.cfg, self.layout, self.dtype = cfg, layout, precision.compute
        h, std = cfg.hidden, cfg.init_std
        dense = dict(layout=layout, precision=precision, std=std, rngs=rngs)
        self.embed = VocabParallelEmbedding(
            cfg.vocab_rows(layout.shape), h, drawn=cfg.padded_vocab, **dense
        )
        normal = nnx.initializers.normal(std)
        self.pos = param(normal, S.REPLICATED_2D, rngs.params(), (cfg.seq_len, h))
        self.types = param(normal, S.REPLICATED_2D, rngs.params(), (TYPE_VOCAB, h))
        if cfg.ln_placement == "post":
            self.ln_embed = LayerNorm(h, cfg.ln_eps, rows_2d=not layout.sequence_parallel)
        else:
            self.ln_f = LayerNorm(h, cfg.ln_eps, rows_2d=not layout.sequence_parallel)
        self.layers = LayerStack(cfg, layout, precision, rngs, causal=False)
        self.pooler = ReplicatedLinear(h, h, **dense)
        if cfg.task == "pretrain":
            self.mlm_dense = ReplicatedLinear(h, h, **dense)
            self.mlm_ln = LayerNorm(h, cfg.ln_eps)
            self.mlm_bias = param(
                nnx.initializers.zeros, S.VOCAB_BIAS, rngs.params(), (cfg.vocab_rows(layout.shape),)
            )
            self.sop = ReplicatedLinear(h, 2, **dense)
        else:
            self.classifier = ReplicatedLinear(h, NUM_CLASSES[cfg.task], **dense)

    # -- encoder ----------------------------------------------------------------------------
    def hidden_states(self, tokens, types, mask, *, key=None):
        """(b, s) ids, segment ids and a 0/1 padding mask -> (b, s, h), replicated over "model"
        (with sequence parallelism: split over it along the sequence)."""
        self.layout.check_tokens(tokens, self.cfg.seq_len)
        check_ids("token ids", tokens, self.cfg.vocab_size)
        check_ids("token types", types, TYPE_VOCAB, tokens.shape)
        if tuple(mask.shape) != tuple(tokens.shape):
            raise ValueError(
                f"the padding mask must have the token ids' shape {tuple(tokens.shape)}, got "
                f"{tuple(mask.shape)}"
            )
        positions = jnp.arange(tokens.shape[1])
        k_embed, k_layers = jax.random.split(key) if key is not None else (None, None)
        # A gather, as in GPT, not a slice: with sequence parallelism a slice's gradient is sharded
        # over "model" and XLA all-gathers the position table in the optimizer update instead.
        x = (
            self.embed(tokens)
            + jnp.take(self.pos[...], positions, axis=0).astype(self.dtype)
            + jnp.take(self.types[...], types, axis=0).astype(self.dtype)
        )
        x = self.layout.constrain(x, self.layout.between_blocks)
        if self.cfg.ln_placement == "post":
            x = self.ln_embed(x)
        x = dropout(x, self.cfg.hidden_dropout, k_embed, self.layout, self.layout.between_blocks)
        x = self.layers(x, key=k_layers, mask=mask.astype(bool))
        return self.ln_f(x) if self.cfg.ln_placement == "pre" else x

    def head_rows(self, h, positions):
        """The rows the heads read, (b, r, h) replicated over "model": [CLS] is position 0.
        With sequence parallelism h is split along the sequence and only these rows cross
        devices (`Layout.take_rows`)."""
        with jax.named_scope("logits"):
            return self.layout.take_rows(h, positions)

    def pooled(self, h):
        """BERT's pooler on hidden states (b, s, h): tanh(W h[CLS] + b)."""
        return self.pool(self.head_rows(h, jnp.zeros((h.shape[0], 1), jnp.int32))[:, 0])

    def pool(self, cls):
        """The pooler on the [CLS] rows (b, h)."""
        return jnp.tanh(self.pooler(cls).astype(jnp.float32))

    # -- pretraining heads --------------------------------------------------------------------
    def mlm_logits(self, h, positions):
        """Vocab-parallel logits (b, P, vocab/tp) at the masked positions only."""
        return self.mlm_head(self.head_rows(h, positions))

    def mlm_head(self, picked):
        """The MLM transform and tied output layer on the hidden states at the masked positions."""
        t = self.mlm_ln(jax.nn.gelu(self.mlm_dense(picked), approximate=self.cfg.gelu == "tanh"))
        return self.embed.attend(t) + self.mlm_bias[...]

    def pretrain_outputs(self, batch, key=None):
        """Per-example results: MLM losses and hits (b, P) at the masked positions, SOP losses
        and hits (b,). The objective averages them; evaluation sums them exactly."""
        k_enc, k_pool = jax.random.split(key) if key is not None else (None, None)
        h = self.hidden_states(batch["tokens"], batch["types"], batch["mask"], key=k_enc)
        cls = jnp.zeros_like(batch["mlm_positions"][:, :1])
        rows = self.head_rows(h, jnp.concatenate([cls, batch["mlm_positions"]], axis=1))
        mlm_losses, mlm_hits = vocab_parallel_cross_entropy(
            self.mlm_head(rows[:, 1:]),
            batch["mlm_ids"],
            self.layout,
            self.cfg.vocab_size,
            with_accuracy=True,
        )
        # replicated over "model": no collective but the data-axis means
        with jax.named_scope("sop_loss"):
            pooled = dropout(
                self.pool(rows[:, 0]),
                self.cfg.hidden_dropout,
                k_pool,
                self.layout,
                S.P(S.DATA, None),
            )
            sop_logits = self.sop(pooled).astype(jnp.float32)
            sop_losses = optax.softmax_cross_entropy_with_integer_labels(
                sop_logits, batch["sop_label"]
            )
            sop_hits = sop_logits.argmax(-1) == batch["sop_label"]
        return {
            "mlm_losses": mlm_losses,
            "mlm_hits": mlm_hits,
            "sop_losses": sop_losses,
            "sop_hits": sop_hits,
        }

    def pretrain_objective(self, batch, key):
        out = self.pretrain_outputs(batch, key)
        w = batch["mlm_weights"].astype(jnp.float32)
        with jax.named_scope("loss_mean"):
            # Means over the global batch, also when each data shard has its rows (ZeRO / FSDP).
            n = jnp.maximum(self.layout.global_sum(w.sum()), 1.0)
            mlm_loss, mlm_acc = (out["mlm_losses"] * w).sum() / n, (out["mlm_hits"] * w).sum() / n
        with jax.named_scope("sop_loss"):
            rows = self.layout.global_sum(out["sop_losses"].size)
            sop_loss, sop_acc = out["sop_losses"].sum() / rows, out["sop_hits"].sum() / rows
        loss = mlm_loss + sop_loss
        return loss, {
            "loss": loss,
            "mlm_loss": mlm_loss,
            "sop_loss": sop_loss,
            "mlm_accuracy": mlm_acc,
            "sop_accuracy": sop_acc,
        }

    # -- fine-tuning heads -------------------------------------------------------------------
    def class_logits(self, batch, *, key=None):
        """(b, classes) for pair classification, (b, 4) option scores for multiple choice."""
        tokens = batch["tokens"]
        lead = tokens.shape[:-1]  # (b,) or (b, choices)
        flat = lambda x: x.reshape(-1, x.shape[-1])  # noqa: E731  options become rows
        k_enc, k_pool = jax.random.split(key) if key is not None else (None, None)
        h = self.hidden_states(flat(tokens), flat(batch["types"]), flat(batch["mask"]), key=k_enc)
        pooled = dropout(
            self.pooled(h), self.cfg.hidden_dropout, k_pool, self.layout, S.P(S.DATA, None)
        )
        logits = self.classifier(pooled).astype(jnp.float32)
        return logits.reshape(lead) if len(lead) == 2 else logits

    def classification_objective(self, batch, key):
        logits = self.class_logits(batch, key=key)
        with jax.named_scope("class_loss"):
            rows = self.layout.global_sum(batch["label"].size)
            loss = (
                optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).sum() / rows
            )
            accuracy = (logits.argmax(-1) == batch["label"]).sum() / rows
        return loss, {"loss": loss, "accuracy": accuracy}

    # -- the training objective of this model's task (megajax/tasks/) ------------------------
    def objective(self, batch, *, key=None):
        if self.cfg.task == "pretrain":
            return self.pretrain_objective(batch, key)
        return self.classification_objective(batch, key)
