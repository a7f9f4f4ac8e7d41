"""What `deltafin-run serve` answers besides hostile requests, on loopback with
the `openai` client's request shapes: /v1/models as a list (and one model by
id), /tokenize and /detokenize, /metrics with Deltafin's counters, logprobs
equal to a teacher-forced log-softmax of mlx-lm's own model (the generated
token's own, alternatives best first; /v1/completions' legacy integer
`logprobs`), a client that half-closes still answered, one that resets stopped.
One server serves the module."""

import json
import re
import socket
import struct
import time

import mlx.core as mx
import numpy as np
import pytest

from deltafin_mlx.testing.server import free_port, get, post, start_server, stop_server

CONTEXT = 512


@pytest.fixture(scope="module")
def serve(converted, tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("serve") / "server.log"
    # No hub cache at all: /v1/models must not need one (mlx-lm's scans it).
    proc = start_server(converted("kimi_k3"), port, "40MB", log, server="deltafin",
                        context=CONTEXT, env={"HF_HOME": str(log.parent / "no-hub")})
    yield port, proc, log
    stop_server(proc)


def metrics(port) -> dict:
    status, raw = get(port, "/metrics")
    assert status == 200
    out = {}
    for line in raw.decode().splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_models_lists_the_served_model_as_openai_clients_expect(serve, converted):
    port = serve[0]
    status, raw = get(port, "/v1/models")
    listing = json.loads(raw)
    assert status == 200 and listing["object"] == "list"
    (card,) = listing["data"]
    assert card["id"] == converted("kimi_k3").name and card["object"] == "model"
    assert isinstance(card["created"], int) and card["owned_by"]
    assert json.loads(get(port, f"/v1/models/{card['id']}")[1]) == card
    assert get(port, "/v1/models/other")[0] == 404


def test_tokenize_and_detokenize_round_trip(serve, converted):
    from deltafin_mlx.engine.load import open_tokenizer

    port = serve[0]
    status, reply = post(port, "/tokenize", {"content": "Hello there, streaming experts"})
    want = open_tokenizer(converted("kimi_k3")).encode("Hello there, streaming experts",
                                                       add_special_tokens=False)
    assert status == 200 and reply["tokens"] == list(want) and reply["count"] == len(want)
    status, back = post(port, "/detokenize", {"tokens": reply["tokens"]})
    assert status == 200 and back["content"] == "Hello there, streaming experts"
    assert post(port, "/detokenize", {"tokens": [10 ** 7]})[0] == 400
    assert post(port, "/detokenize", {"tokens": "x"})[0] == 400
    assert post(port, "/tokenize", {"content": 5})[0] == 400


def test_metrics_count_requests_tokens_and_expert_reads(serve):
    port = serve[0]
    before = metrics(port)
    status, reply = post(port, "/v1/chat/completions",
                         {"messages": [{"role": "user", "content": "Count me"}],
                          "max_tokens": 3})
    assert status == 200
    after = metrics(port)
    assert after['deltafin_requests_total{outcome="ok"}'] == \
        before.get('deltafin_requests_total{outcome="ok"}', 0) + 1
    assert after["deltafin_reply_tokens_total"] - before["deltafin_reply_tokens_total"] == \
        reply["usage"]["completion_tokens"]
    assert after["deltafin_prompt_tokens_total"] - before["deltafin_prompt_tokens_total"] == \
        reply["usage"]["prompt_tokens"]
    hits = after["deltafin_expert_hits_total"] - before["deltafin_expert_hits_total"]
    misses = after["deltafin_expert_misses_total"] - before["deltafin_expert_misses_total"]
    assert hits + misses > 0
    assert "deltafin_expert_bytes_read_total" in after


def test_each_request_logs_one_line_with_its_tokens_times_and_reads(serve):
    port, _, log = serve
    post(port, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Log me"}],
                                        "max_tokens": 2})
    time.sleep(0.2)
    lines = [l for l in log.read_text().splitlines() if "[deltafin] /v1/chat/completions ok" in l]
    assert lines and re.search(r"\d+ prompt (\(\d+ from the prompt cache\) )?\+ 2 reply tokens in [\d.]+ s \(first token "
                               r"[\d.]+ s, [\d.]+ tok/s\); experts \d+ hits, \d+ misses, "
                               r"[\d.]+ [KMG]?B read", lines[-1]), lines[-1]
    (start,) = [l for l in log.read_text().splitlines() if "deltafin-run serve:" in l]
    assert re.search(r"budget 40\.0 MB, context 512 tokens, \d+ requests? at once", start), start


