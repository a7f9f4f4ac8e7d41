"""The expert cache: one pool of fixed-shape slots shared by every MoE layer.

A slot holds one expert of any layer (all layers' records have the same layout;
where mlx-lm's mixed_* recipes lay layers out differently, the pool is partitioned
by layer and each chunk of slots holds layers of one layout):
every section of its record in an MLX array of shape `(capacity, *section_shape)`,
allocated once and reused, so `gather_qmm` reads experts through an
expert -> slot index and nothing is stacked or copied per token. One pool, not one
per layer, so that a small budget needs room for only one layer's experts at a time
and a large one goes where the traffic is.

Reads write into the slot arrays through zero-copy numpy views (`np.asarray` of an
evaluated array), and MLX tracks no dependency on such writes, so a slot is only
written when no pending computation can read it: a layer's computation is evaluated
before the next layer's router (whose input depends on it), the experts of the call
in flight are protected from eviction, and so are slots that reads are filling.
"""

import copy
import time
from dataclasses import dataclass
from typing import Dict, List

import mlx.core as mx
import numpy as np
import mlx.nn as nn
from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchLinear

from deltafin_mlx.format.bank import ALIGN
from deltafin_mlx.format.record import FLOAT_MODE, input_size, linear_quant, record_linears
from deltafin_mlx.engine.policy import ExpertPool
from deltafin_mlx.format.dtypes import in_memory, to_numpy
from deltafin_mlx.plan.slots import MAX_ELEMENTS, max_slots, pool_chunks
from deltafin_mlx.engine.reader import BankFile, ReadCancelled, ReadJob, Reader


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    speculative_issued: int = 0
    speculative_used: int = 0
    speculative_cancelled: int = 0  # dropped unread: their layer chose otherwise
    stall_seconds: float = 0.0

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0


