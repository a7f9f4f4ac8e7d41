"""The demo's model: a small synthetic MoE checkpoint in Kimi K3's published layout
(MXFP4 experts, K3's tensor names and shard naming, a tiktoken vocabulary),
converted with deltafin-convert, and a memory plan that holds only a quarter of
its experts, so most of them stream from disk. Used by `deltafin-run --demo`
(cli/demo.py), the tests and bench. Where it lives: format/catalog.py's demo_root."""

import os
import sys
from pathlib import Path

DEMO_SHAPE = dict(
    num_layers=6,
    hidden_size=256,
    num_experts=64,
    experts_per_token=8,
    routed_expert_hidden_size=256,
    moe_intermediate_size=512,
    intermediate_size=512,
)
CACHE_FRACTION = 0.25


def prepare(root: Path) -> Path:
    """The converted demo model under `root` (built on first use, reused afterwards)."""
    from deltafin_mlx.convert.convert import ConvertOptions, convert
    from deltafin_mlx.format import demo_marker
    from deltafin_mlx.format.manifest import MANIFEST_NAME
    from deltafin_mlx.testing.synthetic import make_checkpoint

    root = Path(root)
    model = root / demo_marker.MODEL
    if (model / MANIFEST_NAME).exists():
        print(f"[demo] the demo model, converted earlier, is in {model} "
              "('deltafin-run rm --demo' removes it)", file=sys.stderr)
        return model
    # Every file written here is recorded first (format/demo_marker.py): `rm --demo`
    # deletes those and nothing else of a folder that may be any the user named.
    root.mkdir(parents=True, exist_ok=True)
    src = root / demo_marker.SOURCE
    if not demo_marker.source_is_complete(root):
        work = demo_marker.start_source(root)
        print(f"[demo] writing a synthetic K3-layout checkpoint to {src}", file=sys.stderr)
        make_checkpoint(work, "kimi_k3", seed=0, **DEMO_SHAPE)
        demo_marker.finish_source(root, work)
    if not os.path.lexists(model):
        demo_marker.claim_model(root)
    print(f"[demo] converting it with deltafin-convert into {model}", file=sys.stderr)
    convert(str(src), model, ConvertOptions(progress=True))
    return model


def demo_plan(model_dir, budget=None, reader_threads: int = 1):
    """A plan whose budget holds the trunk and a quarter of the experts (the same
    plan `load` then makes from that budget), for the opened demo model; a
    `budget` given is planned as it is."""
    from deltafin_mlx.format.dtypes import compute_dtype
    from deltafin_mlx.plan.footprint import inventory_from_manifest
    from deltafin_mlx.plan.memory import plan_memory

    m = model_dir.manifest
    act = compute_dtype("auto", m.dtype)
    inv = inventory_from_manifest(m, model_dir.config, act)
    if budget is None:
        plan = plan_memory(inv, 1 << 50, reader_threads=reader_threads)
        total = m.experts["num_experts"] * len(m.moe_layers)
        slots = max(m.experts["experts_per_token"], int(total * CACHE_FRACTION))
        budget = plan.state_bytes + plan.working_bytes + inv.trunk_bytes + slots * plan.slot_bytes
    return plan_memory(inv, budget, reader_threads=reader_threads)
