"""Simulate expert caches on a routing trace and compare policies.

By default the cache is what the runtime has: one pool of `fraction` of all
experts (of every layer), filled by the MoE layers in order for each token;
"SlotMap" is then the runtime's own ExpertPool (per-layer partitions when every
layer has room for a token's experts, one shared map below that). `run(...,
shared=False)` (the command line's `--per-layer`) gives each layer a cache of its
own instead. Fetching is on demand only: every access to a non-resident expert is a miss and the
expert must be placed, and the experts of the current token in that layer
are protected while it runs. Policies: LRU, LFU, the runtime's SlotMap
(deltafin_mlx.engine.policy, the same code the runtime runs) and Belady's MIN, which
sees the future and is the upper bound. bench.studies.simulate_cache is its
command line.

A trace is JSONL, one object per token:
    {"tok": 0, "layers": [[3, 17, ...], [5, 8, ...], ...]}
"""

import heapq
import json
from collections import OrderedDict

import numpy as np

from deltafin_mlx.engine.policy import ExpertPool, SlotMap

# Generated-trace presets. `repeat` is the chance that a pick copies one of
# the previous token's experts; together with the skew it gives consecutive
# tokens roughly the 30-45% overlap seen in real routing.
PRESETS = {
    # No skew and no overlap: nothing to learn, the hard case.
    "uniform": dict(zipf=0.0, repeat=0.0, drift_every=0, drift_frac=0.0),
    # Zipf 1.0 popularity; consecutive tokens share about 35% of experts.
    "skewed": dict(zipf=1.0, repeat=0.2, drift_every=0, drift_frac=0.0),
    # As skewed, but every 256 tokens a third of the experts in each layer
    # swap popularity ranks (a change of topic, say).
    "drifting": dict(zipf=1.0, repeat=0.2, drift_every=256, drift_frac=0.33),
}
SIZES = [(896, 16), (64, 4)]  # (experts per layer, experts per token)
FRACTIONS = [0.10, 0.25, 0.50]


# ---------------------------------------------------------------- traces


def generate_trace(
    num_experts: int,
    k: int,
    tokens: int,
    layers: int,
    *,
    zipf: float = 1.0,
    repeat: float = 0.25,
    drift_every: int = 0,
    drift_frac: float = 0.0,
    seed: int = 0,
) -> list[list[list[int]]]:
    """Synthetic routing: trace[layer][token] is a list of k distinct experts.

    Per layer, expert popularity is Zipf-like (rank r has weight r**-zipf)
    under its own random permutation. Each pick copies one of the previous
    token's experts with probability `repeat`, else draws from the
    popularity. Every `drift_every` tokens, a `drift_frac` share of experts
    swap ranks among themselves.
    """
    rng = np.random.default_rng(seed)
    weights = np.arange(1, num_experts + 1, dtype=np.float64) ** -zipf
    trace = []
    for _ in range(layers):
        rank_of = rng.permutation(num_experts)  # expert -> popularity rank
        cdf = np.cumsum(weights[rank_of]) / weights.sum()
        prev: list[int] = []
        layer = []
        for t in range(tokens):
            if drift_every and t and t % drift_every == 0:
                moved = rng.choice(num_experts, int(drift_frac * num_experts), replace=False)
                rank_of[moved] = rank_of[rng.permutation(moved)]
                cdf = np.cumsum(weights[rank_of]) / weights.sum()
            chosen: list[int] = []
            for _ in range(k):
                left = [e for e in prev if e not in chosen]
                if left and rng.random() < repeat:
                    chosen.append(left[rng.integers(len(left))])
                    continue
                while True:  # popularity draw, rejecting experts already picked
                    e = min(int(np.searchsorted(cdf, rng.random(), side="right")), num_experts - 1)
                    if e not in chosen:
                        chosen.append(e)
                        break
            layer.append(chosen)
            prev = chosen
        trace.append(layer)
    return trace


