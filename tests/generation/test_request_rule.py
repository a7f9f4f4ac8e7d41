"""One rule for a request, wherever it comes in (generation/request.py): the same
body sent to `serve`, written as a `batch` line (OpenAI's Batch format for both
endpoints, and Deltafin's own lines) or, where a flag exists, given on the
command line gets the same verdict and the same meaning: accepted with the same
prompt and sampling, or refused naming the same field. And the same tokens
become the same text: `run --json`, `batch` and `serve` write the same `text`
and `thinking` (generation/render.py), and the context limit is one rule."""

import json
import subprocess
import sys

import pytest

from deltafin_mlx.testing.server import chat as chat_reply
from deltafin_mlx.testing.server import free_port, post, start_server, stop_server
from deltafin_mlx.cli.batch import batch_parser
from deltafin_mlx.cli.options import check_request_flags, defaults_of
from deltafin_mlx.errors import ContextError, RequestError, UsageError
from deltafin_mlx.generation.request import (INFORMATIONAL_FIELDS, READ_FIELDS,
                                             GenerationRequest, RequestLimits, fit_max_tokens)
from deltafin_mlx.generation.engine import prompt_tokens
from deltafin_mlx.generation.render import opens_thinking, render
from deltafin_mlx.jobs.batch_lines import batch_request, read_requests
from deltafin_mlx.server.schema import read_completion
from deltafin_mlx.testing.tokenizers import write_kimi_tokenizer_files
from deltafin_mlx.tokenizer.kimi import load_kimi_tokenizer

CHAT, TEXT = "/v1/chat/completions", "/v1/completions"
LIMITS = RequestLimits(vocab=1024, context=512, max_text_bytes=1 << 20)
HELLO = [{"role": "user", "content": "Hello"}]


def chat(**fields):
    return {"model": "any", "messages": HELLO, **fields}


def text(prompt="Hello", **fields):
    return {"model": "any", "prompt": prompt, **fields}


# (url, body, the field it is refused for, or None: accepted)
TABLE = [
    (CHAT, chat(), None),
    (TEXT, text(), None),
    (TEXT, text(""), "prompt"),
    (TEXT, text(5), "prompt"),
    (CHAT, chat(prompt="Hello"), "prompt"),
    (TEXT, text(messages=HELLO), "messages"),
    (CHAT, {"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    (CHAT, chat(temperature=0.7), None),
    (CHAT, chat(temperature=500), "temperature"),
    (CHAT, chat(temperature=-1), "temperature"),
    (TEXT, text(top_p=0), None),
    (TEXT, text(top_p=1.5), "top_p"),
    (CHAT, chat(top_k=5, temperature=0.5), None),
    (CHAT, chat(top_k=10 ** 9), "top_k"),
    (CHAT, chat(min_p=0.05), None),
    (CHAT, chat(min_p=-0.1), "min_p"),
    (CHAT, chat(repetition_penalty=1.1), None),
    (CHAT, chat(repetition_penalty=1e-40), "repetition_penalty"),
    (CHAT, chat(presence_penalty=0.5), None),
    (CHAT, chat(presence_penalty=200), "presence_penalty"),
    (CHAT, chat(frequency_penalty=-0.5), None),
    (CHAT, chat(frequency_penalty="1"), "frequency_penalty"),
    (CHAT, chat(repetition_context_size=10 ** 9), "repetition_context_size"),
    (CHAT, chat(presence_context_size=8), None),
    (CHAT, chat(xtc_probability=0.5, xtc_threshold=0.2), None),
    (CHAT, chat(xtc_probability=2), "xtc_probability"),
    (CHAT, chat(min_tokens_to_keep=5), "min_tokens_to_keep"),
    (CHAT, chat(seed=7, temperature=0.8), None),
    (CHAT, chat(seed=-1), "seed"),
    (CHAT, chat(seed=2 ** 70), "seed"),
    (CHAT, chat(stop="\n"), None),
    (CHAT, chat(stop=[""]), "stop[0]"),
    (CHAT, chat(stop=[f"s{i}" for i in range(100)]), "stop"),
    (CHAT, chat(logprobs=True), None),
    (CHAT, chat(logprobs=True, top_logprobs=5), None),
    (CHAT, chat(top_logprobs=50), "top_logprobs"),
    (TEXT, text(logprobs=3), None),  # OpenAI's legacy count of top tokens
    (TEXT, text(logprobs=11), "logprobs"),
    (CHAT, chat(max_tokens=8), None),
    (CHAT, chat(max_tokens=0), "max_tokens"),
    (CHAT, chat(max_completion_tokens=8, max_tokens=3), None),
    (CHAT, chat(logit_bias={"5": -1}), None),
    (CHAT, chat(logit_bias={"99999": 1}), "logit_bias"),
    (CHAT, chat(n=1), None),
    (CHAT, chat(n=2), "n"),
    (CHAT, chat(user="u1", metadata={"k": "v"}, store=False, service_tier="auto",
                parallel_tool_calls=True), None),
    (TEXT, text(best_of=1, echo=False, suffix=""), None),
    (CHAT, chat(echo=True), "echo"),  # a text completion's; a chat takes prompt_logprobs
    (TEXT, text(echo="yes"), "echo"),
    (TEXT, text(prompt_logprobs=21), "prompt_logprobs"),
    (CHAT, chat(prompt_logprobs=-1), "prompt_logprobs"),
    (TEXT, text(prompt=[1, 2]), "prompt"),  # token ids: with echo or prompt_logprobs only
    (CHAT, chat(tool_choice="required"), "tool_choice"),
    (CHAT, chat(temprature=0.5), "temprature"),
    (CHAT, chat(chat_template_kwargs={"thinking": False}), None),
    (CHAT, chat(chat_template_kwargs={"x": [1]}), "chat_template_kwargs"),
    (CHAT, chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}]),
     None),
    (CHAT, chat(tools="x"), "tools"),
    (CHAT, chat(adapters="/tmp"), "adapters"),
    (CHAT, chat(stream=False, stream_options={"include_usage": True}), None),
    (CHAT, chat(draft_model="/tmp"), "draft_model"),
    (CHAT, chat(frequency_context_size=8), None),
    (CHAT, chat(xtc_probability=0.5, xtc_threshold=0.8), "xtc_threshold"),
]


# What serve scores (echo, prompt_logprobs) and a batch refuses: `score` scores a file.
SCORING = [
    (TEXT, text(echo=True, logprobs=1, max_tokens=0)),
    (TEXT, text(prompt=[[1, 2, 3], "two"], echo=True, max_tokens=1)),
    (TEXT, text(prompt_logprobs=20)),
    (CHAT, chat(prompt_logprobs=0, max_tokens=0)),
]


@pytest.mark.parametrize("url,body", SCORING, ids=[str(i) for i in range(len(SCORING))])
def test_serve_scores_a_prompt_that_a_batch_line_refuses(url, body):
    req = served(url, body)
    assert isinstance(req, GenerationRequest) and req.scoring, req
    assert not {"echo", "prompt_logprobs", "prompts"} & set(req.mlx_lm_body())
    for line in ({"custom_id": "r", "method": "POST", "url": url, "body": body},
                 {"id": "r", **body}):
        verdict = batched(line, raw=url == TEXT)
        assert isinstance(verdict, str) and "is serve's" in verdict, verdict
    # mlx_lm.server through the drop-in (its guard checks by serve's schema) scores none
    from deltafin_mlx.server.schema import check_completion

    with pytest.raises(RequestError, match="mlx_lm.server does not score prompts"):
        check_completion(body, url == CHAT, LIMITS)


def test_the_table_holds_every_field_a_request_takes_and_openais_bookkeeping():
    used = {k for _, body, _ in TABLE + [(u, b, None) for u, b in SCORING] for k in body}
    every = READ_FIELDS | INFORMATIONAL_FIELDS
    assert every <= used, every - used
    assert {url for url, _, _ in TABLE} == {CHAT, TEXT} and len(TABLE) >= 25

# Request fields a command-line flag sets (batch's parser has every one of them).
FLAGS = {"temperature": "--temp", "top_p": "--top-p", "top_k": "--top-k", "min_p": "--min-p",
         "repetition_penalty": "--repetition-penalty", "presence_penalty": "--presence-penalty",
         "frequency_penalty": "--frequency-penalty", "seed": "--seed", "stop": "--stop",
         "max_tokens": "-n", "top_logprobs": "--top-logprobs"}
PROMPT_FIELDS = {"model", "messages", "prompt"}


def field_of(message: str) -> str:
    return message.split(":", 1)[0]


def served(url, body):
    """serve's verdict: the request, or the refusal's message."""
    try:
        return read_completion(body, url == CHAT, LIMITS)
    except RequestError as e:
        return str(e)


def batched(line: dict, raw=False):
    """batch's verdict on one line, read as a job reads it (error lines lose their
    "line N: " prefix)."""
    (req,) = read_requests([json.dumps(line)])
    try:
        if req.error:
            raise RequestError(req.error)
        return batch_request(req.spec, LIMITS, raw=raw)
    except ValueError as e:
        return str(e).split(": ", 1)[1] if str(e).startswith("line ") else str(e)


def flaggable(field, value) -> bool:
    """Whether a flag can say what the body says (a flag's text has no JSON type)."""
    if field == "stop":
        return isinstance(value, str) or all(isinstance(x, str) for x in value)
    return field in FLAGS and isinstance(value, (int, float)) and not isinstance(value, bool)


def flagged(body, capsys):
    """The command line's verdict on the body's sampling fields, where every one of
    them has a flag: (args, None) or (None, the error it printed), or None
    without. The flags are checked as `deltafin-run batch` checks them, as they are
    parsed and then with the loaded model's limits."""
    fields = {k: v for k, v in body.items() if k not in PROMPT_FIELDS}
    if not all(flaggable(k, v) for k, v in fields.items()):
        return None
    argv = ["model", "in.jsonl", "-o", "out.jsonl"]
    for k, v in fields.items():
        for x in (v if isinstance(v, list) else [v]):
            argv += [FLAGS[k], str(x)]
    try:
        args = batch_parser().parse_args(argv)
        check_request_flags(args, limits=LIMITS)
        return args, None
    except SystemExit:
        return None, capsys.readouterr().err
    except UsageError as e:
        return None, str(e)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    root = tmp_path_factory.mktemp("tok")
    write_kimi_tokenizer_files(root, flavor="k3")
    return load_kimi_tokenizer(root)


@pytest.mark.parametrize("url,body,refused", TABLE,
                         ids=[f"{i}-{r or 'ok'}" for i, (_, _, r) in enumerate(TABLE)])
def test_serve_batch_and_the_command_line_agree_on_every_request(url, body, refused, tokenizer,
                                                                   capsys):
    serve = served(url, body)
    openai_line = batched({"custom_id": "r", "method": "POST", "url": url, "body": body})
    # Deltafin's own line: a conversation, or with --raw a text as it is (its
    # format says which by the key, "prompt" or "messages", so a body with both
    # or the other is refused there in words of its own)
    own_line = batched({"id": "r", **body}, raw=url == TEXT)
    if refused is None:
        assert isinstance(serve, GenerationRequest), serve
        assert openai_line == serve and own_line == serve
        assert prompt_tokens(openai_line, tokenizer) == prompt_tokens(serve, tokenizer)
    else:
        assert isinstance(serve, str) and field_of(serve) == refused, serve
        assert openai_line == serve
        if refused not in ("prompt", "messages"):
            assert own_line == serve
    cli = flagged(body, capsys)
    if cli is not None:
        args, error = cli
        if refused is None:
            assert args is not None, error
            assert defaults_of(args).sampling == serve.sampling()
            assert (args.seed, args.stop) == (serve.seed, serve.stop)
            assert args.max_tokens == (serve.max_tokens or 256)  # batch's -n default
        elif refused.split("[")[0] in FLAGS:  # else the refusal is not a flag's
            field = refused.split("[")[0]
            assert error and FLAGS[field] in error and field in error, error


def test_a_completions_line_is_its_text_as_it_is_a_chat_line_goes_through_the_template(
        tokenizer):
    as_text = batched({"custom_id": 1, "url": TEXT, "body": text("Hello")})
    as_chat = batched({"custom_id": 2, "url": CHAT, "body": chat()})
    assert prompt_tokens(as_text, tokenizer) == list(tokenizer.encode("Hello"))
    assert len(prompt_tokens(as_chat, tokenizer)) > len(prompt_tokens(as_text, tokenizer))
    own = batched({"id": 3, "prompt": "Hello"})  # Deltafin's own line: the user's message
    assert prompt_tokens(own, tokenizer) == prompt_tokens(as_chat, tokenizer)


def test_the_context_rule_cuts_max_tokens_and_refuses_only_a_prompt_with_no_room():
    assert fit_max_tokens(100, 2 ** 31, 512) == 412
    assert fit_max_tokens(100, 8, 512) == 8
    assert fit_max_tokens(511, 8, 512) == 1
    with pytest.raises(ContextError, match="the prompt is 512 tokens, beyond the planned "
                                           "context of 512 tokens"):
        fit_max_tokens(512, 8, 512)


