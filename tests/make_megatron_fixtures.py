"""Build the Megatron-LM fixtures of tests/test_megatron_data.py and
tests/test_megatron_checkpoint.py with megatron-core itself:
- three tiny indexed datasets written by its IndexedDatasetBuilder, as Megatron-LM's
  tools/preprocess_data.py writes them, and what its IndexedDataset reads back from each;
- a tiny GPT (megatron-core's GPTModel, its local layer spec) saved as Megatron-LM saves a run,
  with tensor parallelism 1 and 2, and the logits its own forward pass gives.

Run by hand, in an environment with PyTorch and megatron-core (never by the test suite, whose
environment has neither):

    python -m venv /tmp/mcore
    /tmp/mcore/bin/pip install torch --index-url https://download.pytorch.org/whl/cpu
    /tmp/mcore/bin/pip install --no-deps megatron-core==0.16.1 && /tmp/mcore/bin/pip install
    tokenizers numpy packaging /tmp/mcore/bin/python tests/make_megatron_fixtures.py

It rewrites tests/fixtures/megatron/ (about 700 kB):
- zen_text_document.{bin,idx}: one sequence per document, [SEP] appended as the end of
  document (`--append-eod`), uint16 ids (DType.optimal_dtype of a 220-id vocabulary): GPT data;
- zen_text_sentence.{bin,idx}: one sequence per sentence (`--split-sentences`), no end token,
  int32 ids (what Megatron writes for vocabularies of 65,500 ids or more): BERT data;
- zen_multimodal.{bin,idx}: the document file again with a mode byte per sequence;
- reference.npz: for each, Megatron's reading: every sequence's ids in order, the sequence
  lengths and the document indices.
The text is the Zen of Python (the stdlib's `this`), tokenized with the BERT fixture's
vocabulary by the `tokenizers` library, not by megajax.
- tensors.pt: a tensor of each dtype megajax reads, views among them, and tensors.npz their values;
- gpt_tp1/, gpt_tp2/: latest_checkpointed_iteration.txt and
iter_0000007/mp_rank_XX/model_optim_rng.pt
  as megatron.training's save_checkpoint lays them out (args, checkpoint_version 3.0, the model's
  state_dict_for_save_checkpoint, an RNG and an optimizer state), 2 layers, hidden 32, 4 heads,
  ffn 128, 16 positions, 256 vocabulary rows (the same 220-id vocabulary padded to 128 x 2), every
  weight random; reference.npz holds 2 x 12 token ids and the logits of their first 220 columns,
  from megatron-core's forward pass on each (parallel_output=False gathers the vocabulary). Both
  checkpoints hold one model: each TP=2 rank loads its slice of the TP=1 weights, and the script
  checks that Megatron's TP=2 forward pass gives the TP=1 logits (so the slicing is Megatron's).
  megatron-core runs on the CPU with patches that move nothing but devices: its global buffer
  and collectives allocate on the CPU, `.cuda()` leaves a tensor where it is, and its CUDA RNG
  tracker (dropout is 0) is a no-op context.
- gpt_tp2_pp2/: the same weights saved with tensor parallelism 2 and pipeline parallelism 2
  (mp_rank_TT_PPP, one layer a stage), by megatron-core's modules for each stage; its logits are
  gpt_tp1's.
"""

import argparse
import codecs
import contextlib
import json
import os
from pathlib import Path

import numpy as np
import torch
from megatron.core.datasets.indexed_dataset import DType, IndexedDataset, IndexedDatasetBuilder
from tokenizers import BertWordPieceTokenizer

HERE = Path(__file__).resolve().parent
OUT = HERE / "fixtures" / "megatron"
VOCAB = HERE / "fixtures" / "hf" / "bert" / "vocab.txt"


def zen_documents() -> list[list[str]]:
    """The 19 aphorisms, three or four sentences to a document."""
    import this  # noqa: F401  (prints the text; its rot13 source is this.s)

    lines = [line for line in codecs.decode(this.s, "rot13").splitlines()[2:] if line.strip()]
    sizes = [3, 4, 3, 3, 4, 2]
    docs, at = [], 0
    for n in sizes:
        docs.append(lines[at : at + n])
        at += n
    return docs


def encode(tok, sentences: list[str], append_eod: bool, eod: int) -> tuple[list[int], list[int]]:
    """preprocess_data.py's Encoder.encode for one document: each non-empty sentence's ids, the
    end of document appended to the last."""
    doc_ids, lens = [], []
    for sentence in sentences:
        ids = tok.encode(sentence, add_special_tokens=False).ids
        if ids:
            doc_ids.extend(ids)
            lens.append(len(ids))
    if doc_ids and append_eod:
        doc_ids.append(eod)
        lens[-1] += 1
    return doc_ids, lens


