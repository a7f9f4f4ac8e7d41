"""Deltafin performance evidence, in one command.

    python -m bench.run --quick     # one model scale, 2 repeats
    python -m bench.run --full      # three scales, 3 repeats, longer decodes

What one run measures, all in the same session so that the ratios compare like
with like (see bench/README.md and docs/PERFORMANCE.md):

1. bounds: O_DIRECT random reads of one expert record at queue depth 1 and 2
   (disk), and mlx-lm running the model fully in memory (compute);
2. decode on generated K3-layout models with K3's real expert shape: mlx-lm
   resident, Deltafin with a budget above the model size, Deltafin at 50%, 25%
   and 10% of the expert bytes, and mlx-lm under a cgroup memory cap equal to
   each budget; each configuration in a fresh process, page cache dropped first;
3. a Kimi K3 projection from per-layer times measured at K3's real widths;
4. results: bench/results/latest.json and .md, plots under docs/perf/.
"""

import argparse
import json
import time
from pathlib import Path

from bench.lib.common import (
    ROOT,
    MemoryCap,
    cgroups_writable,
    code_fingerprint,
    drop_caches,
    ensure_model,
    log,
    machine_info,
    model_info,
    model_overrides,
    remove_stale_cgroups,
    run_worker,
    summary,
    wait_for_quiet,
)

# (name, hidden, decoder layers (layer 0 dense, the rest MoE), experts per layer)
SCALES = {
    "quick": [("k3x-h1024-l3-e160", 1024, 3, 160)],
    "full": [
        ("k3x-h1024-l3-e160", 1024, 3, 160),
        ("k3x-h1024-l5-e160", 1024, 5, 160),
        ("k3x-h2048-l3-e320", 2048, 3, 320),
    ],
}
MODES = {
    # cap_deltafin: the budgets at which Deltafin also runs under the cgroup cap.
    "quick": dict(repeats=2, tokens=16, warmup=4, prompt=4, probe_reads=64, trace_tokens=0,
                  cap_deltafin=("50%", "25%", "10%"), timeout=240, quiet_timeout=90,
                  retries=1),
    "full": dict(repeats=3, tokens=32, warmup=8, prompt=4, probe_reads=192, trace_tokens=128,
                 cap_deltafin=("50%", "25%", "10%"), timeout=600, quiet_timeout=300, retries=2),
}
FRACTIONS = (0.50, 0.25, 0.10)
# A budget covers what Deltafin allocates (trunk, state, cache, working buffers),
# not the Python interpreter and MLX library under it, so each cgroup cap is the
# budget plus this allowance, for mlx-lm and Deltafin alike.
INTERPRETER_ALLOWANCE = 128 << 20


def deltafin_configs(info: dict):
    """(label, budget bytes) for Deltafin: above the model, then fractions of the
    expert bytes. The budget is what `load(memory_budget=...)` gets (trunk, state,
    working buffers and expert cache together) and what the cgroup caps get."""
    eb = info["expert_bytes"]
    full = int(eb * 1.1) + info["trunk_file_bytes"] * 4 + (256 << 20)
    out = [("deltafin-full", full)]
    out += [(f"deltafin-{int(f * 100)}%", int(f * eb)) for f in FRACTIONS]
    return out


def worker_args(model, mode, cfg, budget=None, trace=None, tokens=None, routing=False):
    a = ["--model", model, "--mode", mode, "--tokens", tokens or cfg["tokens"],
         "--warmup", cfg["warmup"], "--prompt-tokens", cfg["prompt"]]
    if routing:
        a += ["--routing"]
    if budget is not None:
        a += ["--budget", budget]
    if trace:
        a += ["--trace-out", trace]
    return a


MAX_FOREIGN_CPU = 0.10  # of the machine's CPUs, used by other processes during a run
RETRIES = 2


def one_run(label, args, cfg, drops, cap_bytes=None):
    """One configuration in a fresh process, rerun (up to RETRIES times) when
    other processes took more than MAX_FOREIGN_CPU of the CPUs meanwhile."""
    discarded = []
    retries = cfg.get("retries", RETRIES)
    for attempt in range(retries + 1):
        quiet = wait_for_quiet(timeout=cfg.get("quiet_timeout", 300))
        res = _one_run(label, args, cfg, drops, cap_bytes)
        res["quiet_wait"] = quiet
        foreign = res.get("foreign_cpu_share")
        if foreign is None or foreign <= MAX_FOREIGN_CPU or attempt == retries:
            break
        log(f"  {label}: other processes used {foreign:.0%} of the CPUs during the run: "
            "running it again")
        discarded.append(res)
    res["interference_discarded"] = discarded
    return res


