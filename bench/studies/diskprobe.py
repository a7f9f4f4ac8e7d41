"""Disk probe: O_DIRECT random reads of exactly one expert record.

Reads whole records at record-aligned offsets of the bench model's bank files
(the runtime's own access pattern), with O_DIRECT so the page cache cannot help,
at queue depth 1 (one thread) and 2 (two threads, each with its own buffer).
Each sample is `batch` reads; the result is GB/s per sample: median and range.

    python -m bench.studies.diskprobe /tmp/deltafin-bench/k3x-h1024-l3-e160/model --reads 96
"""

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path

import numpy as np

from deltafin_mlx.format.aligned import aligned_empty


def aligned_buffer(nbytes: int) -> np.ndarray:
    buf = aligned_empty(nbytes)
    buf[::4096] = 0  # touch every page once, outside the timed reads
    return buf


def bank_targets(model_dir: Path):
    """(path, header_size, num_records, record_size) of every bank of a model."""
    manifest = json.loads((model_dir / "deltafin.json").read_text())
    ex = manifest["experts"]
    out = []
    for entry in ex["layers"].values():
        path = model_dir / entry["bank"]
        out.append((str(path), entry["header_size"], ex["num_experts"], ex["record_size"]))
    return out


def probe(targets, depth: int, reads: int, batch: int, seed: int = 0) -> dict:
    """`reads` random record reads at queue depth `depth`; GB/s per `batch` reads."""
    record_size = targets[0][3]
    rng = np.random.default_rng(seed)
    # Every (file, record) pair once before any repeats, in random order.
    pairs = [(t, r) for t in range(len(targets)) for r in range(targets[t][2])]
    order = rng.permutation(len(pairs))
    plan = [pairs[i] for i in order[:reads]] if reads <= len(pairs) else [
        pairs[i % len(pairs)] for i in rng.integers(0, len(pairs), reads)
    ]
    fds = [os.open(t[0], os.O_RDONLY | getattr(os, "O_DIRECT", 0)) for t in targets]
    direct = hasattr(os, "O_DIRECT")
    bufs = [aligned_buffer(record_size) for _ in range(depth)]
    samples = []
    errors = []
    try:
        for start in range(0, len(plan), batch):
            chunk = plan[start : start + batch]
            lock = threading.Lock()
            next_i = [0]

            def worker(buf):
                view = memoryview(buf)
                while True:
                    with lock:
                        i = next_i[0]
                        next_i[0] += 1
                    if i >= len(chunk):
                        return
                    t, r = chunk[i]
                    off = targets[t][1] + r * record_size
                    try:
                        n = os.preadv(fds[t], [view], off)
                        if n != record_size:
                            errors.append(f"short read {n}")
                    except OSError as e:
                        errors.append(str(e))
                        return

            t0 = time.perf_counter()
            threads = [threading.Thread(target=worker, args=(b,)) for b in bufs]
            for th in threads:
                th.start()
            for th in threads:
                th.join()
            dt = time.perf_counter() - t0
            samples.append(len(chunk) * record_size / dt / 1e9)
    finally:
        for fd in fds:
            os.close(fd)
    if errors:
        raise RuntimeError(f"disk probe failed: {errors[0]}")
    s = np.array(samples)
    return {
        "queue_depth": depth,
        "reads": len(plan),
        "record_size": record_size,
        "batch": batch,
        "o_direct": direct,
        "gbps_samples": [round(x, 4) for x in samples],
        "gbps_median": float(np.median(s)),
        "gbps_min": float(s.min()),
        "gbps_max": float(s.max()),
        "ms_per_record_median": record_size / float(np.median(s)) / 1e6,
    }


def run_probe(model_dir, reads: int = 96, batch: int = 8, seed: int = 0) -> dict:
    targets = bank_targets(Path(model_dir))
    return {f"qd{d}": probe(targets, d, reads, batch, seed + d) for d in (1, 2)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model_dir")
    ap.add_argument("--reads", type=int, default=96)
    ap.add_argument("--batch", type=int, default=8)
    args = ap.parse_args(argv)
    res = run_probe(args.model_dir, args.reads, args.batch)
    for k, r in res.items():
        print(f"{k}: {r['gbps_median']:.2f} GB/s median "
              f"({r['gbps_min']:.2f}-{r['gbps_max']:.2f}), {r['reads']} reads of "
              f"{r['record_size']} bytes")
    json.dump(res, sys.stdout, indent=1)


if __name__ == "__main__":
    main()
