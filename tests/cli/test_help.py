"""`--version`, `--help` and every option's help saying its default."""

import re
from pathlib import Path

import pytest

import deltafin_mlx
from deltafin_mlx.cli import convert as convert_cli

from helpers import run_command


@pytest.mark.parametrize("tool", ["deltafin-run", "deltafin-convert"])
def test_version(tool):
    from importlib.metadata import version

    p = run_command(["--version"], tool=tool)
    assert p.returncode == 0
    assert p.stdout.strip() == f"{tool} {deltafin_mlx.__version__}"
    assert version("deltafin") == deltafin_mlx.__version__


def test_main_help_lists_every_command():
    p = run_command(["--help"])
    assert p.returncode == 0
    usage = p.stdout.split("\n\n")[0]
    for command in ("MODEL PROMPT", "--chat", "plan", "bench", "batch", "serve", "info", "verify",
                    "--demo"):
        assert command in usage, usage
    commands = p.stdout.split("commands:")[1]
    for command in ("plan", "bench", "batch", "serve", "info", "verify", "--demo"):
        assert re.search(rf"^  {re.escape(command)} ", commands, re.M), commands


def all_parsers():
    from deltafin_mlx.cli.batch import batch_parser
    from deltafin_mlx.cli.bench import bench_parser
    from deltafin_mlx.cli.info import info_parser
    from deltafin_mlx.cli.main import run_parser
    from deltafin_mlx.cli.plan import plan_parser
    from deltafin_mlx.cli.verify import verify_parser

    return [run_parser(), plan_parser(), bench_parser(), batch_parser(), info_parser(),
            verify_parser(), convert_cli.build_parser()]


@pytest.mark.parametrize("parser", all_parsers(), ids=lambda p: p.prog)
def test_every_option_has_help_and_says_its_default(parser):
    for action in parser._actions:
        if action.dest in ("help", "version"):
            continue
        assert action.help, f"{parser.prog}: {action.option_strings or action.dest} has no help"
        if not action.option_strings or action.nargs == 0 or action.required:
            continue  # positionals, required options and on/off flags: no default to say
        shown = " ".join(parser._get_formatter()._format_action(action).split())
        assert "(default: " in shown, shown


@pytest.mark.usefixtures("no_disk_measurement")
def test_the_new_commands_options_have_help_and_defaults():
    from deltafin_mlx.cli.list_models import list_parser
    from deltafin_mlx.cli.remove import rm_parser
    from test_help import test_every_option_has_help_and_says_its_default as check

    for parser in (list_parser(), rm_parser()):
        check(parser)


def test_convert_help_lists_the_types_the_every_type_test_runs():
    """deltafin-convert --help and the README name the types of SUPPORTED_TYPES, the
    table tests/convert/test_every_moe_type.py runs (and checks against mlx-lm's)."""
    from deltafin_mlx.model.config import SUPPORTED_TYPES

    assert len(SUPPORTED_TYPES) == 58
    shown = re.findall(r"[\w-]+", convert_cli.build_parser().format_help().split(
        "mlx-lm's tokens):")[1].split(".\n")[0])
    assert shown == list(SUPPORTED_TYPES)
    readme = (Path(__file__).parents[2] / "README.md").read_text()
    listed = readme.split(f"the {len(SUPPORTED_TYPES)} types of mlx-lm")[1].split("- as published")[0]
    assert re.findall(r"[A-Za-z][\w-]+", listed.split(":", 1)[1]) == list(SUPPORTED_TYPES)


def test_the_demo_option_names_every_command_it_stands_in_for():
    from deltafin_mlx.cli.main import COMMANDS, run_parser

    demo = next(a for a in run_parser()._actions if "--demo" in a.option_strings)
    for command in [c.name for c in COMMANDS if " " not in c.name and c.model]:
        assert re.search(rf"\b{command}\b", demo.help), (command, demo.help)
    assert {"score", "perplexity"} <= set(re.findall(r"\w+", demo.help))
