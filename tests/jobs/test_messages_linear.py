"""A `messages` line is prepared from one render of its conversation, in time linear
in its turns, whatever the template (K3's XTML through KimiTokenizer.render_turns;
Jinja templates, Hugging Face's and K2's, rendered once as text): its tokens are
those of the chat template applied to the whole conversation, and its mask is the
one the definition gives (a turn runs from where the conversation before it, with
the generation prompt, stops matching, to the end of the conversation rendered up
to it; with content_only, less what the turn shares with itself rendered empty).
A template that does not render a conversation as a sequence of its turns gets
the definition's answer (or its error), each prefix rendered."""

import json

import numpy as np
import pytest
from mlx_lm.utils import load_tokenizer

from deltafin_mlx.cli.main import main
from deltafin_mlx.generation.stream import common_prefix
from deltafin_mlx.jobs import score_lines
from deltafin_mlx.jobs.batch_lines import Request
from deltafin_mlx.jobs.score_lines import prepare
from deltafin_mlx.testing.tokenizers import write_bpe_tokenizer_files, write_kimi_tokenizer_files
from deltafin_mlx.tokenizer.kimi import load_kimi_tokenizer
from deltafin_mlx.tokenizer.messages import chat_messages


@pytest.fixture(scope="module")
def k3_tokenizer(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    write_kimi_tokenizer_files(path, flavor="k3")
    return load_kimi_tokenizer(path)


def render(tok, msgs, generation_prompt, thinking):
    return list(tok.apply_chat_template(msgs, add_generation_prompt=generation_prompt,
                                        tokenize=True, thinking=thinking,
                                        enable_thinking=thinking))


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


# Jinja chat templates of the families models ship, over the test tokenizers.
CHATML = None  # the Qwen test tokenizer's own
LLAMA3 = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>"
    "\n\n{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
THINKING = (  # Qwen3's shape: reasoning in <think>, an empty one when thinking is off
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.role == 'assistant' %}"
    "{% if m.reasoning_content %}<think>\n{{ m.reasoning_content }}\n</think>\n\n{% endif %}"
    "{% endif %}{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}"
    "<|im_start|>assistant\n{% if enable_thinking is defined and not enable_thinking %}"
    "<think>\n\n</think>\n\n{% endif %}{% endif %}")