def build(prefix: Path, docs, split_sentences: bool, append_eod: bool, dtype, multimodal=False):
    tok = BertWordPieceTokenizer(str(VOCAB), lowercase=True)
    eod = tok.token_to_id("[SEP]")
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=dtype, multimodal=multimodal)
    for doc in docs:
        sentences = doc if split_sentences else [" ".join(doc)]
        ids, lens = encode(tok, sentences, append_eod, eod)
        builder.add_document(
            torch.IntTensor(ids), lens, modes=[0] * len(lens) if multimodal else None
        )
    builder.finalize(f"{prefix}.idx")
    read = IndexedDataset(str(prefix), multimodal=multimodal)
    # multimodal: (ids, mode)
    items = [read[i][0] if multimodal else read[i] for i in range(len(read))]
    return {
        "tokens": np.concatenate(items),
        "lengths": np.asarray(read.sequence_lengths),
        "document_indices": np.asarray(read.document_indices),
    }


# --- checkpoints
# ------------------------------------------------------------------------------------
SIZES = dict(
    num_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    ffn_hidden_size=128,
    max_position_embeddings=16,
    padded_vocab_size=256,
)
REAL_VOCAB = 220


def patch_for_cpu():
    import megatron.core.utils as U
    from megatron.core.tensor_parallel import random as R

    torch.cuda.current_device = lambda: "cpu"
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    U.GlobalMemoryBuffer.get_tensor = lambda self, shape, dtype, name, mem_alloc_context=None: (
        torch.empty(*shape, dtype=dtype)
    )
    R.CudaRNGStatesTracker.fork = lambda self, name="model-parallel-rng": contextlib.nullcontext()


def gpt(tp: int, pre_process: bool = True, post_process: bool = True, pp: int = 1):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    cfg = TransformerConfig(
        num_layers=SIZES["num_layers"],
        hidden_size=SIZES["hidden_size"],
        num_attention_heads=SIZES["num_attention_heads"],
        ffn_hidden_size=SIZES["ffn_hidden_size"],
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        pipeline_dtype=torch.float32,
        use_cpu_initialization=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        bias_dropout_fusion=False,
        gradient_accumulation_fusion=False,
        layernorm_epsilon=1e-5,
    )
    return GPTModel(
        config=cfg,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=SIZES["padded_vocab_size"],
        max_sequence_length=SIZES["max_position_embeddings"],
        position_embedding_type="learned_absolute",
        share_embeddings_and_output_weights=True,
        parallel_output=False,
        pre_process=pre_process,
        post_process=post_process,
    )


def random_weights(shapes: dict, seed: int) -> dict:
    """name -> a random tensor of its shape: N(0, 0.2), norm scales 1 + N(0, 0.2)."""
    g = torch.Generator().manual_seed(seed)
    return {
        name: torch.randn(shape, generator=g) * 0.2
        + (1.0 if name.endswith("layernorm.weight") else 0.0)
        for name, shape in shapes.items()
    }


def full_weights() -> dict:
    """One random model: LayerNorm scales near 1, everything else (biases too) random."""
    h, f = SIZES["hidden_size"], SIZES["ffn_hidden_size"]
    shapes = {
        "embedding.word_embeddings.weight": (SIZES["padded_vocab_size"], h),
        "embedding.position_embeddings.weight": (SIZES["max_position_embeddings"], h),
        "decoder.final_layernorm.weight": (h,),
        "decoder.final_layernorm.bias": (h,),
    }
    for i in range(SIZES["num_layers"]):
        p = f"decoder.layers.{i}."
        shapes.update(
            {
                p + "input_layernorm.weight": (h,),
                p + "input_layernorm.bias": (h,),
                p + "self_attention.linear_qkv.weight": (3 * h, h),
                p + "self_attention.linear_qkv.bias": (3 * h,),
                p + "self_attention.linear_proj.weight": (h, h),
                p + "self_attention.linear_proj.bias": (h,),
                p + "pre_mlp_layernorm.weight": (h,),
                p + "pre_mlp_layernorm.bias": (h,),
                p + "mlp.linear_fc1.weight": (f, h),
                p + "mlp.linear_fc1.bias": (f,),
                p + "mlp.linear_fc2.weight": (h, f),
                p + "mlp.linear_fc2.bias": (h,),
            }
        )
    return random_weights(shapes, 1234)


