"""Decode with one read mode and pipeline setting at a cache of `fraction` of all
experts (bench.studies.read_modes): s/token and the share stalled on reads.

    python -m bench.lib.worker read-mode MODEL FRACTION direct|mmap 1|0 TOKENS
"""

import json
import time

from deltafin_mlx import runtime


def main(argv):
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from deltafin_mlx.engine.load import load

    path, fraction, mode, pipeline, tokens = (argv[0], float(argv[1]), argv[2],
                                              argv[3] == "1", int(argv[4]))
    probe, _ = load(path, tokenizer=False, cache_slots=1, warm_start=False)
    plan = runtime(probe).plan
    runtime(probe).close()
    slots = max(plan.experts_per_token, int(fraction * plan.num_experts * plan.moe_layers))
    m, _ = load(path, tokenizer=False, cache_slots=slots, read_mode=mode, pipeline=pipeline,
                warm_start=False)
    cache = make_prompt_cache(m)
    y = mx.argmax(m(mx.array([[1, 2, 3, 4]]), cache=cache)[:, -1], -1)
    mx.eval(y)
    for _ in range(3):
        y = mx.argmax(m(y[:, None], cache=cache)[:, -1], -1)
        mx.eval(y)
    stall0 = runtime(m).stats.stall_seconds
    start = time.perf_counter()
    for _ in range(tokens):
        y = mx.argmax(m(y[:, None], cache=cache)[:, -1], -1)
        mx.eval(y)
    wall = time.perf_counter() - start
    print(json.dumps({"s_per_token": wall / tokens,
                      "stall_share": (runtime(m).stats.stall_seconds - stall0) / wall}))
