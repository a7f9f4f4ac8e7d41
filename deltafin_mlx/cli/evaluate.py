"""`deltafin-lm-eval`: lm-evaluation-harness's command line with the "deltafin"
model registered (deltafin_mlx/jobs/lm_eval_model.py), as `mlx_lm.evaluate` is
mlx-lm's: lm-eval 0.4 does not look for models in other packages, so the stock
`lm_eval` command cannot see it. Every failure is one line, as deltafin-run's
(cli/common.py's `guarded`; `--debug`, taken out before lm-eval reads the
arguments, shows the traceback)."""

import sys

from deltafin_mlx.cli.common import guarded, quiet_broken_pipe
from deltafin_mlx.errors import UsageError


@quiet_broken_pipe
def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    return guarded("deltafin-lm-eval", lambda: evaluate([a for a in argv if a != "--debug"]),
                   debug="--debug" in argv)


def evaluate(argv) -> int:
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        raise UsageError("lm-eval is not installed (pip install \"deltafin[eval]\")") from None
    from deltafin_mlx.jobs.lm_eval_model import main as run

    program = sys.argv
    sys.argv = ["deltafin-lm-eval", *argv]  # lm-eval reads its arguments from there
    try:
        run()
    finally:
        sys.argv = program
    return 0


if __name__ == "__main__":
    sys.exit(main())
