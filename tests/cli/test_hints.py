"""What a command says when given the wrong kind of model: the command that would run it."""

from deltafin_mlx.cli import convert as convert_cli
from deltafin_mlx.cli.main import main

from helpers import one_error_line, run_command


def test_a_converted_model_as_source_gets_the_command_to_run_it(converted, tmp_path, capsys):
    assert convert_cli.main([str(converted("mixtral")), str(tmp_path / "o")]) == 1
    one_error_line(capsys.readouterr().err, "already a Deltafin model", "deltafin-run ")


def test_an_unconverted_checkpoint_given_to_deltafin_run_gets_the_convert_command(sources):
    p = run_command([sources("mixtral"), "Hello"])
    assert p.returncode == 1
    one_error_line(p, "Hugging Face checkpoint", f"deltafin-convert {sources('mixtral')} ")


def test_a_hub_id_given_to_deltafin_run_gets_the_convert_command(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["someone/Some-MoE", "Hello"]) == 1
    one_error_line(capsys.readouterr().err, "deltafin-convert someone/Some-MoE ~/models/Some-MoE")


def test_offline_hub_failure_says_offline(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    assert convert_cli.main(["someone/some-model", str(tmp_path / "o")]) == 1
    one_error_line(capsys.readouterr().err, "someone/some-model", "offline", "HF_HUB_OFFLINE")
