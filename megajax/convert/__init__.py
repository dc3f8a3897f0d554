"""Checkpoints in the formats the ecosystem uses: Hugging Face GPT-2, BERT and Megatron-BERT
model directories to megajax workdirs and back (megajax/convert/hf.py)."""
from megajax.convert.hf import export_hf, import_hf

__all__ = ["export_hf", "import_hf"]
