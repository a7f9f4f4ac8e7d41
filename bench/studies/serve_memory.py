"""Peak memory of `deltafin-run serve` answering one long prompt.

    python -m bench.studies.serve_memory MODEL [--budget 40MB] [--words 3700] [serve options...]

Starts the server on a free loopback port, sends one chat request of `--words`
words, and prints the reply's length, the seconds it took, and the server's peak
VmHWM against a process that only imported the server (the baseline).
"""

import argparse
import sys
import tempfile
import time
import urllib.error
from pathlib import Path

from bench.lib import server as ss


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--budget", default="40MB")
    p.add_argument("--words", type=int, default=3700)
    a, extra = p.parse_known_args()
    port = ss.free_port()
    log = Path(tempfile.mkdtemp(prefix="deltafin-serve-mem-")) / "server.log"
    proc = ss.start_server(a.model, port, a.budget, log, server="deltafin", extra=extra)
    try:
        start = time.time()
        try:
            reply = f"{len(ss.chat(port, 'stream ' * a.words, 4, False))} characters"
        except urllib.error.HTTPError as e:
            reply = f"HTTP {e.code}: {e.read()[:200].decode()}"
        seconds = time.time() - start
        peak = ss.peak_rss(proc.pid)
    finally:
        ss.stop_server(proc)
    base = ss.baseline_rss()
    print(f"{reply}; {seconds:.1f} s; peak {peak >> 20} MiB, baseline {base >> 20} MiB, "
          f"+{(peak - base) >> 20} MiB over the baseline at budget {a.budget}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
