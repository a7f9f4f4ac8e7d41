"""`deltafin-run plan`: the memory plan and a projected speed, without loading weights.

Works on a converted model, or on a source `config.json` plus the conversion options
(plan Kimi K3 before downloading 1.4 TB). The projection is plan/speed.py's cost
model; the disk and compute rates are measured once per machine and cached
(plan/rates.py), or given with --disk-gbps / --compute-gwps.
"""

import json
import os
import tempfile
from pathlib import Path

import mlx.core as mx

from deltafin_mlx.cli.options import Parser, positive, positive_or_auto
from fnmatch import fnmatch

from deltafin_mlx.format.hub import (SOURCE_PATTERNS, HubError, fetch_config, list_repo,
                                     looks_like_hub_id)
from deltafin_mlx.model.build import source_dtype
from deltafin_mlx.model.quantization import expert_quantization
from deltafin_mlx.plan.disk import disk_routes, itemsize_of
from deltafin_mlx.plan.footprint import inventory_from_config, inventory_from_manifest
from deltafin_mlx.format.manifest import MANIFEST_NAME, ModelError
from deltafin_mlx.format.model_dir import open_model_dir, read_source_config
from deltafin_mlx.model.config import max_context
from deltafin_mlx.plan.memory import check_context, choose_sequences, plan_memory
from deltafin_mlx.plan.rates import (cached_rate, compute_key, disk_key, layer_key,
                                     measure_compute_gwps, measure_disk_gbps,
                                     measure_layer_seconds)
from deltafin_mlx.plan.passes import pass_figures
from deltafin_mlx.plan.scoring import scoring_plan
from deltafin_mlx.plan.speed import project, project_prefill, project_scoring
from deltafin_mlx.model.shard import expert_layout, sharded_inventory
from deltafin_mlx.units import human_bytes

DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}

# The most sequences `--sequences auto` plans (batch caps it at the requests left):
# state memory, not this, is the limit for any model whose state is worth planning.
AUTO_CAP = 4096

# Prompt lengths whose time to first token `plan` projects.
PROJECTED_PROMPTS = (300, 3000, 30000)
PREFILL_BATCH = 64  # tokens per matrix product when the prefill rate is measured

# deltafin-convert's options a source is planned with, and their defaults there.
CONVERSION_OPTIONS = {"bits": 4, "group_size": 64, "expert_bits": 4, "expert_group_size": 64}


def _config_path(target: Path, name: str, revision=None) -> Path:
    """The config.json to plan: a file, a source directory's, or a hub repo's."""
    if target.exists():
        if revision is not None:
            raise ModelError(f"--revision {revision}: {name} is a local path, not a hub id")
        return target / "config.json" if target.is_dir() else target
    if looks_like_hub_id(name):
        try:
            # The hub cache's snapshot files link into its blobs/ folder.
            return fetch_config(name, revision).resolve()
        except HubError as e:
            raise ModelError(str(e)) from None
    raise ModelError(f"{target}: no such model directory or config.json")


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
                                ("--expert-bits", 4, "bits for bf16/fp16 experts"),
                                ("--expert-group-size", 64, "group size for bf16/fp16 experts")):
        p.add_argument(flag, type=int, default=None,
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
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                   help="activation dtype to plan for (default: float32 on CPU; the model's "
                   "dtype on GPU — plan an Apple GPU with bfloat16)")
    p.add_argument("--revision", default=None,
                   help="for a hub id: the branch, tag or commit (default: main)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    p.add_argument("--ranks", type=positive, default=1,
                   help="plan one rank of N running the model tensor parallel (mlx.launch)")
    return p


def cmd_plan(argv) -> int:
    args = plan_parser().parse_args(argv)
    report = plan_from_path(args)
    print(json.dumps(report, indent=1) if args.json else format_plan(report))
    return 0


