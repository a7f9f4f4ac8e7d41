"""The expert cache: fixed-shape slot arrays per MoE layer, filled by the reader.

Each MoE layer owns `capacity` slots. A slot holds one expert: every section of its
record in an MLX array of shape `(capacity, *section_shape)`, allocated once and
reused, so `gather_qmm` reads experts through an expert -> slot index and nothing
is stacked or copied per token. Reads write into the slot arrays through zero-copy
numpy views (see ../shared/NOTES.md): a slot is only written when no pending
computation can read it (the layer's previous call has been evaluated, and the
experts of the call in flight and of reads in progress are protected from eviction).
"""

import time
from dataclasses import dataclass
from typing import Dict, List

import mlx.core as mx
import numpy as np
from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchGLU

from .bank import ALIGN, NUMPY_DTYPES, BankLayout
from .policy import SlotMap
from .reader import BankFile, ReadCancelled, ReadJob, Reader


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    speculative_issued: int = 0
    speculative_used: int = 0
    stall_seconds: float = 0.0

    def reset(self):
        self.__init__()

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
    total = 0
    for s in sections:
        dt = slot_dtype(s.dtype, activation_dtype)
        total += int(np.prod(s.shape)) * dt.size
    return total


def _np_view(a: mx.array) -> np.ndarray:
    if a.dtype == mx.bfloat16:
        a = a.view(mx.uint16)
    return np.asarray(a)


def _alloc_slots(shape, dtype: mx.Dtype):
    """An MLX array whose data starts 4096-aligned (O_DIRECT reads land in it)."""
    nbytes = int(np.prod(shape)) * dtype.size
    raw = mx.zeros((nbytes + ALIGN,), dtype=mx.uint8)
    mx.eval(raw)
    off = (-np.asarray(raw).ctypes.data) % ALIGN
    arr = raw[off : off + nbytes].view(dtype).reshape(shape)
    mx.eval(arr)
    return arr


class LayerCache:
    """One MoE layer's slots, slot map and reads in flight."""

    def __init__(self, bank: BankFile, capacity: int, num_experts: int,
                 activation, activation_dtype: mx.Dtype, quant: dict,
                 reader: Reader, stats: CacheStats):
        layout: BankLayout = bank.layout
        self.layer = layout.layer
        self.bank = bank
        self.capacity = capacity
        self.num_experts = num_experts
        self.reader = reader
        self.stats = stats
        self.slotmap = SlotMap(capacity, num_experts)
        self.slot_expert = np.full(capacity, -1, dtype=np.int64)
        self.pending: Dict[int, ReadJob] = {}
        self.fresh_speculative = set()

        self.arrays = {}
        self.views = {}
        for s in layout.sections:
            arr = _alloc_slots((capacity, *s.shape), slot_dtype(s.dtype, activation_dtype))
            self.arrays[s.name] = arr
            self.views[s.name] = _np_view(arr)

        # mlx-lm's own SwitchGLU, over the slots instead of all experts: the
        # arithmetic is exactly mlx-lm's, only the indices are slot numbers.
        # (Its random initial weights are lazy and never evaluated.)
        hidden, packed_in = layout.section("gate_proj.weight").shape
        in_dim = packed_in * 32 // quant["bits"]
        self.inner = SwitchGLU(in_dim, hidden, capacity, activation=activation)
        for proj, (i, o) in (("gate_proj", (in_dim, hidden)), ("up_proj", (in_dim, hidden)),
                             ("down_proj", (hidden, in_dim))):
            lin = QuantizedSwitchLinear(i, o, capacity, False, quant["group_size"],
                                        quant["bits"], mode=quant["mode"])
            lin.weight = self.arrays[f"{proj}.weight"]
            lin.scales = self.arrays[f"{proj}.scales"]
            lin.biases = self.arrays.get(f"{proj}.biases")
            self.inner[proj] = lin

    def targets(self, slot: int) -> Dict[str, np.ndarray]:
        return {name: v[slot] for name, v in self.views.items()}

    def _assign(self, expert: int, slot: int):
        old = self.slot_expert[slot]
        if old >= 0:
            self.fresh_speculative.discard(int(old))
        self.slot_expert[slot] = expert

    def request(self, experts: np.ndarray) -> List[ReadJob]:
        """Start reads for the misses among `experts` (at most `capacity` of them)."""
        self.slotmap.use(experts)
        protected = set(int(e) for e in experts) | set(self.pending)
        jobs = []
        for e in experts:
            e = int(e)
            if e in self.pending:
                jobs.append(self.pending[e])
            if self.slotmap.slot_of(e) is not None:
                self.stats.hits += 1
                if e in self.fresh_speculative:
                    self.fresh_speculative.discard(e)
                    self.stats.speculative_used += 1
                continue
            self.stats.misses += 1
            try:
                slot = self.slotmap.place(e, protected)
            except RuntimeError:
                # Every other slot is being filled by a speculative read: drop
                # the guesses (or let them finish), then there is room.
                self._retire_speculation(keep=set(int(x) for x in experts))
                protected = set(int(x) for x in experts) | set(self.pending)
                slot = self.slotmap.place(e, protected)
            self._assign(e, slot)
            job = ReadJob(self.bank, e, self.targets(slot), speculative=False)
            self.pending[e] = job
            jobs.append(self.reader.submit(job))
        return jobs

    def prefetch(self, experts: np.ndarray, limit: int):
        """Queue speculative reads for predicted experts not yet resident."""
        protected = set(self.pending)
        issued = 0
        for e in experts:
            e = int(e)
            if issued >= limit:
                break
            if self.slotmap.slot_of(e) is not None:
                continue
            slot = self.slotmap.place(e, protected | {e}, speculative=True)
            if slot is None:
                continue
            self._assign(e, slot)
            job = ReadJob(self.bank, e, self.targets(slot), speculative=True)
            self.pending[e] = job
            self.fresh_speculative.add(e)
            self.reader.submit(job)
            protected.add(e)
            issued += 1
        self.stats.speculative_issued += issued

    def _retire_speculation(self, keep):
        for e, job in list(self.pending.items()):
            if job.speculative and e not in keep:
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
        """Retire finished reads; a failed one leaves its slot empty."""
        for e, job in list(self.pending.items()):
            if job.done.is_set():
                del self.pending[e]
                if job.error is not None:
                    self.slotmap.evict(e)
                    self.fresh_speculative.discard(e)
                    slot = np.nonzero(self.slot_expert == e)[0]
                    self.slot_expert[slot] = -1

    def drain(self):
        """Wait for every read in flight (before slots may be reused elsewhere)."""
        for job in list(self.pending.values()):
            job.done.wait()
        self.collect()

    def slot_map(self) -> np.ndarray:
        """expert -> slot (-1 when not resident), for building slot indices."""
        out = np.full(self.num_experts, -1, dtype=np.int64)
        for e, s in self.slotmap.resident().items():
            out[e] = s
        return out
