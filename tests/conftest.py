"""Shared fixtures: tiny generated source checkpoints, their conversions, and the
oracle — the same source quantized by mlx-lm itself and run fully in memory."""

import shutil
from pathlib import Path

import mlx.core as mx
import pytest
from mlx.utils import tree_map_with_path
from mlx_lm.utils import load_model, quantize_model

from deltafin_mlx.convert.convert import ConvertOptions, convert
from deltafin_mlx.testing.synthetic import make_checkpoint

# Affine fixtures use widths that every group size divides, so mlx-lm quantizes
# exactly the modules Deltafin does.
FIXTURE_OVERRIDES = {
    "kimi_k3": {},
    "kimi_k2": {"moe_intermediate_size": 128},
    "qwen3_moe": {"moe_intermediate_size": 128},
    "mixtral": {"moe_intermediate_size": 128},
}


def make_source(path, arch, **overrides):
    return make_checkpoint(path, arch, seed=0, **{**FIXTURE_OVERRIDES[arch], **overrides})


def reference_model(src, trunk_bits=4, group_size=64, expert_bits=4, expert_group_size=64):
    """What `mlx_lm.convert -q` makes of `src`, loaded fully in memory at float32:
    load lazily, cast to the config dtype, quantize with the model's own predicate
    (and the expert settings for switch_mlp), exactly as mlx_lm.convert does."""
    model, config = load_model(Path(src), lazy=True)
    dtype = config.get("torch_dtype") or config.get("text_config", {}).get("dtype")
    cast = getattr(model, "cast_predicate", lambda _: True)
    dt = getattr(mx, dtype)
    model.update(
        tree_map_with_path(
            lambda k, v: v.astype(dt) if cast(k) and mx.issubdtype(v.dtype, mx.floating) else v,
            model.parameters(),
        )
    )
    own = getattr(model, "quant_predicate", None)

    def predicate(path, module):
        if "switch_mlp" in path:
            return {"group_size": expert_group_size, "bits": expert_bits, "mode": "affine"}
        if trunk_bits is None:
            return False
        return own(path, module) if own else True

    model, _ = quantize_model(
        model, config, group_size, trunk_bits or 4, quant_predicate=predicate
    )
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    return model


@pytest.fixture(autouse=True)
def own_cache_dir(tmp_path_factory, monkeypatch):
    """Every test has its own user cache directory: a hot set saved by one test (or by
    the user's own runs) never warms another test's cache (engine/hot_set.py)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("xdg")))


@pytest.fixture(scope="session")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("sources")
    cache = {}

    def get(arch):
        if arch not in cache:
            cache[arch] = make_source(root / arch, arch)
        return cache[arch]

    return get


@pytest.fixture(scope="session")
def converted(tmp_path_factory, sources):
    root = tmp_path_factory.mktemp("converted")
    cache = {}

    def get(arch):
        if arch not in cache:
            out = root / arch
            convert(str(sources(arch)), out, ConvertOptions(progress=False))
            cache[arch] = out
        return cache[arch]

    return get


@pytest.fixture(scope="session")
def references(sources):
    cache = {}

    def get(arch):
        if arch not in cache:
            cache[arch] = reference_model(sources(arch))
        return cache[arch]

    return get


@pytest.fixture
def copy_of(tmp_path):
    def copy(path):
        dst = tmp_path / Path(path).name
        shutil.copytree(path, dst)
        return dst

    return copy