def run_args(tp: int) -> argparse.Namespace:
    """The arguments megatron.training records that describe the model (a real run records ~400)."""
    return argparse.Namespace(
        **SIZES,
        kv_channels=SIZES["hidden_size"] // SIZES["num_attention_heads"],
        seq_length=12,
        make_vocab_size_divisible_by=128,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=1,
        layernorm_epsilon=1e-5,
        hidden_dropout=0.1,
        attention_dropout=0.1,
        bias_gelu_fusion=False,
        openai_gelu=False,
        onnx_safe=None,
        swiglu=False,
        untie_embeddings_and_output_weights=False,
        position_embedding_type="learned_absolute",
        normalization="LayerNorm",
        add_bias_linear=True,
        group_query_attention=False,
        num_query_groups=None,
        init_method_std=0.02,
        params_dtype=torch.float32,
        tokenizer_type="BertWordPieceLowerCase",
        vocab_file=str(VOCAB),
        iteration=7,
    )


def start_rank(rank: int, world: int, port: int, **parallel):
    """This process as one rank of a gloo group, megatron-core's parallel state set up on the
    CPU."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(**parallel)
    patch_for_cpu()
    return parallel_state


def rank_slices(model, full: dict, t: int, tp: int, source=lambda name: name) -> dict:
    """Tensor-parallel rank t's slice of each full weight, as Megatron splits it: replicated
    whole, column-parallel (and the vocabulary) by rows, row-parallel by columns; SwiGLU's fc1
    as its slice of the gate, then its slice of up. `source`: the full weight a name reads."""
    mine = {}
    for name, tensor in model.state_dict().items():
        if name.endswith("_extra_state"):
            continue
        w = full[source(name)]
        if name.endswith("linear_fc1.weight") and model.config.gated_linear_unit:
            gate, up = w.chunk(2)
            n = gate.shape[0] // tp
            mine[name] = torch.cat([gate[t * n : (t + 1) * n], up[t * n : (t + 1) * n]])
        elif w.shape == tensor.shape:
            mine[name] = w
        elif w.shape[0] != tensor.shape[0]:
            mine[name] = w[t * tensor.shape[0] : (t + 1) * tensor.shape[0]]
        else:
            mine[name] = w[:, t * tensor.shape[1] : (t + 1) * tensor.shape[1]]
    return mine


# kind -> (the model, its full weights, its run's arguments, the iteration saved, the tokens' seed)
KINDS = {
    "gpt": (lambda tp: gpt(tp), lambda: full_weights(), lambda tp: run_args(tp), 7, 99),
    "llama": (lambda tp: llama_gpt(tp), lambda: llama_weights(), lambda tp: llama_args(tp), 3, 98),
}


def save_rank(rank: int, tp: int, out: str, port: int, kind: str = "gpt"):
    """One tensor-parallel rank: its slice of the weights, Megatron's forward pass, torch.save."""
    make_model, make_weights, make_args, iteration, seed = KINDS[kind]
    start_rank(rank, tp, port, tensor_model_parallel_size=tp)
    model = make_model(tp)
    missing, unexpected = model.load_state_dict(
        rank_slices(model, make_weights(), rank, tp), strict=False
    )
    assert not unexpected and all(k.endswith("_extra_state") for k in missing), (
        missing,
        unexpected,
    )
    model.eval()
    tokens = torch.randint(0, REAL_VOCAB, (2, 12), generator=torch.Generator().manual_seed(seed))
    positions = torch.arange(12).unsqueeze(0).expand(2, 12)
    causal = torch.triu(torch.ones(1, 1, 12, 12, dtype=torch.bool), diagonal=1)
    with torch.no_grad():
        logits = model(tokens, positions, causal)
    state = {
        "args": make_args(tp),
        "checkpoint_version": 3.0,
        "iteration": iteration,
        "model": model.state_dict_for_save_checkpoint(),
        "rng_state": [
            {"np_rng_state": np.random.get_state(), "torch_rng_state": torch.get_rng_state()}
        ],
        "optimizer": {"state": {0: {"exp_avg": torch.zeros(3)}}},
    }
    directory = Path(out) / f"iter_{iteration:07d}" / f"mp_rank_{rank:02d}"
    directory.mkdir(parents=True, exist_ok=True)
    torch.save(state, directory / "model_optim_rng.pt")
    if rank == 0:
        (Path(out) / "latest_checkpointed_iteration.txt").write_text(str(iteration))
        np.savez(
            Path(out) / "reference.npz",
            tokens=tokens.numpy(),
            logits=logits.numpy()[..., :REAL_VOCAB],
        )
    torch.distributed.destroy_process_group()


