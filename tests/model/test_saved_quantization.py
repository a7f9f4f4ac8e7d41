"""What a converted or mlx-lm-quantized model's config.json `quantization` block says,
read the way mlx-lm reads it (model/quantization.py): a block that is not mlx-lm's is
one line, never a traceback, and a path that names no module of mlx-lm's is not read
as a layer's experts."""

from types import SimpleNamespace

import pytest

from deltafin_mlx.errors import DeltafinError
from deltafin_mlx.model.quantization import quantization_by_part, saved_layer_quantization

BLOCK = {"group_size": 64, "bits": 4, "mode": "affine"}
EIGHT = {"group_size": 64, "bits": 8, "mode": "affine"}


def test_each_layers_experts_are_read_under_every_switch_name_mlx_lm_gives_them():
    block = {**BLOCK, "model.layers.1.mlp.switch_mlp.up_proj": EIGHT,  # most families
             "model.layers.2.mlp.experts.up_proj": EIGHT,  # gpt-oss
             "model.layers.2.mlp.experts.down_proj": BLOCK}
    layers = saved_layer_quantization(block)
    assert sorted(layers) == [1, 2]
    assert (layers[1]["bits"], layers[2]["bits"]) == (8, 8)
    assert layers[2]["linears"] == {"down_proj": BLOCK}  # the linear quantized otherwise


@pytest.mark.parametrize("path", ["model.layers.\u00b2.mlp.switch_mlp.up_proj",
                                  "model.layers.x.mlp.switch_mlp.up_proj",
                                  "model.layers.1.self_attn.q_proj"])
def test_a_path_naming_no_layers_experts_is_not_read_as_one(path):
    assert saved_layer_quantization({**BLOCK, path: EIGHT}) == {}


@pytest.mark.parametrize("block", [{"model.layers.0.self_attn.q_proj": {}},
                                   {"group_size": 64, "bits": "4"}])
def test_a_quantization_block_that_is_not_mlx_lms_is_one_line(block):
    manifest = SimpleNamespace(moe_layers=[], quantization={}, switch_path=str)
    with pytest.raises(DeltafinError) as e:
        quantization_by_part({"quantization": block}, manifest)
    assert "config.json: quantization" in str(e.value) and "\n" not in str(e.value)
