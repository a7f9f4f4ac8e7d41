"""mlx-lm's own format as a conversion source: a directory `mlx_lm.convert` wrote
(the layout of every mlx-community repository), float or quantized, converts and
streams to exactly the tokens and logits of mlx-lm loading that same directory fully
in memory. Its stacked experts are read one expert at a time, experts mlx-lm
quantized are carried over byte for byte (and can be linked), and its quantized
trunk stays as mlx-lm made it."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.utils import load_model

from conftest import make_source, reference_model
from deltafin_mlx.cli import convert as convert_cli
from deltafin_mlx.convert.convert import ConvertOptions, convert
from deltafin_mlx.convert.source import Source, read_source
from deltafin_mlx.engine.load import load
from deltafin_mlx.errors import ConvertError
from deltafin_mlx.format.bank import read_layout
from deltafin_mlx.format.manifest import read_manifest
from deltafin_mlx.format.record import linear_quant
from deltafin_mlx.format.verify import verify_model
from deltafin_mlx.testing.decode import greedy
from deltafin_mlx.testing.fake_hub import FakeHub
from deltafin_mlx.testing.mlx_lm_format import write_mlx_lm_format
from deltafin_mlx import runtime
from helpers import BIN

# Every supported type (Kimi K2 is a deepseek_v3 model in mlx-lm, whose format splits
# kv_b_proj into embed_q/unembed_out).
ARCHS = ("qwen3_moe", "kimi_k2", "mixtral", "kimi_k3")


def prompt(length=12, seed=0):
    rng = np.random.default_rng(seed)
    return mx.array(rng.integers(1, 380, size=(1, length)).astype(np.int32))


@pytest.fixture(scope="session")
def mlx_lm_dirs(tmp_path_factory, sources):
    """`mlx_lm.convert` of a tiny generated release: float (bits None) or quantized."""
    root = tmp_path_factory.mktemp("mlx_lm")
    cache = {}

    def get(arch, bits=None, recipe=None):
        key = (arch, bits, recipe)
        if key not in cache:
            out = root / f"{arch}-{bits or 'float'}-{recipe or 'uniform'}"
            cache[key] = write_mlx_lm_format(sources(arch), out, bits, recipe=recipe)
        return cache[key]

    return get


def oracle(mlx_dir):
    """What a default conversion must equal, computing in float32: mlx-lm loading
    the directory fully in memory; where mlx-lm left it all in float, quantized by
    mlx-lm as the default options say (as `mlx_lm.convert -q` would)."""
    if "quantization" not in json.loads((Path(mlx_dir) / "config.json").read_text()):
        return reference_model(mlx_dir)
    model, _ = load_model(Path(mlx_dir))
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    return model


def streamed(out):
    """The converted model with an expert cache holding a quarter of its experts."""
    m = read_manifest(out)
    slots = m.experts["num_experts"] * len(m.moe_layers) // 4
    model, _ = load(out, cache_slots=slots, tokenizer=False)
    return model


def assert_same_greedy(out, expected_model, steps=16):
    model = streamed(out)
    try:
        tokens, logits = greedy(model, prompt(), steps)
        assert runtime(model).stats.misses > 0  # the experts streamed
    finally:
        runtime(model).close()
    ref_tokens, ref_logits = greedy(expected_model, prompt(), steps)
    assert (tokens == ref_tokens).all()
    assert mx.array_equal(logits, ref_logits).item()  # bit-identical, not just close


@pytest.mark.parametrize("bits", [None, 4], ids=["unquantized", "4bit"])
@pytest.mark.parametrize("arch", ARCHS)
def test_an_mlx_lm_directory_converts_to_mlx_lms_tokens(arch, bits, mlx_lm_dirs, tmp_path):
    """`mlx_lm.convert` without -q (float) and with -q (4-bit affine); Kimi K3's
    experts stay MXFP4 in both, as its release has them."""
    src = mlx_lm_dirs(arch, bits)
    convert(str(src), tmp_path / "out", ConvertOptions(progress=False))
    m = read_manifest(tmp_path / "out")
    if arch == "kimi_k3":
        assert m.quantization["experts"]["mode"] == "mxfp4"
    carried = arch == "kimi_k3" or bits is not None
    assert m.quantization["experts"].get("carried_over", False) == carried
    assert_same_greedy(tmp_path / "out", oracle(src))


def test_mlx_lms_quantized_experts_are_carried_over_byte_for_byte(mlx_lm_dirs, tmp_path):
    src = mlx_lm_dirs("qwen3_moe", bits=4)
    out = tmp_path / "out"
    # Carried as saved: an expert option would not be applied, so it is refused.
    with pytest.raises(ConvertError, match="carried over as they are"):
        convert(str(src), out, ConvertOptions(progress=False, expert_bits=8))
    convert(str(src), out, ConvertOptions(progress=False))
    m = read_manifest(out)
    saved = {}
    for f in src.glob("model*.safetensors"):
        saved.update(mx.load(str(f)))
    for layer in m.moe_layers:
        sp = m.switch_path(layer)
        layout = read_layout(m.bank_path(layer))
        raw = np.fromfile(m.bank_path(layer), dtype=np.uint8)
        for e in (0, m.experts["num_experts"] - 1):
            base = layout.header_size + e * layout.record_size
            for s in layout.sections:
                want = saved[f"{sp}.{s.name}"][e]
                got = raw[base + s.offset: base + s.offset + s.nbytes]
                assert got.tobytes() == np.asarray(want.view(mx.uint8)).tobytes(), s.name


def test_a_quantized_trunk_stays_as_mlx_lm_saved_it(tmp_path):
    # MLA widths the group size divides, so mlx-lm quantizes the embed_q/unembed_out
    # its format splits DeepSeek-V3's kv_b_proj into (QuantizedMultiLinear).
    hf = make_source(tmp_path / "hf", "kimi_k2", qk_nope_head_dim=64, kv_lora_rank=64)
    src = write_mlx_lm_format(hf, tmp_path / "mlx", bits=4)
    out = tmp_path / "out"
    with pytest.raises(ConvertError, match="kept as it was saved"):  # it would not apply
        convert(str(src), out, ConvertOptions(progress=False, bits=8))
    convert(str(src), out, ConvertOptions(progress=False))
    saved = {}
    for f in src.glob("model*.safetensors"):
        saved.update(mx.load(str(f)))
    converted = {}
    for f in (out / "trunk").glob("*.safetensors"):
        converted.update(mx.load(str(f)))
    # Every trunk tensor, the split MLA projections included, byte for byte.
    assert any(n.endswith(".embed_q.scales") for n in converted)
    assert any(n.endswith(".unembed_out.scales") for n in converted)
    for name, a in converted.items():
        assert mx.array_equal(a, saved[name]).item() and a.dtype == saved[name].dtype, name
    assert_same_greedy(out, oracle(src))


def test_stacked_experts_are_never_loaded_whole(mlx_lm_dirs, tmp_path, monkeypatch):
    """Each expert is read alone from its stacked tensor: conversion memory is one
    expert and one layer's trunk, however many experts a layer has."""
    loaded = []
    whole = Source.load

    def spy(self, name):
        loaded.append(name)
        return whole(self, name)

    monkeypatch.setattr(Source, "load", spy)
    for bits in (None, 4):
        convert(str(mlx_lm_dirs("qwen3_moe", bits=bits)), tmp_path / f"out-{bits}",
                ConvertOptions(progress=False))
    assert loaded and not [n for n in loaded if ".switch_mlp." in n]


