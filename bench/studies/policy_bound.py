"""How close can an online cache policy get to Belady on a routing trace?

The shipped policy (the runtime's ExpertPool, through deltafin_mlx.testing.cache_simulator)
against the best member of a broad family of online policies, each tuned in
hindsight on the trace itself: an upper bound for online policies of these kinds,
not something a runtime could ship (its parameters are chosen by looking at the
answer). The shipped policy is also checked on the trace's two halves and on
sub-traces of its layers (first / second half, even / odd), where no parameter was
tuned, to see that its ratio is a property of routing rather than of one file.

    python -m bench.studies.policy_bound --trace TRACE.jsonl

Family (one pool of `fraction` of all experts, calls layer by layer, demand fetch):
LRU; LFU; SlotMap over all layers with half-life 32/128, repeat weight 0.5/1,
recent bonus 0/0.05/0.2 and distance power 0-3 (value / calls-until-its-layer**p);
per-layer partitions of SlotMap with half-life 32-256, repeat weight 0.5/1 and
staleness on/off (where every layer has room for a token); and a policy that learns
online the chance of reuse by (tokens since last use, decayed rate) class, with
distance power 0-3, shared or partitioned.

Then a foresight ladder: Belady that sees only the next h tokens' routing (and
beyond that evicts like the shipped shared map), for h = 0..8 tokens. It shows how
much knowledge of tokens not yet decoded a policy would need to get within a
given factor of Belady's misses.
"""

import argparse
import itertools
import json
from pathlib import Path

import numpy as np

from deltafin_mlx.testing import cache_simulator as sc
from deltafin_mlx.engine.policy import SlotMap


def _calls_away(num_layers, num_experts, position, power):
    away = (np.arange(num_layers) - position) % num_layers
    away[away == 0] = num_layers
    return np.repeat(away.astype(np.float64) ** -power, num_experts)


class SharedMap:
    """One SlotMap over all layers' experts, values scaled by layer distance."""

    def __init__(self, slots, n, layers, power=0.0, **kw):
        self.map = SlotMap(slots, n * layers, **kw)
        self.n, self.layers, self.power, self.calls = n, layers, power, 0

    def use(self, keys):
        pos = self.calls % self.layers
        self.calls += 1
        self.map.use(keys, tokens=1 if pos == 0 else 0)
        if self.power:
            self.map.weight = lambda: _calls_away(self.layers, self.n, pos, self.power)

    def slot_of(self, key):
        return self.map.slot_of(key)

    def place(self, key, protected=()):
        return self.map.place(key, protected)


