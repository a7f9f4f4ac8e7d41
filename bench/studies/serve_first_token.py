"""The first client's first token among concurrent chats, against a lone client's,
side by side on one `deltafin-run serve`.

    python -m bench.studies.serve_first_token [--model fixture|DIR] [--budget 40MB]
                                              [--context 2048] [--clients 4]
                                              [--rounds 3] [--words 200] [--tokens 8]

Each round sends one streamed chat alone, then `--clients` streamed chats at the
same instant; every message is different (about `--words` words, so each prefill
is its own), after one warm-up chat (so the template's preamble is in the prompt
cache for all of them alike). A client's first token is from its send to its
first streamed text. Reports, per round and as medians: the lone client's first
token, the first-served concurrent client's and the slowest one's, and the ratio
first-served / lone (issue 33's bar: at most 1.5). Writes
bench/results/serve_first_token_MODEL.json.
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
from bench.studies.serve_clients import fixture_model


def message(tag: str, words: int) -> str:
    return f"{tag}: " + " ".join(f"w{tag}{j}" for j in range(words))


def chat(port, content, tokens, go, out, passes, i):
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": tokens,
            "temperature": 0.0, "stream": True}
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions",
                                 json.dumps(body).encode(), {"Content-Type": "application/json"})
    go.wait()
    t0 = time.perf_counter()
    first = began = None
    with urllib.request.urlopen(req, timeout=1800) as r:
        for line in r:
            if began is None and line.startswith(b": keepalive"):
                began = time.perf_counter() - t0
            if first is None and line.startswith(b"data: ") and line.strip() != b"data: [DONE]":
                chunk = json.loads(line[6:])
                delta = chunk["choices"][0].get("delta", {}) if chunk["choices"] else {}
                if delta.get("content") or delta.get("reasoning"):
                    first = time.perf_counter() - t0
    out[i] = first
    passes[i] = began


def together(port, contents, tokens):
    """Each client's first token and the end of its first prefill pass (s after
    the start), in the order of `contents`."""
    out, passes, go = [None] * len(contents), [None] * len(contents), threading.Event()
    threads = [threading.Thread(target=chat, args=(port, c, tokens, go, out, passes, i))
               for i, c in enumerate(contents)]
    for t in threads:
        t.start()
    go.set()
    for t in threads:
        t.join()
    return out, passes


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="fixture")
    p.add_argument("--budget", default="40MB")
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--words", type=int, default=200)
    p.add_argument("--tokens", type=int, default=8)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="deltafin-first-token-"))
    model = fixture_model(work) if a.model == "fixture" else Path(a.model)
    port = free_port()
    proc = start_server(model, port, a.budget, work / "serve.log", server="deltafin",
                        context=a.context)
    rows = []
    try:
        together(port, [message("warm-up", 4)], 2)
        for r in range(a.rounds):
            (lone,), (lone_pass,) = together(port, [message(f"lone{r}", a.words)], a.tokens)
            firsts, passes = together(
                port, [message(f"r{r}c{i}", a.words) for i in range(a.clients)], a.tokens)
            k = firsts.index(min(firsts))
            row = {"lone_s": lone, "first_served_s": min(firsts), "slowest_s": max(firsts),
                   "clients_s": firsts, "ratio": min(firsts) / lone,
                   "lone_first_pass_s": lone_pass, "first_served_first_pass_s": passes[k]}
            log(f"round {r}: lone {lone:.2f} s (first pass done at {lone_pass:.2f} s); "
                f"{a.clients} together: first served {min(firsts):.2f} s (first pass done at "
                f"{passes[k]:.2f} s), slowest {max(firsts):.2f} s ({row['ratio']:.2f}x)")
            rows.append(row)
    finally:
        stop_server(proc)
    med = {k: statistics.median(r[k] for r in rows)
           for k in ("lone_s", "first_served_s", "slowest_s", "ratio")}
    result = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "model": a.model,
              "budget": a.budget, "context": a.context, "clients": a.clients,
              "words": a.words, "tokens": a.tokens,
              "command": "python -m bench.studies.serve_first_token " + " ".join(sys.argv[1:]),
              "rounds": rows, "median": med}
    name = a.model if a.model == "fixture" else "dir"
    out = Path(a.out or ROOT / "bench" / "results" / f"serve_first_token_{name}.json")
    out.write_text(json.dumps(result, indent=1))
    print(f"| lone client | {a.clients} together: first served | slowest | first served / lone |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['lone_s']:.2f} s | {r['first_served_s']:.2f} s | {r['slowest_s']:.2f} s | "
              f"{r['ratio']:.2f}x |")
    print(f"| median {med['lone_s']:.2f} s | {med['first_served_s']:.2f} s | "
          f"{med['slowest_s']:.2f} s | {med['ratio']:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
