"""The plan report: the memory plan and the projected speeds of a model, without
loading its weights, and the machine rates they are projected from.

`plan_report(PlanOptions(...))` plans a converted model, or a source config.json
(a local one or a hub repo's) with deltafin-convert's options, as `deltafin-run
plan` shows it; `bench` projects its own run from the same rates (disk_rate,
decode_rates) to set the measured speed beside it. The disk and compute rates are
measured once per machine and cached (plan/rates.py), unless given.
"""

from collections import Counter
import os
import tempfile
from dataclasses import dataclass, fields
from fnmatch import fnmatch
from pathlib import Path
from typing import Optional

from deltafin_mlx.format.dtypes import compute_dtype, name_of
from deltafin_mlx.format.hub import (SOURCE_PATTERNS, HubError, fetch_config, list_repo,
                                     looks_like_hub_id)
from deltafin_mlx.format.manifest import MANIFEST_NAME, ModelError
from deltafin_mlx.format.model_dir import open_model_dir, read_source_config
from deltafin_mlx.format.record import FLOAT_MODE
from deltafin_mlx.model.build import source_dtype
from deltafin_mlx.model.config import check_config, max_context
from deltafin_mlx.model.quantization import expert_quantization
from deltafin_mlx.model.shard import expert_layout, sharded_inventory
from deltafin_mlx.plan.disk import disk_routes, itemsize_of
from deltafin_mlx.plan.footprint import inventory_from_config, inventory_from_manifest
from deltafin_mlx.plan.memory import check_context, choose_sequences, plan_memory
from deltafin_mlx.plan.rates import (cached_rate, calibration, compute_key, disk_key, layer_key,
                                     measure_compute_gwps, measure_disk_gbps,
                                     measure_layer_seconds)
from deltafin_mlx.plan.scoring import scoring_plan
from deltafin_mlx.plan.slots import max_slots, pool_chunks, pool_limit
from deltafin_mlx.plan.speed import project, project_prefill, project_scoring


# Prompt lengths whose time to first token `plan` projects.
PROJECTED_PROMPTS = (300, 3000, 30000)

# The most sequences `--sequences auto` plans (batch caps it at the requests left):
# state memory, not this, is the limit for any model whose state is worth planning.
AUTO_CAP = 4096
PREFILL_BATCH = 64  # tokens per matrix product when the prefill rate is measured

# deltafin-convert's options a source is planned with, and their defaults there.
CONVERSION_OPTIONS = {"bits": 4, "group_size": 64, "expert_bits": 4, "expert_group_size": 64}


@dataclass
class PlanOptions:
    """What to plan and how. `model`: a converted directory, a source directory or
    config.json, or a hub id. The conversion options (None: deltafin-convert's
    default) apply only to a source. A rate given (GB/s, G weights/s, ms) is used
    as it is; None: measured once on this machine, then cached."""

    model: str
    budget: Optional[str] = None
    context: int = 4096
    sequences: object = 1  # a number, or "auto"
    ranks: int = 1
    activation_dtype: str = "auto"  # a name of format.dtypes.ACTIVATION_DTYPES
    revision: Optional[str] = None
    bits: Optional[int] = None
    group_size: Optional[int] = None
    expert_bits: Optional[int] = None
    expert_group_size: Optional[int] = None
    disk_gbps: Optional[float] = None
    compute_gwps: Optional[float] = None
    prefill_gwps: Optional[float] = None
    layer_ms: Optional[float] = None
    remeasure: bool = False

    @classmethod
    def of(cls, namespace):
        """The options an argparse namespace holds (its other attributes ignored)."""
        return cls(**{f.name: getattr(namespace, f.name) for f in fields(cls)
                      if hasattr(namespace, f.name)})


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


