"""Scoring a conversation's content only: `score --content-only` (and
`deltafin_mlx.score(..., content_only=True)`) scores, of a "messages" line, the
tokens of the assistant turns' content, not the template's tokens around them
(the turn's header, thinking markers, the end-of-turn token); those tokens' values
are the ones a whole-turn score gives them."""

import json

import deltafin_mlx
from deltafin_mlx.cli.main import main
from deltafin_mlx.engine.load import load
from deltafin_mlx.engine.runtime import runtime

CHAT = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "And the experts?"},
        {"role": "assistant", "content": "They stream from disk."}]


def scored_text(tok, line):
    return [tok.decode([t]) for t, v in zip(line["tokens"], line["token_logprobs"])
            if v is not None]


def test_content_only_scores_the_assistant_contents_and_nothing_else(converted):
    model, tok = load(converted("kimi_k3"), "200MB", warm_start=False)
    whole, content = (deltafin_mlx.score(model, tok, [{"messages": CHAT}], content_only=c)[0]
                      for c in (False, True))
    assert whole["tokens"] == content["tokens"]
    assert "".join(scored_text(tok, content)) == "Hello!They stream from disk."
    assert content["scored_tokens"] == len(tok.encode("Hello!", add_special_tokens=False)) + len(
        tok.encode("They stream from disk.", add_special_tokens=False))
    assert whole["scored_tokens"] > content["scored_tokens"]
    for a, b in zip(whole["token_logprobs"], content["token_logprobs"]):
        assert b is None or abs(a - b) < 1e-5  # the content's values as a whole turn gives
    runtime(model).close()


def test_the_cli_option(converted, tmp_path, capsys):
    src, out = tmp_path / "chat.jsonl", tmp_path / "out.jsonl"
    src.write_text(json.dumps({"id": 1, "messages": CHAT[:2]}) + "\n")
    assert main(["score", str(converted("kimi_k3")), str(src), "-o", str(out), "--content-only",
                 "--budget", "200MB"]) == 0
    line = json.loads(out.read_text())
    model, tok = load(converted("kimi_k3"), "200MB", warm_start=False)
    assert "".join(scored_text(tok, line)) == "Hello!"
    runtime(model).close()
