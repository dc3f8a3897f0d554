"""python -m megajax TOOL [ARGS]: megajax's command lines from a checkout, without installing
(`pip install .` also names them megajax-TOOL; train.py and eval.py are the first two)."""

import sys

TOOLS = {
    "train": "train.py: train a GPT, BERT or Llama-family model, or fine-tune one",
    "eval": "eval.py: perplexity, LAMBADA, fine-tuned tasks, chat, samples",
    "plan": "megajax-plan: memory, step time and MFU of every way to run a config",
    "convert": "megajax-convert: Hugging Face and Megatron-LM checkpoints in and out",
    "prepare": "megajax-prepare: corpora tokenized once, for --data bin:DIR",
    "plot": "megajax-plot: a workdir's loss curve",
}


def main():
    listing = "usage: python -m megajax TOOL [ARGS], TOOL one of:\n" + "\n".join(
        f"  {name:<8} {what}" for name, what in TOOLS.items()
    )
    if len(sys.argv) > 1 and sys.argv[1] in ("-h", "--help"):
        print(listing)
        sys.exit(0)
    if len(sys.argv) < 2:
        print(listing, file=sys.stderr)
        sys.exit(2)
    if sys.argv[1] not in TOOLS:
        print(
            f"error: unknown tool '{sys.argv[1]}' (python -m megajax TOOL: {', '.join(TOOLS)})",
            file=sys.stderr,
        )
        sys.exit(2)
    tool = sys.argv.pop(1)
    sys.argv[0] = f"megajax-{tool}"
    if tool == "plot":
        from megajax.cli.plot import plot_command

        sys.exit(plot_command())
    import megajax.cli as cli

    getattr(cli, f"{tool}_command")()


main()
