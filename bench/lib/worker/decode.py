"""One benchmark configuration in one fresh process: load, prefill, warm up, then
time greedy decoding token by token. Prints one JSON line (the last line of stdout).

    python -m bench.lib.worker decode --model DIR --mode resident   # mlx-lm, all in memory
    python -m bench.lib.worker decode --model DIR --mode deltafin --budget 600000000

Where the time goes (nothing in deltafin_mlx is edited; this process wraps
`mlx.core.eval` and, where they exist, the runtime's reader and cache methods):
per-thread CPU time from /proc/self/task splits the timed tokens into MLX compute
(the CPU time of MLX's stream thread, where MLX evaluates on the CPU), the main
thread (Python: graph building, routing, cache policy) and the reader threads;
with the wall time inside the reader's record reads (reader busy), the runtime's
own stall_seconds and the time MLX's thread sat idle (wall - compute).
"""

import argparse
import json
import os
import sys
import threading
import time
from contextlib import ExitStack

import mlx.core as mx
import numpy as np

from deltafin_mlx import runtime

PHASE = {"name": "start"}


def phase(name):
    PHASE["name"] = name
    print(f"phase: {name} t={time.perf_counter():.2f}", file=sys.stderr, flush=True)


def proc_status() -> dict:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                k, v = line.split(":")
                out[k] = int(v.split()[0]) * 1024
    return out


def cpu_ticks() -> dict:
    """System-wide CPU ticks (user, system, idle, iowait, steal) from /proc/stat."""
    try:
        with open("/proc/stat") as f:
            parts = f.readline().split()
        v = [int(x) for x in parts[1:]]
        return {"user": v[0] + v[1], "system": v[2] + v[5] + v[6], "idle": v[3], "iowait": v[4],
                "steal": v[7] if len(v) > 7 else 0}
    except (OSError, ValueError, IndexError):
        return {}


def thread_cpu() -> dict:
    """CPU seconds (user + system) of every thread of this process, by native id."""
    hz = os.sysconf("SC_CLK_TCK")
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                parts = f.read().rsplit(")", 1)[1].split()
            out[int(tid)] = (int(parts[11]) + int(parts[12])) / hz
        except (OSError, ValueError, IndexError):
            pass
    return out


def _has_path(obj, dotted: str) -> bool:
    for part in dotted.split("."):
        if not hasattr(obj, part):
            return False
        obj = getattr(obj, part)
    return True


class Profiler:
    """Wraps mx.eval and the runtime's reader and cache methods (HOOKS)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.t = {}
        self.n = {}
        self.orig_eval = mx.eval
        self.hooked = []
        self.reader_tids = set()

    def add(self, key, dt):
        with self.lock:
            self.t[key] = self.t.get(key, 0.0) + dt
            self.n[key] = self.n.get(key, 0) + 1

    def wrap(self, key, fn):
        def wrapped(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.add(key, time.perf_counter() - t0)

        wrapped.__wrapped__ = fn
        return wrapped

    # What the profile times, by module and name. A hook that is gone (a method renamed
    # or moved) fails the run loudly: a silently skipped hook reads as zero time spent.
    HOOKS = {"deltafin_mlx.engine.reader": ["read_record"],
             "deltafin_mlx.engine.cache": ["ExpertCache.request", "ExpertCache.prefetch",
                                           "ExpertCache._retire_speculation", "ExpertCache.wait"]}

    def install(self):
        import importlib

        mx.eval = self.wrap("runtime_eval", self.orig_eval)
        self.hooked.append("mlx.core.eval")
        missing = [f"{m}.{name}" for m, names in self.HOOKS.items() for name in names
                   if not _has_path(importlib.import_module(m), name)]
        if missing:
            raise SystemExit(f"bench profiler: hooks no longer in the runtime: {', '.join(missing)}"
                             " (update Profiler.HOOKS in bench/lib/worker/decode.py)")
        import deltafin_mlx.engine.cache as dc
        import deltafin_mlx.engine.reader as rd

        inner = self.wrap("reader_busy", rd.read_record)
        tids = self.reader_tids

        def read_record(*a, **k):
            tids.add(threading.get_native_id())
            return inner(*a, **k)

        rd.read_record = read_record
        self.hooked.append("reader.read_record")
        for name in self.HOOKS["deltafin_mlx.engine.cache"]:
            cls_name, meth = name.split(".")
            cls = getattr(dc, cls_name)
            setattr(cls, meth, self.wrap(f"cache.{meth}", getattr(cls, meth)))
            self.hooked.append(name)

    def snapshot(self):
        with self.lock:
            return dict(self.t), dict(self.n)


class Routing:
    """Routed experts per MoE layer and position (first sequence), from the
    runtime's on_route callback where it has one."""

    def __init__(self):
        self.calls = []  # (layer, array (positions, k))

    def __call__(self, layer, idx):
        idx = np.asarray(idx)
        self.calls.append((int(layer), idx.reshape(-1, idx.shape[-1]) if idx.ndim > 1 else idx[None]))

    def tokens(self, layers):
        """[[experts of layer 0], [layer 1], ...] per position, in order."""
        per_layer = {l: [] for l in layers}
        for layer, rows in self.calls:
            if layer in per_layer:
                per_layer[layer].extend(sorted(int(e) for e in r) for r in rows)
        n = min(len(v) for v in per_layer.values()) if per_layer else 0
        return [[per_layer[l][t] for l in layers] for t in range(n)]