def load_trace(path) -> list[list[list[int]]]:
    """Read a JSONL routing trace; returns trace[layer][token]."""
    tokens = []
    with open(path) as f:
        for line in f:
            if line.strip():
                tokens.append(json.loads(line)["layers"])
    num_layers = len(tokens[0])
    return [[tok[l] for tok in tokens] for l in range(num_layers)]


def overlap(layer: list[list[int]]) -> float:
    """Mean share of a token's experts that the previous token also used."""
    shares = [
        len(set(a) & set(b)) / len(set(b)) for a, b in zip(layer, layer[1:]) if b
    ]
    return float(np.mean(shares)) if shares else 0.0


# ---------------------------------------------------------------- baselines
# Same interface as SlotMap: use(), slot_of(), place(); the simulator only
# needs what demand fetching uses.


class LRU:
    """Evict the least recently used unprotected expert."""

    def __init__(self, num_slots, num_experts):
        self.num_slots = num_slots
        self._order = OrderedDict()  # expert -> slot, least recent first

    def slot_of(self, expert):
        return self._order.get(expert)

    def use(self, experts):
        for e in experts:
            if e in self._order:
                self._order.move_to_end(e)

    def place(self, expert, protected=()):
        if len(self._order) < self.num_slots:
            slot = len(self._order)
        else:
            victim = next((e for e in self._order if e not in protected), None)
            if victim is None:
                raise RuntimeError("every cache slot is protected")
            slot = self._order.pop(victim)
        self._order[expert] = slot
        return slot


class LFU:
    """Evict the unprotected expert with the fewest uses over the whole trace
    (counted for non-resident experts too, never aged); ties to lowest id."""

    def __init__(self, num_slots, num_experts):
        self.num_slots = num_slots
        self._count = np.zeros(num_experts, dtype=np.int64)
        self._expert_in = np.full(num_slots, -1, dtype=np.int64)
        self._slot = {}

    def slot_of(self, expert):
        return self._slot.get(expert)

    def use(self, experts):
        self._count[list(experts)] += 1

    def place(self, expert, protected=()):
        if len(self._slot) < self.num_slots:
            slot = len(self._slot)
        else:
            # One integer key orders by count, then by expert id.
            key = self._count[self._expert_in] * len(self._count) + self._expert_in
            key[[self._slot[e] for e in protected if e in self._slot]] = np.iinfo(np.int64).max
            slot = int(np.argmin(key))
            if key[slot] == np.iinfo(np.int64).max:
                raise RuntimeError("every cache slot is protected")
            del self._slot[int(self._expert_in[slot])]
        self._slot[expert] = slot
        self._expert_in[slot] = expert
        return slot


class Belady:
    """MIN: evict the resident expert whose next use is furthest away.

    Built from the whole layer trace so it can look ahead. Protection needs
    no special case: an expert of the current token has next use "now",
    sooner than anything else resident.
    """

    def __init__(self, num_slots, layer: list[list[int]]):
        self.num_slots = num_slots
        never = len(layer)
        # next_use[t][e]: the next token after t that uses e.
        self._next_use = [None] * len(layer)
        upcoming: dict[int, int] = {}
        for t in range(len(layer) - 1, -1, -1):
            self._next_use[t] = {e: upcoming.get(e, never) for e in layer[t]}
            for e in layer[t]:
                upcoming[e] = t
        self._now = -1
        self._due = {}  # resident expert -> (token of its next use, slot)
        self._heap = []  # (-due, expert), stale entries skipped: furthest on top

    def slot_of(self, expert):
        return self._due.get(expert, (None, None))[1]

    def use(self, experts):
        # Called at the start of each token: what was used last token now
        # waits for its next use; what this token uses is due now.
        self._now += 1
        if self._now:
            for e, due in self._next_use[self._now - 1].items():
                if e in self._due:
                    self._set_due(e, due)
        for e in experts:
            if e in self._due:
                self._set_due(e, self._now)

    def _set_due(self, expert, due):
        self._due[expert] = (due, self._due[expert][1])
        heapq.heappush(self._heap, (-due, expert))

    def place(self, expert, protected=()):
        if len(self._due) < self.num_slots:
            slot = len(self._due)
        else:
            while True:
                neg_due, victim = heapq.heappop(self._heap)
                if self._due.get(victim, (None,))[0] == -neg_due:
                    break
            if victim in protected:
                raise RuntimeError("every cache slot is protected")
            slot = self._due.pop(victim)[1]
        self._due[expert] = (self._now, slot)
        heapq.heappush(self._heap, (-self._now, expert))
        return slot


