"""What-if runs: the same decode as bench.run with one runtime setting or
behaviour changed in the worker process only (deltafin_mlx is not edited).

    python -m bench.experiments [--workdir /tmp/deltafin-bench] [--repeats 2]

Variants, each at 25% and 10% budgets of the quick scale's model:
  shipped                  the runtime as it is (its defaults)
  no-pipeline              load(pipeline=False): no computing while reads land
  no-lookahead             load(lookahead=False): no reads ahead
  no-pipeline-no-lookahead both off: every read serialized with compute
  admit-all-speculation    reads ahead may evict like demand misses do
                           (worker decode --experiment admit-all-speculation)
  reader-threads-2         two reader threads (queue depth 2)
Writes bench/results/experiments.json and .md.
"""

import argparse
import json
import time
from pathlib import Path

from bench.lib.common import ROOT, ensure_model, log, model_info, model_overrides, summary
from bench.run import one_run

VARIANTS = {
    "shipped": [],
    "no-pipeline": ["--pipeline", "off"],
    "no-lookahead": ["--lookahead", "0"],
    "no-pipeline-no-lookahead": ["--pipeline", "off", "--lookahead", "0"],
    "admit-all-speculation": ["--experiment", "admit-all-speculation"],
    "reader-threads-2": ["--reader-threads", "2"],
}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", default="/tmp/deltafin-bench")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--variants", nargs="+", choices=sorted(VARIANTS), default=list(VARIANTS),
                    help="run only these variants")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "experiments.json"))
    args = ap.parse_args(argv)
    from bench.studies.diskprobe import run_probe

    model = ensure_model(Path(args.workdir), "k3x-h1024-l3-e160", model_overrides(1024, 3, 160))
    info = model_info(model)
    disk = run_probe(model, reads=64)
    bw = disk["qd1"]["gbps_median"] * 1e9
    log(f"disk QD1 {bw / 1e9:.2f} GB/s")
    base = ["--model", str(model), "--tokens", args.tokens, "--warmup", 4, "--prompt-tokens", 4]
    runs = {}
    t0 = time.time()
    for rep in range(args.repeats):
        for label, extra in [("resident", None)] + [
                (f"{v} {int(f * 100)}%", (v, f)) for f in (0.25, 0.10) for v in args.variants]:
            if extra is None:
                a = base + ["--mode", "resident"]
            else:
                v, f = extra
                a = base + ["--mode", "deltafin", "--budget", int(f * info["expert_bytes"])]
                a += VARIANTS[v]
            a += ["--routing"] if extra is not None else []
            r = one_run(label, a, {"timeout": 300}, drops=True)
            runs.setdefault(label, []).append(r)
            if r.get("status") == "ok":
                log(f"  {label}: {r['s_per_token']:.3f} s/token, hit {r.get('hit_rate') or 0:.0%}, "
                    f"issued {r.get('stats', {}).get('speculative_issued')}, recall "
                    f"{r.get('recall') or 0:.0%}, stall {r.get('stall_share') or 0:.0%}")
            else:
                log(f"  {label}: {r.get('status')}")
    compute = summary([r["s_per_token"] for r in runs["resident"] if r.get("status") == "ok"])
    ref = runs["resident"][0].get("tokens")
    rows = {}
    for label, rs in runs.items():
        ok = [r for r in rs if r.get("status") == "ok"]
        row = {"s_per_token": summary([r["s_per_token"] for r in ok])}
        if ok and ok[0]["mode"] == "deltafin":
            row.update({k: summary([r.get(k) for r in ok]) for k in
                        ("hit_rate", "precision", "recall", "stall_share", "bytes_read_per_token",
                         "needed_bytes_per_token")})
            row["issued_per_token"] = summary(
                [r["stats"]["speculative_issued"] / r["timed_tokens"] for r in ok])
            bounds = [max(compute["median"], r["needed_bytes_per_token"] / bw) for r in ok]
            row["ratio_to_bound"] = summary([r["s_per_token"] / b for r, b in zip(ok, bounds)])
            row["ratio_to_resident"] = summary([r["s_per_token"] / compute["median"] for r in ok])
            row["same_tokens"] = all(r["tokens"] == ref for r in ok)
        rows[label] = row
    res = {"command": "python -m bench.experiments", "started": time.strftime(
        "%Y-%m-%d %H:%M:%S %Z", time.localtime(t0)), "disk": disk, "model": info,
        "compute_bound_s": compute, "rows": rows, "runs": runs, "elapsed_s": time.time() - t0}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1))
    from bench.lib.report import rng

    L = [f"# `python -m bench.experiments` ({res['started']})", "",
         f"Model {info['path']}; compute bound {rng(compute, digits=3)} s/token; "
         f"disk QD1 {bw / 1e9:.2f} GB/s.", "",
         "| variant | s/token | ratio to bound | vs resident | hit rate | reads ahead issued/token "
         "| precision | recall | stall share | MB read/token | same tokens |",
         "|---|---|---|---|---|---|---|---|---|---|---|"]
    for label, r in rows.items():
        if "hit_rate" not in r:
            L.append(f"| {label} | {rng(r['s_per_token'], digits=3)} | | | | | | | | | |")
            continue
        L.append(f"| {label} | {rng(r['s_per_token'], digits=3)} | {rng(r['ratio_to_bound'])} | "
                 f"{rng(r['ratio_to_resident'])} | {rng(r['hit_rate'], pct=True, digits=0)} | "
                 f"{rng(r['issued_per_token'], digits=1)} | {rng(r['precision'], pct=True, digits=0)} | "
                 f"{rng(r['recall'], pct=True, digits=0)} | {rng(r['stall_share'], pct=True, digits=0)} | "
                 f"{rng(r['bytes_read_per_token'], 1e-6, 0)} | {'yes' if r['same_tokens'] else 'NO'} |")
    out.with_suffix(".md").write_text("\n".join(L) + "\n")
    print("\n".join(L))


if __name__ == "__main__":
    main()
