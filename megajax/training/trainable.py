"""Which weights a run trains: every one, or with LoRA adapters (model.lora_rank) the adapters
alone. The frozen base gets no gradient (none is computed: the step differentiates the trained
part only), no optimizer state and no update; it stays bitwise as loaded. A router's balancing
bias (model.moe_bias_update_rate) is never trained either: the step moves it itself."""

from __future__ import annotations

from flax import traverse_util

from megajax.core.lora import is_adapter
from megajax.core.moe import is_router_bias


def trained(cfg, tree: dict) -> dict:
    """The trained part of a params-shaped nested dict (params, their shardings or specs)."""
    if not cfg.model.lora_rank and not cfg.model.moe_bias_update_rate:
        return tree
    keep = is_adapter if cfg.model.lora_rank else lambda k: not is_router_bias(k)
    flat = traverse_util.flatten_dict(tree)
    return traverse_util.unflatten_dict({k: v for k, v in flat.items() if keep(k)})


def with_trained(tree: dict, part: dict) -> dict:
    """`tree` with the leaves of `part` (a trained part of it) in their places."""
    if part is tree:
        return part
    flat = traverse_util.flatten_dict(tree)
    flat.update(traverse_util.flatten_dict(part))
    return traverse_util.unflatten_dict(flat)
