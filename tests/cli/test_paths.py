"""Paths a user types: `~` expanded by the library and by every command."""

import json
from pathlib import Path

import deltafin_mlx
from deltafin_mlx import runtime
from deltafin_mlx.cli import convert as convert_cli
from deltafin_mlx.format.manifest import MANIFEST_NAME

from helpers import make_source, run_command


def test_load_and_the_cli_expand_a_tilde(converted, tmp_path, monkeypatch):
    home = tmp_path / "home"
    (home / "models").mkdir(parents=True)
    (home / "models" / "k3").symlink_to(converted("kimi_k3"))
    monkeypatch.setenv("HOME", str(home))
    model, tokenizer = deltafin_mlx.load("~/models/k3", memory_budget="200MB")
    assert len(deltafin_mlx.generate(model, tokenizer, "Hi", max_tokens=3).tokens) == 3
    runtime(model).close()
    # A quoted ~ reaches the CLI unexpanded by the shell.
    p = run_command(["~/models/k3", "Hi", "-n", "3", "--json", "--budget", "200MB"], env={"HOME": home})
    assert p.returncode == 0, p.stderr
    assert len(json.loads(p.stdout)["tokens"]) == 3
    (home / "src").symlink_to(make_source(tmp_path / "src", "mixtral"))
    assert convert_cli.main(["~/src", "~/mixtral", "--quiet"]) == 0
    assert (home / "mixtral" / MANIFEST_NAME).exists() and not Path("~").exists()