def overlap_stats(tokens) -> dict:
    """Share of a token's experts also used by the previous token (same layer)."""
    if len(tokens) < 2:
        return {}
    shares, distinct = [], set()
    for a, b in zip(tokens, tokens[1:]):
        for la, lb in zip(a, b):
            shares.append(len(set(la) & set(lb)) / len(lb))
    for t in tokens:
        for i, l in enumerate(t):
            distinct.update((i, e) for e in l)
    return {"prev_token_overlap": float(np.mean(shares)), "distinct_layer_experts": len(distinct),
            "tokens": len(tokens)}


def _admit_all_speculation():
    """Reads ahead take a slot like demand misses do (evicting the lowest-valued
    unprotected expert) instead of only when the victim is valued below the guess."""
    import deltafin_mlx.engine.policy as policy
    orig = policy.SlotMap.place

    def place(self, expert, protected=(), speculative=False, **kwargs):
        if not speculative:
            return orig(self, expert, protected, **kwargs)
        try:
            return orig(self, expert, protected)
        except RuntimeError:
            return None

    policy.SlotMap.place = place


EXPERIMENTS = {"admit-all-speculation": _admit_all_speculation}


def main(argv=None):
    try:
        return decode(argv)
    except MemoryError:
        print(json.dumps({"status": "memory-error", "phase": PHASE["name"]}), flush=True)
        return 3


