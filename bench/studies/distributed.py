"""1 process vs 2 tensor-parallel ranks (mlx.launch, ring backend) on this machine.

    python -m bench.studies.distributed [--tokens 16] [--repeats 3] [--throttle-mbps 20]

A K3-layout model (K3's MXFP4 experts at a smaller width, see MODEL) converted with
`--ranks 2` runs greedy decoding at the same budget per process: once in one
process, once as 2 ranks. Two regimes:
  compute  the disk as it is (O_DIRECT reads)
  io       each process's reads capped by a cgroup v1 blkio throttle of its own
           (`blkio.throttle.read_bps_device`, one cgroup per rank as if each had its
           own disk, which two Macs do); skipped cleanly where blkio is not writable
On one machine both ranks share its CPU cores and its disk, so compute does not
scale as it would on two machines. Results: bench/results/distributed.{json,md}.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.lib import ROOT
from deltafin_mlx import runtime

BIN = Path(sys.executable).parent
BLKIO = Path("/sys/fs/cgroup/blkio")
CGROUP = "deltafin-dist-r{rank}"
MODEL = dict(hidden_size=512, num_layers=3, num_experts=64, experts_per_token=8,
             moe_intermediate_size=1536, routed_expert_hidden_size=1024, v_head_dim=64,
             kda_head_dim=64, vocab_size=1024)
PROMPT = [5, 17, 42, 99, 3, 250, 7, 11]


def log(msg):
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def ensure_model(workdir: Path) -> Path:
    from deltafin_mlx.convert.convert import ConvertOptions, convert
    from deltafin_mlx.testing.synthetic import make_checkpoint

    out = workdir / "model-r2"
    spec = workdir / "spec.json"
    if (out / "deltafin.json").exists() and spec.exists() and json.loads(spec.read_text()) == MODEL:
        return out
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    src = make_checkpoint(workdir / "source", "kimi_k3", seed=0, **MODEL)
    convert(str(src), out, ConvertOptions(progress=False, ranks=2))
    shutil.rmtree(src)
    spec.write_text(json.dumps(MODEL))
    return out


def eighth_budget(model: Path) -> int:
    """A budget at which one process caches about an eighth of the experts."""
    import mlx.core as mx

    from deltafin_mlx.plan.footprint import inventory_from_manifest
    from deltafin_mlx.format.model_dir import read_config
    from deltafin_mlx.format.manifest import read_manifest
    from deltafin_mlx.plan.memory import plan_memory

    m = read_manifest(model)
    inv = inventory_from_manifest(m, read_config(model, m), mx.float32)
    floor = plan_memory(inv, 1 << 40, stream_trunk=False).floor
    total = inv.num_experts * len(inv.moe_layers)
    return floor + total // 8 * inv.slot_bytes


# --- cgroup v1 blkio throttle --------------------------------------------------


def blkio_writable() -> bool:
    try:
        probe = BLKIO / "deltafin-dist-probe"
        probe.mkdir(exist_ok=True)
        probe.rmdir()
        return True
    except OSError:
        return False


def make_throttles(path: Path, bps: int, ranks: int):
    dev = os.stat(path).st_dev
    for r in range(ranks):
        d = BLKIO / CGROUP.format(rank=r)
        d.mkdir(exist_ok=True)
        (d / "blkio.throttle.read_bps_device").write_text(
            f"{os.major(dev)}:{os.minor(dev)} {bps}")


def remove_throttles(ranks: int):
    for r in range(ranks):
        d = BLKIO / CGROUP.format(rank=r)
        if d.exists():
            try:
                d.rmdir()
            except OSError:
                log(f"warning: could not remove {d}")


# --- one measurement -------------------------------------------------------------


def worker(out: Path, model: str, budget: str, tokens: int, throttled: bool):
    """One rank (or the single process): decode `tokens` greedily, time it."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    group = mx.distributed.init()
    rank = group.rank()
    if throttled:
        (BLKIO / CGROUP.format(rank=rank) / "cgroup.procs").write_text(str(os.getpid()))
    from deltafin_mlx.engine.load import load

    model, _ = load(model, memory_budget=int(budget), tokenizer=False)
    state = runtime(model)
    cache = make_prompt_cache(model)
    logits = model(mx.array([PROMPT]), cache=cache)[:, -1]
    mx.eval(logits)
    read0, hits0, misses0 = state.store.bytes_read, state.stats.hits, state.stats.misses
    start = time.perf_counter()
    out_tokens = []
    for _ in range(tokens):
        y = mx.argmax(logits, axis=-1)
        logits = model(y[:, None], cache=cache)[:, -1]
        mx.eval(logits)
        out_tokens.append(int(y.item()))
    seconds = time.perf_counter() - start
    result = {
        "rank": rank, "ranks": group.size(), "tokens": out_tokens, "seconds": seconds,
        "tokens_per_second": tokens / seconds,
        "expert_bytes_per_token": (state.store.bytes_read - read0) / tokens,
        "hit_rate": (state.stats.hits - hits0)
        / max(1, state.stats.hits - hits0 + state.stats.misses - misses0),
        "slots": state.plan.slots, "record_bytes": state.store.reader.record_size,
    }
    state.close()
    (out / f"rank-{rank}.json").write_text(json.dumps(result))


