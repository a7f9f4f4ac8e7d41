"""Warm restarts: when the runtime closes, the expert cache's hot set is saved under
the user cache directory, keyed by the model; the next load of the same model reads
it back in the background, behind every demand read, so the first tokens hit more
and are the same tokens. A file that is not this model's, or not a hot-set file at
all, is one warning and a cold start, never an error or a hang; `warm_start=False`
neither reads nor writes it.

(conftest.py gives every test its own XDG_CACHE_HOME.)
"""

import json
import os
import threading

import mlx.core as mx
import numpy as np
import pytest

from deltafin_mlx import runtime
from deltafin_mlx.engine import hot_set
from deltafin_mlx.engine.load import load
from deltafin_mlx.testing import decode

SLOTS = 12  # a quarter of the fixtures' 3 MoE layers x 16 experts
TOKENS = 16


def prompt_of(length, seed=0):
    rng = np.random.default_rng(seed)
    return mx.array(rng.integers(1, 380, size=(1, length)).astype(np.int32))


def greedy(model, prompt, steps=TOKENS):
    return decode.greedy(model, prompt, steps)


def run_once(path, seed=0, drain=False, **options):
    """Load, (let the background reads finish), decode, close: (tokens, logits,
    hits, misses, the runtime)."""
    model, _ = load(path, cache_slots=SLOTS, tokenizer=False, **options)
    rt = runtime(model)
    if drain:
        rt.cache.drain()
    tokens, logits = greedy(model, prompt_of(12, seed))
    hits, misses = rt.stats.hits, rt.stats.misses
    rt.close()
    return tokens, logits, hits, misses, rt


def saved_files():
    d = hot_set.hot_dir()
    return sorted(d.iterdir()) if d.exists() else []


def warnings_of(caplog):
    return [r.getMessage() for r in caplog.records if "warm start" in r.getMessage()]


def test_the_hot_set_survives_a_restart_and_the_first_tokens_hit_more(converted):
    # Without lookahead the counts depend on the routing alone, not on the reader's timing.
    path = converted("kimi_k3")
    _, _, cold_hits, cold_misses, cold = run_once(path, lookahead=False)
    [saved] = saved_files()
    body = json.loads(saved.read_text())
    ids = {(int(layer), e) for layer, experts in body["experts"].items() for e in experts}
    assert 0 < len(ids) <= SLOTS  # at most the cache's slots

    model, _ = load(path, cache_slots=SLOTS, tokenizer=False, lookahead=False)
    rt = runtime(model)
    assert rt.hot_set.preloaded == len(ids)
    rt.cache.drain()  # the background reads finish
    assert ids <= set(rt.cache.resident())
    tokens, _ = greedy(model, prompt_of(12))
    assert rt.stats.hits > cold_hits and rt.stats.misses < cold_misses
    rt.close()


def test_each_layer_is_saved_most_valuable_first(converted):
    path = converted("kimi_k3")
    model, _ = load(path, cache_slots=SLOTS, tokenizer=False)
    rt = runtime(model)
    greedy(model, prompt_of(12))
    ranked = rt.cache.pool.ranked()
    rt.close()
    body = json.loads(saved_files()[0].read_text())
    for layer, experts in body["experts"].items():
        m = rt.cache.pool.maps[int(layer)]
        values = m.value(np.array(experts))
        assert experts == ranked[int(layer)] and list(values) == sorted(values, reverse=True)


@pytest.mark.parametrize("arch,slots,partitioned", [
    ("kimi_k3", SLOTS, True), ("qwen3_moe", SLOTS, False),
    ("kimi_k3", 5, False)])  # per-layer partitions, or one map across layers
def test_tokens_are_the_same_cold_and_warm(arch, slots, partitioned, converted, monkeypatch):
    monkeypatch.setattr(__import__(__name__), "SLOTS", slots)
    path = converted(arch)
    run_once(path)  # saves a hot set
    assert saved_files()
    # Warm, with the background reads racing the first tokens; then cold.
    warm_tokens, warm_logits, _, _, warm = run_once(path, seed=1)
    assert warm.hot_set.preloaded > 0 and warm.cache.pool.partitioned == partitioned
    cold_tokens, cold_logits, *_ = run_once(path, seed=1, warm_start=False)
    assert (warm_tokens == cold_tokens).all()
    assert mx.array_equal(warm_logits, cold_logits).item()  # bit-identical


def test_a_smaller_cache_reads_back_what_fits(converted):
    path = converted("kimi_k3")
    run_once(path)
    model, _ = load(path, cache_slots=6, tokenizer=False)
    rt = runtime(model)
    assert 0 < rt.hot_set.preloaded <= 6
    rt.cache.drain()
    assert len(rt.cache.resident()) == rt.hot_set.preloaded
    rt.close()


def test_a_file_from_another_model_is_ignored_with_one_warning(converted, caplog):
    run_once(converted("kimi_k3"))
    [theirs] = saved_files()
    model, _ = load(converted("qwen3_moe"), cache_slots=SLOTS, tokenizer=False)
    rt = runtime(model)
    mine = rt.hot_set.path
    rt.close()
    mine.write_bytes(theirs.read_bytes())  # copied over: the key inside differs
    caplog.clear()
    model, _ = load(converted("qwen3_moe"), cache_slots=SLOTS, tokenizer=False)
    rt = runtime(model)
    [note] = warnings_of(caplog)
    assert str(mine) in note and "another model" in note and "starting cold" in note
    assert rt.hot_set.preloaded == 0 and not rt.cache.resident()
    rt.close()


