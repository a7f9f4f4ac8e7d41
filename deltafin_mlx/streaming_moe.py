"""The streaming MoE module that replaces mlx-lm's SwitchGLU inside the model.

Routing is data-dependent, so at each MoE layer the router's choice is evaluated
first; then the misses are read from the layer's bank (all at once, in background
threads), the next MoE layer's router is applied to this layer's input to queue
speculative reads behind them (lookahead: it changes timing only; routing always
uses the real router), and mlx-lm's own SwitchGLU runs over the slot arrays.
"""

from typing import Dict, List, Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .cache import CacheStats, LayerCache
from .reader import Reader


class ExpertStore:
    """Every MoE layer's cache, the reader they share, and the counters."""

    def __init__(self, caches: Dict[int, LayerCache], reader: Reader, stats: CacheStats,
                 experts_per_token: int, lookahead: bool):
        self.caches = caches
        self.reader = reader
        self.stats = stats
        self.k = experts_per_token
        self.lookahead = lookahead
        self.layers = sorted(caches)
        self.next_layer = {a: b for a, b in zip(self.layers, self.layers[1:])}
        self.moe_blocks: Dict[int, nn.Module] = {}  # layer -> the block owning the router

    @property
    def bytes_read(self) -> int:
        return self.reader.bytes_read

    def close(self):
        for c in self.caches.values():
            c.drain()
        self.reader.close()
        for c in self.caches.values():
            c.bank.close()


def predict_experts(moe: nn.Module, h: mx.array, k: int) -> Optional[mx.array]:
    """The experts `moe`'s router would pick for hidden state `h` (lazy)."""
    gate = getattr(moe, "gate", None)
    if gate is None:
        return None
    out = gate(h)
    if isinstance(out, tuple):  # DeepSeek-style gates return (indices, scores)
        return out[0]
    scores = out.astype(mx.float32)
    bias = getattr(moe, "e_score_correction_bias", None)
    if bias is not None:
        scores = mx.sigmoid(scores) + bias.astype(mx.float32)
    return mx.argpartition(-scores, kth=k - 1, axis=-1)[..., :k]


class StreamingSwitchGLU(nn.Module):
    """Drop-in for mlx-lm's SwitchGLU: `(x, indices) -> (..., k, D)`."""

    def __init__(self, layer: int, store: ExpertStore, activation):
        super().__init__()
        self.activation = activation
        self._layer = layer
        self._store = store
        self._moe_input = None  # set by the MoE block's tap, for lookahead

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        store = self._store
        cache = store.caches[self._layer]
        nxt = store.next_layer.get(self._layer)
        predicted = None
        if store.lookahead and nxt is not None and self._moe_input is not None:
            predicted = predict_experts(store.moe_blocks[nxt], self._moe_input, store.k)
        self._moe_input = None
        if predicted is not None:
            mx.eval(indices, predicted)
        else:
            mx.eval(indices)
        idx = np.array(indices).astype(np.int64)
        if idx.size and (idx.min() < 0 or idx.max() >= cache.num_experts):
            raise ValueError(f"layer {self._layer}: router chose an expert out of range")
        needed = np.unique(idx)

        if needed.size <= cache.capacity:
            jobs = cache.request(needed)
            if predicted is not None:
                order = _by_votes(np.array(predicted))
                store.caches[nxt].prefetch(order, limit=store.caches[nxt].capacity)
            cache.wait(jobs)
            emap = cache.slot_map()
            slots = mx.array(emap[idx].astype(np.uint32))
            return cache.inner(x, slots)
        return self._chunked(cache, x, idx, needed)

    def _chunked(self, cache: LayerCache, x, idx, needed):
        """More distinct experts than slots (a long prompt, a big batch): run the
        (token, expert) pairs in groups of experts that fit, each evaluated before
        the next group's reads reuse the slots. Each pair's arithmetic is the same
        as in one call, so the result is too."""
        k = idx.shape[-1]
        lead = idx.shape[:-1]
        flat = idx.reshape(-1)
        xs = x.reshape(-1, x.shape[-1])
        outs, order = [], []
        for start in range(0, needed.size, cache.capacity):
            group = needed[start : start + cache.capacity]
            pairs = np.nonzero(np.isin(flat, group))[0]
            cache.wait(cache.request(group))
            emap = cache.slot_map()
            slots = mx.array(emap[flat[pairs]].astype(np.uint32)).reshape(1, -1, 1)
            tokens = mx.array((pairs // k).astype(np.uint32))
            y = cache.inner(xs[tokens][None], slots)  # (1, P, 1, D)
            mx.eval(y)
            outs.append(y.reshape(len(pairs), -1))
            order.append(pairs)
        inverse = np.empty(flat.size, dtype=np.int64)
        inverse[np.concatenate(order)] = np.arange(flat.size)
        y = mx.concatenate(outs)[mx.array(inverse.astype(np.uint32))]
        return y.reshape(*lead, k, -1)


def _by_votes(predicted: np.ndarray) -> np.ndarray:
    """Predicted experts, most-voted first (over all tokens of the call)."""
    ids, counts = np.unique(predicted.reshape(-1), return_counts=True)
    return ids[np.argsort(-counts, kind="stable")]


def tap_moe_input(moe: nn.Module, switch: StreamingSwitchGLU):
    """Make `moe` hand its input to `switch` (for lookahead) without renaming any
    parameter: the instance gets a subclass whose __call__ records the input."""
    base = type(moe)

    def __call__(self, x, *args, **kwargs):
        switch._moe_input = x
        return base.__call__(self, x, *args, **kwargs)

    moe.__class__ = type(f"Tapped{base.__name__}", (base,), {"__call__": __call__})
