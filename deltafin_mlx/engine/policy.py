"""Which expert sits in which cache slot, and which one to evict next.

Each MoE layer has its own fixed set of slots. Routing is skewed (a few
experts carry most of the load, and which ones shifts with the text), so what
predicts reuse is how often an expert has been used lately, not just when it
was last used: LRU collapses on this traffic. The policy keeps, per expert, an
exponentially decayed count of uses (the LRFU family, leaning to frequency):

    rate = decayed use count * (1 - keep),   keep = 0.5 ** (1 / half_life)

an estimate of how many times per token the expert is used. Two corrections
fit it to routing traffic (together about one point of hit rate on drifting
traffic in the cache simulator, bench/studies/simulate_cache.py, and none lost
on steady traffic; docs/LEARNED.md):

* A use in the call right after another use of the same expert counts only
  `repeat_weight`. Consecutive tokens share a third or so of their experts;
  that back-to-back reuse says more about the current context than about
  how popular the expert is (LRU-K's "correlated reference" idea).
* An expert that has gone unused for longer than its rate makes plausible is
  probably no longer popular. Past `stale_after` expected uses without one,
  its value falls off exponentially, well before the decay would catch up.

The victim is the resident, unprotected expert of lowest value; ties go to
the lowest slot. The time unit is the token: `use` advances the clock by the
number of tokens the call routed, so a batched call ages popularity as much
as the same tokens one at a time. The defaults were tuned with
the cache simulator on Zipf-skewed traces, steady and drifting.
"""

import numpy as np

from deltafin_mlx.plan.slots import layer_partition


