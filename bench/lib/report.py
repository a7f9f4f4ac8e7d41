"""Markdown tables and PNG plots from a results JSON written by bench.run.

    python -m bench.lib.report bench/results/latest.json     # rewrite latest.md and the plots
"""

import argparse
import json
import sys
from pathlib import Path

from bench.lib import ROOT


def rng(s, mul=1.0, digits=2, pct=False):
    """'median (min-max)' of a summary dict."""
    if not s or s.get("median") is None:
        return "-"
    f = (lambda x: f"{x * mul * (100 if pct else 1):.{digits}f}{'%' if pct else ''}")
    if s.get("n", 1) > 1 and s["min"] != s["max"]:
        return f"{f(s['median'])} ({f(s['min'])}-{f(s['max'])})"
    return f(s["median"])


def med(s, mul=1.0, digits=2):
    if not s or s.get("median") is None:
        return "-"
    return f"{s['median'] * mul:.{digits}f}"


def pct_or_dash(s):
    m = med(s, 100, 0)
    return "-" if m == "-" else f"{m}%"


def decode_table(scale) -> list:
    a = scale["analysis"]
    info = scale["model"]
    L = []
    L.append(f"### {scale['name']}: {info['moe_layers']} MoE layers x {info['num_experts']} experts "
             f"({info['expert_bytes'] / 1e9:.2f} GB of experts, {info['experts_per_token']} per "
             f"token, record {info['record_size']:,} bytes)\n")
    L.append(f"Compute bound (mlx-lm resident): {rng(a['compute_bound_s'], digits=3)} s/token; "
             f"disk bandwidth used for the I/O bound: {a['disk_gbps_qd1']:.2f} GB/s (QD1 median).\n")
    L.append("| configuration | budget | cache | tok/s | s/token | MB read/token | hit rate "
             "| lookahead precision / recall | stall share | I/O bound s | bound s "
             "| ratio to bound | vs resident | same tokens |")
    L.append("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for label, r in a["rows"].items():
        if not r.get("ok"):
            err = "; ".join(r.get("errors", [])).replace("|", "/")
            L.append(f"| {label} | | | {', '.join(map(str, r['statuses']))}"
                     f"{': ' + err if err else ''} | | | | | | | | | | |")
            continue
        budget = f"{r['budget'] / 1e9:.2f} GB" if r.get("budget") else "all in memory"
        cache = (f"{r['slots']} slots ({r['cache_fraction']:.0%})" if r.get("slots") is not None
                 else "-")
        pr = (f"{pct_or_dash(r.get('precision'))} / {pct_or_dash(r.get('recall'))}"
              if r.get("hit_rate") else "-")
        L.append(
            f"| {label} | {budget} | {cache} | {rng(r['tokens_per_s'])} | "
            f"{rng(r['s_per_token'], digits=3)} | {rng(r.get('bytes_read_per_token'), 1e-6, 0)} | "
            f"{rng(r.get('hit_rate'), pct=True, digits=0)} | {pr} | "
            f"{rng(r.get('stall_share'), pct=True, digits=0)} | {med(r.get('io_bound_s'), digits=3)} | "
            f"{med(r.get('bound_s'), digits=3)} | {rng(r.get('ratio_to_bound'))} | "
            f"{rng(r.get('ratio_to_resident'))} | {'yes' if r.get('tokens_match_resident') else 'NO' if r.get('tokens_match_resident') is False else '-'} |")
    L.append("")
    L.append("Where the time of a token goes (medians over repeats, ms per token; CPU times "
             "per thread from /proc, so they hold whatever the runtime overlaps):\n")
    L.append("| configuration | total | MLX compute (CPU) | MLX thread idle | stall (runtime's "
             "counter) | main thread CPU | reader busy | reads/token | reader GB/s "
             "| I/O hidden behind compute | peak RSS / budget | other processes' CPU (reruns) |")
    L.append("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for label, r in a["rows"].items():
        if not r.get("ok"):
            continue
        b = r["breakdown"]
        L.append(
            f"| {label} | {med(r['s_per_token'], 1e3, 0)} | {med(b.get('compute_s'), 1e3, 0)} | "
            f"{med(b.get('compute_thread_idle_s'), 1e3, 0)} | {med(b.get('stall_s'), 1e3, 0)} | "
            f"{med(b.get('main_thread_cpu_s'), 1e3, 1)} | "
            f"{med(b.get('reader_busy_s'), 1e3, 0)} | {med(b.get('reads_per_token'), 1, 1)} | "
            f"{med(b.get('reader_gbps_while_reading'), 1, 2)} | "
            f"{pct_or_dash(r.get('io_hidden_share'))} | "
            f"{rng(r.get('peak_rss_over_budget'), digits=2) if r.get('budget') else '-'} | "
            f"{rng(r.get('foreign_cpu_share'), pct=True, digits=0)} "
            f"({r.get('reruns_for_interference', 0)}) |")
    L.append("")
    if a["capped"]:
        L.append("Under a cgroup v1 memory cap (`memory.limit_in_bytes`; page cache is charged "
                 "to the cap):\n")
        L.append("| configuration | cap | result per repeat | phase reached | seconds to result "
                 "| max usage | s/token |")
        L.append("|---|---|---|---|---|---|---|")
        for label, c in a["capped"].items():
            mu = ", ".join(f"{x / 1e9:.2f} GB" for x in c["max_usage_bytes"] if x)
            L.append(f"| {label} | {c['cap_bytes'] / 1e9:.2f} GB | {', '.join(c['statuses'])} | "
                     f"{', '.join('decode done' if st == 'ok' else str(p) for p, st in zip(c['last_phase'], c['statuses']))} | "
                     f"{', '.join(str(w) for w in c['wall_s'])} | {mu} | "
                     f"{rng(c['s_per_token'], digits=3)} |")
        L.append("")
    rt = next((r.get("routing") for r in a["rows"].values() if r.get("routing")), None)
    if rt:
        L.append(f"Routing of this model during the timed tokens: {rt['prev_token_overlap']:.0%} of "
                 f"a token's experts were also used by the previous token (same layer).\n")
    return L


def projection_table(p) -> list:
    if not p or p.get("status") != "ok":
        return ["K3 projection: not run or failed.\n"]
    L = []
    pl = p["per_layer_s"]
    c = p["measured"]["components_s"]
    L.append("Measured on this machine at K3's real widths (ms, median per decode step):\n")
    L.append("| block | ms |")
    L.append("|---|---|")
    for k, v in [("KDA attention (96 heads x 128, 4-bit affine projections)", pl["kda_attention"]),
                 ("gated MLA attention (q_lora 1536, kv_lora 512)", pl["mla_attention"]),
                 ("MoE block (router, latent 7168->3584->7168, 16 routed experts, shared 6144)",
                  pl["moe_block"]),
                 ("- of which 16 routed experts 3584x3072 MXFP4 (alone)",
                  c["routed_experts_16_of_3584x3072_mxfp4"]),
                 ("- of which shared experts 6144 (alone)", c["shared_experts_6144"]),
                 ("- of which latent down + up (alone)",
                  c["latent_down_7168_to_3584"] + c["latent_up_3584_to_7168"]),
                 ("896-way router minus the 16-way one of the test model", pl["router_896_extra"]),
                 ("layer 0: KDA + dense SiTU MLP 33792", pl["layer0_dense"]),
                 ("lm_head 163840 x 7168 (4-bit affine)", pl["lm_head_163840"])]:
        L.append(f"| {k} | {v * 1e3:.1f} |")
    L.append("")
    L.append(f"Projected compute for one K3 token on this CPU: **{p['compute_s_per_token']:.1f} s** "
             f"(= layer 0 + 68 x (KDA + MoE) + 24 x (MLA + MoE) + head; routed experts "
             f"{p['routed_experts_s_per_token']:.1f} s of it). Trunk in memory "
             f"{p['trunk_bytes_f32_scales'] / 1e9:.1f} GB (float32 scales, as held on the CPU), "
             f"experts {p['expert_bytes_total'] / 1e12:.2f} TB, all-miss expert I/O "
             f"{p['io_bytes_per_token_all_miss'] / 1e9:.1f} GB per token = "
             f"{p['io_s_per_token_all_miss']:.1f} s at {p['disk_gbps']:.2f} GB/s.\n")
    L.append("| memory | cache (share of experts) | simulated hit rate | I/O s/token "
             "| s/token, no overlap | s/token, full overlap | tok/s |")
    L.append("|---|---|---|---|---|---|---|")
    for r in p["by_memory"]:
        if not r.get("fits"):
            L.append(f"| {r['memory_gb']} GB | trunk does not fit | | | | | - |")
            continue
        L.append(f"| {r['memory_gb']} GB | {r['cache_fraction']:.1%} | {r['hit_rate']:.0%} | "
                 f"{r['io_s']:.1f} | {r['serial_s']:.1f} | {r['overlapped_s']:.1f} | "
                 f"{r['tok_s_serial']:.3f}-{r['tok_s_overlapped']:.3f} |")
    L.append("")
    return L


def simulation_table(sim) -> list:
    if not sim:
        return []
    L = ["Hit rate against cache size (deltafin_mlx.testing.cache_simulator; per-layer caches, "
         "demand fetching):\n"]
    grid = sim["grid"]
    L.append("| routing | policy | " + " | ".join(f"{g:.0%}" for g in grid) + " |")
    L.append("|---|---|" + "---|" * len(grid))
    for group, label in (("k3", "K3 size (896 experts, k=16), preset"), ("bench", "recorded trace")):
        for name, d in sim[group].items():
            for pol, rates in d["rates"].items():
                L.append(f"| {label} {name} (overlap {d['overlap']:.0%}, {d['tokens']} tokens) | "
                         f"{pol} | " + " | ".join(f"{x:.2f}" for x in rates) + " |")
    L.append("")
    return L


def markdown(results) -> str:
    m = results["machine"]
    L = [f"# Deltafin benchmark: `{results['command']}`"
         + (" (PARTIAL: the run was interrupted)" if results.get("partial") else ""), ""]
    L.append(f"Started {results['started']}, took {results.get('elapsed_s', 0) / 60:.1f} min. "
             f"Machine: {m.get('cpu', '?')}, {m.get('cpus')} CPUs, "
             f"{m.get('mem_total_bytes', 0) / 2**30:.0f} GiB RAM, {m.get('platform')}, "
             f"MLX {m.get('mlx')} ({m.get('mlx_device')}), mlx-lm {m.get('mlx_lm')}. "
             f"Page cache dropped before each run: {results['page_cache_dropped']}. "
             f"Settings: {results['settings']}. Code measured: deltafin_mlx + convert sources "
             f"sha256 `{results.get('code', {}).get('sha256')}`"
             + (" (they CHANGED during the run: see code_at_end in the JSON)"
                if results.get("code_at_end", {}).get("sha256") not in
                (None, results.get("code", {}).get("sha256")) else "") + ".\n")
    L.append("## Bounds\n")
    for key, when in (("disk_start", "start"), ("disk_end", "end")):
        d = results.get(key)
        if d:
            L.append(f"- Disk at the {when} of the run, O_DIRECT random reads of one expert record "
                     f"({d['qd1']['record_size']:,} bytes): QD1 {rng({'median': d['qd1']['gbps_median'], 'min': d['qd1']['gbps_min'], 'max': d['qd1']['gbps_max'], 'n': 2})} GB/s, "
                     f"QD2 {rng({'median': d['qd2']['gbps_median'], 'min': d['qd2']['gbps_min'], 'max': d['qd2']['gbps_max'], 'n': 2})} GB/s "
                     f"(median and range of {len(d['qd1']['gbps_samples'])} samples of "
                     f"{d['qd1']['batch']} reads).")
    d = results.get("disk")
    if d:
        L.append(f"- Both probes pooled (used for every I/O bound below): QD1 "
                 f"{d['qd1']['gbps_median']:.2f} GB/s median ({d['qd1']['gbps_min']:.2f}-"
                 f"{d['qd1']['gbps_max']:.2f}), QD2 {d['qd2']['gbps_median']:.2f} GB/s median "
                 f"({d['qd2']['gbps_min']:.2f}-{d['qd2']['gbps_max']:.2f}).")
    for s in results["scales"]:
        L.append(f"- Compute, {s['name']} fully in memory (mlx-lm, `load_resident`): "
                 f"{rng(s['analysis']['compute_bound_s'], digits=3)} s/token.")
    L.append("")
    L.append("## Decode\n")
    for s in results["scales"]:
        L += decode_table(s)
    L.append("## Kimi K3 projection\n")
    L += projection_table(results.get("k3_projection"))
    L.append("## Cache simulation\n")
    L += simulation_table(results.get("simulation"))
    return "\n".join(L) + "\n"


def plots(results, outdir: Path) -> list:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plots (pip install -e '.[bench]')", file=sys.stderr)
        return []
    outdir.mkdir(parents=True, exist_ok=True)
    written = []

    # 1. tokens/s against budget
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, s in enumerate(results["scales"]):
        a, info, col = s["analysis"], s["model"], colors[i % len(colors)]
        eb = info["expert_bytes"]
        xs, ys, lo, hi, bound = [], [], [], [], []
        for label, r in a["rows"].items():
            if not r.get("ok") or not r.get("budget"):
                continue
            x = min(r["budget"] / eb, 1.2) * 100
            xs.append(x)
            t = r["tokens_per_s"]
            ys.append(t["median"])
            lo.append(t["median"] - t["min"])
            hi.append(t["max"] - t["median"])
            bound.append(1 / r["bound_s"]["median"] if r.get("bound_s") else None)
        order = sorted(range(len(xs)), key=lambda j: xs[j])
        xs, ys = [xs[j] for j in order], [ys[j] for j in order]
        lo, hi, bound = [lo[j] for j in order], [hi[j] for j in order], [bound[j] for j in order]
        ax.errorbar(xs, ys, yerr=[lo, hi], marker="o", color=col, capsize=3,
                    label=f"Deltafin, {s['name']}")
        if all(b is not None for b in bound):
            ax.plot(xs, bound, ls=":", color=col, label=f"bound max(compute, I/O), {s['name']}")
        res = a["rows"].get("mlx-lm resident", {})
        if res.get("ok"):
            ax.axhline(res["tokens_per_s"]["median"], color=col, ls="--", lw=1,
                       label=f"mlx-lm fully in memory, {s['name']}")
        first = {"mlx": True, "df": True}
        for label, c in a["capped"].items():
            x = c["cap_bytes"] / eb * 100
            if label.startswith("mlx-lm") and not any(st == "ok" for st in c["statuses"]):
                ax.plot([x], [0], marker="x", ms=10, mew=2, color="crimson", ls="none",
                        label=("mlx-lm under a cap of budget + 128 MiB: OOM-killed"
                               if first["mlx"] else None))
                first["mlx"] = False
            elif label.startswith("deltafin") and c["s_per_token"].get("median"):
                ax.plot([x], [1 / c["s_per_token"]["median"]], marker="^", ms=8, color=col,
                        mfc="none", ls="none",
                        label=(f"Deltafin under the same cap, {s['name']}" if first["df"]
                               else None))
                first["df"] = False
    ax.set_xlabel("memory budget, % of the model's expert bytes (rightmost: above model size)")
    ax.set_ylabel("decode tokens/s")
    ax.set_ylim(bottom=-0.05)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    ax.set_title(f"Decode speed against memory budget ({results['command']})", fontsize=9)
    fig.tight_layout()
    p = outdir / "tokens_per_s_vs_budget.png"
    fig.savefig(p, dpi=120)
    plt.close(fig)
    written.append(p)

    # 2. hit rate against cache size
    sim = results.get("simulation") or {}
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    grid = [g * 100 for g in sim.get("grid", [])]
    styles = {"LRU": ":", "SlotMap": "-", "Belady": "--"}
    for preset, d in sim.get("k3", {}).items():
        for pol, rates in d["rates"].items():
            if preset == "uniform" and pol != "SlotMap":
                continue
            ax.plot(grid, rates, ls=styles[pol], marker=".",
                    label=f"simulated, K3 size, {preset} routing, {pol}")
    for name, d in sim.get("bench", {}).items():
        ax.plot(grid, d["rates"]["SlotMap"], ls="-", marker="s", ms=3,
                label=f"simulated on the recorded trace of {name}, SlotMap")
    for s in results["scales"]:
        pts = [(r["cache_fraction"] * 100, r["hit_rate"]["median"])
               for r in s["analysis"]["rows"].values()
               if r.get("ok") and r.get("hit_rate") and r.get("cache_fraction") is not None]
        if pts:
            ax.plot(*zip(*sorted(pts)), ls="none", marker="o", ms=7, mfc="none", mew=2,
                    label=f"measured, Deltafin runtime, {s['name']}")
    ax.set_xlabel("expert cache, % of all experts")
    ax.set_ylabel("hit rate")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    ax.set_title("Expert-cache hit rate against cache size", fontsize=9)
    fig.tight_layout()
    p = outdir / "hit_rate_vs_cache.png"
    fig.savefig(p, dpi=120)
    plt.close(fig)
    written.append(p)

    # 3. where the time goes
    s = results["scales"][0]
    rows = [(l, r) for l, r in s["analysis"]["rows"].items() if r.get("ok")]
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    names = [l for l, _ in rows]
    comp = [r["breakdown"]["compute_s"]["median"] * 1e3 for _, r in rows]
    idle = [max(r["s_per_token"]["median"] * 1e3 - c, 0) for (_, r), c in zip(rows, comp)]
    busy = [((r["breakdown"].get("reader_busy_s") or {}).get("median") or 0) * 1e3
            for _, r in rows]
    ax.barh(names, comp, label="MLX compute (CPU time of its thread)")
    ax.barh(names, idle, left=comp, label="MLX thread idle (waiting for reads, Python)")
    pts = [(b, n) for b, n in zip(busy, names) if b > 0]
    if pts:
        ax.scatter([b for b, _ in pts], [n for _, n in pts], marker="|", s=300, color="k",
                   zorder=3, label="reader busy (wall time spent reading, overlapping)")
    ax.set_xlabel("ms per token (median)")
    ax.invert_yaxis()
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2)
    ax.grid(alpha=0.3, axis="x")
    ax.set_title(f"Where a token's time goes, {s['name']}", fontsize=9)
    fig.tight_layout()
    p = outdir / "time_breakdown.png"
    fig.savefig(p, dpi=120)
    plt.close(fig)
    written.append(p)
    return written


def write_reports(results, md_path: Path, plot_dir: Path):
    md_path = Path(md_path)
    md_path.write_text(markdown(results))
    print(f"wrote {md_path}")
    for p in plots(results, Path(plot_dir)):
        print(f"wrote {p}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", nargs="?", default=str(ROOT / "bench" / "results" / "latest.json"))
    ap.add_argument("--plots", default=str(ROOT / "docs" / "perf"))
    args = ap.parse_args(argv)
    res = json.loads(Path(args.results).read_text())
    write_reports(res, Path(args.results).with_suffix(".md"), Path(args.plots))


if __name__ == "__main__":
    main()
