"""Texts packed into scoring passes: as many as a pass holds, so that one sweep
over the experts (each (layer, expert) the pass routes to read once) serves all of
them.

A pass is a batch of right-padded rows, so it holds rows x its longest text tokens,
pads included; texts are taken longest first, so the texts of a pass are of
similar lengths and pads are few (and they read no experts, engine/streaming_moe).
How many tokens a pass may hold is plan/scoring.py's rule, given the longest text.
"""

from typing import Callable, Hashable, List, Optional, Sequence


def pack(lengths: Sequence[int], capacity: Callable[[int], int],
         groups: Optional[Sequence[Hashable]] = None) -> List[List[int]]:
    """Indices into `lengths`, one list per pass, longest texts first; `capacity`
    gives the tokens a pass may hold when its longest text has that many. A text
    longer than that is a pass of its own. `groups`: a key per text (lm-eval's
    choices of one context): a group's texts are taken one after another, so they
    share passes, the groups longest first."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    if groups is not None:
        first = {}  # group -> its rank: where its longest text comes in `order`
        for rank, i in enumerate(order):
            first.setdefault(groups[i], rank)
        order.sort(key=lambda i: first[groups[i]])  # stable: longest first within a group
    passes, current, longest = [], [], 0
    for i in order:
        wider = max(longest, lengths[i])
        if current and (len(current) + 1) * wider > capacity(wider):
            passes.append(current)
            current, wider = [], lengths[i]
        current.append(i)
        longest = wider
    if current:
        passes.append(current)
    return passes