def decode(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.lib.worker decode")
    ap.add_argument("--model", required=True)
    ap.add_argument("--mode", choices=("resident", "deltafin"), required=True)
    ap.add_argument("--budget", type=int, help="deltafin memory_budget in bytes")
    ap.add_argument("--prompt-tokens", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--reader-threads", type=int, default=1)
    ap.add_argument("--cache-slots", type=int, help="cap on the expert cache's slots")
    ap.add_argument("--lookahead", type=int, default=1)
    ap.add_argument("--pipeline", choices=("default", "on", "off"), default="default",
                    help="LoadOptions.pipeline ('default': its own, 'auto')")
    ap.add_argument("--throttle", nargs=2, metavar=("FILE", "VALUE"),
                    help="write VALUE into FILE (a blkio throttle) when timing starts")
    ap.add_argument("--trace-out",
                    help="write the routing trace (deltafin_mlx.testing.cache_simulator's JSONL)")
    ap.add_argument("--routing", action="store_true",
                    help="record routing (overlap with the previous token) via on_route")
    ap.add_argument("--experiment", choices=sorted(EXPERIMENTS),
                    help="patch the runtime in this process only (bench.experiments)")
    args = ap.parse_args(argv)
    if args.experiment:
        EXPERIMENTS[args.experiment]()

    from mlx_lm.models.cache import make_prompt_cache

    mx.eval(mx.zeros(8) + 1)
    base = proc_status()
    prof = Profiler()
    prof.install()
    from deltafin_mlx.engine.load import LoadOptions, load
    from deltafin_mlx.testing.decode import load_resident

    phase("loading")
    t0 = time.perf_counter()
    result = {"mode": args.mode, "budget": args.budget, "model": args.model,
              "experiment": args.experiment, "pipeline": args.pipeline,
              "reader_threads": args.reader_threads, "lookahead": bool(args.lookahead)}
    routing, observing = None, ExitStack()  # routing observed until its numbers are taken
    if args.mode == "resident":
        model = load_resident(args.model)
    else:
        # Every configuration starts cold (warm_start=False), as before warm restarts
        # existed: a hot set left by the previous configuration would favour
        # whichever runs next.
        options = LoadOptions(memory_budget=args.budget, tokenizer=False,
                              reader_threads=args.reader_threads,
                              lookahead=bool(args.lookahead), cache_slots=args.cache_slots or None,
                              pipeline="auto" if args.pipeline == "default"
                              else args.pipeline == "on", warm_start=False)
        model, _ = load(args.model, options=options)
        plan = runtime(model).plan
        result["plan"] = {k: getattr(plan, k) for k in (
            "budget", "resident_bytes", "state_bytes", "working_bytes", "slot_bytes",
            "moe_layers", "experts_per_token", "num_experts", "slots", "floor", "cache_bytes",
            "cache_fraction")}
        # Only when asked: a routing observer costs its own bookkeeping.
        if args.routing or args.trace_out:
            routing = Routing()
            observing.enter_context(runtime(model).observe(on_route=routing))
    result["load_s"] = time.perf_counter() - t0
    result["rss_after_load"] = proc_status()["VmRSS"] - base["VmRSS"]

    rng = np.random.default_rng(args.seed)
    prompt = mx.array(rng.integers(1, 700, size=(1, args.prompt_tokens)).astype(np.int32))
    cache = make_prompt_cache(model)
    ev = prof.orig_eval

    def counters():
        c = {"wall": time.perf_counter(), "cpu": sum(os.times()[:2]), "ticks": cpu_ticks(),
             "threads": thread_cpu()}
        c["prof"] = prof.snapshot()
        if args.mode == "deltafin":
            s = runtime(model).stats
            c["stats"] = {k: getattr(s, k) for k in ("hits", "misses", "speculative_issued",
                                                     "speculative_used", "stall_seconds")}
            c["bytes_read"] = runtime(model).store.bytes_read
        return c

    phase("prefill")
    t = time.perf_counter()
    logits = model(prompt, cache=cache)[:, -1]
    ev(logits)
    result["prefill_s"] = time.perf_counter() - t
    tokens = prompt[0].tolist()

    def step(logits):
        y = mx.argmax(logits, axis=-1)
        t0 = time.perf_counter()
        out = model(y[:, None], cache=cache)[:, -1]
        t1 = time.perf_counter()
        ev(out)
        t2 = time.perf_counter()
        tokens.append(int(y.item()))
        return out, t1 - t0, t2 - t1

    phase("warmup")
    warm = []
    for _ in range(args.warmup):
        t = time.perf_counter()
        logits, _, _ = step(logits)
        warm.append(time.perf_counter() - t)
    result["warmup_token_s"] = warm

    if args.throttle:
        # The warm-up filled the cache at full disk speed; only timed tokens
        # run under the throttle (bench.studies.iobound).
        with open(args.throttle[0], "w") as f:
            f.write(args.throttle[1])
    phase("decode")
    before = counters()
    per_token, build, final = [], [], []
    for _ in range(args.tokens):
        t = time.perf_counter()
        logits, b, f = step(logits)
        per_token.append(time.perf_counter() - t)
        build.append(b)
        final.append(f)
    after = counters()
    phase("done")

    n = args.tokens
    wall = after["wall"] - before["wall"]
    pt, pn = after["prof"]
    bt, bn = before["prof"]
    dprof = {k: pt.get(k, 0.0) - bt.get(k, 0.0) for k in pt}
    dcount = {k: pn.get(k, 0) - bn.get(k, 0) for k in pn}
    ticks = {k: after["ticks"].get(k, 0) - before["ticks"].get(k, 0) for k in after["ticks"]}
    total_ticks = sum(ticks.values()) or 1
    # CPU time other processes used meanwhile (the machine may be shared):
    # system-wide busy time minus this process's own, as a share of all CPUs.
    hz = os.sysconf("SC_CLK_TCK")
    ncpu = os.cpu_count() or 1
    busy = (ticks.get("user", 0) + ticks.get("system", 0)) / hz
    own = after["cpu"] - before["cpu"]
    foreign = max(busy - own, 0.0) / (wall * ncpu)
    result.update(
        tokens=tokens,
        timed_tokens=n,
        decode_wall_s=wall,
        s_per_token=wall / n,
        tokens_per_s=n / wall,
        per_token_s=per_token,
        process_cpu_per_token_s=(after["cpu"] - before["cpu"]) / n,
        cpu_steal_share=ticks.get("steal", 0) / total_ticks,
        foreign_cpu_share=foreign,
        cpu_iowait_share=ticks.get("iowait", 0) / total_ticks,
        peak_rss=proc_status()["VmHWM"] - base["VmRSS"],
        base_rss=base["VmRSS"],
        hooks=prof.hooked,
    )
    runtime_eval = dprof.get("runtime_eval", 0.0)
    # Per-thread CPU: MLX evaluates on its own stream thread(s) (neither the main
    # thread nor a reader), so its CPU time is the compute, whatever the runtime
    # does to overlap it (async_eval, pipelining) and whoever else uses the CPUs.
    t0, t1 = before["threads"], after["threads"]
    dthreads = {tid: t1[tid] - t0.get(tid, 0.0) for tid in t1}
    main_tid = os.getpid()
    readers = prof.reader_tids
    mlx_cpu = sum(v for tid, v in dthreads.items() if tid != main_tid and tid not in readers)
    breakdown = {
        "compute_s": mlx_cpu / n,
        "main_thread_cpu_s": dthreads.get(main_tid, 0.0) / n,
        "reader_cpu_s": sum(v for tid, v in dthreads.items() if tid in readers) / n,
        "compute_thread_idle_s": max(wall - mlx_cpu, 0.0) / n,
        "runtime_eval_s": runtime_eval / n,
        "final_eval_s": sum(final) / n,
        "graph_and_runtime_python_s": None,
    }
    if args.mode == "deltafin":
        s0, s1 = before["stats"], after["stats"]
        d = {k: s1[k] - s0[k] for k in s0}
        rec = runtime(model).manifest.experts["record_size"]
        d["bytes_read"] = after["bytes_read"] - before["bytes_read"]
        result["stats"] = d
        lookups = d["hits"] + d["misses"]
        result.update(
            hit_rate=d["hits"] / lookups if lookups else None,
            precision=(d["speculative_used"] / d["speculative_issued"]
                       if d["speculative_issued"] else None),
            recall=(d["speculative_used"] / (d["speculative_used"] + d["misses"])
                    if d["speculative_used"] + d["misses"] else None),
            stall_share=d["stall_seconds"] / wall,
            bytes_read_per_token=d["bytes_read"] / n,
            # Bytes the tokens' experts had to get from disk: demand misses plus
            # reads ahead that were then used.
            needed_bytes_per_token=(d["misses"] + d["speculative_used"]) * rec / n,
            demand_miss_bytes_per_token=d["misses"] * rec / n,
            record_size=rec,
        )
        breakdown["stall_s"] = d["stall_seconds"] / n
        if "reader_busy" in dprof:
            busy = dprof["reader_busy"]
            reads = dcount.get("reader_busy", 0)
            breakdown["reader_busy_s"] = busy / n
            breakdown["reads_per_token"] = reads / n
            breakdown["reader_gbps_while_reading"] = reads * rec / busy / 1e9 if busy else None
        for k, v in dprof.items():
            if k.startswith("cache."):
                breakdown[k + "_s"] = v / n
        breakdown["graph_and_runtime_python_s"] = dthreads.get(main_tid, 0.0) / n
        observing.close()
        if routing is not None:
            layers = sorted({l for l, _ in routing.calls})
            toks = routing.tokens(layers)
            result["routing"] = overlap_stats(toks[-n:])
            result["routing_all_positions"] = len(toks)
            if args.trace_out:
                with open(args.trace_out, "w") as f:
                    for i, t in enumerate(toks):
                        f.write(json.dumps({"tok": i, "layers": t}) + "\n")
        runtime(model).close()
    else:
        breakdown["graph_and_runtime_python_s"] = dthreads.get(main_tid, 0.0) / n
    result["breakdown"] = breakdown
    print(json.dumps(result), flush=True)

