"""`deltafin-run serve` against clients that stall their bodies, on loopback: a body
is read and checked before its request takes a generation place, at a byte-rate
floor, so

- 70 connections each sending 1 byte of a 1,000-byte body (and sending it again
  whenever the server closes one) leave ordinary requests answered exactly, in
  their normal time: the same requests timed without the stalls, in the same test,
  are the measure (a generous ratio, no absolute bound);
- a stalled body is closed with a 408 naming the floor;
- a body that is not JSON is refused at once, while a generation holds the only
  place (it does not wait in the generation queue).

Every loop is bounded in count and time. One server (one sequence) serves the module."""

import json
import socket
import statistics
import threading
import time

import pytest

from deltafin_mlx.testing.server import chat, free_port, get, post, start_server, stop_server

CONTEXT = 512
STALLED = 70
DECLARED = 1000  # the body length each stalled connection announces
CLIENTS = 4
ROUNDS = 5  # requests per client and phase
MAX_TOKENS = 8
RATIO = 5  # loaded median / unloaded median, at most (plus a second for noise)
PROMPTS = ["Hello there", "What is two plus two?", "Write one line of a poem about memory.",
           "Tell me about streaming experts from disk."]


@pytest.fixture(scope="module")
def serve(converted, tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("serve") / "server.log"
    proc = start_server(converted("kimi_k3"), port, "40MB", log, server="deltafin",
                        context=CONTEXT, extra=("--sequences", "1"))
    yield port, proc, log
    stop_server(proc)


def metric(port, name) -> float:
    for line in get(port, "/metrics")[1].decode().splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def stalled_head(port) -> bytes:
    return (f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
            f"\r\nContent-Length: {DECLARED}\r\n\r\n{{").encode()  # 1 byte of the body


def read_reply(sock, deadline) -> bytes:
    data = b""
    while time.monotonic() < deadline:
        try:
            chunk = sock.recv(65536)
        except socket.timeout:
            continue
        except OSError:
            break
        if not chunk:
            break
        data += chunk
    return data


class Stalls:
    """`n` connections that each send headers and 1 byte of a 1,000-byte body, then
    nothing; one the server closes is opened again, until `stop()` (at most
    `reopen` times per connection, and never past `seconds`)."""

    def __init__(self, port, n, seconds=300, reopen=100):
        self.port, self.open, self.answers = port, 0, []
        self._lock, self._stop = threading.Lock(), threading.Event()
        self._until = time.monotonic() + seconds
        self._threads = [threading.Thread(target=self._slot, args=(reopen,), daemon=True)
                         for _ in range(n)]

    def __enter__(self):
        for t in self._threads:
            t.start()
        return self

    def _slot(self, reopen):
        for _ in range(reopen):
            if self._stop.is_set() or time.monotonic() > self._until:
                return
            try:
                s = socket.create_connection(("127.0.0.1", self.port), timeout=10)
                s.sendall(stalled_head(self.port))
            except OSError:
                time.sleep(0.1)
                continue
            with self._lock:
                self.open += 1
            s.settimeout(0.2)
            data = b""
            while not self._stop.is_set() and time.monotonic() < self._until:
                try:
                    chunk = s.recv(65536)
                except socket.timeout:
                    continue
                except OSError:
                    break
                if not chunk:
                    break
                data += chunk
            s.close()
            with self._lock:
                self.open -= 1
                if data:
                    self.answers.append(data)

    def __exit__(self, *exc):
        self._stop.set()
        for t in self._threads:
            t.join(timeout=30)


def timed_requests(port, expected):
    """CLIENTS clients, ROUNDS requests each: [(seconds, exact)]."""
    results, lock = [], threading.Lock()

    def client(i):
        for r in range(ROUNDS):
            prompt = PROMPTS[(i + r) % len(PROMPTS)]
            started = time.perf_counter()
            try:
                exact = chat(port, prompt, MAX_TOKENS, stream=r % 2 == 1) == expected[prompt]
            except OSError:  # urllib's HTTPError (a 503) included
                exact = False
            with lock:
                results.append((time.perf_counter() - started, exact))

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(CLIENTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    return results


def test_ordinary_requests_keep_their_time_beside_70_stalled_bodies(serve, capsys):
    port, proc, _ = serve
    expected = {p: chat(port, p, MAX_TOKENS, stream=False) for p in PROMPTS}
    base = timed_requests(port, expected)
    with Stalls(port, STALLED) as stalls:
        deadline = time.monotonic() + 60
        while metric(port, "deltafin_connections_open") < STALLED and \
                time.monotonic() < deadline:
            time.sleep(0.1)
        held = metric(port, "deltafin_connections_open")
        loaded = timed_requests(port, expected)
    quiet, busy = (statistics.median(d for d, _ in rs) for rs in (base, loaded))
    with capsys.disabled():
        print(f"\n[stalled bodies] {len(base)} requests alone: median {quiet:.3f} s, max "
              f"{max(d for d, _ in base):.3f} s; beside {STALLED} stalled bodies "
              f"({held:.0f} connections open): median {busy:.3f} s, max "
              f"{max(d for d, _ in loaded):.3f} s; {len(stalls.answers)} stalls closed")
    assert held >= STALLED  # the stalls were all in place while the requests ran
    assert all(exact for _, exact in base)
    assert all(exact for _, exact in loaded), loaded  # none refused, every reply exact
    assert busy <= RATIO * quiet + 1.0, (quiet, busy)
    assert proc.poll() is None and get(port, "/health")[0] == 200


def test_a_stalled_body_is_closed_with_a_408_naming_the_floor(serve):
    port = serve[0]
    s = socket.create_connection(("127.0.0.1", port), timeout=1)
    s.sendall(stalled_head(port))
    reply = read_reply(s, time.monotonic() + 120)
    s.close()
    assert b" 408 " in reply.split(b"\r\n", 1)[0], reply[:200]
    message = json.loads(reply.split(b"\r\n\r\n", 1)[1])["error"]["message"]
    assert "KiB/s" in message and f"1 of {DECLARED} bytes" in message, message


def test_a_body_that_is_not_json_is_refused_while_a_generation_holds_the_only_place(serve):
    port = serve[0]
    body = json.dumps({"prompt": "Hello", "max_tokens": CONTEXT - 16, "temperature": 0,
                       "stream": True}).encode()
    s = socket.create_connection(("127.0.0.1", port), timeout=120)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    first = s.recv(65536)  # its headers: the generation has its place
    assert b" 200 " in first.split(b"\r\n", 1)[0], first[:200]
    events = []  # (when it arrived, chunk) as a client reads the stream

    def read_stream():
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            chunk = s.recv(65536)
            if not chunk:
                return
            events.append((time.monotonic(), chunk))

    reader = threading.Thread(target=read_stream, daemon=True)
    reader.start()
    status, reply = post(port, "/v1/chat/completions", None, raw=b'{"messages": [')
    refused = time.monotonic()
    reader.join(timeout=300)
    s.close()
    assert status == 400 and "not valid JSON" in reply["error"]["message"], reply
    assert b"data: [DONE]" in first + b"".join(c for _, c in events)
    # Answered while the generation was still going: most of its tokens came after.
    after = b"".join(c for t, c in events if t > refused).count(b"data: ")
    total = (first + b"".join(c for _, c in events)).count(b"data: ")
    assert after > total // 2, (after, total)
