"""Observing the engine (Runtime.observe) changes nothing it does: the same greedy
tokens, the same expert reads and the same cache counters with an observer as
without, whether every expert is resident (the lazy path, which observing must
not leave) or the cache holds one token's experts; the observer hears every MoE
layer's routing, the same on both paths, and is gone when its block ends."""

import mlx.core as mx
import numpy as np
import pytest

from deltafin_mlx import load, runtime
from deltafin_mlx.format.manifest import read_manifest
from deltafin_mlx.testing.decode import greedy

PROMPT = mx.array(np.random.default_rng(3).integers(1, 380, (1, 12)).astype(np.int32))
STEPS = 6


def run(path, slots, observe: bool):
    """(tokens, (hits, misses, bytes read), routes heard, all resident) of a greedy
    decode on a fresh load; routes: per call, per MoE layer, its sorted experts."""
    model, _ = load(path, cache_slots=slots, tokenizer=False, lookahead=False,
                    warm_start=False)
    with runtime(model) as state:
        heard = []

        def on_route(layer, routed):
            if not heard or layer <= heard[-1][-1][0]:
                heard.append([])
            heard[-1].append((layer, np.sort(routed.reshape(-1, routed.shape[-1]), axis=-1)))

        if observe:
            with state.observe(on_route=on_route):
                tokens, _ = greedy(model, PROMPT, STEPS)
        else:
            tokens, _ = greedy(model, PROMPT, STEPS)
        s = state.stats
        return (tokens, (s.hits, s.misses, state.store.bytes_read), heard,
                state.cache.all_resident)


@pytest.mark.parametrize("arch", ["kimi_k3", "qwen3_moe"])
def test_an_observer_changes_neither_tokens_nor_reads_and_hears_every_layer(arch, converted):
    path = converted(arch)
    m = read_manifest(path)
    layers = m.moe_layers
    routes = {}
    for name, slots in (("resident", None), ("one token's", m.experts["experts_per_token"])):
        tokens, counters, _, resident = run(path, slots, observe=False)
        seen_tokens, seen_counters, heard, seen_resident = run(path, slots, observe=True)
        assert resident == seen_resident == (name == "resident")
        assert np.array_equal(seen_tokens, tokens), name
        assert seen_counters == counters, name  # hits, misses and bytes read
        assert len(heard) == 1 + STEPS and all([l for l, _ in call] == layers for call in heard)
        routes[name] = heard
    assert counters[1] > 0  # the small cache read experts
    for a, b in zip(routes["resident"], routes["one token's"]):
        assert all(np.array_equal(x, y) for (_, x), (_, y) in zip(a, b))


def test_observers_nest_and_each_block_restores_what_was_before(converted):
    model, _ = load(converted("kimi_k3"), cache_slots=None, tokenizer=False,
                    warm_start=False)
    state = runtime(model)
    outer, inner, layers = [], [], []
    with state.observe(on_route=lambda l, r: outer.append(l)):
        with state.observe(on_route=lambda l, r: inner.append(l),
                           on_pass_layer=lambda done, n: layers.append(done)):
            greedy(model, PROMPT, 1)
        heard = len(outer)
        greedy(model, PROMPT, 1)
    greedy(model, PROMPT, 1)
    n = len(state.store.layers)
    # Each block's observer is gone when it ends: the last decode is heard by none.
    assert len(inner) == heard == 2 * n and len(outer) == 4 * n
    state.close()


def test_a_runtime_closes_its_readers_when_its_block_ends(converted):
    model, _ = load(converted("kimi_k3"), cache_slots=4, tokenizer=False, reader_threads=2,
                    warm_start=False)
    with runtime(model) as state:
        threads = list(state.store.reader._workers)
        greedy(model, PROMPT, 1)
        assert threads and all(t.is_alive() for t in threads)
    assert not any(t.is_alive() for t in threads)


def test_lookahead_predicts_with_gpt_oss_router_the_experts_its_block_routes_to():
    """gpt-oss's MoE block names its router `router` (not `gate`): lookahead uses
    it, and predicts exactly the experts mlx-lm's block picks."""
    from mlx_lm.models import gpt_oss

    from deltafin_mlx.engine.streaming_moe import predict_experts

    args = gpt_oss.ModelArgs(num_local_experts=16, num_experts_per_tok=4, hidden_size=32,
                             intermediate_size=32)
    block = gpt_oss.MLPBlock(args)
    h = mx.random.normal((1, 5, 32), key=mx.random.key(0))
    _, want = gpt_oss.mlx_topk(block.router(h), k=4)
    got = predict_experts(block, h, 4)
    assert got is not None
    assert np.array_equal(np.sort(np.array(got), -1), np.sort(np.array(want), -1))
