"""The streaming MoE module that replaces mlx-lm's SwitchGLU inside the model.

Routing is data-dependent, so at each MoE layer the router's choice is evaluated
first; then the misses are read from the layer's bank (all at once, on background
threads), the next MoE layer's router is applied to this layer's input to queue
speculative reads behind them (lookahead: it changes timing only; routing always
uses the real router), and mlx-lm's own expert module (SwitchGLU, SwitchMLP) runs
over the slot arrays.

Reads ahead must pay for themselves. A right guess hides a read behind one layer's
computation, but only in disk time that would otherwise sit idle; a wrong one
spends disk time, which costs a token that much whenever the disk is the
bottleneck, and where a read outlasts a layer's computation it is still running
when the next layer routes, holding that layer's demand reads back (a read cannot
be taken back once started). So guesses are queued only while

    (chance right) x min(read time, layer computation) x (1 - disk busy share)
        > (chance wrong) x (read time x disk busy share
                            + max(read time - layer computation, 0)),

and calls spend more than STALL_FLOOR of their time waiting on reads, all
measured as the run goes: guesses stop where reads saturate the disk (a Mac's
SSD against its GPU, a throttled disk, a small cache) and run where the disk has
time to spare. Where calls rarely wait, pipelining already hides the demand reads
behind the resident experts' arithmetic, so a right guess saves almost nothing,
while every guess's read slows that memory-bound arithmetic, which the disk
terms do not see (docs/LEARNED.md has the runs). The busy share is reader time over wall time, or, where it is
higher, the recent read rate over the rate the disk delivered while calls waited
on it (a disk that banks idle time as credit serves single reads fast).
"""

import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Dict, Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from deltafin_mlx.engine.cache import CacheStats, ExpertCache
from deltafin_mlx.engine.pass_pool import PassPool
from deltafin_mlx.format.dtypes import to_numpy
from deltafin_mlx.engine.reader import Reader, ReadJob


@dataclass(frozen=True)
class StoreConfig:
    """How an expert store runs, fixed at load (from the options and the plan)."""

    experts_per_token: int
    lookahead: bool
    pipeline: bool = True
    # A prefill pass's pairs are computed in pieces of this many tokens' pairs
    # (the plan's attention chunk: what one call of a chunked prefill held).
    pass_piece_tokens: int = 512
    pass_slots: int = 0  # the pass pool's slots (engine/pass_pool.py); 0: the cache's
    release_above: int = 0  # a pass of more tokens than this gives the cache back
    final_layer: Optional[int] = None  # the last decoder layer (`logits_unread`)


