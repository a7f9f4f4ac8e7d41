"""Direct reads (O_DIRECT) against mapped reads (mmap), and the pipeline on and off,
on the same model and cache size, alternating, in fresh processes, with the page
cache dropped before each run.

    python -m bench.studies.read_modes MODEL [--fraction 0.25] [--repeats 3] [--tokens 10]

Prints s/token and the share stalled on reads per configuration (median and range).
"""

import argparse
import json
import statistics
import subprocess
import sys

from bench.lib import worker

def drop_page_cache():
    try:
        subprocess.run(["sync"], check=False)
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
        return True
    except OSError:
        return False


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--fraction", type=float, default=0.25)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--tokens", type=int, default=10)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    configs = [("direct", 1), ("mmap", 1), ("direct", 0)]
    runs = {c: [] for c in configs}
    dropped = True
    for _ in range(a.repeats):
        for mode, pipe in configs:
            dropped &= drop_page_cache()
            out = subprocess.run(worker.command("read-mode", a.model, a.fraction, mode, pipe,
                                                a.tokens),
                                 capture_output=True, text=True, env=worker.environment())
            if out.returncode != 0:
                sys.exit(out.stderr[-2000:])
            runs[(mode, pipe)].append(json.loads(out.stdout.strip().splitlines()[-1]))
    report = {"model": a.model, "fraction": a.fraction, "page_cache_dropped": dropped}
    print(f"{a.model}, cache {a.fraction:.0%} of experts, {a.repeats} alternating runs"
          f"{'' if dropped else ' (page cache NOT dropped)'}")
    for (mode, pipe), rs in runs.items():
        t = [r["s_per_token"] for r in rs]
        st = [r["stall_share"] for r in rs]
        name = f"{mode}, pipeline {'on' if pipe else 'off'}"
        report[name] = {"s_per_token": t, "stall_share": st}
        print(f"  {name:24s} {statistics.median(t):.3f} s/token ({min(t):.3f}-{max(t):.3f}), "
              f"stalled {statistics.median(st):.0%} ({min(st):.0%}-{max(st):.0%})")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
