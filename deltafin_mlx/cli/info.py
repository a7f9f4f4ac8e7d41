"""`deltafin-run info MODEL`: what a converted model is, from its manifest and
config.json alone (nothing big is read): architecture, layers, experts,
quantization, sizes on disk, where it came from and when it was converted."""

import json
from collections import defaultdict
from deltafin_mlx.cli.common import printable
from deltafin_mlx.cli.options import Parser

from deltafin_mlx.units import human_bytes
from deltafin_mlx.format.model_dir import open_model_dir
from deltafin_mlx.model.config import architecture_name, max_context, text_config

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
        "architecture_name": architecture_name(m.model_type),
        "layers": m.num_layers,
        "moe_layers": len(m.moe_layers),
        "experts_per_layer": ex["num_experts"],
        "experts_per_token": ex["experts_per_token"],
        "experts_total": ex["num_experts"] * len(m.moe_layers),
        "expert_record_bytes": ex["record_size"],
        "hidden_size": tc.get("hidden_size"),
        "max_context": max_context(model_dir.config),
        "dtype": m.dtype,
        "quantization": m.quantization,
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
    }


def _quant(q) -> str:
    if not q:
        return "unquantized"
    text = f"{q['mode']} {q['bits']}-bit, group size {q['group_size']}"
    return text + (" (carried over from the source as is)" if q.get("carried_over") else "")


def format_info(r: dict) -> str:
    b = r["bytes"]
    context = f", context up to {r['max_context']:,} tokens" if r.get("max_context") else ""
    converted = r["converted"] or "unknown"
    if r["converted_by"]:
        converted += f" by deltafin {r['converted_by']}"
    lines = [
        f"model          {r['model']}",
        f"architecture   {r['architecture_name']} ({r['architecture']}), {r['layers']} layers, "
        f"{r['moe_layers']} of them MoE, hidden size {r['hidden_size']}{context}",
        f"experts        {r['experts_per_layer']} per MoE layer, {r['experts_per_token']} per "
        f"token, {r['experts_total']:,} in all; {human_bytes(r['expert_record_bytes'])} each",
        f"quantization   trunk {_quant(r['quantization'].get('trunk'))}; "
        f"experts {_quant(r['quantization'].get('experts'))}; weights dtype {r['dtype']}",
        f"size on disk   {human_bytes(b['total'])} in {r['files']} files: trunk "
        f"{human_bytes(b['trunk'])}, experts {human_bytes(b['experts'])}, tokenizer "
        f"{human_bytes(b['tokenizer'])} ({r['tokenizer']}), other {human_bytes(b['other'])}",
        f"source         {r['source'] or 'unknown'}",
        f"converted      {converted}",
    ]
    return "\n".join(map(printable, lines))  # the manifest's strings come from strangers


def info_parser():
    p = Parser(prog="deltafin-run info", description="Describe a converted model (reads "
               "only its manifest and config.json).")
    p.add_argument("model", help="a directory written by deltafin-convert")
    p.add_argument("--json", action="store_true", help="print it as JSON")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    return p


def cmd_info(argv) -> int:
    args = info_parser().parse_args(argv)
    r = model_info(args.model)
    print(json.dumps(r, indent=1) if args.json else format_info(r))
    return 0
