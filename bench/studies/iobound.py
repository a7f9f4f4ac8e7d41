"""The I/O-bound regime, emulated: decode under a disk read throttle.

On a Mac the GPU computes an expert far faster than the SSD reads it; on this CPU
it is the other way round. This runs the profiled decode (`bench.lib.worker
decode`) in a cgroup v1 blkio cgroup whose read throttle
(`blkio.throttle.read_bps_device`) makes reading one expert record cost R times
computing it (R in --ratios), at several expert-cache shares, and compares the
bytes read with Belady's MIN replayed on the same routing with the same number of
slots (the optimal demand cache).

    .venv/bin/python -m bench.studies.iobound    # as root; see bench/README.md
    .venv/bin/python -m bench.studies.iobound --ratios 32 --shares 0.25 --repeats 3

Where the blkio controller is not writable (not root, no cgroup v1), it says so
and exits 0 without measuring.
"""

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

from deltafin_mlx.testing import cache_simulator as sc
from bench.lib import common

BLKIO_ROOT = Path("/sys/fs/cgroup/blkio")
# A small K3-layout model: routed experts of 512 x 512 in MXFP4 (a 408 KiB record,
# K3's is 42x larger), 64 per layer, 8 per token, 4 MoE layers; the router's
# correction bias spread wider than the fixture's default so that routing is
# skewed (see PERFORMANCE.md).
MODEL = dict(hidden_size=256, num_layers=5, num_experts=64, experts_per_token=8,
             routed_expert_hidden_size=512, moe_intermediate_size=512, vocab_size=1024,
             router_bias_std=0.3)


class ReadThrottle(common.Cgroup):
    """A blkio cgroup capping reads from one device at `bps` bytes/s. The worker
    in it writes the cap itself when its timed tokens start (`worker_args`), so
    loading and warming the cache run at full speed."""

    def __init__(self, device: str, bps: int, tag: str):
        self.path = BLKIO_ROOT / f"{common.CGROUP_PREFIX}{os.getpid()}-{tag}"
        self.path.mkdir()
        self.bps = int(bps)
        self.worker_args = ["--throttle", self.path / "blkio.throttle.read_bps_device",
                            f"{device} {self.bps}"]


def blkio_writable() -> str:
    """'' where a throttle can be set here, else why not."""
    probe = BLKIO_ROOT / f"{common.CGROUP_PREFIX}probe-{os.getpid()}"
    try:
        probe.mkdir()
        (probe / "blkio.throttle.read_bps_device").read_text()
        return ""
    except OSError as e:
        return f"{BLKIO_ROOT}: {e.strerror or e}"
    finally:
        try:
            probe.rmdir()
        except OSError:
            pass


def disk_of(path: Path) -> str:
    """'MAJ:MIN' of the whole disk holding `path` (throttles apply to disks)."""
    dev = os.stat(path).st_dev
    major, minor = os.major(dev), os.minor(dev)
    sysfs = Path(f"/sys/dev/block/{major}:{minor}")
    if (sysfs / "partition").exists():  # a partition: throttle its disk
        major, minor = (sysfs.resolve().parent / "dev").read_text().strip().split(":")
    return f"{major}:{minor}"


def expert_compute_s(model: Path, info: dict, args) -> float:
    """Seconds of computation per routed expert here: mlx-lm's decode with every
    expert in memory (worker decode --mode resident, no reads at all), per token,
    divided by the experts a token uses. The trunk's share is included, so R is
    the read time of one expert over everything a token computes per expert."""
    res = common.run_worker(["--model", model, "--mode", "resident", "--tokens", args.tokens,
                             "--warmup", args.warmup], timeout=600)
    if res.get("status") != "ok":
        raise SystemExit(f"iobound: the compute-bound run failed: {res}")
    return res["s_per_token"] / (info["experts_per_token"] * info["moe_layers"])


