"""`deltafin-run --demo`: the main job on a built-in model, no download needed.

Generates a small synthetic MoE checkpoint in Kimi K3's published layout (MXFP4
experts, K3's tensor names and shard naming, a tiktoken vocabulary), converts it
with deltafin-convert, and runs it under a memory budget that holds only a quarter
of the experts, so most of them stream from disk. Its weights are random: the text
it writes is meaningless; the point is the mechanism and the counters.
"""

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


def demo_dir(args) -> Path:
    if args.demo_dir:
        return Path(args.demo_dir).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "deltafin" / "demo"


def prepare(root: Path) -> Path:
    """The converted demo model (built on first use, reused afterwards)."""
    from deltafin_mlx.convert.convert import ConvertOptions, convert

    from deltafin_mlx.format import demo_marker
    from deltafin_mlx.format.manifest import MANIFEST_NAME
    from deltafin_mlx.testing.synthetic import make_checkpoint

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


def demo_plan(model_dir, args):
    """A plan whose budget holds the trunk and a quarter of the experts (the same
    plan `load` then makes from that budget), for the opened demo model."""
    import mlx.core as mx

    from deltafin_mlx.engine.load import default_activation_dtype
    from deltafin_mlx.plan.footprint import inventory_from_manifest
    from deltafin_mlx.plan.memory import plan_memory

    m = model_dir.manifest
    act = default_activation_dtype() or getattr(mx, m.dtype)
    inv = inventory_from_manifest(m, model_dir.config, act)
    budget = args.budget
    if budget is None:
        plan = plan_memory(inv, 1 << 50, reader_threads=args.reader_threads)
        total = m.experts["num_experts"] * len(m.moe_layers)
        slots = max(m.experts["experts_per_token"], int(total * CACHE_FRACTION))
        budget = plan.state_bytes + plan.working_bytes + inv.trunk_bytes + slots * plan.slot_bytes
    return plan_memory(inv, budget, reader_threads=args.reader_threads)


def run_demo(args) -> int:
    """The demo model, then an ordinary run (or chat) of it: every option of
    deltafin-run works as it does on any model."""
    from deltafin_mlx.cli.chat import cmd_chat
    from deltafin_mlx.cli.run import cmd_run
    from deltafin_mlx.format.model_dir import open_model_dir

    model_dir = open_model_dir(prepare(demo_dir(args)))
    plan = demo_plan(model_dir, args)
    banks = sum(s for rel, s in model_dir.manifest.files.items() if rel.endswith(".bank"))
    print(
        f"[demo] budget {plan.budget / 1e6:.1f} MB for a model whose experts take "
        f"{banks / 1e6:.1f} MB on disk: {plan.slots} of "
        f"{plan.num_experts * plan.moe_layers} experts fit ({plan.cache_fraction:.0%}), "
        "the rest stream.",
        file=sys.stderr,
    )
    print("[demo] the weights are random, so the text below is meaningless.", file=sys.stderr)
    args.model, args.budget = str(model_dir.path), plan.budget
    if args.chat:
        return cmd_chat(args, model_dir)
    if args.prompt is None:
        args.prompt = "Explain how Deltafin runs a model larger than memory."
    return cmd_run(args, model_dir)


# Subcommands whose options include --budget: the demo gives them its own budget.
BUDGETED = {"plan", "bench", "batch", "serve"}


def demo_argv(command: str, argv: list) -> list:
    """A subcommand's arguments with `--demo [--demo-dir DIR]` replaced by the demo
    model's directory (built on first use) as its MODEL, and, where the command
    takes one and none is given, the demo's budget (a quarter of its experts)."""
    from types import SimpleNamespace

    from deltafin_mlx.errors import UsageError
    from deltafin_mlx.format.model_dir import open_model_dir

    rest, where = [], None
    it = iter(argv)
    for a in it:
        if a == "--demo":
            continue
        if a == "--demo-dir":
            where = next(it, None)
            if where is None:
                raise UsageError("--demo-dir needs a directory")
        elif a.startswith("--demo-dir="):
            where = a.split("=", 1)[1]
        else:
            rest.append(a)
    if any(a in ("-h", "--help") for a in rest):
        return rest  # the command's own help, without building anything
    args = SimpleNamespace(demo_dir=where, budget=None, reader_threads=1)
    model_dir = open_model_dir(prepare(demo_dir(args)))
    if command in BUDGETED and not any(a == "--budget" or a.startswith("--budget=") for a in rest):
        rest += ["--budget", str(demo_plan(model_dir, args).budget)]
    return [str(model_dir.path)] + rest
