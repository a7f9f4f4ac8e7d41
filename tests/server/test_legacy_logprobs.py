"""/v1/completions' legacy `logprobs` on a real `deltafin-run serve`: OpenAI's
`top_logprobs` is a {text: logprob} map per position, so alternatives that decode
to the same text (pieces of one UTF-8 character all decode to U+FFFD) share a key.
The map keeps the best logprob of each text (as the README says), and `top_tokens`
keeps every alternative with its id, best first."""

import pytest

from deltafin_mlx.testing.server import free_port, post, start_server, stop_server

CONTEXT = 512
TOP = 10
PROMPTS = ["Tell me about streaming experts", "Hello there", "日本語のテキスト",
           "What is two plus two?"]


@pytest.fixture(scope="module")
def serve(converted, tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("serve") / "server.log"
    proc = start_server(converted("kimi_k3"), port, "40MB", log, server="deltafin",
                        context=CONTEXT)
    yield port
    stop_server(proc)


def legacy_logprobs(port, prompt):
    status, reply = post(port, "/v1/completions", {"prompt": prompt, "max_tokens": 12,
                                                   "temperature": 0, "logprobs": TOP})
    assert status == 200, reply
    return reply["choices"][0]["logprobs"]


def test_every_alternative_is_kept_and_shared_texts_keep_their_best_logprob(serve):
    shared = 0
    for prompt in PROMPTS:
        lp = legacy_logprobs(serve, prompt)
        assert len(lp["top_tokens"]) == len(lp["token_ids"]) == len(lp["top_logprobs"])
        for own, alternatives, by_text in zip(lp["token_ids"], lp["top_tokens"],
                                              lp["top_logprobs"]):
            ids = [a["id"] for a in alternatives]
            values = [a["logprob"] for a in alternatives]
            assert len(set(ids)) == TOP  # every alternative, none merged
            assert values == sorted(values, reverse=True)
            assert own == ids[0]  # greedy: the generated token is the best
            best = {}
            for a in alternatives:
                best.setdefault(a["token"], a["logprob"])
            assert by_text == best  # the map: each text once, at its best logprob
            shared += len(by_text) < TOP
    # The case the merge is about occurs: some position's alternatives share a text.
    assert shared > 0
