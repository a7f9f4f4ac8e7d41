"""config.json's sizes and numbers are checked before any model is built from it:
`plan` and `deltafin-convert` answer a forged or broken config.json in one line,
within seconds and a bounded amount of memory (model/config.py `check_config`)."""

import json
import shutil

import mlx.core as mx
import pytest
from mlx_lm.utils import load_model

from deltafin_mlx.convert.convert import ConvertOptions, convert
from deltafin_mlx.engine.load import load
from deltafin_mlx.errors import ModelError
from deltafin_mlx.testing import zoo
from deltafin_mlx.testing.decode import greedy, greedy_streamed

from helpers import LOAD, make_source, only_stderr_line, reseal, run_measured

RATES = ("--disk-gbps", "2", "--compute-gwps", "3", "--prefill-gwps", "3", "--layer-ms", "1")
PEAK = 200 << 20


@pytest.fixture
def mixtral_copy(sources, tmp_path):
    dst = tmp_path / "src"
    shutil.copytree(sources("mixtral"), dst)
    return dst


def edit_config(src, **values):
    config = json.loads((src / "config.json").read_text())
    for key, value in values.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (src / "config.json").write_text(json.dumps(config))


def refused(tool, args, *words):
    code, err, peak, seconds = run_measured(args, tool=tool, timeout=60)
    line = only_stderr_line(err)
    assert code == 1, err
    assert all(w in line for w in words), line
    assert peak < PEAK, f"{peak / 2**20:.0f} MiB"
    assert seconds < 30, seconds
    return line


SIZES = [
    ({"num_hidden_layers": 200_000}, "num_hidden_layers is 200000"),
    ({"num_hidden_layers": 20_000}, "num_hidden_layers is 20000"),
    ({"num_local_experts": 10**9}, "num_local_experts is 1000000000"),
    ({"num_hidden_layers": 0}, "num_hidden_layers is 0"),
    ({"num_experts_per_tok": 0}, "0 experts per token, not 1 to the 16 routed experts"),
    ({"moe_intermediate_size": [64, "64"]}, "not an integer from 0 to 1,048,576"),
    ({"num_experts_per_tok": 10**9}, "num_experts_per_tok is 1000000000"),
    ({"num_experts_per_tok": 17}, "17 experts per token, more than the 16 routed experts"),
    ({"rope_theta": "1e6"}, "rope_theta is '1e6', not a number"),
]


@pytest.mark.parametrize("values,words", SIZES)
def test_plan_refuses_config_sizes_no_model_has_at_once(mixtral_copy, values, words):
    edit_config(mixtral_copy, **values)
    refused("deltafin-run", ["plan", mixtral_copy / "config.json", *RATES], "config.json", words)


@pytest.mark.parametrize("values,words", SIZES)
def test_convert_refuses_config_sizes_no_model_has_at_once(mixtral_copy, tmp_path, values,
                                                           words):
    edit_config(mixtral_copy, **values)
    refused("deltafin-convert", [mixtral_copy, tmp_path / "out", "--quiet"], "config.json",
            words)
    assert not (tmp_path / "out").exists()


def test_sizes_nested_in_text_config_are_checked_too(sources, tmp_path):
    config = json.loads((sources("kimi_k3") / "config.json").read_text())
    config["text_config"]["num_experts"] = 10**9
    (tmp_path / "config.json").write_text(json.dumps(config))
    refused("deltafin-run", ["plan", tmp_path / "config.json", *RATES],
            "num_experts is 1000000000")


@pytest.mark.parametrize("tool", ["plan", "convert"])
@pytest.mark.parametrize("values,model_type", [({"model_type": "llama"}, "llama"),
                                               ({"num_local_experts": 0}, "mixtral")])
def test_a_dense_config_is_one_line_naming_the_missing_experts(mixtral_copy, tmp_path, tool,
                                                               values, model_type):
    edit_config(mixtral_copy, **values)
    args = (["plan", mixtral_copy / "config.json", *RATES] if tool == "plan"
            else [mixtral_copy, tmp_path / "out", "--quiet"])
    refused("deltafin-run" if tool == "plan" else "deltafin-convert", args,
            f"{model_type}: not a Mixture of Experts model")


def test_a_dense_granite_saying_zero_experts_is_said_to_be_mlx_lms(tmp_path):
    """Granite 4.0's dense configs carry num_local_experts: 0 (mlx-lm builds no experts)."""
    config = {**zoo.config("granitemoehybrid", 256), "num_local_experts": 0,
              "num_experts_per_tok": 0}
    (tmp_path / "config.json").write_text(json.dumps(config))
    refused("deltafin-run", ["plan", tmp_path / "config.json", *RATES],
            "granitemoehybrid: not a Mixture of Experts model", "mlx-lm runs")


def test_per_layer_expert_sizes_mlx_lm_takes_convert_and_stream(tmp_path):
    """hunyuan's moe_intermediate_size may be one per layer, as mlx-lm reads it."""
    src = zoo.write(tmp_path / "src", "hunyuan", bits=4,
                    sizes={"moe_intermediate_size": [64, 64]})
    convert(str(src), tmp_path / "out", ConvertOptions(progress=False))
    model, _ = load_model(src)
    model.set_dtype(mx.float32)
    x = mx.array([[1, 5, 9, 200, 17, 33, 2, 8]])
    want, _ = greedy(model, x, 6)
    assert greedy_streamed(tmp_path / "out", x, 6)[0].tolist() == want.tolist()


def test_float_experts_the_group_size_does_not_divide_are_one_line(tmp_path):
    src = make_source(tmp_path / "src", "mixtral", moe_intermediate_size=96)
    words = "expert down_proj input size 96 is not a multiple of the expert group size 64"
    refused("deltafin-run", ["plan", src / "config.json", *RATES], words)
    refused("deltafin-convert", [src, tmp_path / "out", "--quiet"], words)


def test_loading_a_converted_model_checks_its_config_sizes_too(converted, copy_of):
    """A converted model's config.json edited and resealed: `load` builds no model of it
    (what the plan refuses first, a size, is refused before; a number is not sized)."""
    path = copy_of(converted("mixtral"))
    edit_config(path, rope_theta="1e6")
    reseal(path, "config.json")
    with pytest.raises(ModelError, match="rope_theta is '1e6', not a number"):
        load(path, **LOAD)
