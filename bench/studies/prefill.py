"""Prompts at the disk bound: what a prefill reads and how long its first token takes.

For prompts of --prompts tokens and expert caches of --shares of all experts, on the
I/O-bound study's K3-layout model (skewed routing), each run in a fresh process
(`bench.lib.worker prefill-run`) reports:

- expert bytes the prefill read (its passes and the prompt's last token) against the
  union bound of its routing: every distinct (layer, expert) it routed to, once;
- time to first token against its bound, max(compute, union bytes / bandwidth),
  where compute is the same prefill with every expert in memory (no reads);
- prefill tokens/s against decode tokens/s.

Compute-bound (the disk as it is) always; I/O-bound with --ratios R (as root, cgroup v1
blkio: reading one expert record is throttled to take R times computing it, as in
bench.studies.iobound).

    .venv/bin/python -m bench.studies.prefill
    .venv/bin/python -m bench.studies.prefill --prompts 1000 --shares 0.25 --ratios 32

Side by side (`--parts side-by-side`, run first by default): mlx-lm with every
expert in memory and Deltafin at a budget holding every expert, at caches of
--side-shares of the experts and at --side-budgets, one --side-prompt-token prompt
per repeat, all in one process, alternated (`bench.lib.worker prefill-ab`), on the
demo model by default (`--side-model`): tokens per pass, expert and trunk bytes per
pass against the union of the prompt's routing, prefill tokens/s and the ratio to
mlx-lm per repeat (median and range). Writes bench/results/prefill_side_by_side.{json,md}.

    .venv/bin/python -m bench.studies.prefill --parts side-by-side --side-repeats 5
"""

import argparse
import json
import statistics
import time
from pathlib import Path

from bench.lib import common, worker
from bench.studies.iobound import (MODEL, ReadThrottle, blkio_writable, disk_of,
                                   expert_compute_s)


def run(model: Path, tokens: int, slots, decode: int, throttle=None) -> dict:
    """One prefill-run worker, in the throttle's cgroup when there is one."""
    import subprocess

    args = [model, tokens, slots, decode]
    if throttle is not None:
        args += throttle.worker_args[1:]
    common.drop_caches()
    p = subprocess.run(worker.command("prefill-run", *args), capture_output=True, text=True,
                       timeout=1800, env=worker.environment(),
                       preexec_fn=throttle.preexec() if throttle is not None else None)
    if p.returncode != 0:
        return {"status": "failed", "stderr": p.stderr[-2000:]}
    return json.loads(p.stdout.strip().splitlines()[-1])


def disk_rate(model: Path) -> float:
    """The disk's read rate in bytes/s, measured on the model's first bank (cached
    as `deltafin-run plan` caches it)."""
    from deltafin_mlx.plan.rates import cached_rate, disk_key, measure_disk_gbps

    bank = sorted((model / "experts").glob("*.bank"))[0]
    gbps, _ = cached_rate(disk_key(bank), lambda: measure_disk_gbps(bank))
    return gbps * 1e9


def side_by_side(args) -> str:
    """The prefill-ab worker's run, written out; returns its table."""
    import subprocess

    model = args.side_model or common.demo_model()[0]
    cmd = worker.command("prefill-ab", model, args.side_prompt_tokens, args.side_repeats, "all",
                         *[f"{s:g}%" for s in (100 * x for x in args.side_shares)],
                         *args.side_budgets)
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=7200,
                       env=worker.environment())
    if p.returncode != 0:
        raise SystemExit(f"prefill-ab failed: {p.stderr[-2000:]}")
    result = json.loads(p.stdout.strip().splitlines()[-1])
    result.update({"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                   "model": str(model), "machine": common.machine_info(),
                   "command": " ".join(map(str, cmd[1:]))})
    out = Path(args.out).with_name("prefill_side_by_side.json")
    out.write_text(json.dumps(result, indent=1))
    md = side_table(result)
    out.with_suffix(".md").write_text(md + "\n")
    return md


def side_table(result: dict) -> str:
    ref = result["mlx_lm"]
    lo, hi = ref["prefill_tokens_per_s_range"]
    f = lambda v, fmt: "-" if v is None else format(v, fmt)  # noqa: E731
    lines = [f"{result['prompt_tokens']}-token prompts, {result['repeats']} repeats (a new "
             f"prompt each), mlx-lm fully in memory: {ref['prefill_tokens_per_s']:.1f} tok/s "
             f"({lo:.1f}-{hi:.1f}).", "",
             "| Deltafin | cache slots | tokens per pass (passes) | expert MB per pass "
             "| trunk MB per pass | union MB | read / union | prefill tok/s (range) "
             "| / mlx-lm (range) | tokens and log-probs identical |",
             "|" + "---|" * 10]
    for r in result["rows"]:
        lo, hi = r["prefill_tokens_per_s_range"]
        rlo, rhi = r["ratio_range"]
        lines.append(
            f"| {r['config']} | {r['slots']} of {r['all_experts']} | {r['tokens_per_pass']} "
            f"({r['passes']}) | {r['expert_bytes_per_pass'] / 1e6:.1f} "
            f"| {r['trunk_bytes_per_pass'] / 1e6:.1f} | {f(r['union'] and r['union'] / 1e6, '.1f')} "
            f"| {f(r['expert_bytes_over_union'], '.2f')} | {r['prefill_tokens_per_s']:.1f} "
            f"({lo:.1f}-{hi:.1f}) | {r['median_ratio']:.2f}x ({rlo:.2f}-{rhi:.2f}) "
            f"| {'yes' if r['identical'] else 'NO'} |")
    return "\n".join(lines)


