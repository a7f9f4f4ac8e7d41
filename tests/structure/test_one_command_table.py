"""deltafin-run has one registry of its commands, cli/main.py's COMMANDS: every
command's module and function is named there once, its parser is named beside it,
and no other module of cli/ lists command names (usage, help, dispatch and `--demo`
derive from the table; tests/cli/test_command_table.py shows them doing it).

Read from the source with `ast`: a command is a module's `cmd_*` function.
"""

import ast
from pathlib import Path

from deltafin_mlx.cli.main import COMMANDS, command, subcommands

CLI = Path(__file__).resolve().parents[2] / "deltafin_mlx" / "cli"


def defined_commands() -> list:
    """"module:cmd_name" for every command function in cli/."""
    return sorted(f"{path.stem}:{node.name}" for path in CLI.glob("*.py")
                  for node in ast.parse(path.read_text()).body
                  if isinstance(node, ast.FunctionDef) and node.name.startswith("cmd_"))


def test_every_command_of_cli_is_one_entry_of_the_table():
    runs = [c.run for c in COMMANDS]
    assert sorted(runs) == defined_commands()
    assert len({c.name for c in COMMANDS}) == len(COMMANDS)


def test_every_entry_names_its_own_parser():
    for c in COMMANDS:
        prog = command(c.parser)().prog
        assert prog == ("deltafin-run" if c.name not in subcommands() else f"deltafin-run {c.name}")


def literal_names(node) -> set:
    """The strings a literal set, list, tuple or dict (its keys) holds."""
    items = node.keys if isinstance(node, ast.Dict) else getattr(node, "elts", [])
    return {i.value for i in items if isinstance(i, ast.Constant) and isinstance(i.value, str)}


def test_no_module_of_cli_keeps_its_own_list_of_commands():
    names = set(subcommands())
    registries = {}
    for path in CLI.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Set, ast.List, ast.Tuple, ast.Dict)):
                listed = literal_names(node) & names
                if len(listed) > 1:
                    registries[f"{path.name}:{node.lineno}"] = sorted(listed)
    assert registries == {}
