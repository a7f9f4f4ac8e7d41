"""Peak RSS of a long prompt's prefill, over the interpreter's baseline, by prefill
chunk: one pass, mlx-lm's default 2048, smaller chunks, and the memory plan's.

    .venv/bin/python -m bench.studies.prefill_memory [MODEL] [--budget 40MB] [--tokens 3000]

MODEL defaults to a synthetic K3 layout of 8 layers (tests/engine/test_prefill_memory.py's),
generated under /tmp/deltafin-bench/prefill. Each measurement runs in a fresh process
(`deltafin_mlx.testing.peak prefill-peak`, the test's measurement too). Writes
bench/results/prefill_memory.json and .md.
"""

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from bench.lib import ROOT
from deltafin_mlx.testing import peak


def fixture(root: Path) -> Path:
    from deltafin_mlx.convert.convert import ConvertOptions, convert
    from deltafin_mlx.testing.synthetic import make_checkpoint

    if not (root / "model" / "deltafin.json").exists():
        src = make_checkpoint(root / "src", "kimi_k3", seed=0, num_layers=8)
        convert(str(src), root / "model", ConvertOptions(progress=False))
    return root / "model"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", nargs="?")
    p.add_argument("--budget", default="40MB")
    p.add_argument("--tokens", type=int, default=3000)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "prefill_memory.json"))
    args = p.parse_args(argv)
    model = Path(args.model) if args.model else fixture(Path("/tmp/deltafin-bench/prefill"))
    rows = []
    for step in (str(args.tokens + 1), "2048", "512", "128", "plan"):
        runs = []
        for _ in range(args.repeats):
            t = time.perf_counter()
            out = subprocess.run(peak.command("prefill-peak", model, args.budget, args.tokens, step),
                                 capture_output=True, text=True)
            if out.returncode:
                sys.exit(out.stderr.strip().splitlines()[-1])
            r = json.loads(out.stdout.strip().splitlines()[-1])
            r["seconds"] = time.perf_counter() - t
            runs.append(r)
        label = ("one pass" if step == str(args.tokens + 1)
                 else f"plan ({runs[0]['step']})" if step == "plan" else step)
        rows.append({"chunk": label, "mb": [r["over_baseline"] / 1e6 for r in runs],
                     "seconds": [r["seconds"] for r in runs], "budget": runs[0]["budget"]})
        print(f"{label}: {rows[-1]['mb']} MB over baseline", flush=True)
    date = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    lines = [f"# Prefill memory ({date})", "",
             f"`python -m bench.studies.prefill_memory {' '.join(argv or sys.argv[1:])}`: a "
             f"{args.tokens}-token prompt, budget {args.budget}, {model}", "",
             "| prefill chunk | peak RSS over baseline (MB), per run | process wall (s) |",
             "|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['chunk']} | {', '.join(f'{m:.0f}' for m in r['mb'])} | "
                     f"{', '.join(f'{s:.0f}' for s in r['seconds'])} |")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"date": date, "model": str(model), "budget": args.budget,
                               "tokens": args.tokens, "rows": rows}, indent=1))
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