def median_of(runs: list, key: str):
    vals = [r[key] for r in runs if r.get(key) is not None]
    return statistics.median(vals) if vals else None


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, nargs="+", default=[300, 1000, 3000])
    ap.add_argument("--shares", type=float, nargs="+", default=[0.10, 0.25, 0.50, 1.0])
    ap.add_argument("--ratios", type=float, nargs="*", default=[],
                    help="I/O-bound runs: reading an expert costs R times computing it")
    ap.add_argument("--decode", type=int, default=32, help="tokens decoded after the prompt")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--workdir", default=str(common.ROOT / "bench" / "results" / "tmp"))
    ap.add_argument("--parts", nargs="+", choices=("side-by-side", "fresh"),
                    default=["side-by-side", "fresh"],
                    help="side-by-side: one process, alternated, against mlx-lm; fresh: the "
                    "per-process table on the I/O-bound model")
    ap.add_argument("--side-model", default=None, help="side by side: the model (default: the demo's)")
    ap.add_argument("--side-prompt-tokens", type=int, default=1000)
    ap.add_argument("--side-repeats", type=int, default=5)
    ap.add_argument("--side-shares", type=float, nargs="*", default=[0.10, 0.25, 0.50])
    ap.add_argument("--side-budgets", nargs="*", default=["40MB"])
    ap.add_argument("--out", default=str(common.ROOT / "bench" / "results" / "prefill.json"))
    args = ap.parse_args(argv)
    if "side-by-side" in args.parts:
        print(side_by_side(args))
    if "fresh" not in args.parts:
        return 0
    model = common.ensure_model(Path(args.workdir), "iobound", MODEL)
    info = common.model_info(model)
    total = info["num_experts"] * info["moe_layers"]
    disk_bps = disk_rate(model)
    rows = []
    regimes = [("compute-bound", None)]
    if args.ratios:
        why = blkio_writable()
        if why:
            common.log(f"prefill: no I/O-bound runs ({why})")
        else:
            per_expert = expert_compute_s(model, info, argparse.Namespace(tokens=32, warmup=4))
            for r in args.ratios:
                regimes.append((f"R={r:g}", info["record_size"] / (r * per_expert)))
    for tokens in args.prompts:
        resident = [run(model, tokens, "all", args.decode) for _ in range(args.repeats)]
        compute_s = median_of(resident, "seconds_to_first_token")
        for regime, bps in regimes:
            for share in args.shares:
                slots = "all" if share >= 1 else max(info["experts_per_token"], int(share * total))
                if slots == "all" and bps is not None:
                    continue  # nothing is read: the compute-bound row says it
                runs = []
                for i in range(args.repeats):
                    throttle = None
                    if bps is not None:
                        throttle = ReadThrottle(disk_of(model), bps, f"prefill{tokens}-{i}")
                    try:
                        runs.append(run(model, tokens, slots, args.decode, throttle))
                    finally:
                        if throttle is not None:
                            throttle.close()
                ok = [r for r in runs if "seconds_to_first_token" in r]
                if not ok:
                    rows.append({"prompt": tokens, "regime": regime, "share": share,
                                 "status": runs[-1]})
                    continue
                read, union = median_of(ok, "prefill_bytes_read"), median_of(ok, "union_bytes")
                ttft = median_of(ok, "seconds_to_first_token")
                bandwidth = bps or disk_bps
                bound = max(compute_s, union / bandwidth if union and bandwidth else 0.0)
                rows.append({
                    "prompt": tokens, "regime": regime, "share": share,
                    "slots": ok[0]["slots"], "passes": ok[0]["passes"],
                    "prefill_pass": ok[0]["prefill_pass"], "prefill_step": ok[0]["prefill_step"],
                    "bytes_read": read, "union_bytes": union,
                    "bytes_over_union": read / union if union else None,
                    "seconds_to_first_token": ttft, "compute_s": compute_s,
                    "throttle_bps": bps, "ttft_over_bound": ttft / bound if bound else None,
                    "prefill_tok_s": median_of(ok, "prefill_tokens_per_s"),
                    "decode_tok_s": median_of(ok, "decode_tokens_per_s"),
                    "repeats": len(ok),
                })
                common.log(f"prefill: {json.dumps(rows[-1])}")
    result = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "command": "python -m bench.studies.prefill " + " ".join(argv or []),
              "model": info, "rows": rows, "machine": common.machine_info()}
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(format_table(rows))
    return 0


def format_table(rows: list) -> str:
    f = lambda v, fmt: "-" if v is None else format(v, fmt)  # noqa: E731
    lines = ["| prompt | regime | cache | passes (tokens) | MB read | union MB | read/union "
             "| first token s | /bound | prefill tok/s | decode tok/s | prefill/decode |",
             "|" + "---|" * 12]
    for r in rows:
        if "bytes_read" not in r:
            lines.append(f"| {r['prompt']} | {r['regime']} | {r['share']:.0%} | failed |")
            continue
        ratio = (r["prefill_tok_s"] / r["decode_tok_s"]
                 if r["prefill_tok_s"] and r["decode_tok_s"] else None)
        lines.append(
            f"| {r['prompt']} | {r['regime']} | {r['share']:.0%} | {r['passes']} "
            f"({r['prefill_pass']}) | {f(r['bytes_read'] and r['bytes_read'] / 1e6, '.1f')} "
            f"| {f(r['union_bytes'] and r['union_bytes'] / 1e6, '.1f')} "
            f"| {f(r['bytes_over_union'], '.2f')} | {r['seconds_to_first_token']:.2f} "
            f"| {f(r['ttft_over_bound'], '.2f')} | {f(r['prefill_tok_s'], '.1f')} "
            f"| {f(r['decode_tok_s'], '.1f')} | {f(ratio, '.1f')} |")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
