"""deltafin-run end to end, the Python API, the demo, and the mlx-lm drop-in
(mlx_lm.generate and mlx_lm.server on a converted directory)."""

import json
import os
import subprocess
import urllib.request

import pytest

import deltafin_mlx
from deltafin_mlx.errors import HubError, TokenizerError, TrunkReadError
from deltafin_mlx import runtime
from helpers import BIN


def run(args, stdin=None, env=None, timeout=300):
    return subprocess.run([str(BIN / "deltafin-run"), *map(str, args)], input=stdin,
                          capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def run_json(model, prompt, *extra):
    p = run([model, prompt, "--json", "--budget", "200MB", *extra])
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


def test_run_streams_text_and_ends_with_one_stats_line(converted):
    p = run([converted("kimi_k3"), "Hello there", "-n", "12", "--budget", "200MB"])
    assert p.returncode == 0, p.stderr
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("[deltafin] 12 tokens in")
    for word in ("tok/s", "hits", "misses", "hit rate", "MB read", "stalled on reads"):
        assert word in last


def test_json_output_has_text_tokens_and_stats(converted):
    out = run_json(converted("kimi_k3"), "Hello there", "-n", "10")
    assert len(out["tokens"]) == 10 and isinstance(out["text"], str)
    for key in ("tokens_per_second", "hits", "misses", "hit_rate", "bytes_read", "stall_share"):
        assert key in out["stats"]


def test_prompt_from_stdin_equals_prompt_argument(converted):
    a = run_json(converted("kimi_k3"), "Tell me a story", "-n", "8")
    p = run([converted("kimi_k3"), "-", "--json", "--budget", "200MB", "-n", "8"],
            stdin="Tell me a story")
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["tokens"] == a["tokens"]


def test_stop_string_ends_the_text_before_it(converted):
    full = run_json(converted("kimi_k3"), "Hello", "-n", "24", "--raw")
    text = full["text"]
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    assert stop.strip()
    cut = run_json(converted("kimi_k3"), "Hello", "-n", "24", "--raw", "--stop", stop)
    assert cut["text"] == text[: text.index(stop)]
    assert cut["finish_reason"] == "stop"


def test_no_think_changes_the_prompt(converted):
    a = run_json(converted("kimi_k3"), "Hi", "-n", "4")
    b = run_json(converted("kimi_k3"), "Hi", "-n", "4", "--no-think")
    assert a["stats"]["prompt_tokens"] != b["stats"]["prompt_tokens"]


def test_sampling_options_are_reproducible_with_a_seed(converted):
    args = ("Hi", "-n", "12", "--temp", "0.8", "--top-p", "0.9", "--top-k", "20", "--seed", "3")
    assert run_json(converted("kimi_k3"), *args)["tokens"] == run_json(converted("kimi_k3"), *args)["tokens"]


def test_chat_keeps_history_and_answers_commands(converted):
    script = "Hello\n/stats\nAnd then?\n/reset\nHello\n/quit\n"
    p = run([converted("kimi_k3"), "--chat", "-n", "6", "--budget", "200MB"], stdin=script)
    assert p.returncode == 0, p.stderr
    assert p.stderr.count("[deltafin] 6 tokens in") == 3
    assert "hit rate" in p.stderr and "[history cleared]" in p.stderr


def test_bench_subcommand_reports_tokens_per_second(converted):
    p = run(["bench", converted("qwen3_moe"), "-n", "4", "--repeats", "2", "--json"])
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout)
    assert r["tokens_per_second_median"] > 0 and len(r["runs"]) == 2


def test_trace_routing_writes_one_line_per_token(converted, tmp_path):
    trace = tmp_path / "trace.jsonl"
    p = run([converted("kimi_k3"), "Hi", "--raw", "-n", "5", "--budget", "200MB",
             "--trace-routing", trace])
    assert p.returncode == 0, p.stderr
    lines = [json.loads(l) for l in trace.read_text().splitlines()]
    assert [l["tok"] for l in lines] == list(range(len(lines)))
    assert len(lines) >= 5  # prompt tokens and generated tokens
    assert all(len(l["layers"]) == 3 and all(len(ids) == 4 for ids in l["layers"]) for l in lines)


def test_demo_builds_converts_and_streams(tmp_path):
    p = run(["--demo", "--demo-dir", tmp_path / "demo", "-n", "8"])
    assert p.returncode == 0, p.stderr
    assert "meaningless" in p.stderr
    assert "of 320 experts fit (25%)" in p.stderr
    assert p.stderr.strip().splitlines()[-1].startswith("[deltafin] 8 tokens in")


# --- Python API ---------------------------------------------------------------------


def test_python_api_generate_and_stream_generate(converted):
    model, tokenizer = deltafin_mlx.load(converted("kimi_k3"), memory_budget="200MB", cache_slots=6)
    done = deltafin_mlx.generate(model, tokenizer, "Hello", max_tokens=6)
    assert len(done.tokens) == 6 and done.stats.tokens == 6 and done.stats.misses > 0
    streamed = list(deltafin_mlx.stream_generate(model, tokenizer, "Hello", max_tokens=6))
    assert [r.token for r in streamed] == done.tokens
    assert streamed[-1].deltafin.tokens == 6
    runtime(model).close()


