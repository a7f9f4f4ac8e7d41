"""`deltafin-run --demo`: the main job on a built-in model, no download needed.

The model is testing/demo.py's: a small synthetic checkpoint in Kimi K3's layout,
converted, and run under a memory budget that holds only a quarter of its experts,
so most of them stream from disk. Its weights are random: the text it writes is
meaningless; the point is the mechanism and the counters. This module only finds
(or builds) it and hands it to the command asked for, as its MODEL and budget.
"""

import sys

from deltafin_mlx.errors import UsageError
from deltafin_mlx.format.catalog import demo_root
from deltafin_mlx.format.model_dir import open_model_dir
from deltafin_mlx.testing.demo import demo_plan, prepare

DEFAULT_PROMPT = "Explain how Deltafin runs a model larger than memory."


def demo_model(args):
    """The opened demo model (built on first use), with `args` made an ordinary run
    (or chat) of it: its MODEL, its budget unless one is given, and a prompt. Every
    option of deltafin-run then works as it does on any model."""
    model_dir = open_model_dir(prepare(demo_root(args.demo_dir)))
    plan = demo_plan(model_dir, args.budget, args.reader_threads)
    banks = sum(s for rel, s in model_dir.manifest.files.items() if rel.endswith(".bank"))
    print(f"[demo] budget {plan.budget / 1e6:.1f} MB for a model whose experts take "
          f"{banks / 1e6:.1f} MB on disk: {plan.slots} of "
          f"{plan.num_experts * plan.moe_layers} experts fit ({plan.cache_fraction:.0%}), "
          "the rest stream.",
          file=sys.stderr)
    print("[demo] the weights are random, so the text below is meaningless.", file=sys.stderr)
    args.model, args.budget = str(model_dir.path), plan.budget
    if not args.chat and args.prompt is None:
        args.prompt = DEFAULT_PROMPT
    return model_dir


def demo_argv(argv: list, parser) -> list:
    """A subcommand's arguments with `--demo [--demo-dir DIR]` replaced by the demo
    model's directory (built on first use) as its MODEL, and, where the command's
    `parser` has --budget and none is given, the demo's budget (a quarter of its experts)."""
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
    model_dir = open_model_dir(prepare(demo_root(where)))
    if "--budget" in parser._option_string_actions and not any(
            a == "--budget" or a.startswith("--budget=") for a in rest):
        rest += ["--budget", str(demo_plan(model_dir).budget)]
    return [str(model_dir.path)] + rest
