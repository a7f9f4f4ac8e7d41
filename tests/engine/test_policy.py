import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deltafin_mlx.testing import cache_simulator as sim
from deltafin_mlx.engine.policy import SlotMap


def check_consistent(slots: SlotMap):
    """slot_of and resident agree, no two experts share a slot, and the
    cache never holds more experts than it has slots."""
    resident = slots.resident()
    assert len(resident) <= slots.num_slots
    assert len(set(resident.values())) == len(resident)
    assert all(0 <= s < slots.num_slots for s in resident.values())
    for expert in range(slots.num_experts):
        assert slots.slot_of(expert) == resident.get(expert)


def serve(slots: SlotMap, experts, protected=()):
    """One layer call the way the runtime makes it: record the accesses,
    then place the misses while the call's own experts are protected."""
    experts = list(dict.fromkeys(experts))
    slots.use(experts)
    guard = set(experts) | set(protected)
    return [slots.place(e, guard) for e in experts if slots.slot_of(e) is None]


# A random history: each step is a layer call (the experts it needs, plus
# extra experts whose reads are in flight), an eviction or a prefetch.
N, S = 12, 5
calls = st.lists(st.integers(0, N - 1), min_size=1, max_size=S, unique=True)
steps = st.lists(
    st.one_of(
        st.tuples(st.just("call"), calls, st.lists(st.integers(0, N - 1), max_size=3)),
        st.tuples(st.just("evict"), st.integers(0, N - 1)),
        st.tuples(st.just("prefetch"), st.integers(0, N - 1), st.lists(st.integers(0, N - 1), max_size=S)),
    ),
    max_size=40,
)


def replay(history, slots=None):
    slots = slots or SlotMap(S, N)
    for step in history:
        if step[0] == "call":
            pinned = [e for e in step[2] if slots.slot_of(e) is not None]
            try:
                serve(slots, step[1], pinned)
            except RuntimeError:
                pass  # every slot pinned: the runtime would wait for a read
        elif step[0] == "evict":
            slots.evict(step[1])
        elif slots.slot_of(step[1]) is None:
            slots.place(step[1], set(step[2]), speculative=True)
    return slots


# ---------------------------------------------------------------- slots


def test_free_slots_are_used_before_any_eviction():
    slots = SlotMap(4, 10)
    serve(slots, [7, 3, 9, 1])
    assert slots.resident() == {7: 0, 3: 1, 9: 2, 1: 3}

    slots.evict(3)
    serve(slots, [5])  # takes the freed slot; nobody else moves
    assert slots.resident() == {7: 0, 5: 1, 9: 2, 1: 3}


def test_evict_frees_the_slot_and_ignores_experts_not_resident():
    slots = SlotMap(2, 4)
    serve(slots, [0, 1])
    slots.evict(0)
    slots.evict(2)
    assert slots.resident() == {1: 1}
    assert slots.slot_of(0) is None


def test_placing_a_resident_expert_is_an_error():
    slots = SlotMap(2, 4)
    serve(slots, [0])
    with pytest.raises(ValueError):
        slots.place(0, set())


def test_runtime_error_when_every_slot_is_protected():
    slots = SlotMap(3, 8)
    serve(slots, [0, 1, 2])
    with pytest.raises(RuntimeError):
        slots.place(3, {0, 1, 2})
    assert slots.resident() == {0: 0, 1: 1, 2: 2}  # nothing moved


@settings(max_examples=300, deadline=None)
@given(steps)
def test_protected_experts_are_never_evicted(history):
    slots = SlotMap(S, N)
    for step in history:
        before = slots.resident()
        if step[0] == "call":
            experts = step[1]
            pinned = {e for e in step[2] if e in before}
            slots.use(experts)
            guard = set(experts) | pinned
            for e in experts:
                if slots.slot_of(e) is not None:
                    continue
                if len(guard & set(slots.resident())) == S:
                    with pytest.raises(RuntimeError):
                        slots.place(e, guard)
                    break
                slots.place(e, guard)
            for e in pinned:
                assert slots.slot_of(e) == before[e]
            for e in experts:
                if e in before:
                    assert slots.slot_of(e) == before[e]
        elif step[0] == "evict":
            slots.evict(step[1])
        elif step[1] not in before:
            guard = set(step[2])
            slot = slots.place(step[1], guard, speculative=True)
            if len(before) == S and guard >= set(before):
                assert slot is None  # a prefetch gives up rather than raise
            for e in guard & set(before):
                assert slots.slot_of(e) == before[e]
        check_consistent(slots)


@settings(max_examples=200, deadline=None)
@given(steps, st.integers(0, N - 1))
def test_speculative_placement_never_evicts_an_expert_ranked_above_it(history, expert):
    slots = replay(history)
    if slots.slot_of(expert) is not None:
        return
    before = slots.resident()
    value = dict(enumerate(slots.value()))

    slot = slots.place(expert, set(), speculative=True)

    after = slots.resident()
    if len(before) < S:
        assert slot is not None and set(after) == set(before) | {expert}
    elif slot is None:
        # Declined: every resident is worth at least as much as the guess.
        assert after == before
        assert all(value[e] >= value[expert] for e in before)
    else:
        (victim,) = set(before) - set(after)
        assert value[victim] < value[expert]
        assert value[victim] == min(value[e] for e in before)
    check_consistent(slots)


@settings(max_examples=100, deadline=None)
@given(steps)
def test_the_same_history_gives_the_same_slots(history):
    assert replay(history).resident() == replay(history).resident()


