"""`deltafin-run list`: every model under a folder, its size, architecture, quantization and floor."""

import json
import os
import subprocess

import pytest

from deltafin_mlx.cli.main import main
from deltafin_mlx.format.model_dir import open_model_dir

from helpers import BIN, run_json, run_tool


@pytest.mark.usefixtures("no_disk_measurement")
def test_list_shows_every_model_under_a_directory_with_size_architecture_and_floor(
        converted, tmp_path, capsys):
    import shutil

    for arch in ("kimi_k3", "qwen3_moe"):
        shutil.copytree(converted(arch), tmp_path / "models" / arch)
    (tmp_path / "models" / "notes").mkdir()
    rows = [json.loads(line) for line in run_json_lines(capsys, "list", tmp_path / "models")]
    assert [r["architecture"] for r in rows] == ["kimi_k3", "qwen3_moe"]
    plan = run_json(capsys, "plan", tmp_path / "models" / "kimi_k3", "--disk-gbps", "2",
                    "--compute-gwps", "3", "--prefill-gwps", "3")
    assert rows[0]["floor_bytes"] == plan["floor_bytes"]
    assert rows[0]["bytes"] > sum(open_model_dir(tmp_path / "models" / "kimi_k3").manifest
                                  .files.values()) * 0.99
    capsys.readouterr()
    assert main(["list", str(tmp_path / "models")]) == 0
    out = capsys.readouterr().out
    assert " kimi_k3 " in out and "Kimi K3" not in out and "FLOOR" in out and len(out.splitlines()) == 3  # a header


def run_json_lines(capsys, *args):
    capsys.readouterr()
    assert main([*map(str, args), "--json"]) == 0
    return capsys.readouterr().out.splitlines()


def test_list_has_a_quantization_column_and_aligned_columns(converted, tmp_path):
    import shutil

    for arch in ("kimi_k3", "qwen3_moe"):
        shutil.copytree(converted(arch), tmp_path / "models" / arch)
    out = run_tool("deltafin-run", "list", tmp_path / "models")
    assert out.returncode == 0, out.stderr
    header, *rows = out.stdout.splitlines()
    assert header.split()[:4] == ["MODEL", "SIZE", "ARCHITECTURE", "QUANTIZATION"]
    assert len(rows) == 2
    assert "affine 4-bit/64 except router affine 8-bit/64, experts mxfp4 " in rows[0]
    assert "affine 4-bit/64 except router affine 8-bit/64 " in rows[1]  # experts: 4-bit too
    for column in ("SIZE", "ARCHITECTURE", "QUANTIZATION", "FLOOR"):
        at = header.index(column)
        assert all(row[at - 2: at] == "  " and row[at] != " " for row in rows), out.stdout


def test_list_without_a_folder_shows_the_demo_too(converted, tmp_path):
    import shutil

    shutil.copytree(converted("qwen3_moe"), tmp_path / "here" / "mine")
    shutil.copytree(converted("kimi_k3"), tmp_path / "cache" / "deltafin" / "demo" / "model")
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    out = subprocess.run([str(BIN / "deltafin-run"), "list"], cwd=tmp_path / "here", env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    rows = out.stdout.splitlines()[1:]
    assert [r.split()[0] for r in rows] == ["mine", str(tmp_path / "cache" / "deltafin" / "demo" / "model")]
    given = run_tool("deltafin-run", "list", tmp_path / "here")  # a folder named: that folder only
    assert len(given.stdout.splitlines()) == 2, given.stdout


def test_list_shows_a_model_whose_linked_source_is_gone_as_unusable(sources, tmp_path):
    import shutil

    source = tmp_path / "source"
    shutil.copytree(sources("kimi_k3"), source)
    out = run_tool("deltafin-convert", source, tmp_path / "models" / "linked", "--link-experts")
    assert out.returncode == 0, out.stderr
    assert "unusable" not in run_tool("deltafin-run", "list", tmp_path / "models").stdout
    shutil.rmtree(source)  # as `rm --demo` removes the demo's source
    listed = run_tool("deltafin-run", "list", tmp_path / "models").stdout
    assert "unusable" in listed and "gone" in listed, listed