class SlotMap:
    """Maps the experts of one layer to a fixed number of cache slots.

    Per layer call, the caller reports the distinct experts the call needs
    with `use` (hits and misses alike), then calls `place` for each one that
    is not resident, protecting the experts the call is using.
    """

    def __init__(self, num_slots: int, num_experts: int, *, half_life: float = 128.0,
                 repeat_weight: float = 0.5, stale_after: float = 3.0, recent_bonus: float = 0.0):
        if not 0 < num_slots <= num_experts:
            raise ValueError(f"need 0 < num_slots <= num_experts, got {num_slots} and {num_experts}")
        self.num_slots = num_slots
        self.num_experts = num_experts
        self.repeat_weight = repeat_weight
        self.stale_after = stale_after
        self.recent_bonus = recent_bonus

        self._expert_in = np.full(num_slots, -1, dtype=np.int64)  # slot -> expert, -1 free
        self._slot_of = np.full(num_experts, -1, dtype=np.int64)  # expert -> slot, -1 none
        self._free = list(range(num_slots - 1, -1, -1))  # pop() hands out slot 0 first

        # Counts are stored multiplied by `_inc`, the weight a use made now
        # gets. Growing the increment instead of decaying every count keeps
        # `use` proportional to the experts it touches; the counts are
        # rescaled long before they could overflow.
        self._keep = 0.5 ** (1.0 / half_life)
        self._inc = 1.0
        self._counts = np.zeros(num_experts)
        self._last_use = np.full(num_experts, -(2**62), dtype=np.int64)
        self._now = 0  # tokens seen
        self._prev = 0  # clock at the previous call
        self._values = None  # value() at the current clock, once asked for
        # Optional function giving a per-expert factor on value() when choosing
        # victims (ExpertPool's shared map: how soon each expert's layer runs
        # again); only called when a slot must be given up.
        self.weight = None

    def slot_of(self, expert: int) -> int | None:
        slot = int(self._slot_of[expert])
        return None if slot < 0 else slot

    def resident(self) -> dict[int, int]:
        """The resident experts, as {expert: slot}."""
        return {int(e): slot for slot, e in enumerate(self._expert_in.tolist()) if e >= 0}

    def use(self, experts, tokens: int = 1) -> None:
        """Record one access per distinct expert id in `experts`, for one
        layer call that routed `tokens` tokens (0: more of the same tokens)."""
        # tokens=0: another layer's call for the same tokens (one cache shared
        # by all layers); the clock has already moved for them.
        if tokens:
            self._prev = self._now
            self._now += tokens
            self._inc /= self._keep**tokens
            if self._inc > 1e100:
                self._counts /= self._inc
                self._inc = 1.0
        self._values = None
        idx = np.asarray(experts, dtype=np.int64)
        back_to_back = self._last_use[idx] == self._prev
        self._counts[idx] += np.where(back_to_back, self.repeat_weight * self._inc, self._inc)
        self._last_use[idx] = self._now

    def value(self, experts=None) -> np.ndarray:
        """The policy's value of keeping each of `experts` (all when None):
        its estimated uses per token, discounted once it looks stale. Higher
        is kept longer; only comparisons at one moment mean anything."""
        idx = slice(None) if experts is None else np.asarray(experts, dtype=np.int64)
        rate = self._counts[idx] * ((1.0 - self._keep) / self._inc)
        # Uses the rate predicts since the expert's last one, beyond the
        # allowance; that many missing uses means the rate is out of date.
        age = self._now - self._last_use[idx]
        overdue = rate * age - self.stale_after
        value = rate * np.exp(-np.maximum(overdue, 0.0))
        if self.recent_bonus:
            value = value + self.recent_bonus * (age <= 1)
        return value

    def place(self, expert: int, protected=(), speculative: bool = False,
              worth: float = 0.0) -> int | None:
        """Choose a slot for the non-resident `expert` and assign it there.

        Uses a free slot if there is one. Otherwise evicts the lowest-valued
        resident expert not in `protected` (the experts whose slots the call
        in flight is using or a read is filling); raises RuntimeError if every
        slot is protected.

        With `speculative=True` (a prefetch the router has not asked for
        yet), a full cache gives up a slot only if its victim is valued
        strictly below `expert` itself; otherwise nothing changes and None is
        returned (also when every slot is protected). A guess must not push
        out an expert the policy expects to be used sooner than the guess,
        and an expert never used is worth 0, so it only ever fills free slots.
        `worth` (the chance that a guess is right, as the caller measures it)
        raises the guess's value to at least that: values are uses per token, so
        a guess right 60% of the time outranks an expert used once in five tokens.
        """
        if self._slot_of[expert] >= 0:
            raise ValueError(f"expert {expert} is already resident")
        if self._free:
            slot = self._free.pop()
        else:
            # Values only change when `use` moves the clock, so the misses of
            # one call share a single evaluation over all experts.
            if self._values is None:
                self._raw = self.value()
                self._values = self._raw if self.weight is None else self._raw * self.weight()
            values = self._values.copy()
            if protected:
                values[np.fromiter(protected, dtype=np.int64)] = np.inf
            values = values[self._expert_in]
            slot = int(values.argmin())  # ties: lowest slot
            # A guess is judged in uses per token, without `weight`: it is for the
            # layer that runs next, so weighted it would outrank nearly everything.
            victim = self._expert_in[slot]
            if speculative and not (values[slot] < np.inf
                                    and self._raw[victim] < max(self._raw[expert], worth)):
                return None
            if values[slot] == np.inf:
                raise RuntimeError(f"all {self.num_slots} cache slots are protected")
            self._slot_of[self._expert_in[slot]] = -1
        self._expert_in[slot] = expert
        self._slot_of[expert] = slot
        return slot

    def has_free(self) -> bool:
        return bool(self._free)

    def evict(self, expert: int) -> None:
        """Free the slot of `expert` (e.g. after a failed read); no-op if it
        is not resident."""
        slot = int(self._slot_of[expert])
        if slot >= 0:
            self._slot_of[expert] = -1
            self._expert_in[slot] = -1
            self._free.append(slot)


