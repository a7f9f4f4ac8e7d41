"""`deltafin-run plan`: the memory plan and a projected speed, without loading weights.

Works on a converted model, or on a source `config.json` plus the conversion options
(plan Kimi K3 before downloading 1.4 TB). The report is plan/report.py's; this
module parses the options and formats it (or prints it as JSON).
"""

import json

from deltafin_mlx.cli.options import (Parser, add_activation_dtype, expert_bits, positive,
                                     positive_or_auto)
from deltafin_mlx.plan.report import PREFILL_BATCH, PlanOptions, plan_report
from deltafin_mlx.units import human_bytes


def plan_parser():
    p = Parser(prog="deltafin-run plan", description="Show the memory plan for a model, "
               "without loading its weights.")
    p.add_argument("model", help="a Deltafin model directory, a source directory or "
                   "config.json, or a Hugging Face hub id (only its config.json is fetched)")
    p.add_argument("--budget", default=None,
                   help="memory budget, e.g. 8GB (default: from available memory)")
    p.add_argument("--context", type=int, default=4096,
                   help="tokens of context to hold KV/state for (at most the model's maximum)")
    p.add_argument("--sequences", type=positive_or_auto, default=1, metavar="N|auto",
                   help="sequences decoded together (a batch job); auto: the most that fit "
                   "(default: 1)")
    for flag, default, what in (("--bits", 4, "trunk quantization bits"),
                                ("--group-size", 64, "trunk quantization group size"),
                                ("--expert-bits", 4, "bits for bf16/fp16 experts (float: "
                                 "kept in float)"),
                                ("--expert-group-size", 64, "group size for bf16/fp16 experts")):
        p.add_argument(flag, type=expert_bits if flag == "--expert-bits" else int, default=None,
                       help=f"{what}, as deltafin-convert would use them; only for planning a "
                       f"source (default: {default})")
    p.add_argument("--disk-gbps", type=float, default=None,
                   help="disk read bandwidth in GB/s (default: measured once, then cached)")
    p.add_argument("--compute-gwps", type=float, default=None,
                   help="quantized matvec rate, G weights/s (default: measured once, then cached)")
    p.add_argument("--prefill-gwps", type=float, default=None,
                   help="quantized matrix product rate at a prefill's batch, G weights/s "
                   "(default: measured once, then cached)")
    p.add_argument("--layer-ms", type=float, default=None,
                   help="what one decoder layer costs a decode step besides its weights, in ms "
                   "(default: measured once, then cached; deltafin-run bench calibrates it)")
    p.add_argument("--remeasure", action="store_true",
                   help="measure the disk, compute and per-layer rates again instead of using "
                   "cached ones")
    add_activation_dtype(p)
    p.add_argument("--revision", default=None,
                   help="for a hub id: the branch, tag or commit (default: main)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    p.add_argument("--ranks", type=positive, default=1,
                   help="plan one rank of N running the model tensor parallel (mlx.launch)")
    return p


def cmd_plan(argv) -> int:
    args = plan_parser().parse_args(argv)
    report = plan_report(PlanOptions.of(args))
    print(json.dumps(report, indent=1) if args.json else format_plan(report))
    return 0


def _ranges(xs):
    if not xs:
        return "none"
    out, start, prev = [], xs[0], xs[0]
    for x in xs[1:] + [None]:
        if x is not None and x == prev + 1:
            prev = x
            continue
        out.append(f"{start}" if start == prev else f"{start}-{prev}")
        if x is not None:
            start = prev = x
    return ", ".join(out)


def _count(n: float) -> str:
    """A count in the unit that suits it: 980, 12.3 K, 104 G (weights)."""
    return human_bytes(n).replace(" B", "").replace("KB", "K").replace("MB", "M").replace(
        "GB", "G").replace("TB", "T")


def _percent(f: float) -> str:
    """A share that stays readable when small: 25.0%, 0.034%."""
    return f"{100 * f:.1f}%" if f >= 0.001 or f == 0 else f"{100 * f:.2g}%"


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.3g} s"
    if seconds < 7200:
        return f"{seconds / 60:.3g} min"
    return f"{seconds / 3600:.3g} h"


def speed(tokens_per_second: float) -> str:
    """tok/s, or seconds per token where that reads better (below 1 tok/s)."""
    if tokens_per_second < 1:
        return f"{1 / tokens_per_second:.3g} s/token"
    return f"{tokens_per_second:.3g} tok/s"


def speed_range(low: float, high: float) -> str:
    if high < 1:
        return f"{1 / high:.3g}-{1 / low:.3g} s/token"  # ascending, as every range
    return f"{speed(low)}-{high:.3g} tok/s" if low < 1 else f"{low:.3g}-{high:.3g} tok/s"


