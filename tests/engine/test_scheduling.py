"""Scheduling rules for expert reads: demand reads go before guesses, a guess never
takes a slot in use, stale guesses are dropped unread, guesses are only queued when
their measured gain beats their disk time, and none of it changes a token."""

import threading
import time
from types import SimpleNamespace

import mlx.core as mx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import deltafin_mlx.engine.reader as rd
from deltafin_mlx.engine.cache import CacheStats
from deltafin_mlx.engine.load import load
from deltafin_mlx.engine.policy import ExpertPool
from deltafin_mlx.engine.reader import ReadCancelled, ReadJob, Reader
from deltafin_mlx.engine.streaming_moe import IORates
from deltafin_mlx.testing.decode import greedy
from test_runtime import expected, prompt_of  # noqa: F401  (fixture)

from deltafin_mlx import runtime


class GatedReads:
    """Stands in for read_record: records the order of reads; every read waits
    until `release` is set."""

    def __init__(self):
        self.order = []
        self.release = threading.Event()
        self.first_taken = threading.Event()

    def __call__(self, bank, expert, targets, staging, verify):
        self.first_taken.set()
        self.release.wait(10)
        self.order.append(expert)


def job(expert, speculative):
    return ReadJob(bank=None, expert=expert, targets={}, speculative=speculative)


def test_demand_reads_are_served_before_queued_guesses(monkeypatch):
    gate = GatedReads()
    monkeypatch.setattr(rd, "read_record", gate)
    reader = Reader(record_size=1, threads=1, checks="off")  # fake banks
    first = reader.submit(job(0, speculative=False))
    assert gate.first_taken.wait(5)  # the thread is busy with read 0
    guesses = [reader.submit(job(e, speculative=True)) for e in (1, 2, 3)]
    demands = [reader.submit(job(e, speculative=False)) for e in (4, 5)]
    gate.release.set()
    for j in [first, *guesses, *demands]:
        assert j.done.wait(5)
    reader.close()
    assert gate.order == [0, 4, 5, 1, 2, 3]


def test_a_cancelled_guess_is_never_read_and_a_started_one_cannot_be_cancelled(monkeypatch):
    gate = GatedReads()
    monkeypatch.setattr(rd, "read_record", gate)
    reader = Reader(record_size=1, threads=1, checks="off")  # fake banks
    started = reader.submit(job(0, speculative=True))
    assert gate.first_taken.wait(5)
    queued = reader.submit(job(1, speculative=True))
    assert not reader.cancel(started)  # its bytes may already be landing
    assert reader.cancel(queued)
    gate.release.set()
    assert started.done.wait(5) and queued.done.wait(5)
    reader.close()
    assert gate.order == [0]
    assert started.error is None
    assert isinstance(queued.error, ReadCancelled)
    assert reader.reads == 1


# A random history of calls and guesses on a pool: guesses with the highest
# possible worth still never take a protected slot.
pool_steps = st.lists(
    st.tuples(st.integers(0, 2), st.lists(st.integers(0, 7), min_size=1, max_size=3, unique=True),
              st.lists(st.integers(0, 7), max_size=4, unique=True)),
    min_size=1, max_size=40)


@settings(max_examples=60, deadline=None)
@given(pool_steps, st.sampled_from([4, 9]))  # 4 slots: one shared map; 9: partitions
def test_a_guess_never_evicts_a_slot_in_use(history, slots):
    pool = ExpertPool(slots, 8, [0, 1, 2], experts_per_token=3)
    for layer, experts, guesses in history:
        pool.use(layer, experts, tokens=1)
        in_use = {(layer, e) for e in experts}
        for e in experts:
            if pool.slot_of(layer, e) is None:
                try:
                    pool.place(layer, e, in_use)
                except RuntimeError:
                    pass
        nxt = (layer + 1) % 3
        for e in guesses:
            if pool.slot_of(nxt, e) is not None:
                continue
            before = pool.resident()
            slot = pool.place(nxt, e, in_use, speculative=True, worth=1.0)
            if slot is None:
                assert pool.resident() == before
                continue
            displaced = [k for k, s in before.items() if s == slot]
            assert not (set(displaced) & in_use)
            for key in in_use:  # what the call uses stays where it was
                assert pool.resident().get(key) == before.get(key)


