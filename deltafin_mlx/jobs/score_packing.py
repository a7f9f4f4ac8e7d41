"""Texts packed into scoring passes: as many as a pass holds, so that one sweep
over the experts (each (layer, expert) the pass routes to read once) serves all of
them.

A pass is a batch of right-padded rows, so it holds rows x its longest text tokens,
pads included; texts are taken longest first, so the texts of a pass are of
similar lengths and pads are few (and they read no experts, engine/streaming_moe).
How many tokens a pass may hold is plan/scoring.py's rule, given the longest text.
"""

from typing import Callable, List, Sequence


def pack(lengths: Sequence[int], capacity: Callable[[int], int]) -> List[List[int]]:
    """Indices into `lengths`, one list per pass, longest texts first; `capacity`
    gives the tokens a pass may hold when its longest text has that many. A text
    longer than that is a pass of its own."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    passes, current, longest, room = [], [], 0, 0
    for i in order:
        if current and (len(current) + 1) * longest > room:
            passes.append(current)
            current = []
        if not current:
            longest = lengths[i]
            room = capacity(longest)
        current.append(i)
    if current:
        passes.append(current)
    return passes