def plan_from_path(args) -> dict:
    target = Path(args.model).expanduser()
    act = DTYPES[args.dtype] if getattr(args, "dtype", None) else (
        mx.float32 if mx.default_device() == mx.cpu else None)
    given = {k: getattr(args, k, None) for k in CONVERSION_OPTIONS}
    bank = None
    routes = None  # a converted model has taken its route
    if target.is_dir() and (target / MANIFEST_NAME).exists():
        if getattr(args, "revision", None) is not None:
            raise ModelError(f"--revision {args.revision}: {target} is a converted model, "
                             "not a hub id")
        model_dir = open_model_dir(target)
        manifest, config = model_dir.manifest, model_dir.config
        named = [f"--{k.replace('_', '-')}" for k, v in given.items() if v is not None]
        if named:
            q = manifest.quantization
            raise ModelError(
                f"{' '.join(named)}: {target} is already converted (trunk "
                + (f"{q['trunk']['bits']}-bit" if q.get("trunk") else "unquantized")
                + f", experts {q['experts']['mode']} {q['experts']['bits']}-bit); these options "
                "plan a source: pass its config.json or hub id instead")
        check_context(args.context, config)
        act = act or getattr(mx, manifest.dtype)
        inv = inventory_from_manifest(manifest, config, act)
        layout = expert_layout(manifest)
        bank = None if manifest.linked else manifest.bank_path(manifest.moe_layers[0])
        source = str(target)
    else:
        config_path = _config_path(target, args.model, getattr(args, "revision", None))
        config = read_source_config(config_path)
        check_context(args.context, config)
        opts = {k: CONVERSION_OPTIONS[k] if v is None else v for k, v in given.items()}
        act = act or mx.bfloat16
        inv = inventory_from_config(config, act, bits=opts["bits"] or None,
                                    group_size=opts["group_size"],
                                    expert_bits=opts["expert_bits"],
                                    expert_group_size=opts["expert_group_size"])
        layout = None  # as deltafin-convert --ranks N would write it
        source = args.model if not target.exists() else str(config_path)
        routes = _disk_routes(inv, config, opts, target, args.model,
                              getattr(args, "revision", None))
    ranks = getattr(args, "ranks", 1)
    whole = inv
    if ranks > 1:
        inv = sharded_inventory(inv, config, ranks, 0, layout, target)
    plan = plan_memory(inv, args.budget, context=args.context, stream_trunk=ranks == 1,
                       sequences=getattr(args, "sequences", 1), max_sequences=AUTO_CAP)
    # What `batch --batch-size auto` takes with requests enough: the sequences whose
    # state the plan allows.
    auto = choose_sequences(inv, plan.budget, plan.context, stream_trunk=ranks == 1,
                            cap=AUTO_CAP)
    remeasure = getattr(args, "remeasure", False)
    disk, disk_from = _disk_rate(args.disk_gbps, bank, source, remeasure)
    compute, compute_from, layer, layer_from = decode_rates(args, inv, act, remeasure)
    mode, group = matvec_kind(inv)
    if args.prefill_gwps:
        batched, batched_from = args.prefill_gwps, "given"
    elif args.compute_gwps:  # a machine described by hand: its matvec rate, unless told more
        batched, batched_from = args.compute_gwps, "--compute-gwps (no --prefill-gwps given)"
    else:
        batched, entry = cached_rate(
            compute_key(mode, 4, group, act, PREFILL_BATCH),
            lambda: measure_compute_gwps(mode, group_size=group, act=act, batch=PREFILL_BATCH,
                                         dim=2048),
            remeasure)
        batched_from = _rate_origin(entry)
    streamed = [int(k) for k in plan.streamed]
    from deltafin_mlx.plan.slots import max_slots, pool_chunks, pool_limit

    chunk = max_slots(inv.sections, act)
    limit = pool_limit(len(inv.moe_layers), inv.experts_per_token, inv.num_experts, chunk)
    scoring = scoring_plan(inv.config, plan, act)
    return {
        "model": source,
        "ranks": ranks,  # every figure below is per rank
        "whole_trunk_bytes": whole.trunk_bytes,
        "whole_expert_record_bytes": whole.record_size,
        "model_type": inv.model_type,
        "activation_dtype": str(act).split(".")[-1],
        "budget_bytes": plan.budget,
        "context": plan.context,
        "max_context": max_context(inv.config),
        "floor_bytes": plan.floor,
        "floor_parts": plan.floor_parts,
        "trunk_bytes": inv.trunk_bytes,
        "resident_trunk_bytes": plan.resident_bytes,
        "pinned_layers": sorted(int(k) for k in plan.pinned if k != "globals"),
        "streamed_layers": streamed,
        "stream_buffer_bytes": plan.ring_bytes,
        "embedding_on_demand": plan.embed_on_demand,
        "embedding_bytes": inv.embed_bytes,
        "state_bytes": plan.state_bytes,
        "sequences": plan.sequences,
        "auto_sequences": auto,
        "sequence_recurrent_bytes": plan.sequence_recurrent_bytes,
        "sequence_kv_bytes": plan.sequence_kv_bytes,
        "working_bytes": plan.working_bytes,
        "buffer_cache_bytes": plan.buffer_cache_bytes,
        "expert_record_bytes": inv.record_size,
        "expert_slot_bytes": plan.slot_bytes,
        "experts_per_layer": inv.num_experts,
        "experts_per_token": inv.experts_per_token,
        "moe_layers": len(inv.moe_layers),
        "experts_total": inv.num_experts * len(inv.moe_layers),
        "expert_bytes_on_disk": inv.expert_disk_bytes,
        "expert_cache_slots": plan.slots,
        "expert_cache_bytes": plan.cache_bytes,
        "expert_cache_fraction": plan.cache_fraction,
        "expert_cache_arrays": len(pool_chunks(plan.slots, len(inv.moe_layers),
                                               inv.experts_per_token, inv.num_experts, chunk)),
        "expert_slots_per_array": chunk,
        "expert_pool_limit_slots": limit,
        "disk_gbps": disk,
        "disk_rate_from": disk_from,
        "compute_gweights_per_second": compute,
        "compute_rate_from": compute_from,
        "prefill_gweights_per_second": batched,
        "prefill_rate_from": batched_from,
        "layer_seconds": layer,
        "layer_rate_from": layer_from,
        "projection": project(inv, plan, disk, compute, layer),
        "prefill_step": plan.prefill_step,
        "prefill_pass": plan.prefill_pass,
        "prefill_bytes": plan.prefill_bytes,
        "prefill_projection": [project_prefill(inv, plan, n, disk, batched)
                               for n in PROJECTED_PROMPTS],
        "scoring_pass_tokens": scoring.pass_tokens,
        "scoring_logit_rows": scoring.logit_rows,
        "scoring_projection": project_scoring(inv, plan, scoring.pass_tokens, disk, batched),
        "passes": pass_figures(inv, plan, disk, batched, PROJECTED_PROMPTS),
        "disk_routes": routes.to_dict() if routes is not None else None,
    }


