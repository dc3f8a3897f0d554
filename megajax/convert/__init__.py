"""Checkpoints in the formats the ecosystem uses: Hugging Face GPT-2, BERT and Megatron-BERT
model directories to megajax workdirs and back (megajax/convert/hf.py), and Megatron-LM's own
GPT checkpoints to megajax workdirs (megajax/convert/megatron_ckpt.py); LoRA adapters out in
PEFT's format, or merged into their base (megajax/convert/peft.py)."""

from megajax.convert.hf import ExportNote, export_hf, import_hf
from megajax.convert.megatron_ckpt import import_megatron
from megajax.convert.peft import export_adapter, merge_export

__all__ = [
    "ExportNote",
    "export_adapter",
    "export_hf",
    "import_hf",
    "import_megatron",
    "merge_export",
]
