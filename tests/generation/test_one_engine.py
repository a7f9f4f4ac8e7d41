"""One engine under every entry point: the same greedy tokens give the same
answer, thinking and finish reason through run, chat, batch, serve, the
library, lm-eval's generate_until and the mlx-lm drop-in, with a stop string,
with K3's thinking channel, and for a model without a chat template (which
every entry point renders as mlx-lm's server does). The drop-in keeps the
plan's context across calls."""

import json
import shutil
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest

import deltafin_mlx
from deltafin_mlx.chat.session import ChatSession
from deltafin_mlx.cli.main import main
from deltafin_mlx.convert.convert import ConvertOptions, convert
from deltafin_mlx.engine.load import load
from deltafin_mlx.engine.runtime import runtime
from deltafin_mlx.generation.engine import (Completion, Defaults, Scheduler, batch, chat_prompt,
                                            complete, model_limits, prepare, stream)
from deltafin_mlx.generation.render import opens_thinking, render
from deltafin_mlx.generation.request import GenerationRequest
from deltafin_mlx.testing.server import free_port, post, start_server, stop_server

CONTENT = "Tell me about the fox and the dog."
MESSAGES = [{"role": "user", "content": CONTENT}]
N = 12
BUDGET, CONTEXT = "200MB", 1024
CASES = {"stop": "qwen3_moe", "thinking": "kimi_k3", "no-template": "qwen3_moe"}
ENTRIES = ("run", "chat", "batch", "serve", "library", "lm-eval", "drop-in")
PROCESSES = ("serve", "drop-in")  # in processes of their own: e2e (tests/conftest.py)