def teacher_forced_logprobs(model, prompt, generated):
    """float32 log-softmax at each generated position, the tokens given."""
    ids = mx.array([prompt + generated[:-1]])
    logits = model(ids)[0, len(prompt) - 1:].astype(mx.float32)
    return np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))


def test_logprobs_equal_a_teacher_forced_log_softmax_of_mlx_lms_model(serve, converted,
                                                                      references):
    """/v1/completions with the legacy integer logprobs at temperature 0: the
    reported token is the generated one (the reference's argmax), its logprob and
    the top 3 (best first) equal mlx-lm's own model's within 1e-4."""
    from deltafin_mlx.engine.load import open_tokenizer

    port = serve[0]
    prompt = "Tell me about streaming experts"
    status, reply = post(port, "/v1/completions", {"prompt": prompt, "max_tokens": 6,
                                                   "temperature": 0, "logprobs": 3})
    assert status == 200, reply
    lp = reply["choices"][0]["logprobs"]
    generated = lp["token_ids"]
    prompt_ids = list(open_tokenizer(converted("kimi_k3")).encode(prompt))
    assert len(prompt_ids) == reply["usage"]["prompt_tokens"]
    want = teacher_forced_logprobs(references("kimi_k3"), prompt_ids, generated)
    for i, token in enumerate(generated):
        assert token == int(np.argmax(want[i]))
        assert abs(lp["token_logprobs"][i] - want[i][token]) < 1e-4
        top = list(lp["top_logprobs"][i].values())
        assert top == sorted(top, reverse=True) and len(top) == 3
        assert np.allclose(top, np.sort(want[i])[::-1][:3], atol=1e-4)


def test_logprobs_equal_what_score_gives_for_the_same_tokens(serve, converted):
    """The values `deltafin-run serve` reports are those `score` gives the prompt
    plus the generated tokens: the same top 3 ids at each generated position and
    log-probabilities within 1e-4."""
    from deltafin_mlx import load, runtime
    from deltafin_mlx.jobs.score_lines import ScoreItem
    from deltafin_mlx.jobs.score import ScoreOptions, iter_passes

    prompt = "the experts stream from"
    status, reply = post(serve[0], "/v1/completions", {"prompt": prompt, "max_tokens": 5,
                                                       "temperature": 0, "logprobs": 3})
    assert status == 200, reply
    lp = reply["choices"][0]["logprobs"]
    model, tok = load(converted("kimi_k3"), "200MB", cache_slots=12, warm_start=False)
    prompt_ids = list(tok.encode(prompt))
    tokens = prompt_ids + lp["token_ids"]
    item = ScoreItem(0, tokens, np.arange(len(tokens)) >= len(prompt_ids))
    ((scored,),) = [results for results, _ in
                    iter_passes(model, [item], ScoreOptions(top_logprobs=3))]
    for j, token in enumerate(lp["token_ids"]):
        at = len(prompt_ids) + j
        assert abs(lp["token_logprobs"][j] - scored.token_logprobs[at]) < 1e-4
        top = lp["top_logprobs"][j]
        assert [tok.decode([i]) for i in scored.top_ids[at]] == list(top)
        assert np.allclose(list(top.values()), scored.top_logprobs[at], atol=1e-4)
    runtime(model).close()


