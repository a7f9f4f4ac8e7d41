"""Simulate expert caches on a routing trace and compare policies (the simulator
is deltafin_mlx.testing.cache_simulator; its docstring says what it models).

    python -m bench.studies.simulate_cache                       # all presets, both sizes
    python -m bench.studies.simulate_cache --preset skewed --experts 64 --k 4
    python -m bench.studies.simulate_cache --trace routing.jsonl --json out.json
"""

import argparse
import json
import time
from pathlib import Path

import numpy as np

from deltafin_mlx.testing.cache_simulator import (FRACTIONS, PRESETS, SIZES, generate_trace,
                                                  load_trace, overlap, run)


def format_table(name: str, rows: dict) -> str:
    cols = [c for c in next(iter(rows.values())) if c != "slots"]
    lines = [f"{name}", f"  {'cache':>11}  " + "  ".join(f"{c:>14}" for c in cols)]
    for fraction, row in rows.items():
        cache = f"{fraction:.0%} ({row['slots']})"
        lines.append(f"  {cache:>11}  " + "  ".join(f"{row[c]:>14.3f}" for c in cols))
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", help="routing trace JSONL (default: generated presets)")
    parser.add_argument("--preset", choices=sorted(PRESETS), action="append",
                        help="generated preset(s) to run (default: all)")
    parser.add_argument("--experts", type=int, help="experts per layer (default: 896 and 64)")
    parser.add_argument("--k", type=int, help="experts per token (default: 16 and 4)")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--zipf", type=float, help="override the preset's Zipf exponent")
    parser.add_argument("--repeat", type=float, help="override the preset's repeat probability")
    parser.add_argument("--drift-every", type=int, help="override the preset's drift period (tokens)")
    parser.add_argument("--drift-frac", type=float, help="override the preset's share of experts re-ranked")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--fractions", type=float, nargs="+", default=FRACTIONS)
    parser.add_argument("--per-layer", action="store_true",
                        help="one cache per layer instead of the runtime's shared pool")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    if (args.experts is None) != (args.k is None) and not args.trace:
        parser.error("give --experts and --k together")

    cases = []  # (name, trace, num_experts)
    if args.trace:
        trace = load_trace(args.trace)
        n = args.experts or 1 + max(e for layer in trace for tok in layer for e in tok)
        cases.append((Path(args.trace).name, trace, n))
    else:
        sizes = [(args.experts, args.k)] if args.experts else SIZES
        for preset in args.preset or list(PRESETS):
            params = dict(PRESETS[preset])
            for name in params:
                if getattr(args, name) is not None:
                    params[name] = getattr(args, name)
            for n, k in sizes:
                trace = generate_trace(n, k, args.tokens, args.layers, seed=args.seed, **params)
                cases.append((f"{preset} N={n} k={k}", trace, n))

    results = {}
    for name, trace, n in cases:
        start = time.perf_counter()
        rows = run(trace, n, args.fractions, shared=not args.per_layer)
        shared = np.mean([overlap(layer) for layer in trace])
        took = time.perf_counter() - start
        print(format_table(f"{name}  (overlap {shared:.0%}, {len(trace[0])} tokens x "
                           f"{len(trace)} layers, {took:.1f}s)", rows))
        print()
        results[name] = {
            "cache": "per layer" if args.per_layer else "shared pool",
            "overlap": shared,
            "tokens": len(trace[0]),
            "layers": len(trace),
            "hit_rate": {str(f): r for f, r in rows.items()},
        }
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
