"""Batch decoding: aggregate tokens/s and expert bytes read per token against B, next
to the union bound computed from the recorded routing; compute-bound and I/O-bound
(disk throttled with a cgroup v1 blkio cap); and mlx_lm.server under 8 clients,
batching against sequential serving.

    python -m bench.studies.batch [--workdir /tmp/deltafin-bench-batch] [--tokens 12]
                                  [--io-mbps 25] [--server-seconds 30] [--json FILE]

Model: K3 layout (KDA + MLA trunk, MXFP4 latent experts), 3 MoE layers x 64 experts,
8 per token, 418 KB records: small enough to run every B on a small CPU.

Union bound: at each MoE call (a prefill chunk or one decode step of the batch) the
least a batch can read is the union of the experts its sequences route to, less what
the cache holds. With h slots per layer out of E experts and the near-uniform
routing of a random-weight model, a cache holds an expert with chance h/E, so the
bound is sum over calls of |union| x (1 - h/E) x record bytes, per generated token.
I/O-bound time bound: those bytes / the throttled bandwidth.

Union statistics for Kimi K3's shape (896 experts, 16 per token, uniform routing)
and for the shared real trace (OLMoE, 64 experts, top-8; B sequences at B different
positions of the trace) say what batching can gain on real routing.
"""

import argparse
import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
from contextlib import nullcontext
from pathlib import Path

import numpy as np

from bench.lib.common import CGROUP_PREFIX, ROOT, Cgroup, ensure_model, log, machine_info
from deltafin_mlx import runtime

MODEL = dict(hidden_size=256, num_layers=4, num_experts=64, experts_per_token=8,
             routed_expert_hidden_size=512, moe_intermediate_size=512, vocab_size=1024)
# A real routing trace, read where this machine has it; without it the union table
# leaves the trace columns out.
TRACE = Path("/work/shared/traces/olmoe_299.jsonl")
BLKIO = Path("/sys/fs/cgroup/blkio")


# --- union statistics -------------------------------------------------------


def uniform_union(E: int, k: int, B: int) -> float:
    """Expected distinct experts among B tokens routed uniformly, k each."""
    return E * (1 - (1 - k / E) ** B)


def trace_union(path: Path, B: int):
    """Mean distinct experts per (step, layer) when B sequences follow the trace
    from B evenly spaced starting points (wrapping around)."""
    rows = [json.loads(x)["layers"] for x in path.read_text().splitlines() if x.strip()]
    n, layers, k = len(rows), len(rows[0]), len(rows[0][0])
    starts = [i * n // B for i in range(B)]
    sizes = []
    for step in range(n):
        for layer in range(layers):
            sizes.append(len({e for s in starts for e in rows[(s + step) % n][layer]}))
    return float(np.mean(sizes)), k


def union_table(sizes):
    out = []
    for B in sizes:
        k3 = uniform_union(896, 16, B)
        row = {"B": B, "k3_uniform_union": k3, "k3_uniform_gain": B * 16 / k3,
               "fixture_uniform_union": uniform_union(64, 8, B),
               "fixture_uniform_gain": B * 8 / uniform_union(64, 8, B)}
        if TRACE.exists():
            u, k = trace_union(TRACE, B)
            row.update(trace_union=u, trace_gain=B * k / u)
        out.append(row)
    return out


# --- one configuration (run in a child process, maybe in a blkio cgroup) ----


def worker(args):
    from deltafin_mlx.jobs.batch import batch_generate
    from deltafin_mlx.engine.load import load

    results = []
    for B in args.sizes:
        model, tok = load(args.model, memory_budget=args.budget, cache_slots=args.slots,
                          lookahead=not args.no_lookahead, context=256, sequences=B)
        d = runtime(model)
        record = d.manifest.experts["record_size"]
        unions = []
        observing = (d.observe(on_route=lambda layer, idx: unions.append(len(np.unique(idx))))
                     if args.record else nullcontext())
        reqs = [{"id": i, "prompt": f"Prompt {i}: tell me about item {i * 7 % 13}",
                 "max_tokens": args.tokens} for i in range(B)]
        b0, s0 = d.store.bytes_read, (d.stats.misses, d.stats.speculative_issued)
        t = time.perf_counter()
        with observing:
            res = batch_generate(model, tok, reqs, raw=True, batch_size=B)
        wall = time.perf_counter() - t
        tokens = sum(r["stats"]["generation_tokens"] for r in res)
        read = d.store.bytes_read - b0
        h = d.plan.slots / d.plan.moe_layers
        E = d.plan.num_experts
        bound = sum(unions) * (1 - min(h, E) / E) * record if args.record else None
        results.append({
            "B": B, "tokens": tokens, "seconds": wall, "tokens_per_second": tokens / wall,
            "bytes_read": read, "bytes_per_token": read / tokens,
            "demand_misses": d.stats.misses - s0[0],
            "speculative_issued": d.stats.speculative_issued - s0[1],
            "union_experts": sum(unions), "moe_calls": len(unions),
            "union_bound_bytes_per_token": bound / tokens if bound is not None else None,
            "union_no_cache_bytes_per_token": sum(unions) * record / tokens if unions else None,
            "cache_slots": d.plan.slots, "slots_per_layer": h, "record_bytes": record,
            "texts": [r["text"] for r in res],
        })
        d.close()
    print(json.dumps(results))


def run_child(argv, cap: "Throttle" = None, timeout=900):
    cmd = [sys.executable, "-m", "bench.studies.batch", "--worker"] + [str(a) for a in argv]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env,
                       preexec_fn=cap.preexec() if cap else None)
    if p.returncode != 0:
        raise RuntimeError(p.stderr[-2000:])
    return json.loads(p.stdout.strip().splitlines()[-1])