class ExpertStore:
    """The expert cache, the reader it uses, the counters, and lookahead wiring.
    What changes per call is set only by the engine (`observe`, Runtime's
    `real_tokens` and `hint_logits_unread`)."""

    def __init__(self, cache: ExpertCache, config: StoreConfig,
                 switches: Dict[int, "StreamingSwitchGLU"], moe_blocks: Dict[int, nn.Module],
                 make_inner: Callable, trunk_pass=None):
        self.cache, self.reader, self.stats = cache, cache.reader, cache.stats
        self.config = config
        self.layers = cache.layers
        self.next_layer = {a: b for a, b in zip(self.layers, self.layers[1:])}
        self.moe_blocks = moe_blocks  # layer -> the block owning the router
        self.switches = switches  # layer -> its streaming module
        for switch in switches.values():
            switch._store = self
        self.make_inner = make_inner  # (layer, slot arrays, slots) -> mlx-lm's SwitchGLU over them
        self.trunk_pass = trunk_pass  # the pinned trunk layers a pass streams (PassTrunk)
        self.rates = IORates()
        self.pass_pool: Optional[PassPool] = None  # while a pass runs
        self.resuming = False  # end_pass started and was stopped before it finished
        # layer -> the experts the pass's last position routed to (each row's), the
        # cache's first guesses when decoding resumes.
        self.pass_last: Dict[int, np.ndarray] = {}
        self._route_observers, self._layer_observers = [], []  # `observe`
        self._lazy_routes = []  # per lazy call, [(layer, its routing, maybe unevaluated)]
        # A scoring pass's rows are right-padded texts: this (rows, positions) bool
        # array says which positions are real tokens (Runtime.real_tokens). Pads route
        # nowhere (no expert is read for them) and their expert outputs are zeros;
        # causal attention keeps them out of every real token's result.
        self.token_mask = None
        # The last decoder layer's MoE output reaches only the logits. When the
        # caller says nothing reads the next call's logits (mlx-lm's prefill
        # chunks, generation/stream.unread_logits_hint), that layer's experts are
        # neither read nor computed, as mlx-lm's lazy graph never computes them.
        self.logits_unread = False

    @contextmanager
    def observe(self, on_route=None, on_pass_layer=None):
        """Runtime.observe. A lazy call (every expert resident) stays lazy: its
        routing is reported once evaluated (`report_route`)."""
        added = [(hooks, f) for hooks, f in ((self._route_observers, on_route),
                                             (self._layer_observers, on_pass_layer)) if f]
        for hooks, f in added:
            hooks.append(f)
        try:
            yield self
            self._report_lazy_routes()
        finally:
            for hooks, f in added:
                hooks.remove(f)
            if not self._route_observers:
                self._lazy_routes = []

    def report_route(self, layer: int, routing, lazy: bool = False):
        """Tell the route observers a call's routing, or a `lazy` call's once the
        caller has evaluated it (no evaluation, no wait added): when the call after
        next starts (mlx-lm builds a step as the last one computes) or `observe` ends."""
        if not self._route_observers:
            return
        if not lazy:
            self._report_lazy_routes()
            for hook in list(self._route_observers):
                hook(layer, routing)
            return
        if not self._lazy_routes or layer <= self._lazy_routes[-1][-1][0]:  # a new call
            self._report_lazy_routes(keep=1)
            self._lazy_routes.append([])
        self._lazy_routes[-1].append((layer, routing))

    def _report_lazy_routes(self, keep: int = 0):
        """Report the lazy calls' routing, all but the last `keep` calls'."""
        done = self._lazy_routes[: max(len(self._lazy_routes) - keep, 0)]
        self._lazy_routes = self._lazy_routes[len(done):]
        for layer, indices in (route for call in done for route in call):
            routing = np.array(indices).astype(np.int64)
            for hook in list(self._route_observers):
                hook(layer, routing)

    def real_routing(self, idx: np.ndarray):
        """(mask, routing) of a call's real tokens: `token_mask` where it fits the
        call (a scoring pass's rows), else every token (mask None)."""
        real = self.token_mask
        if real is None or real.shape != idx.shape[:-1]:
            return None, idx
        return real, idx[real][None]

    def pass_layer_done(self, layer: int):
        """Report that a pass is done with `layer` to the `observe` blocks' listeners."""
        for hook in list(self._layer_observers):
            hook(self.layers.index(layer) + 1, len(self.layers))

    @property
    def bytes_read(self) -> int:
        return self.reader.bytes_read

    def begin_pass(self, tokens: int):
        """A pass of `tokens` tokens (pads included) starts: the cache gives its
        slot arrays back (each streaming module drops its computation over them)
        and the pass reads into a pool of `pass_slots`. Nothing to do while a pass
        runs, where the cache holds every expert (the pass then reads nothing), or
        for a pass the plan's allowance holds beside the cache (`release_above`:
        the cache's experts then serve it and the decoding after it)."""
        if self.resuming:
            self.end_pass()
        if (self.pass_pool is not None or not self.config.pass_slots
                or self.cache.all_resident or tokens <= self.config.release_above):
            return
        self.cache.release()
        self.pass_last = {}
        for switch in self.switches.values():
            switch._inner = None
        if self.trunk_pass is not None:
            self.trunk_pass.release()
        mx.clear_cache()  # the freed arrays leave MLX's buffer cache too
        layout = self.cache.banks[self.layers[0]].layout
        self.pass_pool = PassPool(layout.held_sections, self.config.pass_slots,
                                  self.cache.activation_dtype, self.make_inner)

    def end_pass(self):
        """Decoding resumes: the pass pool goes, the trunk layers the pass streamed
        are pinned again and the cache has its slots again, its first guesses the
        experts the pass's last position routed to (read behind every demand read,
        as a warm start's: consecutive tokens share many experts on a trained model's
        routing, docs/LEARNED.md)."""
        if self.pass_pool is None and not self.resuming:
            return
        # A Ctrl-C in here (the trunk's read takes seconds on K3) leaves `resuming`
        # set, and the next call finishes the job: each step can be redone.
        self.resuming = True
        self.pass_pool = None
        mx.clear_cache()
        if self.trunk_pass is not None:
            self.trunk_pass.restore()
        self.cache.restore()
        for layer, switch in self.switches.items():
            switch._inner = self.make_inner(layer, *self.cache.arrays_of(layer))
        self.resuming = False
        last, self.pass_last = self.pass_last, {}
        if self.reader.threads:  # without reader threads a guess would hold decoding up
            self.cache.warm([(layer, int(e)) for layer in self.layers
                             for e in last.get(layer, ())])


    def close(self):
        self.cache.drain()
        self.reader.close()
        if self.trunk_pass is not None:
            self.trunk_pass.close()
        for bank in self.cache.banks.values():
            bank.close()