def replay_reads(trace_file: Path, slots: int, timed: int, k: int) -> dict:
    """The recorded routing replayed with `slots` slots in one pool (calls layer by
    layer, as the runtime makes them), misses counted over the last `timed` tokens:
    Belady's MIN (the optimum), the runtime's own pool (what its policy alone
    reads, without reads ahead) and Belady seeing only the next token's routing
    (more than any decoder can know)."""
    trace = sc.load_trace(trace_file)
    n = 1 + max(e for layer in trace for tok in layer for e in tok)
    layers = len(trace)
    calls = sc.shared_calls(trace, n)
    first_timed = (len(trace[0]) - timed) * layers
    caches = {"optimal": sc.Belady(slots, calls),
              "policy": sc.RuntimePool(slots, n, layers, k),
              "next_token_known": sc.Foresight(slots, calls, layers, layers, n)}
    misses = dict.fromkeys(caches, 0)
    for name, cache in caches.items():
        for i, experts in enumerate(calls):
            need = list(dict.fromkeys(experts))
            cache.use(need)
            for e in need:
                if cache.slot_of(e) is None:
                    cache.place(e, set(need))
                    misses[name] += i >= first_timed
    return {"misses": misses, "tokens": len(trace[0]), "overlap": sum(
        sc.overlap(layer) for layer in trace) / layers}


def run_one(model: Path, info: dict, slots: int, throttle, args, lookahead: int,
            trace_file: Path) -> dict:
    worker = ["--model", model, "--mode", "deltafin", "--budget", 64 << 30,
              "--cache-slots", slots, "--tokens", args.tokens, "--warmup", args.warmup,
              "--lookahead", lookahead, "--reader-threads", args.reader_threads,
              "--trace-out", trace_file, *throttle.worker_args]
    common.drop_caches()
    res = common.run_worker(worker, timeout=600, cap=throttle)
    if res.get("status") != "ok":
        return res
    rec = info["record_size"]
    opt = replay_reads(trace_file, res["plan"].get("slots", slots), args.tokens,
                       info["experts_per_token"])
    bw = throttle.bps if throttle else None
    bpt = res["bytes_read_per_token"]
    opt_bpt = opt["misses"]["optimal"] * rec / args.tokens
    s = res["stats"]
    # Guess reads = reads - demand misses; those never used were wasted (guesses
    # cancelled before a reader took them cost nothing and are not counted).
    wasted = max(s["bytes_read"] / rec - s["misses"] - s["speculative_used"], 0)
    out = {
        "slots": res["plan"].get("slots", slots), "lookahead": bool(lookahead),
        "tokens_per_s": res["tokens_per_s"], "s_per_token": res["s_per_token"],
        "bytes_read_per_token": bpt, "optimal_bytes_per_token": opt_bpt,
        "bytes_over_optimal": bpt / opt_bpt if opt_bpt else None,
        "policy_over_optimal": (opt["misses"]["policy"] * rec / args.tokens / opt_bpt
                                if opt_bpt else None),
        "next_token_known_over_optimal": (opt["misses"]["next_token_known"] * rec
                                          / args.tokens / opt_bpt if opt_bpt else None),
        "time_over_io": res["s_per_token"] / (bpt / bw) if bw and bpt else None,
        "precision": res["precision"], "recall": res["recall"], "hit_rate": res["hit_rate"],
        "stall_share": res.get("stall_share"),
        "guesses_per_token": s["speculative_issued"] / args.tokens,
        "wasted_read_share": wasted * rec / (bpt * args.tokens) if bpt else 0.0,
        "achieved_bps": bpt * res["tokens_per_s"],
        "reader_bps_while_reading": (res["breakdown"].get("reader_gbps_while_reading") or 0) * 1e9,
        "throttle_bps": bw, "routing_overlap": opt["overlap"], "tokens": res["tokens"],
    }
    return out


def median_row(runs: list) -> dict:
    ok = [r for r in runs if "tokens_per_s" in r]
    if not ok:
        return {"status": runs[-1].get("status", "failed"), "runs": runs}
    row = {}
    for k, v in ok[0].items():
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            vals = [r[k] for r in ok if r.get(k) is not None]
            row[k] = statistics.median(vals) if vals else None
            if len(vals) > 1:
                row[k + "_range"] = [min(vals), max(vals)]
        else:
            row[k] = v
    row["repeats"] = len(ok)
    tokens = {tuple(r["tokens"]) for r in ok}
    row["same_tokens"] = len(tokens) == 1
    row.pop("tokens", None)
    return row


