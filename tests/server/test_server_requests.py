"""`deltafin-run serve` against hostile request values, on loopback: every value is
checked before generation (one schema for chat and completions), a bad one is
HTTP 400 naming the field, content other than text is refused before any I/O
(no URL is fetched), and afterwards the server is healthy and answers exactly.
One server serves the whole module."""

import json
import socket

import pytest

from deltafin_mlx.testing.server import expected_reply, free_port, get, post, start_server, stop_server

CONTEXT = 512
CHAT = "/v1/chat/completions"
TEXT = "/v1/completions"


@pytest.fixture(scope="module")
def serve(converted, tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("serve") / "server.log"
    proc = start_server(converted("kimi_k3"), port, "40MB", log, server="deltafin",
                        context=CONTEXT)
    yield port, proc, log
    stop_server(proc)


def chat(content="Hello there", **extra):
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 4,
            "temperature": 0.0, **extra}


def text(prompt="Hello there", **extra):
    return {"prompt": prompt, "max_tokens": 4, "temperature": 0.0, **extra}


HOSTILE = [
    (CHAT, chat(stop=[1]), "stop[0]"),
    (CHAT, chat(stop=[[1, 2]]), "stop[0]"),
    (CHAT, chat(stop=5), "stop"),
    (CHAT, chat(stop=""), "stop[0]"),
    (CHAT, chat(stop=["x"] * 17), "stop"),
    (CHAT, chat(top_k=100000, temperature=0.7), "top_k"),
    (CHAT, chat(top_k=1024, temperature=1e-30), "top_k"),  # all of the fixture's 1024 ids
    (TEXT, text(""), "prompt"),
    (TEXT, text(5), "prompt"),
    (TEXT, {"max_tokens": 4}, "prompt"),
    (CHAT, chat(logit_bias={"5": [1]}), "logit_bias[5]"),
    (CHAT, chat(logit_bias={"10000000": 1}), "outside the vocabulary"),
    (CHAT, chat(logit_bias={"-1": 1}), "not a token id"),
    (CHAT, chat(logit_bias={"5": 1e300}), "logit_bias[5]"),
    (CHAT, chat(logit_bias=[1]), "logit_bias"),
    (CHAT, chat(seed=2 ** 70), "seed"),
    (CHAT, chat(seed=-1), "seed"),
    (CHAT, chat(seed=1.5), "seed"),
    (CHAT, chat(stream_options="x"), "stream_options"),
    (CHAT, chat(stream="yes"), "stream"),
    (CHAT, {**chat(), "max_tokens": True}, "max_tokens"),
    (CHAT, {**chat(), "max_tokens": 0}, "max_tokens"),
    (CHAT, {**chat(), "max_tokens": "5"}, "max_tokens"),
    (CHAT, chat(temperature=-1), "temperature"),
    (CHAT, chat(top_p=2), "top_p"),
    (CHAT, chat(repetition_context_size=10 ** 9), "repetition_context_size"),
    (CHAT, chat(top_logprobs=50), "top_logprobs"),
    (CHAT, chat(n=2), "n"),
    (CHAT, chat(adapters="/tmp"), "adapters"),
    (CHAT, chat(draft_model="/tmp"), "draft_model"),
    (CHAT, chat(chat_template_kwargs={"x": [1]}), "chat_template_kwargs"),
    (CHAT, chat(tools="x"), "tools"),
    (CHAT, {"messages": [], "max_tokens": 4}, "messages"),
    (CHAT, {"messages": "hi", "max_tokens": 4}, "messages"),
    (CHAT, {"messages": [{"role": "robot", "content": "x"}]}, "role"),
    (CHAT, {"messages": [{"role": "user", "content": 5}]}, "content"),
    (CHAT, chat("\ud800"), "surrogate"),
    (CHAT, chat([{"type": "input_audio", "input_audio": {"data": "x"}}]), "content type"),
    (CHAT, {"messages": [{"role": "assistant", "content": "",
                          "tool_calls": [{"function": {"arguments": "{}"}}]}]}, "name"),
    (CHAT, {"messages": [{"role": "assistant", "content": "", "tool_calls": 5}]},
     "tool_calls"),
    (CHAT, chat(tools=[{"type": "function", "function": {"name": "f", "parameters":
                                                         json.loads("[" * 40 + "]" * 40)}}]),
     "nested"),
    (CHAT, chat(repetition_penalty=-1), "repetition_penalty"),
    (CHAT, chat(repetition_penalty=1e-40), "repetition_penalty"),  # logits / it = inf
    (CHAT, chat(repetition_penalty=11), "repetition_penalty"),
    (CHAT, chat(repetition_penalty="2"), "repetition_penalty"),
    (TEXT, text(min_tokens_to_keep=-5), "min_tokens_to_keep"),
    (TEXT, text(min_tokens_to_keep=10 ** 6), "min_tokens_to_keep"),
    (CHAT, chat(min_tokens_to_keep=1.5), "min_tokens_to_keep"),
    (CHAT, chat(min_tokens_to_keep=5), "min_tokens_to_keep"),  # mlx-lm's server keeps 1
    (CHAT, chat("stream " * (CONTEXT + 64)), "planned context"),
    # What the server does not do is refused, never dropped.
    (TEXT, text(echo=True, stream=True), "stream"),  # scoring answers whole
    (CHAT, chat(echo=True), "echo"),  # a text completion's (a chat: prompt_logprobs)
    (TEXT, text(best_of=2), "best_of"),
    (TEXT, text(suffix="and so on"), "suffix"),
    (CHAT, chat(tool_choice="required"), "tool_choice"),
    (CHAT, chat(response_format={"type": "json_object"}), "response_format"),
    (CHAT, chat(images=["aGk="]), "images"),
    (CHAT, chat(role_mapping={"user": "U"}), "role_mapping"),
    (CHAT, chat(temprature=0.5), "temprature"),
]


