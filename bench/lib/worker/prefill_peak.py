"""Peak RSS of a long prompt's prefill over the interpreter's baseline, at one
prefill pass (an integer) or the memory plan's ("plan"). Shared by
bench.studies.prefill_memory and tests/engine/test_prefill_memory.py, so that both
measure the same thing.

    python -m bench.lib.worker prefill-peak MODEL BUDGET TOKENS STEP|plan
"""

import json

from deltafin_mlx import runtime


def status(field):
    """VmRSS now, or VmHWM its peak (ru_maxrss would count the parent's)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def main(argv):
    import mlx.core as mx
    import numpy as np

    from deltafin_mlx.engine.load import load
    from deltafin_mlx.generation.stream import stream_generate

    mx.eval(mx.ones(4) + 1)  # the runtime is part of the baseline
    base = status("VmRSS")
    path, budget, n, step = argv[0], argv[1], int(argv[2]), argv[3]
    model, tok = load(path, budget, context=n + 256)
    prompt = np.random.default_rng(0).integers(1, 700, n).tolist()
    extra = {} if step == "plan" else {"prefill_step_size": int(step)}
    for r in stream_generate(model, tok, prompt, 2, **extra):
        pass
    peak = status("VmHWM")
    print(json.dumps({"over_baseline": peak - base, "budget": runtime(model).plan.budget,
                      "step": runtime(model).plan.prefill_step,
                      "pass": runtime(model).plan.prefill_pass, "prompt": r.prompt_tokens}))