class IORates:
    """Running estimates, per MoE layer call, of the computation between calls
    (what a read started at one call can hide behind: the time between calls less
    the time stalled on reads, since while a call stalls the disk is already busy
    with demand reads), one read's time, and the share of the time the disk is
    busy; `guesses_pay` is the rule in the module docstring."""

    SMOOTH = 0.25  # weight of the newest call in the running means
    # Guesses only while calls stall on reads for more than this share of their
    # time: below it they cost more arithmetic than the stalls they could remove
    # (compute-bound runs stall less and lose with guesses: docs/LEARNED.md).
    STALL_FLOOR = 0.25

    def __init__(self):
        self.layer_s = None
        self.read_s = None
        self.busy = 0.0
        self._wall = self._reading = self._reads = 0.0  # running sums behind `busy`
        self._stalled = 0.0  # running sum of time stalled on reads, over `_wall`
        # Reads per second the disk delivered while calls were waiting on it (so
        # it was reading flat out): what it can do, whatever single reads take.
        self.capacity = None
        self.issued, self.used = 2.0, 1.0  # recent guesses and their hits (prior 1/2)
        self._last = None  # (time, reader busy s, reads, stall s, guesses, used)

    @property
    def right(self) -> float:
        """Recent share of guesses that were used (prefill's guesses, made from
        many tokens at once, say little about decoding's)."""
        # A guess can be used calls after it was issued, so the two running sums
        # can cross.
        return min(self.used / self.issued, 1.0)

    def tick(self, reader: Reader, stats: CacheStats, now: float = None):
        """Called once per MoE layer call."""
        now = time.perf_counter() if now is None else now
        mark = (now, reader.busy_seconds, reader.reads, stats.stall_seconds,
                stats.speculative_issued, stats.speculative_used)
        if self._last is not None:
            t0, busy0, reads0, stall0, issued0, used0 = self._last
            keep = 1 - self.SMOOTH
            self.issued = keep * self.issued + (mark[4] - issued0)
            self.used = keep * self.used + (mark[5] - used0)
            if self.issued < 1.0:  # too few recent guesses to judge: back to the prior
                self.issued, self.used = self.issued + 2.0, self.used + 1.0
            wall = now - t0
            a = self.SMOOTH
            if wall > 0:
                compute = max(wall - (mark[3] - stall0), 0.0)
                self.layer_s = compute if self.layer_s is None else (1 - a) * self.layer_s + a * compute
                # Time-weighted: running reader time over running wall time. A mean
                # of per-call shares would weigh a 10 ms call with no read ending in
                # it like a 90 ms one spent reading, and call a saturated disk idle.
                # (A read is counted when it ends, perhaps a call after it ran; the
                # share is capped where it is used.)
                reading = (mark[1] - busy0) / max(reader.threads, 1)
                reads, stalled = mark[2] - reads0, mark[3] - stall0
                self._wall = (1 - a) * self._wall + a * wall
                self._reading = (1 - a) * self._reading + a * reading
                self._reads = (1 - a) * self._reads + a * reads
                self._stalled = (1 - a) * self._stalled + a * stalled
                self.busy = self._reading / self._wall
                # A disk that banks idle time as credit (a token-bucket throttle,
                # some cloud volumes) serves single reads fast and still delivers
                # no more than its rate, so reader time alone calls it idle: it is
                # as busy as its recent rate is close to what it delivers flat out.
                if stalled > 0.5 * wall and reads:
                    sample = reads / wall
                    self.capacity = sample if self.capacity is None else (
                        (1 - a) * self.capacity + a * sample)
                if self.capacity:
                    self.busy = max(self.busy, self._reads / self._wall / self.capacity)
            if mark[2] > reads0:
                per_read = (mark[1] - busy0) / (mark[2] - reads0)
                self.read_s = per_read if self.read_s is None else (1 - a) * self.read_s + a * per_read
        self._last = mark

    @property
    def stall_share(self) -> float:
        """Recent share of the time calls spent waiting on reads."""
        return self._stalled / self._wall if self._wall else 0.0

    def guesses_pay(self, right: float = None) -> bool:
        """Does a guess right with probability `right` (default: the recent
        share) pay for its disk time?"""
        right = self.right if right is None else right
        if self.layer_s is None or self.read_s is None:
            return True  # nothing measured yet: guesses also measure the disk
        if self.stall_share <= self.STALL_FLOOR:
            return False
        busy = min(self.busy, 1.0)
        gain = right * min(self.read_s, self.layer_s) * (1.0 - busy)
        # A wrong guess spends disk time the run needed, and one still being read
        # when the next layer routes (a read longer than a layer's computation)
        # holds that layer's demand reads back by what is left of it.
        late = max(self.read_s - self.layer_s, 0.0)
        cost = (1.0 - right) * (self.read_s * busy + late)
        return gain > cost


