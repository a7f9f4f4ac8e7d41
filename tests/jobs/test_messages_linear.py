"""A `messages` line is prepared from one render of its conversation (K3's XTML:
KimiTokenizer.render_turns), in time linear in its turns: its tokens are those of
the chat template applied to the whole conversation, and its mask is the one the
definition gives (a turn runs from where the conversation before it, with the
generation prompt, stops matching, to the end of the conversation rendered up to
it; with content_only, less what the turn shares with itself rendered empty)."""

import numpy as np
import pytest

from deltafin_mlx.generation.stream import common_prefix
from deltafin_mlx.jobs.batch_lines import Request
from deltafin_mlx.jobs.score_lines import prepare
from deltafin_mlx.testing.tokenizers import write_kimi_tokenizer_files
from deltafin_mlx.tokenizer.kimi import load_kimi_tokenizer
from deltafin_mlx.tokenizer.messages import chat_messages


@pytest.fixture(scope="module")
def k3_tokenizer(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    write_kimi_tokenizer_files(path, flavor="k3")
    return load_kimi_tokenizer(path)


def render(tok, msgs, generation_prompt, thinking):
    return list(tok.apply_chat_template(msgs, add_generation_prompt=generation_prompt,
                                        tokenize=True, thinking=thinking))


def by_definition(tok, msgs, thinking, content_only):
    """The mask as the module docstring defines it, each prefix rendered on its own."""
    msgs = chat_messages(msgs)
    tokens = render(tok, msgs, False, thinking)
    scored = np.zeros(len(tokens), bool)
    for i, m in enumerate(msgs):
        if m["role"] != "assistant":
            continue
        upto = render(tok, msgs[: i + 1], False, thinking)
        assert tokens[: len(upto)] == upto
        start, end = common_prefix(tokens, render(tok, msgs[:i], True, thinking)), len(upto)
        if content_only:
            empty = render(tok, msgs[:i] + [{**m, "content": ""}], False, thinking)
            start = max(start, common_prefix(upto, empty))
            end -= common_prefix(upto[::-1], empty[::-1])
        scored[start:end] = True
    scored[0] = False
    return tokens, scored


CALL = {"id": "c1", "type": "function",
        "function": {"name": "lookup", "arguments": '{"q": "experts", "n": 3}'}}
CALL2 = {"id": "c2", "type": "function", "function": {"name": "fetch", "arguments": {}}}
CONVERSATIONS = [
    [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"}],
    [{"role": "system", "content": "be brief"},
     {"role": "user", "content": "what streams?"},
     {"role": "assistant", "content": "the experts", "reasoning_content": "they are big"},
     {"role": "user", "content": "and the trunk?"},
     {"role": "assistant", "content": "it stays"}],
    [{"role": "user", "content": "look it up"},
     {"role": "assistant", "content": "", "tool_calls": [CALL, CALL2]},
     # answered out of order: the template orders a run of results by call
     {"role": "tool", "tool_call_id": "c2", "content": "page"},
     {"role": "tool", "tool_call_id": "c1", "content": "3 hits"},
     {"role": "assistant", "content": "found 3"},
     {"role": "user", "content": "thanks"}],
]


@pytest.mark.parametrize("thinking", [True, False])
@pytest.mark.parametrize("content_only", [False, True])
@pytest.mark.parametrize("conversation", range(len(CONVERSATIONS)))
def test_one_render_gives_the_whole_templates_tokens_and_the_defined_mask(
        k3_tokenizer, conversation, thinking, content_only):
    msgs = CONVERSATIONS[conversation]
    item = prepare(Request("1", 1, 1, spec={"id": 1, "messages": msgs}), k3_tokenizer,
                   thinking, content_only)
    tokens, scored = by_definition(k3_tokenizer, msgs, thinking, content_only)
    assert item.tokens == tokens
    assert (item.scored == scored).all() and scored.any()


def exchanges(n):
    msgs = []
    for i in range(n):
        msgs += [{"role": "user", "content": f"question {i} about the experts"},
                 {"role": "assistant", "content": f"answer {i}: they stream from disk"}]
    return msgs


def test_preparing_a_conversation_encodes_each_token_a_bounded_number_of_times(k3_tokenizer):
    """Tokens encoded (memoized pieces count as encoded: the work is the same
    list-building) grow with the conversation, not with its square: rendering every
    prefix encoded about turns/2 times each token."""
    kimi = k3_tokenizer._tokenizer  # mlx-lm's wrapper holds the Kimi tokenizer
    encode = kimi._encode_pieces
    for n in (10, 100):
        encoded = []

        def counting(pieces):
            ids = encode(pieces)
            encoded.append(len(ids))
            return ids

        kimi._encode_pieces = counting
        try:
            item = prepare(Request("1", 1, 1, spec={"id": 1, "messages": exchanges(n)}),
                           k3_tokenizer)
        finally:
            kimi._encode_pieces = encode
        assert sum(encoded) <= len(item.tokens) + 64, (n, sum(encoded), len(item.tokens))
