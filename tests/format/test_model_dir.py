"""A model directory is opened once per command: one read of its manifest, one
check of its small files' checksums, whatever the command does next."""

import pytest

import deltafin_mlx.format.manifest as manifest_module
from deltafin_mlx.cli.main import main
from deltafin_mlx.format.manifest import MANIFEST_NAME


@pytest.fixture
def opens(monkeypatch):
    """Counts manifest reads and small-file checks."""
    count = {"manifest": 0, "small_files": 0}
    read_inside, check_small_files = manifest_module.read_inside, manifest_module.check_small_files

    def counted_read(root, rel, limit):
        count["manifest"] += rel == MANIFEST_NAME
        return read_inside(root, rel, limit)

    def counted_check(m, *args, **kwargs):
        count["small_files"] += 1
        return check_small_files(m, *args, **kwargs)

    monkeypatch.setattr(manifest_module, "read_inside", counted_read)
    monkeypatch.setattr(manifest_module, "check_small_files", counted_check)
    return count


@pytest.mark.parametrize("command", [
    ["{model}", "Hello", "-n", "2", "--budget", "200MB"],
    ["info", "{model}"],
    ["plan", "{model}", "--budget", "200MB", "--disk-gbps", "1", "--compute-gwps", "1"],
    ["verify", "{model}"],
], ids=["run", "info", "plan", "verify"])
def test_each_command_reads_the_manifest_once(command, converted, opens, capsys):
    model = str(converted("qwen3_moe"))
    assert main([a.format(model=model) for a in command]) == 0
    assert opens["manifest"] == 1
    assert opens["small_files"] <= 1


def test_load_and_the_tokenizer_share_one_opened_directory(converted, opens):
    import deltafin_mlx

    model_dir = deltafin_mlx.open_model_dir(converted("qwen3_moe"))
    tokenizer = deltafin_mlx.open_tokenizer(model_dir)
    model, tok = deltafin_mlx.load(model_dir, memory_budget="200MB")
    assert tok is tokenizer
    assert deltafin_mlx.runtime(model).model_dir is model_dir
    deltafin_mlx.runtime(model).close()
    assert opens == {"manifest": 1, "small_files": 1}
