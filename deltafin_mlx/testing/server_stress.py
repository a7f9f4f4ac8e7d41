"""Concurrent clients against a server, for a bounded time: every reply must equal
the one learned for its prompt, or be a clean HTTP error (for hostile requests,
the expected one); the server must stay up and its peak memory within the budget
plus a margin. bench.studies.stress_server is its command line;
tests/server/test_server_load.py runs it for a few seconds. Every loop is bounded in
count and time.
"""

import json
import random
import socket
import statistics
import threading
import time
import urllib.error
from pathlib import Path

from deltafin_mlx.testing.peak import baseline_rss, peak_rss
from deltafin_mlx.testing.server import chat, free_port, get, start_server, stop_server

PROMPTS = [
    "Hello there",
    "Tell me about streaming experts from disk.",
    "What is two plus two?",
    "Write one line of a poem about memory.",
]


def _body(prompt, max_tokens, **extra):
    return {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0.0, **extra}


def raw_post(port, raw: bytes, headers: dict, timeout=60, path="/v1/chat/completions"):
    """POST bytes exactly as given (any Content-Length); returns (status, body)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\n{head}\r\n".encode() + raw)
        data = b""
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
    status = int(data.split(b" ", 2)[1]) if data.startswith(b"HTTP/") else 0
    return status, data.split(b"\r\n\r\n", 1)[-1]


def disconnect(port, prompt, max_tokens, after_s):
    """Send a request and close the socket without reading the reply."""
    body = json.dumps(_body(prompt, max_tokens, stream=False)).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                  b"Content-Type: application/json\r\nContent-Length: "
                  + str(len(body)).encode() + b"\r\n\r\n" + body)
        time.sleep(after_s)


def hostile(port, rng, vocab, context, max_tokens):
    """One hostile request; returns its outcome: 'refused-ok' when the server gave
    the expected error, else what went wrong."""
    kind = rng.choice(["bias_oov", "bias_negative", "long_prompt", "malformed", "nested",
                       "not_object", "bad_length", "oversized", "disconnect", "nan",
                       "long_but_fits", "text_beyond", *VALUES])
    if kind == "text_beyond":  # within the body bound, more text than the context holds
        raw = json.dumps(_body("x" * (context * 100), max_tokens)).encode()
        status, _ = raw_post(port, raw, {"Content-Type": "application/json",
                                         "Content-Length": str(len(raw))})
        return "refused-ok" if status in (400, 413) else f"{kind} got {status}"
    if kind == "long_but_fits":  # most of the context: answered, within memory
        try:
            chat(port, "stream " * (context // 2 - 300), max_tokens, stream=False)
            return "long-ok"
        except urllib.error.HTTPError as e:
            return f"{kind} got {e.code}"
    expect = {"oversized": 413}.get(kind, 400)
    if kind == "disconnect":
        disconnect(port, rng.choice(PROMPTS), max_tokens, rng.choice([0.0, 0.05, 0.3]))
        return "disconnect"
    if kind in ("bias_oov", "bias_negative"):
        bad = vocab + rng.randrange(10 ** 6) if kind == "bias_oov" else -1 - rng.randrange(100)
        raw = json.dumps(_body("Hello there", max_tokens, logit_bias={str(bad): 5.0})).encode()
    elif kind == "long_prompt":
        raw = json.dumps(_body("stream " * (context + 64), max_tokens)).encode()
    elif kind == "malformed":
        raw = b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": '
    elif kind == "nested":
        raw = b"[" * 20_000 + b"]" * 20_000  # deeper than any parser recursion, within the body bound
    elif kind == "not_object":
        raw = b'[1, 2, 3]'
    elif kind in VALUES:
        path, body = VALUES[kind]
        raw = body if isinstance(body, bytes) else json.dumps(
            {**_body("Hello there", max_tokens), **body}).encode()
        status, _ = raw_post(port, raw, {"Content-Type": "application/json",
                                         "Content-Length": str(len(raw))}, path=path)
        return "refused-ok" if status == 400 else f"{kind} got {status}"
    elif kind == "nan":
        raw = json.dumps(_body("Hello there", max_tokens, temperature=float("nan"))).encode()
    elif kind == "oversized":
        status, _ = raw_post(port, b"", {"Content-Length": str(1 << 40)})
        return "refused-ok" if status == expect else f"{kind} got {status}"
    if kind == "bad_length":
        status, _ = raw_post(port, raw := b"{}", {"Content-Length": "-5"})
    else:
        status, _ = raw_post(port, raw, {"Content-Type": "application/json",
                                         "Content-Length": str(len(raw))})
    return "refused-ok" if status == expect else f"{kind} got {status}"


# Values that once reached mlx-lm's generation thread (and stopped it for every
# client), or fetched a URL: each must be a 400 now.
VALUES = {
    "stop_int": ("/v1/chat/completions", {"stop": [1]}),
    "stop_nested": ("/v1/chat/completions", {"stop": [[1, 2]]}),
    "top_k_huge": ("/v1/chat/completions", {"top_k": 100000, "temperature": 0.7}),
    "empty_prompt": ("/v1/completions", {"prompt": "", "messages": None}),
    "image_url": ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://127.0.0.1:9/x.png"}}]}]}),
    "seed_huge": ("/v1/chat/completions", {"seed": 2 ** 70}),
    "bias_list": ("/v1/chat/completions", {"logit_bias": {"5": [1]}}),
    "stream_options": ("/v1/chat/completions", {"stream_options": "x"}),
    "utf16": ("/v1/chat/completions", json.dumps({"messages": [
        {"role": "user", "content": "hi"}]}).encode("utf-16")),
}


def percentile(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def run(model, clients=8, seconds=60.0, budget="200MB", max_tokens=12, max_requests=10_000,
        seed=0, server="mlx_lm", hostile_fraction=0.0, context=4096, extra=(), samples=None,
        launcher=None):
    """`launcher`: how `deltafin-run serve` starts (deltafin_mlx.testing.server's
    start_server); `samples`: the file where that server writes its memory samples, if
    it does; the report's `peak_sample` is the one at the highest VmRSS."""
    import tempfile

    port = free_port()
    log_path = Path(tempfile.mkdtemp(prefix="deltafin-stress-")) / "server.log"
    proc = start_server(model, port, budget, log_path, server, context, extra=extra,
                        launcher=launcher)
    vocab = json.loads((Path(model) / "config.json").read_text()).get("vocab_size", 1 << 17)
    try:
        expected = {p: chat(port, p, max_tokens, stream=False) for p in PROMPTS}
        results, errors, lock = [], [], threading.Lock()
        stop_at = time.time() + seconds

        def client(i):
            rng = random.Random(seed + i)
            while time.time() < stop_at:
                with lock:
                    if len(results) >= max_requests:
                        return
                prompt = rng.choice(PROMPTS)
                stream = rng.random() < 0.5
                start = time.perf_counter()
                try:
                    if rng.random() < hostile_fraction:
                        outcome = hostile(port, rng, vocab, context, max_tokens)
                        with lock:
                            results.append((outcome, time.perf_counter() - start, False))
                        continue
                    text = chat(port, prompt, max_tokens, stream)
                    outcome = "ok" if text == expected[prompt] else "wrong"
                except urllib.error.HTTPError as e:
                    outcome = f"refused {e.code}"
                except (OSError, ValueError) as e:
                    outcome = f"error {type(e).__name__}"
                    with lock:
                        errors.append(f"{time.time() - stop_at + seconds:.1f}s: {e!r}")
                with lock:
                    results.append((outcome, time.perf_counter() - start, stream))

        threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=seconds + 180)
        alive = proc.poll() is None
        # Still serving, and correctly, after everything it was sent.
        after = {p: chat(port, p, max_tokens, stream=False) for p in PROMPTS} if alive else {}
        alive = alive and after == expected and get(port, "/health")[0] == 200
        rss = peak_rss(proc.pid)
    finally:
        stop_server(proc)
        log_tail = log_path.read_text()[-3000:]
    lat = [d for o, d, _ in results if o == "ok"]
    hostile_n = sum(1 for o, _, _ in results if o in ("refused-ok", "long-ok", "disconnect")
                    or " got " in o)
    outcomes = {}
    for o, _, _ in results:
        outcomes[o] = outcomes.get(o, 0) + 1
    return {
        "clients": clients,
        "seconds": seconds,
        "budget": budget,
        "server": server,
        "context": context,
        "requests": len(results),
        "hostile_requests": hostile_n,
        "outcomes": outcomes,
        "streaming_requests": sum(1 for *_, s in results if s),
        "server_alive": alive,
        "server_peak_rss_bytes": rss,
        "baseline_rss_bytes": baseline_rss(),
        "latency_p50_s": percentile(lat, 0.5),
        "latency_p90_s": percentile(lat, 0.9),
        "latency_p99_s": percentile(lat, 0.99),
        "latency_mean_s": statistics.mean(lat) if lat else float("nan"),
        "errors": errors[:10],
        "server_log_tail": log_tail,
        "peak_sample": peak_sample(samples) if samples else None,
    }


def peak_sample(path):
    """The memory sample (bench/lib/worker/sampled_serve.py) of highest VmRSS."""
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    return max(rows, key=lambda r: r["VmRSS"]) if rows else None


def healthy(r, margin=64 << 20) -> bool:
    """Alive, every request answered correctly or refused cleanly, and memory within
    the budget plus a margin: what the baseline process does not show (library code
    paged in as it runs) and, for plain mlx_lm.server, what glibc and MLX keep of
    what they freed (`deltafin-run serve` bounds both)."""
    from deltafin_mlx.units import parse_size

    answered = all(k in ("ok", "refused-ok", "long-ok", "disconnect") or k.startswith("refused ")
                   for k in r["outcomes"])
    used = r["server_peak_rss_bytes"] - r["baseline_rss_bytes"]
    return r["server_alive"] and answered and used <= parse_size(r["budget"]) + margin