# --- bad input ------------------------------------------------------------------------


@pytest.mark.parametrize("args,words", [
    (["/nonexistent/model", "hi"], ["no such model directory"]),
    (["{tmp}", "hi"], ["not a Deltafin model"]),
    (["{model}", "hi", "--budget", "lots"], ["bad memory size 'lots'"]),
    (["{model}", "hi", "--budget", "1KB"], ["below this model's floor"]),
    (["{model}", "hi", "--frobnicate"], ["unrecognized arguments: --frobnicate"]),
    (["{model}"], ["no prompt given"]),
    ([], ["no model given"]),
    (["plan", "/nonexistent"], ["no such"]),
])
def test_bad_input_is_one_line_and_a_non_zero_exit(args, words, converted, tmp_path):
    args = [a.format(tmp=tmp_path, model=converted("mixtral")) for a in args]
    p = run(args)
    assert p.returncode != 0
    err = p.stderr.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith(("deltafin-run: error:", "deltafin-run plan: error:")), err
    for w in words:
        assert w in err


@pytest.mark.parametrize("error", [
    TokenizerError("tokenizer.model: line 3 is not a token and a rank"),
    TrunkReadError("trunk/layer.3.safetensors: cannot read (Input/output error)"),
    HubError("someone/some-model: not found on the hub"),
])
def test_every_deltafin_error_is_its_message_alone(error, monkeypatch, capsys):
    """Whatever stage raises it, a DeltafinError is shown as it is: no class name, no
    --debug hint (those mark a bug)."""
    import deltafin_mlx.cli.run as run_command
    from deltafin_mlx.cli.main import main

    def fail(*args):
        raise error

    monkeypatch.setattr(run_command, "open_model", fail)
    assert main(["some-model", "hi"]) == 1
    assert capsys.readouterr().err == f"deltafin-run: error: {error}\n"


# --- the mlx-lm drop-in -------------------------------------------------------------


def test_mlx_lm_generate_runs_a_converted_directory(converted):
    p = subprocess.run(
        [str(BIN / "mlx_lm.generate"), "--model", str(converted("kimi_k3")), "--trust-remote-code",
         "--prompt", "Hello", "-m", "8", "--ignore-chat-template"],
        capture_output=True, text=True, timeout=300, env={**os.environ, "DELTAFIN_BUDGET": "200MB"},
    )
    assert p.returncode == 0, p.stderr
    assert "Generation: 8 tokens" in p.stdout


def post(port, path, body):
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return r.read().decode()


@pytest.fixture
def server(converted, tmp_path):
    from deltafin_mlx.testing.server import free_port as port_of, start_server

    port = port_of()
    proc = start_server(converted("kimi_k3"), port, "200MB", tmp_path / "server.log")
    yield port
    proc.terminate()
    proc.wait(timeout=30)


def test_mlx_lm_server_replies_equal_deltafin_run(server, converted):
    from deltafin_mlx.engine.load import open_tokenizer

    # The server's text is mlx-lm's streamed decode of the tokens (markup included);
    # deltafin-run shows only the answer, so its tokens are compared, decoded alike.
    tokens = run_json(converted("kimi_k3"), "Hello there", "-n", "10")["tokens"]
    detok = open_tokenizer(converted("kimi_k3")).detokenizer
    detok.reset()
    for t in tokens:
        detok.add_token(t)
    detok.finalize()
    expected = detok.text
    body = {"messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 10,
            "temperature": 0.0}
    reply = json.loads(post(server, "/v1/chat/completions", body))["choices"][0]["message"]
    assert (reply.get("reasoning") or reply.get("reasoning_content") or "") + (
        reply.get("content") or "") == expected

    chunks = post(server, "/v1/chat/completions", {**body, "stream": True})
    text = ""
    for line in chunks.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            delta = json.loads(line[6:])["choices"][0].get("delta", {})
            text += (delta.get("reasoning") or delta.get("reasoning_content") or "") + (
                delta.get("content") or "")
    assert text == expected


def test_mlx_lm_load_uses_deltafin_tokenizer_and_never_remote_tokenizer_code(converted, copy_of):
    """K3 ships tokenization_kimi.py for transformers (the conversion copies neither it
    nor its `auto_map`); mlx-lm loading a Deltafin directory must use Deltafin's
    tokenizer, even with remote code allowed for the model and a module planted."""
    import mlx_lm

    from deltafin_mlx.tokenizer.kimi import KimiTokenizer

    path = copy_of(converted("kimi_k3"))
    assert "auto_map" not in (path / "tokenizer_config.json").read_text()
    (path / "tokenization_kimi.py").write_text("raise RuntimeError('remote tokenizer code ran')\n")
    os.environ["DELTAFIN_BUDGET"] = "200MB"
    try:
        model, tokenizer = mlx_lm.load(str(path), tokenizer_config={"trust_remote_code": False},
                                       trust_remote_code=True)
    finally:
        del os.environ["DELTAFIN_BUDGET"]
    assert isinstance(tokenizer._tokenizer, KimiTokenizer)
    text = mlx_lm.generate(model, tokenizer, "Hello", max_tokens=4)
    assert isinstance(text, str)
    runtime(model).close()
