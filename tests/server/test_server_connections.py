"""`deltafin-run serve` against what clients do with connections, on loopback:
descriptors past 1024 work (every descriptor below 1024 is taken in the server
before it starts), connections beyond --max-connections get 503 at once and the
thread count stays bounded, an idle connection is closed after --header-timeout,
a client that resets before its answer is written leaves no traceback in the log,
and Ctrl-C with a request in flight exits 0. One server serves the module."""

import json
import os
import resource
import signal
import socket
import struct
import sys
import time

import pytest

from deltafin_mlx.testing.server import free_port, get, post, start_server, stop_server

CONTEXT = 512
MAX_CONNECTIONS = 8
HEADER_TIMEOUT = 4
FD_SETSIZE = 1024  # what select() takes
# Takes every descriptor below FD_SETSIZE (inherited across exec), then execs the server.
TAKE_LOW_FDS = ("import os, sys\n"
                "while True:\n"
                "    fd = os.open(os.devnull, os.O_RDONLY)\n"
                "    os.set_inheritable(fd, True)\n"
                f"    if fd >= {FD_SETSIZE - 1}:\n"
                "        break\n"
                "os.execv(sys.argv[1], sys.argv[1:])\n")
CHAT = {"messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 3,
        "temperature": 0.0}


@pytest.fixture(scope="module")
def serve(converted, tmp_path_factory):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = FD_SETSIZE + 512
    if soft < need:
        if hard != resource.RLIM_INFINITY and hard < need:
            pytest.skip(f"the descriptor limit is {hard}, under {need}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))  # the server inherits it
    port = free_port()
    log = tmp_path_factory.mktemp("serve") / "server.log"
    try:
        proc = start_server(converted("kimi_k3"), port, "40MB", log, server="deltafin",
                            context=CONTEXT, prefix=(sys.executable, "-c", TAKE_LOW_FDS),
                            extra=("--max-connections", str(MAX_CONNECTIONS),
                                   "--header-timeout", str(HEADER_TIMEOUT)))
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    yield port, proc, log
    stop_server(proc)


def open_fds(pid) -> set:
    return {int(n) for n in os.listdir(f"/proc/{pid}/fd")}


def threads(pid) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("Threads:"):
            return int(line.split()[1])
    raise AssertionError("no Threads line")


def idle_connections(port, n):
    """`n` connections that send nothing, each accepted by the server."""
    conns = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(n)]
    time.sleep(0.3)  # the accepting thread takes them
    return conns


def read_all(sock) -> bytes:
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def answered(sock) -> bytes:
    """What the server has sent on `sock` so far (no wait)."""
    sock.setblocking(False)
    try:
        return sock.recv(65536)
    except BlockingIOError:
        return b""


def metric(port, name) -> float:
    status, body = get(port, "/metrics")
    assert status == 200, body
    return metric_in(body, name)


def metric_in(body: bytes, name) -> float:
    for line in body.decode().splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def settle(port) -> int:
    """Wait until the only connection open is the one asking; how many of its asks
    were refused (503: the server had not yet seen enough closes to free a place)."""
    refused, deadline = 0, time.monotonic() + 60
    while time.monotonic() < deadline:
        status, body = get(port, "/metrics")
        if status == 503:
            refused += 1
        elif metric_in(body, "deltafin_connections_open") <= 1:
            return refused
        time.sleep(0.1)
    raise AssertionError("connections were still open after 60 s")


def test_completions_are_answered_on_descriptors_past_1024(serve):
    """select() refuses a descriptor >= 1024; the client watch must not take
    that for a reset."""
    port, proc, _ = serve
    assert set(range(FD_SETSIZE)) <= open_fds(proc.pid)  # every connection lands above
    conn = idle_connections(port, 1)[0]
    try:
        assert max(open_fds(proc.pid)) >= FD_SETSIZE
        status, reply = post(port, "/v1/chat/completions", CHAT)
        assert status == 200 and reply["usage"]["completion_tokens"] == 3, reply
        status, reply = post(port, "/v1/completions", {"prompt": "Hello", "max_tokens": 3})
        assert status == 200, reply
    finally:
        conn.close()


def test_a_reset_is_still_seen_on_descriptors_past_1024(serve):
    port = serve[0]
    gone = 'deltafin_requests_total{outcome="gone"}'
    before = metric(port, gone)
    body = json.dumps({**CHAT, "max_tokens": 200, "stream": True}).encode()
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: "
              + str(len(body)).encode() + b"\r\n\r\n" + body)
    s.recv(1)  # generation has started
    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    s.close()
    deadline = time.time() + 30
    while metric(port, gone) == before and time.time() < deadline:
        time.sleep(0.2)
    assert metric(port, gone) == before + 1


