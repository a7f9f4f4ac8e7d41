"""The converter reads a model's names as mlx-lm's built model has them: a tensor's
decoder layer from the model's own layer paths, whatever the list holding the layers
is called, and a sanitize that cannot take a layer's tensors is one line."""

import json

import mlx.core as mx
import pytest
from mlx_lm.utils import load_model

from deltafin_mlx.convert.convert import ConvertOptions, convert
from deltafin_mlx.errors import ConvertError
from deltafin_mlx.model.modules import LayerIndex, layer_paths
from deltafin_mlx.testing import zoo


def test_a_names_layer_is_read_from_the_models_own_layer_paths(tmp_path):
    model, _ = load_model(zoo.write(tmp_path / "phi", "phi-msft"), lazy=True)
    paths = layer_paths(model)
    assert paths[1] == "transformer.h.1"
    layer_of = LayerIndex(paths)
    assert layer_of.index("transformer.h.1.moe.mlp.switch_mlp.fc1.weight") == 1
    assert layer_of.index("transformer.embd.wte.weight") is None
    assert layer_of.index("lm_head.linear.weight") is None
    assert layer_of.generic("transformer.h.1.mixer.Wqkv.weight") == "transformer.h.#.mixer.Wqkv.weight"
    assert layer_of.moved("transformer.h.1.mixer.Wqkv.weight", 0) == "transformer.h.0.mixer.Wqkv.weight"


def test_a_source_may_nest_the_layer_list_elsewhere():
    layer_of = LayerIndex(["language_model.model.layers.0", "language_model.model.layers.1"])
    assert layer_of.index("model.language_model.layers.12.mlp.gate.weight") == 12
    assert layer_of.index("model.visual.blocks.3.attn.qkv.weight") is None
    assert layer_of.index("model.sublayers.3.x") is None  # a whole path component only
    assert layer_of.rename(["model.language_model.layers.7.mlp.gate.weight"], 7) == \
        ("layers.7.", "layers.0.")


def test_a_sanitize_that_fails_on_a_layer_is_one_line(tmp_path):
    # qwen3_vl_moe's sanitize reads lm_head whatever it is given: a source without
    # it cannot be sanitized, and the converter says so instead of finding no experts.
    src = zoo.write(tmp_path / "src", "qwen3_vl_moe")
    index = src / "model.safetensors.index.json"
    weight_map = json.loads(index.read_text())["weight_map"]
    head = [n for n in weight_map if "lm_head" in n]
    assert head
    for shard in {weight_map[n] for n in head}:
        tensors = mx.load(str(src / shard))
        mx.save_safetensors(str(src / shard), {n: a for n, a in tensors.items() if n not in head},
                            metadata={"format": "mlx"})
    index.write_text(json.dumps({"weight_map": {n: f for n, f in weight_map.items()
                                                if n not in head}}))
    with pytest.raises(ConvertError, match=r"layer 0: mlx-lm's qwen3_vl_moe sanitize fails on "
                                           r"the layer's tensors \(KeyError: 'lm_head'\)"):
        convert(str(src), tmp_path / "out", ConvertOptions(progress=False))
