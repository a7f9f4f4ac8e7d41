"""Greedy decode at one budget, or with mlx-lm fully in memory
(bench.studies.trunk_budget): s/token, the tokens, and for Deltafin the trunk and
expert bytes read per token, the stall share and the plan's shape.

    python -m bench.lib.worker budget-decode MODEL resident|deltafin BUDGET TOKENS
"""

import json
import time

from deltafin_mlx import find_runtime


def main(argv):
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from deltafin_mlx.engine.load import load
    from deltafin_mlx.testing.decode import load_resident

    path, mode, budget, tokens = argv[0], argv[1], int(argv[2]), int(argv[3])
    if mode == "resident":
        m = load_resident(path)
    else:
        m, _ = load(path, memory_budget=budget, tokenizer=False)
    cache = make_prompt_cache(m)
    y = mx.argmax(m(mx.array([[1, 2, 3, 4]]), cache=cache)[:, -1], -1)
    mx.eval(y)
    for _ in range(2):
        y = mx.argmax(m(y[:, None], cache=cache)[:, -1], -1)
        mx.eval(y)
    st = find_runtime(m)

    def counters():
        if st is None:
            return (0, 0, 0)
        return (st.store.bytes_read, st.trunk.bytes_read if st.trunk else 0,
                st.stats.stall_seconds)

    c0, out = counters(), []
    start = time.perf_counter()
    for _ in range(tokens):
        y = mx.argmax(m(y[:, None], cache=cache)[:, -1], -1)
        mx.eval(y)
        out.append(y.item())
    wall = time.perf_counter() - start
    c1 = counters()
    r = {"s_per_token": wall / tokens, "tokens": out}
    if st is not None:
        p = st.plan
        r.update(expert_bytes_per_token=(c1[0] - c0[0]) / tokens,
                 trunk_bytes_per_token=(c1[1] - c0[1]) / tokens,
                 stall_share=(c1[2] - c0[2]) / wall, streamed_layers=len(p.streamed),
                 embed_on_demand=p.embed_on_demand, slots=p.slots, floor=p.floor,
                 cache_fraction=p.cache_fraction)
    print(json.dumps(r))