def test_connections_beyond_the_cap_get_503_at_once_and_threads_stay_bounded(serve):
    port, proc, _ = serve
    settle(port)  # earlier tests' connections have closed
    base, refused = threads(proc.pid), metric(port, "deltafin_connections_refused_total")
    fds = len(open_fds(proc.pid))
    idle = idle_connections(port, MAX_CONNECTIONS + 4)  # 4 beyond the cap: refused
    try:
        assert threads(proc.pid) <= base + MAX_CONNECTIONS
        # At once: a connection queued behind the idle ones would wait until they
        # close (in `finally`), so the socket's timeout would end the read first.
        s = socket.create_connection(("127.0.0.1", port), timeout=30)
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        reply = read_all(s)
        s.close()
        assert reply.startswith(b"HTTP/1.1 503"), reply
        assert json.loads(reply.split(b"\r\n\r\n", 1)[1])["error"]["code"] == 503
        assert sum(answered(c).startswith(b"HTTP/1.1 503") for c in idle) == 4
    finally:
        for c in idle:
            c.close()
    # The server sees the closes as its threads get to them: waited for, not slept on.
    # A poll that lands before enough of them is refused too, and counted.
    polls_refused = settle(port)
    assert get(port, "/health")[0] == 200
    assert post(port, "/v1/chat/completions", CHAT)[0] == 200
    assert metric(port, "deltafin_connections_refused_total") == refused + 5 + polls_refused
    assert settle(port) == 0  # each closed connection is seen closed: only the poll's is open
    assert len(open_fds(proc.pid)) <= fds + 1  # every closed connection's socket is closed


def test_a_connection_silent_before_its_headers_is_closed_after_the_header_timeout(serve):
    port = serve[0]
    s = socket.create_connection(("127.0.0.1", port), timeout=HEADER_TIMEOUT + 20)
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")  # headers unfinished
    started = time.monotonic()
    assert read_all(s) == b""
    assert HEADER_TIMEOUT - 0.5 < time.monotonic() - started < HEADER_TIMEOUT + 10
    s.close()


def test_a_client_that_trickles_its_headers_is_closed_after_the_header_timeout(serve):
    """A byte a second keeps each read short; the timeout bounds them in all."""
    port = serve[0]
    s = socket.create_connection(("127.0.0.1", port), timeout=HEADER_TIMEOUT + 20)
    started = time.monotonic()
    try:
        for byte in b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"y" * 40:
            s.send(bytes([byte]))
            time.sleep(0.5)
    except OSError:  # closed under it: a reset on the next byte
        pass
    else:
        raise AssertionError("20 s of trickled headers were taken")
    assert time.monotonic() - started < HEADER_TIMEOUT + 10
    s.close()


def test_a_client_that_resets_before_its_refusal_leaves_no_traceback(serve):
    """A POST with no Content-Length, reset at once: its 411 cannot be written."""
    port, _, log = serve
    for _ in range(6):
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n\r\n")
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        s.close()
    time.sleep(0.5)
    assert get(port, "/health")[0] == 200
    assert post(port, "/v1/chat/completions", CHAT)[0] == 200
    text = log.read_text()
    assert "Traceback" not in text and "Exception occurred" not in text, text[-3000:]


def test_ctrl_c_with_a_request_in_flight_exits_cleanly(serve):
    """Last (it stops the module's server): SIGINT while a reply streams ends the
    server with status 0 and its last log line, not SIGABRT from a thread's C++
    destructor racing the interpreter's finalization (3 in 28 tries before)."""
    port, proc, log = serve
    body = json.dumps({"prompt": "hi", "max_tokens": 3000, "stream": True}).encode()
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: "
              + str(len(body)).encode() + b"\r\n\r\n" + body)
    s.recv(1)  # generation has started
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=30) == 0
    s.close()
    text = log.read_text()
    assert "stopping" in text and "terminate called" not in text, text[-2000:]


def _tcp_pair():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    client = socket.create_connection(listener.getsockname())
    server, _ = listener.accept()
    listener.close()
    return server, client


def test_a_client_that_resets_stops_its_generation_one_that_half_closes_does_not():
    import struct

    from deltafin_mlx.server.handler import ClientGone, _Watched

    class Ctx:
        stopped = False

        def stop(self):
            self.stopped = True

    class Inner:
        def generate(self, request, args, progress):
            return ctx, iter(range(100))

    class Handler:
        def __init__(self, sock):
            self.connection = sock

    ctx = Ctx()
    server, client = _tcp_pair()
    _, responses = _Watched(Inner(), Handler(server), None).generate(None, None)
    assert next(responses) == 0
    client.shutdown(socket.SHUT_WR)  # sent its request, still reading
    assert next(responses) == 1 and not ctx.stopped
    client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    client.close()  # a reset
    time.sleep(0.2)
    with pytest.raises(ClientGone):
        next(responses)
    assert ctx.stopped
    server.close()
