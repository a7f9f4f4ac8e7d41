"""One-shot runs (`deltafin-run MODEL PROMPT`): the prompt they build, the options they refuse,
the output and counters they print."""

import json
import re

import pytest

from deltafin_mlx.cli.main import main, run_parser
from deltafin_mlx.cli.run import request_of
from deltafin_mlx.engine.load import open_tokenizer
from deltafin_mlx.format.model_dir import open_model_dir
from deltafin_mlx.generation.engine import chat_prompt, prompt_tokens

from helpers import one_error_line, run_json


def exit_status(args):
    try:
        return main(args)
    except SystemExit as e:
        return e.code


@pytest.mark.usefixtures("no_disk_measurement")
def test_one_shot_puts_the_system_message_and_thinking_effort_into_the_prompt(converted, capsys):
    model = converted("kimi_k3")
    tok = open_tokenizer(open_model_dir(model))
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    plain = run_json(capsys, model, "Hi", "-n", "1", "--budget", "200MB")
    system = run_json(capsys, model, "Hi", "-n", "1", "--budget", "200MB", "--system", "Be brief.")
    assert system["stats"]["prompt_tokens"] == len(chat_prompt(tok, msgs))
    assert system["stats"]["prompt_tokens"] > plain["stats"]["prompt_tokens"]
    args = run_parser().parse_args(["m", "Hi", "--system", "Be brief.", "--thinking-effort", "low"])
    low = prompt_tokens(request_of(args, "Hi"), tok)
    assert low == chat_prompt(tok, msgs, thinking_effort="low") != chat_prompt(tok, msgs)


@pytest.mark.usefixtures("no_disk_measurement")
@pytest.mark.parametrize("args,words", [
    (["{model}", "Hi", "--session", "s"], ["--session only applies with --chat"]),
    (["{model}", "Hi", "--raw", "--system", "x"], ["--system", "--raw"]),
    (["{model}", "Hi", "--raw", "--thinking-effort", "low"], ["--thinking-effort", "--raw"]),
    (["{model}", "Hi", "-n", "0"], ["-n/--max-tokens", "must be in 1.."]),
    (["{model}", "Hi", "-n", "-1"], ["-n/--max-tokens", "must be in 1.."]),
    (["{model}", "--chat", "-n", "0"], ["-n/--max-tokens", "must be in 1.."]),
    (["bench", "{model}", "-n", "0"], ["-n/--max-tokens", "must be in 1.."]),
    (["batch", "{model}", "in.jsonl", "-o", "out.jsonl", "-n", "0"], ["-n/--max-tokens", "must be in 1.."]),
    (["bench", "{model}", "--context", "256", "--prompt-tokens", "250", "-n", "8"],
     ["--context 256 does not hold"]),
])
def test_options_without_effect_or_out_of_range_are_refused_in_one_line(args, words, converted,
                                                                          capsys):
    args = [a.format(model=converted("kimi_k3")) for a in args]
    assert exit_status(args) in (1, 2)  # 2: argparse's usage errors
    one_error_line(capsys.readouterr().err, *words)


@pytest.mark.usefixtures("no_disk_measurement")
def test_one_shot_output_hides_markup_and_the_counters_show_peak_memory(converted, capsys):
    model = converted("kimi_k3")
    capsys.readouterr()
    assert main([str(model), "Hello there", "-n", "40", "--budget", "200MB"]) == 0
    out = capsys.readouterr()
    assert "<|" not in out.out and "[thinking]" in out.out  # thinking apart, markup never
    assert re.search(r"peak memory [\d.]+ [KMG]B MLX, [\d.]+ [KMG]B RSS; activations float32$",
                     out.err.strip())
    stats = run_json(capsys, model, "Hi", "-n", "2", "--budget", "200MB")["stats"]
    assert stats["peak_rss_bytes"] > 0 and stats["peak_mlx_bytes"] > 0


@pytest.mark.usefixtures("no_disk_measurement")
@pytest.mark.parametrize("extra", [["--system", "x"], ["--thinking-effort", "low"], ["--no-think"]])
@pytest.mark.parametrize("mode", [["Hi"], ["--chat"]])
def test_template_options_are_refused_for_a_model_without_a_chat_template(
        converted, copy_of, capsys, extra, mode):
    from helpers import reseal

    model = copy_of(converted("qwen3_moe"))
    config = json.loads((model / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    reseal(model, "tokenizer_config.json")
    assert main([str(model), *mode, "-n", "2", "--budget", "200MB", *extra]) == 1
    one_error_line(capsys.readouterr().err, extra[0], "chat template", "has none")
    if mode == ["Hi"]:
        assert main([str(model), "Hi", "-n", "2", "--budget", "200MB"]) == 0  # it runs without


def test_only_rank_0_prints_the_stats_line(converted, monkeypatch, capsys):
    from types import SimpleNamespace

    from deltafin_mlx.engine.runtime import Runtime

    assert Runtime.is_primary.fget(SimpleNamespace(group=None))
    assert Runtime.is_primary.fget(SimpleNamespace(group=SimpleNamespace(rank=lambda: 0)))
    assert not Runtime.is_primary.fget(SimpleNamespace(group=SimpleNamespace(rank=lambda: 1)))
    args = [str(converted("qwen3_moe")), "hi", "-n", "2"]
    assert main(args) == 0
    assert "[deltafin]" in capsys.readouterr().err
    monkeypatch.setattr(Runtime, "is_primary", property(lambda self: False))  # as rank 1
    assert main(args) == 0
    assert "[deltafin]" not in capsys.readouterr().err