class Foresight:
    """Belady that sees only `horizon` calls ahead: of the resident experts, one
    not used within the horizon is evicted first (the lowest decayed use count
    over calls until its layer runs again, cubed: the shipped shared map's shape);
    only when all are due within it, the one due last. horizon 0 is an online
    policy, a horizon past the trace is Belady. How much foresight a policy needs
    to get within a given factor of Belady says what an online policy, which has
    none past the token being decoded, can hope for.

    `calls` are shared_calls (keys layer * num_experts + expert)."""

    def __init__(self, num_slots, calls, horizon, num_layers, num_experts,
                 half_life=32.0, power=3.0):
        self.num_slots, self.horizon = num_slots, horizon
        self.layers, self.n, self.power = num_layers, num_experts, power
        never = 1 << 60
        self._next_use, upcoming = [None] * len(calls), {}
        for i in range(len(calls) - 1, -1, -1):
            self._next_use[i] = {k: upcoming.get(k, never) for k in calls[i]}
            for k in calls[i]:
                upcoming[k] = i
        self._keep = 0.5 ** (1.0 / half_life)  # per token
        self._inc = 1.0
        self._count = np.zeros(num_layers * num_experts)
        self._due = {}  # resident key -> (call of its next use, slot)
        self._now = -1
        self._pending = ()

    def slot_of(self, key):
        return self._due.get(key, (None, None))[1]

    def use(self, keys):
        self._settle()
        self._now += 1
        if self._now % self.layers == 0:
            self._inc /= self._keep
        for k in keys:
            self._count[k] += self._inc
        self._pending = list(keys)

    def _settle(self):
        # The last call's experts now wait for their next use.
        for k in self._pending:
            if k in self._due:
                self._due[k] = (self._next_use[self._now][k], self._due[k][1])

    def place(self, key, protected=()):
        if len(self._due) < self.num_slots:
            slot = len(self._due)
        else:
            cands = [k for k in self._due if k not in protected]
            if not cands:
                raise RuntimeError("every cache slot is protected")
            unseen = [k for k in cands if self._due[k][0] - self._now > self.horizon]
            if unseen:
                keys = np.array(unseen)
                away = ((keys // self.n) - self._now % self.layers) % self.layers
                away[away == 0] = self.layers
                victim = unseen[int((self._count[keys] / away.astype(float) ** self.power).argmin())]
            else:
                victim = max(cands, key=lambda k: self._due[k][0])
            slot = self._due.pop(victim)[1]
        self._due[key] = (self._now, slot)
        return slot


def foresight_hit_rate(trace, num_experts: int, fraction: float, horizon_tokens: float) -> float:
    """Hit rate of Foresight seeing `horizon_tokens` tokens (of all layers) ahead,
    one pool of `fraction` of all experts."""
    calls = shared_calls(trace, num_experts)
    widest = max(len(set(c)) for c in calls)
    slots = min(num_experts * len(trace), max(widest, round(fraction * num_experts * len(trace))))
    cache = Foresight(slots, calls, round(horizon_tokens * len(trace)), len(trace), num_experts)
    hits, accesses = simulate_layer(cache, calls)
    return hits / accesses


POLICIES = {
    "LRU": lambda slots, n, layer: LRU(slots, n),
    "LFU": lambda slots, n, layer: LFU(slots, n),
    "SlotMap": lambda slots, n, layer: SlotMap(slots, n),
    "Belady": lambda slots, n, layer: Belady(slots, layer),
}


# ---------------------------------------------------------------- simulation


def simulate_layer(cache, layer: list[list[int]]) -> tuple[int, int]:
    """Run one layer's accesses through `cache`; returns (hits, accesses)."""
    hits = accesses = 0
    for experts in layer:
        need = list(dict.fromkeys(experts))  # distinct, in routing order
        cache.use(need)
        protected = set(need)
        for e in need:
            if cache.slot_of(e) is None:
                cache.place(e, protected)
            else:
                hits += 1
        accesses += len(need)
    return hits, accesses


def num_slots_for(fraction: float, num_experts: int, trace) -> int:
    """Slots for a cache of `fraction` of the experts; never fewer than the
    most distinct experts one token needs in a layer, or a token cannot run."""
    widest = max(len(set(experts)) for layer in trace for experts in layer)
    return min(num_experts, max(widest, round(fraction * num_experts)))


def hit_rate(policy: str, trace, num_experts: int, fraction: float, make=None) -> float:
    """Hit rate of `policy` over all layers, each layer its own cache."""
    make = make or POLICIES[policy]
    slots = num_slots_for(fraction, num_experts, trace)
    hits = accesses = 0
    for layer in trace:
        h, a = simulate_layer(make(slots, num_experts, layer), layer)
        hits += h
        accesses += a
    return hits / accesses


class RuntimePool:
    """The runtime's ExpertPool (the same code) behind the simulator's interface:
    keys are layer * num_experts + expert, calls come layer by layer."""

    def __init__(self, num_slots, num_experts, num_layers, experts_per_token):
        self.pool = ExpertPool(num_slots, num_experts, range(num_layers), experts_per_token)
        self.n = num_experts
        self.num_layers = num_layers
        self.calls = 0

    def use(self, keys):
        layer = self.calls % self.num_layers
        self.pool.use(layer, [k % self.n for k in keys], tokens=1)
        self.calls += 1

    def slot_of(self, key):
        return self.pool.slot_of(key // self.n, key % self.n)

    def place(self, key, protected=()):
        return self.pool.place(key // self.n, key % self.n,
                               {(k // self.n, k % self.n) for k in protected})


def shared_calls(trace, num_experts: int) -> list[list[int]]:
    """The accesses in the order the runtime makes them: token by token, layer by
    layer, with each layer's experts as keys of one pool."""
    return [[layer * num_experts + e for e in trace[layer][t]]
            for t in range(len(trace[0])) for layer in range(len(trace))]


def shared_hit_rate(policy: str, trace, num_experts: int, fraction: float) -> float:
    """Hit rate of `policy` with one pool of `fraction` of all experts."""
    total = num_experts * len(trace)
    calls = shared_calls(trace, num_experts)
    widest = max(len(set(c)) for c in calls)
    slots = min(total, max(widest, round(fraction * total)))
    make = {
        "LRU": lambda: LRU(slots, total),
        "LFU": lambda: LFU(slots, total),
        "SlotMap": lambda: RuntimePool(slots, num_experts, len(trace), widest),
        "Belady": lambda: Belady(slots, calls),
    }[policy]
    hits, accesses = simulate_layer(make(), calls)
    return hits / accesses


def run(trace, num_experts: int, fractions=FRACTIONS, policies=tuple(POLICIES),
        shared: bool = False) -> dict:
    """Hit rates {fraction: {policy: rate}} plus SlotMap/Belady ratios."""
    rows = {}
    for fraction in fractions:
        if shared:
            row = {p: shared_hit_rate(p, trace, num_experts, fraction) for p in policies}
        else:
            row = {p: hit_rate(p, trace, num_experts, fraction) for p in policies}
        if "SlotMap" in row and "Belady" in row and row["Belady"] > 0:
            row["SlotMap/Belady"] = row["SlotMap"] / row["Belady"]
        row["slots"] = (round(fraction * num_experts * len(trace)) if shared
                        else num_slots_for(fraction, num_experts, trace))
        rows[fraction] = row
    return rows
