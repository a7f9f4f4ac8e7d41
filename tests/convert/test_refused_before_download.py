"""What config.json alone settles is said before any weight is downloaded: a dense
model (mlx-lm builds it with no routed experts) is not a Mixture of Experts and
mlx-lm runs it, in one line from `plan`, `info` and `deltafin-convert`, for a local
directory and for a hub id (the loopback hub, deltafin_mlx/testing/fake_hub.py,
counts what it serves: no safetensors file is asked for); quantization options on a
repository mlx-lm quantized, or on experts carried over as saved (Kimi K3's MXFP4), are
refused as early, and options that refuse each other before anything is asked for."""

import json
import os
import subprocess

import pytest

from deltafin_mlx.testing import zoo
from deltafin_mlx.testing.fake_hub import FakeHub
from helpers import BIN, one_error_line

DENSE = "not a Mixture of Experts"


def run(tool, args, env=None):
    return subprocess.run([str(BIN / tool), *map(str, args)], capture_output=True, text=True,
                          timeout=300, env={**os.environ, **(env or {})})


@pytest.fixture(scope="module")
def repos(tmp_path_factory):
    """A dense Qwen3 and a 4-bit ERNIE-4.5 MoE, as mlx_lm.convert writes them."""
    root = tmp_path_factory.mktemp("repos")
    return {"dense": zoo.write(root / "dense", "qwen3", bits=4),
            "moe": zoo.write(root / "moe", "ernie4_5_moe", bits=4)}


def commands(model, out):
    return [("deltafin-run", ["plan", model]), ("deltafin-run", ["info", model]),
            ("deltafin-convert", [model, out])]


def test_a_dense_directory_is_said_to_be_mlx_lms_by_every_command(repos, tmp_path):
    for tool, args in commands(repos["dense"], tmp_path / "out"):
        p = run(tool, args)
        assert p.returncode != 0
        err = one_error_line(p, DENSE, "mlx-lm runs")
        assert "convert it first" not in err and "StopIteration" not in err
    assert not (tmp_path / "out").exists()


def test_a_dense_hub_repository_is_refused_from_its_config_json_alone(repos, tmp_path):
    with FakeHub() as hub:
        hub.add("someone/dense", repos["dense"])
        for tool, args in commands("someone/dense", tmp_path / "out"):
            p = run(tool, args, hub.env(tmp_path / "hf"))
            assert p.returncode != 0
            one_error_line(p, DENSE, "mlx-lm runs")
        fetched = [path for _, path in hub.requests if "/resolve/" in path]
        assert fetched and all(path.endswith("/config.json") for path in fetched), fetched
        weights = os.path.getsize(repos["dense"] / "model.safetensors")
        assert hub.bytes_served < weights


@pytest.mark.parametrize("option", [["--bits", "8"], ["--expert-bits", "8"]])
def test_options_an_mlx_lm_quantized_repository_refuses_are_said_before_its_weights(
        repos, tmp_path, option):
    with FakeHub() as hub:
        hub.add("someone/moe", repos["moe"])
        p = run("deltafin-convert", ["someone/moe", tmp_path / "out", *option],
                hub.env(tmp_path / "hf"))
        assert p.returncode != 0
        one_error_line(p, option[0], "drop the option")
        assert not any(path.endswith(".safetensors") for _, path in hub.requests), hub.requests


def test_expert_options_on_k3s_mxfp4_experts_are_said_before_its_weights(sources, tmp_path):
    with FakeHub() as hub:
        hub.add("someone/k3", sources("kimi_k3"))
        p = run("deltafin-convert", ["someone/k3", tmp_path / "out", "--expert-bits", "8"],
                hub.env(tmp_path / "hf"))
        assert p.returncode != 0
        one_error_line(p, "--expert-bits", "MXFP4", "carried over", "drop the option")
        assert not any(path.endswith(".safetensors") for _, path in hub.requests), hub.requests


def test_linking_float_experts_is_refused_before_anything_is_asked_for(repos, tmp_path):
    with FakeHub() as hub:
        hub.add("someone/moe", repos["moe"])
        p = run("deltafin-convert", ["someone/moe", tmp_path / "out", "--link-experts",
                                     "--expert-bits", "float"], hub.env(tmp_path / "hf"))
        assert p.returncode != 0
        one_error_line(p, "--link-experts with --expert-bits float", "drop one of the two")
        assert hub.requests == [], hub.requests


def test_a_quantization_method_mlx_lm_does_not_read_is_said_before_the_weights(tmp_path):
    src = zoo.write(tmp_path / "awq", "ernie4_5_moe")
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "quantization_config": {
        "quant_method": "awq", "bits": 4, "group_size": 128}}))
    with FakeHub() as hub:
        hub.add("someone/awq", src)
        p = run("deltafin-convert", ["someone/awq", tmp_path / "out"], hub.env(tmp_path / "hf"))
        assert p.returncode != 0
        one_error_line(p, "source quantization awq/None is not supported")
        assert not any(path.endswith(".safetensors") for _, path in hub.requests), hub.requests
