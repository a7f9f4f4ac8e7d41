"""Checkpoints as their publishers release them convert, with default options, to
exactly the tokens of mlx-lm loading the same directory: DeepSeek-V3, V3.2 and
Kimi K2 in FP8 with 128x128 block scales; Kimi-K2-Thinking's and Kimi K2.5's INT4
compressed-tensors experts; gpt-oss's MXFP4 `_blocks`/`_scales` experts with their
biases; GLM-4.5, GLM-5, Qwen3-Next, MiniMax-M2 (FP8), Qwen3.5-MoE, Llama 4 and
Mistral 4 (experts stacked and fused in the release; Llama 4's transposed, Mistral
4's FP8 with one scale per tensor). The sources are written by
deltafin_mlx/testing/original_layouts.py as the inverse of each mlx-lm class's
`sanitize`; the first test checks that inverse.

The oracle is what `mlx_lm.convert -q` makes of the same directory, run fully in
memory at float32: mlx-lm's sanitize dequantizes FP8 to bf16, and a default
conversion quantizes float experts and trunk at 4 bits as that does, while experts
already quantized in a mode MLX runs (MXFP4, INT4 as 4-bit affine) stay as
mlx-lm loads them (Kimi K3's MXFP4 too). Today's other releases, DeepSeek-V3,
Kimi K2, Qwen3-MoE and Mixtral in bf16 and Kimi K3, are held to the same bar."""

import json
import os
import subprocess
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_map_with_path
from mlx_lm.models.switch_layers import SwitchLinear
from mlx_lm.utils import load_model, quantize_model

from deltafin_mlx.convert.convert import ConvertOptions, convert
from deltafin_mlx.format.manifest import read_manifest
from deltafin_mlx.testing.decode import greedy, greedy_streamed
from deltafin_mlx.testing.fake_hub import FakeHub
from deltafin_mlx.testing.mlx_lm_format import write_mlx_lm_format
from deltafin_mlx.testing.original_layouts import SOURCES, built_model, write_original
from helpers import BIN

# Each of original_layouts.SOURCES: how far its release's number format rounds a
# weight, relative to its tensor's largest magnitude (bf16 ~2^-8; FP8 e4m3 per 128x128
# block; INT4 over groups of 32; MXFP4's shared power-of-two scale over 32).
ROUNDING = {
    "deepseek_v3_fp8": 0.06,
    "deepseek_v32_fp8": 0.06,
    "kimi_k2_fp8": 0.06,
    "kimi_k2_int4": 0.1,
    "kimi_k25_int4": 0.1,
    "gpt_oss": 0.2,
    "glm4_moe": 0.01,
    "glm_moe_dsa": 0.01,
    "qwen3_next": 0.01,
    "minimax_fp8": 0.06,
    "mistral4_fp8": 0.06,
    "qwen3_5_moe": 0.01,
    "llama4": 0.01,
    "deepseek_v3": 0.01,
}

# Today's five in bf16 (K3's experts MXFP4), as deltafin_mlx/testing/synthetic.py
# writes their releases (conftest's `sources`); DeepSeek-V3 in bf16 is in SOURCES.
SYNTHETIC = ("kimi_k3", "kimi_k2", "qwen3_moe", "mixtral")

# Experts the release already quantized in a mode MLX runs: carried over as they are.
CARRIED = ("gpt_oss", "kimi_k2_int4", "kimi_k25_int4", "kimi_k3")


@pytest.fixture(scope="module")
def releases(tmp_path_factory):
    root = tmp_path_factory.mktemp("releases")
    cache = {}

    def get(source):
        if source not in cache:
            cache[source] = write_original(root / source, source)
        return cache[source]

    return get


def prompt(length=12, seed=0):
    rng = np.random.default_rng(seed)
    return mx.array(rng.integers(1, 380, size=(1, length)).astype(np.int32))


def dense(module):
    """A (switch) linear's weight as float32, dequantized where it is quantized."""
    if not hasattr(module, "scales"):
        return module.weight.astype(mx.float32)
    return mx.dequantize(module.weight, module.scales, getattr(module, "biases", None),
                         group_size=module.group_size, bits=module.bits, mode=module.mode)


@pytest.mark.parametrize("source", SOURCES)
def test_mlx_lm_loads_each_release_as_the_model_it_was_built_from(source, releases):
    """The writer inverts sanitize: every weight comes back up to the release's
    rounding (a swapped gate/up, a transposed kv_b_proj or a misplaced block scale
    would be off by its whole size). And the experts decide the tokens."""
    src = releases(source)
    config = json.loads((src / "config.json").read_text())
    built = built_model(config)
    loaded, _ = load_model(src)
    modules = dict(loaded.named_modules())
    got = dict(tree_flatten(loaded.parameters()))
    for name, want in tree_flatten(built.parameters()):
        owner, leaf = name.rsplit(".", 1)
        if leaf == "weight" and hasattr(modules[owner], "scales"):
            value = dense(modules[owner])
        else:
            value = got[name].astype(mx.float32)
        err = (mx.abs(value - want).max() / mx.abs(want).max()).item()
        assert err <= ROUNDING[source], (name, err)

    tokens, _ = greedy(built, prompt(), 8)
    for path, m in built.named_modules():
        if isinstance(m, SwitchLinear) and path.endswith("down_proj"):
            m.weight = mx.zeros_like(m.weight)
            if "bias" in m:
                m.bias = mx.zeros_like(m.bias)
    without_experts, _ = greedy(built, prompt(), 8)
    assert (tokens != without_experts).any()


