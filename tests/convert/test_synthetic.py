import json
import math
import re
import struct
import subprocess
import sys
import textwrap

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.utils import load_model
from safetensors import safe_open

from deltafin_mlx.testing.kimi_k3 import CONFIG as K3_CONFIG
from deltafin_mlx.testing.synthetic import ARCHITECTURES, checkpoint_size, make_checkpoint

TOKENS = [1, 5, 9, 200, 300, 17, 42, 99]
_ITEMSIZE = {"BF16": 2, "F32": 4, "U8": 1}
_SHARD_RE = {
    "kimi_k3": r"model-(\d{5})-of-(\d{6})\.safetensors",
    "kimi_k2": r"model-(\d+)-of-(\d+)\.safetensors",
    "qwen3_moe": r"model-(\d{5})-of-(\d{5})\.safetensors",
    "mixtral": r"model-(\d{5})-of-(\d{5})\.safetensors",
}


def read_header(path):
    # Parsed here rather than through the writer, so the test checks the
    # format, not the writer against itself.
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header


def shard_headers(path):
    return {p.name: read_header(p) for p in sorted(path.glob("model*.safetensors"))}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("synthetic")
    return {arch: make_checkpoint(root / arch, arch) for arch in ARCHITECTURES}


@pytest.fixture
def no_compile():
    # mx.compile on the CPU backend JIT-builds C++ on first use (~10 s cold);
    # these models are tiny, so run them uncompiled.
    mx.disable_compile()
    yield
    mx.enable_compile()


