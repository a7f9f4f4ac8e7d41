"""Chat turn latencies: N equal turns with the session's cache kept (only the new
turn is prefilled) against the same turns re-prefilling the whole history each
time (what `deltafin-run --chat` did before sessions kept their cache).

    .venv/bin/python -m bench.studies.chat_turns [MODEL] [--budget B] [--turns N] [-n TOKENS]

MODEL defaults to the demo model (`deltafin-run --demo` builds it). Writes
bench/results/chat_turns.json and .md; the tokens of both ways must agree.
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from mlx_lm.models.cache import make_prompt_cache

from bench.lib import ROOT, common
from deltafin_mlx.chat.session import ChatSession
from deltafin_mlx.engine.load import load
from deltafin_mlx import runtime

MESSAGE = "Tell me about the quick brown fox and the lazy dog, in a few words."


def run_turns(model, tok, turns, max_tokens, keep_cache):
    session = ChatSession(model, tok)
    rows = []
    for i in range(turns):
        prompt = session.prompt_for(MESSAGE)
        if not keep_cache:  # an empty cache: the whole conversation is prefilled again
            session.cache, session.tokens = make_prompt_cache(model), []
        t = time.perf_counter()
        turn = session.ask(MESSAGE, max_tokens, prompt=prompt)
        wall = time.perf_counter() - t
        rows.append({"turn": i + 1, "prefilled": turn.prefilled, "reused": turn.reused,
                     "first_token_s": turn.stats.first_token_seconds, "turn_s": wall,
                     "decode_tok_s": turn.stats.decode_tokens_per_second,
                     "tokens": turn.tokens})
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", nargs="?", default=None)
    p.add_argument("--budget", default=None, help="default: a quarter of the experts (demo)")
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("-n", "--max-tokens", type=int, default=16)
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "chat_turns.json"))
    args = p.parse_args(argv)
    if args.model is None:
        args.model, args.budget = common.demo_model(args.budget)
    model, tok = load(args.model, args.budget, context=4096)
    result = {"model": args.model, "budget_bytes": runtime(model).plan.budget,
              "turns": args.turns, "max_tokens": args.max_tokens,
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    for name, keep in (("cache kept", True), ("history re-prefilled", False)):
        result[name] = run_turns(model, tok, args.turns, args.max_tokens, keep)
    same = all(a["tokens"] == b["tokens"]
               for a, b in zip(result["cache kept"], result["history re-prefilled"]))
    result["same_tokens"] = same
    runtime(model).close()

    lines = [f"# Chat turn latencies ({result['date']})", "",
             f"`{' '.join(['python -m bench.studies.chat_turns'] + (argv or sys.argv[1:]))}`: "
             f"{args.turns} equal turns of {args.max_tokens} tokens, budget "
             f"{result['budget_bytes'] / 1e6:.0f} MB; same tokens both ways: {same}.", "",
             "| turn | cache kept: prefilled | first token | turn | history re-prefilled: "
             "prefilled | first token | turn |", "|---|---|---|---|---|---|---|"]
    for a, b in zip(result["cache kept"], result["history re-prefilled"]):
        lines.append(f"| {a['turn']} | {a['prefilled']} | {a['first_token_s']:.2f} s | "
                     f"{a['turn_s']:.2f} s | {b['prefilled']} | {b['first_token_s']:.2f} s | "
                     f"{b['turn_s']:.2f} s |")
    kept = [r["turn_s"] for r in result["cache kept"]]
    lines += ["", f"Cache kept: last turn / first turn = {kept[-1] / kept[0]:.2f} "
              f"(median turn {statistics.median(kept):.2f} s)."]
    for r in result["cache kept"] + result["history re-prefilled"]:
        r.pop("tokens")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