@pytest.mark.parametrize("path,body,names", HOSTILE,
                         ids=[f"{i}-{n}" for i, (_, _, n) in enumerate(HOSTILE)])
def test_a_bad_value_is_refused_with_400_naming_it(serve, path, body, names):
    status, reply = post(serve[0], path, body)
    assert status == 400, reply
    assert names in reply["error"]["message"], reply


def test_after_every_hostile_request_the_server_is_healthy_and_exact(serve, converted):
    port, proc, _ = serve
    for path, body, _ in HOSTILE[:12]:
        post(port, path, body)
    assert get(port, "/health") == (200, b'{"status": "ok"}')
    status, reply = post(port, CHAT, chat(max_tokens=8))
    assert status == 200 and proc.poll() is None
    message = reply["choices"][0]["message"]
    assert (message.get("reasoning") or "") + (message.get("content") or "") == \
        expected_reply(converted("kimi_k3"), "Hello there", 8)


def test_absent_and_null_values_are_the_defaults(serve):
    port = serve[0]
    for body in (chat(logit_bias=None, seed=None, stop=None, stream_options=None,
                      repetition_penalty=None, min_tokens_to_keep=None),
                 chat(repetition_penalty=0, min_tokens_to_keep=1),
                 chat(stop="\n\n", logit_bias={"5": -1.5}, seed=3),
                 # what OpenAI's client libraries send when asked for nothing more
                 chat(user="u1", metadata={"k": "v"}, store=False, parallel_tool_calls=True,
                      tool_choice="auto", response_format={"type": "text"}, best_of=1,
                      modalities=["text"], audio=None, functions=None)):
        status, reply = post(port, CHAT, body)
        assert status == 200, reply


def test_a_body_that_is_not_utf8_json_is_refused(serve):
    port = serve[0]
    raw = json.dumps(chat()).encode("utf-16")
    assert post(port, CHAT, None, raw=raw)[0] == 400
    assert post(port, CHAT, None, raw=b'{"messages": [')[0] == 400
    assert post(port, CHAT, None, raw=b"[1, 2]")[0] == 400
    assert post(port, CHAT, None, raw=b"[" * 20000 + b"]" * 20000)[0] == 400