def fake_reader(busy, reads, threads=1):
    return SimpleNamespace(busy_seconds=busy, reads=reads, threads=threads)


def rates_after(calls, layer_s, read_s, reads_per_call, stall_s=0.0):
    """IORates fed `calls` layer calls `layer_s` apart (of which `stall_s` stalled
    on reads), each with that many reads of `read_s` seconds on one thread."""
    rates, stats = IORates(), CacheStats()
    busy = reads = 0
    for i in range(calls):
        rates.tick(fake_reader(busy, reads), stats, now=i * layer_s)
        reads += reads_per_call
        busy += reads_per_call * read_s
        stats.stall_seconds += stall_s
    return rates


def test_guesses_run_while_calls_wait_on_a_disk_with_time_to_spare():
    # Reads take a tenth of a layer's computation, the disk idles 80% of the time,
    # and calls spend 4 of their 14 ms waiting on reads.
    rates = rates_after(50, layer_s=0.014, read_s=0.0014, reads_per_call=2, stall_s=0.004)
    assert rates.busy == pytest.approx(0.2, abs=0.05)
    assert rates.stall_share == pytest.approx(0.29, abs=0.02)
    assert rates.guesses_pay(0.3)
    assert not rates.guesses_pay(0.1)


def test_no_guesses_where_calls_rarely_wait_on_reads():
    # The compute-bound regime: pipelining hides the demand reads (calls stall 10%
    # of their time), so a right guess removes little and every guess's read slows
    # the arithmetic; even guesses that are always right are not queued.
    rates = rates_after(50, layer_s=0.010, read_s=0.001, reads_per_call=2, stall_s=0.001)
    assert rates.busy == pytest.approx(0.2, abs=0.05)
    assert rates.stall_share == pytest.approx(0.1, abs=0.02)
    assert not rates.guesses_pay(1.0)


def test_guesses_stop_when_reads_saturate_the_disk_even_if_reads_are_cheap():
    # Reads as cheap as a tenth of a layer, but so many that the disk never rests
    # (a small cache): a right guess saves no disk time, a wrong one costs it.
    rates = rates_after(50, layer_s=0.010, read_s=0.001, reads_per_call=10)
    assert rates.busy == pytest.approx(1.0, abs=0.05)
    assert not rates.guesses_pay(0.9)


def test_guesses_stop_where_reading_an_expert_costs_many_times_computing_it():
    # R = 32: a read costs 4 layer calls' time and the disk never rests.
    rates = rates_after(50, layer_s=0.008, read_s=0.032, reads_per_call=0.25)
    assert rates.busy == pytest.approx(1.0, abs=0.05)
    assert not rates.guesses_pay(0.5)
    assert not rates.guesses_pay(0.95)  # a saturated disk has no time to hide reads in


def test_time_stalled_on_reads_hides_no_guess():
    # Calls 40 ms apart, 32 of them waiting for the 32 ms read each call needs:
    # only 8 ms of computation could hide a read started early.
    rates = rates_after(50, layer_s=0.040, read_s=0.032, reads_per_call=1, stall_s=0.032)
    assert rates.layer_s == pytest.approx(0.008)
    assert not rates.guesses_pay(0.5)


