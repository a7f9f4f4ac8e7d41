"""`deltafin-run serve` admits prompts one at a time, in the order they arrive:
of four streaming clients that send at once, the first one served gets its first
token before any pass of the others' prompts has run (mlx-lm's batch generator,
left to itself, prefills prompts that arrive together in lockstep, so every first
token waited for all four prefills), and every reply is the one the same request
gets alone. The time each costs is measured side by side in
bench/studies/serve_first_token.py (docs/PERFORMANCE.md)."""

import json
import threading
import time
import urllib.request

import pytest

from deltafin_mlx.testing.server import free_port, post, start_server, stop_server

TEXT = "/v1/completions"
CLIENTS = 4
TOKENS = 6


@pytest.fixture(scope="module")
def serve(converted, tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("serve") / "server.log"
    proc = start_server(converted("kimi_k3"), port, "40MB", log, server="deltafin",
                        context=1024)
    yield port, proc, log
    stop_server(proc)


def prompt(i: int) -> str:
    """A prompt of some 150 tokens, different for each client (no prompt-cache reuse)."""
    return f"Client {i} asks: " + " ".join(f"word{i}x{j}" for j in range(60))


def stream(port, body, go, events):
    """Send `body` streamed once `go` is set; `events` gets (monotonic time, kind,
    value) for each prefill progress comment ("progress", (done, total)) and each
    text chunk ("text", text)."""
    req = urllib.request.Request(f"http://127.0.0.1:{port}{TEXT}",
                                 json.dumps({**body, "stream": True}).encode(),
                                 {"Content-Type": "application/json"})
    go.wait()
    with urllib.request.urlopen(req, timeout=600) as r:
        for line in r:
            now = time.monotonic()
            if line.startswith(b": keepalive "):
                done, total = line.split()[-1].decode().split("/")
                events.append((now, "progress", (int(done), int(total))))
            elif line.startswith(b"data: ") and line.strip() != b"data: [DONE]":
                chunk = json.loads(line[6:])
                if chunk["choices"] and chunk["choices"][0].get("text"):
                    events.append((now, "text", chunk["choices"][0]["text"]))


def timeline(events):
    """Per client: its first prefill pass, its last, its first token (s after the first event)."""
    t0 = min(e[0][0] for e in events)
    return [(round(min(t for t, k, _ in e if k == "progress") - t0, 2),
             round(max(t for t, k, _ in e if k == "progress") - t0, 2),
             round(min(t for t, k, _ in e if k == "text") - t0, 2)) for e in events]


def test_the_first_client_is_answered_before_the_others_are_prefilled(serve):
    port, proc, _ = serve
    bodies = [{"prompt": prompt(i), "max_tokens": TOKENS, "temperature": 0.0}
              for i in range(CLIENTS)]
    go, events = threading.Event(), [[] for _ in bodies]
    threads = [threading.Thread(target=stream, args=(port, b, go, e))
               for b, e in zip(bodies, events)]
    for t in threads:
        t.start()
    go.set()
    for t in threads:
        t.join(timeout=600)
    assert proc.poll() is None

    def first_text(e):
        return min(t for t, kind, _ in e if kind == "text")

    def prefill_began(e):  # the moment its first prefill pass was done
        return min(t for t, kind, _ in e if kind == "progress")

    first = min(range(CLIENTS), key=lambda i: first_text(events[i]))
    others = [i for i in range(CLIENTS) if i != first]
    # In lockstep every prompt is in before any first token. Admitted in order, the
    # first client's first token is out before the next prompt's first pass has run
    # (mlx-lm would run that pass in the same call as the decode step, before
    # handing out its token).
    assert all(first_text(events[first]) < prefill_began(events[i]) for i in others), \
        timeline(events)

    # Each reply is the one the same request gets alone.
    together = ["".join(v for _, kind, v in e if kind == "text") for e in events]
    for body, reply in zip(bodies, together):
        status, alone = post(port, TEXT, body)
        assert status == 200
        assert alone["choices"][0]["text"] == reply
