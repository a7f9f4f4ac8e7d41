"""Scoring over HTTP against `score`: the same texts (random token ids, every position
but the first scored) scored by `deltafin-run score` (one process) and by
`deltafin-run serve` (one process) through /v1/completions' `echo` (`logprobs` 1,
`max_tokens` 0, the prompt as token ids) three ways: every text in one request,
one request per text sent one after another, and one request per text sent at once
(requests waiting are scored in the same passes). Scored tokens/s with the model
already loaded in each (score's own summary; over HTTP, first request sent to last
answer), and the summed log-probabilities, which must agree.

    .venv/bin/python -m bench.studies.score_http --model demo --texts 8 --length 128
"""

import argparse
import json
import random
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench.lib import common
from deltafin_mlx.testing.server import free_port, post, start_server, stop_server


def texts(n: int, length: int, vocab: int, seed: int = 0) -> list:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(length)] for _ in range(n)]


def by_score(model, budget, ids, work: Path) -> dict:
    src, out = work / "in.jsonl", work / "out.jsonl"
    src.write_text("".join(json.dumps({"id": i, "tokens": t}) + "\n" for i, t in enumerate(ids)))
    out.unlink(missing_ok=True)
    cmd = [str(Path(sys.executable).parent / "deltafin-run"), "score", str(model), str(src),
           "-o", str(out), "--budget", budget, "--context", "512", "--json", "--no-progress"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, check=True)
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    return {"tokens_per_s": summary["tokens_per_second"], "scored_tokens": summary["scored_tokens"],
            "logprob": sum(x["logprob"] for x in lines), "sweeps": summary["sweeps"]}


def echo(port, prompt) -> list:
    status, reply = post(port, "/v1/completions", {"prompt": prompt, "echo": True, "logprobs": 1,
                                                   "max_tokens": 0}, timeout=1800)
    assert status == 200, reply
    return reply["choices"]


def total(choices) -> float:
    return sum(v for c in choices for v in c["logprobs"]["token_logprobs"][1:])


def by_http(port, ids, how: str) -> dict:
    start = time.perf_counter()
    if how == "one request":
        choices = echo(port, ids)
    elif how == "a request each, in turn":
        choices = [c for t in ids for c in echo(port, [t])]
    else:
        answers = [None] * len(ids)
        threads = [threading.Thread(target=lambda i=i: answers.__setitem__(i, echo(port, [ids[i]])))
                   for i in range(len(ids))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        choices = [c for a in answers for c in a]
    seconds = time.perf_counter() - start
    scored = sum(len(t) - 1 for t in ids)
    return {"tokens_per_s": scored / seconds, "scored_tokens": scored, "logprob": total(choices)}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="demo", help="a converted model, or `demo`")
    p.add_argument("--budget", default=None, help="default: the demo's own")
    p.add_argument("--texts", type=int, default=8)
    p.add_argument("--length", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", default="bench/results/score_http.json")
    args = p.parse_args(argv)
    model, budget = (common.demo_model(args.budget) if args.model == "demo"
                     else (args.model, args.budget))
    budget = str(budget)  # the demo's is in bytes
    config = json.loads((Path(model) / "config.json").read_text())
    vocab = config.get("text_config", config)["vocab_size"]
    ids = texts(args.texts, args.length, vocab)
    rows = {"score": []}
    ways = ("one request", "a request each, in turn", "a request each, at once")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for _ in range(args.repeats):  # the two processes alternate
            rows["score"].append(by_score(model, budget, ids, work))
            port = free_port()
            server = start_server(model, port, budget, work / "serve.log", server="deltafin",
                                  context=512)
            try:
                for how in ways:
                    rows.setdefault(how, []).append(by_http(port, ids, how))
            finally:
                stop_server(server)
    report = {"model": str(model), "budget": budget, "texts": args.texts, "length": args.length,
              "rows": rows}
    Path(args.out).write_text(json.dumps(report, indent=1))
    for name, runs in rows.items():
        rates = [r["tokens_per_s"] for r in runs]
        print(f"{name:26s} {sorted(rates)[len(rates) // 2]:8.1f} scored tok/s "
              f"({min(rates):.1f}-{max(rates):.1f}); summed log-prob "
              f"{runs[0]['logprob']:.4f}")


if __name__ == "__main__":
    main()
