"""A server on a free loopback port and its clients, for the tests and the benchmarks:
start and stop `deltafin-run serve` or `mlx_lm.server` (the drop-in), send chat,
JSON and GET requests, and the reply `deltafin-run` gives for a prompt (what a
server's must equal). Only loopback addresses are used."""

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path


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


def start_server(model, port, budget, log_path, server="mlx_lm", context=4096, extra=(),
                 env=None, prefix=(), launcher=None):
    """`deltafin-run serve` (server="deltafin") or `mlx_lm.server` through the drop-in,
    on loopback, returned once it answers. The server logs every request: to a file (a
    pipe nobody drains would fill up and block the server). `env`: more environment
    (DELTAFIN_CONTEXT, ...). `prefix`: a command that execs the server's command line.
    `launcher(serve_args) -> (command, env)`: runs `deltafin-run serve`'s arguments
    some other way (bench's memory-sampling server)."""
    bin_dir = Path(sys.executable).parent
    env = {**os.environ, "DELTAFIN_BUDGET": budget, **(env or {})}
    log = open(log_path, "w")
    if server == "deltafin":
        serve = ["serve", str(model), "--budget", budget, "--context", str(context),
                 "--host", "127.0.0.1", "--port", str(port)]
        cmd = [str(bin_dir / "deltafin-run"), *serve]
        if launcher is not None:
            cmd, more = launcher(serve)
            env.update(more)
    else:
        cmd = [str(bin_dir / "mlx_lm.server"), "--model", str(model), "--trust-remote-code",
               "--host", "127.0.0.1", "--port", str(port)]
    proc = subprocess.Popen([*prefix, *cmd, *extra], stdout=log, stderr=subprocess.STDOUT, env=env)
    deadline = time.time() + 300  # a loaded machine loads slowly
    while time.time() < deadline:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2).read()
            return proc
        except OSError:
            if proc.poll() is not None:
                raise RuntimeError("server exited: " + Path(log_path).read_text()[-2000:])
            time.sleep(0.3)
    proc.kill()
    raise RuntimeError("server did not come up in 300 s")


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


def post(port, path, body, raw=None, timeout=60):
    """POST a JSON body (or `raw` bytes) on loopback: (status, parsed JSON reply)."""
    import urllib.error

    data = raw if raw is not None else json.dumps(body).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data,
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def get(port, path, timeout=30):
    """GET on loopback: (status, body bytes)."""
    import urllib.error

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def expected_reply(model, prompt, n) -> str:
    """What `deltafin-run MODEL PROMPT -n N` answers (greedy), its thinking then its
    answer: a server's reply to the same chat prompt (reasoning then content) must
    equal it."""
    out = subprocess.run([str(Path(sys.executable).parent / "deltafin-run"), str(model), prompt,
                          "-n", str(n), "--json"], capture_output=True, text=True, timeout=120)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-2000:])
    reply = json.loads(out.stdout)
    return (reply.get("thinking") or "") + reply["text"]