class Throttle(Cgroup):
    """A cgroup v1 blkio cgroup capping reads from the disk holding `path`."""

    def __init__(self, path: Path, bps: int):
        st = os.stat(path)
        self.path = BLKIO / f"{CGROUP_PREFIX}{os.getpid()}-batch"
        self.path.mkdir()
        (self.path / "blkio.throttle.read_bps_device").write_text(
            f"{os.major(st.st_dev)}:{os.minor(st.st_dev)} {bps}")


def throttle_available(path: Path) -> str:
    try:
        Throttle(path, 1 << 30).close()
        return ""
    except OSError as e:
        return f"blkio cgroup not writable ({e.strerror})"


# --- mlx_lm.server under 8 clients -----------------------------------------


def serve(model, extra, clients, seconds, max_tokens, budget, cap: "Throttle" = None):
    from bench.lib.server import free_port, start_server, stop_server

    import tempfile

    port = free_port()
    log_path = Path(tempfile.mkdtemp(prefix="deltafin-batch-srv-")) / "server.log"
    proc = start_server(model, port, budget, log_path, extra)
    if cap is not None:  # the model is loaded: throttle the expert reads from here on
        (cap.path / "cgroup.procs").write_text(str(proc.pid))
    # Plain completions of short, distinct prompts: the chat template's ~280-token system
    # prompt would make this a prefill benchmark, confounded by the server's prompt cache
    # (sequential requests reuse the cached prefix, concurrent ones cannot yet).
    prompts = [f"Question {i}: what is {i} plus {i}?" for i in range(16)]

    def ask(prompt):
        body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0}
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions",
                                     json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as r:
            out = json.loads(r.read())
        return out["choices"][0]["text"], out["usage"]["completion_tokens"]

    try:
        ask(prompts[0])  # warm up
        done, lock = [], threading.Lock()
        stop_at = time.time() + seconds

        def client(i):
            j = i
            while time.time() < stop_at:
                text, n = ask(prompts[j % len(prompts)])
                with lock:
                    done.append((prompts[j % len(prompts)], text, n))
                j += clients

        t = time.perf_counter()
        threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        wall = time.perf_counter() - t
    finally:
        stop_server(proc)
    tokens = sum(n for *_, n in done)
    replies = {}
    for p, text, _ in done:
        replies.setdefault(p, set()).add(text)
    return {"server_args": extra, "requests": len(done), "tokens": tokens, "seconds": wall,
            "tokens_per_second": tokens / wall,
            "consistent": all(len(v) == 1 for v in replies.values()),
            "replies": {p: sorted(v)[0] for p, v in replies.items()}}


