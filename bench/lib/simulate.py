"""Hit rate against cache size, from deltafin_mlx.testing.cache_simulator (used unchanged):
on generated routing at Kimi K3's size (896 experts, 16 per token) and on routing
traces recorded from the bench models. Part of bench.run's report and of the K3
projection."""

from pathlib import Path

from deltafin_mlx.testing import cache_simulator as sc

GRID = [0.02, 0.05, 0.10, 0.25, 0.50, 0.75]
SIZES = {"quick": dict(tokens=1024, layers=2), "full": dict(tokens=2048, layers=4)}
_TRACES = {}


def _k3_trace(preset: str, mode: str):
    key = (preset, mode)
    if key not in _TRACES:
        _TRACES[key] = sc.generate_trace(896, 16, seed=0, **SIZES[mode], **sc.PRESETS[preset])
    return _TRACES[key]


def k3_hit_rates(fractions, mode="quick", preset="skewed", policy="SlotMap") -> dict:
    trace = _k3_trace(preset, mode)
    return {f: sc.hit_rate(policy, trace, 896, f) for f in fractions}


def simulate_all(results: dict, mode: str) -> dict:
    out = {"k3": {}, "bench": {}, "grid": GRID,
           "note": "per-layer caches of fraction x experts (the simulator's model); "
                   "demand fetching only"}
    for preset in ("skewed", "uniform"):
        trace = _k3_trace(preset, mode)
        out["k3"][preset] = {
            "overlap": sc.overlap(trace[0]),
            "rates": {p: [sc.hit_rate(p, trace, 896, f) for f in GRID]
                      for p in ("LRU", "SlotMap", "Belady")},
            "tokens": len(trace[0]), "layers": len(trace),
        }
    for scale in results.get("scales", []):
        path = scale.get("trace")
        if not path or not Path(path).exists():
            continue
        trace = sc.load_trace(path)
        n = scale["model"]["num_experts"]
        out["bench"][scale["name"]] = {
            "overlap": sum(sc.overlap(l) for l in trace) / len(trace),
            "rates": {p: [sc.hit_rate(p, trace, n, f) for f in GRID]
                      for p in ("LRU", "SlotMap", "Belady")},
            "tokens": len(trace[0]), "layers": len(trace),
        }
    return out
