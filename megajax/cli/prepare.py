"""megajax-prepare / python -m megajax.prepare: a corpus tokenized once, for `--data bin:DIR`."""

from __future__ import annotations

import argparse

from megajax.cli.common import (
    Parser,
    Stopped,
    fail,
    failed,
    given,
    guard_stdout,
    stop_with_a_line,
    stopped,
)
from megajax.errors import UserError


def prepare_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="megajax-prepare",
        description="Tokenize text files, jsonl or a TFDS dataset into train / validation token "
        "files that train.py reads with --data bin:DIR. Parallel over processes; an interrupted "
        "run continues where it stopped.",
        epilog="examples:\n"
        "  megajax-prepare 'corpus/**/*.txt' --tokenizer tiktoken:gpt2 --out data/corpus\n"
        "  megajax-prepare dump.jsonl --text-field body --tokenizer runs/gpt2 --out data/dump\n"
        "  python train.py --config gpt2_355m --data bin:data/corpus\n"
        "  megajax-prepare 'books/*.txt' --pairs --seq-len 512 --tokenizer wordpiece:vocab.txt "
        "--out data/pairs\n"
        "  python train.py --config bert_336m --data pairs:data/pairs\n"
        "  megajax-prepare chats.jsonl --chat --tokenizer runs/llama --out data/chats\n"
        "  python train.py --init-from runs/llama --data chat:data/chats",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "inputs",
        type=given,
        nargs="+",
        help="text files or globs (one document per file), .jsonl files (one document per line), "
        "or tfds:NAME[:SPLIT]",
    )
    p.add_argument(
        "--out",
        type=given,
        required=True,
        help="the corpus directory (new, or this same preparation's to resume)",
    )
    p.add_argument(
        "--tokenizer",
        type=given,
        default="bytes",
        help="bytes | hf:PATH/tokenizer.json | tiktoken:NAME | wordpiece:PATH/vocab.txt | a "
        "workdir (its tokenizer)",
    )
    p.add_argument(
        "--val-fraction",
        type=float,
        default=0.01,
        help="held-out share of the tokens (default 0.01)",
    )
    p.add_argument(
        "--text-field", default="text", help="jsonl: the field holding the text (default text)"
    )
    p.add_argument("--workers", type=int, help="processes (default: every CPU)")
    p.add_argument(
        "--pairs",
        action="store_true",
        help="BERT: sentence pairs for --seq-len, for --data pairs:DIR",
    )
    p.add_argument(
        "--seq-len", type=int, help="--pairs: the model.seq_len they are for (default 512)"
    )
    p.add_argument(
        "--seed",
        type=int,
        help="--pairs: the train.seed whose draws shape the pairs, as in memory (default 0)",
    )
    p.add_argument(
        "--chat",
        action="store_true",
        help=".jsonl conversations rendered with the tokenizer's chat template, with their loss "
        "masks, for --data chat:DIR",
    )
    p.add_argument(
        "--chat-loss",
        choices=("assistant", "all"),
        help="--chat: the tokens the loss covers (default assistant)",
    )
    return p


def check_prepare_args(args):
    """The numbers on the command line, before anything is read or written; --seq-len and --seed
    take their defaults here, since they mean something only with --pairs."""
    if not args.pairs and (args.seq_len, args.seed) != (None, None):  # before: silently unused
        raise UserError(
            "--seq-len and --seed shape BERT sentence pairs: add --pairs (a GPT corpus has neither)"
        )
    args.seq_len = 512 if args.seq_len is None else args.seq_len
    args.seed = 0 if args.seed is None else args.seed
    if args.pairs and not 8 <= args.seq_len < 2**31:
        raise UserError(
            f"--seq-len must be at least 8 (and below 2^31) for sentence pairs, got {args.seq_len}"
        )
    if not 0 <= args.seed < 2**31:
        raise UserError(f"--seed must be in 0..2^31-1, got {args.seed}")
    if args.chat and args.pairs:
        raise UserError("--chat and --pairs prepare different corpora: give one of them")
    if args.chat_loss is not None and not args.chat:
        raise UserError("--chat-loss is for --chat")
    args.chat_loss = args.chat_loss or "assistant"
    if args.workers is not None and args.workers < 1:
        raise UserError(f"--workers must be at least 1, got {args.workers}")


def prepare_main(argv=None) -> int:
    guard_stdout()
    args = prepare_parser().parse_args(argv)
    from megajax.prepare import Settings, prepare, prepare_chat

    stop_with_a_line(
        f"the finished units are kept in {args.out}/.partial: the same command continues"
    )
    try:
        check_prepare_args(args)
        if args.chat:
            meta = prepare_chat(
                args.inputs,
                args.out,
                args.tokenizer,
                args.val_fraction,
                args.chat_loss,
                args.workers,
            )
        else:
            settings = Settings(
                args.tokenizer,
                args.val_fraction,
                args.text_field,
                args.seq_len if args.pairs else 0,
                args.seed,
            )
            meta = prepare(args.inputs, args.out, settings, args.workers)
    except UserError as e:
        return fail(str(e))
    except Stopped as e:
        return stopped(e)
    except Exception as e:  # noqa: BLE001  (a full disk: one line; a bug: raised)
        return failed(e, "use fewer --workers")
    if args.chat:
        t, v = meta["splits"]["train"], meta["splits"]["val"]
        print(
            f"{args.out}: train {t['conversations']:,} conversations ({t['tokens']:,} tokens), "
            f"validation {v['conversations']:,} ({v['tokens']:,} tokens), "
            f"{meta['tokenizer']['kind']} tokenizer; train.py --data chat:{args.out}"
        )
        return 0
    if args.pairs:
        print(
            f"{args.out}: {meta['pairs']:,} sentence pairs ({meta['tokens']:,} tokens) for seq_len "
            f"{meta['seq_len']}, the last {meta['val_pairs']:,} for validation, "
            f"{meta['tokenizer']['kind']} tokenizer; train.py --data pairs:{args.out}"
        )
        return 0
    print(
        f"{args.out}: {_splits(meta['splits'])}, {meta['dtype']}, {meta['tokenizer']['kind']} "
        f"tokenizer; train.py --data bin:{args.out}"
    )
    return 0


def _splits(splits: dict) -> str:
    """The splits in words. The held-out documents are whole trailing ones, unless no document
    ends near the held-out fraction (a corpus of one or a few long documents): then the cut is
    inside one, whose start trains and whose rest is validation, and the line says so."""
    t, v = splits["train"], splits["val"]
    if not v.get("starts_inside_a_document"):
        return (
            f"train {t['tokens']:,} tokens ({t['documents']:,} documents), validation "
            f"{v['tokens']:,} tokens ({v['documents']:,} documents)"
        )
    more = f" and {v['documents'] - 1:,} more" if v["documents"] > 1 else ""
    return (
        f"train {t['tokens']:,} tokens ({t['documents']:,} whole documents and the start of one "
        f"more), validation {v['tokens']:,} tokens (the rest of that document{more}: no document "
        "ends near the held-out fraction, so the cut is inside one)"
    )