# --- report ------------------------------------------------------------------


def table(rows, io_mbps=None, compute=None):
    """Markdown rows. In the I/O-bound mode: the I/O bound (union bytes / bandwidth),
    and the overlapped bound max(I/O time, compute time) with the compute-bound rate
    of the same B."""
    b1 = next((r for r in rows if r["B"] == 1), rows[0])
    head = "| B | tok/s | gain vs B=1 | expert MB read / token | union bound MB / token | ratio |"
    if io_mbps:
        head += " I/O bound tok/s | ratio | max(I/O, compute) bound tok/s | ratio |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        ub = r.get("union_bound_bytes_per_token")
        cells = [str(r["B"]), f"{r['tokens_per_second']:.2f}",
                 f"{r['tokens_per_second'] / b1['tokens_per_second']:.2f}x",
                 f"{r['bytes_per_token'] / 1e6:.2f}",
                 f"{ub / 1e6:.2f}" if ub else "-",
                 f"{r['bytes_per_token'] / ub:.2f}" if ub else "-"]
        if io_mbps:
            tb = io_mbps * 1e6 / ub if ub else None
            cells += [f"{tb:.2f}" if tb else "-",
                      f"{tb / r['tokens_per_second']:.2f}" if tb else "-"]
            c = (compute or {}).get(r["B"])
            both = 1 / max(1 / tb, 1 / c) if tb and c else None
            cells += [f"{both:.2f}" if both else "-",
                      f"{both / r['tokens_per_second']:.2f}" if both else "-"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--sizes", type=lambda s: [int(x) for x in s.split(",")], default=None)
    p.add_argument("--budget", default=None, help=argparse.SUPPRESS)
    p.add_argument("--slots", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--no-lookahead", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--record", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--workdir", default="/tmp/deltafin-bench-batch")
    p.add_argument("--tokens", type=int, default=12, help="tokens per request")
    p.add_argument("--io-tokens", type=int, default=8, help="tokens per request, I/O-bound")
    p.add_argument("--io-mbps", type=float, default=25.0, help="blkio read cap, MB/s")
    p.add_argument("--io-sizes", type=lambda s: [int(x) for x in s.split(",")],
                   default=[1, 4, 16, 32])
    p.add_argument("--server-seconds", type=float, default=30.0)
    p.add_argument("--parts", default="compute,io,server",
                   help="what to run; the others are kept from an existing --json")
    p.add_argument("--json", default=str(ROOT / "bench/results/batch.json"))
    a = p.parse_args()
    if a.worker:
        return worker(a)

    model = ensure_model(Path(a.workdir), "k3-mid", MODEL)
    from mlx_lm.utils import load_config

    from deltafin_mlx.plan.footprint import inventory_from_manifest
    from deltafin_mlx.format.manifest import read_manifest
    from deltafin_mlx.plan.memory import choose_sequences, plan_memory

    import mlx.core as mx

    m = read_manifest(model)
    inv = inventory_from_manifest(m, load_config(model), mx.float32)
    all_experts = m.experts["num_experts"] * len(m.moe_layers)
    full_budget = "1GB"
    max_b = choose_sequences(inv, full_budget, context=256, cap=64)
    sizes = a.sizes or sorted({1, 4, 16, 32, max_b})
    parts = set(a.parts.split(","))
    old = json.loads(Path(a.json).read_text()) if Path(a.json).exists() else {}
    report = {**old, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "machine": machine_info(), "model": str(model),
              "load_average": os.getloadavg(), "union": union_table(sorted({*sizes, 64}))}

    if "compute" in parts:
        report["tokens"] = a.tokens
        log(f"compute-bound: every expert resident, B in {sizes} (max B the 1 GB budget "
            f"allows at context 256, capped at 64: {max_b})")
        report["compute"] = run_child(["--model", model, "--budget", full_budget, "--tokens",
                                       a.tokens, "--sizes", ",".join(map(str, sizes))])
    slots = all_experts // 4
    why = throttle_available(model)
    if "io" not in parts:
        pass
    elif why:
        log(f"I/O-bound: skipped ({why})")
        report["io"] = {"skipped": why}
    else:
        report["io"] = {"mbps": a.io_mbps, "cache_slots": slots, "tokens": a.io_tokens}
        for name, extra in (("lookahead", []), ("no_lookahead", ["--no-lookahead"])):
            log(f"I/O-bound ({name}): reads capped at {a.io_mbps} MB/s, cache {slots} of "
                f"{all_experts} experts, B in {a.io_sizes}")
            th = Throttle(model, int(a.io_mbps * 1e6))
            try:
                report["io"][name] = run_child(
                    ["--model", model, "--slots", slots, "--tokens", a.io_tokens, "--record",
                     "--sizes", ",".join(map(str, a.io_sizes))] + extra, cap=th)
            finally:
                th.close()
    if "server" in parts and a.server_seconds > 0:
        report["server"] = {}
        modes = [("compute", "1GB", None)]
        if not why:
            one = plan_memory(inv, "1GB", context=4096)
            budget = one.used_bytes - one.cache_bytes + slots * one.slot_bytes
            modes.append(("io", str(budget), a.io_mbps))
        for mode, budget, mbps in modes:
            for name, extra in (("sequential", ["--decode-concurrency", "1",
                                                "--prompt-concurrency", "1"]), ("batched", [])):
                log(f"server ({mode}, {name}): 8 clients for {a.server_seconds:.0f} s")
                th = Throttle(model, int(mbps * 1e6)) if mbps else None
                try:
                    report["server"][f"{mode}_{name}"] = serve(
                        model, extra, 8, a.server_seconds, 16, budget, th)
                finally:
                    if th:
                        th.close()
            s, b = (report["server"][f"{mode}_{n}"]["replies"] for n in ("sequential", "batched"))
            report["server"][f"{mode}_same_replies"] = all(s[k] == b[k] for k in s if k in b)
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps(report, indent=1))
    Path(a.json).with_suffix(".md").write_text(markdown(report) + "\n")
    print(markdown(report))


def markdown(r):
    out = [f"{r['date']}, load average {r['load_average'][0]:.1f} on {r['machine'].get('cpus')} "
           "CPUs"]
    if "compute" in r:
        out += ["", f"Compute-bound (all experts resident), {r.get('tokens')} tokens per "
                "request:", "", table(r["compute"])]
    io = r.get("io", {})
    for name in ("lookahead", "no_lookahead"):
        if name in io:
            out += ["", f"I/O-bound, {io['mbps']} MB/s, cache {io['cache_slots']} slots, "
                    f"{io.get('tokens')} tokens per request ({name.replace('_', ' ')}):", "",
                    table(io[name], io["mbps"],
                          {c["B"]: c["tokens_per_second"] for c in r.get("compute", [])})]
    if "skipped" in io:
        out += ["", f"I/O-bound: skipped ({io['skipped']})"]
    out += ["", "| B | K3 uniform: union / gain | fixture uniform: union / gain | "
            "OLMoE trace: union / gain |", "|---|---|---|---|"]
    for u in r["union"]:
        t = (f"{u['trace_union']:.1f} / {u['trace_gain']:.2f}x" if "trace_union" in u else "-")
        out.append(f"| {u['B']} | {u['k3_uniform_union']:.1f} / {u['k3_uniform_gain']:.2f}x | "
                   f"{u['fixture_uniform_union']:.1f} / {u['fixture_uniform_gain']:.2f}x | {t} |")
    if "server" in r:
        s = r["server"]
        out += ["", "| mlx_lm.server, 8 clients | requests | tokens | tok/s | gain |",
                "|---|---|---|---|---|"]
        for mode in ("compute", "io"):
            if f"{mode}_sequential" not in s:
                continue
            base = s[f"{mode}_sequential"]["tokens_per_second"]
            for name in ("sequential", "batched"):
                x = s[f"{mode}_{name}"]
                out.append(f"| {mode}, {name} | {x['requests']} | {x['tokens']} | "
                           f"{x['tokens_per_second']:.2f} | {x['tokens_per_second'] / base:.2f}x |")
            out.append(f"\n{mode}: same replies in both modes: {s[f'{mode}_same_replies']}")
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