def test_disk_busy_share_is_weighted_by_time_not_by_call():
    # Calls alternate: 10 ms with no read ending in it, 90 ms in which 85 ms of
    # reads end (misses wait for the disk). The disk is busy 85% of the time,
    # not the 47% a mean of the two calls' shares would say, and no guess pays.
    rates, stats = IORates(), CacheStats()
    now = busy = 0.0
    for i in range(60):
        rates.tick(fake_reader(busy, i), stats, now=now)
        long_call = i % 2
        now += 0.090 if long_call else 0.010
        busy += 0.085 if long_call else 0.0
    assert rates.busy == pytest.approx(0.85, abs=0.05)
    assert not rates.guesses_pay(0.63)


def test_a_disk_that_banks_idle_time_is_busy_when_calls_wait_on_it():
    # A token-bucket throttle: each read takes 3 ms once it has credit, but calls
    # spend 12 of their 20 ms waiting for reads. Reader time says 45% busy; the
    # disk delivers no more than it does now, so a guess would only take credit
    # a demand read needs next.
    rates, stats = IORates(), CacheStats()
    busy = reads = 0
    for i in range(50):
        rates.tick(fake_reader(busy, reads), stats, now=i * 0.020)
        reads += 3
        busy += 3 * 0.003
        stats.stall_seconds += 0.012
    assert rates.busy == pytest.approx(1.0, abs=0.05)
    assert not rates.guesses_pay(0.63)


def test_share_of_guesses_used_never_exceeds_one():
    # Guesses issued in one call and used in later ones: the running counts of
    # used and issued can cross; the share cannot.
    rates, stats = IORates(), CacheStats()
    reader = fake_reader(0.0, 0)
    for i in range(20):
        if i % 4 == 0:
            stats.speculative_issued += 4
        else:
            stats.speculative_used += 2
        rates.tick(reader, stats, now=i * 0.01)
        assert 0.0 <= rates.right <= 1.0


def test_a_guess_read_that_outlasts_a_layer_does_not_pay_even_on_an_idle_disk():
    # R = 32 with most experts cached: the disk is idle 70% of the time, but a read
    # takes 32 ms against 8 ms of computation per layer, so a wrong guess is still
    # being read when the next layer routes and holds its demand reads back.
    rates = rates_after(200, layer_s=0.012, read_s=0.032, reads_per_call=0.1125,
                        stall_s=0.004)
    assert rates.busy == pytest.approx(0.3, abs=0.05)
    assert rates.layer_s == pytest.approx(0.008)
    assert not rates.guesses_pay(0.75)
    # Reads shorter than a layer's computation on the same idle disk still pay.
    assert rates_after(200, layer_s=0.012, read_s=0.004, reads_per_call=0.9,
                       stall_s=0.004).guesses_pay(0.75)


def test_guesses_allowed_before_anything_is_measured():
    assert IORates().guesses_pay(0.5)


def test_stale_guesses_are_dropped_unread_and_tokens_stay_exact(converted, expected,
                                                              monkeypatch):
    """With reads slow enough that guesses are still queued when their layer
    routes, the unchosen ones are cancelled (never read, slots freed) and the
    tokens and logits stay those of mlx-lm."""
    real = rd.read_record

    def slow(*a, **k):
        time.sleep(0.004)
        return real(*a, **k)

    monkeypatch.setattr(rd, "read_record", slow)
    monkeypatch.setattr(IORates, "guesses_pay", lambda self, right=None: True)
    path = converted("kimi_k3")
    model, _ = load(path, cache_slots=12, reader_threads=1, lookahead=True, tokenizer=False)
    tokens, logits = greedy(model, prompt_of(12), 16)
    ref_tokens, ref_logits = expected("kimi_k3", 1, 12, 16)
    stats = runtime(model).stats
    store = runtime(model).store
    cache = store.cache
    assert stats.speculative_cancelled > 0
    # Every read counted was a real read: demand misses plus guesses not dropped.
    assert store.reader.reads <= stats.misses + stats.speculative_issued - stats.speculative_cancelled
    assert all(not j.cancelled for j in cache.pending.values())
    assert (tokens == ref_tokens).all()
    assert mx.array_equal(logits, ref_logits).item()
    runtime(model).close()
