"""mlx-lm's flag names, typed out of habit: the one usage-error line says what
Deltafin calls the same thing (cli/mlx_lm_names.py's table), and the flags that
mean the same here are taken as they are."""

import importlib

import pytest

from deltafin_mlx.cli import convert as convert_cli
from deltafin_mlx.cli.bench import bench_parser
from deltafin_mlx.cli.main import run_parser
from deltafin_mlx.cli.mlx_lm_names import MLX_LM_FLAGS
from deltafin_mlx.cli.serve import parser as serve_parser

from helpers import one_error_line

MLX_LM_PARSERS = [getattr(importlib.import_module(f"mlx_lm.{module}"), make)() for module, make in
                  (("generate", "setup_arg_parser"), ("chat", "setup_arg_parser"),
                   ("convert", "configure_parser"), ("benchmark", "setup_arg_parser"))]
OURS = {"deltafin-run": run_parser, "deltafin-run bench": bench_parser,
        "deltafin-run serve": serve_parser, "deltafin-convert": convert_cli.build_parser}
NAMES = sorted({name for names, _, _ in MLX_LM_FLAGS for name in names})


def mlx_lm_flags() -> set:
    return {o for p in MLX_LM_PARSERS for a in p._actions for o in a.option_strings}


def usage_error(prog: str, argv, capsys) -> str:
    with pytest.raises(SystemExit) as e:
        OURS[prog]().parse_args(argv)
    assert e.value.code == 2
    return capsys.readouterr().err


def test_every_name_in_the_table_is_one_of_mlx_lms_flags():
    assert set(NAMES) - mlx_lm_flags() == set()


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("prog", sorted(OURS))
def test_an_mlx_lm_name_a_command_lacks_gets_a_one_line_hint(prog, name, capsys):
    if (prog, name) == ("deltafin-run bench", "--prompt"):
        assert bench_parser().parse_args(["M", name, "5"]).prompt_tokens == 5  # the same
        return
    err = usage_error(prog, ["MODEL", "OUT", name, "1"] if "convert" in prog
                      else ["MODEL", name, "1"], capsys)
    one_error_line(err, f"mlx-lm's {name}: ",
                   f"(see {prog} --help)")


@pytest.mark.parametrize("argv, hint", [
    (["--model", "M", "--prompt", "hi"], "MODEL is the first argument"),
    (["M", "hi", "-m", "5"], "mlx-lm's -m: -n"),
    (["M", "hi", "--system-prompt", "be brief"], "mlx-lm's --system-prompt: --system"),
    (["M", "hi", "--ignore-chat-template"], "mlx-lm's --ignore-chat-template: --raw"),
])
def test_mlx_lm_generate_habits_name_deltafin_runs_flag(argv, hint, capsys):
    with pytest.raises(SystemExit):
        run_parser().parse_intermixed_args(argv)
    one_error_line(capsys.readouterr().err, hint)


def test_serves_max_tokens_has_no_short_form(capsys):
    one_error_line(usage_error("deltafin-run serve", ["M", "-m", "5"], capsys),
                   "mlx-lm's -m: --max-tokens (see")


def test_serve_model_and_convert_paths_say_they_are_arguments(capsys):
    one_error_line(usage_error("deltafin-run serve", ["--model", "M"], capsys),
                   "mlx-lm's --model: MODEL is the first argument")
    one_error_line(usage_error("deltafin-convert", ["--hf-path", "S", "--mlx-path", "O"],
                               capsys),
                   "mlx-lm's --hf-path: SRC is the first argument",
                   "mlx-lm's --mlx-path: OUT is deltafin-convert's second argument")


def test_a_flag_deltafin_does_not_know_at_all_gets_no_hint(capsys):
    err = usage_error("deltafin-run", ["M", "--no-such-flag"], capsys)
    assert "mlx-lm's" not in one_error_line(err, "--no-such-flag")


def test_flags_that_mean_the_same_are_taken_as_mlx_lm_spells_them():
    args = run_parser().parse_args(["M", "hi", "--max-tokens", "5", "--temp", "0.5",
                                    "--top-p", "0.9", "--top-k", "3", "--min-p", "0.1",
                                    "--seed", "1"])
    assert (args.max_tokens, args.temp, args.top_p, args.top_k, args.min_p, args.seed) == (
        5, 0.5, 0.9, 3, 0.1, 1)


def test_bench_says_its_n_is_tokens_where_mlx_lm_benchmarks_is_trials(capsys):
    text = " ".join(bench_parser().format_help().split())
    assert "mlx_lm.benchmark's -n counts trials: --repeats here" in text
    assert "mlx_lm.benchmark's -n/--num-trials" in text
    one_error_line(usage_error("deltafin-run bench", ["M", "--num-trials", "3"], capsys),
                   "mlx-lm's --num-trials: --repeats", "not mlx_lm.benchmark's trials")
