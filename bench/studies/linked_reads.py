"""Linked experts against packed banks: expert read rate through the runtime's own
reader, O_DIRECT, on the same K3-layout experts (Kimi K3's real expert shape).

The packed layout reads each expert as one aligned record; the linked one reads it
where it lies in the source's safetensors shards (one aligned read per contiguous
run, widened to 4096-byte blocks, through a staging buffer and copied into the
slots). Each configuration runs in a fresh process, alternating, `--repeats` times:
unthrottled (the rate this disk and CPU give) and, where the cgroup v1 blkio
controller is writable (root), under a read throttle that makes the disk the
bottleneck as on a Mac reading K3 (bench/studies/iobound.py).

    .venv/bin/python -m bench.studies.linked_reads            # ~2 minutes the first time
    .venv/bin/python -m bench.studies.linked_reads --throttle-mbps 300 --repeats 5
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import time
from pathlib import Path

from bench.lib import ROOT, common, worker
from bench.studies.iobound import BLKIO_ROOT, blkio_writable, disk_of

MODEL = dict(hidden_size=256, num_layers=5, num_experts=8, vocab_size=1024,
             **{**common.K3_EXPERT, "experts_per_token": 4})


def ensure_models(workdir: Path):
    """The source (kept: linked experts live in it) and its two conversions."""
    from deltafin_mlx.convert.convert import ConvertOptions, convert
    from deltafin_mlx.testing.synthetic import make_checkpoint

    spec = {"arch": "kimi_k3", "overrides": MODEL}
    spec_file = workdir / "spec.json"
    src, packed, linked = workdir / "src", workdir / "packed", workdir / "linked"
    if spec_file.exists() and json.loads(spec_file.read_text()) == spec and all(
            (p / "deltafin.json").exists() for p in (packed, linked)):
        return packed, linked
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    common.log(f"generating a K3-layout checkpoint {MODEL}")
    make_checkpoint(src, "kimi_k3", seed=0, **MODEL)
    convert(str(src), packed, ConvertOptions(progress=False))
    convert(str(src), linked, ConvertOptions(progress=False, link_experts=True))
    spec_file.write_text(json.dumps(spec))
    return packed, linked


def run(model: Path, passes: int, throttle=None) -> dict:
    args = [model, passes]
    preexec = None
    if throttle is not None:
        cg, value = throttle
        args += [cg / "blkio.throttle.read_bps_device", value]
        preexec = common.Cgroup.preexec(cg_holder(cg))
    p = subprocess.run(worker.command("expert-reads", *args), capture_output=True, text=True,
                       env=worker.environment(), cwd=str(ROOT), preexec_fn=preexec,
                       timeout=600)
    if p.returncode != 0:
        raise SystemExit(f"linked_reads: worker failed: {p.stderr[-2000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def cg_holder(path: Path):
    holder = common.Cgroup()
    holder.path = path
    return holder


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", default="/tmp/deltafin-linked-reads")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--passes", type=int, default=2, help="reads of every expert per run")
    ap.add_argument("--throttle-mbps", type=float, default=300)
    ap.add_argument("--json", default=str(ROOT / "bench" / "results" / "linked_reads.json"))
    args = ap.parse_args()
    packed, linked = ensure_models(Path(args.workdir))
    why = blkio_writable()
    cg = None
    if not why:
        cg = BLKIO_ROOT / f"{common.CGROUP_PREFIX}{os.getpid()}-linked"
        cg.mkdir()
    modes = ["unthrottled"] + (["throttled"] if cg else [])
    results = {m: {"packed": [], "linked": []} for m in modes}
    try:
        for _ in range(args.repeats):
            for mode in modes:
                for name, model in (("packed", packed), ("linked", linked)):
                    throttle = None
                    if mode == "throttled":
                        value = f"{disk_of(model)} {int(args.throttle_mbps * 1e6)}"
                        throttle = (cg, value)
                    results[mode][name].append(run(model, args.passes, throttle))
    finally:
        if cg is not None:
            cg_holder(cg).close()
    report = {"date": time.strftime("%Y-%m-%d"), "model": MODEL, "repeats": args.repeats,
              "passes": args.passes, "throttle_mbps": args.throttle_mbps if cg else None,
              "throttle_unavailable": why or None, "machine": common.machine_info()}
    print(f"expert reads, K3's expert shape ({results[modes[0]]['packed'][0]['useful_bytes_per_read']:,} "
          f"bytes), {args.repeats} alternating runs" + (f"; no throttle: {why}" if why else ""))
    for mode in modes:
        rates = {n: [r["bytes_per_second"] / 1e9 for r in rs] for n, rs in results[mode].items()}
        ratios = [l / p for l, p in zip(rates["linked"], rates["packed"])]
        report[mode] = {"packed_gbps": rates["packed"], "linked_gbps": rates["linked"],
                        "linked_over_packed": ratios,
                        "direct": all(r["direct"] for rs in results[mode].values() for r in rs)}
        label = mode if mode == "unthrottled" else f"throttled to {args.throttle_mbps:g} MB/s"
        print(f"  {label:26s} packed {statistics.median(rates['packed']):.3f} GB/s, linked "
              f"{statistics.median(rates['linked']):.3f} GB/s: linked/packed "
              f"{statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f})")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
