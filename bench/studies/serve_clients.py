"""Concurrent clients of `deltafin-run serve`: time to first token and aggregate
tokens per second for 1, 2, 4 and 8 clients sending at once, with concurrent
requests decoded together (`--sequences auto`, the default) and one at a time
(`--sequences 1`), so the two compare within one run.

    python -m bench.studies.serve_clients [--model fixture|k3-mid|DIR] [--budget 40MB]
                                          [--context 1024] [--clients 1,2,4,8]
                                          [--rounds 3] [--tokens 24]

Models: `fixture`, the tests' synthetic K3-layout model (every expert fits the
budget: compute-bound), or `k3-mid`, bench.studies.batch's model (192 experts of
418 KB; at 40 MB about a tenth of them are cached: experts are read as decoding
goes), generated once under /tmp/deltafin-bench; or a converted directory.
Each round sends one streamed /v1/completions request (`--chat`: chat) per client
at the same instant, a different short prompt each (no prompt-cache reuse); a client's time to first token is
from the start to its first streamed text, the aggregate rate is all clients'
reply tokens (from the usage chunk) over the round's wall time. Reports medians
over rounds (time to first token: over clients and rounds) and writes
bench/results/serve_clients_MODEL.json.
"""

import argparse
import json
import re
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
    from deltafin_mlx.convert.convert import ConvertOptions, convert
    from deltafin_mlx.testing.synthetic import make_checkpoint

    out = workdir / "k3"
    if not (out / "deltafin.json").exists():
        make_checkpoint(workdir / "src", "kimi_k3", seed=0)
        convert(str(workdir / "src"), out, ConvertOptions(progress=False))
    return out


def stream_one(port, prompt, tokens, chat, start_event, out, i):
    body = {"max_tokens": tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}}
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    path = "/v1/chat/completions" if chat else "/v1/completions"
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
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
            elif first is None and chunk["choices"]:
                c = chunk["choices"][0]
                delta = c.get("delta", {})
                if c.get("text") or delta.get("content") or delta.get("reasoning"):
                    first = time.perf_counter() - t0
    out[i] = (first, n, time.perf_counter() - t0)


def one_round(port, clients, tokens, chat, tag):
    out, go = [None] * clients, threading.Event()
    threads = [threading.Thread(target=stream_one, args=(
        port, f"{tag} client {i}: tell me about streaming experts from disk", tokens, chat, go,
        out, i))
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


def started_line(log_path: Path) -> str:
    for line in log_path.read_text().splitlines():
        if "deltafin-run serve:" in line:
            return line.split("deltafin-run serve: ", 1)[1]
    return ""


def measure(model, budget, context, sequences, counts, rounds, tokens, chat, logdir):
    port = free_port()
    log_path = logdir / f"serve-{sequences}.log"
    proc = start_server(model, port, budget, log_path, server="deltafin", context=context,
                        extra=["--sequences", str(sequences)])
    slots = re.search(r"(\d+) request.* at once.*?(\d+) expert slots", started_line(log_path))
    log(f"--sequences {sequences}: {started_line(log_path)}")
    rows = []
    try:
        one_round(port, 1, 4, chat, "warm-up")
        for clients in counts:
            runs = [one_round(port, clients, tokens, chat, f"{sequences}/{clients}/{r}")
                    for r in range(rounds)]
            ttft = [t for r in runs for t in r["ttft_s"]]
            rate = [r["tokens"] / r["wall_s"] for r in runs]
            row = {"sequences": sequences, "clients": clients,
                   "running_at_once": int(slots.group(1)) if slots else None,
                   "expert_slots": int(slots.group(2)) if slots else None,
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
    p.add_argument("--model", default="fixture")
    p.add_argument("--budget", default="40MB")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--chat", action="store_true",
                   help="chat requests (the chat template's system prompt is prefilled: "
                   "measures prefill), instead of /v1/completions of short prompts")
    p.add_argument("--clients", default="1,2,4,8")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tokens", type=int, default=24)
    p.add_argument("--out", default=None,
                   help="default: bench/results/serve_clients_MODEL.json")
    a = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="deltafin-serve-clients-"))
    if a.model == "fixture":
        model = fixture_model(work)
    elif a.model == "k3-mid":
        from bench.lib.common import ensure_model
        from bench.studies.batch import MODEL

        model = ensure_model(Path("/tmp/deltafin-bench"), "k3-mid", MODEL)
    else:
        model = Path(a.model)
    counts = [int(c) for c in a.clients.split(",")]
    rows = []
    for sequences in ("auto", 1):
        rows += measure(model, a.budget, a.context, sequences, counts, a.rounds, a.tokens,
                        a.chat, work)
    result = {"date": time.strftime("%Y-%m-%d"), "model": a.model, "budget": a.budget,
              "context": a.context, "endpoint": "chat" if a.chat else "completions",
              "tokens": a.tokens, "command": "python -m bench.studies.serve_clients " +
              " ".join(sys.argv[1:]), "rows": rows}
    name = a.model if a.model in ("fixture", "k3-mid") else "dir"
    out = Path(a.out or ROOT / "bench" / "results" / f"serve_clients_{name}.json")
    out.write_text(json.dumps(result, indent=1))
    print("| --sequences | at once | expert slots | clients | first token s (median, max) "
          "| tok/s, all clients |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['sequences']} | {r['running_at_once']} | {r['expert_slots']} | "
              f"{r['clients']} | {r['ttft_median_s']:.2f}, {r['ttft_max_s']:.2f} | "
              f"{r['aggregate_tok_s_median']:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