def save_stage(rank: int, tp: int, pp: int, out: str, port: int):
    """One rank of a tensor- and pipeline-parallel run: its stage's layers (named from 0 within
    the stage, as Megatron saves them), its slice of each, and the last stage's copy of the
    embedding as the output layer. Saved only; the logits are those of the same weights unsplit."""
    parallel_state = start_rank(
        rank, tp * pp, port, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp
    )
    t, stage = (
        parallel_state.get_tensor_model_parallel_rank(),
        parallel_state.get_pipeline_model_parallel_rank(),
    )
    model, full = gpt(tp, stage == 0, stage == pp - 1, pp), full_weights()
    per_stage = SIZES["num_layers"] // pp

    def source(name):  # each stage numbers its layers from 0; its output layer is the embedding
        if name == "output_layer.weight":
            return "embedding.word_embeddings.weight"
        if name.startswith("decoder.layers."):
            local, rest = name.removeprefix("decoder.layers.").split(".", 1)
            return f"decoder.layers.{stage * per_stage + int(local)}.{rest}"
        return name

    mine = rank_slices(model, full, t, tp, source)
    model.load_state_dict(mine, strict=False)
    args = run_args(tp)
    args.pipeline_model_parallel_size = pp
    state = {
        "args": args,
        "checkpoint_version": 3.0,
        "iteration": 7,
        "model": model.state_dict_for_save_checkpoint(),
    }
    directory = Path(out) / "iter_0000007" / f"mp_rank_{t:02d}_{stage:03d}"
    directory.mkdir(parents=True, exist_ok=True)
    torch.save(state, directory / "model_optim_rng.pt")
    if rank == 0:
        (Path(out) / "latest_checkpointed_iteration.txt").write_text("7")
    torch.distributed.destroy_process_group()


# --- a Llama-style GPT: RMSNorm, rotary positions (llama3 scaling), SwiGLU, 2 query groups of
# 2 heads, no biases, an untied output layer ---------------------------------------------------
LLAMA = dict(
    num_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    num_query_groups=2,
    ffn_hidden_size=48,
    max_position_embeddings=16,
    padded_vocab_size=256,
)


def llama_gpt(tp: int):
    import torch.nn.functional as F
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    cfg = TransformerConfig(
        num_layers=LLAMA["num_layers"],
        hidden_size=LLAMA["hidden_size"],
        num_attention_heads=LLAMA["num_attention_heads"],
        num_query_groups=LLAMA["num_query_groups"],
        ffn_hidden_size=LLAMA["ffn_hidden_size"],
        tensor_model_parallel_size=tp,
        use_cpu_initialization=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        bias_dropout_fusion=False,
        gradient_accumulation_fusion=False,
        layernorm_epsilon=1e-5,
        apply_rope_fusion=False,
    )
    return GPTModel(
        config=cfg,
        transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
        vocab_size=LLAMA["padded_vocab_size"],
        max_sequence_length=LLAMA["max_position_embeddings"],
        position_embedding_type="rope",
        rotary_base=10000,
        rope_scaling=True,
        rope_scaling_factor=8.0,
        share_embeddings_and_output_weights=False,
        parallel_output=False,
    )


def llama_weights() -> dict:
    h, f, heads, groups = (
        LLAMA["hidden_size"],
        LLAMA["ffn_hidden_size"],
        LLAMA["num_attention_heads"],
        LLAMA["num_query_groups"],
    )
    d = h // heads
    shapes = {
        "embedding.word_embeddings.weight": (LLAMA["padded_vocab_size"], h),
        "output_layer.weight": (LLAMA["padded_vocab_size"], h),
        "decoder.final_layernorm.weight": (h,),
    }
    for i in range(LLAMA["num_layers"]):
        p = f"decoder.layers.{i}."
        shapes.update(
            {
                p + "input_layernorm.weight": (h,),
                p + "pre_mlp_layernorm.weight": (h,),
                p + "self_attention.linear_qkv.weight": ((heads + 2 * groups) * d, h),
                p + "self_attention.linear_proj.weight": (h, heads * d),
                p + "mlp.linear_fc1.weight": (2 * f, h),
                p + "mlp.linear_fc2.weight": (h, f),
            }
        )
    return random_weights(shapes, 4321)