def measure(model: Path, budget: int, tokens: int, ranks: int, throttled: bool) -> list:
    with tempfile.TemporaryDirectory(prefix="deltafin-dist-") as tmp:
        args = ["-m", "bench.studies.distributed", "--worker", tmp, str(model), str(budget),
                str(tokens), "1" if throttled else "0"]
        if ranks == 1:
            cmd = [sys.executable, *args]
        else:
            cmd = [str(BIN / "mlx.launch"), "--backend", "ring", "--hosts", "127.0.0.1",
                   "-n", str(ranks), "--python", sys.executable, "--", *args]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, cwd=ROOT)
        results = [json.loads(p.read_text()) for p in sorted(Path(tmp).glob("rank-*.json"))]
        if len(results) != ranks:
            raise RuntimeError(f"{ranks} rank(s) failed: {proc.stderr[-2000:]}")
        return results


def summary(values):
    import numpy as np

    a = np.array(values, dtype=float)
    return {"median": float(np.median(a)), "min": float(a.min()), "max": float(a.max()),
            "n": len(values)}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workdir", default="/tmp/deltafin-dist")
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--throttle-mbps", type=float, default=20.0,
                   help="per-process read cap in the io regime, MB/s")
    p.add_argument("--out", default=str(ROOT / "bench/results/distributed.json"))
    p.add_argument("--worker", nargs=5, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        out, model, budget, tokens, throttled = args.worker
        return worker(Path(out), model, budget, int(tokens), throttled == "1")

    model = ensure_model(Path(args.workdir))
    budget = eighth_budget(model)
    regimes = ["compute"]
    if blkio_writable():
        regimes.append("io")
    else:
        log("blkio cgroup not writable: skipping the io regime")
    report = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "command": " ".join(["python", "-m", "bench.studies.distributed", *sys.argv[1:]]),
              "model": MODEL, "budget_bytes_per_process": budget,
              "throttle_mbps": args.throttle_mbps, "regimes": {}}
    for regime in regimes:
        throttled = regime == "io"
        if throttled:
            make_throttles(model / "experts", int(args.throttle_mbps * 1e6), 2)
        runs = {1: [], 2: []}
        try:
            for rep in range(args.repeats):
                for ranks in (1, 2):
                    res = measure(model, budget, args.tokens, ranks, throttled)
                    runs[ranks].append(res)
                    log(f"{regime} repeat {rep + 1}: {ranks} rank(s): "
                        + ", ".join(f"{r['tokens_per_second']:.2f} tok/s, "
                                    f"{r['expert_bytes_per_token'] / 1e6:.2f} MB/token, "
                                    f"hit rate {r['hit_rate']:.0%}" for r in res))
        finally:
            if throttled:
                remove_throttles(2)
        same = all(r["tokens"] == runs[1][0][0]["tokens"] for rs in runs.values() for x in rs
                   for r in x)
        report["regimes"][regime] = {
            str(n): {
                "tokens_per_second": summary([x[0]["tokens_per_second"] for x in rs]),
                "expert_bytes_per_token_per_rank": summary(
                    [r["expert_bytes_per_token"] for x in rs for r in x]),
                "hit_rate": summary([r["hit_rate"] for x in rs for r in x]),
                "slots_per_rank": rs[0][0]["slots"],
                "record_bytes_read": rs[0][0]["record_bytes"],
            } for n, rs in runs.items()
        }
        report["regimes"][regime]["same_tokens"] = same
    Path(args.out).write_text(json.dumps(report, indent=1))
    Path(args.out).with_suffix(".md").write_text(to_markdown(report))
    print(to_markdown(report))


def to_markdown(r) -> str:
    L = [f"# 1 process vs 2 ranks ({r['date']})", "", f"`{r['command']}`", "",
         f"Budget per process {r['budget_bytes_per_process'] / 1e6:.0f} MB; io regime: "
         f"{r['throttle_mbps']:.0f} MB/s read cap per process. Both ranks share this VM's "
         "2 cores and one disk.", "",
         "| regime | ranks | tok/s median (range) | expert MB/token per rank | hit rate | slots/rank |",
         "| --- | --- | --- | --- | --- | --- |"]
    for regime, d in r["regimes"].items():
        for n in ("1", "2"):
            x = d[n]
            t, b = x["tokens_per_second"], x["expert_bytes_per_token_per_rank"]
            L.append(f"| {regime} | {n} | {t['median']:.2f} ({t['min']:.2f}-{t['max']:.2f}) | "
                     f"{b['median'] / 1e6:.2f} | {x['hit_rate']['median']:.0%} | "
                     f"{x['slots_per_rank']} |")
        L.append(f"| {regime} | | same tokens: {d['same_tokens']} | | | |")
    return "\n".join(L) + "\n"


if __name__ == "__main__":
    sys.exit(main())