def test_a_body_larger_than_the_context_can_use_is_refused_unread(serve):
    """The body bound follows the planned context (its text could not fit),
    and text over the bound is refused before it is tokenized."""
    port = serve[0]
    status, _ = post(port, CHAT, chat("x" * (4 << 20)))
    assert status == 413
    status, reply = post(port, CHAT, chat("y" * (CONTEXT * 40)))
    assert status in (400, 413), reply


def test_an_image_url_is_refused_without_being_fetched(serve):
    """A content part naming a URL (here a listening socket of the test's own)
    is refused before any I/O: nothing connects to it."""
    port = serve[0]
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    listener.settimeout(1.0)
    url = f"http://127.0.0.1:{listener.getsockname()[1]}/cat.png"
    parts = [{"type": "text", "text": "what is this?"},
             {"type": "image_url", "image_url": {"url": url}}]
    status, reply = post(port, CHAT, chat(parts))
    assert status == 400 and "content type" in reply["error"]["message"]
    with pytest.raises(socket.timeout):
        listener.accept()
    listener.close()


# Edge values of every sampling field, each one valid alone; combined at random they
# once found top_k = the vocabulary size, which mlx-lm's sampler refused inside the
# generation thread.
EDGES = {"temperature": [0, 1e-30, 100, 0.5], "top_p": [0, 1e-9, 1], "top_k": [0, 1, 1023],
         "min_p": [0, 1, 1e-9], "repetition_penalty": [0, 0.01, 10],
         "repetition_context_size": [0, 1, CONTEXT], "presence_penalty": [-100, 100],
         "presence_context_size": [0, CONTEXT], "frequency_penalty": [-100, 100],
         "frequency_context_size": [0, CONTEXT], "xtc_probability": [0, 1],
         "xtc_threshold": [0, 0.5], "logit_bias": [{"0": 100}, {"1023": -100},
                                                 {str(i): -100 for i in range(1000)}],
         "seed": [0, 2 ** 63 - 1], "top_logprobs": [0, 10], "logprobs": [True, False],
         "stop": [["\u0000"], ["a" * 1024], ["x"] * 16, "\n"], "max_tokens": [1, 8],
         "chat_template_kwargs": [{"thinking": False}, {"x": None}],
         "stream_options": [{"include_usage": True}], "max_completion_tokens": [1, 5],
         "min_tokens_to_keep": [1]}


def test_random_combinations_of_edge_values_never_fail_generation(serve):
    """60 requests, each with 5 fields at edge values (fixed seed): every one is
    answered 200 or refused 400, and the generation loop never had to restart."""
    import random

    port, rng, seen = serve[0], random.Random(7), {}
    for _ in range(60):
        body = {k: rng.choice(EDGES[k]) for k in rng.sample(sorted(EDGES), 5)}
        if rng.random() < 0.3:
            path, body["prompt"] = TEXT, rng.choice(["x", " ", "\u0000", "hello"])
        else:
            path, body["messages"] = CHAT, [{"role": "user", "content": "hi"}]
        body.setdefault("max_tokens", 3)
        status, reply = post(port, path, body)
        seen[status] = seen.get(status, 0) + 1
        assert status in (200, 400), (status, reply, body)
    assert seen.get(200, 0) >= 40, seen
    metrics = get(port, "/metrics")[1].decode()
    assert "deltafin_generation_restarts_total 0" in metrics


def test_max_tokens_beyond_the_context_is_cut_to_what_is_left(serve):
    status, reply = post(serve[0], CHAT, chat(max_tokens=2 ** 31))
    usage = reply["usage"]
    assert status == 200 and usage["prompt_tokens"] + usage["completion_tokens"] <= CONTEXT


def test_a_body_shorter_than_its_content_length_is_refused(serve):
    """The client sends half its body and stops sending (half-close): 400 at once,
    not a wait."""
    port = serve[0]
    data = json.dumps(chat()).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: "
                  + str(len(data)).encode() + b"\r\n\r\n" + data[: len(data) // 2])
        s.shutdown(socket.SHUT_WR)
        reply = b""
        while chunk := s.recv(65536):  # the headers and the body may come apart
            reply += chunk
    assert reply.startswith(b"HTTP/1.0 400") and b"ended after" in reply, reply
