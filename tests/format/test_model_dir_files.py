"""Files of a model directory that are not plain files inside it: symlinks, FIFOs, devices."""

import os
import shutil
from pathlib import Path

import pytest

from deltafin_mlx import runtime
from deltafin_mlx.engine.load import load
from deltafin_mlx.format.manifest import MANIFEST_NAME, ModelError, read_manifest
from deltafin_mlx.format.verify import verify_model

from helpers import LOAD, no_hang


@pytest.mark.parametrize("what", ["bank", "trunk", "experts_dir", "tokenizer", "manifest"])
def test_symlink_to_a_same_size_copy_outside_the_model_is_refused(converted, copy_of, tmp_path,
                                                                  what):
    path = copy_of(converted("kimi_k3"))
    m = read_manifest(path)
    outside = tmp_path / "outside"
    outside.mkdir()
    rel = {"bank": str(m.bank_path(m.moe_layers[0]).relative_to(path)),
           "trunk": m.trunk_files["0"], "experts_dir": "experts",
           "tokenizer": "tokenizer_config.json", "manifest": MANIFEST_NAME}[what]
    target = outside / Path(rel).name
    (shutil.copytree if (path / rel).is_dir() else shutil.copy)(path / rel, target)
    (shutil.rmtree if (path / rel).is_dir() else os.unlink)(path / rel)
    os.symlink(target, path / rel)
    with pytest.raises(ModelError, match="outside the model directory"):
        load(path, **LOAD)
    with pytest.raises(ModelError, match="outside the model directory"):
        verify_model(path)


def test_symlink_inside_the_model_is_followed(converted, copy_of):
    path = copy_of(converted("kimi_k3"))
    (path / "trunk" / "globals.safetensors").rename(path / "globals-real.safetensors")
    os.symlink("../globals-real.safetensors", path / "trunk" / "globals.safetensors")
    model, _ = load(path, **LOAD)
    runtime(model).close()


@pytest.mark.parametrize("name", ["config.json", MANIFEST_NAME, "tokenizer_config.json",
                                  "trunk/globals.safetensors"])
def test_a_fifo_in_place_of_a_file_is_refused_without_blocking(converted, copy_of, name):
    path = copy_of(converted("kimi_k3"))
    (path / name).unlink()
    os.mkfifo(path / name)
    with no_hang(20), pytest.raises(ModelError, match="not a regular file"):
        load(path, memory_budget="2GB")


@pytest.mark.parametrize("name", ["config.json", "tokenizer_config.json", "tiktoken.model",
                                  "generation_config.json"])
def test_dev_zero_linked_as_a_file_read_by_fixed_name_is_refused(converted, copy_of, name):
    path = copy_of(converted("kimi_k3"))
    (path / name).unlink()
    os.symlink("/dev/zero", path / name)
    with no_hang(20), pytest.raises(ModelError, match="outside the model directory"):
        load(path, memory_budget="2GB")