def llama_args(tp: int) -> argparse.Namespace:
    return argparse.Namespace(
        **LLAMA,
        kv_channels=LLAMA["hidden_size"] // LLAMA["num_attention_heads"],
        seq_length=12,
        make_vocab_size_divisible_by=128,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=1,
        layernorm_epsilon=1e-5,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        swiglu=True,
        untie_embeddings_and_output_weights=True,
        position_embedding_type="rope",
        rotary_base=10000,
        rotary_percent=1.0,
        rotary_interleaved=False,
        use_rope_scaling=True,
        rope_scaling_factor=8.0,
        normalization="RMSNorm",
        add_bias_linear=False,
        add_qkv_bias=False,
        group_query_attention=True,
        init_method_std=0.02,
        params_dtype=torch.float32,
        tokenizer_type="BertWordPieceLowerCase",
        vocab_file=str(VOCAB),
        iteration=3,
    )


def llama_checkpoints():
    for tp in (1, 2):
        torch.multiprocessing.spawn(
            save_rank, args=(tp, str(OUT / f"llama_tp{tp}"), 29620 + tp, "llama"), nprocs=tp
        )
    one, two = (np.load(OUT / f"llama_tp{tp}" / "reference.npz") for tp in (1, 2))
    gap = np.abs(one["logits"] - two["logits"]).max()
    assert np.array_equal(one["tokens"], two["tokens"]) and gap < 1e-5, gap
    print(
        f"llama_tp1, llama_tp2: Megatron's logits agree to {gap:.2e} (scale "
        f"{np.abs(one['logits']).max():.2f})"
    )


def checkpoints():
    torch.multiprocessing.spawn(save_stage, args=(2, 2, str(OUT / "gpt_tp2_pp2"), 29610), nprocs=4)
    for tp in (1, 2):
        torch.multiprocessing.spawn(
            save_rank, args=(tp, str(OUT / f"gpt_tp{tp}"), 29600 + tp), nprocs=tp
        )
    one, two = (np.load(OUT / f"gpt_tp{tp}" / "reference.npz") for tp in (1, 2))
    gap = np.abs(one["logits"] - two["logits"]).max()
    assert np.array_equal(one["tokens"], two["tokens"]) and gap < 1e-5, gap
    print(
        f"gpt_tp1, gpt_tp2: Megatron's logits agree to {gap:.2e} (scale "
        f"{np.abs(one['logits']).max():.2f})"
    )


def tensors():
    """tensors.pt: one tensor of each storage type torch_pickle reads, some of them views
    (a transpose, an offset slice) of a larger storage, and their values as float64/int64."""
    g = torch.Generator().manual_seed(5)
    base = torch.randn(6, 5, generator=g)
    made = {
        "float32_t": base.t(),
        "float16": base.half(),
        "bfloat16": base.bfloat16()[1:4, ::2],
        "float64": base.double()[2],
        "int64": torch.arange(-3, 9).reshape(3, 4),
        "int32": torch.tensor([7, -1], dtype=torch.int32),
        "uint8": torch.tensor([0, 255], dtype=torch.uint8),
        "bool": torch.tensor([True, False]),
    }
    torch.save(
        {"model": made, "args": argparse.Namespace(dtype=torch.bfloat16)}, OUT / "tensors.pt"
    )
    np.savez(
        OUT / "tensors.npz",
        **{k: v.double().numpy() if v.is_floating_point() else v.numpy() for k, v in made.items()},
    )


def main():
    OUT.mkdir(parents=True, exist_ok=True)
    tensors()
    checkpoints()
    docs = zen_documents()
    vocab = len(VOCAB.read_text().splitlines())
    made = {
        "zen_text_document": build(
            OUT / "zen_text_document", docs, False, True, DType.optimal_dtype(vocab)
        ),
        "zen_text_sentence": build(OUT / "zen_text_sentence", docs, True, False, np.int32),
        "zen_multimodal": build(
            OUT / "zen_multimodal", docs, False, True, DType.optimal_dtype(vocab), True
        ),
    }
    np.savez(
        OUT / "reference.npz",
        **{f"{name}/{k}": v for name, r in made.items() for k, v in r.items()},
    )
    (OUT / "documents.json").write_text(json.dumps(docs, indent=1) + "\n")
    for name, r in made.items():
        print(
            name,
            len(r["tokens"]),
            "tokens,",
            len(r["lengths"]),
            "sequences,",
            len(r["document_indices"]) - 1,
            "documents",
        )


if __name__ == "__main__":
    import sys

    if sys.argv[1:] == ["--llama"]:  # the Llama-style checkpoints only
        OUT.mkdir(parents=True, exist_ok=True)
        llama_checkpoints()
    else:
        main()
        llama_checkpoints()
