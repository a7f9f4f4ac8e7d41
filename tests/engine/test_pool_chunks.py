"""Expert pools larger than one MLX array allows (2**31 elements per slot array,
1,560 K3 slots) are split into chunks of whole per-layer partitions; checked at
small scale by lowering the limit."""

import mlx.core as mx
import numpy as np
import pytest

import deltafin_mlx.plan.slots as slots_mod
from deltafin_mlx.plan.slots import pool_chunks, pool_limit
from deltafin_mlx.engine.load import load
from deltafin_mlx.format.manifest import read_manifest
from deltafin_mlx.testing.decode import greedy
from test_runtime import expected, prompt_of  # noqa: F401  (fixture)

from deltafin_mlx import runtime


def test_a_pool_within_the_limit_is_one_chunk():
    assert pool_chunks(1560, 92, 16, 896, 1560) == [(0, 1560)]


def test_a_k3_pool_past_the_limit_is_cut_at_partition_boundaries():
    # 64 GB Mac: ~30 GB of cache = 1,700 K3 slots: 92 partitions of 18.
    chunks = pool_chunks(1700, 92, 16, 896, 1560)
    assert sum(n for _, n in chunks) == 92 * 18
    assert all(n % 18 == 0 and n <= 1560 for _, n in chunks)
    assert [s for s, _ in chunks] == [0] + list(np.cumsum([n for _, n in chunks])[:-1])


def test_every_k3_expert_can_be_cached():
    assert pool_limit(92, 16, 896, 1560) == 92 * 896
    chunks = pool_chunks(92 * 896, 92, 16, 896, 1560)
    assert sum(n for _, n in chunks) == 92 * 896 and max(n for _, n in chunks) <= 1560


def test_a_pool_that_cannot_be_partitioned_stops_at_one_chunk():
    # 10 layers x 8 experts per token = 80 slots before partitions; a chunk holds 50.
    assert pool_limit(10, 8, 64, 50) == 50
    with pytest.raises(ValueError):
        pool_chunks(60, 10, 8, 64, 50)


def test_the_planner_plans_past_one_chunk():
    assert pool_limit(92, 16, 896, 1560) > 1560


def test_tokens_stay_exact_with_the_pool_in_several_chunks(converted, expected, monkeypatch):
    path = converted("kimi_k3")
    m = read_manifest(path)
    biggest = max(int(np.prod(s["shape"])) for s in m.experts["sections"])
    # 11 slots per array; the fixture has 3 MoE layers x 16 experts, 4 per token.
    monkeypatch.setattr(slots_mod, "MAX_ELEMENTS", 11 * biggest)
    ref_tokens, ref_logits = expected("kimi_k3", 1, 12, 16)
    for slots, lookahead in ((24, True), (48, False)):  # 48 is capped at 3 x 11
        model, _ = load(path, cache_slots=slots, reader_threads=1, lookahead=lookahead,
                        tokenizer=False)
        cache = runtime(model).store.cache
        assert len(cache.chunks) > 1
        assert all(n <= 11 for _, n in cache.chunks)
        assert cache.capacity == min(slots, 33)
        tokens, logits = greedy(model, prompt_of(12), 16)
        assert (tokens == ref_tokens).all(), slots
        assert mx.array_equal(logits, ref_logits).item(), slots
        runtime(model).close()