@pytest.fixture(scope="module")
def cases(converted, sources, tmp_path_factory):
    """case -> (model directory, model, tokenizer, stop strings, the engine's reply)."""
    untemplated = tmp_path_factory.mktemp("untemplated")
    src = untemplated / "src"
    shutil.copytree(sources("qwen3_moe"), src)
    config = json.loads((src / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (src / "tokenizer_config.json").write_text(json.dumps(config))
    (src / "chat_template.jinja").unlink(missing_ok=True)
    convert(str(src), untemplated / "model", ConvertOptions(progress=False))
    out, loaded = {}, {}
    for case, arch in CASES.items():
        path = untemplated / "model" if case == "no-template" else converted(arch)
        if path not in loaded:
            loaded[path] = load(path, BUDGET, context=CONTEXT)
        model, tok = loaded[path]
        assert getattr(tok, "has_chat_template", False) == (case != "no-template")
        stop = ()
        if case == "stop":  # a stop string the greedy reply holds, halfway through
            text = engine_reply(model, tok, ()).text
            assert len(text) >= 4, text
            stop = (text[len(text) // 2: len(text) // 2 + 2],)
        out[case] = (path, model, tok, stop, engine_reply(model, tok, stop))
    yield out
    for model, _ in loaded.values():
        runtime(model).close()


def engine_reply(model, tok, stop):
    prepared = prepare(GenerationRequest(messages=MESSAGES), tok, model_limits(model),
                       Defaults(max_tokens=N, stop=stop))
    return complete(stream(model, prepared))


def by_run(path, model, tok, stop, capsys, **_):
    capsys.readouterr()
    flags = [a for s in stop for a in ("--stop", s)]
    assert main([str(path), CONTENT, "-n", str(N), "--budget", BUDGET, "--context",
                 str(CONTEXT), "--json", *flags]) == 0
    out = json.loads(capsys.readouterr().out)
    return out["text"], out["thinking"], out["finish_reason"]


def by_chat(path, model, tok, stop, **_):
    session = ChatSession(model, tok)
    turn = session.ask(CONTENT, N, defaults=Defaults(stop=stop))
    # the history records the reply as shown: cut at the stop, the stop not in it
    assert session.messages[-1]["content"] == turn.text
    if stop:  # and the next turn's prompt is the conversation as recorded, not the tokens
        nxt = {"role": "user", "content": "And then?"}  # past the stop the model made
        assert session.prompt_for(nxt["content"]) == chat_prompt(tok, session.messages + [nxt])
    return turn.text, turn.thinking, turn.finish_reason


def by_batch(path, model, tok, stop, **_):
    (r,) = deltafin_mlx.batch_generate(model, tok, [{"messages": MESSAGES}], max_tokens=N,
                                       stop=list(stop), context=CONTEXT)
    return r["text"], r["thinking"], r["finish_reason"]


def by_library(path, model, tok, stop, **_):
    done = deltafin_mlx.generate(model, tok, MESSAGES, N, stop=stop)
    return done.text, done.thinking, done.finish_reason


def by_lm_eval(path, model, tok, stop, expected, **_):
    pytest.importorskip("lm_eval")
    from deltafin_mlx.jobs.lm_eval_model import DeltafinLM

    lm = DeltafinLM(model=str(path), budget=BUDGET, context=CONTEXT, max_gen_toks=N)
    try:
        # lm-eval's chat template gives the rendered conversation as text
        context = lm.apply_chat_template(MESSAGES)
        (text,) = lm.generate_until([SimpleNamespace(args=(context, {"until": list(stop)}))])
    finally:
        runtime(lm.model).close()
    return text, expected.thinking, expected.finish_reason  # lm-eval takes the answer only


def by_serve(path, model, tok, stop, tmp_path, **_):
    port = free_port()
    proc = start_server(path, port, BUDGET, tmp_path / "serve.log", server="deltafin",
                        context=CONTEXT)
    try:
        status, body = post(port, "/v1/chat/completions",
                            {"messages": MESSAGES, "max_tokens": N, "stop": list(stop)})
    finally:
        stop_server(proc)
    assert status == 200, body
    choice = body["choices"][0]
    return (choice["message"]["content"] or "", choice["message"].get("reasoning", ""),
            choice["finish_reason"])


def by_drop_in(path, model, tok, stop, **_):
    """mlx-lm's own generation over the drop-in: its tokens, rendered by the one rule."""
    prompt = chat_prompt(tok, MESSAGES)
    code = ("import json, mlx_lm\n"
            f"model, tok = mlx_lm.load({str(path)!r}, trust_remote_code=True)\n"
            f"print(json.dumps([r.token for r in mlx_lm.stream_generate(model, tok, {prompt!r}, "
            f"max_tokens={N})]))\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=600, env=drop_in_env(CONTEXT))
    assert p.returncode == 0, p.stderr[-2000:]
    tokens = json.loads(p.stdout.strip().splitlines()[-1])
    answer, thinking = render(tok, tokens, opens_thinking(tok, prompt), stop)
    cut = answer != render(tok, tokens, opens_thinking(tok, prompt))[0]
    ended = cut or tokens[-1] in tok.eos_token_ids
    return answer, thinking, "stop" if ended else "length"


def drop_in_env(context):
    import os

    return {**os.environ, "DELTAFIN_BUDGET": BUDGET, "DELTAFIN_CONTEXT": str(context)}


ENTRY = {"run": by_run, "chat": by_chat, "batch": by_batch, "serve": by_serve,
         "library": by_library, "lm-eval": by_lm_eval, "drop-in": by_drop_in}


def check(entry, case, cases, capsys, tmp_path):
    path, model, tok, stop, expected = cases[case]
    got = ENTRY[entry](path, model, tok, stop, capsys=capsys, tmp_path=tmp_path,
                       expected=expected)
    assert got == (expected.text, expected.thinking, expected.finish_reason)
    if case == "stop":
        assert expected.finish_reason == "stop" and stop[0] not in expected.text
    if case == "thinking":
        assert expected.thinking  # K3's prompt opens its thinking channel
    if case == "no-template":  # mlx-lm's server's rendering of a conversation
        assert chat_prompt(tok, MESSAGES) == list(tok.encode(f"USER: {CONTENT}\nASSISTANT:"))


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("entry", [e for e in ENTRIES if e not in PROCESSES])
def test_every_entry_point_gives_the_engines_answer_thinking_and_finish(
        entry, case, cases, capsys, tmp_path):
    check(entry, case, cases, capsys, tmp_path)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("entry", PROCESSES)
def test_every_process_entry_point_gives_the_engines_answer_thinking_and_finish(
        entry, case, cases, capsys, tmp_path):
    """The same, for the entry points that run in a process of their own (e2e)."""
    check(entry, case, cases, capsys, tmp_path)


@pytest.mark.parametrize("case", CASES)
def test_batch_gives_each_prepared_the_events_stream_gives_it_alone(case, cases):
    """The engine's `batch` decodes Prepareds together (three at a time, so the
    fourth takes a finished one's place): each gets the tokens, answer, thinking,
    log-probabilities and finish reason `stream` gives it alone (greedy), a stop
    string's cut and an earlier length included."""
    _, model, tok, stop, _ = cases[case]
    requests = [GenerationRequest(messages=MESSAGES, stop=list(stop), logprobs=True),
                GenerationRequest(messages=MESSAGES, max_tokens=N // 2, top_logprobs=3),
                GenerationRequest(messages=[{"role": "user", "content": "Count to five."}]),
                GenerationRequest(prompt="Hello there")]
    prepareds = [prepare(r, tok, model_limits(model), Defaults(max_tokens=N)) for r in requests]
    got, logprobs = {}, {}
    for p, e in batch(model, prepareds, Scheduler(batch_size=3)):
        assert e.stats.tokens == len(got.setdefault(id(p), Completion()).tokens) + 1
        got[id(p)].add(e)
        logprobs.setdefault(id(p), []).append(e.logprob)
    for p in prepareds:
        alone = list(stream(model, p))
        want = complete(iter(alone))
        done = got[id(p)]
        assert (done.tokens, done.text, done.thinking, done.finish_reason) == (
            want.tokens, want.text, want.thinking, want.finish_reason)
        # K3's KDA layers round a batch's prefill a few 1e-6 apart (tests/jobs/test_batch.py)
        assert logprobs[id(p)] == pytest.approx([e.logprob for e in alone], abs=1e-4)
        assert np.allclose(done.top_logprobs or [], want.top_logprobs or [], atol=1e-4)
    reasons = [got[id(p)].finish_reason for p in prepareds]
    assert reasons[1] == "length" and len(got[id(prepareds[1])].tokens) == N // 2
    if stop:
        assert reasons[0] == "stop" and stop[0] not in got[id(prepareds[0])].text
    assert max(got[id(p)].stats.mean_batch for p in prepareds) > 1  # decoded together


def test_a_text_completion_is_the_same_reply_from_the_library_and_run_raw(cases, capsys):
    """`generate(model, tok, "Hello there")` is `deltafin-run --raw --json`: its
    answer and thinking apart, markup never in the text."""
    path, model, tok, _, _ = cases["thinking"]
    done = deltafin_mlx.generate(model, tok, "Hello there", N)
    capsys.readouterr()
    assert main([str(path), "Hello there", "--raw", "-n", str(N), "--budget", BUDGET,
                 "--context", str(CONTEXT), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (done.text, done.thinking, done.tokens, done.finish_reason) == (
        out["text"], out["thinking"], out["tokens"], out["finish_reason"])
    assert "<|" not in done.text


def test_the_drop_in_refuses_a_conversation_beyond_its_plan_across_calls(converted):
    """Each prefill call of 32 fits a context of 64; the conversation does not: the
    call that would take it past 64 tokens is refused, in one line naming it."""
    code = ("import mlx_lm\n"
            f"model, tok = mlx_lm.load({str(converted('kimi_k3'))!r}, trust_remote_code=True)\n"
            "try:\n"
            "    for r in mlx_lm.stream_generate(model, tok, [100] * 200, max_tokens=21,\n"
            "                                    prefill_step_size=32):\n"
            "        pass\n"
            "except Exception as e:\n"
            "    print(type(e).__name__ + ': ' + str(e))\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=600, env=drop_in_env(64))
    assert p.returncode == 0, p.stderr[-2000:]
    line = p.stdout.strip().splitlines()[-1]
    assert line == ("ContextError: 96 tokens (64 in the prompt cache, 32 in this call), beyond "
                    "the planned context of 64 tokens (DELTAFIN_CONTEXT=N plans for more)")
