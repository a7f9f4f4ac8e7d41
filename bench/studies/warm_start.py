"""Warm restarts: the expert cache's hits over a run's first tokens, from an empty
cache (cold) against a restart that reads back the last run's hot set (warm).

    .venv/bin/python -m bench.studies.warm_start [MODEL] [--budget B] [-n 32]

MODEL defaults to the demo model (`deltafin-run --demo` builds it), at a budget
that holds a quarter of its experts. Each prompt is run cold (an empty hot-set
directory), then warm twice after a restart: with the same prompt, and with the
next prompt (a different question after the restart, against that prompt cold).
Hits are counted apart for the prefill with the first token and for the decoded
tokens after it. The hot sets live in a temporary XDG_CACHE_HOME, so the user's own
are neither used nor changed. Warm and cold tokens must agree. Writes
bench/results/warm_start.json and .md.
"""

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

from bench.lib import ROOT, common

PROMPTS = [
    "Explain how Deltafin runs a model larger than memory.",
    "Write a short poem about a lighthouse keeper.",
    "What is the capital of France, and why is it famous?",
    "List three ways to sort a list of numbers.",
]


def one_run(model_path, budget, prompt, tokens, lookahead, warm_start=True):
    """Load, generate, close (which saves the hot set): hits and misses of the
    prefill with the first token and of the tokens after it."""
    import deltafin_mlx

    model, tok = deltafin_mlx.load(model_path, memory_budget=budget, lookahead=lookahead,
                                   warm_start=warm_start)
    rt = deltafin_mlx.runtime(model)
    preloaded = rt.hot_set.preloaded if rt.hot_set is not None else 0
    first, last, out = None, None, []
    t = time.perf_counter()
    for r in deltafin_mlx.stream_generate(model, tok, prompt, tokens):
        out.append(r.token)
        last = r.deltafin
        if first is None:
            first = last
    wall = time.perf_counter() - t
    rt.close()
    row = {"prompt": prompt, "tokens": out, "preloaded": preloaded,
           "slots": rt.plan.slots, "experts": rt.plan.num_experts * rt.plan.moe_layers,
           "first_token_s": first.first_token_seconds, "wall_s": wall,
           "first": {"hits": first.hits, "misses": first.misses},
           "decode": {"hits": last.hits - first.hits, "misses": last.misses - first.misses},
           "all": {"hits": last.hits, "misses": last.misses}}
    return row


def rate(rows, part):
    hits = sum(r[part]["hits"] for r in rows)
    total = hits + sum(r[part]["misses"] for r in rows)
    return hits / total if total else 0.0


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", nargs="?", default=None)
    p.add_argument("--budget", default=None, help="default: a quarter of the experts (demo)")
    p.add_argument("-n", "--tokens", type=int, default=32)
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "warm_start.json"))
    args = p.parse_args(argv)
    if args.model is None:
        # Resolved before XDG_CACHE_HOME is pointed elsewhere (the demo lives under it).
        args.model, args.budget = common.demo_model(args.budget)

    results = {"model": args.model, "budget": args.budget, "tokens": args.tokens,
               "date": time.strftime("%Y-%m-%d"), "runs": {}}
    for lookahead in (False, True):
        rows = {"cold": [], "warm_same": [], "warm_next": []}
        for i, prompt in enumerate(PROMPTS):
            nxt = PROMPTS[(i + 1) % len(PROMPTS)]
            for kind, second in (("warm_same", prompt), ("warm_next", nxt)):
                with tempfile.TemporaryDirectory() as xdg:
                    os.environ["XDG_CACHE_HOME"] = xdg
                    cold = one_run(args.model, args.budget, prompt, args.tokens, lookahead)
                    assert cold["preloaded"] == 0
                    if kind == "warm_same":
                        rows["cold"].append(cold)
                    warm = one_run(args.model, args.budget, second, args.tokens, lookahead)
                    assert warm["preloaded"] > 0, "no hot set was read back"
                    rows[kind].append(warm)
                    reference = cold if kind == "warm_same" else one_run(
                        args.model, args.budget, second, args.tokens, lookahead,
                        warm_start=False)
                    if warm["tokens"] != reference["tokens"]:
                        raise SystemExit(f"tokens differ warm and cold: {second!r}")
        name = "lookahead" if lookahead else "no_lookahead"
        results["runs"][name] = rows
        slots, experts = rows["cold"][0]["slots"], rows["cold"][0]["experts"]
        print(f"{name}: {slots} of {experts} experts cached ({slots / experts:.0%}), "
              f"prompt + {args.tokens} tokens, {len(PROMPTS)} prompts")
        for kind in rows:
            r = rows[kind]
            print(f"  {kind:10s} hit rate: first token {rate(r, 'first'):.0%}, "
                  f"decode {rate(r, 'decode'):.0%}, all {rate(r, 'all'):.0%}; "
                  f"preloaded {sum(x['preloaded'] for x in r) / len(r):.0f}; "
                  f"first token {sum(x['first_token_s'] for x in r) / len(r) * 1e3:.0f} ms")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    lines = [f"# Warm restarts ({results['date']})", "",
             f"`python -m bench.studies.warm_start` on {args.model}, budget {args.budget} bytes, "
             f"prompt + {args.tokens} tokens, {len(PROMPTS)} prompts.", "",
             "| lookahead | run | hit rate, first token | decode | all | preloaded |",
             "|---|---|---|---|---|---|"]
    for name, rows in results["runs"].items():
        for kind, r in rows.items():
            lines.append(f"| {name} | {kind} | {rate(r, 'first'):.1%} | {rate(r, 'decode'):.1%} "
                         f"| {rate(r, 'all'):.1%} | {sum(x['preloaded'] for x in r) / len(r):.0f} |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print(f"wrote {out} and {out.with_suffix('.md')}")


if __name__ == "__main__":
    main()
