"""deltafin-run's commands come from one table (cli/main.py's COMMANDS): usage, help,
dispatch and `--demo` are derived from it, and whether a command takes a budget is
read from its own parser. So `--demo` gives every command that takes a budget the
demo's (score and perplexity included), and a command added to the table is listed,
dispatched and given the demo's model and budget with nothing else to change."""

import sys
import types

import pytest

from deltafin_mlx.cli import main as cli_main
from deltafin_mlx.cli.main import COMMANDS, Command, command, main, subcommands
from deltafin_mlx.cli.options import Parser, add_load_options


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    from deltafin_mlx.testing.demo import prepare

    root = tmp_path_factory.mktemp("demo")
    return root, prepare(root)


def demo_budget(model) -> int:
    from deltafin_mlx.format.model_dir import open_model_dir
    from deltafin_mlx.testing.demo import demo_plan

    return demo_plan(open_model_dir(model)).budget


@pytest.mark.parametrize("name, inputs", [
    ("score", ["in.jsonl", "-o", "out.jsonl"]),
    ("perplexity", ["in.txt"]),
])
def test_score_and_perplexity_with_demo_load_the_demo_model_under_the_demo_budget(
        demo, name, inputs, tmp_path, monkeypatch):
    root, model = demo
    (tmp_path / "in.jsonl").write_text('{"id": 1, "text": "Hi"}\n')
    (tmp_path / "in.txt").write_text("Deltafin streams experts from disk. " * 40)
    loaded = []

    def load(path, options):  # what the command loads is all this test needs
        loaded.append((str(path), options.memory_budget))
        raise SystemExit(7)

    monkeypatch.setattr("deltafin_mlx.engine.load.load", load)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as stopped:
        main([name, "--demo", "--demo-dir", str(root), *inputs])
    assert stopped.value.code == 7
    assert loaded == [(str(model), demo_budget(model))]
    loaded.clear()
    with pytest.raises(SystemExit):  # a budget given is the user's, not the demo's
        main([name, "--demo", "--demo-dir", str(root), *inputs, "--budget", "300MB"])
    assert loaded == [(str(model), 300_000_000)]


def called_with(monkeypatch, target: str) -> list:
    """The argument lists the command `target` names is called with, from now on (it
    only records them)."""
    calls = []
    module, _, function = target.partition(":")
    monkeypatch.setattr(f"deltafin_mlx.cli.{module}.{function}",
                        lambda argv: calls.append(argv) or 0)
    return calls


@pytest.mark.parametrize("sub", subcommands().values(), ids=lambda c: c.name)
def test_demo_is_the_model_of_every_command_that_takes_one_with_a_budget_where_its_parser_has_one(
        sub, demo, monkeypatch):
    root, model = demo
    calls = called_with(monkeypatch, sub.run)
    assert main([sub.name, "--demo", "--demo-dir", str(root), "--json"]) == 0
    if not sub.model:  # rm's --demo is its own (the demo's cache); list takes no MODEL
        assert calls == [["--demo", "--demo-dir", str(root), "--json"]]
        return
    takes_budget = "--budget" in command(sub.parser)()._option_string_actions
    budget = ["--budget", str(demo_budget(model))] if takes_budget else []
    assert calls == [[str(model), "--json", *budget]]


def test_the_commands_that_take_a_budget_all_get_the_demo_s():
    takes_budget = {c.name for c in subcommands().values()
                    if "--budget" in command(c.parser)()._option_string_actions}
    assert {"plan", "bench", "batch", "score", "perplexity", "serve"} <= takes_budget
    assert {"info", "verify", "list", "rm"}.isdisjoint(takes_budget)
    assert all(subcommands()[name].model for name in takes_budget)


def hello_parser():
    p = Parser(prog="deltafin-run hello", description="Say hello to a model.")
    p.add_argument("model")
    add_load_options(p)
    return p


def test_a_command_is_one_table_entry_and_its_module(demo, monkeypatch, capsys):
    root, model = demo
    said = []
    module = types.ModuleType("deltafin_mlx.cli.hello")
    module.hello_parser = hello_parser
    module.cmd_hello = lambda argv: said.append(hello_parser().parse_args(argv)) or 0
    monkeypatch.setitem(sys.modules, "deltafin_mlx.cli.hello", module)
    monkeypatch.setattr(cli_main, "COMMANDS", COMMANDS + (
        Command("hello", "hello:cmd_hello", "hello:hello_parser", "MODEL [options]",
                "say hello to a model"),))

    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "deltafin-run hello MODEL [options]" in out.split("commands:")[0]
    assert "\n  hello             say hello to a model\n" in out
    assert "verify, hello) it is the MODEL" in " ".join(out.split())

    assert main(["hello", "some-model", "--budget", "1GB"]) == 0
    assert (said[-1].model, said[-1].budget) == ("some-model", "1GB")
    assert main(["hello", "--demo", "--demo-dir", str(root)]) == 0
    assert (said[-1].model, said[-1].budget) == (str(model), str(demo_budget(model)))
