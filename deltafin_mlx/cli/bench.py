"""`deltafin-run bench MODEL`: a short decode benchmark. Synthetic prompts are
prefilled in the plan's chunks and decoded greedily, a few times; the medians of
prefill and decode speed are reported with the last run's expert counters."""

import json
import statistics

from deltafin_mlx.cli.options import Parser, add_load_options, add_max_tokens, load_model, positive
from deltafin_mlx.engine.runtime import runtime
from deltafin_mlx.errors import UsageError
from deltafin_mlx.format.model_dir import open_model_dir
from deltafin_mlx.model.config import max_context
from deltafin_mlx.plan.memory import round_context


def bench_parser():
    p = Parser(prog="deltafin-run bench", description="A short decode benchmark.")
    p.add_argument("model", help="a directory written by deltafin-convert")
    add_max_tokens(p, 32, "tokens decoded per run, as deltafin-run's -n (mlx_lm.benchmark's "
                   "-n counts trials: --repeats here)")
    p.add_argument("--prompt-tokens", type=positive, default=16, help="prompt length of each run")
    p.add_argument("--context", type=positive, default=None, metavar="N",
                   help="tokens of KV cache/state to reserve, as a run does (default: prompt + "
                   "max tokens, rounded up)")
    p.add_argument("--repeats", type=positive, default=3, help="runs, mlx_lm.benchmark's -n/--num-trials (the median is reported)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    add_load_options(p)
    return p


def cmd_bench(argv) -> int:
    args = bench_parser().parse_args(argv)
    model_dir = open_model_dir(args.model)
    context = args.context or round_context(args.prompt_tokens + args.max_tokens + 1,
                                            max_context(model_dir.config))
    if context <= args.prompt_tokens + args.max_tokens:
        raise UsageError(f"--context {context} does not hold --prompt-tokens {args.prompt_tokens} "
                         f"+ -n {args.max_tokens}")
    model, _ = load_model(args, model_dir, tokenizer=False, context=context)
    runs = [bench_run(model, args, i) for i in range(args.repeats)]
    tps = [r.decode_tokens_per_second for r in runs]
    pps = [r.prefill_tokens_per_second for r in runs]
    step = runtime(model).plan.prefill_pass
    result = {"model": args.model,
              "budget_bytes": runtime(model).plan.budget,
              "cache_fraction": runtime(model).plan.cache_fraction,
              "context": runtime(model).plan.context,
              "tokens_per_second_median": statistics.median(tps),
              "tokens_per_second_range": [min(tps), max(tps)],
              "prefill_tokens_per_second_median": statistics.median(pps),
              "prefill_tokens_per_second_range": [min(pps), max(pps)],
              "prefill_pass": step,
              **projected_against_measured(model, runs, statistics.median(tps)),
              "runs": [r.to_dict() for r in runs]}
    if args.json:
        print(json.dumps(result))
    else:
        print(f"prefill, {args.prompt_tokens} tokens x {args.repeats}: median "
              f"{result['prefill_tokens_per_second_median']:.2f} tok/s "
              f"(range {min(pps):.2f}-{max(pps):.2f}, passes of {step} tokens); "
              f"decode, {args.max_tokens} tokens: median "
              f"{result['tokens_per_second_median']:.2f} tok/s "
              f"(range {min(tps):.2f}-{max(tps):.2f}); cache {result['cache_fraction']:.0%} "
              f"of experts; last run: {runs[-1].line()}")
        print(f"plan's projection: {result['projected_tokens_per_second']:.3g} tok/s with "
              f"{1e3 * result['projected_layer_seconds']:.3g} ms per layer, measured "
              f"{result['tokens_per_second_median']:.3g}: projected/measured "
              f"{result['projected_over_measured']:.2f}; {calibration_text(result)}")
    runtime(model).close()
    return 0


def projected_against_measured(model, runs, measured: float) -> dict:
    """plan's projection for this model and budget (plan/speed.py, the cached machine
    rates) next to what the runs measured, and the per-layer cost the runs imply,
    cached for the next `plan` (the term small models are dominated by)."""
    from deltafin_mlx.plan.report import decode_rates, disk_rate
    from deltafin_mlx.plan.rates import layer_key, store_calibration
    from deltafin_mlx.plan.speed import layer_seconds_from_run, project

    state = runtime(model)
    inv, plan = state.inventory, state.plan
    bank = state.manifest.bank_path(state.manifest.moe_layers[0])
    disk, _ = disk_rate(None, bank, str(state.manifest.path))
    model_id = state.manifest.digest
    compute, _, layer, _ = decode_rates(inv, inv.activation_dtype, model=model_id)
    projected = project(inv, plan, disk, compute, layer)["real_routing_tokens_per_second"]
    last = runs[-1]
    stall = last.stall_seconds / max(last.tokens, 1)
    run_layer = (layer_seconds_from_run(inv, compute, 1 / measured, stall) if measured > 0
                 else 0.0)
    entry = store_calibration(layer_key(inv.activation_dtype, model_id), run_layer,
                              how=f"deltafin-run bench on {state.manifest.path}")
    return {"projected_tokens_per_second": projected, "projected_layer_seconds": layer,
            "projected_over_measured": projected / measured if measured > 0 else None,
            "run_layer_seconds": run_layer,
            "calibrated_layer_seconds": entry["value"] if entry else None,
            "calibration_runs": entry["runs"] if entry else 0,
            "activation_dtype": str(inv.activation_dtype).split(".")[-1]}


def calibration_text(result: dict) -> str:
    if result["calibrated_layer_seconds"] is None:
        return ("no per-layer cost calibrated: this run left no time beyond the weights' "
                "arithmetic and its reads (nothing cached)")
    return (f"per-layer cost {1e3 * result['run_layer_seconds']:.3g} ms from the median decode "
            f"rate, calibrated to {1e3 * result['calibrated_layer_seconds']:.3g} ms, the mean "
            f"of {result['calibration_runs']} bench runs of this model (cached: `deltafin-run "
            f"plan` uses it for this model with {result['activation_dtype']} activations on "
            "this machine, unless given --layer-ms or --compute-gwps)")


def bench_run(model, args, i: int):
    """One run's RunStats: run `i`'s prompt (each run's differs), then the decode."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from deltafin_mlx.generation.stream import StatsMeter

    step = runtime(model).plan.prefill_pass
    cache = make_prompt_cache(model)
    prompt = mx.array([[(7 * j + i) % 200 + 1 for j in range(args.prompt_tokens)]])
    meter = StatsMeter(model)
    for start in range(0, prompt.shape[1] - 1, step):  # the plan's prefill passes
        model(prompt[:, start : min(start + step, prompt.shape[1] - 1)], cache=cache)
        mx.eval([c.state for c in cache])
    y = mx.argmax(model(prompt[:, -1:], cache=cache)[:, -1], axis=-1)
    mx.eval(y)
    meter.first_token()
    for _ in range(args.max_tokens):
        y = mx.argmax(model(y[:, None], cache=cache)[:, -1], axis=-1)
        mx.eval(y)
    return meter.now(args.max_tokens + 1, args.prompt_tokens)
