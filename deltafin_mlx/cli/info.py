"""`deltafin-run info MODEL`: what a converted model is, from its manifest and
config.json alone (nothing big is read): architecture, layers, experts,
quantization, sizes on disk, where it came from and when it was converted."""

import json
from collections import defaultdict
from deltafin_mlx.cli.common import printable
from deltafin_mlx.cli.options import Parser

from pathlib import Path

from deltafin_mlx.units import human_bytes
from deltafin_mlx.errors import ModelError
from deltafin_mlx.format.dtypes import compute_dtype, name_of
from deltafin_mlx.format.hub import HubError, fetch_config, list_repo, looks_like_hub_id
from deltafin_mlx.format.manifest import MANIFEST_NAME
from deltafin_mlx.format.model_dir import open_model_dir, read_source_config
from deltafin_mlx.model.config import max_context, text_config
from deltafin_mlx.model.quantization import quantization_by_part, quantization_summary


def hub_source_info(repo: str, revision=None) -> dict:
    """What a hub checkpoint is, from its config.json and the hub's file listing
    (nothing else is downloaded): what `info` says of a model not yet converted."""
    from deltafin_mlx.model.build import build_moe

    try:
        listed = list_repo(repo, revision, "its config.json")
        config = read_source_config(fetch_config(repo, revision).resolve())
    except HubError as e:
        raise ModelError(str(e)) from None
    tc = text_config(config)
    _, paths, _, moe = build_moe(config, f"{repo}: config.json")
    weights = None if listed is None else sum(
        f.size for f in listed.files.values() if f.name.endswith(".safetensors"))
    return {
        "model": repo,
        "converted": False,
        "architecture": config.get("model_type"),
        "layers": len(paths),
        "experts_per_layer": moe.num_experts,
        "experts_per_token": moe.experts_per_token,
        "hidden_size": tc.get("hidden_size"),
        "max_context": max_context(config),
        "commit": listed.commit if listed else None,
        "checkpoint_bytes": weights,  # None offline: the listing is the hub's
    }


def format_hub_info(r: dict) -> str:
    size = (human_bytes(r["checkpoint_bytes"]) + " of safetensors on the hub"
            if r["checkpoint_bytes"] is not None else "unknown (offline)")
    name = r["model"].split("/")[1]
    return "\n".join([
        f"model          {r['model']} (on the Hugging Face hub, not converted)",
        f"architecture   {r['architecture']}, {r['layers']} layers, "
        f"hidden size {r['hidden_size']}, context up to {r['max_context'] or 'unknown'} tokens",
        f"experts        {r['experts_per_layer']} per MoE layer, {r['experts_per_token']} "
        "per token",
        f"checkpoint     {size}",
        f"convert it     deltafin-convert {r['model']} ~/models/{name} "
        f"(disk per route: deltafin-run plan {r['model']})",
    ])

def model_info(path) -> dict:
    model_dir = open_model_dir(path)
    path, m, tc = model_dir.path, model_dir.manifest, text_config(model_dir.config)
    sizes = defaultdict(int)
    for rel, size in m.files.items():
        kind = rel.split("/", 1)[0] if "/" in rel else (
            "tokenizer" if rel in m.tokenizer.get("files", []) else "other")
        sizes[kind] += size
    ex = m.experts
    return {
        "model": str(path),
        "architecture": m.model_type,
        "layers": m.num_layers,
        "moe_layers": len(m.moe_layers),
        "experts_per_layer": ex["num_experts"],
        "experts_per_token": ex["experts_per_token"],
        "experts_total": ex["num_experts"] * len(m.moe_layers),
        "expert_record_bytes": ex["record_size"],
        "hidden_size": tc.get("hidden_size"),
        "max_context": max_context(model_dir.config),
        "dtype": m.dtype,
        "activation_dtype": {"auto": name_of(compute_dtype("auto", m.dtype)), "model": m.dtype},
        "quantization": m.quantization,
        # per part, from config.json's per-module entries (the manifest's "trunk" is
        # only the default: gpt-oss's router is 8-bit where it says 4)
        "quantization_by_part": quantization_by_part(model_dir.config, m),
        "bytes": {"trunk": sizes["trunk"], "experts": sizes["experts"],
                  "tokenizer": sizes["tokenizer"], "other": sizes["other"],
                  "total": sum(m.files.values())},
        "files": len(m.files),
        "tokenizer": m.tokenizer.get("kind"),
        "source": m.source.get("id"),
        "source_fingerprint": m.source.get("fingerprint"),
        "converted": m.source.get("converted"),
        "converted_by": m.source.get("deltafin_version"),  # absent in older manifests
        "conversion_options": m.source.get("options"),
        # linked experts (format version 3): read where they lie in the source
        "linked_source_root": m.linked["root"] if m.linked else None,
        "linked_source_files": len(m.linked["files"]) if m.linked else 0,
    }


