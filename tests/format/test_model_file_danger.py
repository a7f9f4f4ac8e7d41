"""mlx-lm executes the `model_file` config.json names (--trust-remote-code) before
any Deltafin code runs, so nothing of Deltafin's can stop a config.json pointing
it outside the model directory; `deltafin-run verify` names such a config.json as
dangerous (and transformers' `auto_map` code outside it, or from another hub
repository), exits 1, and the README says so where the drop-in is introduced."""

import json
import shutil
import subprocess
from pathlib import Path

import pytest

import deltafin_mlx.cli.main as cli
from deltafin_mlx.cli import convert as convert_cli
from deltafin_mlx.format.manifest import MANIFEST_NAME

from helpers import BIN, only_stderr_line, reseal, run_main

README = Path(__file__).resolve().parents[2] / "README.md"


def verify(model, *more):
    return subprocess.run([str(BIN / "deltafin-run"), "verify", str(model), *more],
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("edit, named", [
    ({"model_file": "../evil.py"}, "../evil.py"),
    ({"model_file": "/tmp/evil.py"}, "/tmp/evil.py"),
    ({"auto_map": {"AutoModel": "../../evil.Model"}}, "../../evil.Model"),
    ({"auto_map": {"AutoTokenizer": ["someone/repo--tok.Tokenizer", None]}},
     "someone/repo--tok.Tokenizer"),
], ids=["model_file ..", "model_file absolute", "auto_map ..", "auto_map other repo"])
def test_verify_names_code_outside_the_model_directory_as_dangerous(converted, tmp_path,
                                                                     edit, named):
    model = tmp_path / "m"
    shutil.copytree(converted("kimi_k3"), model)
    config = json.loads((model / "config.json").read_text())
    config.update(edit)
    (model / "config.json").write_text(json.dumps(config))
    r = verify(model)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    said = [l for l in r.stderr.splitlines() if "DANGEROUS" in l]
    assert len(said) == 1 and "config.json" in said[0] and named in said[0], r.stderr
    report = json.loads(verify(model, "--json").stdout)
    assert not report["ok"] and named in report["dangerous"][0]


def test_a_model_as_converted_is_not_dangerous(converted):
    r = verify(converted("kimi_k3"))
    assert r.returncode == 0 and "DANGEROUS" not in r.stderr, r.stderr


def test_the_readme_says_so_where_the_drop_in_is_introduced():
    section = README.read_text().split("### With mlx-lm", 1)[1].split("\n## ", 1)[0]
    assert "deltafin-run verify" in section and "model_file" in section


@pytest.mark.parametrize("named", ["../evil.py", "evil.py", "/tmp/evil.py", "./deltafin_model.py",
                                   7, None])
def test_a_config_naming_another_model_file_is_refused_by_every_command(
        converted, copy_of, capsys, named):
    """mlx-lm executes config.json's model_file: resealed consistently (checksums and
    config hash), anything but the converter's own deltafin_model.py is refused."""
    path = copy_of(converted("qwen3_moe"))
    config = json.loads((path / "config.json").read_text())
    assert config["model_file"] == "deltafin_model.py"
    config["model_file"] = named
    (path / "config.json").write_text(json.dumps(config))
    reseal(path, "config.json")
    for command in (["info", path], [path, "hi", "-n", "1"]):
        code, line = run_main(capsys, *command)
        assert code == 1 and '"model_file"' in line and "config.json" in line, (command, line)
    # verify: one line; for code outside the directory, a report whose first line
    # names the danger (tests/format/test_model_file_danger.py)
    code = cli.main(["verify", str(path)])
    first = capsys.readouterr().err.splitlines()[0]
    assert code == 1 and '"model_file"' in first and "config.json" in first, first


def test_rerunning_the_converter_over_a_config_naming_another_model_file_is_refused(
        converted, sources, copy_of, capsys):
    """Not "already holds this conversion": the converter opens a finished output as
    every command does."""
    path = copy_of(converted("qwen3_moe"))
    config = json.loads((path / "config.json").read_text())
    config["model_file"] = "../evil.py"
    (path / "config.json").write_text(json.dumps(config))
    reseal(path, "config.json")
    assert convert_cli.main([str(sources("qwen3_moe")), str(path), "--quiet"]) == 1
    line = only_stderr_line(capsys.readouterr().err)
    assert line.startswith("deltafin-convert: error: ") and '"model_file"' in line, line


def test_a_model_file_the_manifest_does_not_list_is_refused(converted, copy_of, capsys):
    path = copy_of(converted("qwen3_moe"))
    d = json.loads((path / MANIFEST_NAME).read_text())
    for key in ("files", "checksums"):
        del d[key]["deltafin_model.py"]
    (path / MANIFEST_NAME).write_text(json.dumps(d))
    for command in (["verify", path], ["info", path]):
        code, line = run_main(capsys, *command)
        assert code == 1 and '"model_file" names deltafin_model.py, which the manifest does ' \
            "not list" in line, (command, line)
