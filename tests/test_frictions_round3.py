"""Round three of what a new user trips over (issue 24), each fixed or refused in
one clear line: one-shot runs apply --system and --thinking-effort and refuse what
would do nothing, one -n convention, bench's --context, --demo with every
subcommand."""

import json

import pytest

from deltafin_mlx.cli.main import main, run_parser
from deltafin_mlx.cli.run import make_prompt
from deltafin_mlx.engine.load import open_tokenizer
from deltafin_mlx.format.model_dir import open_model_dir
from deltafin_mlx.generate import chat_prompt
from test_frictions import one_error_line


def run_json(capsys, *args):
    capsys.readouterr()
    assert main([*map(str, args), "--json"]) == 0, capsys.readouterr().err
    return json.loads(capsys.readouterr().out)


def exit_status(args):
    try:
        return main(args)
    except SystemExit as e:
        return e.code


# --- one-shot runs: --system and --thinking-effort apply, --session is refused --------


def test_one_shot_puts_the_system_message_and_thinking_effort_into_the_prompt(converted, capsys):
    model = converted("kimi_k3")
    tok = open_tokenizer(open_model_dir(model))
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    plain = run_json(capsys, model, "Hi", "-n", "1", "--budget", "200MB")
    system = run_json(capsys, model, "Hi", "-n", "1", "--budget", "200MB", "--system", "Be brief.")
    assert system["stats"]["prompt_tokens"] == len(chat_prompt(tok, msgs))
    assert system["stats"]["prompt_tokens"] > plain["stats"]["prompt_tokens"]
    args = run_parser().parse_args(["m", "Hi", "--system", "Be brief.", "--thinking-effort", "low"])
    low = make_prompt(tok, "Hi", args)
    assert low == chat_prompt(tok, msgs, thinking_effort="low") != chat_prompt(tok, msgs)


@pytest.mark.parametrize("args,words", [
    (["{model}", "Hi", "--session", "s"], ["--session only applies with --chat"]),
    (["{model}", "Hi", "--raw", "--system", "x"], ["--system", "--raw"]),
    (["{model}", "Hi", "--raw", "--thinking-effort", "low"], ["--thinking-effort", "--raw"]),
    (["{model}", "Hi", "-n", "0"], ["-n/--max-tokens", "1 or more"]),
    (["{model}", "Hi", "-n", "-1"], ["-n/--max-tokens", "1 or more"]),
    (["{model}", "--chat", "-n", "0"], ["-n/--max-tokens", "1 or more"]),
    (["bench", "{model}", "-n", "0"], ["-n/--max-tokens", "1 or more"]),
    (["batch", "{model}", "in.jsonl", "-o", "out.jsonl", "-n", "0"], ["-n/--max-tokens", "1 or more"]),
    (["bench", "{model}", "--context", "256", "--prompt-tokens", "250", "-n", "8"],
     ["--context 256 does not hold"]),
])
def test_options_without_effect_or_out_of_range_are_refused_in_one_line(args, words, converted,
                                                                          capsys):
    args = [a.format(model=converted("kimi_k3")) for a in args]
    assert exit_status(args) in (1, 2)  # 2: argparse's usage errors
    one_error_line(capsys.readouterr().err, *words)


# --- bench plans the context a run would ----------------------------------------------


def test_bench_reserves_what_its_runs_need_or_the_context_given(converted, capsys):
    model = converted("kimi_k3")
    base = ["bench", model, "-n", "2", "--prompt-tokens", "4", "--repeats", "1", "--budget", "200MB"]
    assert run_json(capsys, *base)["context"] == 256  # 4 + 2 tokens, rounded up as a run does
    assert run_json(capsys, *base, "--context", "1000")["context"] == 1000


# --- --demo with every subcommand --------------------------------------------------------


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    from deltafin_mlx.cli.demo import prepare

    root = tmp_path_factory.mktemp("demo")
    return root, prepare(root)


def test_every_subcommand_takes_demo_and_a_cached_demo_says_where_it_is(demo, capsys, tmp_path):
    root, model = demo
    where = ["--demo", "--demo-dir", str(root)]
    plan = run_json(capsys, "plan", *where, "--disk-gbps", "2", "--compute-gwps", "3",
                    "--prefill-gwps", "3")
    assert plan["model"] == str(model) and plan["expert_cache_fraction"] == pytest.approx(0.25, abs=0.01)
    capsys.readouterr()
    assert main(["info", *where]) == 0
    out = capsys.readouterr()
    assert str(model) in out.out and f"converted earlier, is in {model}" in out.err
    assert main(["verify", *where]) == 0
    assert "OK" in capsys.readouterr().out
    bench = run_json(capsys, "bench", *where, "-n", "2", "--repeats", "1")
    assert bench["model"] == str(model) and bench["cache_fraction"] < 0.5
    prompts = tmp_path / "in.jsonl"
    prompts.write_text('{"id": 1, "prompt": "Hi", "max_tokens": 2}\n')
    assert main(["batch", *where, str(prompts), "-o", str(tmp_path / "out.jsonl")]) == 0
    assert json.loads((tmp_path / "out.jsonl").read_text())["id"] == 1