def predict_experts(moe: nn.Module, h: mx.array, k: int) -> Optional[mx.array]:
    """The experts `moe`'s router (`gate`, gpt-oss's `router`) would pick for
    hidden state `h` (lazy)."""
    gate = next((g for g in (getattr(moe, n, None) for n in ("gate", "router")) if g is not None),
                None)
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
    """Drop-in for mlx-lm's SwitchGLU or SwitchMLP: `(x, indices) -> (..., k, D)`."""

    def __init__(self, layer: int, inner):
        super().__init__()
        self._layer = layer
        self._store: Optional[ExpertStore] = None  # the store it is made for binds it
        self._inner = inner  # mlx-lm's expert module over the shared slot arrays
        self._moe_input = None  # set by the MoE block's tap, for lookahead

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        store, cache, layer = self._store, self._store.cache, self._layer
        config = store.config
        # A call of more than one token per sequence is a prefill pass (decoding,
        # even a batch's, is one token per sequence).
        per_sequence = indices.shape[-2] if indices.ndim >= 3 else indices.size // max(
            indices.shape[-1], 1)
        long_call = per_sequence > 1
        if long_call and store.logits_unread and layer == config.final_layer:
            return self._unread(x, indices)
        if long_call:
            store.begin_pass(indices.size // max(indices.shape[-1], 1))
        elif store.pass_pool is not None or store.resuming:
            store.end_pass()
        if cache.all_resident and store.token_mask is None:
            # Every expert is in memory: map ids to slots lazily, like mlx-lm
            # would index its stacked tensor, with no evaluation here. Left lazy, a
            # prefill pass's last MoE layer is never computed, as in mlx-lm (only
            # the caches are evaluated; nothing reads that layer's output).
            self._moe_input = None
            store.report_route(layer, indices, lazy=True)
            store.stats.hits += indices.size
            slots = cache.slot_maps[layer][indices]
            if not long_call or indices.ndim < 3:
                return self._inner(x, slots)
            return self._lazy_pieces(x, slots)
        nxt = store.next_layer.get(layer)
        predicted = None
        store.rates.tick(store.reader, store.stats)
        # A pass's guesses would be most of the next layer's experts, which that
        # layer reads once anyway.
        if (config.lookahead and nxt is not None and self._moe_input is not None
                and not long_call and store.rates.guesses_pay()):
            predicted = predict_experts(store.moe_blocks[nxt], self._moe_input,
                                        config.experts_per_token)
        self._moe_input = None
        mx.eval(indices, predicted) if predicted is not None else mx.eval(indices)
        idx = np.array(indices).astype(np.int64)
        real, routed = store.real_routing(idx)
        if routed.size and (routed.min() < 0 or routed.max() >= cache.num_experts):
            raise ValueError(f"layer {layer}: router chose an expert out of range")
        needed = np.unique(routed)
        tokens = routed.size // routed.shape[-1]
        store.report_route(layer, routed)

        if store.pass_pool is not None:
            return self._pass(x, idx, needed, real)
        room = cache.pool.capacity_of(layer)
        if long_call or needed.size > room:
            return self._grouped(cache, x, idx, needed, tokens, room, prefill=long_call,
                                 routed=routed, real=real)
        jobs = cache.request(layer, needed, tokens)
        if predicted is not None:
            in_use = {cache.key(layer, e) for e in needed}
            limit = cache.pool.capacity_of(nxt)
            if not cache.pool.partitioned:
                limit -= needed.size
            cache.prefetch(nxt, _by_votes(np.array(predicted)), in_use, limit=limit,
                           worth=store.rates.right)
        if jobs and config.pipeline:
            return self._pipelined(cache, x, idx, needed, jobs)
        cache.wait(jobs)
        return self._inner(x, mx.array(self._slot_map(cache, needed)[idx].astype(np.uint32)))

    def _unread(self, x, indices) -> mx.array:
        """The last layer's MoE output of a call whose logits nobody reads: zeros,
        with nothing read or computed (its routing is still reported)."""
        store = self._store
        self._moe_input = None
        store.report_route(self._layer, indices, lazy=True)  # never scoring's (no hint)
        store.pass_layer_done(self._layer)
        return mx.zeros((*indices.shape, x.shape[-1]), dtype=x.dtype)

    def _lazy_pieces(self, x, slots) -> mx.array:
        """A pass with every expert resident: SwitchGLU over pieces of at most
        `pass_piece_tokens` positions, joined, all lazy (each piece's intermediates
        are freed once its output is computed). Each row's arithmetic is the same as
        in one call, so the result is too."""
        step, n = self._store.config.pass_piece_tokens, slots.shape[-2]
        if n <= step:
            return self._inner(x, slots)
        outs = [self._inner(x[..., s : s + step, :], slots[..., s : s + step, :])
                for s in range(0, n, step)]
        return mx.concatenate(outs, axis=-3)

    def _slot_map(self, cache: ExpertCache, group) -> np.ndarray:
        """expert -> slot for the experts of `group` (others map to slot 0, unused)."""
        emap = np.zeros(cache.num_experts, dtype=np.int64)
        emap[group] = cache.slots_of(self._layer, group)
        return emap

    def _pair_outputs(self, xs, flat, k, emap, pairs, inner=None) -> mx.array:
        """mlx-lm's SwitchGLU on the (token, expert) pairs `pairs` (flat indices
        into the call's routing): one row per pair; `inner`: over the pass pool's
        slots instead of the cache's."""
        slots = mx.array(emap[flat[pairs]].astype(np.uint32)).reshape(1, -1, 1)
        rows = mx.array((pairs // k).astype(np.uint32))
        inner = self._inner if inner is None else inner
        return inner(xs[rows][None], slots).reshape(len(pairs), -1)  # (1, P, 1, D)

    def _pairs(self, cache: ExpertCache, xs, flat, k, group):
        """The pairs whose expert is in `group`, and their outputs."""
        pairs = np.nonzero(np.isin(flat, group))[0]
        return pairs, self._pair_outputs(xs, flat, k, self._slot_map(cache, group), pairs)

    @staticmethod
    def _assemble(outs, order, lead, k, size):
        inverse = np.empty(size, dtype=np.int64)
        inverse[np.concatenate(order)] = np.arange(size)
        y = mx.concatenate(outs)[mx.array(inverse.astype(np.uint32))]
        return y.reshape(*lead, k, -1)

    def _pipelined(self, cache: ExpertCache, x, idx, needed, jobs):
        """Compute while reading: the resident experts' pairs start at once (on
        MLX's stream, in the background), then each missing expert's pairs as its
        read lands. Each pair's arithmetic is the same as in one call (on MLX's
        CPU backend a pair's result does not depend on what else is in the call),
        so the result is too; `pipeline=False` keeps the single call."""
        k, lead = idx.shape[-1], idx.shape[:-1]
        flat = idx.reshape(-1)
        xs = x.reshape(-1, x.shape[-1])
        reading = [job.expert for job in jobs]
        ready = np.setdiff1d(needed, reading)
        outs, order = [], []
        if ready.size:
            pairs, y = self._pairs(cache, xs, flat, k, ready)
            mx.async_eval(y)
            outs.append(y)
            order.append(pairs)
        for job in jobs:
            cache.wait([job])
            pairs, y = self._pairs(cache, xs, flat, k, np.array([job.expert]))
            mx.async_eval(y)
            outs.append(y)
            order.append(pairs)
        return self._assemble(outs, order, lead, k, flat.size)

    def _grouped(self, cache: ExpertCache, x, idx, needed, tokens, room, prefill: bool,
                 routed=None, real=None):
        """A prefill pass (more than one token per sequence), or a call needing more
        distinct experts than the layer has slots (a big batch): every expert the
        call routes to is read at most once, in groups that fit the layer's slots
        (`_in_groups`). Held experts go first (computed before any read can evict
        them)."""
        layer = self._layer
        held = np.array([cache.pool.slot_of(layer, e) is not None for e in needed], dtype=bool)
        order = _read_order(needed, held, idx if routed is None else routed)
        misses = int((~held).sum())
        size = room if not misses else max(1, min(room // 2, -(-order.size // 2)))
        groups = [order[s : s + size] for s in range(0, order.size, size)]

        def read(i):  # never evicting the group computing meanwhile
            keep = {cache.key(layer, e) for e in groups[i - 1]} if i else ()
            return cache.request(layer, groups[i], 0 if i else tokens, keep=keep), None

        return self._in_groups(x, idx, real, groups, read,
                               lambda i, _: self._slot_map(cache, groups[i]), pass_=prefill)

    def _pass(self, x, idx, needed, real):
        """A pass's MoE layer with the cache given back (ExpertStore.begin_pass):
        each expert its real tokens route to is read once into the pass pool, half
        of the pool at a time (`_in_groups`)."""
        store, layer = self._store, self._layer
        pool, bank, stats = store.pass_pool, store.cache.banks[layer], store.stats
        half = max(1, pool.slots // 2)
        groups = [needed[s : s + half] for s in range(0, needed.size, half)]
        double = pool.slots >= 2 * half

        def read(i):  # group i into its half of the pool (the only half with one slot)
            first = (i % 2) * half if double else 0
            stats.misses += groups[i].size
            return [store.reader.submit(ReadJob(bank, int(e), pool.targets(first + j), False))
                    for j, e in enumerate(groups[i])], first

        def slot_map(i, first):
            emap = np.zeros(store.cache.num_experts, dtype=np.int64)
            emap[groups[i]] = first + np.arange(groups[i].size)
            return emap

        store.pass_last[layer] = np.unique(idx.reshape(-1, *idx.shape[-2:])[:, -1])
        return self._in_groups(x, idx, real, groups, read, slot_map, pool.inner(layer), double)

    def _in_groups(self, x, idx, real, groups, read, slot_map, inner=None, ahead=True,
                   pass_=True):
        """mlx-lm's expert module (`inner`: over the pass pool's slots) on the
        call's (token, expert) pairs, a group of experts at a time, double-buffered:
        group i computes once its reads (`read(i)` -> (jobs, handle)) have landed,
        the next group's reads running behind its arithmetic (`ahead`), or after
        it where there is room for one group only; `slot_map(i, handle)`: expert ->
        slot. The pairs are computed in pieces of at most an attention chunk's
        pairs (the memory one call of a chunked prefill takes) and written into one
        output buffer. Each pair's arithmetic is the same as in one call, so the
        result is too. Pads (`real` False) get no pairs: their outputs stay zeros."""
        k, flat = idx.shape[-1], idx.reshape(-1)
        xs = x.reshape(-1, x.shape[-1])
        real_pairs = None if real is None else np.repeat(real.reshape(-1), k)
        piece = self._store.config.pass_piece_tokens * k
        outputs = _PairOutputs(flat.size)
        jobs, handle = read(0) if groups else ([], None)
        for i, group in enumerate(groups):
            self._store.cache.wait(jobs)
            current, last = handle, i + 1 == len(groups)
            if ahead and not last:
                jobs, handle = read(i + 1)
            emap, chosen = slot_map(i, current), np.isin(flat, group)
            pairs = np.nonzero(chosen if real_pairs is None else chosen & real_pairs)[0]
            for s in range(0, pairs.size, piece):
                part = pairs[s : s + piece]
                outputs.write(part, self._pair_outputs(xs, flat, k, emap, part, inner))
            if not ahead and not last:
                jobs, handle = read(i + 1)
        out = outputs.array(x)
        if pass_:
            # A pass allocates arrays of many sizes; MLX keeps freed ones for reuse,
            # which at a pass's sizes would hold memory the plan does not count.
            mx.clear_cache()
            self._store.pass_layer_done(self._layer)
        return out.reshape(*idx.shape[:-1], k, -1)


class _PairOutputs:
    """One buffer for a call's (token, expert) pair outputs, written a piece at a
    time through a zero-copy view (allocated at the first piece, when the output
    width and dtype are known)."""

    def __init__(self, size: int):
        self.size, self.out, self.view = size, None, None

    def write(self, part: np.ndarray, y: mx.array):
        mx.eval(y)
        if self.out is None:
            self.out = mx.zeros((self.size, y.shape[-1]), dtype=y.dtype)
            mx.eval(self.out)
            self.view = to_numpy(self.out)
        self.view[part] = to_numpy(y)

    def array(self, x: mx.array) -> mx.array:
        """The outputs (a call with no real token: every output a pad's zeros)."""
        if self.out is None:
            return mx.zeros((self.size, x.shape[-1]), dtype=x.dtype)
        return self.out


def _read_order(needed: np.ndarray, held: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """The order a grouped call reads and computes its experts in: those already
    held first, then the rest by the last position that uses them, so that what the
    cache keeps at the end of a pass is what its last tokens used (the next token
    shares about a third of them)."""
    positions = np.broadcast_to(np.arange(idx.shape[-2])[:, None], idx.shape[-2:])
    last_use = np.full(int(needed.max()) + 1, -1)
    np.maximum.at(last_use, idx.reshape(-1), np.broadcast_to(positions, idx.shape).reshape(-1))
    missing = needed[~held]
    return np.concatenate([needed[held], missing[np.argsort(last_use[missing], kind="stable")]])


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
