"""Concurrent clients of `deltafin-run serve`: time to first token and aggregate
tokens per second for 1, 2, 4 and 8 clients sending at once, with concurrent
requests decoded together (`--sequences auto`, the default) and one at a time
(`--sequences 1`), so the two compare within one run.

    python -m bench.studies.serve_clients [MODEL] [--budget 40MB] [--clients 1,2,4,8]
                                          [--rounds 3] [--tokens 24]

Without MODEL the test fixtures' synthetic K3-layout model is generated (seconds).
Each round sends one streamed chat request per client at the same instant, a
different prompt each (no prompt-cache reuse); a client's time to first token is
from the start to its first streamed text, the aggregate rate is all clients'
reply tokens (from the usage chunk) over the round's wall time. Reports medians
over rounds (time to first token: over clients and rounds) and writes
bench/results/serve_clients.json.
"""

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from bench.lib import ROOT
from bench.lib.common import log
from bench.lib.server import free_port, start_server, stop_server


def fixture_model(workdir: Path) -> Path:
    from deltafin_convert.convert import ConvertOptions, convert
    from deltafin_mlx.testing.synthetic import make_checkpoint

    out = workdir / "k3"
    if not (out / "deltafin.json").exists():
        make_checkpoint(workdir / "src", "kimi_k3", seed=0)
        convert(str(workdir / "src"), out, ConvertOptions(progress=False))
    return out


def stream_one(port, prompt, tokens, start_event, out, i):
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": tokens,
            "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions",
                                 json.dumps(body).encode(), {"Content-Type": "application/json"})
    start_event.wait()
    t0 = time.perf_counter()
    first, n = None, 0
    with urllib.request.urlopen(req, timeout=600) as r:
        for line in r:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                n = chunk["usage"]["completion_tokens"]
            elif first is None and chunk["choices"] and chunk["choices"][0].get("delta", {}):
                delta = chunk["choices"][0]["delta"]
                if delta.get("content") or delta.get("reasoning"):
                    first = time.perf_counter() - t0
    out[i] = (first, n, time.perf_counter() - t0)


def one_round(port, clients, tokens, tag):
    out, go = [None] * clients, threading.Event()
    threads = [threading.Thread(target=stream_one, args=(
        port, f"{tag} client {i}: tell me about streaming experts from disk", tokens, go, out, i))
        for i in range(clients)]
    for t in threads:
        t.start()
    start = time.perf_counter()
    go.set()
    for t in threads:
        t.join(timeout=900)
    wall = time.perf_counter() - start
    return {"ttft_s": [o[0] for o in out if o and o[0] is not None],
            "tokens": sum(o[1] for o in out if o), "wall_s": wall}


def measure(model, budget, sequences, counts, rounds, tokens, logdir):
    port = free_port()
    proc = start_server(model, port, budget, logdir / f"serve-{sequences}.log", server="deltafin",
                        extra=["--sequences", str(sequences)])
    rows = []
    try:
        one_round(port, 1, 4, "warm-up")
        for clients in counts:
            runs = [one_round(port, clients, tokens, f"{sequences}/{clients}/{r}")
                    for r in range(rounds)]
            ttft = [t for r in runs for t in r["ttft_s"]]
            rate = [r["tokens"] / r["wall_s"] for r in runs]
            row = {"sequences": sequences, "clients": clients,
                   "ttft_median_s": statistics.median(ttft) if ttft else None,
                   "ttft_max_s": max(ttft) if ttft else None,
                   "aggregate_tok_s_median": statistics.median(rate),
                   "wall_s_median": statistics.median(r["wall_s"] for r in runs),
                   "rounds": rounds}
            log(f"--sequences {sequences}, {clients} clients: first token "
                f"{row['ttft_median_s']:.2f} s (max {row['ttft_max_s']:.2f}), "
                f"{row['aggregate_tok_s_median']:.1f} tok/s in all")
            rows.append(row)
    finally:
        stop_server(proc)
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", nargs="?")
    p.add_argument("--budget", default="40MB")
    p.add_argument("--clients", default="1,2,4,8")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tokens", type=int, default=24)
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "serve_clients.json"))
    a = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="deltafin-serve-clients-"))
    model = Path(a.model) if a.model else fixture_model(work)
    counts = [int(c) for c in a.clients.split(",")]
    rows = []
    for sequences in ("auto", 1):
        rows += measure(model, a.budget, sequences, counts, a.rounds, a.tokens, work)
    result = {"date": time.strftime("%Y-%m-%d"), "model": str(model), "budget": a.budget,
              "tokens": a.tokens, "command": "python -m bench.studies.serve_clients " +
              " ".join(sys.argv[1:]), "rows": rows}
    Path(a.out).write_text(json.dumps(result, indent=1))
    print(f"{'sequences':>9} {'clients':>7} {'first token s':>13} {'tok/s all':>9}")
    for r in rows:
        print(f"{r['sequences']!s:>9} {r['clients']:>7} {r['ttft_median_s']:>13.2f} "
              f"{r['aggregate_tok_s_median']:>9.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
