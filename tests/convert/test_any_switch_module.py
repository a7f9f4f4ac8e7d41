"""Any mlx-lm MoE whose routed experts are SwitchGLU/SwitchMLP modules converts and
streams to mlx-lm's own tokens: the model class and its `sanitize` decide the names
and layouts, not a list of architectures. Each type here is a tiny random model
built with mlx-lm's own class, saved as `mlx_lm.convert` saves it (float, and 4-bit
affine), converted with the default options and streamed with an expert cache
holding a quarter of its experts; the tokens are mlx-lm's loading the same
directory (float32, as the other exactness tests compute)."""

import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_map_with_path
from mlx_lm.utils import load_model, quantize_model, save_config, save_model

from deltafin_mlx.convert.convert import ConvertOptions, convert
from deltafin_mlx.convert.source import read_source
from deltafin_mlx.errors import ConvertError
from deltafin_mlx.format.manifest import read_manifest
from deltafin_mlx.model.build import build_model
from deltafin_mlx.model.modules import switch_classes
from deltafin_mlx.testing.decode import greedy, greedy_streamed

BASE = {"vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "max_position_embeddings": 8192, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "num_experts_per_tok": 2}

# One tiny configuration per model type: 8 experts (16 for deepseek_v3's groups).
CONFIGS = {
    "qwen3_moe": {"intermediate_size": 128, "num_experts": 8, "moe_intermediate_size": 64,
                  "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True},
    "mixtral": {"intermediate_size": 64, "num_local_experts": 8},
    "deepseek_v3": {"intermediate_size": 128, "moe_intermediate_size": 64,
                    "n_routed_experts": 16, "n_shared_experts": 1, "n_group": 4,
                    "topk_group": 2, "routed_scaling_factor": 2.5, "first_k_dense_replace": 1,
                    "num_hidden_layers": 3, "kv_lora_rank": 32, "q_lora_rank": 48,
                    "qk_rope_head_dim": 16, "qk_nope_head_dim": 32, "v_head_dim": 16,
                    "moe_layer_freq": 1, "topk_method": "noaux_tc", "scoring_func": "sigmoid",
                    "norm_topk_prob": True},
    "gpt_oss": {"num_local_experts": 8, "intermediate_size": 64, "sliding_window": 8,
                "layer_types": ["sliding_attention", "full_attention"]},
    "glm4_moe": {"intermediate_size": 128, "moe_intermediate_size": 64, "n_routed_experts": 8,
                 "n_shared_experts": 1, "n_group": 1, "topk_group": 1,
                 "routed_scaling_factor": 1.5, "first_k_dense_replace": 1,
                 "num_hidden_layers": 3, "norm_topk_prob": True, "use_qk_norm": True,
                 "attention_bias": False, "partial_rotary_factor": 0.5, "rope_scaling": None},
    "olmoe": {"intermediate_size": 64, "num_experts": 8},
    "granitemoe": {"intermediate_size": 64, "num_local_experts": 8, "logits_scaling": 2.0,
                   "attention_multiplier": 0.25, "embedding_multiplier": 4.0,
                   "residual_multiplier": 0.5, "attention_bias": False},
    "qwen3_next": {"intermediate_size": 128, "num_experts": 8, "moe_intermediate_size": 64,
                   "shared_expert_intermediate_size": 64, "decoder_sparse_step": 1,
                   "mlp_only_layers": [], "linear_num_value_heads": 4,
                   "linear_num_key_heads": 2, "linear_key_head_dim": 16,
                   "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4,
                   "partial_rotary_factor": 0.5, "full_attention_interval": 2,
                   "num_hidden_layers": 4},
    "nemotron_h": {"intermediate_size": 128, "moe_intermediate_size": 64,
                   "n_routed_experts": 8, "n_shared_experts": 1,
                   "moe_shared_expert_intermediate_size": 64, "n_group": 1, "topk_group": 1,
                   "norm_topk_prob": True, "routed_scaling_factor": 1.0,
                   "hybrid_override_pattern": ["M", "E", "*", "E"], "num_hidden_layers": 4,
                   "mamba_num_heads": 4, "mamba_head_dim": 16, "mamba_proj_bias": False,
                   "ssm_state_size": 16, "conv_kernel": 4, "n_groups": 1, "mlp_bias": False,
                   "layer_norm_epsilon": 1e-5, "use_bias": False, "use_conv_bias": True,
                   "attention_bias": False},
}


def tiny_model(model_type: str, seed: int = 0, **overrides):
    """mlx-lm's own class for the tiny config, with random weights scaled so that
    the experts decide the tokens (several classes start routers, expert biases or
    score corrections at zero, which would route every token alike)."""
    config = {**BASE, **CONFIGS[model_type], **overrides, "model_type": model_type}
    model = build_model(config)
    switches = [p for p, m in model.named_modules() if isinstance(m, switch_classes())]
    rng = np.random.default_rng(seed)

    def init(path, v):
        if not mx.issubdtype(v.dtype, mx.floating):
            return v
        expert = any(path.startswith(sp + ".") for sp in switches)
        if v.ndim == 1:
            base = 1.0 if "norm" in path or path.endswith("layernorm.weight") else 0.0
            return mx.array(base + 0.1 * rng.standard_normal(v.shape).astype(np.float32))
        scale = (2.0 if expert else 1.0) / np.sqrt(v.shape[-1])
        return mx.array(scale * rng.standard_normal(v.shape).astype(np.float32))

    model.update(tree_map_with_path(init, model.parameters()))
    model.set_dtype(mx.bfloat16)
    mx.eval(model.parameters())
    return model, config


def save_as_mlx_lm_convert(model_type: str, out: Path, bits=None) -> Path:
    """What `mlx_lm.convert` writes: the sanitized weights (and, with `bits`, the
    model quantized by mlx-lm's own rules) and config.json with its quantization."""
    model, config = tiny_model(model_type)
    if bits is not None:
        model, config = quantize_model(model, config, 64, bits)
    out.mkdir(parents=True)
    save_model(out, model)
    save_config(config, out / "config.json")
    return out


def oracle(src: Path):
    """mlx-lm's load of the directory at float32; a float one quantized by mlx-lm
    as the default options say (4-bit group 64, the experts too)."""
    model, config = load_model(src, lazy=True)
    if "quantization" not in config:
        model, _ = quantize_model(model, config, 64, 4)
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    return model


def prompt():
    return mx.array(np.random.default_rng(1).integers(1, 250, size=(1, 10)).astype(np.int32))


def assert_streams_mlx_lms_tokens(out: Path, src: Path, steps=12):
    tokens, logits = greedy_streamed(out, prompt(), steps)  # asserts experts were read
    ref_tokens, ref_logits = greedy(oracle(src), prompt(), steps)
    assert tokens.tolist() == ref_tokens.tolist()
    assert mx.allclose(logits, ref_logits, atol=1e-4).item()


@pytest.mark.parametrize("bits", [None, 4], ids=["float", "4bit"])
@pytest.mark.parametrize("model_type", sorted(CONFIGS))
def test_every_switch_module_type_streams_to_mlx_lms_tokens(model_type, bits, tmp_path):
    src = save_as_mlx_lm_convert(model_type, tmp_path / "src", bits)
    convert(str(src), tmp_path / "out", ConvertOptions(progress=False))
    m = read_manifest(tmp_path / "out")
    assert m.quantization["experts"].get("carried_over", False) == (bits is not None)
    assert_streams_mlx_lms_tokens(tmp_path / "out", src)


def test_per_expert_biases_are_kept_as_float_sections(tmp_path):
    src = save_as_mlx_lm_convert("gpt_oss", tmp_path / "src")
    convert(str(src), tmp_path / "out", ConvertOptions(progress=False))
    sections = {s["name"]: s for s in read_manifest(tmp_path / "out").experts["sections"]}
    for p in ("gate_proj", "up_proj", "down_proj"):
        assert sections[f"{p}.bias"]["dtype"] == "bfloat16"
        assert sections[f"{p}.bias"]["shape"] == [sections[f"{p}.weight"]["shape"][0]]


@pytest.mark.parametrize("model_type", ["gpt_oss", "nemotron_h", "granitemoe"])
def test_float_experts_kept_stream_to_mlx_lms_float_tokens(model_type, tmp_path):
    """`--expert-bits float --no-trunk-quant`: nothing is quantized (per-expert biases,
    SwitchMLP's fc1/fc2, a recipe that would give down_proj 8 bits), and the tokens
    are those of mlx-lm loading the float directory."""
    src = save_as_mlx_lm_convert(model_type, tmp_path / "src")
    out = tmp_path / "out"
    convert(str(src), out, ConvertOptions(bits=None, expert_bits="float", progress=False))
    assert all(s["dtype"] == "bfloat16" for s in read_manifest(out).experts["sections"])
    model, _ = load_model(src)
    model.set_dtype(mx.float32)
    tokens, logits = greedy_streamed(out, prompt(), 12)
    ref_tokens, ref_logits = greedy(model, prompt(), 12)
    assert tokens.tolist() == ref_tokens.tolist()
    assert mx.allclose(logits, ref_logits, atol=1e-4).item()


def test_switch_mlp_records_hold_fc1_and_fc2(tmp_path):
    src = save_as_mlx_lm_convert("nemotron_h", tmp_path / "src", bits=4)
    convert(str(src), tmp_path / "out", ConvertOptions(progress=False))
    names = [s["name"] for s in read_manifest(tmp_path / "out").experts["sections"]]
    assert names == [f"{p}.{k}" for p in ("fc1", "fc2") for k in ("weight", "scales", "biases")]


def test_new_families_link_their_experts_to_the_same_tokens(tmp_path):
    """mlx-lm's stacked sections (per-expert biases too) are byte ranges of the
    source: linked, no expert bytes are copied and the tokens are the same."""
    src = save_as_mlx_lm_convert("gpt_oss", tmp_path / "src", bits=4)
    convert(str(src), tmp_path / "out", ConvertOptions(progress=False, link_experts=True))
    assert not any(rel.endswith(".bank") for rel in read_manifest(tmp_path / "out").files)
    assert_streams_mlx_lms_tokens(tmp_path / "out", src)


def test_float_experts_cannot_be_linked_and_say_so(tmp_path):
    src = save_as_mlx_lm_convert("olmoe", tmp_path / "src")
    with pytest.raises(ConvertError, match="--link-experts"):
        convert(str(src), tmp_path / "out", ConvertOptions(progress=False, link_experts=True))


def test_an_expert_group_is_converted_alone_with_memory_bounded(tmp_path):
    """Conversion memory is a group of experts (GROUP_BYTES of source), not a layer:
    converting a model whose one layer's experts are twelve times that bound takes
    at most three groups of MLX memory (its source rows, what sanitize makes of them,
    the records); with the whole layer as one group it takes twice the layer."""
    model, config = tiny_model("qwen3_moe", num_experts=64, moe_intermediate_size=512,
                               hidden_size=256, intermediate_size=256)
    src = tmp_path / "big"
    src.mkdir()
    save_model(src, model)
    save_config(config, src / "config.json")
    saved = read_source(str(src), src, src)
    layer_experts = sum(t.nbytes for n, t in saved.tensors.items()
                        if n.startswith("model.layers.0.") and ".switch_mlp." in n)
    group = 4 << 20
    assert layer_experts >= 12 * group

    def peak(group_bytes, out):
        code = (
            "import mlx.core as mx\n"
            "import deltafin_mlx.convert.convert as c, deltafin_mlx.convert.experts as x\n"
            f"x.GROUP_BYTES = {group_bytes}\n"
            "mx.reset_peak_memory()\n"
            f"c.convert({str(src)!r}, {str(tmp_path / out)!r}, c.ConvertOptions(progress=False))\n"
            "print(mx.get_peak_memory())\n"
        )
        p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           check=True)
        return int(p.stdout.split()[-1])

    assert peak(group, "grouped") < 3 * group
    assert peak(layer_experts, "whole") > layer_experts  # what the bound saves


def test_tensor_parallel_records_of_other_expert_modules_are_refused_in_one_line(tmp_path):
    """Rank slices split SwitchGLU experts without per-expert biases: gpt-oss's biased
    experts and SwitchMLP ones are refused with --ranks, saying why."""
    for model_type in ("gpt_oss", "nemotron_h"):
        src = save_as_mlx_lm_convert(model_type, tmp_path / model_type, bits=4)
        with pytest.raises(ConvertError, match="--ranks 2: tensor parallelism splits SwitchGLU"):
            convert(str(src), tmp_path / f"{model_type}-out",
                    ConvertOptions(progress=False, ranks=2))


def save_one_tensor_per_expert(model_type: str, out: Path, release=lambda n, a: a) -> Path:
    """A Hugging Face release's layout: each expert's projections as tensors of
    their own (`...experts.<e>.gate_proj.weight`), which mlx-lm's sanitize stacks;
    `release` undoes what else sanitize converts."""
    model, config = tiny_model(model_type)
    weights = {}
    for name, a in tree_flatten(model.parameters()):
        a = release(name, a)
        if ".switch_mlp." in name:
            for e in range(a.shape[0]):
                weights[name.replace(".switch_mlp.", f".experts.{e}.")] = a[e]
        else:
            weights[name] = a
    out.mkdir(parents=True)
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    save_config(config, out / "config.json")
    return out


def test_the_trunk_is_sanitized_as_within_the_whole_checkpoint(tmp_path):
    """Qwen3-Next's sanitize shifts its norms by one and turns its conv weights only
    when it sees routed experts in the checkpoint: each layer's trunk (and the final
    norm, with no experts of its own) is converted as loading the whole release."""
    norms = (".input_layernorm.weight", ".post_attention_layernorm.weight",
             "model.norm.weight", ".q_norm.weight", ".k_norm.weight")

    def release(name, a):
        if name.endswith(norms) and a.ndim == 1:
            return a - 1.0
        return a.moveaxis(1, 2) if "conv1d.weight" in name else a

    src = save_one_tensor_per_expert("qwen3_next", tmp_path / "src", release)
    convert(str(src), tmp_path / "out", ConvertOptions(progress=False))
    assert_streams_mlx_lms_tokens(tmp_path / "out", src)


@pytest.mark.parametrize("model_type,bits", [("qwen3_moe", None), ("olmoe", None),
                                             ("gpt_oss", 4)])
def test_experts_converted_in_groups_are_the_records_of_a_whole_layer(
        model_type, bits, tmp_path, monkeypatch):
    """Groups of 3 of 8 experts (3, 3, 2: sanitize runs with the group's count) give
    the very bytes converting the layer's experts at once gives, from one tensor per
    expert and from mlx-lm's stacked tensors alike."""
    import deltafin_mlx.convert.experts as experts

    src = (save_one_tensor_per_expert(model_type, tmp_path / "src") if bits is None
           else save_as_mlx_lm_convert(model_type, tmp_path / "src", bits))
    convert(str(src), tmp_path / "whole", ConvertOptions(progress=False))
    m = read_manifest(tmp_path / "whole")
    saved = read_source(str(src), src, src).tensors
    sp = m.switch_path(m.moe_layers[0])
    stem = sp.rpartition(".")[0]
    one = sum(t.nbytes for n, t in saved.items() if n.startswith(f"{stem}.experts.0.")) + sum(
        t.nbytes for n, t in saved.items() if n.startswith(sp + ".")) // 8
    monkeypatch.setattr(experts, "GROUP_BYTES", 3 * one)
    groups = []
    real = experts.SanitizedExperts._convert_group
    monkeypatch.setattr(experts.SanitizedExperts, "_convert_group",
                        lambda self, layer, e0, e1: groups.append((e0, e1))
                        or real(self, layer, e0, e1))
    convert(str(src), tmp_path / "grouped", ConvertOptions(progress=False))
    assert groups[:3] == [(0, 3), (3, 6), (6, 8)]
    for layer in m.moe_layers:
        rel = m.experts["layers"][str(layer)]["bank"]
        assert (tmp_path / "grouped" / rel).read_bytes() == (tmp_path / "whole" / rel).read_bytes()
    assert_streams_mlx_lms_tokens(tmp_path / "grouped", src)


def test_a_new_familys_mlx_community_repository_converts_from_the_hub(tmp_path):
    """gpt-oss as an mlx-community repository: --scratch-limit gives the local
    conversion's files, --link-experts its tokens with no expert bytes copied."""
    import os

    from deltafin_mlx.testing.fake_hub import FakeHub
    from helpers import BIN

    src = save_as_mlx_lm_convert("gpt_oss", tmp_path / "src", bits=4)
    convert(str(src), tmp_path / "local", ConvertOptions(progress=False))
    with FakeHub() as hub:
        hub.add("mlx-community/tiny-gpt-oss-4bit", src)
        env = {**os.environ, **hub.env(tmp_path / "hf")}
        for out, how in (("scratch", ["--scratch-limit", "1GB"]), ("linked", ["--link-experts"])):
            p = subprocess.run([str(BIN / "deltafin-convert"), "mlx-community/tiny-gpt-oss-4bit",
                                str(tmp_path / out), *how, "--quiet"], capture_output=True,
                               text=True, timeout=600, env=env)
            assert p.returncode == 0, p.stderr
    a, b = read_manifest(tmp_path / "scratch"), read_manifest(tmp_path / "local")
    assert a.files == b.files and a.checksums == b.checksums
    assert not any(rel.endswith(".bank") for rel in read_manifest(tmp_path / "linked").files)
    assert_streams_mlx_lms_tokens(tmp_path / "linked", src)
