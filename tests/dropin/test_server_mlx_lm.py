"""Plain `mlx_lm.server --trust-remote-code` on a Deltafin model, on loopback: the
drop-in installs Deltafin's request checks there, so an out-of-vocabulary
logit_bias id (a segfault in mlx-lm alone), values that would stop mlx-lm's
generation thread, an image URL and a prompt beyond the planned context
(DELTAFIN_CONTEXT) are HTTP 400 and the server goes on answering exactly."""

import socket

import pytest

from deltafin_mlx.testing.server import expected_reply, free_port, get, post, start_server, stop_server

CONTEXT = 512


@pytest.fixture(scope="module")
def mlx_lm_server(converted, tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("mlx_lm_server") / "server.log"
    proc = start_server(converted("kimi_k3"), port, "40MB", log,
                        env={"DELTAFIN_CONTEXT": str(CONTEXT)})
    # A request sent while the model loads waits for it (checked, then answered).
    status, _ = post(port, "/v1/chat/completions",
                     {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
                     timeout=300)
    assert status == 200
    yield port, proc, log
    stop_server(proc)


def chat(content="Hello there", **extra):
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 4,
            "temperature": 0.0, **extra}


@pytest.mark.parametrize("body,says", [
    (chat(logit_bias={"10000000": 5}), "outside the vocabulary"),
    (chat(logit_bias={"5": [1]}), "logit_bias[5]"),
    (chat(stop=[1]), "stop[0]"),
    (chat(top_k=100000, temperature=0.7), "top_k"),
    (chat(seed=2 ** 70), "seed"),
    (chat("stream " * (CONTEXT + 64)), "planned context"),
])
def test_the_drop_in_refuses_what_would_crash_or_starve_mlx_lm_server(mlx_lm_server, body,
                                                                        says):
    port, proc, _ = mlx_lm_server
    status, reply = post(port, "/v1/chat/completions", body)
    assert status == 400 and says in str(reply["error"]), reply
    assert proc.poll() is None and get(port, "/health")[0] == 200


def test_an_empty_completion_prompt_is_refused(mlx_lm_server):
    status, _ = post(mlx_lm_server[0], "/v1/completions", {"prompt": "", "max_tokens": 2})
    assert status == 400
    assert get(mlx_lm_server[0], "/health")[0] == 200


def test_the_drop_in_fetches_no_image_url(mlx_lm_server):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    listener.settimeout(1.0)
    url = f"http://127.0.0.1:{listener.getsockname()[1]}/cat.png"
    status, _ = post(mlx_lm_server[0], "/v1/chat/completions",
                     chat([{"type": "image_url", "image_url": {"url": url}}]))
    assert status == 400
    with pytest.raises(socket.timeout):
        listener.accept()
    listener.close()


def test_after_the_refusals_mlx_lm_server_answers_as_deltafin_run(mlx_lm_server, converted):
    status, reply = post(mlx_lm_server[0], "/v1/chat/completions", chat(max_tokens=8))
    message = reply["choices"][0]["message"]
    assert status == 200
    assert (message.get("reasoning") or "") + (message.get("content") or "") == \
        expected_reply(converted("kimi_k3"), "Hello there", 8)


def test_the_server_log_says_what_the_drop_in_cannot_guard(mlx_lm_server):
    assert "use `deltafin-run serve` for untrusted clients" in mlx_lm_server[2].read_text()
