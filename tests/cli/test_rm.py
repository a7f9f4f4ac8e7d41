"""`deltafin-run rm`: it removes only a converted model, asks first, and says what a folder is."""

from pathlib import Path

import pytest

from deltafin_mlx.cli.main import main

from helpers import one_error_line, one_line_error, run_tool


@pytest.mark.usefixtures("no_disk_measurement")
def test_rm_removes_only_a_converted_model_and_asks_first(converted, copy_of, tmp_path, capsys,
                                                            monkeypatch):
    import io

    model = copy_of(converted("kimi_k3"))
    monkeypatch.setattr("sys.stdin", io.StringIO(""))  # not a terminal: no one to ask
    assert main(["rm", str(model)]) == 1
    one_error_line(capsys.readouterr().err, "without confirmation", "--yes")
    (model / "notes.txt").write_text("mine")
    assert main(["rm", str(model), "--yes"]) == 1
    one_error_line(capsys.readouterr().err, "did not write", "notes.txt", "not removed")
    assert model.exists()
    (model / "notes.txt").unlink()
    (tmp_path / "link").symlink_to(model)
    assert main(["rm", str(tmp_path / "link"), "--yes"]) == 1
    one_error_line(capsys.readouterr().err, "symlink")
    assert main(["rm", str(tmp_path), "--yes"]) == 1
    one_error_line(capsys.readouterr().err, "not a Deltafin model")
    assert main(["rm", str(model), "--yes"]) == 0
    assert not model.exists() and "freed" in capsys.readouterr().err


def test_rm_of_a_hugging_face_folder_says_what_it_is(sources):
    err = one_line_error(run_tool("deltafin-run", "rm", sources("kimi_k3"), "--yes"))
    assert "a Hugging Face checkpoint, not a Deltafin model" in err
    assert "convert it first" not in err
    assert (Path(sources("kimi_k3")) / "config.json").exists()
