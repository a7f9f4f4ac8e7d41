"""Measurements of a pass's memory in a fresh process, for tests/engine/test_pass_bars.py:
peak RSS (VmHWM) over the interpreter's baseline once MLX is up, as
bench.lib.worker's prefill-peak and score-peak measure it. Each mode prints one
JSON line (the last line of stdout).

    python tests/peak_worker.py score-text MODEL BUDGET TOKENS LOGPROBS.npy
    python tests/peak_worker.py score-job MODEL BUDGET IN OUT
"""

import json
import sys


def status(field):
    """VmRSS now, or VmHWM its peak (ru_maxrss would count the parent's)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def score_text(path, budget, n, out):
    """One text of `n` random token ids scored at `budget`: its log-probabilities
    saved to `out`, the passes it took and the peak."""
    import numpy as np

    from deltafin_mlx.engine.load import load
    from deltafin_mlx.engine.runtime import runtime
    from deltafin_mlx.jobs.batch_lines import read_requests
    from deltafin_mlx.jobs.score import ScoreOptions, iter_passes, prepare_all

    base = status("VmRSS")
    model, tok = load(path, budget, tokenizer=False, warm_start=False)
    tokens = np.random.default_rng(0).integers(1, 700, int(n)).tolist()
    requests = read_requests([json.dumps({"id": 0, "tokens": tokens})], spec_of=dict)
    items, errors = prepare_all(requests, tok, ScoreOptions())
    assert not errors, errors
    passes, logprobs = 0, None
    for results, stats in iter_passes(model, items, ScoreOptions()):
        passes += stats.passes
        logprobs = results[0].token_logprobs
    np.save(out, logprobs)
    return {"over_baseline": status("VmHWM") - base, "budget": runtime(model).plan.budget,
            "passes": passes, "tokens": int(n)}


def score_job(path, budget, src, dst):
    """`deltafin-run score`'s job on IN at `budget`; after each pass, how many result
    lines OUT holds already (written as the passes finish, not at the end)."""
    import deltafin_mlx.jobs.score as score
    from deltafin_mlx.engine.load import load
    from deltafin_mlx.engine.runtime import runtime

    base = status("VmRSS")
    model, tok = load(path, budget, warm_start=False)
    written = []
    passes = score.iter_passes

    def counted(*args, **kwargs):
        for done in passes(*args, **kwargs):
            yield done
            with open(dst, "rb") as f:  # run_job wrote this pass's lines before resuming us
                written.append(sum(1 for _ in f))

    score.iter_passes = counted
    s = score.run_job(model, tok, src, dst, score.ScoreOptions(), show_progress=False)
    return {"over_baseline": status("VmHWM") - base, "budget": runtime(model).plan.budget,
            "summary": s, "written_after_each_pass": written}


def main(argv):
    import mlx.core as mx

    mx.eval(mx.ones(4) + 1)  # the runtime is part of the baseline
    mode, *args = argv
    result = {"score-text": score_text, "score-job": score_job}[mode](*args)
    print(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1:])
