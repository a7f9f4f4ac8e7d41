"""The runtime state of a loaded model: its directory, memory plan, expert store
(cache, reader, counters) and trunk streamer, and the one way to reach it.

`load` attaches it to mlx-lm's model object; `runtime(model)` is the public
accessor, so nothing outside the engine depends on where it is kept.
"""

from contextlib import contextmanager
from typing import Optional

from deltafin_mlx.engine.streaming_moe import ExpertStore
from deltafin_mlx.engine.trunk_stream import TrunkStreamer
from deltafin_mlx.engine.wired import unwire
from deltafin_mlx.format.model_dir import ModelDir
from deltafin_mlx.plan.memory import MemoryPlan

_ATTRIBUTE = "_deltafin"  # on mlx-lm's model (and the drop-in's wrapper)


class Runtime:
    def __init__(self, model_dir: ModelDir, plan: MemoryPlan, store: ExpertStore,
                 trunk: Optional[TrunkStreamer] = None, group=None, hot_set=None,
                 inventory=None, reader_threads: int = 1, activation_dtype=None):
        self.model_dir = model_dir
        self.manifest = model_dir.manifest
        self.plan = plan
        self.store = store
        self.trunk = trunk
        self.group = group  # the tensor-parallel group, None in one process
        self.hot_set = hot_set  # engine/hot_set.HotSet, None without a warm start
        # What the plan was made from (plan/footprint.Inventory) and with: a re-plan
        # (a conversation's context growing) starts from them.
        self.inventory = inventory
        self.reader_threads = reader_threads
        self.activation_dtype = activation_dtype  # what the plan was made for
        self._closed = False
        self.wired_previous = None  # the wired limit load replaced (engine/wired.py)

    @property
    def stats(self):
        """Expert cache hits, misses, speculative reads and stalls so far."""
        return self.store.stats

    @property
    def trunk_bytes_read(self) -> int:
        """Trunk bytes read since load: the streamed layers', and the pinned layers'
        that passes streamed (engine/trunk_pass.py)."""
        passes = self.store.trunk_pass
        return ((self.trunk.bytes_read if self.trunk is not None else 0)
                + (passes.bytes_read if passes is not None else 0))

    @property
    def cache(self):
        return self.store.cache

    def observe(self, on_route=None, on_pass_layer=None):
        """A `with` block within which `on_route(layer, routing (numpy, (..., k)))`
        hears each MoE layer call and `on_pass_layer(MoE layers done, of)` each MoE
        layer a pass finishes; observing changes nothing computed or read."""
        return self.store.observe(on_route, on_pass_layer)

    @contextmanager
    def real_tokens(self, real):
        """A `with` block within which a call of (rows, positions) of `real`'s shape
        (a scoring pass's right-padded rows) routes only `real`'s positions."""
        previous, self.store.token_mask = self.store.token_mask, real
        try:
            yield
        finally:
            self.store.token_mask = previous

    def hint_logits_unread(self, unread: bool):
        """Nobody reads the next call's logits (ExpertStore.logits_unread): until False."""
        self.store.logits_unread = bool(unread)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    @property
    def is_primary(self) -> bool:
        """Rank 0 under mlx.launch (or the only process): the one that reports."""
        return self.group is None or self.group.rank() == 0

    def close(self):
        """Save the cache's hot set for the next load (with a warm start), stop the
        reader threads and close the banks (the model is unusable after). Closing
        twice does nothing."""
        if self._closed:
            return
        self._closed = True
        try:
            if self.hot_set is not None:
                self.hot_set.save()
        finally:
            self.store.close()
            if self.trunk is not None:
                self.trunk.close()
            unwire(self.wired_previous)


def attach(model, state: Runtime):
    setattr(model, _ATTRIBUTE, state)


def find_runtime(model) -> Optional[Runtime]:
    """The model's runtime state, or None for a model Deltafin did not load."""
    return getattr(model, _ATTRIBUTE, None)


def runtime(model) -> Runtime:
    """The runtime state of a model `deltafin_mlx.load` returned: `.stats`
    (counters), `.plan` (the memory plan), `.cache`, `.store`, `.observe(...)`,
    `.close()`; as a `with` block it closes on exit."""
    state = find_runtime(model)
    if state is None:
        raise TypeError(f"{type(model).__name__} was not loaded by deltafin_mlx.load")
    return state