def _one_run(label, args, cfg, drops, cap_bytes=None):
    dropped = drop_caches() if drops else False
    cap = None
    if cap_bytes is not None:
        cap = MemoryCap(cap_bytes, label.replace("%", "pct"))
    try:
        res = run_worker(args, cfg["timeout"], cap)
        if cap is not None:
            res["cgroup"] = cap.counters()
            res["cap_bytes"] = cap_bytes
            if res.get("status") in ("killed", "failed") and res["cgroup"].get(
                    "oom_control.oom_kill", 0) > 0:
                res["status"] = "oom-killed"
            tail = res.get("stderr_tail", "")
            phases = [l.split()[1] for l in tail.splitlines() if l.startswith("phase:")]
            if phases:
                res["last_phase"] = phases[-1]
    finally:
        if cap is not None:
            cap.close()
    res["label"] = label
    res["page_cache_dropped"] = dropped
    if res.get("status") == "ok":
        extra = ""
        if res.get("hit_rate") is not None:
            extra = (f", hit {res['hit_rate']:.0%}, {res['bytes_read_per_token'] / 1e6:.0f} MB "
                     f"read/token, stall {res['stall_share']:.0%}")
        log(f"  {label}: {res['s_per_token']:.3f} s/token ({res['tokens_per_s']:.2f} tok/s){extra}")
    else:
        log(f"  {label}: {res.get('status')} after {res.get('wall_s', 0):.0f} s"
            f" (phase {res.get('last_phase', '?')})")
    return res


def bench_scale(name, hidden, layers, experts, args, cfg, disk, can_cap, drops):
    from bench.studies.diskprobe import run_probe

    model = ensure_model(Path(args.workdir), name, model_overrides(hidden, layers, experts))
    info = model_info(model)
    log(f"scale {name}: {info['moe_layers']} MoE layers x {info['num_experts']} experts, "
        f"expert bytes {info['expert_bytes'] / 1e9:.2f} GB, trunk files "
        f"{info['trunk_file_bytes'] / 1e6:.0f} MB")
    if disk is None:
        log("disk probe: O_DIRECT random reads of one expert record, QD1 and QD2")
        wait_for_quiet(timeout=60)
        disk = run_probe(model, reads=cfg["probe_reads"])
        for k, r in disk.items():
            log(f"  {k}: {r['gbps_median']:.2f} GB/s median ({r['gbps_min']:.2f}-"
                f"{r['gbps_max']:.2f})")

    configs = [("mlx-lm resident", None)] + deltafin_configs(info)
    runs = {label: [] for label, _ in configs}
    for rep in range(cfg["repeats"]):
        log(f"scale {name}: repeat {rep + 1}/{cfg['repeats']}")
        for label, budget in configs:
            mode = "resident" if budget is None else "deltafin"
            # Routing is recorded where the runtime streams anyway (not at full budget,
            # where a callback could take it off its all-resident fast path).
            routing = label not in ("mlx-lm resident", "deltafin-full")
            runs[label].append(one_run(label, worker_args(model, mode, cfg, budget,
                                                          routing=routing), cfg, drops))

    capped = {}
    if can_cap:
        for label, budget in configs[2:]:
            pct = label.split("-")[1]
            cap = budget + INTERPRETER_ALLOWANCE
            key = f"mlx-lm capped {pct}"
            capped[key] = []
            for rep in range(cfg["repeats"]):
                log(f"scale {name}: mlx-lm (fully in memory) under a {cap / 1e9:.2f} GB cgroup "
                    f"cap (budget {pct} + {INTERPRETER_ALLOWANCE >> 20} MiB)")
                capped[key].append(one_run(key, worker_args(model, "resident", cfg), cfg, drops,
                                           cap_bytes=cap))
            if pct in cfg["cap_deltafin"]:
                dkey = f"deltafin capped {pct}"
                reps = 1 if cfg["repeats"] < 3 else cfg["repeats"]
                capped[dkey] = []
                for rep in range(reps):
                    log(f"scale {name}: Deltafin (budget {pct}) under the same {cap / 1e9:.2f} GB cap")
                    capped[dkey].append(one_run(dkey, worker_args(model, "deltafin", cfg, budget),
                                                cfg, drops, cap_bytes=cap))

    trace = None
    if cfg["trace_tokens"]:
        trace = str(Path(args.workdir) / name / "routing-trace.jsonl")
        log(f"scale {name}: routing trace of {cfg['trace_tokens']} tokens (full budget)")
        one_run("trace", worker_args(model, "deltafin", cfg, configs[1][1], trace,
                                     cfg["trace_tokens"]), cfg, drops)
    return {"name": name, "model": info, "runs": runs, "capped": capped, "trace": trace}, disk