def test_chat_top_logprobs_report_the_generated_token_best_first(serve):
    port = serve[0]
    status, reply = post(port, "/v1/chat/completions",
                         {"messages": [{"role": "user", "content": "Hello there"}],
                          "max_tokens": 5, "temperature": 0, "logprobs": True,
                          "top_logprobs": 3})
    assert status == 200
    content = reply["choices"][0]["logprobs"]["content"]
    assert len(content) == reply["usage"]["completion_tokens"]
    for entry in content:
        top = entry["top_logprobs"]
        assert [t["logprob"] for t in top] == sorted((t["logprob"] for t in top), reverse=True)
        assert top[0]["id"] == entry["id"] and top[0]["logprob"] == entry["logprob"]
        assert entry["bytes"] == list(entry["token"].encode())


def _raw_request(port, body: dict):
    data = json.dumps(body).encode()
    s = socket.create_connection(("127.0.0.1", port), timeout=60)
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
              b"application/json\r\nContent-Length: " + str(len(data)).encode() +
              b"\r\n\r\n" + data)
    return s


def test_a_client_that_half_closes_after_sending_gets_its_answer(serve):
    port = serve[0]
    s = _raw_request(port, {"messages": [{"role": "user", "content": "Hello there"}],
                            "max_tokens": 6})
    s.shutdown(socket.SHUT_WR)
    data = b""
    while chunk := s.recv(65536):
        data += chunk
    s.close()
    assert data.startswith(b"HTTP/1.0 200") or data.startswith(b"HTTP/1.1 200"), data[:200]
    reply = json.loads(data.split(b"\r\n\r\n", 1)[1])
    assert reply["usage"]["completion_tokens"] == 6


def test_a_client_that_resets_has_its_generation_stopped(serve):
    port = serve[0]
    before = metrics(port).get('deltafin_requests_total{outcome="gone"}', 0)
    s = _raw_request(port, {"messages": [{"role": "user", "content": "Go on and on"}],
                            "max_tokens": 400, "stream": True})
    s.recv(1)  # generation has started
    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    s.close()
    deadline = time.time() + 30
    while time.time() < deadline:
        if metrics(port).get('deltafin_requests_total{outcome="gone"}', 0) > before:
            break
        time.sleep(0.2)
    assert metrics(port)['deltafin_requests_total{outcome="gone"}'] == before + 1
    assert get(serve[0], "/health")[0] == 200


def test_forty_simultaneous_clients_are_all_answered_without_a_reset(serve):
    """A burst of 40 connections at the same instant: the listen backlog and the
    thread per connection take them all; each gets its reply (or a 503), none a
    reset."""
    import threading

    port, results, go = serve[0], [], threading.Event()

    def client(i):
        go.wait()
        try:
            results.append(post(port, "/v1/chat/completions",
                                {"messages": [{"role": "user", "content": f"Client {i}"}],
                                 "max_tokens": 2}, timeout=120)[0])
        except OSError as e:
            results.append(repr(e))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(40)]
    for t in threads:
        t.start()
    go.set()
    for t in threads:
        t.join(timeout=180)
    assert len(results) == 40 and set(results) <= {200, 503}, results
    assert results.count(200) >= 30


def test_streamed_logprobs_equal_the_unstreamed_ones(serve):
    import urllib.request

    port = serve[0]
    body = {"messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 6,
            "temperature": 0, "logprobs": True, "top_logprobs": 2}
    whole = post(port, "/v1/chat/completions", body)[1]["choices"][0]["logprobs"]["content"]
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions",
                                 json.dumps({**body, "stream": True}).encode(),
                                 {"Content-Type": "application/json"})
    streamed = []
    with urllib.request.urlopen(req, timeout=60) as r:
        for line in r:
            if line.startswith(b"data: {"):
                choice = json.loads(line[6:])["choices"][0]
                streamed += (choice.get("logprobs") or {}).get("content", [])
    assert [e["id"] for e in streamed] == [e["id"] for e in whole]
    assert all(abs(a["logprob"] - b["logprob"]) < 1e-6 for a, b in zip(streamed, whole))
