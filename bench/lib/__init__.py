"""What the benchmarks share, and what tests may import: bench models and
cgroups (common), the report (report), the fresh-process workers (worker), the
cache simulator (cache_simulator, simulate) and the server harness (server,
server_stress)."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository
