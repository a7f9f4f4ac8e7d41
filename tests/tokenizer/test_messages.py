"""One rule for a conversation, wherever it comes in: a chat request to `serve`, a
`messages` line of `batch` or of `score` (tokenizer/messages.py)."""

import pytest

from deltafin_mlx.jobs.batch_lines import Request, batch_request, batch_spec
from deltafin_mlx.errors import RequestError
from deltafin_mlx.jobs.score_lines import prepare
from deltafin_mlx.server.schema import RequestLimits, check_completion
from deltafin_mlx.testing.tokenizers import write_kimi_tokenizer_files
from deltafin_mlx.tokenizer.kimi import load_kimi_tokenizer
from deltafin_mlx.tokenizer.messages import chat_messages

USER = {"role": "user", "content": "What is 2+2?"}
REPLY = {"role": "assistant", "content": "4."}


def test_content_parts_tool_calls_and_empty_echoes_take_the_templates_form():
    got = chat_messages([
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None, "refusal": None, "annotations": [],
         "tool_calls": [{"id": "c1", "type": "function",
                         "function": {"name": "add", "arguments": '{"x": 1}'}}]},
        {"role": "tool", "tool_call_id": "c1", "name": "add", "content": "1"},
    ])
    assert got == [
        {"role": "user", "content": "ab"},
        {"role": "assistant", "content": "",
         "tool_calls": [{"type": "function", "id": "c1",
                         "function": {"name": "add", "arguments": {"x": 1}}}]},
        {"role": "tool", "content": "1", "tool_call_id": "c1", "name": "add"},
    ]


BAD = [
    ([], "messages: must be a non-empty list"),
    ([USER, 5], "messages[1]: must be an object"),
    ([{"role": "wizard", "content": "hi"}], "messages[0].role: must be one of"),
    ([{"role": "user", "content": "hi", "mood": "calm"}], "messages[0]: unknown key 'mood'"),
    ([{"role": "assistant", "content": "x", "refusal": "no"}], "unknown key 'refusal'"),
    ([{"role": "user", "content": 5}], "messages[0].content: must be a string, a list"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}],
     "messages[0].content[0]: content type 'image_url' is not supported"),
    ([{"role": "user", "content": "\ud800"}], "messages[0].content: holds a lone surrogate"),
    ([{"role": "assistant", "content": "", "tool_calls": 5}],
     "messages[0].tool_calls: must be a list"),
    ([{"role": "assistant", "content": "", "tool_calls": [{"function": {"arguments": "{}"}}]}],
     "messages[0].tool_calls[0].function.name: must be a string"),
    ([{"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "{not json"}}]}],
     "function.arguments: is not valid JSON"),
    ([{"role": "assistant", "content": "", "tool_calls": [
        {"type": "code", "function": {"name": "f"}}]}], 'tool_calls[0].type: must be "function"'),
    ([{"role": "user", "content": "hi", "name": "n" * 300}], "messages[0].name: is 300 characters"),
]


@pytest.mark.parametrize("msgs,why", BAD)
def test_a_bad_conversation_is_refused_alike_by_serve_batch_and_score(msgs, why, tmp_path):
    with pytest.raises(RequestError) as direct:
        chat_messages(msgs)
    limits = RequestLimits(vocab=1000, context=1024, max_text_bytes=1 << 20)
    with pytest.raises(RequestError) as served:
        check_completion({"messages": msgs}, chat=True, limits=limits)
    with pytest.raises(ValueError) as batched:
        batch_spec({"id": 1, "messages": msgs})
    write_kimi_tokenizer_files(tmp_path / "tok", flavor="k3")
    tokenizer = load_kimi_tokenizer(tmp_path / "tok")
    with pytest.raises(ValueError) as scored:
        prepare(Request("1", 1, 1, spec={"id": 1, "messages": msgs}), tokenizer)
    assert why in str(direct.value)
    assert str(direct.value) == str(served.value) == str(batched.value) == str(scored.value)


def test_a_good_conversation_is_taken_by_all_three(tmp_path):
    msgs = [USER, {**REPLY, "content": [{"type": "text", "text": "4."}]}]
    limits = RequestLimits(vocab=1 << 20, context=1024, max_text_bytes=1 << 20)
    assert check_completion({"messages": msgs}, chat=True, limits=limits)["messages"] == [
        USER, REPLY]
    assert batch_request(batch_spec({"id": 1, "messages": msgs}), limits).messages == [USER, REPLY]
    write_kimi_tokenizer_files(tmp_path / "tok", flavor="k3")
    item = prepare(Request("1", 1, 1, spec={"id": 1, "messages": msgs}),
                   load_kimi_tokenizer(tmp_path / "tok"))
    assert item.scored.any()