class ExpertPool:
    """Slots for the experts of every MoE layer, as the runtime's cache holds them.

    With room for at least one token's experts in every layer, the pool is split
    into equal per-layer partitions, each its own SlotMap: a layer's misses evict
    only that layer's experts, so the experts a layer used this token (a third of
    which the next token reuses) survive the other layers' misses. Below that (the
    budgets near the floor) one SlotMap spans all layers, keyed by
    layer * num_experts + expert; experts used this token or the last get a
    bonus, for the same reason, and each value is divided by the cube of how
    many layer calls away the expert's layer is (`distance_power`): layers run in
    a fixed order, so a slot kept for a layer that runs next is held one call for
    its chance of a hit, one kept for the layer that just ran is held a whole
    token. What the bonus, the partitions and the distance term each gain on
    generated and real routing is in docs/LEARNED.md ("The pool's shared map").
    """

    def __init__(self, num_slots: int, num_experts: int, layers, experts_per_token: int,
                 distance_power: float = 3.0):
        self.layers = list(layers)
        self.num_experts = num_experts
        self.num_slots = num_slots
        n = len(self.layers)
        share = layer_partition(num_slots, n, experts_per_token, num_experts)
        self.partitioned = share is not None
        if self.partitioned:
            self.maps = {layer: SlotMap(share, num_experts) for layer in self.layers}
            self.offset = {layer: i * share for i, layer in enumerate(self.layers)}
        else:
            self.shared = SlotMap(num_slots, n * num_experts, recent_bonus=0.05)
            self.position = {layer: i for i, layer in enumerate(self.layers)}
            self.distance_power = distance_power

    def _distance_weight(self, i: int) -> np.ndarray:
        """Per key of the shared map, after layer position i's call: (layer calls
        until the key's layer runs again) ** -distance_power."""
        n = len(self.layers)
        calls_away = (np.arange(n) - i) % n
        calls_away[calls_away == 0] = n
        return np.repeat(calls_away.astype(np.float64) ** -self.distance_power, self.num_experts)

    def capacity_of(self, layer) -> int:
        """The most distinct experts one call of `layer` can hold at once."""
        return self.maps[layer].num_slots if self.partitioned else self.num_slots

    def _where(self, layer, expert):
        if self.partitioned:
            return self.maps[layer], int(expert), self.offset[layer]
        return self.shared, self.position[layer] * self.num_experts + int(expert), 0

    def use(self, layer, experts, tokens: int):
        """One call of `layer` needing `experts`, routing `tokens` tokens (0: a
        later group of the same call)."""
        if self.partitioned:
            self.maps[layer].use([int(e) for e in experts], tokens=tokens)
        else:
            base = self.position[layer] * self.num_experts
            clock = tokens if layer == self.layers[0] else 0  # once per token
            self.shared.use([base + int(e) for e in experts], tokens=clock)
            self.shared.weight = lambda i=self.position[layer]: self._distance_weight(i)

    def slot_of(self, layer, expert):
        m, key, off = self._where(layer, expert)
        slot = m.slot_of(key)
        return None if slot is None else slot + off

    def place(self, layer, expert, protected=(), speculative=False, worth=0.0):
        """A slot for `layer`'s non-resident `expert`; `protected` holds
        (layer, expert) pairs that must stay."""
        m, key, off = self._where(layer, expert)
        keys = {self._where(l, e)[1] for l, e in protected if not self.partitioned or l == layer}
        slot = m.place(key, keys, speculative=speculative, worth=worth)
        return None if slot is None else slot + off

    def evict(self, layer, expert):
        m, key, _ = self._where(layer, expert)
        m.evict(key)

    def resident(self):
        """{(layer, expert): slot}."""
        if self.partitioned:
            return {(layer, e): s + self.offset[layer]
                    for layer, m in self.maps.items() for e, s in m.resident().items()}
        n = self.num_experts
        return {(self.layers[k // n], k % n): s for k, s in self.shared.resident().items()}

    def has_free(self, layer) -> bool:
        """Is a slot that `layer`'s experts may use empty?"""
        m, _, _ = self._where(layer, 0)
        return m.has_free()

    def ranked(self):
        """{layer: its resident experts, most valuable first}: what a warm restart
        reads back first. Ties keep slot order (a warm start fills slots in the order
        of its own ranking). The shared map's values are taken without the distance
        term, which only says which layer runs next."""
        order = {layer: [] for layer in self.layers}
        if self.partitioned:
            for layer, m in self.maps.items():
                held = sorted(m.resident().items(), key=lambda es: es[1])  # by slot
                experts = np.array([e for e, _ in held], dtype=np.int64)
                if experts.size:
                    values = m.value(experts)
                    order[layer] = experts[np.argsort(-values, kind="stable")].tolist()
            return order
        held = sorted(self.shared.resident().items(), key=lambda ks: ks[1])
        keys = np.array([k for k, _ in held], dtype=np.int64)
        if keys.size:
            values = self.shared.value(keys)
            for k in keys[np.argsort(-values, kind="stable")].tolist():
                order[self.layers[k // self.num_experts]].append(k % self.num_experts)
        return order
