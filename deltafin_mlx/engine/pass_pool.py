"""The slots a pass reads its experts into while the expert cache is given back.

During a pass each expert its tokens route to is read once whatever the cache
holds (plan/memory.py pass_tokens), so the cache's memory is worth more as pass tokens: the
cache gives its slot arrays back when a pass starts (ExpertCache.release) and takes
them again, empty, when decoding resumes (decode's first token reads what it
routes to, as any miss). The pass reads into this pool instead: `slots` slots (the
memory plan's `pass_slots`, plan/memory.PASS_GROUPS), half of them computing
while the other half is read.
"""

from typing import Callable, Dict

import mlx.core as mx

from deltafin_mlx.engine.cache import alloc_aligned
from deltafin_mlx.format.dtypes import in_memory, to_numpy


class PassPool:
    def __init__(self, sections, slots: int, activation_dtype: mx.Dtype, make_inner: Callable):
        self.slots = slots
        self.arrays = {s.name: alloc_aligned((slots, *s.shape),
                                             in_memory(s.dtype, activation_dtype))
                       for s in sections}
        self.views = {name: to_numpy(a) for name, a in self.arrays.items()}
        self._make_inner = make_inner  # (layer, arrays, slots) -> mlx-lm's SwitchGLU over them
        self._inners: Dict[int, object] = {}

    def inner(self, layer: int):
        """mlx-lm's SwitchGLU of `layer` (its activation) over this pool's slots."""
        if layer not in self._inners:
            self._inners[layer] = self._make_inner(layer, self.arrays, self.slots)
        return self._inners[layer]

    def targets(self, slot: int) -> dict:
        return {name: v[slot] for name, v in self.views.items()}
