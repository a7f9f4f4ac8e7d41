"""`deltafin-run serve` reuses the chat template's preamble across conversations:
K3's template opens every conversation that has no system message with one of its
own (~345 tokens on K3, ~225 on the fixture), and the server keeps the state at its
end in mlx-lm's prompt cache, so a new conversation prefills only its own
message. The reply is the one `deltafin-run` gives the same prompt alone."""

import pytest

from deltafin_mlx.testing.server import expected_reply, free_port, post, start_server, stop_server

CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def serve(converted, tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("serve") / "server.log"
    proc = start_server(converted("kimi_k3"), port, "40MB", log, server="deltafin",
                        context=1024)
    yield port, proc, log
    stop_server(proc)


def ask(port, content, system=None):
    messages = ([{"role": "system", "content": system}] if system else []) + \
        [{"role": "user", "content": content}]
    status, reply = post(port, CHAT, {"messages": messages, "max_tokens": 6,
                                      "temperature": 0.0})
    assert status == 200, reply
    message = reply["choices"][0]["message"]
    text = (message.get("reasoning") or "") + (message.get("content") or "")
    return text, reply["usage"]


def test_a_new_conversation_starts_from_the_cached_preamble(serve, converted):
    port, proc, log = serve
    model = converted("kimi_k3")
    first, usage = ask(port, "Hello there")
    assert usage["prompt_tokens_details"]["cached_tokens"] == 0
    second, usage = ask(port, "What is up")
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    # The preamble and the user message's opening markup: all but the message itself.
    assert 100 < cached < usage["prompt_tokens"] - 3
    assert first == expected_reply(model, "Hello there", 6)
    assert second == expected_reply(model, "What is up", 6)
    assert f"({cached} from the prompt cache)" in log.read_text()


def test_a_conversation_with_its_own_system_message_is_exact(serve):
    port, _, _ = serve
    once, _ = ask(port, "Hello there", system="Answer in one word.")
    again, usage = ask(port, "Hello again", system="Answer in one word.")
    assert usage["prompt_tokens_details"]["cached_tokens"] > 0  # mlx-lm's own system segment
    alone, _ = ask(port, "Hello there", system="Answer in one word.")
    assert alone == once
