"""Which weights a run trains: every one, or with LoRA adapters (model.lora_rank) the adapters
alone. The frozen base gets no gradient (none is computed: the step differentiates the trained
part only), no optimizer state and no update; it stays bitwise as loaded."""

from __future__ import annotations

from flax import traverse_util

from megajax.core.lora import is_adapter


def trained(cfg, tree: dict) -> dict:
    """The trained part of a params-shaped nested dict (params, their shardings or specs)."""
    if not cfg.model.lora_rank:
        return tree
    flat = traverse_util.flatten_dict(tree)
    return traverse_util.unflatten_dict({k: v for k, v in flat.items() if is_adapter(k)})


def with_trained(tree: dict, part: dict) -> dict:
    """`tree` with the leaves of `part` (a trained part of it) in their places."""
    if part is tree:
        return part
    flat = traverse_util.flatten_dict(tree)
    flat.update(traverse_util.flatten_dict(part))
    return traverse_util.unflatten_dict(flat)