def assert_same_greedy(out, expected, steps=16):
    """The conversion at `out`, streamed with an expert cache of a quarter of its
    experts, gives `expected`'s greedy tokens and bit-identical logits."""
    tokens, logits = greedy_streamed(out, prompt(), steps)  # asserts experts were read
    ref_tokens, ref_logits = greedy(expected, prompt(), steps)
    assert (tokens == ref_tokens).all()
    assert mx.array_equal(logits, ref_logits).item()  # bit-identical, not just close


def oracle(src):
    """`mlx_lm.convert -q` of `src` at the default settings, in float32: load (its
    sanitize dequantizes FP8), cast to the config's dtype, quantize the trunk with
    the model's own predicate and float experts at 4-bit affine, group 64."""
    model, config = load_model(Path(src), lazy=True)
    cast = getattr(model, "cast_predicate", lambda _: True)
    text = config.get("text_config", {})
    dtype = getattr(mx, next(c[k] for c in (config, text) for k in ("torch_dtype", "dtype")
                             if c.get(k)))
    model.update(tree_map_with_path(
        lambda k, v: v.astype(dtype) if cast(k) and mx.issubdtype(v.dtype, mx.floating) else v,
        model.parameters()))
    own = getattr(model, "quant_predicate", None)

    def predicate(path, module):
        if isinstance(module, SwitchLinear):
            return {"group_size": 64, "bits": 4, "mode": "affine"}
        return own(path, module) if own else True

    model, _ = quantize_model(model, config, 64, 4, quant_predicate=predicate)
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    return model


@pytest.mark.parametrize("source", [*SOURCES, *SYNTHETIC])
def test_a_release_converts_to_mlx_lms_tokens(source, releases, sources, tmp_path):
    src = releases(source) if source in SOURCES else sources(source)
    out = tmp_path / "out"
    convert(str(src), out, ConvertOptions(progress=False))
    m = read_manifest(out)
    expected = oracle(src)
    assert m.quantization["experts"].get("carried_over", False) == (source in CARRIED)
    assert_same_greedy(out, expected)


def test_an_mlx_community_glm_repository_converts_from_the_hub_with_a_scratch_limit_or_linked(
        releases, tmp_path):
    """GLM-4.5 as mlx-community publishes it (`mlx_lm.convert -q` of the release: its
    experts stacked in 4-bit affine): from the hub shard by shard under a scratch
    limit, the same bytes as from a local directory; linked into the hub cache, no
    expert bytes copied and mlx-lm's tokens."""
    src = write_mlx_lm_format(releases("glm4_moe"), tmp_path / "mlx", bits=4)
    convert(str(src), tmp_path / "local", ConvertOptions(progress=False))
    repo = "mlx-community/Tiny-GLM-4.5-4bit"
    with FakeHub() as hub:
        hub.add(repo, src)
        env = {**os.environ, **hub.env(tmp_path / "hf")}
        for out, how in (("scratch", ["--scratch-limit", "1GB"]), ("linked", ["--link-experts"])):
            p = subprocess.run([str(BIN / "deltafin-convert"), repo, str(tmp_path / out), *how,
                                "--quiet"], capture_output=True, text=True, timeout=600, env=env)
            assert p.returncode == 0, p.stderr
    a, b = read_manifest(tmp_path / "scratch"), read_manifest(tmp_path / "local")
    assert a.files == b.files and a.checksums == b.checksums
    linked = read_manifest(tmp_path / "linked")
    assert all(rel.startswith("blobs/") for rel in linked.linked["files"])  # the hub cache's
    assert not any(rel.endswith(".bank") for rel in linked.files)  # no expert bytes copied
    model, _ = load_model(src)  # mlx-lm's own 4-bit: the conversion carries it as it is
    model.set_dtype(mx.float32)
    for out in ("local", "linked"):  # packed and linked alike
        assert_same_greedy(tmp_path / out, model)


@pytest.mark.parametrize("source", ["deepseek_v3_fp8", "gpt_oss"])
def test_a_release_converts_from_the_hub_within_a_two_shard_scratch_limit(source, releases, tmp_path):
    """How a 700 GB FP8 release is converted on a Mac: from the hub with a scratch
    limit of two shards (and the small files: the embedding rides in the first shard
    and the head in the last, as in DeepSeek-V3's release), the same bytes as from a
    local copy."""
    src = releases(source)
    convert(str(src), tmp_path / "local", ConvertOptions(progress=False))
    shards = sorted(p.stat().st_size for p in src.glob("model*.safetensors"))
    assert len(shards) >= 3
    small = sum(p.stat().st_size for p in src.iterdir() if not p.name.startswith("model-"))
    limit = sum(shards[-2:]) + small
    with FakeHub() as hub:
        hub.add(f"someone/{source}", src)
        p = subprocess.run([str(BIN / "deltafin-convert"), f"someone/{source}",
                            str(tmp_path / "scratch"), "--scratch-limit",
                            str(limit), "--quiet"],
                           capture_output=True, text=True, timeout=600,
                           env={**os.environ, **hub.env(tmp_path / "hf")})
    assert p.returncode == 0, p.stderr
    a, b = read_manifest(tmp_path / "scratch"), read_manifest(tmp_path / "local")
    assert a.files == b.files and a.checksums == b.checksums