def write_hot_file(path, key, experts):
    body = {"format": hot_set.FORMAT, "version": hot_set.VERSION, "key": key,
            "experts": experts}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(body))


def load_in_thread(path, timeout=120):
    """load() on a thread: a hang fails the test instead of stopping it."""
    out = {}

    def target():
        try:
            out["model"] = load(path, cache_slots=SLOTS, tokenizer=False)[0]
        except BaseException as e:
            out["error"] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), "load hung on the hot-set file"
    if "error" in out:
        raise out["error"]
    return out["model"]


def damage(kind, target, key):
    if kind == "garbage":
        target.write_bytes(b'{"format": "deltafin-hot-set", "ver\x00\xff')
    elif kind == "not an object":
        target.write_text("[1, 2, 3]")
    elif kind == "ids out of range":
        write_hot_file(target, key, {"1": [0, 1, 99]})
    elif kind == "a layer it lacks":
        write_hot_file(target, key, {"0": [1]})  # layer 0 is dense
    elif kind == "not integers":
        write_hot_file(target, key, {"1": [1.5, True]})
    elif kind == "oversized":
        with open(target, "wb") as f:  # sparse: huge on paper, no disk used
            f.truncate(1 << 30)
    elif kind == "fifo":
        os.mkfifo(target)  # no writer: reading it would block forever
    elif kind == "directory":
        target.mkdir()


KINDS = ["garbage", "not an object", "ids out of range", "a layer it lacks", "not integers",
         "oversized", "fifo", "directory"]


@pytest.mark.parametrize("kind", KINDS)
def test_a_damaged_oversized_or_special_file_is_ignored_without_a_hang(kind, converted, caplog):
    path = converted("kimi_k3")
    model, _ = load(path, cache_slots=SLOTS, tokenizer=False, warm_start=True)
    rt = runtime(model)
    target, key = rt.hot_set.path, rt.hot_set.key
    rt.close()  # nothing ran: nothing resident, nothing saved
    assert not saved_files()
    target.parent.mkdir(parents=True, exist_ok=True)
    damage(kind, target, key)
    caplog.clear()
    model = load_in_thread(path)
    rt = runtime(model)
    [note] = warnings_of(caplog)
    assert str(target) in note and "ignored" in note and "\n" not in note
    assert rt.hot_set.preloaded == 0
    tokens, _ = greedy(model, prompt_of(12), steps=4)  # and the model runs
    rt.close()


def test_warm_start_false_neither_reads_nor_writes_the_file(converted, caplog):
    path = converted("kimi_k3")
    run_once(path, warm_start=False)
    assert not saved_files()  # nothing written
    run_once(path)
    [saved] = saved_files()
    before = saved.read_bytes()
    saved.unlink()
    os.mkfifo(saved)  # read, it would warn (or hang)
    caplog.clear()
    model, _ = load(path, cache_slots=SLOTS, tokenizer=False, warm_start=False)
    rt = runtime(model)
    assert rt.hot_set is None and not warnings_of(caplog)
    assert not rt.cache.resident()
    greedy(model, prompt_of(12), steps=4)
    rt.close()
    assert saved.is_fifo() and before  # left as it was


def test_nothing_is_saved_or_read_when_every_expert_fits(converted):
    model, _ = load(converted("kimi_k3"), tokenizer=False)  # a budget for everything
    rt = runtime(model)
    assert rt.cache.all_resident and rt.hot_set is None
    greedy(model, prompt_of(12), steps=4)
    rt.close()
    assert not saved_files()


def test_closing_before_the_reads_finish_keeps_the_hot_set(converted, monkeypatch):
    path = converted("kimi_k3")
    run_once(path)
    [saved] = saved_files()
    first = json.loads(saved.read_text())["experts"]
    model, _ = load(path, cache_slots=SLOTS, tokenizer=False)
    runtime(model).close()  # at once: reads not yet started are given up, not waited for
    again = json.loads(saved.read_text())["experts"]
    assert {k: sorted(v) for k, v in again.items()} == {k: sorted(v) for k, v in first.items()}


def test_the_key_names_model_dtype_and_rank(converted):
    from deltafin_mlx.format.model_dir import open_model_dir

    a = open_model_dir(converted("kimi_k3")).manifest
    b = open_model_dir(converted("qwen3_moe")).manifest
    keys = {hot_set.hot_key(a, mx.float32), hot_set.hot_key(a, mx.bfloat16),
            hot_set.hot_key(b, mx.float32), hot_set.hot_key(a, mx.float32, 0, 2),
            hot_set.hot_key(a, mx.float32, 1, 2)}
    assert len(keys) == 5
    assert len({hot_set.hot_path(k) for k in keys}) == 5


def test_the_command_line_saves_a_hot_set_unless_told_not_to(converted, monkeypatch, capsys):
    from functools import partial

    import deltafin_mlx.engine.load as load_module
    from deltafin_mlx.cli.main import main

    monkeypatch.setattr(load_module, "load", partial(load, cache_slots=SLOTS))
    path = str(converted("kimi_k3"))
    assert main([path, "Hello", "-n", "4", "--no-warm-start"]) == 0
    assert not saved_files()
    assert main([path, "Hello", "-n", "4"]) == 0
    assert len(saved_files()) == 1
