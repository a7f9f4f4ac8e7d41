"""Budgets below the trunk: trunk layers stream too (the 'run at any budget' claim).

    python -m bench.studies.trunk_budget [--workdir /tmp/deltafin-bench] [--repeats 2] [--tokens 6]

A K3-layout model whose trunk alone is larger than the smaller budgets (hidden 3072,
KDA attention 24 x 128, K3's real expert shape, 12 layers, 16 experts per layer) and
at least 4x larger than every budget. Side by side, in fresh processes with the page
cache dropped: mlx-lm with the model fully in memory (the compute bound); Deltafin at
each budget, reporting s/token against max(compute bound, bytes it read per token /
measured disk bandwidth); and mlx-lm under a cgroup v1 memory cap equal to each budget
(what a user gets without Deltafin). Writes bench/results/trunk_budget.{json,md}.
"""

import argparse
import json
import statistics
import subprocess
from pathlib import Path

from bench.lib import common, worker

OVERRIDES = dict(hidden_size=3072, num_layers=12, num_experts=16, vocab_size=1024,
                 kda_num_heads=24, kda_head_dim=128, **common.K3_EXPERT)

def run(model, mode, budget, tokens, cap=None, timeout=900):
    cmd = worker.command("budget-decode", model, mode, budget, tokens)
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=worker.environment(), preexec_fn=cap.preexec() if cap else None)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        return {"status": "timeout"}
    for line in reversed(out.splitlines()):
        if line.startswith("{"):
            return {"status": "ok", **json.loads(line)}
    return {"status": "oom-killed" if p.returncode == -9 else f"failed ({p.returncode})",
            "stderr_tail": err[-300:]}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", default="/tmp/deltafin-bench")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=6)
    ap.add_argument("--out", default=str(common.ROOT / "bench" / "results" / "trunk_budget"))
    a = ap.parse_args()

    import mlx.core as mx
    from mlx_lm.utils import load_config

    from deltafin_mlx.plan.footprint import inventory_from_manifest
    from deltafin_mlx.format.manifest import read_manifest
    from deltafin_mlx.plan.rates import measure_disk_gbps
    from deltafin_mlx.plan.memory import plan_memory

    model = common.ensure_model(Path(a.workdir), "k3-trunk-h3072-l12-e16", OVERRIDES)
    m = read_manifest(model)
    inv = inventory_from_manifest(m, load_config(model), mx.float32)
    total = sum(m.files.values())
    floor = plan_memory(inv, 1 << 50).floor
    budgets = {"near the floor": int(floor * 1.05),
               "floor + half the trunk": floor + inv.trunk_bytes // 2,
               "a quarter of the model": total // 4}
    common.log(f"model {total / 1e9:.2f} GB on disk, trunk {inv.trunk_bytes / 1e9:.2f} GB in "
               f"memory (float32), floor {floor / 1e9:.2f} GB; budgets {budgets}")
    bank = m.bank_path(m.moe_layers[0])
    disk = [measure_disk_gbps(bank, nbytes=512 << 20, block=m.experts["record_size"])
            for _ in range(3)]
    gbps = statistics.median(disk)

    rows = {"mlx-lm resident": []}
    rows.update({f"deltafin, {k}": [] for k in budgets})
    rows.update({f"mlx-lm capped, {k}": [] for k in budgets})
    can_cap = common.cgroups_writable()
    for _ in range(a.repeats):
        common.drop_caches()
        rows["mlx-lm resident"].append(run(model, "resident", 0, a.tokens))
        for name, b in budgets.items():
            common.drop_caches()
            rows[f"deltafin, {name}"].append(run(model, "deltafin", b, a.tokens))
            if can_cap:
                cap = common.MemoryCap(b, "trunk")
                try:
                    rows[f"mlx-lm capped, {name}"].append(
                        run(model, "resident", 0, a.tokens, cap=cap, timeout=300))
                finally:
                    cap.close()
    compute = statistics.median(r["s_per_token"] for r in rows["mlx-lm resident"])
    ref_tokens = rows["mlx-lm resident"][0]["tokens"]
    report = {"model_bytes": total, "trunk_bytes_float32": inv.trunk_bytes, "floor": floor,
              "budgets": budgets, "disk_gbps": disk, "compute_s_per_token": compute,
              "runs": rows, "cgroups": can_cap, "machine": common.machine_info()}
    lines = [f"# `python -m bench.studies.trunk_budget` ({a.repeats} repeats, "
             f"{a.tokens} tokens)", "",
             f"Model {total / 1e9:.2f} GB on disk (K3 layout {OVERRIDES}); trunk "
             f"{inv.trunk_bytes / 1e9:.2f} GB in memory at float32; floor {floor / 1e9:.2f} GB. "
             f"Disk (O_DIRECT, record-sized reads) {gbps:.2f} GB/s median "
             f"({min(disk):.2f}-{max(disk):.2f}). Compute bound (mlx-lm resident) "
             f"{compute:.3f} s/token.", "",
             "| configuration | budget | result | s/token | trunk layers streamed | trunk MB read/token "
             "| expert MB read/token | stall share | bound s | ratio to bound | same tokens |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, rs in rows.items():
        if not rs:
            continue
        b = next((v for k, v in budgets.items() if name.endswith(k)), None)
        ok = [r for r in rs if r["status"] == "ok"]
        status = ", ".join(r["status"] for r in rs)
        if not ok:
            lines.append(f"| {name} | {b / 1e9:.2f} GB | {status} | - | - | - | - | - | - | - | - |")
            continue
        t = [r["s_per_token"] for r in ok]
        same = all(r["tokens"] == ref_tokens for r in ok)
        if name.startswith("deltafin"):
            tb = statistics.median(r["trunk_bytes_per_token"] for r in ok)
            eb = statistics.median(r["expert_bytes_per_token"] for r in ok)
            bound = max(compute, (tb + eb) / (gbps * 1e9))
            ratio = [x / bound for x in t]
            lines.append(
                f"| {name} | {b / 1e9:.2f} GB | {status} | {statistics.median(t):.3f} "
                f"({min(t):.3f}-{max(t):.3f}) | {ok[0]['streamed_layers']} | {tb / 1e6:.0f} | "
                f"{eb / 1e6:.0f} | {statistics.median(r['stall_share'] for r in ok):.0%} | "
                f"{bound:.3f} | {statistics.median(ratio):.2f} ({min(ratio):.2f}-{max(ratio):.2f}) "
                f"| {'yes' if same else 'NO'} |")
        else:
            bud = f"{b / 1e9:.2f} GB" if b else "all in memory"
            lines.append(f"| {name} | {bud} | {status} | {statistics.median(t):.3f} "
                         f"({min(t):.3f}-{max(t):.3f}) | - | - | - | - | - | - | "
                         f"{'yes' if same else 'NO'} |")
    md = "\n".join(lines) + "\n"
    print(md)
    Path(a.out + ".json").write_text(json.dumps(report, indent=1))
    Path(a.out + ".md").write_text(md)


if __name__ == "__main__":
    main()
