"""Deltafin's resident arrays wired, as mlx-lm's `wired_limit` wires a model's: on
Metal (a device that reports a recommended working set) the wired limit is raised
while a model is loaded, so that the trunk, the expert cache and the KV/state are
not paged out between steps, and put back when the model is closed. It is the
plan's budget, never past the working set (plan/memory.default_budget keeps the
budget within it too). Elsewhere nothing is wired.
"""

from typing import Optional

import mlx.core as mx

from deltafin_mlx.plan import memory

set_wired_limit = getattr(mx, "set_wired_limit", None)  # the seam's other half


def wire(budget: int) -> Optional[int]:
    """Wire up to `budget` bytes; the limit it replaced, or None where nothing was
    wired."""
    limit = memory.working_set()
    if not limit or set_wired_limit is None:
        return None
    return set_wired_limit(min(int(budget), limit))


def unwire(previous: Optional[int]):
    if previous is not None and set_wired_limit is not None:
        set_wired_limit(previous)
