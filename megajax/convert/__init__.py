"""Checkpoints in the formats the ecosystem uses: Hugging Face GPT-2, BERT and Megatron-BERT
model directories to megajax workdirs and back (megajax/convert/hf.py), and Megatron-LM's own
GPT checkpoints to megajax workdirs (megajax/convert/megatron_ckpt.py)."""
from megajax.convert.hf import export_hf, import_hf
from megajax.convert.megatron_ckpt import import_megatron

__all__ = ["export_hf", "import_hf", "import_megatron"]