class Partitioned:
    """Equal per-layer partitions, each a SlotMap."""

    def __init__(self, slots, n, layers, **kw):
        self.share = slots // layers
        self.maps = [SlotMap(self.share, n, **kw) for _ in range(layers)]
        self.n = n

    def use(self, keys):
        self.maps[keys[0] // self.n].use([k % self.n for k in keys], tokens=1)

    def slot_of(self, key):
        s = self.maps[key // self.n].slot_of(key % self.n)
        return None if s is None else s + (key // self.n) * self.share

    def place(self, key, protected=()):
        layer = key // self.n
        keep = {k % self.n for k in protected if k // self.n == layer}
        return self.maps[layer].place(key % self.n, keep) + layer * self.share


class Learned:
    """Reuse chance learned online per (tokens since last use, decayed-rate octave)
    class; value = that chance / calls-until-its-layer ** power."""

    AGES, LO, HI = 8, -4, 4

    def __init__(self, slots, n, layers, k, power=0.0, partitioned=False, half_life=32.0):
        self.n, self.layers, self.k, self.power = n, layers, k, power
        total = n * layers
        self.keep, self.inc, self.t = 0.5 ** (1 / half_life), 1.0, 0
        self.count = np.zeros(total)
        self.last = np.full(total, -(2**40))
        self.rates = (self.HI - self.LO) * 2 + 2
        classes = (self.AGES + 1) * self.rates
        self.hits, self.seen = np.full(classes, 2 * k / n), np.full(classes, 2.0)
        self.slot = np.full(total, -1)
        self.expert_in = np.full(slots, -1)
        self.share = slots // layers if partitioned else None
        self.free = ([list(range((l + 1) * self.share - 1, l * self.share - 1, -1))
                      for l in range(layers)] if partitioned else list(range(slots - 1, -1, -1)))

    def _rate(self, keys):
        return self.count[keys] * (1 - self.keep) / self.inc

    def _class(self, keys):
        age = np.clip(self.t - self.last[keys], 1, self.AGES + 1) - 1
        r = self._rate(keys) * self.n / self.k
        octave = np.floor((np.log2(np.maximum(r, 1e-12)) - self.LO) * 2).astype(int) + 1
        octave = np.where(r > 0, np.clip(octave, 0, self.rates - 1), 0)
        return age * self.rates + octave

    def use(self, keys):
        keys = np.asarray(keys)
        self.pos = int(keys[0] // self.n)
        if self.pos == 0:
            self.t += 1
            self.inc /= self.keep
        layer_keys = np.arange(self.pos * self.n, (self.pos + 1) * self.n)
        cls = self._class(layer_keys)
        used = np.zeros(self.n)
        used[keys - self.pos * self.n] = 1
        self.hits += np.bincount(cls, used, minlength=len(self.hits))
        self.seen += np.bincount(cls, minlength=len(self.seen))
        self.count[keys] += self.inc
        self.last[keys] = self.t
        self.values = None

    def slot_of(self, key):
        s = self.slot[key]
        return None if s < 0 else int(s)

    def place(self, key, protected=()):
        layer = key // self.n
        free = self.free[layer] if self.share else self.free
        if free:
            s = free.pop()
        else:
            if self.values is None:
                keys = np.arange(self.n * self.layers)
                cls = self._class(keys)
                p = self.hits[cls] / self.seen[cls] + 1e-3 * self._rate(keys)
                self.values = p * _calls_away(self.layers, self.n, self.pos, self.power)
            v = self.values.copy()
            v[list(protected)] = np.inf
            if self.share:
                lo = layer * self.share
                s = lo + int(v[self.expert_in[lo:lo + self.share]].argmin())
            else:
                s = int(v[self.expert_in].argmin())
            self.slot[self.expert_in[s]] = -1
        self.expert_in[s] = key
        self.slot[key] = s
        return s


def family(slots, n, layers, k):
    """(name, factory) for every member of the policy family at this size."""
    yield "LRU", lambda: sc.LRU(slots, n * layers)
    yield "LFU", lambda: sc.LFU(slots, n * layers)
    for hl, rw, rb, p in itertools.product((32, 128), (0.5, 1.0), (0.0, 0.05, 0.2), (0, 1, 2, 3)):
        yield (f"shared hl={hl} repeat={rw} bonus={rb} power={p}",
               lambda hl=hl, rw=rw, rb=rb, p=p: SharedMap(
                   slots, n, layers, p, half_life=hl, repeat_weight=rw, recent_bonus=rb))
    for p in (0, 1, 2, 3):
        yield f"learned shared power={p}", lambda p=p: Learned(slots, n, layers, k, p)
    if slots >= layers * k:
        for hl, rw, st in itertools.product((32, 64, 128, 256), (0.5, 1.0), (3.0, 1e9)):
            yield (f"partitioned hl={hl} repeat={rw} stale_after={st:g}",
                   lambda hl=hl, rw=rw, st=st: Partitioned(
                       slots, n, layers, half_life=hl, repeat_weight=rw, stale_after=st))
        yield "learned partitioned", lambda: Learned(slots, n, layers, k, 0, partitioned=True)


def pool_size(trace, n, fraction):
    calls = sc.shared_calls(trace, n)
    widest = max(len(set(c)) for c in calls)
    return calls, min(n * len(trace), max(widest, round(fraction * n * len(trace)))), widest


def bound(trace, n, fraction) -> dict:
    calls, slots, k = pool_size(trace, n, fraction)
    belady = sc.simulate_layer(sc.Belady(slots, calls), calls)
    belady = belady[0] / belady[1]
    rates = {}
    for name, make in family(slots, n, len(trace), k):
        h, a = sc.simulate_layer(make(), calls)
        rates[name] = h / a / belady
    best = max(rates, key=rates.get)
    shipped = sc.shared_hit_rate("SlotMap", trace, n, fraction) / belady
    return {"slots": slots, "belady": belady, "shipped": shipped, "best": best,
            "bound": rates[best], "family": rates}


# Foresight in tokens; 0 is online. Decoding knows nothing past the token it is
# computing, so anything h > 0 buys is out of an online policy's reach.
FORESIGHT_TOKENS = (0, 1, 2, 3, 4, 8)


def sub_traces(trace):
    """The trace's halves (in time) and four sub-traces of its layers."""
    t, L = len(trace[0]), len(trace)
    return {
        "first half": [layer[: t // 2] for layer in trace],
        "second half": [layer[t // 2:] for layer in trace],
        "layers first half": trace[: L // 2],
        "layers second half": trace[L // 2:],
        "even layers": trace[0::2],
        "odd layers": trace[1::2],
    }


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", required=True)
    ap.add_argument("--fractions", type=float, nargs="+", default=[0.10, 0.25])
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    trace = sc.load_trace(args.trace)
    n = 1 + max(e for layer in trace for tok in layer for e in tok)
    out = {}
    for f in args.fractions:
        r = bound(trace, n, f)
        print(f"{f:.0%} ({r['slots']} slots): Belady hit rate {r['belady']:.3f}; shipped "
              f"{r['shipped']:.3f} of Belady; best in hindsight {r['bound']:.3f} ({r['best']}); "
              f"gap {r['bound'] - r['shipped']:.3f}", flush=True)
        top = sorted(r["family"].items(), key=lambda kv: -kv[1])[:5]
        for name, v in top:
            print(f"    {v:.3f}  {name}")
        checks = {}
        for name, sub in sub_traces(trace).items():
            sub_bound = bound(sub, n, f)
            checks[name] = {k: sub_bound[k] for k in ("slots", "shipped", "bound", "best")}
            print(f"  {name:>20}: shipped {sub_bound['shipped']:.3f}, best in hindsight "
                  f"{sub_bound['bound']:.3f} ({sub_bound['best']})", flush=True)
        r["checks"] = checks
        # What foresight buys: Belady seeing only h tokens ahead (of every layer).
        belady_misses = 1 - r["belady"]
        r["foresight"] = {}
        for h in FORESIGHT_TOKENS:
            miss = (1 - sc.foresight_hit_rate(trace, n, f, h)) / belady_misses
            r["foresight"][h] = miss
        print("  misses / Belady's, seeing h tokens ahead: " + ", ".join(
            f"h={h}: {m:.2f}" for h, m in r["foresight"].items())
              + f"  (shipped, h=0: {(1 - r['shipped'] * r['belady']) / belady_misses:.2f})",
              flush=True)
        out[str(f)] = r
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
