"""megajax-convert / python -m megajax.convert: Hugging Face model directories in and out."""

from __future__ import annotations

import argparse
import sys
import warnings

from megajax.cli.common import Parser, exit_on_signal, fail, failed, given, guard_stdout, start_jax
from megajax.errors import UserError
from megajax.files import abandon_staged


def convert_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="megajax-convert",
        description="Convert between Hugging Face model directories (GPT2LMHeadModel, "
        "BertForPreTraining, MegatronBertForPreTraining) and megajax workdirs, and import "
        "Megatron-LM's own GPT checkpoints.",
        epilog="examples:\n"
        "  megajax-convert import --hf ~/models/gpt2 --workdir runs/gpt2\n"
        "  megajax-convert import --megatron checkpoints/gpt2_345m --tokenizer tiktoken:gpt2 "
        "--workdir runs/345m\n"
        "  python eval.py --workdir runs/gpt2 --task sample --prompt 'Hello' --mesh model=2 "
        "--host-devices 2\n"
        "  megajax-convert export --workdir runs/bert --out exported/bert\n"
        "  megajax-convert export --adapter --workdir runs/lora --out exported/adapter\n"
        "  megajax-convert merge --workdir runs/lora --out exported/merged",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="direction", required=True)
    _add_import(sub)
    _add_export(sub)
    _add_merge(sub)
    return p


def _add_import(sub):
    imp = sub.add_parser(
        "import",
        help="an HF directory (config.json, model.safetensors, tokenizer), or a Megatron-LM GPT "
        "checkpoint with --tokenizer -> a workdir",
    )
    source = imp.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--hf", type=given, metavar="DIR", help="a local Hugging Face model directory"
    )
    source.add_argument(
        "--megatron",
        type=given,
        metavar="DIR",
        help="a Megatron-LM checkpoint directory (its latest_checkpointed_iteration.txt, or one "
        "iter_N/release directory), torch format",
    )
    imp.add_argument(
        "--tokenizer",
        help="--megatron: the tokenizer it was trained with (tiktoken:gpt2, hf:PATH, "
        "wordpiece:PATH/vocab.txt, bytes); a checkpoint records none",
    )
    imp.add_argument(
        "--workdir",
        type=given,
        required=True,
        help="the new megajax workdir (must not exist, or be empty)",
    )
    imp.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a field HF does not decide, e.g. model.vocab_multiple=128 or model.scan_layers=false",
    )


def _add_export(sub):
    exp = sub.add_parser(
        "export", help="a workdir's checkpoint -> an HF directory that from_pretrained loads"
    )
    exp.add_argument("--workdir", type=given, required=True, help="the run to export")
    exp.add_argument(
        "--out",
        type=given,
        required=True,
        metavar="DIR",
        help="the new HF directory (must not exist, or be empty)",
    )
    exp.add_argument(
        "--step", type=int, help="the checkpoint to export (default: the newest that reads back)"
    )
    exp.add_argument(
        "--adapter",
        action="store_true",
        help="a LoRA run: its adapters alone, in PEFT's format (adapter_config.json, "
        "adapter_model.safetensors)",
    )
    exp.add_argument(
        "--base",
        default="",
        metavar="NAME_OR_DIR",
        help="--adapter: the base model PEFT records (base_model_name_or_path)",
    )


def _add_merge(sub):
    merge = sub.add_parser(
        "merge",
        help="a LoRA run's checkpoint with its adapters folded into the base -> an HF directory",
    )
    merge.add_argument(
        "--workdir",
        type=given,
        required=True,
        help="a LoRA run, whose adapters are folded into its base model",
    )
    merge.add_argument(
        "--out",
        type=given,
        required=True,
        metavar="DIR",
        help="the new HF directory (must not exist, or be empty)",
    )
    merge.add_argument(
        "--step", type=int, help="the checkpoint to merge (default: the newest that reads back)"
    )


def convert_main(argv=None) -> int:
    guard_stdout()
    args = convert_parser().parse_args(argv)
    # jax is imported only now, as every command line does.
    from megajax.convert import ExportNote, export_adapter, export_hf, merge_export

    warnings.simplefilter("ignore", ExportNote)  # printed below, with the other notes

    exit_on_signal(_stopped_line)
    try:
        start_jax()
        if args.direction == "import":
            cfg = _import(args)
            print(
                f"imported {args.hf or args.megatron} into {args.workdir}: {cfg.model.describe()}"
            )
        elif args.direction == "merge":
            for line in merge_export(args.workdir, args.out, args.step):
                print(line)
        else:
            if args.base and not args.adapter:
                raise UserError("--base is for --adapter: the base model PEFT records")
            export = export_adapter if args.adapter else export_hf
            kwargs = {"base": args.base} if args.adapter else {}
            for line in export(args.workdir, args.out, args.step, **kwargs):
                print(line)
    except UserError as e:
        return fail(str(e))
    except Exception as e:  # noqa: BLE001  (a full disk: one line; a bug: raised)
        return failed(e, "convert on a machine with more memory")
    sys.stdout.flush()
    return 0


def _import(args):
    from megajax.convert import import_hf, import_megatron

    if args.hf:
        if args.tokenizer:
            raise UserError(
                "--tokenizer is for --megatron: a Hugging Face directory brings its own"
            )
        return import_hf(args.hf, args.workdir, args.set)
    if not args.tokenizer:
        raise UserError(
            "--megatron needs --tokenizer: a Megatron-LM checkpoint records no tokenizer "
            "(tiktoken:gpt2 for GPT2BPETokenizer, wordpiece:PATH/vocab.txt for "
            "BertWordPieceLowerCase)"
        )
    return import_megatron(args.megatron, args.workdir, args.tokenizer, args.set)


def _stopped_line(signal_name: str) -> str:
    """What a signal leaves: the output in place whole, or nothing (its staged copy removed)."""
    written = abandon_staged()
    if written:
        return f"stopped by {signal_name} after {written[0]} was written whole"
    return (
        f"stopped by {signal_name}: nothing was written (the output appears in one rename, or not "
        "at all)"
    )
