"""The activation-memory model (megajax/memory_model.py) against the paper's closed forms and
against the buffers XLA compiles for the train step."""
import itertools

import pytest
from conftest import mesh_for, tiny_config

from megajax.memory_model import activation_bytes_per_layer, paper_bytes_per_layer
from megajax.training.step import make_trainer


@pytest.mark.parametrize("tp,sp,remat", itertools.product([1, 2, 8], [False, True], ["none", "selective", "full"]))
def test_16_bit_with_dropout_is_the_papers_formula(tp, sp, remat):
    """bfloat16, ffn = 4h, both dropouts: the paper's closed form plus LayerNorm's float32
    statistics (16 bytes a row, absent from the paper), which the full-recompute form keeps none of."""
    shape = dict(b=4, s=2048, h=12288, heads=96, tp=tp, sequence_parallel=sp, remat=remat)   # the paper's 530B layer
    stats = 0 if remat == "full" else 16 * 2048 * 4 // (tp if sp else 1)
    assert activation_bytes_per_layer(**shape) - stats == pytest.approx(paper_bytes_per_layer(**shape), rel=1e-12)


MID = dict(hidden=512, num_heads=8, seq_len=256, vocab_size=512, vocab_multiple=128, compute_dtype="float32",
           scan_layers=True, hidden_dropout=0.1, attention_dropout=0.1)


def compiled_temp_bytes(layers: int, batch: int, **model) -> int:
    cfg = tiny_config(num_layers=layers, **MID, **model)
    cfg.train.batch_size = batch
    return make_trainer(cfg, mesh_for("1x8")).lower_step().compile().memory_analysis().temp_size_in_bytes


def test_compiled_activation_memory_follows_the_model():
    """For the four combinations of sequence parallelism and (no, selective) recomputation on
    1x8, the bytes one more layer adds for 8 more sequences (the compiled step's temporary
    bytes differenced in layers and in batch, so parameters, gradients, optimizer state,
    embedding and logits, and XLA:CPU's per-layer weight copies drop out) agree with the
    model within 15%, and so does the ratio of tensor parallelism alone to tensor + sequence
    parallelism + selective recomputation. Float32: XLA:CPU stores 16-bit activations as
    float32, so only float32 means the same bytes here as on a GPU."""
    measured, model = {}, {}
    for sp, remat in itertools.product([False, True], ["none", "selective"]):
        t = {(n, b): compiled_temp_bytes(n, b, sequence_parallel=sp, remat=remat) for n in (2, 3) for b in (8, 16)}
        measured[sp, remat] = t[3, 16] - t[2, 16] - t[3, 8] + t[2, 8]
        model[sp, remat] = activation_bytes_per_layer(b=8, s=256, h=512, heads=8, tp=8, sequence_parallel=sp,
                                                      remat=remat, dtype="float32")
    for k in measured:
        assert measured[k] == pytest.approx(model[k], rel=0.15), (k, measured, model)
    tp_only, best = (False, "none"), (True, "selective")
    assert measured[tp_only] / measured[best] == pytest.approx(model[tp_only] / model[best], rel=0.15)