TOOLS = (  # Qwen2.5's shape: content only when there is some, tool results grouped
    "{% for m in messages %}{% if m.role == 'assistant' %}<|im_start|>assistant"
    "{% if m.content %}\n{{ m.content }}{% endif %}{% for c in m.tool_calls or [] %}"
    "\n<tool_call>\n{{ c.function | tojson }}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% elif m.role == 'tool' %}{% if loop.first or messages[loop.index0 - 1].role != 'tool' %}"
    "<|im_start|>user{% endif %}\n<tool_response>\n{{ m.content }}\n</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>\n{% endif %}"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
HARMONY = (  # gpt-oss's shape: the last reply ends in <|return|>, others in <|end|>
    "{% for m in messages %}<|start|>{{ m.role }}<|message|>{{ m.content }}"
    "{% if m.role == 'assistant' and loop.last and not add_generation_prompt %}<|return|>"
    "{% else %}<|end|>{% endif %}{% endfor %}{% if add_generation_prompt %}<|start|>assistant"
    "{% endif %}")
TEMPLATES = {"chatml": ("qwen3_moe", CHATML), "llama2": ("mixtral", None),
             "llama3": ("qwen3_moe", LLAMA3), "thinking": ("qwen3_moe", THINKING),
             "tools": ("qwen3_moe", TOOLS), "harmony": ("qwen3_moe", HARMONY), "k2": ("k2", None)}


@pytest.fixture(scope="module")
def jinja_tokenizer(tmp_path_factory):
    cache = {}

    def get(name):
        if name not in cache:
            tokenizer, template = TEMPLATES[name]
            path = tmp_path_factory.mktemp(name)
            if tokenizer == "k2":
                write_kimi_tokenizer_files(path, flavor="k2")
                tok = load_kimi_tokenizer(path)
            else:
                write_bpe_tokenizer_files(path, tokenizer)
                tok = load_tokenizer(path)
            if template is not None:
                tok._tokenizer.chat_template = template
            cache[name] = tok
        return cache[name]

    return get


def long_conversation(name, n=12):
    """n exchanges in the template's kind of conversation, with what trips a
    renderer up: contents that need trimming, empty contents, reasoning, tool calls,
    private-use characters (what a renderer might mark contents with)."""
    msgs = [{"role": "system", "content": "be brief \ue000\ue0001\ue000\ue001"}]
    for i in range(n):
        msgs.append({"role": "user", "content": f"question {i} about the experts "})
        reply = {"role": "assistant", "content": f"answer {i}: they stream from disk"}
        if name == "thinking" and i % 2:
            reply["reasoning_content"] = f"step {i}"
        if name == "tools" and i % 3 == 1:
            msgs.append({**reply, "content": "", "tool_calls": [CALL]})
            msgs.append({"role": "tool", "tool_call_id": "c1", "content": f"{i} hits"})
        msgs.append(reply)
    return msgs


def counting_renders(monkeypatch):
    """How many times the chat template renders a conversation while a line is prepared."""
    renders = []
    render = score_lines.chat_prompt

    def counting(*args, **kwargs):
        renders.append(len(args[1]))
        return render(*args, **kwargs)

    monkeypatch.setattr(score_lines, "chat_prompt", counting)
    return renders


@pytest.mark.parametrize("thinking", [True, False])
@pytest.mark.parametrize("content_only", [False, True])
@pytest.mark.parametrize("template", TEMPLATES)
def test_a_jinja_template_gives_the_definitions_tokens_and_mask_from_a_few_renders(
        jinja_tokenizer, monkeypatch, template, thinking, content_only):
    tok, msgs = jinja_tokenizer(template), long_conversation(template)
    try:
        tokens, scored = by_definition(tok, msgs, thinking, content_only)
    except AssertionError:  # the template is not a sequence of its turns
        with pytest.raises(ValueError, match="not render the conversation up to"):
            prepare(Request("1", 1, 1, spec={"id": 1, "messages": msgs}), tok, thinking,
                    content_only)
        return
    renders = counting_renders(monkeypatch)
    item = prepare(Request("1", 1, 1, spec={"id": 1, "messages": msgs}), tok, thinking,
                   content_only)
    assert item.tokens == tokens
    assert (item.scored == scored).all() and scored.any()
    # the definition renders 1 + 2 (3 with content_only) per turn: 25 (37) and more
    assert len(renders) <= 24, renders


def test_a_hostile_template_renders_each_prefix_and_keeps_the_definitions_answer(
        jinja_tokenizer, monkeypatch):
    """A template that renders a message by its place (here the fifth reply
    differently), not by what it holds, is found out and rendered turn by turn."""
    tok = jinja_tokenizer("chatml")
    monkeypatch.setattr(tok._tokenizer, "chat_template", CHATML_BY_PLACE)
    msgs = long_conversation("chatml")
    tokens, scored = by_definition(tok, msgs, True, True)
    renders = counting_renders(monkeypatch)
    item = prepare(Request("1", 1, 1, spec={"id": 1, "messages": msgs}), tok, True, True)
    assert item.tokens == tokens and (item.scored == scored).all()
    assert len(renders) > 3 * 12  # turn by turn


CHATML_BY_PLACE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% if loop.index0 == 10 and m.content %}!{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.mark.parametrize("content_only", [False, True])
def test_score_renders_a_conversation_as_often_whatever_its_length(
        converted, tmp_path, monkeypatch, content_only):
    """`deltafin-run score` with a messages line of 8 or 48 exchanges (Qwen's
    ChatML template): the same number of renders, so preparing it is linear in its
    length (each render is)."""
    counts = []
    for n in (8, 48):
        src, out = tmp_path / f"chat{n}.jsonl", tmp_path / f"out{n}.jsonl"
        src.write_text(json.dumps({"id": 1, "messages": exchanges(n)}) + "\n")
        renders = counting_renders(monkeypatch)
        assert main(["score", str(converted("qwen3_moe")), str(src), "-o", str(out),
                     "--budget", "200MB"] + ["--content-only"] * content_only) == 0
        assert json.loads(out.read_text())["scored_tokens"] > 0
        counts.append(len(renders))
    assert counts[0] == counts[1] <= 24, counts