def format_plan(r: dict) -> str:
    p = r["projection"]
    maximum = f" (the model's maximum: {r['max_context']:,})" if r.get("max_context") else ""
    parts = " + ".join(f"{what} {human_bytes(n)}" for what, n in r["floor_parts"].items())
    lines = [
        f"model          {r['model']} ({r['model_type']}), activations {r['activation_dtype']}"
        + (f" (mlx-lm computes in {r['model_dtype']}: --activation-dtype model)"
           if r["activation_dtype"] != r["model_dtype"] else ""),
        *([f"ranks          {r['ranks']} (tensor parallel): every figure below is per rank; "
           f"whole trunk {human_bytes(r['whole_trunk_bytes'])}, whole expert record "
           f"{human_bytes(r['whole_expert_record_bytes'])}"] if r.get("ranks", 1) > 1 else []),
        f"context        {r['context']:,} tokens{maximum}",
        f"budget         {human_bytes(r['budget_bytes'])}",
        f"floor          {human_bytes(r['floor_bytes'])} = {parts}",
        f"trunk          {human_bytes(r['trunk_bytes'])} in all; resident {human_bytes(r['resident_trunk_bytes'])}",
        f"  pinned       layers {_ranges(r['pinned_layers'])}",
        f"  streamed     layers {_ranges(r['streamed_layers'])}"
        + (f" (through {human_bytes(r['stream_buffer_bytes'])} of buffers, read ahead in order)"
           if r["streamed_layers"] else ""),
        f"  embedding    {human_bytes(r['embedding_bytes'])}, "
        + ("rows read on demand" if r["embedding_on_demand"] else "resident"),
        f"KV/state       {human_bytes(r['state_bytes'])} for {r['sequences']} "
        f"sequence{'s' if r['sequences'] > 1 else ''}; per sequence "
        f"{human_bytes(r['sequence_recurrent_bytes'])} recurrent + "
        f"{human_bytes(r['sequence_kv_bytes'])} KV at {r['context']:,} tokens; "
        f"batch --batch-size auto: {r['auto_sequences']:,} sequences",
        f"experts        {r['experts_total']:,} experts ({r['moe_layers']} MoE layers x "
        f"{r['experts_per_layer']}, {r['experts_per_token']} per token), "
        f"{human_bytes(r['expert_record_bytes'])} each, {human_bytes(r['expert_bytes_on_disk'])} on disk",
        f"  cache        {r['expert_cache_slots']:,} experts, {human_bytes(r['expert_cache_bytes'])} "
        f"({_percent(r['expert_cache_fraction'])} of all experts)",
        f"  pool         {r['expert_cache_arrays']} set(s) of slot arrays of up to "
        f"{r['expert_slots_per_array']:,} slots (MLX's int32 shapes); the pool can hold "
        f"{r['expert_pool_limit_slots']:,} experts"
        + (" (every expert)" if r["expert_pool_limit_slots"] >= r["experts_total"] else
           " at most: larger pools would need partitions this model's routing cannot fill"),
        f"disk           {r['disk_gbps']:.2f} GB/s ({r['disk_rate_from']})",
        f"compute        {r['compute_gweights_per_second']:.2f} G weights/s quantized matvec "
        f"({r['compute_rate_from']})",
        f"per layer      {1e3 * r['layer_seconds']:.3g} ms a decode step besides the weights "
        f"({r['layer_rate_from']})",
        f"projection     {_count(p['weights_per_token'])} weights and "
        f"{human_bytes(p['read_bytes_per_token'])} read per token: "
        f"{speed_range(p['tokens_per_second_serial'], p['tokens_per_second_overlapped'])} "
        "(no overlap .. full overlap; hit rate taken as the cache share)",
        f"  real routing hit rate {p['real_routing_hit_rate']:.0%} (the pool policy on OLMoE's "
        f"routing at as many slots per routed expert): "
        f"{human_bytes(p['real_routing_read_bytes_per_token'])} read per token, "
        f"{speed(p['real_routing_tokens_per_second'])} where reads overlap compute",
        f"  prefill      {r['prefill_gweights_per_second']:.3g} G weights/s in matrix products "
        f"of {PREFILL_BATCH} tokens ({r['prefill_rate_from']})",
        f"prefill        passes of up to {r['prefill_pass_tokens']:,} tokens through each layer "
        f"(attention in chunks of {r['prefill_step']}), {human_bytes(r['prefill_bytes'])} "
        "of activations beyond the working buffers; each pass reads the experts its "
        "tokens route to once"
        + (f"; a pass that gives the cache back streams the {r['pass_trunk_layers']} pinned "
           f"trunk layers too ({human_bytes(r['pass_trunk_bytes'])} more for its tokens)"
           if r["pass_trunk_layers"] else ""),
        "  first token  " + "; ".join(
            f"{q['prompt_tokens']:,} tokens: {_duration(q['seconds_to_first_token'])} "
            f"({q['passes']:,} pass{'es' if q['passes'] > 1 else ''}, "
            f"{human_bytes(q['read_bytes'])} read)" for q in r["prefill_projection"])
        + "".join(f"; {n:,} tokens: needs --context {n} or more"
                  for n in r["prefill_needs_context"])
        + " (uniform routing, the cache's share held)",
        f"scoring        passes of up to {r['scoring_pass_tokens']:,} tokens (texts within an "
        f"attention chunk; no KV kept), logits in blocks of {r['scoring_logit_rows']:,} "
        f"positions: {r['scoring_projection']['tokens_per_second']:.3g} scored tok/s "
        f"({_duration(r['scoring_projection']['pass_seconds'])} and "
        f"{human_bytes(r['scoring_projection']['pass_read_bytes'])} read per pass)",
        *_format_routes(r.get("disk_routes")),
    ]
    return "\n".join(lines)


def _format_routes(d):
    if not d:
        return []
    h = human_bytes
    linked = (f"  linked       --link-experts: {h(d['linked_output_bytes'])} output beside the "
              f"download = {h(d['download_and_linked_bytes'])} (the snapshot must stay)"
              if d["linked_output_bytes"] is not None else
              "  linked       not possible: the experts are requantized, not carried over")
    return [f"disk routes    download {h(d['download_bytes'])} ({d['download_from']}), "
            f"largest shard {h(d['largest_shard_bytes'])}",
            f"  packed       download, then convert: {h(d['packed_output_bytes'])} output = "
            f"{h(d['download_and_packed_bytes'])} at the peak",
            linked,
            f"  scratch      from the hub with --scratch-limit: {h(d['packed_output_bytes'])} "
            f"output + {h(d['scratch_peak_bytes'])} scratch peak = "
            f"{h(d['hub_with_scratch_bytes'])}"]
