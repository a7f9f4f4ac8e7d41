"""One prompt's prefill and a short decode, measured: expert bytes the prefill reads
against the union bound of its routing (each distinct (layer, expert) once), time to
first token, prefill and decode rates, the plan's passes.

    python -m bench.lib.worker prefill-run MODEL TOKENS SLOTS DECODE [THROTTLE_FILE VALUE]

SLOTS: the expert cache's slots ("all" for every expert). With THROTTLE_FILE, VALUE
is written into it (a blkio read throttle) once the model is loaded, so that only
the prefill and the decode run under it.
"""

import json
import time
from contextlib import nullcontext

import numpy as np


def main(argv):
    import mlx.core as mx

    from deltafin_mlx import load, runtime, stream_generate

    path, tokens, slots, decode = argv[0], int(argv[1]), argv[2], int(argv[3])
    model, tok = load(path, 64 << 30, context=tokens + decode + 64, warm_start=False,
                      cache_slots=None if slots == "all" else int(slots))
    state = runtime(model)
    routed, seen = set(), {"steps": 0, "read": None}
    first_layer = state.store.layers[0]

    def on_route(layer, idx):
        # The prefill is the passes and the prompt's last token (the first
        # one-token step); mlx-lm starts the next token's step before it yields
        # the first token, so the prefill's reads are taken as that step begins.
        if idx.shape[-2] == 1 and layer == first_layer:
            seen["steps"] += 1
            if seen["steps"] == 2:
                seen["read"] = state.store.bytes_read - before
        if seen["read"] is None:
            routed.update((layer, int(e)) for e in np.unique(idx))

    # With every expert resident there is nothing to read.
    observing = state.observe(on_route=on_route) if slots != "all" else nullcontext()
    if len(argv) > 5:
        with open(argv[4], "w") as f:
            f.write(argv[5])
    prompt = np.random.default_rng(0).integers(1, 700, tokens).tolist()
    mx.eval(mx.ones(4) + 1)
    start, first, read = time.perf_counter(), None, None
    before = state.store.bytes_read
    with observing:
        for r in stream_generate(model, tok, prompt, decode):
            if first is None:
                first = time.perf_counter() - start
                read = seen["read"] if seen["read"] is not None else state.store.bytes_read - before
    record = state.manifest.experts["record_size"]
    plan = state.plan
    print(json.dumps({
        "prompt_tokens": r.prompt_tokens, "slots": plan.slots,
        "cache_fraction": plan.cache_fraction, "prefill_pass": plan.prefill_pass,
        "prefill_step": plan.prefill_step, "passes": -(-(tokens - 1) // plan.prefill_pass),
        "prefill_bytes_read": read, "union_bytes": len(routed) * record if routed else None,
        "seconds_to_first_token": first, "prefill_tokens_per_s": r.prompt_tps,
        "decode_tokens_per_s": r.generation_tps, "generated": r.generation_tokens,
    }))
