"""The parallel core: the ("data", "model") mesh, every PartitionSpec, the precision policy,
Megatron's tensor-parallel layers and the vocab-parallel embedding and cross-entropy."""

from megajax.host import xla_cache

xla_cache.install()
