"""What the benchmarks share: bench models and cgroups (common), the report
(report), the fresh-process workers (worker), hit rates from the cache simulator
(simulate) and the server harness (server). What the tests use too (the cache
simulator, the stress clients, the peak-memory measurements) is in
deltafin_mlx/testing/."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository
