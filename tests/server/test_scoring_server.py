"""`deltafin-run serve` as an evaluation and teacher server, on loopback: /v1/completions'
`echo` with `logprobs` and `max_tokens` 0 or 1 gives the prompt's tokens with
`score`'s log-probabilities (the first null), vLLM's `prompt_logprobs` gives per
position the prompt's token and the top N with their ranks, lm-eval's own
`local-completions` model gets `deltafin-lm-eval`'s log-likelihoods, concurrent
scoring requests (and a generation beside them) all get their own answers, and a bad
scoring request is a one-line 400."""

import json
import shutil
import threading
from types import SimpleNamespace

import pytest
from mlx_lm.server import CompletionRequest
from mlx_lm.utils import load_tokenizer

import deltafin_mlx
from deltafin_mlx import compat
from deltafin_mlx.engine.load import load
from deltafin_mlx.engine.runtime import runtime
from deltafin_mlx.generation.engine import chat_prompt
from deltafin_mlx.model.config import eos_token_ids
from deltafin_mlx.testing.server import free_port, post, start_server, stop_server
from helpers import reseal

BUDGET = "200MB"
TEXTS = ["the experts stream from disk while the trunk stays in memory",
         "def route(x): return x"]
TOP = 3


@pytest.fixture(scope="module")
def served(converted, tmp_path_factory):
    model = converted("qwen3_moe")
    port = free_port()
    log = tmp_path_factory.mktemp("serve") / "server.log"
    proc = start_server(model, port, BUDGET, log, server="deltafin", context=512)
    yield model, port
    stop_server(proc)


@pytest.fixture(scope="module")
def local(served):
    """The same model loaded in this process: `score`'s values."""
    model, tok = load(served[0], BUDGET, warm_start=False)
    yield model, tok
    runtime(model).close()


def completions(port, body):
    status, reply = post(port, "/v1/completions", body)
    assert status == 200, reply
    return reply


def test_echo_gives_the_prompts_tokens_with_scores_logprobs(served, local):
    model, tok = local
    want = deltafin_mlx.score(model, tok, TEXTS, top_logprobs=TOP)
    for text, w in zip(TEXTS, want):
        reply = completions(served[1], {"prompt": text, "echo": True, "logprobs": TOP,
                                        "max_tokens": 0})
        (choice,) = reply["choices"]
        assert choice["text"] == text
        lp = choice["logprobs"]
        assert lp["token_ids"] == w["tokens"]
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert lp["text_offset"][0] == 0 and len(lp["tokens"]) == len(w["tokens"])
        for got, value in zip(lp["token_logprobs"][1:], w["token_logprobs"][1:]):
            assert got == pytest.approx(value, abs=1e-5)
        for alternatives, ids in zip(lp["top_tokens"][1:], w["top_ids"][1:]):
            assert [a["id"] for a in alternatives] == ids
        assert reply["usage"]["prompt_tokens"] == len(w["tokens"])
        assert reply["usage"]["completion_tokens"] == 0


def test_one_more_token_is_the_greedy_reply_after_the_prompt(served):
    text = TEXTS[0]
    echoed = completions(served[1], {"prompt": text, "echo": True, "logprobs": 1,
                                     "max_tokens": 1, "temperature": 0})["choices"][0]
    generated = completions(served[1], {"prompt": text, "logprobs": 1, "max_tokens": 1,
                                        "temperature": 0})["choices"][0]
    assert echoed["text"] == text + generated["text"]
    assert echoed["logprobs"]["token_ids"][-1] == generated["logprobs"]["token_ids"][0]
    assert echoed["logprobs"]["token_logprobs"][-1] == pytest.approx(
        generated["logprobs"]["token_logprobs"][0], abs=1e-4)
    # and a longer reply is generated after the scored prompt, its tokens the plain reply's
    longer = completions(served[1], {"prompt": text, "echo": True, "logprobs": 1,
                                     "max_tokens": 4, "temperature": 0})["choices"][0]
    plain = completions(served[1], {"prompt": text, "logprobs": 1, "max_tokens": 4,
                                    "temperature": 0})["choices"][0]
    assert longer["text"] == text + plain["text"]
    n = len(plain["logprobs"]["token_ids"])
    assert longer["logprobs"]["token_ids"][-n:] == plain["logprobs"]["token_ids"]
    assert longer["logprobs"]["token_logprobs"][0] is None
    assert longer["logprobs"]["text_offset"][-n] == len(text)


def test_prompt_logprobs_are_vllms_shape_with_scores_values(served, local):
    model, tok = local
    (w,) = deltafin_mlx.score(model, tok, [TEXTS[1]], top_logprobs=2)
    reply = completions(served[1], {"prompt": TEXTS[1], "prompt_logprobs": 2, "max_tokens": 0})
    entries = reply["choices"][0]["prompt_logprobs"]
    assert reply["choices"][0]["prompt_token_ids"] == w["tokens"]
    assert entries[0] is None and len(entries) == len(w["tokens"])
    for token, value, ids, values, entry in zip(w["tokens"][1:], w["token_logprobs"][1:],
                                                w["top_ids"][1:], w["top_logprobs"][1:],
                                                entries[1:]):
        pairs = list(zip(ids, values))
        own = entry[str(token)]
        assert own["logprob"] == pytest.approx(value, abs=1e-5)
        assert own["decoded_token"] == tok.decode([token])
        for rank, (i, v) in enumerate(pairs, 1):
            assert entry[str(i)]["logprob"] == pytest.approx(v, abs=1e-5)
            assert entry[str(i)]["rank"] == rank or i == token
        assert own["rank"] >= 1 and (own["rank"] == 1) == (token == pairs[0][0])
        assert set(entry) <= {str(token), *(str(i) for i, _ in pairs)}
    # a chat's, at the top of its response (vLLM's place), the template's tokens
    status, chat = post(served[1], "/v1/chat/completions", {
        "messages": [{"role": "user", "content": TEXTS[0]}], "prompt_logprobs": 1,
        "max_tokens": 0})
    assert status == 200, chat
    assert chat["prompt_logprobs"][0] is None
    assert len(chat["prompt_logprobs"]) == len(chat["prompt_token_ids"]) > len(w["tokens"])
    assert chat["choices"][0]["message"]["content"] == ""
    # with a reply generated after it, the same prompt's scores
    status, replied = post(served[1], "/v1/chat/completions", {
        "messages": [{"role": "user", "content": TEXTS[0]}], "prompt_logprobs": 1,
        "max_tokens": 3, "temperature": 0})
    assert status == 200, replied
    assert replied["prompt_token_ids"] == chat["prompt_token_ids"]
    assert replied["usage"]["completion_tokens"] >= 1
    for a, b in zip(replied["prompt_logprobs"][1:], chat["prompt_logprobs"][1:]):
        assert a.keys() == b.keys()
        for key in a:
            assert a[key]["logprob"] == pytest.approx(b[key]["logprob"], abs=1e-5)


def test_lm_evals_local_completions_equals_deltafin_lm_eval(served, local):
    from lm_eval.api.instance import Instance
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    from deltafin_mlx.jobs.lm_eval_model import DeltafinLM

    model_dir, port = served
    pairs = [("The experts stream from", " disk"), ("The experts stream from", " memory"),
             ("def route(x): return", " x"), ("def route(x): return", " 12 + x")]
    requests = [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)]
    client = LocalCompletionsAPI(base_url=f"http://127.0.0.1:{port}/v1/completions",
                                 tokenizer_backend="huggingface", tokenizer=str(model_dir),
                                 max_retries=1, timeout=120)
    got = client.loglikelihood(requests, disable_tqdm=True)
    lm = DeltafinLM(model=str(model_dir), budget=BUDGET)
    try:
        want = lm.loglikelihood(requests)
    finally:
        runtime(lm.model).close()
    for pair, (logprob, greedy), (w_logprob, w_greedy) in zip(pairs, got, want):
        assert logprob == pytest.approx(w_logprob, abs=1e-4), pair
        assert greedy == w_greedy, pair


def test_concurrent_scoring_requests_each_get_their_own_answer(served):
    port = served[1]
    bodies = [{"prompt": [t], "echo": True, "logprobs": 1, "max_tokens": 0} for t in TEXTS]
    alone = [completions(port, b)["choices"][0]["logprobs"] for b in bodies]
    answers, errors = {}, []

    def ask(i):
        try:
            answers[i] = completions(port, bodies[i % 2])["choices"][0]["logprobs"]
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    def generate():
        try:
            answers["chat"] = completions(port, {"prompt": TEXTS[0], "max_tokens": 8})
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(6)]
    threads.append(threading.Thread(target=generate))
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors and len(answers) == 7, errors
    for i in range(6):
        assert answers[i]["token_ids"] == alone[i % 2]["token_ids"]
        for a, b in zip(answers[i]["token_logprobs"][1:], alone[i % 2]["token_logprobs"][1:]):
            assert a == pytest.approx(b, abs=1e-5)
    # several prompts in one request: one choice each, in order
    reply = completions(port, {"prompt": TEXTS, "echo": True, "logprobs": 1, "max_tokens": 0})
    assert [c["index"] for c in reply["choices"]] == [0, 1]
    assert [c["logprobs"]["token_ids"] for c in reply["choices"]] == [
        a["token_ids"] for a in alone]


BAD = [
    ({"prompt": "x", "echo": True, "logprobs": 11, "max_tokens": 0}, "logprobs: must be in 0..10"),
    ({"prompt": "x", "prompt_logprobs": -1, "max_tokens": 0}, "prompt_logprobs: must be in 0..20"),
    ({"prompt": "x", "prompt_logprobs": 10**9}, "prompt_logprobs: must be in 0..20"),
    ({"prompt": "x", "echo": True, "stream": True}, "stream: must be false with echo"),
    ({"prompt": [1, 2, 3]}, "prompt: a list (token ids, or several prompts) is taken with echo"),
    ({"prompt": [1, 2, 1 << 40], "echo": True, "max_tokens": 0}, "outside the vocabulary"),
    ({"prompt": [[1, 2], [3]], "echo": True, "max_tokens": 5}, "scored with max_tokens 0, or 1"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens: must be in 1.."),
]


@pytest.mark.parametrize("body, says", BAD, ids=[s.split(":")[0] + str(i)
                                                for i, (_, s) in enumerate(BAD)])
def test_a_bad_scoring_request_is_a_one_line_400(served, body, says):
    status, reply = post(served[1], "/v1/completions", body)
    assert status == 400, reply
    message = reply["error"]["message"]
    assert says in message and "\n" not in message, message
    status, reply = post(served[1], "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "x"}], "echo": True})
    assert status == 400 and "echo: is a text completion's" in reply["error"]["message"]


# A template whose thinking is off unless a request turns it on (Deltafin's own
# renderer turns it on; mlx-lm's server passes only the request's kwargs).
THINKING_OFF = ("{% if not thinking is defined %}{% set thinking = false %}{% endif %}"
                "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
                "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                "{% if thinking %}<think>\n{% else %}<think>\n\n</think>\n\n{% endif %}"
                "{% endif %}")


@pytest.fixture(scope="module")
def thinking_off(served, tmp_path_factory):
    """(model, port, stop) of a server of a copy of the model with THINKING_OFF as
    its template and the greedy token after TEXTS[0] as one more stop token."""
    stop = completions(served[1], {"prompt": TEXTS[0], "max_tokens": 1, "temperature": 0,
                                   "logprobs": 1})["choices"][0]["logprobs"]["token_ids"][0]
    root = tmp_path_factory.mktemp("thinking_off")
    model = root / "model"
    shutil.copytree(served[0], model)
    configs = [n for n in ("config.json", "generation_config.json") if (model / n).exists()]
    for name in configs:  # generation_config.json's stop tokens win, as in mlx-lm
        config = json.loads((model / name).read_text())
        config["eos_token_id"] = [*(eos_token_ids(config) or []), stop]
        (model / name).write_text(json.dumps(config))
    tokenizer_config = json.loads((model / "tokenizer_config.json").read_text())
    tokenizer_config["chat_template"] = THINKING_OFF
    (model / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    reseal(model, *configs, "tokenizer_config.json")
    port = free_port()
    proc = start_server(model, port, BUDGET, root / "server.log", server="deltafin",
                        context=512)
    yield model, port, stop
    stop_server(proc)


def test_a_scored_chat_prompt_is_the_prompt_its_reply_is_generated_from(thinking_off):
    model, port, _ = thinking_off
    messages = [{"role": "user", "content": TEXTS[1]}]
    tok = load_tokenizer(model)
    provider = SimpleNamespace(processor=None, cli_args=SimpleNamespace(chat_template_args={}))
    want = compat.server_prompt_tokens(SimpleNamespace(model_provider=provider), tok,
                                       CompletionRequest("chat", "", messages, None, None),
                                       SimpleNamespace(chat_template_kwargs=None))
    assert want != chat_prompt(tok, messages)  # thinking on: not this request's prompt
    body = {"messages": messages, "max_tokens": 1, "temperature": 0}
    status, scored = post(port, "/v1/chat/completions", {**body, "prompt_logprobs": 1})
    assert status == 200, scored
    status, plain = post(port, "/v1/chat/completions", body)
    assert status == 200, plain
    assert scored["prompt_token_ids"] == want
    assert scored["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"] == len(want)
    (a,), (b,) = scored["choices"], plain["choices"]
    assert a["finish_reason"] == b["finish_reason"]
    for key in ("content", "reasoning"):
        assert a["message"].get(key) == b["message"].get(key), key


def test_a_stop_token_read_from_the_pass_ends_the_reply_as_generation_does(thinking_off):
    _, port, stop = thinking_off
    body = {"prompt": TEXTS[0], "max_tokens": 1, "temperature": 0}
    plain = completions(port, body)["choices"][0]
    assert plain["finish_reason"] == "stop" and plain["text"] == ""  # the stop token
    scored = completions(port, {**body, "prompt_logprobs": 0})["choices"][0]
    echoed = completions(port, {**body, "echo": True, "logprobs": 1})["choices"][0]
    assert scored["finish_reason"] == echoed["finish_reason"] == "stop"
    assert scored["text"] == "" and echoed["text"] == TEXTS[0]
    assert echoed["logprobs"]["token_ids"][-1] == stop
