"""Plain `mlx_lm.server --trust-remote-code` on a Deltafin model, hit by a hostile
request the instant it listens: /health answers as soon as the port is open, before
mlx-lm has imported the drop-in (and so before Deltafin's checks exist), so such a
request passes mlx-lm's own validation. The drop-in checks every request again as
mlx-lm's generation thread takes it (that thread loads the model, and so imports
the drop-in, before it takes any request): an out-of-vocabulary logit_bias id is
refused with its reason instead of indexing past the logits (a segfault), and so
are values that would stop that thread; the server goes on answering. Fresh
servers, each hit as early as a client can."""

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from deltafin_mlx.testing.server import free_port, get, post, stop_server

HOSTILE = {"messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 4,
           "temperature": 0.0, "logit_bias": {"100000000": 5}}
TRIES = 3


def request(port, path, body=None, timeout=300):
    """(status, body bytes) of a request on a fresh connection, or (0, b"") when
    the connection is refused or reset (not listening yet, or the server died)."""
    data = json.dumps(body).encode() if body is not None else b""
    head = (f"{'POST' if body is not None else 'GET'} {path} HTTP/1.1\r\nHost: x\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n"
            "Connection: close\r\n\r\n").encode()
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
            s.sendall(head + data)
            reply = b""
            while chunk := s.recv(65536):
                reply += chunk
    except OSError:
        return 0, b""
    if not reply.startswith(b"HTTP/"):
        return 0, reply
    return int(reply.split(b" ", 2)[1]), reply.split(b"\r\n\r\n", 1)[-1]


def first_moment_request(model, log_path, body=HOSTILE):
    """Start mlx_lm.server, poll /health as fast as a client can, and send the
    hostile request the moment it answers 200; returns (status, body, process)."""
    port = free_port()
    env = {**os.environ, "DELTAFIN_BUDGET": "40MB", "DELTAFIN_CONTEXT": "512"}
    log = open(log_path, "w")
    proc = subprocess.Popen([str(Path(sys.executable).parent / "mlx_lm.server"), "--model",
                             str(model), "--trust-remote-code", "--host", "127.0.0.1",
                             "--port", str(port)], stdout=log, stderr=subprocess.STDOUT,
                            env=env)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and proc.poll() is None:
        if request(port, "/health", timeout=5)[0] == 200:
            break
        time.sleep(0.002)
    else:
        stop_server(proc)
        raise AssertionError("mlx_lm.server did not answer /health: "
                             + Path(log_path).read_text()[-2000:])
    status, reply = request(port, "/v1/chat/completions", body)
    return port, status, reply, proc


def test_a_hostile_first_request_is_refused_and_the_server_goes_on(converted, tmp_path):
    model = converted("kimi_k3")
    for i in range(TRIES):
        log_path = tmp_path / f"server{i}.log"
        port, status, body, proc = first_moment_request(model, log_path)
        try:
            time.sleep(0.5)  # a crash in the generation thread shows by now
            log = log_path.read_text()
            assert proc.poll() is None, f"try {i}: the server died ({proc.returncode}): " \
                                        + log[-2000:]
            # Refused with the reason: 400 from the handler's check, or mlx-lm's 404
            # for a request its generation thread refused (it arrived before the
            # handler's check was installed).
            assert status in (400, 404), (i, status, body, log[-2000:])
            assert "outside the vocabulary" in body.decode(), (i, status, body)
            assert get(port, "/health")[0] == 200
            ok, reply = post(port, "/v1/chat/completions",
                             {**HOSTILE, "logit_bias": {"5": 1.0}}, timeout=300)
            assert ok == 200 and reply["usage"]["completion_tokens"] >= 1, reply
        finally:
            stop_server(proc)


@pytest.mark.parametrize("values,says", [({"stop": [1]}, "stop[0]"),
                                         ({"seed": 2 ** 70}, "seed")])
def test_a_first_request_that_would_stop_generation_is_refused(converted, tmp_path, values,
                                                               says):
    port, status, body, proc = first_moment_request(converted("kimi_k3"),
                                                    tmp_path / "server.log",
                                                    {**HOSTILE, "logit_bias": None, **values})
    try:
        assert status in (400, 404) and says in body.decode(), (status, body)
        assert get(port, "/health")[0] == 200  # the generation thread lives
        ok, reply = post(port, "/v1/chat/completions", {**HOSTILE, "logit_bias": None},
                         timeout=300)
        assert ok == 200 and reply["usage"]["completion_tokens"] >= 1, reply
    finally:
        stop_server(proc)