def format_table(rows: list, info: dict) -> str:
    head = ("| R | cache | lookahead | tok/s | MB read/token | optimal MB/token | bytes/optimal "
            "| policy alone / optimal | next token known / optimal "
            "| time/(bytes/bw) | precision | recall | guesses / token | stall share | wasted reads "
            "| achieved / throttle MB/s |")
    lines = [head, "|" + "---|" * 16]
    for r in rows:
        if "tokens_per_s" not in r:
            lines.append(f"| {r['ratio']} | {r['share']:.0%} | | {r.get('status')} |")
            continue
        f = lambda v, fmt: "-" if v is None else format(v, fmt)  # noqa: E731
        lines.append(
            f"| {r['ratio']} | {r['share']:.0%} ({int(r['slots'])}) | {'on' if r['lookahead'] else 'off'} "
            f"| {r['tokens_per_s']:.2f} | {r['bytes_read_per_token'] / 1e6:.2f} "
            f"| {r['optimal_bytes_per_token'] / 1e6:.2f} | {f(r['bytes_over_optimal'], '.2f')} "
            f"| {f(r.get('policy_over_optimal'), '.2f')} "
            f"| {f(r.get('next_token_known_over_optimal'), '.2f')} "
            f"| {f(r['time_over_io'], '.2f')} | {f(r['precision'], '.2f')} | {f(r['recall'], '.2f')} "
            f"| {f(r.get('guesses_per_token'), '.1f')} | {f(r.get('stall_share'), '.0%')} "
            f"| {r['wasted_read_share']:.0%} | {r['achieved_bps'] / 1e6:.0f} / "
            f"{r['throttle_bps'] / 1e6:.0f} |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ratios", type=float, nargs="+", default=[1, 8, 32],
                    help="read time of one expert / its compute time")
    ap.add_argument("--shares", type=float, nargs="+", default=[0.10, 0.25, 0.50],
                    help="expert cache slots as a share of all experts")
    ap.add_argument("--lookahead", choices=("on", "off", "both"), default="both")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=32,
                    help="timed tokens per run (fewer weigh the cold start more, where "
                    "Belady's foresight gains most)")
    ap.add_argument("--warmup", type=int, default=4, help="untimed, unthrottled tokens first")
    ap.add_argument("--reader-threads", type=int, default=1)
    ap.add_argument("--router-bias-std", type=float, default=MODEL["router_bias_std"],
                    help="spread of the fixture's router bias (0.1: near-uniform routing)")
    ap.add_argument("--workdir", default="/tmp/deltafin-iobound")
    ap.add_argument("--out", default=str(common.BENCH / "results" / "iobound.json"))
    args = ap.parse_args(argv)

    # Terminated from outside: unwind, so that the cgroups are removed.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    why = blkio_writable()
    if why:
        print(f"iobound: skipped, cannot set a read throttle ({why}); run as root on a "
              "machine with the cgroup v1 blkio controller")
        return 0
    spec = {**MODEL, "router_bias_std": args.router_bias_std}
    model = common.ensure_model(Path(args.workdir), f"iobound-bias{args.router_bias_std:g}",
                                spec, seed=0)
    info = common.model_info(model)
    device = disk_of(model)
    compute = expert_compute_s(model, info, args)
    total = info["num_experts"] * info["moe_layers"]
    common.log(f"model: {info['moe_layers']} MoE layers x {info['num_experts']} experts, "
               f"record {info['record_size']} B; compute per expert {compute * 1e3:.3f} ms; "
               f"disk {device}")
    looks = {"on": [1], "off": [0], "both": [1, 0]}[args.lookahead]
    rows = []
    tmp = Path(tempfile.mkdtemp(prefix="deltafin-iobound-"))
    for ratio in args.ratios:
        bps = info["record_size"] / (ratio * compute)
        for share in args.shares:
            slots = max(info["experts_per_token"], round(share * total))
            for look in looks:
                runs = []
                for rep in range(args.repeats):
                    throttle = ReadThrottle(device, bps, f"r{ratio:g}-{rep}")
                    try:
                        runs.append(run_one(model, info, slots, throttle, args, look,
                                            tmp / f"trace-{ratio:g}-{share}-{look}-{rep}.jsonl"))
                    finally:
                        throttle.close()
                row = {"ratio": ratio, "share": share, **median_row(runs)}
                rows.append(row)
                common.log(format_table([row], info).splitlines()[-1])
    result = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "command": "python -m bench.studies.iobound " + " ".join(argv or sys.argv[1:]),
              "model": info, "expert_compute_s": compute, "device": device,
              "tokens": args.tokens, "warmup": args.warmup, "repeats": args.repeats,
              "reader_threads": args.reader_threads, "rows": rows,
              "machine": common.machine_info()}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    table = format_table(rows, info)
    Path(args.out).with_suffix(".md").write_text(table + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
