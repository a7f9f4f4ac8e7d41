"""A release stores beside a weight the tensors sanitize consumes with it (its FP8
scale, a static activation scale, INT4's scale and shape, a quantized module's
scales and biases): the converter sorts them with their weight, so a layer's
trunk never holds a scale whose weight went with the experts (Mistral 4's FP8
`experts.down_proj` and its `experts.down_proj_scale_inv`)."""

from deltafin_mlx.convert.experts import companions

MISTRAL4 = [
    "mlp.experts.gate_up_proj", "mlp.experts.gate_up_proj_scale_inv",
    "mlp.experts.gate_up_proj_activation_scale",
    "mlp.experts.down_proj", "mlp.experts.down_proj_scale_inv",
    "mlp.experts.down_proj_activation_scale",
    "mlp.gate.weight",
    "self_attn.q_a_proj.weight", "self_attn.q_a_proj.weight_scale_inv",
    "self_attn.q_a_proj.activation_scale",
    "self_attn.q_a_layernorm.weight",
]


def test_a_stacked_expert_tensor_named_as_a_parameter_takes_its_suffixed_scales():
    assert sorted(companions("mlp.experts.down_proj", MISTRAL4)) == [
        "mlp.experts.down_proj_activation_scale", "mlp.experts.down_proj_scale_inv"]
    assert sorted(companions("mlp.experts.gate_up_proj", MISTRAL4)) == [
        "mlp.experts.gate_up_proj_activation_scale", "mlp.experts.gate_up_proj_scale_inv"]


def test_a_modules_weight_takes_the_modules_other_tensors_and_no_neighbours():
    assert sorted(companions("self_attn.q_a_proj.weight", MISTRAL4)) == [
        "self_attn.q_a_proj.activation_scale", "self_attn.q_a_proj.weight_scale_inv"]
    assert companions("mlp.gate.weight", MISTRAL4) == []
    assert companions("self_attn.q_a_layernorm.weight", MISTRAL4) == []


def test_int4_and_mlx_quantized_modules_keep_their_parts_together():
    int4 = ["experts.0.w1.weight_packed", "experts.0.w1.weight_scale",
            "experts.0.w1.weight_shape", "experts.0.w2.weight_packed"]
    assert sorted(companions(int4[0], int4)) == int4[1:3]
    mlx = ["switch_mlp.up_proj.weight", "switch_mlp.up_proj.scales",
           "switch_mlp.up_proj.biases", "switch_mlp.up_proj_b.weight"]
    assert sorted(companions(mlx[0], mlx)) == ["switch_mlp.up_proj.biases",
                                               "switch_mlp.up_proj.scales"]


def test_gpt_oss_parts_are_each_their_own_stacked_tensor():
    names = ["mlp.experts.gate_up_proj_blocks", "mlp.experts.gate_up_proj_scales",
             "mlp.experts.gate_up_proj_bias"]
    assert all(companions(n, names) == [] for n in names)