def alloc_aligned(shape, dtype: mx.Dtype) -> mx.array:
    """An MLX array whose data starts 4096-aligned (O_DIRECT reads land in it).

    The flat allocation is made in `dtype` itself, not in bytes, so that arrays
    up to MAX_ELEMENTS elements (8 GB of uint32 weights) fit MLX's int32 shapes.
    """
    n = int(np.prod(shape))
    if n > MAX_ELEMENTS:
        raise ValueError(f"slot array of {n} elements exceeds MLX's limit of {MAX_ELEMENTS}")
    raw = mx.zeros((n + ALIGN // dtype.size,), dtype=dtype)
    mx.eval(raw)
    off = (-to_numpy(raw).ctypes.data) % ALIGN
    if off % dtype.size:  # never seen: MLX buffers are at least 8-aligned
        arr = mx.zeros(shape, dtype=dtype)  # reads then go through the staging buffer
    else:
        arr = raw[off // dtype.size : off // dtype.size + n].reshape(shape)
    mx.eval(arr)
    return arr


def switch_over_slots(arrays: Dict[str, mx.array], capacity: int, quant: dict,
                      original: nn.Module) -> nn.Module:
    """mlx-lm's own routed-expert module (`original`'s class, activation and
    settings: SwitchGLU, SwitchMLP, with or without per-expert biases) over the
    slots instead of all experts: the arithmetic is exactly mlx-lm's, only the
    indices are slot numbers. (Random initial weights are lazy, never evaluated.)"""
    inner = copy.copy(original)
    for name, have in record_linears(arrays).items():
        shape = arrays[f"{name}.weight"].shape[1:]
        q = linear_quant(quant, name)
        if q["mode"] == FLOAT_MODE:
            lin = SwitchLinear(shape[1], shape[0], capacity, bias=False)
        else:
            lin = QuantizedSwitchLinear(input_size(q, shape), shape[0], capacity, False,
                                        q["group_size"], q["bits"], mode=q["mode"])
        for kind in have:
            lin[kind] = arrays[f"{name}.{kind}"]
        if "biases" not in have and q["mode"] != FLOAT_MODE:
            lin.biases = None
        inner[name] = lin
    return inner


class ExpertCache:
    """The slot pool, its policy (keyed by (layer, expert)) and reads in flight."""

    def __init__(self, banks: Dict[int, BankFile], capacity: int, num_experts: int,
                 experts_per_token: int, activation_dtype: mx.Dtype, reader: Reader,
                 stats: CacheStats):
        self.banks = banks
        self.layers = sorted(banks)
        self.capacity = capacity
        self.num_experts = num_experts
        self.reader = reader
        self.stats = stats
        # Layers whose records are laid out alike (all of them but with mlx-lm's
        # mixed_* recipes); the pool lists each group's layers together, so that a
        # partitioned pool's chunks can be cut at group boundaries.
        groups: Dict[tuple, list] = {}
        for layer in self.layers:
            groups.setdefault(tuple(banks[layer].layout.held_sections), []).append(layer)
        self.pool_order = [layer for group in groups.values() for layer in group]
        self.pool = ExpertPool(capacity, num_experts, self.pool_order, experts_per_token)
        self.slot_key = [None] * capacity  # slot -> (layer, expert)
        self.pending: Dict[tuple, ReadJob] = {}  # (layer, expert) -> read in flight
        self.fresh_speculative = set()  # keys read ahead and not yet demanded
        self.all_resident = False  # set by preload_all
        # A warm start's reads (a previous run's hot set) not yet demanded, and per
        # partition the order they were queued in: the last queued, least valuable
        # and least likely started, is the first given up when a miss needs a slot.
        self.warming = set()
        self._warm_order: Dict[object, list] = {}
        self.warm_issued = 0
        self.slot_maps = {}

        self.experts_per_token = experts_per_token
        self.activation_dtype = activation_dtype
        self.released = False  # the slot arrays given back for a pass (`release`)
        limits = [(len(g), max_slots(s, activation_dtype)) for s, g in groups.items()]
        self.chunks = pool_chunks(capacity, len(self.layers), experts_per_token, num_experts,
                                  limits[0][1], limits if len(limits) > 1 else None)
        share = self.pool.capacity_of(self.layers[0])  # a partition (or the whole pool)
        self.chunk_sections = [banks[self.pool_order[first // share]].layout.held_sections
                               for first, _ in self.chunks]
        self._allocate()
        self._chunk_of_slot = np.repeat(np.arange(len(self.chunks)),
                                        [size for _, size in self.chunks])
        self.layer_chunk = {}  # layer -> its chunk, when there are several
        if len(self.chunks) > 1:
            for layer in self.layers:
                first = self.pool.offset[layer]
                self.layer_chunk[layer] = int(self._chunk_of_slot[first])

    def _allocate(self):
        self.chunk_arrays, self.chunk_views = [], []
        for (_, size), sections in zip(self.chunks, self.chunk_sections):
            arrays = {s.name: alloc_aligned((size, *s.shape),
                                            in_memory(s.dtype, self.activation_dtype))
                      for s in sections}  # a rank's slice under tensor parallelism
            self.chunk_arrays.append(arrays)
            self.chunk_views.append({name: to_numpy(a) for name, a in arrays.items()})
        # With one chunk (every pool up to 27 GB of K3 experts) these are the pool.
        self.arrays, self.views = self.chunk_arrays[0], self.chunk_views[0]

    def release(self):
        """Give the slot arrays' memory back for a pass (plan/memory.py pass_tokens: during a
        pass each expert is read once whatever the cache holds, so its memory is
        worth more as pass tokens): every read in flight is waited out or dropped,
        the pool starts empty and the arrays are dropped (the streaming modules
        drop their computations over them: ExpertStore.begin_pass)."""
        self.cancel_warm()
        self.drain()
        self.pool = ExpertPool(self.capacity, self.num_experts, self.pool_order,
                               self.experts_per_token)
        self.slot_key = [None] * self.capacity
        self.fresh_speculative.clear()
        self.warming.clear()
        self._warm_order.clear()
        self.chunk_arrays = self.chunk_views = []
        self.arrays = self.views = None
        self.released = True

    def restore(self):
        """The slot arrays again, empty, after a pass (`release`)."""
        self._allocate()
        self.released = False

    def arrays_of(self, layer: int):
        """(slot arrays, slots) of the chunk holding `layer`'s experts."""
        c = self.layer_chunk.get(layer, 0)
        return self.chunk_arrays[c], self.chunks[c][1]

    def key(self, layer: int, expert: int) -> tuple:
        return (layer, int(expert))

    def _targets(self, slot: int):
        c = int(self._chunk_of_slot[slot])
        local = slot - self.chunks[c][0]
        return {name: v[local] for name, v in self.chunk_views[c].items()}

    def _assign(self, key: tuple, slot: int):
        old = self.slot_key[slot]
        if old is not None:
            self.fresh_speculative.discard(old)
        self.slot_key[slot] = key

    def request(self, layer: int, experts: np.ndarray, tokens: int, keep=()) -> List[ReadJob]:
        """Start reads for the misses among `experts` of `layer` (at most
        `capacity` distinct experts) for a call routing `tokens` tokens (0 for
        a later group of the same call), never evicting the keys in `keep` (a
        group still computing); returns the reads to wait for."""
        keys = [self.key(layer, e) for e in experts]
        self.pool.use(layer, experts, tokens)
        wanted = set(keys)
        if tokens:
            self._cancel_stale(layer, wanted)
        protected = wanted | set(self.pending) | set(keep)
        jobs = []
        for key, e in zip(keys, experts):
            if key in self.warming:
                self.warming.discard(key)
                job = self.pending.get(key)
                if job is not None and self.reader.cancel(job):
                    # Its warm read has not started, and guesses queue behind one
                    # another: read it now as a demand read (a miss), into its slot.
                    self.stats.misses += 1
                    jobs.append(self._read(layer, e, self.pool.slot_of(layer, e), False))
                    continue
            if key in self.pending:
                jobs.append(self.pending[key])
            if self.pool.slot_of(layer, e) is not None:
                self.stats.hits += 1
                if key in self.fresh_speculative:
                    self.fresh_speculative.discard(key)
                    self.stats.speculative_used += 1
                continue
            self.stats.misses += 1
            if self.warming and not self.pool.has_free(layer):
                # An unread warm-start guess costs nothing to give up; an expert
                # already read (or used this run) does.
                self._yield_warm(layer)
            try:
                slot = self.pool.place(layer, e, protected)
            except RuntimeError:
                # Every other slot is being filled by a speculative read: drop
                # the guesses (or let them finish), then there is room.
                self._retire_speculation(keep=wanted)
                protected = wanted | set(self.pending) | set(keep)
                try:
                    slot = self.pool.place(layer, e, protected)
                except RuntimeError:
                    self._retire_speculation(keep=wanted, warm=True)
                    protected = wanted | set(self.pending) | set(keep)
                    slot = self.pool.place(layer, e, protected)
            jobs.append(self._read(layer, e, slot, False))
        return jobs

    def _read(self, layer: int, e, slot: int, speculative: bool) -> ReadJob:
        """Start reading `layer`'s expert `e` into `slot`."""
        key = self.key(layer, e)
        self._assign(key, slot)
        job = ReadJob(self.banks[layer], int(e), self._targets(slot), speculative=speculative)
        self.pending[key] = job
        return self.reader.submit(job)

    def prefetch(self, layer: int, experts: np.ndarray, in_use: set, limit: int, worth: float):
        """Queue speculative reads for `layer`'s predicted experts, never evicting
        what the call in flight uses (`in_use`, keys) or reads are filling;
        `worth`: the chance a guess is right (streaming_moe.IORates.right)."""
        protected = set(self.pending) | in_use
        issued = 0
        for e in experts:
            if issued >= limit:
                break
            key = self.key(layer, e)
            if self.pool.slot_of(layer, e) is not None:
                continue
            slot = self.pool.place(layer, e, protected, speculative=True, worth=worth)
            if slot is None:
                continue
            self._read(layer, e, slot, True)
            self.fresh_speculative.add(key)
            protected.add(key)
            issued += 1
        self.stats.speculative_issued += issued

    def _cancel_stale(self, layer: int, wanted: set):
        """This layer's router has chosen: its guesses that it did not choose and
        that no reader has started are dropped, so they spend no disk time, and
        their slots are free again at once (nothing will write them)."""
        for key, job in list(self.pending.items()):
            if (job.speculative and key[0] == layer and key not in wanted
                    and key not in self.warming and self.reader.cancel(job)):
                del self.pending[key]
                slot = self.pool.slot_of(*key)
                self.pool.evict(*key)
                self.fresh_speculative.discard(key)
                self.stats.speculative_cancelled += 1
                if slot is not None:
                    self.slot_key[slot] = None

    def _retire_speculation(self, keep, warm: bool = False):
        """Cancel or wait out the guesses not in `keep`. Unstarted warm-start reads
        are left alone unless `warm` (`_yield_warm` has already given up those of
        the partition short of a slot)."""
        for key, job in list(self.pending.items()):
            if job.speculative and key not in keep:
                if key in self.warming and not warm and not job.started:
                    continue
                job.cancelled = True
                job.done.wait()
        self.collect()

    def warm(self, keys) -> int:
        """Queue reads of a previous run's hot set, `keys` ((layer, expert), most
        valuable first), as guesses behind every demand read, each into a free slot
        only (a guess never evicts; nothing is in flight at load anyway). Returns
        how many were queued."""
        issued, protected = 0, set(self.pending)
        for layer, e in keys:
            if self.pool.slot_of(layer, e) is not None:
                continue
            slot = self.pool.place(layer, e, protected, speculative=True)
            if slot is None:
                continue  # its partition is full
            key = self.key(layer, e)
            protected.add(key)
            self._read(layer, e, slot, True)
            self.warming.add(key)
            self._warm_order.setdefault(self._partition(layer), []).append(key)
            issued += 1
        self.warm_issued += issued
        return issued

    def _partition(self, layer):
        return layer if self.pool.partitioned else None

    def _drop_warm(self, key) -> bool:
        """Give up `key`'s warm read if no thread has taken it: its slot is free."""
        job = self.pending.get(key)
        if job is None or not self.reader.cancel(job):
            return False
        del self.pending[key]
        self.warming.discard(key)
        slot = self.pool.slot_of(*key)
        self.pool.evict(*key)
        if slot is not None:
            self.slot_key[slot] = None
        return True

    def _yield_warm(self, layer) -> bool:
        """Free a slot for `layer` by giving up its partition's last queued,
        unstarted warm read."""
        queued = self._warm_order.get(self._partition(layer), [])
        while queued:
            key = queued.pop()
            if key in self.warming and self._drop_warm(key):
                return True
        return False

    def cancel_warm(self) -> list:
        """Give up every warm read no thread has taken (closing: they would only
        delay it); returns their keys, each partition's in the order they were queued."""
        dropped = []
        for queued in self._warm_order.values():
            dropped.extend(key for key in queued if key in self.warming and self._drop_warm(key))
            queued.clear()
        return dropped

    def wait(self, jobs: List[ReadJob]):
        start = time.perf_counter()
        try:
            for job in jobs:
                job.done.wait()
        finally:
            self.stats.stall_seconds += time.perf_counter() - start
        self.collect()
        for job in jobs:
            if job.error is not None and not isinstance(job.error, ReadCancelled):
                raise job.error

    def collect(self):
        """Retire finished reads; a failed or cancelled one leaves its slot empty."""
        for key, job in list(self.pending.items()):
            if job.done.is_set():
                del self.pending[key]
                self.warming.discard(key)
                if job.error is not None:
                    slot = self.pool.slot_of(*key)
                    self.pool.evict(*key)
                    self.fresh_speculative.discard(key)
                    if slot is not None:
                        self.slot_key[slot] = None

    def drain(self):
        """Wait for every read in flight."""
        for job in list(self.pending.values()):
            job.done.wait()
        self.collect()

    def slots_of(self, layer: int, experts: np.ndarray) -> np.ndarray:
        """The slot of each of `layer`'s (resident) `experts`, counted within the
        chunk holding the layer (`arrays_of`): the index its computation uses."""
        first = self.chunks[self.layer_chunk.get(layer, 0)][0]
        return np.array([self.pool.slot_of(layer, e) - first for e in experts], dtype=np.int64)

    def preload_all(self, progress=None):
        """With room for every expert: read them all now, in file order, and switch
        to the lazy path (no per-layer evaluation, no bookkeeping per token)."""
        assert self.capacity >= len(self.layers) * self.num_experts
        jobs = []
        for layer in self.layers:
            for e in range(self.num_experts):
                if self.pool.slot_of(layer, e) is None:
                    jobs.append(self._read(layer, e, self.pool.place(layer, e), False))
        for i, job in enumerate(jobs):
            job.done.wait()
            if progress is not None:
                progress(i + 1, len(jobs))
        self.collect()
        for job in jobs:
            if job.error is not None:
                raise job.error
        self.slot_maps = {
            layer: mx.array(self.slots_of(layer, np.arange(self.num_experts)).astype(np.uint32))
            for layer in self.layers
        }
        self.all_resident = True

    def resident(self):
        """{(layer, expert): slot} for every resident expert."""
        return self.pool.resident()