def test_linked_mlx_lm_experts_give_the_packed_conversions_tokens(mlx_lm_dirs, tmp_path):
    src = mlx_lm_dirs("qwen3_moe", bits=4)
    convert(str(src), tmp_path / "packed", ConvertOptions(progress=False))
    convert(str(src), tmp_path / "linked", ConvertOptions(progress=False, link_experts=True))
    linked = read_manifest(tmp_path / "linked")
    assert not any(rel.endswith(".bank") for rel in linked.files)  # no expert bytes copied
    assert linked.linked["root"] == os.path.realpath(src)
    assert_same_greedy(tmp_path / "linked", oracle(src))


def test_an_mlx_community_repository_converts_from_the_hub_with_a_scratch_limit_or_linked(
        mlx_lm_dirs, tmp_path):
    src = mlx_lm_dirs("qwen3_moe", bits=4)
    convert(str(src), tmp_path / "local", ConvertOptions(progress=False))
    with FakeHub() as hub:
        hub.add("mlx-community/Tiny-Qwen3-MoE-4bit", src)
        env = {**os.environ, **hub.env(tmp_path / "hf")}
        for out, how in (("scratch", ["--scratch-limit", "1GB"]), ("linked", ["--link-experts"])):
            p = subprocess.run([str(BIN / "deltafin-convert"), "mlx-community/Tiny-Qwen3-MoE-4bit",
                                str(tmp_path / out), *how, "--quiet"], capture_output=True,
                               text=True, timeout=600, env=env)
            assert p.returncode == 0, p.stderr
    a, b = read_manifest(tmp_path / "scratch"), read_manifest(tmp_path / "local")
    assert a.files == b.files and a.checksums == b.checksums
    linked = read_manifest(tmp_path / "linked")
    assert all(rel.startswith("blobs/") for rel in linked.linked["files"])  # the hub cache's
    assert not any(rel.endswith(".bank") for rel in linked.files)
    assert_same_greedy(tmp_path / "linked", oracle(src))