def test_the_render_rule_splits_thinking_hides_markup_and_cuts_the_answer_at_a_stop(
        tokenizer):
    enc = lambda s: tokenizer.encode(s, add_special_tokens=False)  # noqa: E731
    special = tokenizer.convert_tokens_to_ids
    reply = (enc("let me see") + [special("<|close|>")] + enc("think") + [special("<|sep|>")]
             + [special("<|open|>")] + enc("response") + [special("<|sep|>")]
             + enc("the answer. And more") + [special("<|end_of_msg|>")])
    assert render(tokenizer, reply) == ("the answer. And more", "let me see")
    assert render(tokenizer, reply, stop=["."]) == ("the answer", "let me see")
    # a prompt with thinking off (or a text completion) opens the answer
    assert render(tokenizer, enc("plain"), thinking=False) == ("plain", "")
    # the reply starts where the prompt leaves it: in the channel it opened last
    chat = [{"role": "user", "content": "Hi"}]
    opened = lambda on: opens_thinking(tokenizer, tokenizer.apply_chat_template(  # noqa: E731
        chat, add_generation_prompt=True, tokenize=True, thinking=on))
    assert opened(True) and not opened(False)
    assert not opens_thinking(tokenizer, enc("plain <|open|>think"))


# --- end to end: a real batch job and a real server --------------------------------

CONTEXT = 512
PROMPT = "Tell me about the fox and the dog."
E2E = [  # (id, url, body, refused)
    ("completion", TEXT, text("Hello", max_tokens=6), None),
    ("chat", CHAT, chat(max_tokens=6, user="u1", presence_penalty=0.5, logprobs=True), None),
    ("hot", CHAT, chat(temperature=500), "temperature"),
    ("empty", TEXT, text(""), "prompt"),
    ("long", CHAT, chat(max_tokens=2 ** 31), None),  # cut to the context, not refused
]


@pytest.fixture(scope="module")
def model(converted):
    return str(converted("kimi_k3"))


@pytest.fixture(scope="module")
def server(model, tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("serve") / "server.log"
    proc = start_server(model, port, "40MB", log, server="deltafin", context=CONTEXT)
    yield port
    stop_server(proc)


def deltafin_run(*args):
    return subprocess.run([sys.executable, "-m", "deltafin_mlx.cli.main", *args],
                          capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def batch_results(model, tmp_path_factory):
    root = tmp_path_factory.mktemp("batch")
    lines = [{"custom_id": i, "method": "POST", "url": url, "body": body}
             for i, url, body, _ in E2E]
    lines.append({"id": "own", "prompt": PROMPT, "max_tokens": 8})
    (root / "in.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    p = deltafin_run("batch", model, str(root / "in.jsonl"), "-o", str(root / "out.jsonl"),
                     "--no-progress", "--budget", "200MB", "--context", str(CONTEXT))
    assert p.returncode == 3, p.stderr  # some lines are error lines
    return {r["id"]: r for r in map(json.loads, (root / "out.jsonl").read_text().splitlines())}


@pytest.mark.parametrize("rid,url,body,refused", E2E, ids=[r[0] for r in E2E])
def test_a_real_batch_job_and_a_real_server_agree(rid, url, body, refused, server,
                                                  batch_results):
    status, reply = post(server, url, body)
    got = batch_results[rid]
    if refused:
        assert status == 400 and field_of(reply["error"]["message"]) == refused, reply
        assert field_of(got["error"].split(": ", 1)[1]) == refused, got
        return
    assert status == 200, reply
    choice = reply["choices"][0]
    usage = reply["usage"]
    assert got["stats"]["prompt_tokens"] == usage["prompt_tokens"]
    assert len(got["tokens"]) == usage["completion_tokens"]
    assert usage["prompt_tokens"] + usage["completion_tokens"] <= CONTEXT
    if url == TEXT:
        assert (got["text"], got["thinking"]) == (choice["text"], "")
    else:
        message = choice["message"]
        assert got["text"] == (message["content"] or "")
        assert got["thinking"] == (message.get("reasoning") or "")
        if body.get("logprobs"):
            assert len(got["logprobs"]) == len(got["tokens"]) and choice["logprobs"]


def test_run_json_batch_and_serve_write_the_same_text_and_thinking(model, server,
                                                                  batch_results):
    """Greedy, so the tokens are the same; the text and thinking must be too."""
    p = deltafin_run(model, PROMPT, "--json", "-n", "8", "--budget", "200MB")
    assert p.returncode == 0, p.stderr
    run = json.loads(p.stdout)
    got = batch_results["own"]
    status, reply = post(server, CHAT, {"messages": [{"role": "user", "content": PROMPT}],
                                        "max_tokens": 8})
    assert status == 200, reply
    message = reply["choices"][0]["message"]
    assert run["tokens"] == got["tokens"]
    assert run["text"] + run["thinking"], "nothing to compare"
    assert (run["text"], run["thinking"]) == (got["text"], got["thinking"]) == (
        message["content"] or "", message.get("reasoning") or "")
    # streamed, the same text arrives in pieces
    assert chat_reply(server, PROMPT, 8, stream=True) == run["thinking"] + run["text"]
