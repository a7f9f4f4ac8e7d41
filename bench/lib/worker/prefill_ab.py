"""`python -m bench.lib.worker prefill-ab`: one prompt's prefill by mlx-lm with every
expert in memory and by Deltafin at several budgets, side by side in one process,
alternated (bench.studies.prefill --parts side-by-side).

    python -m bench.lib.worker prefill-ab MODEL TOKENS REPEATS CONFIG...

CONFIG: `all` (a budget holding every expert), `S%` (the expert cache holds S% of
the experts, the budget otherwise large: the disk is not the bound) or a budget
such as `40MB` (the memory plan's cache, passes and trunk at that budget).

Both run mlx-lm's own `generate_step` (mlx-lm at its default prefill step, Deltafin
at the plan's pass with the progress callback its stream_generate passes), greedy; a
run's time is its time to first token. Each repeat
is a new prompt (random token ids; the caches keep what the previous one left, as
a next prompt finds them) run by mlx-lm, then by every configuration; a
configuration's ratio in a repeat is mlx-lm's time over its time, so the load other
processes put on the machine weighs on both sides of a ratio about alike. A first
round is a warm-up, not timed. Expert and trunk bytes are what the prefill read up
to its first token; the union bound is each (layer, expert) the prompt routes to,
once (its routing recorded in the same run). The tokens and their
log-probabilities after each prompt must equal mlx-lm's bit for bit (`identical`).
Prints one JSON line.
"""

import json
import statistics
import time
from contextlib import nullcontext

import numpy as np

DECODED = 4  # tokens generated after the prompt, compared with mlx-lm's


def _first_token(model, prompt, step: int, on_first=None):
    """(seconds to the first token, the DECODED tokens, their log-probabilities)."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.sample_utils import make_sampler

    from deltafin_mlx.generation.stream import unread_logits_hint

    cache = make_prompt_cache(model)
    tokens, logprobs, first = [], [], None
    start = time.perf_counter()
    # Deltafin's stream_generate passes the hint (its last layer is not computed for
    # a prefill chunk, as mlx-lm's lazy graph skips it); a model not Deltafin's gets None.
    for y, lp in generate_step(mx.array(prompt), model, max_tokens=DECODED,
                               sampler=make_sampler(0.0), prompt_cache=cache,
                               prefill_step_size=step,
                               prompt_progress_callback=unread_logits_hint(model)):
        if first is None:
            first = time.perf_counter() - start
            if on_first is not None:
                on_first()
        tokens.append(int(y))
        logprobs.append(np.array(lp.astype(mx.float32)))
    mx.clear_cache()
    return first, tokens, logprobs


def _load(path: str, config: str, tokens: int):
    from deltafin_mlx.engine.load import load
    from deltafin_mlx.format.model_dir import open_model_dir

    context = tokens + DECODED + 64
    if config == "all":
        budget, slots = 64 << 30, None
    elif config.endswith("%"):
        m = open_model_dir(path).manifest
        total = m.experts["num_experts"] * len(m.moe_layers)
        budget = 64 << 30
        slots = max(m.experts["experts_per_token"], round(float(config[:-1]) / 100 * total))
    else:
        budget, slots = config, None
    model, _ = load(path, budget, tokenizer=False, warm_start=False, context=context,
                    cache_slots=slots)
    return model


def main(argv):
    from deltafin_mlx.testing.decode import load_resident
    from deltafin_mlx.engine.runtime import runtime
    from deltafin_mlx.generation.stream import planned_pass

    path, n, repeats, configs = argv[0], int(argv[1]), int(argv[2]), argv[3:]
    reference = load_resident(path)
    vocab = getattr(reference.args, "vocab_size", None) or 1024
    prompts = [np.random.default_rng(seed).integers(1, min(vocab, 1024) - 1, n).tolist()
               for seed in range(repeats + 1)]  # the first is the warm-up's
    models = {c: _load(path, c, n) for c in configs}
    rows = {}
    for c, model in models.items():
        state, step = runtime(model), planned_pass(model)
        plan = state.plan
        rows[c] = {"config": c, "slots": plan.slots, "budget_bytes": plan.budget,
                   "cache_fraction": plan.cache_fraction,
                   "all_experts": plan.num_experts * plan.moe_layers,
                   "tokens_per_pass": step, "passes": -(-(n - 1) // step),
                   "trunk_streamed": bool(state.trunk or state.plan.pass_trunk), "identical": True,
                   "seconds": [], "ratios": [], "expert_bytes": [], "trunk_bytes": [],
                   "union_bytes": []}
    ref_s = []
    for r, prompt in enumerate(prompts):
        first, ref_tokens, ref_logprobs = _first_token(reference, prompt, 2048)
        if r:
            ref_s.append(first)
        for c, model in models.items():
            state, row = runtime(model), rows[c]
            e0 = state.store.bytes_read
            t0 = state.trunk_bytes_read
            routed, marks = set(), {}

            def route(layer, idx):
                if not marks:  # the prefill's
                    routed.update((layer, int(e)) for e in np.unique(idx))

            def mark():  # the prefill ends at the first token
                marks["e"] = state.store.bytes_read - e0
                marks["t"] = state.trunk_bytes_read - t0

            # With every expert held nothing is read, nothing to bound.
            with state.observe(on_route=route) if c != "all" else nullcontext():
                s, toks, lps = _first_token(model, prompt, planned_pass(model), on_first=mark)
            row["identical"] &= toks == ref_tokens and all(
                np.array_equal(a, b) for a, b in zip(lps, ref_logprobs))
            if not r:
                continue  # the warm-up
            row["seconds"].append(s)
            row["ratios"].append(first / s)
            row["expert_bytes"].append(marks["e"])
            row["trunk_bytes"].append(marks["t"])
            if routed:
                row["union_bytes"].append(len(routed) * state.manifest.experts["record_size"])
    med = statistics.median
    for row in rows.values():
        s, e, u = row["seconds"], row["expert_bytes"], row["union_bytes"]
        row.update({
            "prefill_tokens_per_s": n / med(s),
            "prefill_tokens_per_s_range": [n / max(s), n / min(s)],
            "median_ratio": med(row["ratios"]),
            "ratio_range": [min(row["ratios"]), max(row["ratios"])],
            "expert_bytes_read": med(e), "trunk_bytes_read": med(row["trunk_bytes"]),
            "expert_bytes_per_pass": med(e) / row["passes"],
            "trunk_bytes_per_pass": med(row["trunk_bytes"]) / row["passes"],
            "union": med(u) if u else None,
            "expert_bytes_over_union": med([a / b for a, b in zip(e, u)]) if u else None,
        })
    print(json.dumps({
        "mode": "prefill-ab", "prompt_tokens": n, "repeats": repeats,
        "mlx_lm": {"seconds": ref_s, "prefill_tokens_per_s": n / med(ref_s),
                   "prefill_tokens_per_s_range": [n / max(ref_s), n / min(ref_s)],
                   "prefill_step": 2048},
        "rows": list(rows.values())}))
    for model in models.values():
        runtime(model).close()
    return 0
