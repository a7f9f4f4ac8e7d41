"""/tokenize and /detokenize on a real `deltafin-run serve` refuse a field they do
not take (HTTP 400 naming it), as the completion endpoints do, rather than
dropping it; their own fields are still answered."""

import pytest

from deltafin_mlx.testing.server import free_port, post, start_server, stop_server


@pytest.fixture(scope="module")
def serve(converted, tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("serve") / "server.log"
    proc = start_server(converted("kimi_k3"), port, "40MB", log, server="deltafin",
                        context=512)
    yield port
    stop_server(proc)


@pytest.mark.parametrize("path,body", [
    ("/tokenize", {"content": "Hello", "add_special": False, "with_pieces": True}),
    ("/detokenize", {"tokens": [1, 2], "skip_special": True}),
])
def test_an_unknown_field_is_refused_naming_it(serve, path, body):
    status, reply = post(serve, path, body)
    assert status == 400, reply
    assert "with_pieces" in reply["error"]["message"] or \
        "skip_special" in reply["error"]["message"]


def test_the_endpoints_own_fields_are_answered(serve):
    status, reply = post(serve, "/tokenize", {"content": "Hello", "add_special": False})
    assert status == 200 and reply["count"] == len(reply["tokens"]) > 0
    status, back = post(serve, "/detokenize", {"tokens": reply["tokens"]})
    assert status == 200 and back["content"] == "Hello"
