"""The smallest memory budget a converted model runs in (the memory plan's
floor), from its manifest alone: what `deltafin-run list` shows for each model."""

from deltafin_mlx.plan.footprint import inventory_from_manifest
from deltafin_mlx.plan.memory import plan_memory

UNBOUNDED = 1 << 60  # a budget every model fits: its plan still states the floor


def floor_bytes(model_dir, activation_dtype, context: int = 4096) -> int:
    """The floor of the opened `model_dir` at `context` tokens for one sequence,
    with activations in `activation_dtype`."""
    inv = inventory_from_manifest(model_dir.manifest, model_dir.config, activation_dtype)
    return plan_memory(inv, UNBOUNDED, context=context).floor