def pool_probes(a: dict, b: dict) -> dict:
    import numpy as np

    out = {}
    for k in a:
        s = np.array(a[k]["gbps_samples"] + b[k]["gbps_samples"])
        out[k] = dict(a[k], gbps_samples=s.tolist(), gbps_median=float(np.median(s)),
                      gbps_min=float(s.min()), gbps_max=float(s.max()),
                      reads=a[k]["reads"] + b[k]["reads"])
    return out


def analyze(scale: dict, disk: dict):
    """Medians, ranges, bounds and ratios of one scale."""
    bw = disk["qd1"]["gbps_median"] * 1e9
    runs = scale["runs"]
    rows = {}
    res_ok = [r for r in runs["mlx-lm resident"] if r.get("status") == "ok"]
    compute = summary([r["s_per_token"] for r in res_ok])
    ref_tokens = res_ok[0]["tokens"] if res_ok else None
    for label, rs in runs.items():
        ok = [r for r in rs if r.get("status") == "ok"]
        row = {"runs": len(rs), "ok": len(ok), "statuses": [r.get("status") for r in rs],
               "errors": sorted({(r.get("stderr_tail") or "").strip().splitlines()[-1][:200]
                                 for r in rs if r.get("status") != "ok"
                                 and (r.get("stderr_tail") or "").strip()})}
        if ok:
            row.update(
                s_per_token=summary([r["s_per_token"] for r in ok]),
                tokens_per_s=summary([r["tokens_per_s"] for r in ok]),
                peak_rss=summary([r["peak_rss"] for r in ok]),
                load_s=summary([r["load_s"] for r in ok]),
                prefill_s=summary([r["prefill_s"] for r in ok]),
                tokens_match_resident=(all(r["tokens"] == ref_tokens for r in ok)
                                       if ref_tokens else None),
                breakdown={k: summary([r["breakdown"].get(k) for r in ok])
                           for k in ok[0]["breakdown"]},
                cpu_steal_share=summary([r.get("cpu_steal_share") for r in ok]),
                foreign_cpu_share=summary([r.get("foreign_cpu_share") for r in ok]),
                reruns_for_interference=sum(len(r.get("interference_discarded", [])) for r in rs),
            )
            if "plan" in ok[0]:
                p = ok[0]["plan"]
                row["budget"] = ok[0]["budget"]
                row["slots"] = p.get("slots")
                row["cache_fraction"] = p.get("cache_fraction")
                row["peak_rss_over_budget"] = summary([r["peak_rss"] / r["budget"] for r in ok])
                for k in ("hit_rate", "precision", "recall", "stall_share",
                          "bytes_read_per_token", "needed_bytes_per_token",
                          "demand_miss_bytes_per_token"):
                    row[k] = summary([r.get(k) for r in ok])
                io = [r["needed_bytes_per_token"] / bw for r in ok]
                row["io_bound_s"] = summary(io)
                row["routing"] = ok[0].get("routing")
                if compute["median"]:
                    bounds = [max(compute["median"], x) for x in io]
                    serial = [compute["median"] + x for x in io]
                    row["bound_s"] = summary(bounds)
                    row["serial_bound_s"] = summary(serial)
                    row["ratio_to_bound"] = summary(
                        [r["s_per_token"] / b for r, b in zip(ok, bounds)])
                    row["ratio_to_serial"] = summary(
                        [r["s_per_token"] / s for r, s in zip(ok, serial)])
                    row["ratio_to_resident"] = summary(
                        [r["s_per_token"] / compute["median"] for r in ok])
                    # Share of the reader's busy time hidden behind compute:
                    # 0 when time = compute + reads, 1 when time = compute.
                    hidden = []
                    for r in ok:
                        busy = r["breakdown"].get("reader_busy_s")
                        if busy:
                            h = (compute["median"] + busy - r["s_per_token"]) / busy
                            hidden.append(min(max(h, 0.0), 1.0))
                    row["io_hidden_share"] = summary(hidden)
        rows[label] = row
    capped = {}
    for label, rs in scale["capped"].items():
        capped[label] = {
            "cap_bytes": rs[0].get("cap_bytes"),
            "statuses": [r.get("status") for r in rs],
            "last_phase": [r.get("last_phase") for r in rs],
            "wall_s": [round(r.get("wall_s", r.get("process_wall_s", 0)), 1) for r in rs],
            "max_usage_bytes": [r.get("cgroup", {}).get("max_usage_in_bytes") for r in rs],
            "s_per_token": summary([r.get("s_per_token") for r in rs if r.get("status") == "ok"]),
            "tokens_match_resident": ([r["tokens"] == ref_tokens for r in rs
                                       if r.get("status") == "ok"] if ref_tokens else None),
        }
    return {"compute_bound_s": compute, "disk_gbps_qd1": disk["qd1"]["gbps_median"],
            "rows": rows, "capped": capped}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--quick", action="store_true")
    g.add_argument("--full", action="store_true")
    ap.add_argument("--workdir", default="/tmp/deltafin-bench",
                    help="bench models are generated here once and reused")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "latest.json"))
    ap.add_argument("--plots", default=str(ROOT / "docs" / "perf"))
    ap.add_argument("--scale", action="append",
                    help="run only this model scale (repeatable; names as in SCALES)")
    ap.add_argument("--repeats", type=int)
    ap.add_argument("--tokens", type=int)
    ap.add_argument("--no-cgroup", action="store_true", help="skip the capped mlx-lm runs")
    ap.add_argument("--no-projection", action="store_true")
    ap.add_argument("--no-drop-caches", action="store_true")
    args = ap.parse_args(argv)
    mode = "quick" if args.quick else "full"
    cfg = dict(MODES[mode])
    if args.repeats:
        cfg["repeats"] = args.repeats
    if args.tokens:
        cfg["tokens"] = args.tokens

    t_start = time.time()
    log(f"deltafin bench --{mode}: {cfg}")
    drops = not args.no_drop_caches and drop_caches()
    if not drops:
        log("page cache drops not permitted here: bank reads may hit the page cache "
            "(Deltafin reads with O_DIRECT and is unaffected; mlx-lm's loads are)")
    can_cap = False
    if not args.no_cgroup:
        can_cap = cgroups_writable()
        if can_cap:
            remove_stale_cgroups()
        else:
            log("cgroup v1 memory controller not writable: skipping the capped runs")

    results = {
        "mode": mode,
        "command": f"python -m bench.run --{mode}",
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(t_start)),
        "machine": machine_info(),
        "code": code_fingerprint(),
        "settings": cfg,
        "page_cache_dropped": drops,
        "cgroups": can_cap,
        "cap_rule": f"cap = budget + {INTERPRETER_ALLOWANCE >> 20} MiB (interpreter allowance)",
        "scales": [],
    }
    scales = SCALES[mode]
    if args.scale:
        known = {s[0]: s for m in SCALES.values() for s in m}
        unknown = [n for n in args.scale if n not in known]
        if unknown:
            ap.error(f"unknown scale(s) {unknown}; known: {sorted(known)}")
        scales = [known[n] for n in args.scale]
        results["command"] += "".join(f" --scale {n}" for n in args.scale)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    disk = None
    for name, hidden, layers, experts in scales:
        scale, disk = bench_scale(name, hidden, layers, experts, args, cfg, disk, can_cap, drops)
        results["scales"].append(scale)
        results["disk_start"] = disk
        # Written after every scale, so an interrupted run leaves what it measured.
        partial = dict(results, partial=True)
        partial["scales"] = [dict(sc, analysis=analyze(sc, disk)) for sc in results["scales"]]
        out.with_suffix(".partial.json").write_text(json.dumps(partial, indent=1))
        log(f"partial results so far: {out.with_suffix('.partial.json')}")

    from bench.studies.diskprobe import run_probe

    first = results["scales"][0]["model"]["path"]
    log("disk probe again (drift over the run)")
    wait_for_quiet(timeout=60)
    results["disk_end"] = run_probe(first, reads=cfg["probe_reads"], seed=7)
    for k, r in results["disk_end"].items():
        log(f"  {k}: {r['gbps_median']:.2f} GB/s median ({r['gbps_min']:.2f}-{r['gbps_max']:.2f})")
    # The I/O bound uses the start and end probes' samples together.
    results["disk"] = pooled = pool_probes(results["disk_start"], results["disk_end"])
    log(f"disk, both probes pooled: QD1 {pooled['qd1']['gbps_median']:.2f} GB/s, "
        f"QD2 {pooled['qd2']['gbps_median']:.2f} GB/s (medians)")
    for scale in results["scales"]:
        scale["analysis"] = analyze(scale, pooled)

    if not args.no_projection:
        from bench.studies.k3_projection import project

        results["k3_projection"] = project(Path(args.workdir), results["disk"], mode, drops)

    from bench.lib.simulate import simulate_all

    results["simulation"] = simulate_all(results, mode)
    results["elapsed_s"] = time.time() - t_start
    results["partial"] = False
    results["code_at_end"] = code_fingerprint()
    if results["code_at_end"]["sha256"] != results["code"]["sha256"]:
        changed = [f for f, h in results["code_at_end"]["files"].items()
                   if results["code"]["files"].get(f) != h]
        log(f"warning: the runtime's sources changed during the run: {changed}")
    out.write_text(json.dumps(results, indent=1))
    out.with_suffix(".partial.json").unlink(missing_ok=True)
    log(f"wrote {out}")

    from bench.lib.report import write_reports

    write_reports(results, out.with_suffix(".md"), Path(args.plots))
    log(f"done in {results['elapsed_s'] / 60:.1f} min")


if __name__ == "__main__":
    main()
