"""Peak RSS of scoring one long text over the interpreter's baseline, at a budget
(as prefill_peak measures a prompt's). Shared by tests/jobs/test_long_texts.py.

    python -m bench.lib.worker score-peak MODEL BUDGET TOKENS
"""

import json

from bench.lib.worker.prefill_peak import status


def main(argv):
    import mlx.core as mx
    import numpy as np

    import deltafin_mlx
    from deltafin_mlx.engine.load import load
    from deltafin_mlx.jobs.score import ScoreOptions, iter_passes, prepare_all
    from deltafin_mlx.jobs.batch_lines import read_requests

    mx.eval(mx.ones(4) + 1)  # the runtime is part of the baseline
    base = status("VmRSS")
    path, budget, n = argv[0], argv[1], int(argv[2])
    model, tok = load(path, budget, tokenizer=False, warm_start=False)
    tokens = np.random.default_rng(0).integers(1, 700, n).tolist()
    requests = read_requests([json.dumps({"id": 0, "tokens": tokens})], spec_of=dict)
    items, errors = prepare_all(requests, tok, ScoreOptions())
    assert not errors, errors
    passes, logprob = 0, 0.0
    for results, stats in iter_passes(model, items, ScoreOptions()):
        passes += stats.passes
        logprob += sum(s.logprob for s in results)
    peak = status("VmHWM")
    print(json.dumps({"over_baseline": peak - base,
                      "budget": deltafin_mlx.runtime(model).plan.budget,
                      "passes": passes, "logprob": logprob, "tokens": n}))
