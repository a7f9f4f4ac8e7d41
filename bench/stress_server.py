"""mlx_lm.server serving a Deltafin model under concurrent clients, for a bounded time.

    python bench/stress_server.py MODEL [--clients 8] [--seconds 60] [--budget 200MB]
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
none), while every ordinary request still gets its exact reply.
"""

import argparse
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

PROMPTS = [
    "Hello there",
    "Tell me about streaming experts from disk.",
    "What is two plus two?",
    "Write one line of a poem about memory.",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_server(proc):
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()


def start_server(model, port, budget, log_path, server="mlx_lm", context=4096, extra=()):
    """The server logs every request: to a file (a pipe nobody drains would fill
    up and block the server)."""
    bin_dir = Path(sys.executable).parent
    env = {**os.environ, "DELTAFIN_BUDGET": budget}
    log = open(log_path, "w")
    if server == "deltafin":
        cmd = [str(bin_dir / "deltafin-run"), "serve", str(model), "--budget", budget,
               "--context", str(context), "--host", "127.0.0.1", "--port", str(port)]
    else:
        cmd = [str(bin_dir / "mlx_lm.server"), "--model", str(model), "--trust-remote-code",
               "--host", "127.0.0.1", "--port", str(port)]
    proc = subprocess.Popen([*cmd, *extra], stdout=log, stderr=subprocess.STDOUT, env=env)
    deadline = time.time() + 180
    while time.time() < deadline:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2).read()
            return proc
        except OSError:
            if proc.poll() is not None:
                raise RuntimeError("server exited: " + Path(log_path).read_text()[-2000:])
            time.sleep(0.3)
    proc.kill()
    raise RuntimeError("server did not come up in 180 s")


def chat(port, prompt, max_tokens, stream, timeout=120):
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0.0, "stream": stream}
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions",
                                 json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        raw = r.read().decode()
    if not stream:
        msg = json.loads(raw)["choices"][0]["message"]
        return (msg.get("reasoning") or msg.get("reasoning_content") or "") + (msg.get("content") or "")
    text = ""
    for line in raw.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            delta = json.loads(line[6:])["choices"][0].get("delta", {})
            text += (delta.get("reasoning") or delta.get("reasoning_content") or "") + (
                delta.get("content") or "")
    return text


def _body(prompt, max_tokens, **extra):
    return {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0.0, **extra}


def raw_post(port, raw: bytes, headers: dict, timeout=60):
    """POST bytes exactly as given (any Content-Length); returns (status, body)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        s.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n{head}\r\n".encode() + raw)
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
                       "long_but_fits"])
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
        raw = b"[" * 200_000 + b"]" * 200_000
    elif kind == "not_object":
        raw = b'[1, 2, 3]'
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


def peak_rss(pid) -> int:
    try:
        for line in open(f"/proc/{pid}/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def baseline_rss() -> int:
    """Peak memory of a process that has imported what the server imports, with no
    model: subtracted from the server's peak to compare with the budget."""
    code = ("import mlx.core as mx, mlx_lm.server, deltafin_mlx.engine.load\n"
            "mx.eval(mx.zeros(8) + 1)\n"
            "print([l for l in open('/proc/self/status') if l.startswith('VmHWM')][0].split()[1])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    return int(out.stdout.strip()) * 1024 if out.returncode == 0 else 0


def percentile(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def run(model, clients=8, seconds=60.0, budget="200MB", max_tokens=12, max_requests=10_000,
        seed=0, server="mlx_lm", hostile_fraction=0.0, context=4096):
    import tempfile

    port = free_port()
    log_path = Path(tempfile.mkdtemp(prefix="deltafin-stress-")) / "server.log"
    proc = start_server(model, port, budget, log_path, server, context)
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
        alive = alive and after == expected
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
    }


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
    a = p.parse_args()
    r = run(a.model, a.clients, a.seconds, a.budget, a.max_tokens, server=a.server,
            hostile_fraction=a.hostile, context=a.context)
    print(json.dumps(r, indent=1))
    if a.json:
        Path(a.json).write_text(json.dumps(r, indent=1))
    return 0 if healthy(r) else 1


def healthy(r, margin=64 << 20) -> bool:
    """Alive, every request answered correctly or refused cleanly, and memory within
    the budget plus a margin (MLX's allocator keeps freed buffers for reuse)."""
    from deltafin_mlx.units import parse_size

    answered = all(k in ("ok", "refused-ok", "long-ok", "disconnect") or k.startswith("refused ")
                   for k in r["outcomes"])
    used = r["server_peak_rss_bytes"] - r["baseline_rss_bytes"]
    return r["server_alive"] and answered and used <= parse_size(r["budget"]) + margin


if __name__ == "__main__":
    sys.exit(main())