def test_stacked_experts_that_disagree_with_config_json_are_refused_in_one_line(
        mlx_lm_dirs, copy_of, tmp_path, capsys):
    src = copy_of(mlx_lm_dirs("qwen3_moe", bits=4))
    config = json.loads((src / "config.json").read_text())
    config["num_experts"] = 8  # the stacked tensors hold 16
    (src / "config.json").write_text(json.dumps(config))
    assert convert_cli.main([str(src), str(tmp_path / "out"), "--quiet"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert "switch_mlp.gate_proj.weight is U32 [16," in err and "expected U32 [8," in err, err


def test_mixed_3_6_carries_each_layers_quantization_and_streams_to_mlx_lms_tokens(
        mlx_lm_dirs, tmp_path, capsys):
    """mlx-lm's mixed recipes give some layers' down_proj more bits than the rest:
    each layer's experts are carried as saved, with that layer's bits and group size
    in the manifest, and stream (a cache below every layer's experts) to the tokens
    and logits of mlx_lm.load's model."""
    src = mlx_lm_dirs("qwen3_moe", bits=4, recipe="mixed_3_6")
    out = tmp_path / "out"
    assert convert_cli.main([str(src), str(out), "--quiet"]) == 0
    said = capsys.readouterr().out.strip().splitlines()[-1]
    assert said.endswith("experts: 3-bit affine (group size 64), carried over as saved in the "
                         "first MoE layer, each layer as mlx-lm saved it"), said
    m = read_manifest(out)
    saved = json.loads((src / "config.json").read_text())["quantization"]
    bits = {}
    for layer in m.moe_layers:
        for proj in ("gate_proj", "up_proj", "down_proj"):
            own = saved[f"{m.switch_path(layer)}.{proj}"]
            q = linear_quant(m.expert_quant(layer), proj)
            assert (q["bits"], q["group_size"]) == (own["bits"], own["group_size"] or 64)
        bits[layer] = linear_quant(m.expert_quant(layer), "down_proj")["bits"]
    assert set(bits.values()) == {3, 6}, bits  # a layout per layer, not one for all
    assert all(("quantization" in m.experts["layers"][str(layer)]) == (b != bits[m.moe_layers[0]])
               for layer, b in bits.items())
    expected = oracle(src)
    assert_same_greedy(out, expected)
    whole, _ = load(out, tokenizer=False)  # a cache of every expert: read once, all resident
    try:
        tokens, logits = greedy(whole, prompt(), 8)
        assert runtime(whole).cache.all_resident
    finally:
        runtime(whole).close()
    ref_tokens, ref_logits = greedy(expected, prompt(), 8)
    assert (tokens == ref_tokens).all() and mx.array_equal(logits, ref_logits).item()


def test_mixed_3_6_experts_link_verify_and_stream_layer_by_layer(mlx_lm_dirs, tmp_path):
    """Linked in place, each layer's link table is read with that layer's layout: the
    model verifies and streams to mlx_lm.load's tokens."""
    src = mlx_lm_dirs("qwen3_moe", bits=4, recipe="mixed_3_6")
    out = tmp_path / "linked"
    convert(str(src), out, ConvertOptions(progress=False, link_experts=True))
    assert read_manifest(out).mixed and verify_model(out).problems == []
    assert_same_greedy(out, oracle(src))


def test_a_null_group_size_is_mlx_defaults_for_the_mode(mlx_lm_dirs, tmp_path):
    """mlx_lm.convert's recipes without --q-group-size save `"group_size": null` per
    module, which MLX takes as the mode's default (64 for affine)."""
    src = tmp_path / "src"
    shutil.copytree(mlx_lm_dirs("qwen3_moe", bits=4), src)
    config = json.loads((src / "config.json").read_text())
    switches = [f"model.layers.{i}.mlp.switch_mlp.{p}" for i in range(config["num_hidden_layers"])
                for p in ("gate_proj", "up_proj", "down_proj")]
    for key in ("quantization", "quantization_config"):
        block = config[key]
        block.update({p: {"group_size": 64, "bits": 4, "mode": "affine"} for p in switches})
        routers = [p for p, entry in block.items() if isinstance(entry, dict)
                   and entry["bits"] == 8]
        assert routers  # the routers' own entries (8 bits) get a null too
        for entry in block.values():
            if isinstance(entry, dict):
                entry["group_size"] = None
    (src / "config.json").write_text(json.dumps(config))
    convert(str(src), tmp_path / "out", ConvertOptions(progress=False))
    m = read_manifest(tmp_path / "out")
    assert (m.quantization["experts"]["bits"], m.quantization["experts"]["group_size"]) == (4, 64)
    assert_same_greedy(tmp_path / "out", oracle(src))


def test_conversion_memory_is_a_fraction_of_one_layers_stacked_experts(mlx_lm_dirs, tmp_path):
    """Peak memory while converting (after a first conversion has warmed up every
    import and allocator) stays under a quarter of one layer's stacked experts: no
    stacked tensor is ever held whole."""
    big = write_mlx_lm_format(
        make_source(tmp_path / "hf", "qwen3_moe", num_layers=2, num_experts=64,
                    hidden_size=256, moe_intermediate_size=512), tmp_path / "big")
    saved = read_source(str(big), big, big)
    layer_experts = sum(t.nbytes for n, t in saved.tensors.items()
                        if n.startswith("model.layers.0.") and ".switch_mlp." in n)
    assert layer_experts >= 48 << 20
    code = (
        "import resource\n"
        "import deltafin_mlx.convert.convert as c\n"
        f"c.convert({str(mlx_lm_dirs('qwen3_moe'))!r}, {str(tmp_path / 'warm')!r}, "
        "c.ConvertOptions(progress=False))\n"
        "base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024\n"
        f"c.convert({str(big)!r}, {str(tmp_path / 'out')!r}, c.ConvertOptions(progress=False))\n"
        "peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024\n"
        "print(base, peak)\n"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    base, peak = map(int, p.stdout.split()[-2:])
    assert peak - base < layer_experts // 4, (peak - base, layer_experts)