def _disk_routes(inv, config, opts, target: Path, name: str, revision):
    """The disk per route for a source: file sizes from the hub's listing or the
    local directory where there are any, else estimated from config.json."""
    quant = expert_quantization(config, opts["expert_bits"], opts["expert_group_size"])
    shards, small = None, 0
    if target.exists():
        folder = target if target.is_dir() else target.parent
        files = [p for p in folder.iterdir() if p.is_file()]
        found = {p.name: p.stat().st_size for p in files if p.name.endswith(".safetensors")}
        if found:
            shards = found
            small = sum(p.stat().st_size for p in files if p.name not in found)
    else:
        try:
            listed = list_repo(name, revision)
        except HubError as e:
            raise ModelError(str(e)) from None
        if listed is not None:
            shards = {n: f.size for n, f in listed.files.items() if n.endswith(".safetensors")}
            small = sum(f.size for n, f in listed.files.items()
                        if n not in shards and any(fnmatch(n, p) for p in SOURCE_PATTERNS))
    return disk_routes(inv, quant, shards or None, small,
                       itemsize_of(str(source_dtype(config) or "bfloat16").split(".")[-1]))


def matvec_kind(inv):
    """(quantization mode, group size) of the experts' matvecs, as measured."""
    mode = "mxfp4" if inv.sections[0].dtype == "uint32" and any(
        s.dtype == "uint8" for s in inv.sections) else "affine"
    return mode, 32 if mode == "mxfp4" else 64


def decode_rates(args, inv, act, remeasure=False):
    """(matvec G weights/s, where from, per-layer seconds, where from): given with
    --compute-gwps / --layer-ms, else cached (measured once; bench calibrates the
    per-layer cost)."""
    mode, group = matvec_kind(inv)
    if getattr(args, "compute_gwps", None):
        compute, compute_from = args.compute_gwps, "given"
    else:
        compute, entry = cached_rate(
            compute_key(mode, 4, group, act),
            lambda: measure_compute_gwps(mode, group_size=group, act=act), remeasure)
        compute_from = _rate_origin(entry)
    layer_ms = getattr(args, "layer_ms", None)
    if layer_ms is not None:
        layer, layer_from = layer_ms / 1e3, "given"
    elif getattr(args, "compute_gwps", None):
        layer, layer_from = 0.0, "not counted for a machine described by hand (give --layer-ms)"
    else:
        layer, entry = cached_rate(layer_key(act), lambda: measure_layer_seconds(act), remeasure)
        layer_from = _rate_origin(entry) + (f", {entry['how']}" if entry.get("how") else
                                            ", a microbenchmark: run bench to calibrate it")
    return compute, compute_from, layer, layer_from


def _disk_rate(given, bank, source, remeasure):
    """(GB/s, where it came from): given, or measured on the disk the model is on
    (its bank when big enough to measure, else a scratch file beside it) and cached."""
    if given:
        return given, "given"
    if bank is not None and os.path.getsize(bank) > 64 << 20:
        path, scratch_dir = bank, None
    else:
        here = Path(source) if bank is not None else None
        scratch_dir = str(here) if here is not None and os.access(here, os.W_OK) else None
        path = None
    where = path or scratch_dir or tempfile.gettempdir()
    value, entry = cached_rate(disk_key(where),
                               lambda: measure_disk_gbps(path, scratch_dir=scratch_dir), remeasure)
    return value, _rate_origin(entry)


