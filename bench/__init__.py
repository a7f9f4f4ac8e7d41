"""Deltafin's benchmarks, run from the repository root as modules:
`python -m bench.run --quick`, `python -m bench.experiments`,
`python -m bench.studies.NAME` (one question each). `bench.lib` holds the
pieces they share, and the only part of bench that tests import; results are
written under bench/results/.
"""
