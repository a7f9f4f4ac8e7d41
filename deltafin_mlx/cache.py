"""The expert cache: one pool of fixed-shape slots shared by every MoE layer.

A slot holds one expert of any layer (all layers' records have the same layout):
every section of its record in an MLX array of shape `(capacity, *section_shape)`,
allocated once and reused, so `gather_qmm` reads experts through an
expert -> slot index and nothing is stacked or copied per token. One pool, not one
per layer, so that a small budget needs room for only one layer's experts at a time
and a large one goes where the traffic is.

Reads write into the slot arrays through zero-copy numpy views (see
../shared/NOTES.md). A slot is only written when no pending computation can read
it: a layer's computation is evaluated before the next layer's router (whose input
depends on it), the experts of the call in flight are protected from eviction, and
so are slots that reads are filling.
"""

import time
from dataclasses import dataclass
from typing import Dict, List

import mlx.core as mx
import numpy as np
from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchGLU

from .bank import ALIGN, BankLayout
from .policy import ExpertPool
from .reader import BankFile, ReadCancelled, ReadJob, Reader


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    speculative_issued: int = 0
    speculative_used: int = 0
    stall_seconds: float = 0.0

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0


def slot_dtype(disk_dtype: str, activation_dtype: mx.Dtype) -> mx.Dtype:
    """Scales/biases are held in the activation dtype when they are floats: with
    bf16 scales and f32 activations gather_qmm would convert every slot per call."""
    if disk_dtype in ("bfloat16", "float16", "float32"):
        return activation_dtype
    return getattr(mx, disk_dtype)


def slot_bytes(sections, activation_dtype: mx.Dtype) -> int:
    """Memory one slot takes (scales may be wider in memory than on disk)."""
    return sum(int(np.prod(s.shape)) * slot_dtype(s.dtype, activation_dtype).size
               for s in sections)


def np_view(a: mx.array) -> np.ndarray:
    """A writable numpy view of an evaluated MLX array (bf16 as uint16)."""
    if a.dtype == mx.bfloat16:
        a = a.view(mx.uint16)
    return np.asarray(a)


# MLX array dimensions are int32: no axis, including the flat one the aligned
# allocation below slices, may hold 2**31 elements or more.
MAX_ELEMENTS = 2**31 - 1 - ALIGN


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
    off = (-np_view(raw).ctypes.data) % ALIGN
    if off % dtype.size:  # never seen: MLX buffers are at least 8-aligned
        arr = mx.zeros(shape, dtype=dtype)  # reads then go through the staging buffer
    else:
        arr = raw[off // dtype.size : off // dtype.size + n].reshape(shape)
    mx.eval(arr)
    return arr


def max_slots(sections, activation_dtype: mx.Dtype) -> int:
    """The most slots one pool can have (see MAX_ELEMENTS)."""
    return min(MAX_ELEMENTS // int(np.prod(s.shape)) for s in sections)


def switch_over_slots(arrays: Dict[str, mx.array], capacity: int, quant: dict, activation):
    """mlx-lm's own SwitchGLU, over the slots instead of all experts: the
    arithmetic is exactly mlx-lm's, only the indices are slot numbers.
    (Its random initial weights are lazy and never evaluated.)"""
    hidden, packed_in = arrays["gate_proj.weight"].shape[1:]
    in_dim = packed_in * 32 // quant["bits"]
    inner = SwitchGLU(in_dim, hidden, capacity, activation=activation)
    for proj, (i, o) in (("gate_proj", (in_dim, hidden)), ("up_proj", (in_dim, hidden)),
                         ("down_proj", (hidden, in_dim))):
        lin = QuantizedSwitchLinear(i, o, capacity, False, quant["group_size"], quant["bits"],
                                    mode=quant["mode"])
        lin.weight = arrays[f"{proj}.weight"]
        lin.scales = arrays[f"{proj}.scales"]
        lin.biases = arrays.get(f"{proj}.biases")
        inner[proj] = lin
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
        self.pool = ExpertPool(capacity, num_experts, self.layers, experts_per_token)
        self.slot_key = [None] * capacity  # slot -> (layer, expert)
        self.pending: Dict[tuple, ReadJob] = {}  # (layer, expert) -> read in flight
        self.fresh_speculative = set()  # keys read ahead and not yet demanded
        self.all_resident = False  # set by preload_all
        self.slot_maps = {}

        layout: BankLayout = banks[self.layers[0]].layout
        self.arrays, self.views = {}, {}
        for s in layout.held_sections:  # a rank's slice under tensor parallelism
            arr = alloc_aligned((capacity, *s.shape), slot_dtype(s.dtype, activation_dtype))
            self.arrays[s.name] = arr
            self.views[s.name] = np_view(arr)

    def key(self, layer: int, expert: int) -> tuple:
        return (layer, int(expert))

    def _targets(self, slot: int):
        return {name: v[slot] for name, v in self.views.items()}

    def _assign(self, key: tuple, slot: int):
        old = self.slot_key[slot]
        if old is not None:
            self.fresh_speculative.discard(old)
        self.slot_key[slot] = key

    def request(self, layer: int, experts: np.ndarray, tokens: int) -> List[ReadJob]:
        """Start reads for the misses among `experts` of `layer` (at most
        `capacity` distinct experts) for a call routing `tokens` tokens (0 for
        a later group of the same call); returns the reads to wait for."""
        keys = [self.key(layer, e) for e in experts]
        self.pool.use(layer, experts, tokens)
        wanted = set(keys)
        protected = wanted | set(self.pending)
        jobs = []
        for key, e in zip(keys, experts):
            if key in self.pending:
                jobs.append(self.pending[key])
            if self.pool.slot_of(layer, e) is not None:
                self.stats.hits += 1
                if key in self.fresh_speculative:
                    self.fresh_speculative.discard(key)
                    self.stats.speculative_used += 1
                continue
            self.stats.misses += 1
            try:
                slot = self.pool.place(layer, e, protected)
            except RuntimeError:
                # Every other slot is being filled by a speculative read: drop
                # the guesses (or let them finish), then there is room.
                self._retire_speculation(keep=wanted)
                protected = wanted | set(self.pending)
                slot = self.pool.place(layer, e, protected)
            self._assign(key, slot)
            job = ReadJob(self.banks[layer], int(e), self._targets(slot), speculative=False)
            self.pending[key] = job
            jobs.append(self.reader.submit(job))
        return jobs

    def prefetch(self, layer: int, experts: np.ndarray, in_use: set, limit: int):
        """Queue speculative reads for `layer`'s predicted experts, never evicting
        what the call in flight uses (`in_use`, keys) or reads are filling."""
        protected = set(self.pending) | in_use
        # How often guesses have been right so far (a prior of one in two).
        worth = (self.stats.speculative_used + 1) / (self.stats.speculative_issued + 2)
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
            self._assign(key, slot)
            job = ReadJob(self.banks[layer], int(e), self._targets(slot), speculative=True)
            self.pending[key] = job
            self.fresh_speculative.add(key)
            self.reader.submit(job)
            protected.add(key)
            issued += 1
        self.stats.speculative_issued += issued

    def _retire_speculation(self, keep):
        for key, job in list(self.pending.items()):
            if job.speculative and key not in keep:
                job.cancelled = True
                job.done.wait()
        self.collect()

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
        """The slot of each of `layer`'s (resident) `experts`."""
        return np.array([self.pool.slot_of(layer, e) for e in experts], dtype=np.int64)

    def preload_all(self, progress=None):
        """With room for every expert: read them all now, in file order, and switch
        to the lazy path (no per-layer evaluation, no bookkeeping per token)."""
        assert self.capacity >= len(self.layers) * self.num_experts
        jobs = []
        for layer in self.layers:
            for e in range(self.num_experts):
                key = self.key(layer, e)
                if self.pool.slot_of(layer, e) is None:
                    slot = self.pool.place(layer, e)
                    self._assign(key, slot)
                    job = ReadJob(self.banks[layer], e, self._targets(slot), speculative=False)
                    self.pending[key] = job
                    jobs.append(self.reader.submit(job))
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