def _rate_origin(entry: dict) -> str:
    if entry["cached"]:
        return f"measured {entry['measured']}, cached in {entry['file']}"
    return f"measured now, cached in {entry['file']}"




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
        return f"{1 / low:.3g}-{1 / high:.3g} s/token"
    return f"{speed(low)}-{high:.3g} tok/s" if low < 1 else f"{low:.3g}-{high:.3g} tok/s"


def format_plan(r: dict) -> str:
    p = r["projection"]
    maximum = f" (the model's maximum: {r['max_context']:,})" if r.get("max_context") else ""
    parts = " + ".join(f"{what} {human_bytes(n)}" for what, n in r["floor_parts"].items())
    lines = [
        f"model          {r['model']} ({r['model_type']}), activations {r['activation_dtype']}",
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
        f"prefill        passes of up to {r['prefill_pass']:,} tokens through each layer "
        f"(attention in chunks of {r['prefill_step']}), {human_bytes(r['prefill_bytes'])} "
        "of activations beyond the working buffers; each pass reads the experts its "
        "tokens route to once",
        "  first token  " + "; ".join(
            f"{q['prompt_tokens']:,} tokens: {_duration(q['seconds_to_first_token'])} "
            f"({q['passes']:,} pass{'es' if q['passes'] > 1 else ''}, "
            f"{human_bytes(q['read_bytes'])} read)" for q in r["prefill_projection"])
        + " (uniform routing, the cache's share held; longer prompts need --context)",
        f"scoring        passes of up to {r['scoring_pass_tokens']:,} tokens (texts within an "
        f"attention chunk; no KV kept), logits in blocks of {r['scoring_logit_rows']:,} "
        f"positions: {r['scoring_projection']['tokens_per_second']:.3g} scored tok/s "
        f"({_duration(r['scoring_projection']['pass_seconds'])} and "
        f"{human_bytes(r['scoring_projection']['pass_read_bytes'])} read per pass)",
        *_format_passes(r["passes"]),
        *_format_routes(r.get("disk_routes")),
    ]
    return "\n".join(lines)


def _format_passes(q: dict) -> list:
    h = human_bytes
    trunk = ("streamed a layer at a time" if q["trunk_streamed"] else "held whole")
    s = q["scoring"]
    return [
        f"pass plan      a pass gets the budget: up to {q['prefill_tokens']:,} prompt tokens "
        f"or {q['scoring_tokens']:,} scored tokens, beside the trunk {trunk} "
        f"({h(q['trunk_bytes'])}), one group of experts ({h(q['expert_group_bytes'])}), a "
        f"logits block ({h(q['logits_bytes'])}) and the KV/state the prompt keeps; "
        f"{h(q['token_bytes'])} per token",
        f"  per pass     trunk {h(s['trunk_read_bytes'])} and experts "
        f"{h(s['expert_read_bytes'])} read (each routed expert once, uniform routing)",
        "  first token  " + "; ".join(
            f"{p['prompt_tokens']:,} tokens: {_duration(p['seconds_to_first_token'])} "
            f"({p['passes']:,} pass{'es' if p['passes'] > 1 else ''} of up to "
            f"{p['pass_tokens']:,}, {h(p['read_bytes'])} read)" for p in q["prefill_projection"]),
        f"  scoring      {s['tokens_per_second']:.3g} scored tok/s ({_duration(s['seconds'])} "
        f"a pass, {'compute' if s['compute_seconds'] >= s['read_seconds'] else 'disk'} bound)",
    ]


def _format_routes(d):
    if not d:
        return []
    h = human_bytes
    linked = (f"  linked       --link-experts: {h(d['linked_output_bytes'])} output beside the "
              f"download = {h(d['download_and_linked_bytes'])} (the snapshot must stay)"
              if d["linked_output_bytes"] is not None else
              "  linked       not possible: the experts are requantized, not carried over")
    return [
        f"disk routes    download {h(d['download_bytes'])} ({d['download_from']}), "
        f"largest shard {h(d['largest_shard_bytes'])}",
        f"  packed       download, then convert: {h(d['packed_output_bytes'])} output = "
        f"{h(d['download_and_packed_bytes'])} at the peak",
        linked,
        f"  scratch      from the hub with --scratch-limit: {h(d['packed_output_bytes'])} "
        f"output + {h(d['scratch_peak_bytes'])} scratch peak = "
        f"{h(d['hub_with_scratch_bytes'])}",
    ]