def plan_report(options: PlanOptions) -> dict:
    """The plan report of `options.model`, as `deltafin-run plan --json` prints it:
    every figure per rank (`ranks`), each rate with where it came from."""
    target = Path(options.model).expanduser()
    given = {k: getattr(options, k) for k in CONVERSION_OPTIONS}
    bank = None
    routes = None  # a converted model has taken its route
    if target.is_dir() and (target / MANIFEST_NAME).exists():
        if options.revision is not None:
            raise ModelError(f"--revision {options.revision}: {target} is a converted model, "
                             "not a hub id")
        model_dir = open_model_dir(target)
        manifest, config = model_dir.manifest, model_dir.config
        named = [f"--{k.replace('_', '-')}" for k, v in given.items() if v is not None]
        if named:
            q, ex = manifest.quantization, manifest.quantization["experts"]
            raise ModelError(
                f"{' '.join(named)}: {target} is already converted (trunk "
                + (f"{q['trunk']['bits']}-bit" if q.get("trunk") else "unquantized")
                + ", experts " + (ex["dtype"] if ex["mode"] == FLOAT_MODE
                                  else f"{ex['mode']} {ex['bits']}-bit") + "); these options "
                "plan a source: pass its config.json or hub id instead")
        check_context(options.context, config)
        saved = manifest.dtype
        act = compute_dtype(options.activation_dtype, saved)
        inv = inventory_from_manifest(manifest, config, act)
        layout = expert_layout(manifest)
        bank = None if manifest.linked else manifest.bank_path(manifest.moe_layers[0])
        source, model_id = str(target), manifest.digest
    else:
        config_path = _config_path(target, options.model, options.revision)
        config = read_source_config(config_path)
        check_config(config, config_path)
        check_context(options.context, config)
        opts = {k: CONVERSION_OPTIONS[k] if v is None else v for k, v in given.items()}
        saved = name_of(source_dtype(config) or "bfloat16")
        act = compute_dtype(options.activation_dtype, saved)
        inv = inventory_from_config(config, act, bits=opts["bits"] or None,
                                    group_size=opts["group_size"],
                                    expert_bits=opts["expert_bits"],
                                    expert_group_size=opts["expert_group_size"])
        layout = None  # as deltafin-convert --ranks N would write it
        source = options.model if not target.exists() else str(config_path)
        routes = _disk_routes(inv, config, opts, target, options.model, options.revision)
        model_id = ""  # not converted: no bench has run it
    ranks = options.ranks
    whole = inv
    if ranks > 1:
        inv = sharded_inventory(inv, config, ranks, 0, layout, target)
    plan = plan_memory(inv, options.budget, context=options.context, stream_trunk=ranks == 1,
                       sequences=options.sequences, max_sequences=AUTO_CAP)
    # What `batch --batch-size auto` takes with requests enough: the sequences whose
    # state the plan allows.
    auto = choose_sequences(inv, plan.budget, plan.context, stream_trunk=ranks == 1, cap=AUTO_CAP)
    remeasure = options.remeasure
    disk, disk_from = disk_rate(options.disk_gbps, bank, source, remeasure)
    compute, compute_from, layer, layer_from = decode_rates(
        inv, act, options.compute_gwps, options.layer_ms, remeasure, model_id)
    mode, group = matvec_kind(inv)
    if options.prefill_gwps:
        batched, batched_from = options.prefill_gwps, "given"
    elif options.compute_gwps:  # a machine described by hand: its matvec rate, unless told more
        batched, batched_from = options.compute_gwps, "--compute-gwps (no --prefill-gwps given)"
    else:
        batched, entry = cached_rate(
            compute_key(mode, 4, group, act, PREFILL_BATCH),
            lambda: measure_compute_gwps(mode, group_size=group, act=act, batch=PREFILL_BATCH,
                                         dim=2048),
            remeasure)
        batched_from = _rate_origin(entry)
    streamed = [int(k) for k in plan.streamed]
    chunk = min(max_slots(s, act) for s in [inv.sections, *inv.layer_sections.values()])
    alike = Counter(tuple(s) for s in inv.layer_sections.values())  # mixed_*: per layout
    groups = [(n, max_slots(s, act)) for s, n in alike.items()] if alike else None
    limit = pool_limit(len(inv.moe_layers), inv.experts_per_token, inv.num_experts, chunk)
    scoring = scoring_plan(inv.config, plan, act)
    return {
        "model": source,
        "ranks": ranks,  # every figure below is per rank
        "whole_trunk_bytes": whole.trunk_bytes,
        "whole_expert_record_bytes": whole.record_size,
        "model_type": inv.model_type,
        "activation_dtype": name_of(act),
        "model_dtype": saved,  # what mlx-lm computes in (--activation-dtype model)
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
                                               inv.experts_per_token, inv.num_experts, chunk,
                                               groups)),
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
        # The one size of a pass per kind (plan/memory.py pass_tokens), as load runs it.
        "prefill_pass_tokens": plan.prefill_pass,
        "prefill_bytes": plan.prefill_bytes,
        "pass_trunk_layers": len(plan.pass_trunk),
        "pass_trunk_bytes": plan.pass_trunk_bytes,
        # A prompt longer than the context cannot be run with this plan at all: its
        # KV/state is planned for --context tokens, so it gets no projection.
        "prefill_projection": [project_prefill(inv, plan, n, disk, batched)
                               for n in PROJECTED_PROMPTS if n <= plan.context],
        "prefill_needs_context": [n for n in PROJECTED_PROMPTS if n > plan.context],
        "scoring_pass_tokens": scoring.pass_tokens,
        "scoring_logit_rows": scoring.logit_rows,
        "scoring_projection": project_scoring(inv, plan, scoring.pass_tokens, disk, batched),
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
                       itemsize_of(name_of(source_dtype(config) or "bfloat16")))


def matvec_kind(inv):
    """(quantization mode, group size) of the experts' matvecs, as measured."""
    mode = "mxfp4" if inv.sections[0].dtype == "uint32" and any(
        s.dtype == "uint8" for s in inv.sections) else "affine"
    return mode, 32 if mode == "mxfp4" else 64


def decode_rates(inv, act, compute_gwps=None, layer_ms=None, remeasure=False, model=""):
    """(matvec G weights/s, where from, per-layer seconds, where from): given
    (--compute-gwps / --layer-ms), else cached (measured once); the per-layer cost
    is what bench calibrated for `model` (a manifest digest) where it has, else the
    machine's microbenchmark."""
    mode, group = matvec_kind(inv)
    if compute_gwps:
        compute, compute_from = compute_gwps, "given"
    else:
        compute, entry = cached_rate(
            compute_key(mode, 4, group, act),
            lambda: measure_compute_gwps(mode, group_size=group, act=act), remeasure)
        compute_from = _rate_origin(entry)
    if layer_ms is not None:
        layer, layer_from = layer_ms / 1e3, "given"
    elif compute_gwps:
        layer, layer_from = 0.0, "not counted for a machine described by hand (give --layer-ms)"
    elif model and (entry := calibration(layer_key(act, model))):
        layer = entry["value"]
        layer_from = (f"calibrated by deltafin-run bench on this model (the mean of "
                      f"{entry['runs']} runs, the last {entry['measured']})")
    else:
        layer, entry = cached_rate(layer_key(act), lambda: measure_layer_seconds(act), remeasure)
        layer_from = _rate_origin(entry) + (f", {entry['how']}" if entry.get("how") else
                                            ", a microbenchmark: run bench to calibrate it")
    return compute, compute_from, layer, layer_from


def disk_rate(given, bank, source, remeasure=False):
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
