"""mlx_lm.server serving a Deltafin model under concurrent clients, for a bounded time.

    python -m bench.studies.stress_server MODEL [--clients 8] [--seconds 60] [--budget 200MB]
                                            [--server deltafin --hostile 0.5 --context 1024]

Starts `mlx_lm.server --trust-remote-code` on a free localhost port, learns each
prompt's greedy reply from requests sent one at a time, then runs N client threads
sending chat completions (streaming and not) in a loop until the time is up. Every
reply must equal the one learned for its prompt, or be a clean HTTP error; the
server must stay up and its peak memory (VmHWM) within the budget plus a margin.
Prints (and with --json writes) requests served, failures, and latency percentiles.
Only loopback addresses are used; every loop is bounded in count and time.

`--server deltafin` runs `deltafin-run serve` instead (the way to serve); with
`--hostile F` a fraction F of requests are hostile (out-of-vocabulary and negative
logit_bias ids, prompts over the planned context, malformed or deeply nested or
oversized bodies, bad Content-Length, clients that disconnect before or during
their reply), each of which must get its expected HTTP error (a disconnect gets
none), while every ordinary request still gets its exact reply. With `--samples FILE`
(`--server deltafin`) the server samples its memory every 50 ms into FILE, and the
report's `peak_sample` splits the peak: RssAnon/RssFile, MLX's active and cached
bytes, glibc's heap, used and free (docs/PERFORMANCE.md, "Serving memory").
"""

import argparse
import json
import sys
from pathlib import Path

from bench.lib.server import sampling
from deltafin_mlx.testing.server_stress import healthy, run


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--seconds", type=float, default=60)
    p.add_argument("--budget", default="200MB")
    p.add_argument("--max-tokens", type=int, default=12)
    p.add_argument("--json", default=None, help="write the report here")
    p.add_argument("--server", choices=("mlx_lm", "deltafin"), default="mlx_lm")
    p.add_argument("--hostile", type=float, default=0.0, help="fraction of hostile requests")
    p.add_argument("--context", type=int, default=4096, help="deltafin-run serve --context")
    p.add_argument("--samples", default=None,
                   help="with --server deltafin: write the server's memory samples here")
    a = p.parse_args()
    if a.samples and a.server != "deltafin":
        p.error("--samples needs --server deltafin")
    r = run(a.model, a.clients, a.seconds, a.budget, a.max_tokens, server=a.server,
            hostile_fraction=a.hostile, context=a.context, samples=a.samples,
            launcher=sampling(a.samples) if a.samples else None)
    print(json.dumps(r, indent=1))
    if a.json:
        Path(a.json).write_text(json.dumps(r, indent=1))
    return 0 if healthy(r) else 1


if __name__ == "__main__":
    sys.exit(main())
