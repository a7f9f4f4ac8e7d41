"""Options parsed as a user writes them, and options that would do nothing refused in one line."""

import json

import pytest

from deltafin_mlx.cli.main import main

from helpers import one_error_line, one_line_error, run_command, run_tool


def run_json(*args):
    p = run_command([*args, "--json", "--budget", "200MB"])
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


def test_stop_before_the_prompt_takes_one_value_and_repeats(converted):
    model = converted("kimi_k3")
    text = run_json(model, "Hello", "-n", "24", "--raw")["text"]
    first, second = text[4:6], text[12:14]
    assert first.strip() and second.strip()
    cut = run_json(model, "--stop", second, "--stop", first, "Hello", "-n", "24", "--raw")
    assert cut["text"] == text[: min(text.index(first), text.index(second))]
    assert cut["finish_reason"] == "stop"


@pytest.mark.parametrize("args,words", [
    (["{model}", "--chat", "--json"], ["--json does not work with --chat"]),
    (["{model}", "--chat", "--trace-routing", "t.jsonl"], ["--trace-routing does not work with --chat"]),
    (["{model}", "--chat", "--raw"], ["--raw does not work with --chat"]),
    (["{model}", "Hello", "--chat"], ["--chat", "drop the prompt"]),
    (["{model}", "Hello", "--raw", "--no-think"], ["--no-think", "--raw"]),
    (["{model}", "Hello", "--demo-dir", "x"], ["--demo-dir only applies with --demo"]),
    (["--demo", "{model}", "Hello"], ["--demo runs its own model"]),
    (["plan", "{model}", "--bits", "8"], ["--bits", "already converted", "config.json"]),
    (["plan", "{model}", "--expert-group-size", "32"], ["--expert-group-size", "already converted"]),
    (["plan", "{model}", "--context", "-5"], ["--context must be at least 1"]),
    (["plan", "{model}", "--context", "0"], ["--context must be at least 1"]),
    (["plan", "{model}", "--context", "9999999"], ["beyond this model's maximum of 1,048,576"]),
])
def test_options_that_would_do_nothing_are_refused_in_one_line(args, words, converted, capsys):
    args = [a.format(model=converted("kimi_k3")) for a in args]
    assert main(args) == 1
    one_error_line(capsys.readouterr().err, *words)


def test_no_think_with_a_thinking_effort_is_refused_in_one_line(converted):
    err = one_line_error(run_tool("deltafin-run", converted("kimi_k3"), "Hi", "--no-think",
                             "--thinking-effort", "high"))
    assert "--thinking-effort" in err and "--no-think" in err
