"""A model's Mixture of Experts comes from mlx-lm's built model (model/modules.py
`moe_shape`, model/build.py `build_moe`): experts per token are what its router hands
its routed-expert module, routed experts that module's size, the MoE layers those
that hold one, whatever each family calls them in config.json."""

import pytest

from deltafin_mlx.errors import ModelError
from deltafin_mlx.model.build import build_moe
from deltafin_mlx.testing import zoo

# Each family's own name for experts per token, and a name of another family's.
OWN_NAMES = [("ernie4_5_moe", "moe_k"), ("step3p5", "moe_top_k"), ("longcat_flash", "moe_topk"),
             ("gemma4_text", "top_k_experts"), ("kimi_linear", "num_experts_per_token"),
             ("mixtral", "num_experts_per_tok")]


@pytest.mark.parametrize("model_type, key", OWN_NAMES)
def test_experts_per_token_are_what_the_router_gives_never_another_familys_key(model_type,
                                                                               key):
    cfg = zoo.config(model_type, 256)
    assert key in cfg
    other = "num_experts_per_tok" if key != "num_experts_per_tok" else "moe_k"
    moe = build_moe({**cfg, key: 3, other: 5})[3]
    assert (moe.experts_per_token, moe.num_experts) == (3, zoo.NUM_EXPERTS)


def test_moe_layers_are_those_the_built_model_gives_routed_experts():
    _, paths, switches, _ = build_moe(zoo.config("nemotron_h", 256))  # pattern M E * E
    assert len(paths) == 4 and sorted(switches) == [1, 3]


def test_shared_width_is_what_the_block_computes_beside_its_routed_experts():
    # Mixtral's block holds its router alone: one score per expert.
    assert build_moe(zoo.config("mixtral", 256))[3].shared_width == zoo.NUM_EXPERTS
    one, two = (build_moe({**zoo.config("deepseek_v3", 256), "n_shared_experts": n})[3]
                for n in (1, 2))
    inner = zoo.config("deepseek_v3", 256)["moe_intermediate_size"]
    assert two.shared_width - one.shared_width == 2 * inner  # gate and up projections


def test_a_dense_model_is_said_to_be_mlx_lms_to_run():
    with pytest.raises(ModelError, match="qwen3: not a Mixture of Experts.*mlx-lm runs"):
        build_moe(zoo.config("qwen3", 256))