def format_info(r: dict) -> str:
    b, act = r["bytes"], r["activation_dtype"]
    context = f", context up to {r['max_context']:,} tokens" if r.get("max_context") else ""
    converted = r["converted"] or "unknown"
    carried = " (experts carried over from the source as they are)"
    if r["converted_by"]:
        converted += f" by deltafin {r['converted_by']}"
    lines = [
        f"model          {r['model']}",
        f"architecture   {r['architecture']}, {r['layers']} layers, "
        f"{r['moe_layers']} of them MoE, hidden size {r['hidden_size']}{context}",
        f"experts        {r['experts_per_layer']} per MoE layer, {r['experts_per_token']} per "
        f"token, {r['experts_total']:,} in all; {human_bytes(r['expert_record_bytes'])} each",
        f"quantization   {quantization_summary(r['quantization_by_part'])}"
        f"{carried if (r['quantization'].get('experts') or {}).get('carried_over') else ''}; "
        f"weights dtype {r['dtype']}",
        f"activations    {act['auto']} here by default; {act['model']} with --activation-dtype "
        "model (as mlx-lm computes)",
        f"size on disk   {human_bytes(b['total'])} in {r['files']} files: trunk "
        f"{human_bytes(b['trunk'])}, experts {human_bytes(b['experts'])}, tokenizer "
        f"{human_bytes(b['tokenizer'])} ({r['tokenizer']}), other {human_bytes(b['other'])}",
        f"source         {r['source'] or 'unknown'}",
        f"converted      {converted}",
        *([f"linked         the experts are read where they lie in {r['linked_source_files']} "
           f"files under {r['linked_source_root']} (they must stay there, unchanged; "
           "verify checks them)"] if r.get("linked_source_root") else []),
    ]
    return "\n".join(map(printable, lines))  # the manifest's strings come from strangers


def info_parser():
    p = Parser(prog="deltafin-run info", description="Describe a converted model (reads "
               "only its manifest and config.json).")
    p.add_argument("model", help="a directory written by deltafin-convert, or a hub id "
                   "(only its config.json and file listing are fetched)")
    p.add_argument("--revision", default=None,
                   help="for a hub id: the branch, tag or commit (default: main)")
    p.add_argument("--json", action="store_true", help="print it as JSON")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    return p


def cmd_info(argv) -> int:
    args = info_parser().parse_args(argv)
    if not Path(args.model).expanduser().exists() and looks_like_hub_id(args.model):
        r = hub_source_info(args.model, args.revision)
        print(json.dumps(r, indent=1) if args.json else format_hub_info(r))
        return 0
    if args.revision is not None:
        raise ModelError(f"--revision {args.revision}: {args.model} is not a hub id")
    source = Path(args.model).expanduser()
    if (source / "config.json").is_file() and not (source / MANIFEST_NAME).exists():
        # A checkpoint not converted: a dense one is said to be mlx-lm's to run.
        from deltafin_mlx.model.build import build_moe

        build_moe(read_source_config(source / "config.json"), source / "config.json")
    r = model_info(args.model)
    print(json.dumps(r, indent=1) if args.json else format_info(r))
    return 0
