"""`python -m bench.lib.worker score`: score N synthetic texts of L tokens in a
fresh process and time it (bench.studies.scoring).

    --mode deltafin   deltafin_mlx's scoring (score/job.py's passes) at --cache-slots,
                      then Deltafin's greedy decode rate in the same process
    --mode mlx-lm     mlx-lm's own scoring (mlx_lm.perplexity.eval_ppl) of the same
                      texts with every expert in memory (testing/decode.load_resident)
    --mode ab         both in one process, alternating --repeats times (Deltafin at
                      each of --configs: every expert held, S% of the experts, a
                      budget): the ratio of each pair, on a machine too noisy for
                      separate processes to compare; passes, tokens per pass,
                      expert and trunk bytes per pass against the union

With --throttle FILE VALUE the blkio throttle is written after loading, so every
timed read runs under it. Prints one JSON line.
"""

import argparse
import json
import time

import mlx.core as mx
import numpy as np


def texts(n: int, length: int, vocab: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(1, vocab, size=(n, length)).astype(np.int32)


def decode_rate(model, prompt: np.ndarray, steps: int) -> float:
    """Greedy tokens/s after a prompt, the prompt's own call not timed."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    logits = model(mx.array(prompt[None]), cache=cache)[:, -1]
    mx.eval(logits)
    t = time.perf_counter()
    for _ in range(steps):
        y = mx.argmax(logits, axis=-1)
        logits = model(y[:, None], cache=cache)[:, -1]
        mx.eval(logits)
    return steps / (time.perf_counter() - t)


def score_items(data: np.ndarray):
    from deltafin_mlx.jobs.score_lines import ScoreItem

    scored = np.arange(data.shape[1]) > 0  # every position but the first
    return [ScoreItem(i, row.tolist(), scored.copy())
            for i, row in enumerate(data)]


def score_job(model, items):
    """Score `items` with Deltafin's scoring passes: (seconds, sweeps, union bytes,
    tokens of each pass, summed log-probability)."""
    from deltafin_mlx.jobs.score import ScoreOptions, iter_passes

    t = time.perf_counter()
    sweeps, union, pass_tokens, logprob = 0, 0, [], 0.0
    for results, stats in iter_passes(model, items, ScoreOptions()):
        sweeps += stats.passes  # a text longer than a pass is scored across several
        union += stats.union_bytes
        pass_tokens.append(stats.tokens / stats.passes)
        logprob += sum(r.logprob for r in results)
    return time.perf_counter() - t, sweeps, union, pass_tokens, logprob


def _load_config(path: str, config: str, args):
    """A Deltafin model for a side-by-side configuration: `all` (every expert held),
    `S%` (an expert cache of S% of the experts, the budget otherwise large) or a
    budget such as `40MB`."""
    from deltafin_mlx.engine.load import load
    from deltafin_mlx.format.model_dir import open_model_dir

    budget, slots = args.budget, None
    if config.endswith("%"):
        m = open_model_dir(path).manifest
        total = m.experts["num_experts"] * len(m.moe_layers)
        slots = max(m.experts["experts_per_token"], round(float(config[:-1]) / 100 * total))
    elif config != "all":
        budget = config
    model, _ = load(path, budget, cache_slots=slots, tokenizer=False, warm_start=False,
                    context=1024)
    return model


def ab(args) -> int:
    """mlx-lm's eval_ppl and Deltafin's scoring of the same texts at each of
    --configs, alternated: each repeat runs mlx-lm, then every configuration."""
    from mlx_lm.perplexity import eval_ppl

    from deltafin_mlx.testing.decode import load_resident
    from deltafin_mlx.engine.runtime import runtime

    reference = load_resident(args.model)
    models = {c: _load_config(args.model, c, args) for c in args.configs}
    data = texts(args.texts, args.length, 1024)
    items = score_items(data)
    scored = sum(it.scored_tokens for it in items)
    rows = {c: {"config": c, "seconds": [], "ratios": [], "sweeps": [], "pass_tokens": None,
                "expert_bytes": [], "trunk_bytes": [], "union_bytes": [], "logprob": None}
            for c in models}
    ref_s = []
    for rep in range(args.repeats + 1):  # the first round is a warm-up
        t = time.perf_counter()
        eval_ppl(reference, mx.array(data), batch_size=8)
        first = time.perf_counter() - t
        for c, model in models.items():
            state, row = runtime(model), rows[c]
            e0 = state.store.bytes_read
            t0 = state.trunk_bytes_read
            seconds, sweeps, union, tokens, logprob = score_job(model, items)
            if not rep:
                continue
            row["seconds"].append(seconds)
            row["ratios"].append(first / seconds)
            row["sweeps"].append(sweeps)
            row["pass_tokens"] = tokens
            row["expert_bytes"].append(state.store.bytes_read - e0)
            row["trunk_bytes"].append(state.trunk_bytes_read - t0)
            row["union_bytes"].append(union)
            row["logprob"] = logprob
        if rep:
            ref_s.append(first)
    med = lambda v: float(np.median(v))  # noqa: E731
    out = []
    for c, row in rows.items():
        plan = runtime(models[c]).plan
        sweeps = med(row["sweeps"])
        e, u = row["expert_bytes"], row["union_bytes"]
        row.update({
            "slots": plan.slots, "all_experts": plan.num_experts * plan.moe_layers,
            "budget_bytes": plan.budget, "trunk_streamed": bool(runtime(models[c]).trunk or plan.pass_trunk),
            "tokens_per_s": scored / med(row["seconds"]),
            "tokens_per_s_range": [scored / max(row["seconds"]), scored / min(row["seconds"])],
            "median_ratio": med(row["ratios"]), "ratio_range": [min(row["ratios"]), max(row["ratios"])],
            "tokens_per_pass": med(row["pass_tokens"]),
            "expert_bytes_per_pass": med(e) / sweeps, "trunk_bytes_per_pass": med(row["trunk_bytes"]) / sweeps,
            "union_bytes_per_pass": med(u) / sweeps,
            "expert_bytes_over_union": med([a / b for a, b in zip(e, u)]) if all(u) else None,
        })
        out.append(row)
    logprobs = {r["logprob"] for r in out}
    print(json.dumps({"mode": "ab", "scored_tokens": scored, "repeats": args.repeats,
                      "mlx_lm_seconds": ref_s, "mlx_lm_tokens_per_s": scored / med(ref_s),
                      "mlx_lm_tokens_per_s_range": [scored / max(ref_s), scored / min(ref_s)],
                      "same_logprob_every_config": len(logprobs) == 1, "rows": out,
                      # the headline: every expert held, as before
                      **({"median_ratio": rows["all"]["median_ratio"],
                          "pairs": [{"ratio": x} for x in rows["all"]["ratios"]],
                          "deltafin_tokens_per_s": rows["all"]["tokens_per_s"],
                          "mlx_lm_tokens_per_s": scored / med(ref_s)} if "all" in rows else {})}))
    for model in models.values():
        runtime(model).close()
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--mode", choices=("deltafin", "mlx-lm", "ab"), required=True)
    ap.add_argument("--repeats", type=int, default=5, help="--mode ab: rounds timed")
    ap.add_argument("--configs", nargs="+", default=["all"],
                    help="--mode ab: Deltafin at `all` (every expert held), `S%%` (an expert "
                    "cache of S%% of the experts) or a budget such as 40MB")
    ap.add_argument("--texts", type=int, default=64)
    ap.add_argument("--length", type=int, default=200)
    ap.add_argument("--cache-slots", type=int, default=None)
    ap.add_argument("--budget", default="64GB")
    ap.add_argument("--decode-tokens", type=int, default=16)
    ap.add_argument("--throttle", nargs=2, metavar=("FILE", "VALUE"))
    args = ap.parse_args(argv)

    if args.mode == "ab":
        return ab(args)
    if args.mode == "mlx-lm":
        from mlx_lm.perplexity import eval_ppl

        from deltafin_mlx.testing.decode import load_resident

        model = load_resident(args.model)
        vocab = model.args.text_config.vocab_size if hasattr(model.args, "text_config") else 1024
        data = mx.array(texts(args.texts, args.length, min(vocab, 1024)))
        t = time.perf_counter()
        ppl, _ = eval_ppl(model, data, batch_size=8)
        seconds = time.perf_counter() - t
        scored = args.texts * (args.length - 1)
        print(json.dumps({"mode": "mlx-lm", "scored_tokens": scored, "seconds": seconds,
                          "tokens_per_s": scored / seconds, "perplexity": ppl}))
        return 0

    from deltafin_mlx.engine.load import load
    from deltafin_mlx.engine.runtime import runtime

    model, _ = load(args.model, args.budget, cache_slots=args.cache_slots, tokenizer=False,
                    warm_start=False, context=1024)
    state = runtime(model)
    data = texts(args.texts, args.length, 1024)
    items = score_items(data)
    if args.throttle:
        with open(args.throttle[0], "w") as f:
            f.write(args.throttle[1])
    read0 = state.store.bytes_read
    seconds, sweeps, union, pass_tokens, logprob = score_job(model, items)
    read = state.store.bytes_read - read0
    scored = sum(it.scored_tokens for it in items)
    decode = decode_rate(model, data[0][:16], args.decode_tokens) if args.decode_tokens else None
    print(json.dumps({
        "mode": "deltafin", "slots": state.plan.slots,
        "all_experts": state.plan.num_experts * state.plan.moe_layers,
        "scored_tokens": scored, "seconds": seconds, "tokens_per_s": scored / seconds,
        "perplexity": float(np.exp(-logprob / scored)), "sweeps": sweeps,
        "pass_tokens": pass_tokens, "expert_bytes_read": read, "union_bytes": union,
        "bytes_per_scored_token": read / scored, "union_bytes_per_scored_token": union / scored,
        "decode_tokens_per_s": decode}))
    state.close()
    return 0
