"""Scoring throughput: teacher-forced log-probs of many texts, packed into passes
that each sweep the experts once, against mlx-lm scoring the same texts fully in
memory and against Deltafin's own decode rate.

Compute-bound (here, where the CPU computes an expert slower than the disk reads
it): scored tokens/s at expert caches of 10%, 25% and 100% of the experts, sweeps,
expert bytes per scored token against the union bound of each pass (each (layer,
expert) the pass routes to read once), mlx-lm's `mlx_lm.perplexity.eval_ppl` on
the same texts with every expert in memory, and Deltafin's greedy decode rate in
the same process. With --iobound, the same scoring and decode under a blkio read
throttle that makes one expert read cost R times its computation
(bench/studies/iobound.py's emulation; needs root and cgroup v1 blkio).

    .venv/bin/python -m bench.studies.scoring                       # compute-bound
    .venv/bin/python -m bench.studies.scoring --iobound --ratios 8 32 --shares 0.1

The runs alternated in one process (`--mode ab` of the worker; `--only-ab` runs
just them) are mlx-lm's eval_ppl, then Deltafin at each of --ab-configs (every
expert held, 10/25/50% of the experts, 40MB by default), repeated: passes, tokens
per pass, expert and trunk bytes per pass against the union of each pass's
routing (the caches keep what the previous round left), scored tokens/s and the
ratio to mlx-lm per round (median and range). `--model demo` runs them on the
demo model.

Texts are random token ids (every position scored but the first) on the
I/O-bound study's K3-layout model (bench/studies/iobound.py MODEL). Each
measurement runs in a fresh process (`bench.lib.worker score`); repeats are
interleaved and reported as medians.
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from bench.lib import common
from bench.studies import iobound


def score_run(model: Path, mode: str, args, slots=None, throttle=None) -> dict:
    worker = ["--model", model, "--mode", mode, "--texts", args.texts, "--length", args.length,
              "--decode-tokens", args.decode_tokens]
    if slots is not None:
        worker += ["--cache-slots", slots]
    if throttle is not None:
        worker += throttle.worker_args
    common.drop_caches()
    return common.run_worker(worker, timeout=900, cap=throttle, mode="score")


def median(runs: list, key: str):
    vals = [r[key] for r in runs if r.get(key) is not None]
    return statistics.median(vals) if vals else None


def summarize(name: str, runs: list) -> dict:
    ok = [r for r in runs if r.get("status") == "ok"]
    if not ok:
        return {"config": name, "status": runs[-1].get("status"), "runs": runs}
    row = {"config": name, "repeats": len(ok), "runs": ok}
    for key in ("tokens_per_s", "decode_tokens_per_s", "sweeps", "bytes_per_scored_token",
                "union_bytes_per_scored_token", "expert_bytes_read", "union_bytes", "slots",
                "perplexity"):
        row[key] = median(ok, key)
    row["tokens_per_s_range"] = [min(r["tokens_per_s"] for r in ok),
                                 max(r["tokens_per_s"] for r in ok)]
    return row


def table(rows: list, baseline) -> str:
    head = ("| config | cache slots | scored tok/s (median, range) | vs mlx-lm in memory "
            "| sweeps | expert bytes / scored token | union bound / scored token "
            "| decode tok/s | scoring / decode |")
    lines = [head, "|" + "---|" * 9]
    for r in rows:
        if "tokens_per_s" not in r:
            lines.append(f"| {r['config']} | | {r.get('status')} |")
            continue
        lo, hi = r["tokens_per_s_range"]
        vs = f"{r['tokens_per_s'] / baseline:.2f}x" if baseline else "-"
        dec = r.get("decode_tokens_per_s")
        f = lambda v, fmt: "-" if v is None else format(v, fmt)  # noqa: E731
        lines.append(
            f"| {r['config']} | {f(r.get('slots'), '.0f')} | {r['tokens_per_s']:.1f} "
            f"({lo:.1f}-{hi:.1f}) | {vs if r['config'] != 'mlx-lm in memory' else '1.00x'} "
            f"| {f(r.get('sweeps'), '.0f')} | {f(r.get('bytes_per_scored_token'), ',.0f')} "
            f"| {f(r.get('union_bytes_per_scored_token'), ',.0f')} | {f(dec, '.2f')} "
            f"| {f(r['tokens_per_s'] / dec if dec else None, '.1f')}x |")
    return "\n".join(lines)


def ab_table(ab: dict) -> str:
    """The configurations alternated with mlx-lm in one process."""
    f = lambda v, fmt: "-" if v is None else format(v, fmt)  # noqa: E731
    lo, hi = ab["mlx_lm_tokens_per_s_range"]
    lines = [f"{ab['scored_tokens']} scored tokens, {ab['repeats']} rounds; mlx-lm in memory "
             f"{ab['mlx_lm_tokens_per_s']:.1f} scored tok/s ({lo:.1f}-{hi:.1f}); the same summed "
             f"log-probability at every configuration: {ab['same_logprob_every_config']}.", "",
             "| Deltafin | cache slots | passes (tokens per pass) | expert MB per pass "
             "| trunk MB per pass | union MB per pass | read / union | scored tok/s (range) "
             "| / mlx-lm (range) |", "|" + "---|" * 9]
    for r in ab["rows"]:
        lo, hi = r["tokens_per_s_range"]
        rlo, rhi = r["ratio_range"]
        lines.append(
            f"| {r['config']} | {r['slots']} of {r['all_experts']} | {statistics.median(r['sweeps']):.0f} "
            f"({r['tokens_per_pass']:.0f}) | {r['expert_bytes_per_pass'] / 1e6:.1f} "
            f"| {r['trunk_bytes_per_pass'] / 1e6:.1f} | {r['union_bytes_per_pass'] / 1e6:.1f} "
            f"| {f(r['expert_bytes_over_union'], '.2f')} | {r['tokens_per_s']:.1f} "
            f"({lo:.1f}-{hi:.1f}) | {r['median_ratio']:.2f}x ({rlo:.2f}-{rhi:.2f}) |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--texts", type=int, default=8,
                    help="texts per run (1,000 would take hours on this CPU)")
    ap.add_argument("--length", type=int, default=200, help="tokens per text")
    ap.add_argument("--shares", type=float, nargs="+", default=[0.10, 0.25, 1.0],
                    help="expert cache slots as a share of all experts")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--decode-tokens", type=int, default=16)
    ap.add_argument("--ab-repeats", type=int, default=5,
                    help="pairs of mlx-lm / Deltafin (100%%) alternated in one process")
    ap.add_argument("--ab-configs", nargs="+", default=["all", "10%", "25%", "50%", "40MB"],
                    help="Deltafin's configurations alternated with mlx-lm in one process: "
                    "all (every expert held), S%% of the experts, or a budget")
    ap.add_argument("--model", default=None,
                    help="a converted model, or `demo` (default: the I/O-bound study's)")
    ap.add_argument("--only-ab", action="store_true",
                    help="only the runs alternated in one process (no fresh-process cells)")
    ap.add_argument("--iobound", action="store_true",
                    help="under a blkio read throttle (root, cgroup v1), at --ratios")
    ap.add_argument("--ratios", type=float, nargs="+", default=[8, 32],
                    help="--iobound: read time of one expert / its compute time")
    ap.add_argument("--workdir", default="/tmp/deltafin-iobound")
    ap.add_argument("--out", default=None,
                    help="default: bench/results/scoring.json (scoring_iobound.json with --iobound)")
    args = ap.parse_args(argv)
    out = Path(args.out or common.BENCH / "results" /
               ("scoring_iobound.json" if args.iobound else "scoring.json"))
    if args.model == "demo":
        model = Path(common.demo_model()[0])
    elif args.model:
        model = Path(args.model)
    else:
        model = common.ensure_model(Path(args.workdir), "iobound-bias0.3", iobound.MODEL, seed=0)
    info = common.model_info(model)
    total = info["num_experts"] * info["moe_layers"]
    configs = [(f"deltafin {s:.0%}", max(info["experts_per_token"], round(s * total)))
               for s in args.shares]
    runs = {}
    extra = {}
    if not args.iobound:
        # The headline ratio: both in one process, alternated (separate processes
        # on this shared machine differ by more than the effect measured).
        ab = common.run_worker(["--model", model, "--mode", "ab", "--texts", args.texts,
                                "--length", args.length, "--repeats", args.ab_repeats,
                                "--configs", *args.ab_configs],
                               timeout=7200, mode="score")
        extra = {"ab": ab}
        common.log(f"ab: Deltafin (every expert held) / mlx-lm in memory, median "
                   f"{ab.get('median_ratio')}")
        configs = [("mlx-lm in memory", None)] + configs
        for rep in range(0 if args.only_ab else args.repeats):
            for name, slots in configs:
                mode = "mlx-lm" if slots is None else "deltafin"
                res = score_run(model, mode, args, slots)
                runs.setdefault(name, []).append(res)
                common.log(f"{name} repeat {rep + 1}: {res.get('tokens_per_s', res.get('status'))}")
    else:
        why = iobound.blkio_writable()
        if why:
            print(f"scoring: --iobound skipped, cannot set a read throttle ({why})")
            return 0
        device = iobound.disk_of(model)
        compute = iobound.expert_compute_s(model, info, argparse.Namespace(tokens=16, warmup=4))
        extra = {"expert_compute_s": compute, "device": device}
        named = []
        for ratio in args.ratios:
            bps = info["record_size"] / (ratio * compute)
            for name, slots in configs:
                named.append((f"R={ratio:g} {name}", slots, bps))
        for rep in range(args.repeats):
            for name, slots, bps in named:
                throttle = iobound.ReadThrottle(device, bps, f"score-{rep}-{len(runs)}")
                try:
                    res = score_run(model, "deltafin", args, slots, throttle)
                finally:
                    throttle.close()
                res["throttle_bps"] = bps
                runs.setdefault(name, []).append(res)
                common.log(f"{name} repeat {rep + 1}: {res.get('tokens_per_s', res.get('status'))}")
    rows = [summarize(name, rs) for name, rs in runs.items()]
    base = next((r.get("tokens_per_s") for r in rows if r["config"] == "mlx-lm in memory"), None)
    result = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "command": "python -m bench.studies.scoring " + " ".join(argv or sys.argv[1:]),
              "model": info, "texts": args.texts, "length": args.length,
              "repeats": args.repeats, **extra, "rows": rows, "machine": common.machine_info()}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    md = table(rows, base)
    if extra.get("ab", {}).get("median_ratio"):
        ab = extra["ab"]
        md = (f"Alternated in one process, {len(ab['pairs'])} pairs: Deltafin (every expert "
              f"held) / mlx-lm in memory = {ab['median_ratio']:.2f}x (median; pairs "
              + ", ".join(f"{p['ratio']:.2f}" for p in ab["pairs"])
              + f"), {ab['deltafin_tokens_per_s']:.1f} against "
              f"{ab['mlx_lm_tokens_per_s']:.1f} scored tok/s.\n\n" + ab_table(ab) + "\n\n" + md)
    out.with_suffix(".md").write_text(md + "\n")
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
