"""megajax-prepare / python -m megajax.prepare: a corpus tokenized once, for `--data bin:DIR`."""
from __future__ import annotations

import argparse

from megajax.cli.common import fail
from megajax.errors import UserError


def prepare_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="megajax-prepare", description="Tokenize text files, jsonl or a TFDS dataset into train / validation "
                                            "token files that train.py reads with --data bin:DIR. Parallel over "
                                            "processes; an interrupted run continues where it stopped.",
        epilog="examples:\n  megajax-prepare 'corpus/**/*.txt' --tokenizer tiktoken:gpt2 --out data/corpus\n"
               "  megajax-prepare dump.jsonl --text-field body --tokenizer runs/gpt2 --out data/dump\n"
               "  python train.py --config gpt2_355m --data bin:data/corpus",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("inputs", nargs="+", help="text files or globs (one document per file), .jsonl files (one "
                                             "document per line), or tfds:NAME[:SPLIT]")
    p.add_argument("--out", required=True, help="the corpus directory (new, or this same preparation's to resume)")
    p.add_argument("--tokenizer", default="bytes", help="bytes | hf:PATH/tokenizer.json | tiktoken:NAME | "
                                                        "wordpiece:PATH/vocab.txt | a workdir (its tokenizer)")
    p.add_argument("--val-fraction", type=float, default=0.01, help="held-out share of the tokens (default 0.01)")
    p.add_argument("--text-field", default="text", help="jsonl: the field holding the text (default text)")
    p.add_argument("--workers", type=int, help="processes (default: every CPU)")
    return p


def prepare_main(argv=None) -> int:
    args = prepare_parser().parse_args(argv)
    from megajax.prepare import Settings, prepare

    try:
        meta = prepare(args.inputs, args.out, Settings(args.tokenizer, args.val_fraction, args.text_field), args.workers)
    except UserError as e:
        return fail(str(e))
    t, v = meta["splits"]["train"], meta["splits"]["val"]
    print(f"{args.out}: train {t['tokens']:,} tokens ({t['documents']:,} documents), validation {v['tokens']:,} "
          f"tokens ({v['documents']:,} documents), {meta['dtype']}, {meta['tokenizer']['kind']} tokenizer; "
          f"train.py --data bin:{args.out}")
    return 0
