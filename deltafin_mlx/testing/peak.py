"""Peak memory of one measurement in a fresh process, for the tests and the benchmarks
alike (so both measure the same thing): peak RSS (VmHWM) over the interpreter's
baseline once MLX is up. A fresh process keeps one run's memory, caches and patches
out of the next; its result is one JSON line, the last of stdout.

    python -m deltafin_mlx.testing.peak prefill-peak MODEL BUDGET TOKENS STEP|plan
    python -m deltafin_mlx.testing.peak score-peak MODEL BUDGET TOKENS [LOGPROBS.npy]
    python -m deltafin_mlx.testing.peak score-job MODEL BUDGET IN OUT
    python -m deltafin_mlx.testing.peak server-baseline

prefill-peak: a random prompt of TOKENS prefilled at one pass size (STEP) or the
memory plan's ("plan"). score-peak: one random text of TOKENS scored (its
log-probabilities saved to LOGPROBS.npy if given). score-job: `deltafin-run score`'s
job on IN, with how many result lines OUT holds after each pass (written as the
passes finish, not at the end). server-baseline: a process that has imported what a
server imports, with no model (the baseline a server's peak is compared with).
"""

import json
import subprocess
import sys


def command(mode: str, *args) -> list:
    """The command line that measures `mode` with `args` in a fresh interpreter."""
    if mode not in MODES:
        raise ValueError(f"unknown measurement {mode!r}; known: {sorted(MODES)}")
    return [sys.executable, "-m", __name__, mode, *map(str, args)]


def measure(mode: str, *args, timeout=3000) -> dict:
    """Runs `mode` in a fresh interpreter and returns its JSON result."""
    p = subprocess.run(command(mode, *args), capture_output=True, text=True, timeout=timeout)
    if p.returncode != 0:
        raise RuntimeError(f"{mode} failed:\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def status(field: str, pid="self") -> int:
    """VmRSS now, or VmHWM its peak, in bytes (ru_maxrss would count the parent's)."""
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def peak_rss(pid) -> int:
    """Another process's peak RSS (0 once it is gone)."""
    try:
        return status("VmHWM", pid)
    except (OSError, StopIteration):
        return 0


def baseline_rss() -> int:
    try:
        return measure("server-baseline", timeout=600)["peak"]
    except (RuntimeError, subprocess.TimeoutExpired):
        return 0


def prefill_peak(path, budget, n, step):
    import numpy as np

    from deltafin_mlx.engine.load import load
    from deltafin_mlx.engine.runtime import runtime
    from deltafin_mlx.generation.stream import stream_generate

    base = status("VmRSS")
    n = int(n)
    model, tok = load(path, budget, context=n + 256)
    prompt = np.random.default_rng(0).integers(1, 700, n).tolist()
    extra = {} if step == "plan" else {"prefill_step_size": int(step)}
    for r in stream_generate(model, tok, prompt, 2, **extra):
        pass
    plan = runtime(model).plan
    return {"over_baseline": status("VmHWM") - base, "budget": plan.budget,
            "step": plan.prefill_step, "pass": plan.prefill_pass, "prompt": r.prompt_tokens}


def score_peak(path, budget, n, out=None):
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
    passes, logprob, logprobs = 0, 0.0, None
    for results, stats in iter_passes(model, items, ScoreOptions()):
        passes += stats.passes
        logprob += sum(s.logprob for s in results)
        logprobs = results[0].token_logprobs if results else logprobs
    if out is not None:
        np.save(out, logprobs)
    return {"over_baseline": status("VmHWM") - base, "budget": runtime(model).plan.budget,
            "passes": passes, "logprob": logprob, "tokens": int(n)}


def score_job(path, budget, src, dst):
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


def server_baseline():
    import mlx_lm.server  # noqa: F401  (imported for its memory, as the server does)

    import deltafin_mlx.engine.load  # noqa: F401

    return {"peak": status("VmHWM")}


MODES = {"prefill-peak": prefill_peak, "score-peak": score_peak, "score-job": score_job,
         "server-baseline": server_baseline}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in MODES:
        print(__doc__, file=sys.stderr)
        return 2
    import mlx.core as mx

    mx.eval(mx.ones(4) + 1)  # the runtime is part of the baseline
    print(json.dumps(MODES[argv[0]](*argv[1:])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