# ---------------------------------------------------------------- policy


def test_popular_experts_survive_a_stream_of_one_off_experts():
    # Experts 0 and 1 come back every third token; the tokens between bring
    # experts never seen before, more of them than there are free slots. LRU
    # keeps the newest and loses 0 and 1; the policy keeps the popular ones.
    one_off = itertools.count(2)
    routing = [[0, 1] if t % 3 == 0 else [next(one_off), next(one_off)] for t in range(60)]
    slots, lru = SlotMap(4, 200), sim.LRU(4, 200)
    for experts in routing:
        serve(slots, experts)
        serve(lru, experts)
    assert {0, 1} <= set(slots.resident())
    assert lru.slot_of(0) is None and lru.slot_of(1) is None


def test_a_fresh_favourite_replaces_a_faded_one():
    # Expert 0 was used by every token for 100 tokens, then the traffic moved
    # to expert 1. Expert 0 still has the larger decayed count, but 30 tokens
    # without it are implausible at its old rate, so a miss evicts 0, not 1.
    slots = SlotMap(2, 10)
    for _ in range(100):
        serve(slots, [0])
    for _ in range(30):
        serve(slots, [1])
    serve(slots, [2])
    assert set(slots.resident()) == {1, 2}


def test_prefetch_of_an_unknown_expert_does_not_displace_a_used_one():
    slots = SlotMap(2, 10)
    serve(slots, [0, 1])
    assert slots.place(5, set(), speculative=True) is None
    assert set(slots.resident()) == {0, 1}


def test_use_ages_by_tokens_so_one_batched_call_equals_single_calls():
    batched, single = SlotMap(4, 10), SlotMap(4, 10)
    batched.use([3])
    single.use([3])
    batched.use([4], tokens=5)
    for _ in range(4):
        single.use([])
    single.use([4])
    assert batched.value() == pytest.approx(single.value())


# ---------------------------------------------------------------- simulator


def test_belady_is_optimal_on_tiny_traces():
    # Exhaustive search over every eviction choice on tiny layers.
    def best(layer, slots):
        frontier = {frozenset(): 0}  # resident set -> most hits so far
        for experts in layer:
            need = set(experts)
            nxt = {}
            for resident, hits in frontier.items():
                h = hits + len(need & resident)
                overflow = len(resident | need) - slots
                keep_from = sorted(resident - need)
                for dropped in itertools.combinations(keep_from, max(overflow, 0)):
                    state = frozenset((resident - set(dropped)) | need)
                    nxt[state] = max(nxt.get(state, -1), h)
            frontier = nxt
        return max(frontier.values())

    for seed in range(20):
        trace = sim.generate_trace(6, 2, 10, 1, zipf=0.5, repeat=0.3, seed=seed)
        layer = trace[0]
        for slots in (2, 3, 4):
            hits, _ = sim.simulate_layer(sim.Belady(slots, layer), layer)
            assert hits == best(layer, slots), (seed, slots)


@pytest.mark.parametrize("preset", sorted(sim.PRESETS))
def test_belady_beats_every_policy_on_every_preset(preset):
    trace = sim.generate_trace(64, 4, 300, 2, seed=1, **sim.PRESETS[preset])
    for fraction in (0.1, 0.25, 0.5):
        rows = sim.run(trace, 64, [fraction])[fraction]
        assert all(rows["Belady"] >= rows[p] for p in ("LRU", "LFU", "SlotMap")), rows


@settings(max_examples=30, deadline=None)
@given(st.lists(st.lists(st.integers(0, 9), min_size=1, max_size=3), min_size=1, max_size=40),
       st.integers(3, 10))
def test_belady_beats_every_policy_on_any_trace(tokens, slots):
    layer = [list(dict.fromkeys(t)) for t in tokens]
    hits = {p: sim.simulate_layer(make(slots, 10, layer), layer)[0] for p, make in sim.POLICIES.items()}
    assert all(hits["Belady"] >= h for h in hits.values()), hits


@settings(max_examples=30, deadline=None)
@given(st.lists(st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=2), min_size=2, max_size=2),
                min_size=1, max_size=30),
       st.integers(4, 10), st.integers(0, 8))
def test_foresight_never_beats_belady_and_is_belady_when_it_sees_the_whole_trace(tokens, slots, horizon):
    trace = [[list(dict.fromkeys(tok[layer])) for tok in tokens] for layer in range(2)]
    calls = sim.shared_calls(trace, 6)
    belady = sim.simulate_layer(sim.Belady(slots, calls), calls)[0]
    limited = sim.simulate_layer(sim.Foresight(slots, calls, horizon, 2, 6), calls)[0]
    whole = sim.simulate_layer(sim.Foresight(slots, calls, len(calls), 2, 6), calls)[0]
    assert limited <= belady
    assert whole == belady


def test_slotmap_beats_lru_on_skewed_traffic():
    trace = sim.generate_trace(64, 4, 600, 2, seed=2, **sim.PRESETS["skewed"])
    for fraction in (0.1, 0.25):
        rows = sim.run(trace, 64, [fraction], policies=("LRU", "SlotMap"))[fraction]
        assert rows["SlotMap"] > rows["LRU"] + 0.03, rows


def test_simulator_reads_jsonl_traces(tmp_path):
    path = tmp_path / "trace.jsonl"
    path.write_text('{"tok": 0, "layers": [[1, 2], [3]]}\n{"tok": 1, "layers": [[2, 4], [3]]}\n')
    assert sim.load_trace(path) == [[[1, 2], [2, 4]], [[3], [3]]]
