"""`deltafin-lm-eval`: lm-evaluation-harness's command line with the "deltafin"
model registered (deltafin_mlx/jobs/lm_eval_model.py), as `mlx_lm.evaluate` is
mlx-lm's: lm-eval 0.4 does not look for models in other packages, so the stock
`lm_eval` command cannot see it."""

import sys


def main():
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        print("deltafin-lm-eval: error: lm-eval is not installed (pip install "
              "\"deltafin[eval]\")", file=sys.stderr)
        return 1
    from deltafin_mlx.jobs.lm_eval_model import main as run

    run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