def record_routing(model):
    """Wrap every MoE's switch_mlp to record the expert ids it is called with."""
    log = []

    class Recorder(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def __call__(self, x, inds):
            log.append(np.array(inds).reshape(-1, inds.shape[-1]))
            return self.inner(x, inds)

    for _, module in model.named_modules():
        if "switch_mlp" in module and not isinstance(module, Recorder):
            module.switch_mlp = Recorder(module.switch_mlp)
    return log


def run(model, tokens=TOKENS):
    model.set_dtype(mx.float32)
    logits = model(mx.array([tokens]))
    mx.eval(logits)
    return np.array(logits[0])


def check_runs(path, num_moe_layers, top_k):
    model, _ = load_model(path)  # strict
    routing = record_routing(model)
    logits = run(model)
    assert np.isfinite(logits).all()
    assert logits.std(axis=0).mean() > 0.1, "logits barely vary across positions"
    assert len(routing) == num_moe_layers
    for inds in routing:
        assert inds.shape == (len(TOKENS), top_k)
        picks = {tuple(sorted(row)) for row in inds.tolist()}
        assert len(picks) > 1, "every token routed to the same experts"
        assert len(np.unique(inds)) > top_k
    per_layer = {tuple(map(tuple, np.sort(inds, axis=-1).tolist())) for inds in routing}
    assert len(per_layer) == len(routing), "two layers route identically"
    return model


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_shards_and_index_agree(checkpoints, arch):
    path = checkpoints[arch]
    index = json.loads((path / "model.safetensors.index.json").read_text())
    headers = shard_headers(path)
    n = len(headers)
    for i, name in enumerate(headers, start=1):
        m = re.fullmatch(_SHARD_RE[arch], name)
        assert m, name
        assert (int(m.group(1)), int(m.group(2))) == (i, n)

    weight_map = index["weight_map"]
    in_shards = {k: name for name, h in headers.items() for k in h}
    assert weight_map == in_shards
    total = 0
    for name, header in headers.items():
        end = 0
        for key, t in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"]):
            begin, stop = t["data_offsets"]
            assert begin == end, f"{name}:{key} not contiguous"
            assert stop - begin == math.prod(t["shape"]) * _ITEMSIZE[t["dtype"]]
            end = stop
        total += end
        # The reference reader must accept the file (it validates offsets).
        with safe_open(str(path / name), framework="numpy") as f:
            assert set(f.keys()) == set(header)
    assert index["metadata"]["total_size"] == total == checkpoint_size(arch)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_loads_and_runs(checkpoints, no_compile, arch):
    config = json.loads((checkpoints[arch] / "config.json").read_text())
    text = config.get("text_config", config)
    dense = text.get("first_k_dense_replace", 0)
    top_k = text.get("num_experts_per_token") or text["num_experts_per_tok"]
    check_runs(checkpoints[arch], text["num_hidden_layers"] - dense, top_k)


@pytest.mark.parametrize(
    "arch, overrides",
    [
        ("kimi_k3", dict(num_layers=5, num_experts=8, experts_per_token=2,
                         routed_expert_hidden_size=32, moe_intermediate_size=64,
                         kda_num_heads=3, vocab_size=1100)),
        ("kimi_k2", dict(num_layers=3, num_experts=8, experts_per_token=2,
                         hidden_size=96, num_expert_group=2, topk_group=1)),
        ("qwen3_moe", dict(num_layers=3, num_experts=8, experts_per_token=2,
                           hidden_size=96, mlp_only_layers=[1])),
        ("mixtral", dict(num_layers=2, num_experts=8, experts_per_token=2,
                         hidden_size=96, moe_intermediate_size=48)),
    ],
)
def test_overrides_scale(tmp_path, no_compile, arch, overrides):
    path = make_checkpoint(tmp_path, arch, seed=3, **overrides)
    config = json.loads((path / "config.json").read_text())
    text = config.get("text_config", config)
    assert text["num_hidden_layers"] == overrides["num_layers"]
    moe_layers = overrides["num_layers"] - text.get("first_k_dense_replace", 0)
    moe_layers -= len(overrides.get("mlp_only_layers", ()))
    check_runs(path, moe_layers, overrides["experts_per_token"])
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == checkpoint_size(arch, **overrides)


def test_kimi_k3_layout(checkpoints):
    path = checkpoints["kimi_k3"]
    config = json.loads((path / "config.json").read_text())
    text = config["text_config"]
    lin = text["linear_attn_config"]
    n = text["num_hidden_layers"]
    assert config["model_type"] == "kimi_k3" and text["model_type"] == "kimi_linear"
    assert sorted(lin["kda_layers"] + lin["full_attn_layers"]) == list(range(1, n + 1))
    assert lin["kda_layers"] and lin["full_attn_layers"]
    assert text["first_k_dense_replace"] == 1 and 1 < text["attn_res_block_size"] < n
    ids = [config[f"{k}_token_id"] for k in ("bos", "eos", "pad")]
    assert ids == [768, 770, 1023]
    assert config["media_placeholder_token_id"] == 789 and text["vocab_size"] == 1024

    headers = shard_headers(path)
    names = list(headers)
    assert len(names) == n + 3
    for layer in range(n):
        prefix = f"language_model.model.layers.{layer}."
        assert all(k.startswith(prefix) for k in headers[names[layer]])
    assert set(headers[names[n]]) == {
        "language_model.model.embed_tokens.weight",
        "language_model.lm_head.weight",
        "language_model.model.norm.weight",
        "language_model.model.output_attn_res_norm.weight",
        "language_model.model.output_attn_res_proj.weight",
    }
    assert {k.split(".")[0] for k in headers[names[n + 1]]} == {"mm_projector"}
    assert {k.split(".")[0] for k in headers[names[n + 2]]} == {"vision_tower"}

    tensors = {k: v for h in headers.values() for k, v in h.items()}
    H, lat = text["hidden_size"], text["routed_expert_hidden_size"]
    inner = text["moe_intermediate_size"]
    heads, hd = lin["num_heads"], lin["head_dim"]
    P = heads * hd

    def spec(name):
        t = tensors[f"language_model.model.layers.{name}"]
        return t["dtype"], t["shape"]

    kda = lin["kda_layers"][0] - 1
    mla = lin["full_attn_layers"][0] - 1
    kda_attn, mla_attn = f"{kda}.self_attn", f"{mla}.self_attn"
    assert spec(f"{kda_attn}.q_conv1d.weight") == ("F32", [P, 1, 4])
    assert spec(f"{kda_attn}.A_log") == ("F32", [128])
    assert spec(f"{kda_attn}.dt_bias") == ("F32", [P])
    assert spec(f"{kda_attn}.o_norm.weight") == ("F32", [hd])
    assert spec(f"{kda_attn}.f_b_proj.weight") == ("BF16", [P, hd])
    assert spec(f"{kda_attn}.b_proj.weight") == ("BF16", [heads, H])
    kv_a = text["kv_lora_rank"] + text["qk_rope_head_dim"]
    assert spec(f"{mla_attn}.kv_a_proj_with_mqa.weight") == ("BF16", [kv_a, H])
    mla_width = text["num_attention_heads"] * text["v_head_dim"]
    assert spec(f"{mla_attn}.g_proj.weight") == ("BF16", [mla_width, H])
    assert spec("0.mlp.gate_proj.weight") == ("BF16", [text["intermediate_size"], H])
    assert spec("0.self_attention_res_proj.weight") == ("BF16", [1, H])
    moe = "1.block_sparse_moe"
    assert spec(f"{moe}.gate.e_score_correction_bias") == ("F32", [text["num_experts"]])
    assert spec(f"{moe}.routed_expert_down_proj.weight") == ("BF16", [lat, H])
    shared = inner * text["num_shared_experts"]
    assert spec(f"{moe}.shared_experts.down_proj.weight") == ("BF16", [H, shared])
    expert_shapes = {"w1": (inner, lat), "w3": (inner, lat), "w2": (lat, inner)}
    for w, (out_dim, in_dim) in expert_shapes.items():
        e = f"{moe}.experts.7.{w}"
        assert spec(f"{e}.weight_packed") == ("U8", [out_dim, in_dim // 2])
        assert spec(f"{e}.weight_scale") == ("U8", [out_dim, in_dim // 32])
    # Everything that CHECKPOINT.md does not name float32 or uint8 is bf16.
    not_bf16 = re.compile(
        r"(conv1d\.weight|A_log|dt_bias|o_norm\.weight|e_score_correction_bias|"
        r"weight_packed|weight_scale)$"
    )
    for k, t in tensors.items():
        assert (t["dtype"] != "BF16") == bool(not_bf16.search(k)), k

    # A_log is padded past the real heads with zeros, as in the release.
    shard = path / names[kda]
    with safe_open(str(shard), framework="numpy") as f:
        a_log = f.get_tensor(f"language_model.model.layers.{kda}.self_attn.A_log")
    assert np.all(a_log[heads:] == 0) and np.all(a_log[:heads] > 0)


def test_kimi_k3_config_matches_release(checkpoints):
    real = json.loads(K3_CONFIG.read_text())
    ours = json.loads((checkpoints["kimi_k3"] / "config.json").read_text())

    def differing(a, b, prefix=""):
        assert list(a) == list(b), f"keys differ under {prefix or 'top level'}"
        out = set()
        for k in a:
            if isinstance(a[k], dict):
                out |= differing(a[k], b[k], f"{prefix}{k}.")
            elif a[k] != b[k]:
                out.add(prefix + k)
        return out

    scaled = {
        "bos_token_id", "eos_token_id", "pad_token_id",
        "media_placeholder_token_id",
        "attn_res_block_size", "hidden_size", "intermediate_size", "kv_lora_rank",
        "moe_intermediate_size", "num_attention_heads", "num_experts",
        "num_experts_per_token", "num_hidden_layers", "num_key_value_heads",
        "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
        "routed_expert_hidden_size", "vocab_size",
        "linear_attn_config.full_attn_layers",
        "linear_attn_config.kda_layers", "linear_attn_config.head_dim",
        "linear_attn_config.num_heads",
    }
    allowed = {f"text_config.{k}" for k in scaled} | {k for k in scaled if "." not in k}
    diff = differing(real, ours)
    assert {k for k in diff if not k.startswith("vision_config.")} <= allowed
    quant = "quantization_config"
    assert ours["text_config"][quant] == real["text_config"][quant]


def decode_mxfp4(packed, scales):
    # The format as CHECKPOINT.md describes it, independently of MLX.
    lut = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float32)
    codes = np.stack([packed & 15, packed >> 4], axis=-1)
    codes = codes.reshape(packed.shape[0], -1)  # low nibble first
    values = lut[codes & 7] * np.where(codes & 8, -1.0, 1.0)
    return values * np.exp2(np.repeat(scales.astype(np.float32) - 127, 32, axis=-1))


def test_kimi_k3_experts_are_mxfp4(checkpoints):
    path = checkpoints["kimi_k3"]
    model, _ = load_model(path)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    layer = 2
    mlp = model.language_model.model.layers[layer].mlp
    switch = mlp.switch_mlp
    for src, proj in (("w1", switch.gate_proj), ("w2", switch.down_proj)):
        assert proj.mode == "mxfp4"
        key = f"language_model.model.layers.{layer}.block_sparse_moe.experts.5.{src}"
        shard = path / index["weight_map"][f"{key}.weight_packed"]
        with safe_open(str(shard), framework="numpy") as f:
            packed = f.get_tensor(f"{key}.weight_packed")
            ours = decode_mxfp4(packed, f.get_tensor(f"{key}.weight_scale"))
        theirs = mx.dequantize(
            proj.weight[5], proj.scales[5], group_size=32, bits=4, mode="mxfp4"
        )
        np.testing.assert_array_equal(ours, np.array(theirs.astype(mx.float32)))
        # Scaled like a 1/sqrt(fan_in) init, so expert outputs stay O(1).
        rms = float(np.sqrt((ours**2).mean())) * math.sqrt(ours.shape[1])
        assert 0.3 < rms < 3, rms


@pytest.mark.parametrize("arch, flavor", [("kimi_k3", "k3"), ("kimi_k2", "k2")])
def test_kimi_tokenizer_files(checkpoints, arch, flavor):
    path = checkpoints[arch]
    assert (path / "tiktoken.model").exists()
    tok = json.loads((path / "tokenizer_config.json").read_text())
    config = json.loads((path / "config.json").read_text())
    specials = {int(i): t["content"] for i, t in tok["added_tokens_decoder"].items()}
    assert specials[config["bos_token_id"]] == "[BOS]"
    if arch == "kimi_k3":
        assert specials[config["eos_token_id"]] == "<|end_of_msg|>"
        assert specials[config["pad_token_id"]] == "[PAD]"
        assert specials[config["media_placeholder_token_id"]] == "<|media_pad|>"
    else:
        assert specials[config["eos_token_id"]] == "[EOS]"
    assert max(specials) < config.get("text_config", config)["vocab_size"]


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_bpe_tokenizer_loads(checkpoints, arch):
    from mlx_lm.tokenizer_utils import load as load_tokenizer
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    path = checkpoints[arch]
    config = json.loads((path / "config.json").read_text())
    text = "Experts route tokens: 42 of them, déjà vu 東京!"
    raw = Tokenizer.from_file(str(path / "tokenizer.json"))
    hf = AutoTokenizer.from_pretrained(path)
    assert hf.encode(text) == raw.encode(text).ids
    assert hf.decode(hf.encode(text), skip_special_tokens=True) == text
    assert 256 < len(hf) <= config["vocab_size"]
    assert hf.eos_token_id == config["eos_token_id"]
    if arch == "mixtral":
        assert hf.encode(text)[0] == hf.bos_token_id == config["bos_token_id"]
    wrapped = load_tokenizer(path)
    assert config["eos_token_id"] in wrapped.eos_token_ids
    assert wrapped.decode(wrapped.encode(text, add_special_tokens=False)) == text


def test_deterministic_in_seed(tmp_path):
    a = make_checkpoint(tmp_path / "a", "qwen3_moe", seed=1)
    b = make_checkpoint(tmp_path / "b", "qwen3_moe", seed=1)
    c = make_checkpoint(tmp_path / "c", "qwen3_moe", seed=2)
    files = sorted(p.name for p in a.iterdir())
    assert files == sorted(p.name for p in b.iterdir())
    for name in files:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    shard = next(a.glob("model-*.safetensors")).name
    assert (a / shard).read_bytes() != (c / shard).read_bytes()


def test_rejects_bad_overrides(tmp_path):
    with pytest.raises(ValueError):
        make_checkpoint(tmp_path, "kimi_k3", routed_expert_hidden_size=48)
    with pytest.raises(ValueError):
        make_checkpoint(tmp_path, "mixtral", experts_per_token=20)
    with pytest.raises(ValueError):
        make_checkpoint(tmp_path, "llama")
    with pytest.raises(TypeError):
        make_checkpoint(tmp_path, "mixtral", hidden=32)
    make_checkpoint(tmp_path / "k2", "kimi_k2", num_layers=2)
    with pytest.raises(FileExistsError):  # would be globbed in by loaders
        make_checkpoint(tmp_path / "k2", "kimi_k2", num_layers=3)


def test_memory_stays_bounded(tmp_path):
    # A checkpoint whose embedding and head are 128 MB each, written in a
    # fresh process so that the peak RSS is its own.
    script = textwrap.dedent(
        f"""
        import resource, sys
        from deltafin_mlx.testing.synthetic import make_checkpoint
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        make_checkpoint({str(tmp_path)!r}, "qwen3_moe", vocab_size=65536,
                        hidden_size=1024, num_layers=1, num_experts=4)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        print((peak - base) * (1 if sys.platform == "darwin" else 1024))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True
    )
    grew = int(out.stdout.split()[-1])
    written = sum(p.stat().st_size for p in tmp_path.glob("model*.safetensors"))
    assert written > 256e6
    assert grew < 100e6, f"RSS grew {grew / 1e6:.0f} MB writing {written / 1e6:.0f} MB"
