"""Checksums of a model's files: random bytes over a file refused at load, large files checked
only with --verify, generation config listed and unedited."""

import json
import os

import pytest

from deltafin_mlx import runtime
from deltafin_mlx.cli.main import main
from deltafin_mlx.engine.load import load
from deltafin_mlx.format.manifest import MANIFEST_NAME, ModelError, read_manifest
from deltafin_mlx.format.verify import verify_model

from helpers import LOAD, only_stderr_line, overwrite_bytes


def test_random_bytes_over_a_trunk_file_are_refused_at_load_and_named_by_verify(
        converted, copy_of):
    path = copy_of(converted("kimi_k3"))
    rel = read_manifest(path, check_files=False).trunk_files["1"]
    overwrite_bytes(path / rel, 200, os.urandom(64))
    with pytest.raises(ModelError, match=rf"{rel}: modified since conversion"):
        load(path, **LOAD)
    assert any(p.startswith(f"{rel}: modified since conversion")
               for p in verify_model(path).problems)


def test_large_files_are_checked_at_load_only_with_verify(converted, copy_of, monkeypatch):
    """Files over the load-time limit (real trunk files) are checked by --verify."""
    import deltafin_mlx.format.integrity as integrity

    monkeypatch.setattr(integrity, "SMALL_FILE_BYTES", 0)
    monkeypatch.setattr(integrity.check_small_files, "__defaults__", (0,))
    path = copy_of(converted("kimi_k3"))
    rel = read_manifest(path, check_files=False).trunk_files["globals"]
    overwrite_bytes(path / rel, (path / rel).stat().st_size - 100, os.urandom(16))  # tensor data
    model, _ = load(path, **LOAD)  # not checked at load: too large to read every time
    runtime(model).close()
    with pytest.raises(ModelError, match=rf"{rel}: modified since conversion"):
        load(path, verify=True, **LOAD)


def test_an_unlisted_generation_config_is_refused(converted, copy_of, capsys):
    """An added generation_config.json would change the eos tokens unseen."""
    path = copy_of(converted("qwen3_moe"))
    d = json.loads((path / MANIFEST_NAME).read_text())
    for key in ("files", "checksums"):
        del d[key]["generation_config.json"]
    d["tokenizer"]["files"].remove("generation_config.json")
    (path / MANIFEST_NAME).write_text(json.dumps(d))
    for command in (["info", path], ["plan", path, "--budget", "1GB"], [path, "hi", "-n", "1"]):
        assert main(list(map(str, command))) == 1
        line = only_stderr_line(capsys.readouterr().err)
        assert "generation_config.json: not listed in the manifest" in line, command


def test_an_edited_generation_config_is_refused(converted, copy_of, capsys):
    path = copy_of(converted("qwen3_moe"))
    g = path / "generation_config.json"
    g.write_text(g.read_text().replace("}", ', "x": 1}', 1)[: len(g.read_text())])
    assert main(["info", str(path)]) == 1
    assert "generation_config.json: modified since conversion" in only_stderr_line(
        capsys.readouterr().err)
