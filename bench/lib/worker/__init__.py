"""Every program a benchmark runs in a fresh process, as one module with modes:

    python -m bench.lib.worker decode --model DIR --mode resident     # profiled decode
    python -m bench.lib.worker read-mode MODEL FRACTION MODE PIPELINE TOKENS
    python -m bench.lib.worker budget-decode MODEL MODE BUDGET TOKENS
    python -m bench.lib.worker prefill-run MODEL TOKENS SLOTS DECODE [THROTTLE_FILE VALUE]
    python -m bench.lib.worker prefill-ab MODEL TOKENS REPEATS CONFIG...
    python -m bench.lib.worker sampled-serve FILE serve MODEL [serve options...]
    python -m bench.lib.worker score --model DIR --mode deltafin|mlx-lm [--cache-slots N]
    python -m bench.lib.worker expert-reads MODEL PASSES [THROTTLE_FILE VALUE]

Each mode prints its result as one JSON line (the last line of stdout), except
sampled-serve, a server that writes memory samples to FILE (the peak-memory
measurements the tests share are deltafin_mlx/testing/peak.py). A fresh process per measurement
keeps one run's memory, caches and patches out of the next.
"""

import importlib
import os
import sys

from bench.lib import ROOT

# mode -> the module (in this package) whose main(argv) runs it
MODES = {
    "decode": "decode",
    "read-mode": "read_mode",
    "budget-decode": "budget_decode",
    "prefill-run": "prefill_run",
    "sampled-serve": "sampled_serve",
    "score": "score",
    "expert-reads": "expert_reads",
    "prefill-ab": "prefill_ab",
}


def command(mode: str, *args) -> list:
    """The command line that runs `mode` with `args` in a fresh interpreter."""
    if mode not in MODES:
        raise ValueError(f"unknown worker mode {mode!r}; known: {sorted(MODES)}")
    return [sys.executable, "-m", __name__, mode, *map(str, args)]


def environment() -> dict:
    """This process's environment with the repository root on PYTHONPATH, so that
    `-m bench.lib.worker` resolves whatever the child's working directory."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return env


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] in (["-h"], ["--help"]):
        print(__doc__)
        return 0
    if not argv or argv[0] not in MODES:
        print(__doc__, file=sys.stderr)
        return 2
    module = importlib.import_module(f"{__name__}.{MODES[argv[0]]}")
    return module.main(argv[1:]) or 0
